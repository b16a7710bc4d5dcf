"""A CPU profile measures with the threads the run's ranks will use (issue 37: a profile taken with every core and
ranks running one thread each disagree by the thread count): `pipeplan profile` alone at a CPU_DEFAULT_DEVICES-rank
run's share of the cores, `plan MODEL` at its own ranks' share, `plan --profile` warns when the file's threads are
not its ranks' share. The policy is `cluster.cpu_threads_per_rank`, which the run's ranks use too; and each CPU
rank is pinned to a block of cores of its own (`cluster.cpu_core_blocks`). A machine of 8 cores is pretended (the
affinity) where the rule is checked; what is checked is the threads and cores recorded and the warnings, not
timings."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from helpers.runtime import make_plan

import pipeplan
from pipeplan.cluster import CPU_DEFAULT_DEVICES, cpu_core_blocks, cpu_threads_per_rank, pin_process
from pipeplan.runtime.launch import worker
from pipeplan.runtime.launch.local import launch_local
from pipeplan.runtime.train.config import RunConfig

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


def test_cpu_ranks_get_blocks_of_cores_of_their_own(eight_cores):
    """Rank r of N on the machine: the r-th of N equal blocks of the usable cores; none where the ranks outnumber
    the cores or their threads outnumber a block (the OS places them)."""
    assert cpu_core_blocks(2, 4) == [frozenset(range(4)), frozenset(range(4, 8))]
    assert cpu_core_blocks(3, 1) == [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5})]
    assert cpu_core_blocks(8, 1) == [frozenset({core}) for core in range(8)]
    assert cpu_core_blocks(2, 5) is None and cpu_core_blocks(9, 1) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the OS sets no affinity")
@pytest.mark.slow  # two ranks
@pytest.mark.timeout(300)
def test_a_runs_cpu_ranks_are_pinned_to_their_blocks_and_its_trace_keeps_the_steps_asked(tmp_path):
    path, _ = make_plan(tmp_path, "mlp", "mlp", TINY, schedule="1f1b", pipeline_devices=2)
    trace = tmp_path / "measured.json"
    config = RunConfig(steps=3, trace_path=str(trace), trace_steps=2, quiet=True, heartbeat_timeout_s=30.0)
    results = launch_local(path, config, threads=1)
    for rank in json.loads(trace.read_text())["pipeplan_measured"]["ranks"]:  # --trace-steps 2: the last two
        assert [step["step"] for step in rank["steps"]] == [1, 2]
    blocks = cpu_core_blocks(2, 1)
    machine = tuple(sorted(os.sched_getaffinity(0)))
    expected = [tuple(sorted(block)) for block in blocks] if blocks else [machine, machine]  # 1 core: the OS's
    assert [result.cores for result in results] == expected
    assert tuple(sorted(os.sched_getaffinity(0))) == machine  # the launching process is left as it was


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the OS sets no affinity")
def test_pinning_covers_every_thread_and_gives_the_cores_back():
    machine = frozenset(os.sched_getaffinity(0))
    started = threading.Event()
    seen: list[set[int]] = []

    def thread() -> None:  # a thread that existed before the pin (as torch's pool may)
        started.wait()
        seen.append(set(os.sched_getaffinity(0)))

    other = threading.Thread(target=thread)
    other.start()
    one = frozenset({min(machine)})
    before = pin_process(one)
    try:
        started.set()
        other.join()
        assert before == machine and seen == [set(one)] and os.sched_getaffinity(0) == one
    finally:
        pin_process(before)
    assert os.sched_getaffinity(0) == machine
