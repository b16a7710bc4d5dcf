"""A CPU profile measures with the threads the run's ranks will use (issue 37: a profile taken with every core and
ranks running one thread each disagree by the thread count): `pipeplan profile` alone at a CPU_DEFAULT_DEVICES-rank
run's share of the cores, `plan MODEL` at its own ranks' share, `plan --profile` warns when the file's threads are
not its ranks' share. The policy is `cluster.cpu_threads_per_rank`, which the run's ranks use too. A machine of 8
cores is pretended (the affinity); what is checked is the threads recorded and the warnings, not timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import pipeplan
from pipeplan.cluster import CPU_DEFAULT_DEVICES, cpu_core_blocks, cpu_threads_per_rank, pin_process
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


def test_cpu_ranks_get_blocks_of_cores_of_their_own(eight_cores):
    """Rank r of N on the machine: the r-th of N equal blocks of the usable cores; none where the ranks outnumber
    the cores or their threads outnumber a block (the OS places them)."""
    assert cpu_core_blocks(2, 4) == [frozenset(range(4)), frozenset(range(4, 8))]
    assert cpu_core_blocks(3, 1) == [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5})]
    assert cpu_core_blocks(8, 1) == [frozenset({core}) for core in range(8)]
    assert cpu_core_blocks(2, 5) is None and cpu_core_blocks(9, 1) is None


def _affinity_of_a_rank(local_rank: int, local_world_size: int, threads: int) -> set[int]:
    """The cores a rank's process runs on once the worker pinned it (a process of its own: pinning is for good)."""
    code = (
        "import os; from pipeplan.runtime.launch.worker import _pin_local_rank; "
        f"_pin_local_rank({threads}); print(sorted(os.sched_getaffinity(0)))"
    )
    env = {**os.environ, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the OS sets no affinity")
@pytest.mark.slow  # a process importing torch per rank
def test_a_cpu_rank_is_pinned_to_its_block():
    machine = set(os.sched_getaffinity(0))
    blocks = cpu_core_blocks(2, 1)
    for rank in (0, 1):
        assert _affinity_of_a_rank(rank, 2, 1) == (set(blocks[rank]) if blocks else machine)
    assert _affinity_of_a_rank(0, 2, len(machine) + 1) == machine  # threads that fit no block: left to the OS


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
