"""Capacity's memory figures with the search's memory options: the layout screen's floor stays a lower bound when
stages may recompute and optimizer state may be sharded, and the busiest device's split counts ZeRO-1's 1/d of the
optimizer state."""

from __future__ import annotations

import pytest
from helpers.search import make_cluster, synthetic_profile

from pipeplan.capacity.memory import device_memory_split, memory_floor_bytes
from pipeplan.costs import numerics
from pipeplan.search.candidate import Rejection, min_memory_bytes
from pipeplan.search.config import SearchConfig
from pipeplan.search.search import enumerate_layouts, search_plans
from pipeplan.search.variants import zero_choices


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_floor_is_a_lower_bound_with_recomputation_and_zero(schedule):
    profile = synthetic_profile(8, activation_bytes=40_000_000, params=1_000_000)
    config = SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed"))
    cluster = make_cluster(8, memory=2**34)
    layouts = [x for x in enumerate_layouts(8, cluster, config, (schedule,)) if not isinstance(x, Rejection)]
    assert layouts
    for layout in layouts:
        zero = max(zero_choices(layout, config))
        floor = memory_floor_bytes(layout, profile, config.least_per_param(layout.data_parallel), recompute=True)
        need = min_memory_bytes(layout, profile, cluster, config, zero=zero, recompute="auto")
        plain = min_memory_bytes(layout, profile, cluster, config)
        assert need is not None and plain is not None and floor <= need * (1 + 1e-3) and need <= plain * (1 + 1e-3)


def test_memory_split_counts_sharded_optimizer_state():
    profile = synthetic_profile(4, params=1_000_000, activation_bytes=1_000_000)
    config = SearchConfig(
        global_batch_size=16, pipeline_depths=(1,), numerics=numerics("adamw", "bf16-mixed")
    )  # plain data parallelism
    result = search_plans(profile, make_cluster(4, memory=48 * 2**20), config)
    best = result.best
    assert best.zero == 1 and best.layout.data_parallel == 4
    split = device_memory_split(best, result.profiles[1], result.config.split)
    assert split.weights == split.gradients == 4 * 4_000_000  # fp32 master weights and gradients, whole
    assert split.optimizer == 8 * 4_000_000 // 4  # Adam's moments, a quarter on each of the 4 devices
    assert split.total == best.peak_memory_bytes
