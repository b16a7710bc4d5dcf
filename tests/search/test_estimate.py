"""The search's pruning figures: the contiguous-split bound is the optimum from below; the partition bound never
exceeds the simulated step."""

from __future__ import annotations

import itertools

import pytest
from helpers.search import make_cluster, synthetic_profile
from hypothesis import given
from hypothesis import strategies as st

from pipeplan.costs import numerics
from pipeplan.costs.overlap import Overlap
from pipeplan.search.candidate import Evaluation, Layout
from pipeplan.search.config import SearchConfig
from pipeplan.search.estimate import min_largest_stage, partition_lower_bound_ms, probe_microbatches
from pipeplan.search.evaluate import evaluate


def _best_split(work: list[float], stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(work)), stages - 1):
        bounds = (0, *cuts, len(work))
        best = min(best, max(sum(work[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@given(st.lists(st.floats(0.1, 10.0), min_size=2, max_size=8), st.integers(1, 4))
def test_min_largest_stage_is_the_optimum_from_below(work, stages):
    stages = min(stages, len(work))
    optimum = _best_split(work, stages)
    bound = min_largest_stage(work, stages)
    assert bound <= optimum + 1e-9
    assert bound >= optimum * (1 - 1e-6) - 1e-9


def test_probe_keeps_the_residue():
    assert probe_microbatches(4, 8) == 8
    assert probe_microbatches(4, 30) == 8 + 30 % 4
    assert probe_microbatches(8, 512) == 16


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "zbv", "interleaved"])
def test_partition_bound_is_below_the_simulated_step(schedule):
    profile = synthetic_profile(heavy_last=3.0, cut_bytes=10_000_000)
    cluster = make_cluster(4)
    layout = Layout(schedule=schedule, microbatch_size=1, data_parallel=2, pipeline_devices=2, num_microbatches=8)
    config = SearchConfig(global_batch_size=16, numerics=numerics("adamw-bf16", "bf16-mixed"), post_validate="off")
    result = evaluate(layout, profile, cluster, config, memory_limit=cluster.memory_per_device)
    assert isinstance(result, Evaluation)
    for overlap in (Overlap(), Overlap(grad_reduce=True)):  # an overlapped reduction may hide: the bound drops it
        config = SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed"), overlap=overlap)
        assert partition_lower_bound_ms(layout, result.partition, profile, cluster, config) <= result.step_ms + 1e-9
