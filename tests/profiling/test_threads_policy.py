"""A CPU profile measures with the threads the run's ranks will use (issue 37: a profile taken with every core and
ranks running one thread each disagree by the thread count): `pipeplan profile` alone at a CPU_DEFAULT_DEVICES-rank
run's share of the cores, `plan MODEL` at its own ranks' share, `plan --profile` warns when the file's threads are
not its ranks' share. The policy is `cluster.cpu_threads_per_rank`, which the run's ranks use too. A machine of 8
cores is pretended (the affinity); what is checked is the threads recorded and the warnings, not timings."""

from __future__ import annotations

import json
import os

import pytest
import torch

import pipeplan
from pipeplan.cluster import CPU_DEFAULT_DEVICES, cpu_threads_per_rank
from pipeplan.runtime.launch import worker

TINY = {"layers": 2, "hidden": 8}


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


def test_ranks_and_profiles_share_one_rule(eight_cores, monkeypatch):
    assert [cpu_threads_per_rank(r) for r in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert worker.default_cpu_threads() == cpu_threads_per_rank(4) == 2


def test_profile_measures_at_a_default_runs_share_and_gives_the_threads_back(eight_cores, tmp_path):
    before = torch.get_num_threads()
    profile = pipeplan.profile("mlp", assignments=TINY, repeats=3)
    assert profile.provenance.threads == cpu_threads_per_rank(CPU_DEFAULT_DEVICES) == 4
    assert torch.get_num_threads() == before  # the caller's own setting is left as it was
    given = pipeplan.profile("mlp", assignments=TINY, repeats=3, threads=3)
    assert given.provenance.threads == 3


def test_plan_profiles_at_its_own_ranks_share(eight_cores, tmp_path):
    pipeplan.plan("mlp", assignments=TINY, devices=4, global_batch_size=8, output=tmp_path / "plan")
    recorded = json.loads((tmp_path / "plan" / "profile.json").read_text())["provenance"]["threads"]
    assert recorded == cpu_threads_per_rank(4) == 2


def test_plan_from_a_file_of_other_threads_warns_once(eight_cores, console_warnings):
    at_two = pipeplan.profile("mlp", assignments=TINY, repeats=3, threads=2)
    console_warnings()
    pipeplan.plan(profile=at_two, devices=4, global_batch_size=8)  # 4 ranks of 8 cores: 2 each
    assert not [w for w in console_warnings() if "CPU thread" in w]
    pipeplan.plan(profile=at_two, devices=2, global_batch_size=8)  # 2 ranks: 4 each
    (line,) = [w for w in console_warnings() if "CPU thread" in w]
    assert "measured with 2 CPU thread(s)" in line and "will run with 4" in line and "--threads 4" in line
