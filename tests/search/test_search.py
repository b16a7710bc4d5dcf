"""search_plans: the winner is the fastest candidate that fits, pruning never drops a faster one, forced schedules,
rejection reasons, and the infeasible error's smallest fitting memory."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from helpers.search import make_cluster, synthetic_profile

from pipeplan.costs import numerics
from pipeplan.errors import ConfigError, InfeasibleError
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info
from pipeplan.search.candidate import Evaluation, Rejection
from pipeplan.search.config import PREDICTION_MARGIN, SearchConfig, default_memory_reserve, searched_schedules
from pipeplan.search.evaluate import evaluate
from pipeplan.search.scaling import scale_profile
from pipeplan.search.search import enumerate_layouts, prefer_simple, search_plans
from pipeplan.search.variants import zero_choices
from pipeplan.units import parse_size


def _brute_force(profile, cluster, config) -> list[Evaluation]:
    """Every layout evaluated, no pruning (of the schedules the search considers under `config.allow_async`)."""
    auto = tuple(n for n in SCHEDULE_NAMES if not schedule_info(n).named_only)  # what plan searches unnamed
    names = searched_schedules(auto, allow_async=config.allow_async, named=False)
    layouts = enumerate_layouts(profile.num_layers, cluster, config, names)
    return [e for item in layouts if not isinstance(item, Rejection) for e in _fitting(item, profile, cluster, config)]


def _fitting(layout, profile, cluster, config) -> list[Evaluation]:
    """`layout` evaluated without pruning under each of the search's memory options (ZeRO settings; stages
    recompute only where the layout does not fit without): the evaluations that fit."""
    found = []
    for zero in zero_choices(layout, config):
        for recompute in ("none", "auto") if config.recompute == "auto" else ("none",):
            scaled = scale_profile(profile, layout.microbatch_size)
            limit = cluster.memory_per_device
            result = evaluate(layout, scaled, cluster, config, memory_limit=limit, zero=zero, recompute=recompute)
            if isinstance(result, Evaluation) and result.peak_memory_bytes <= cluster.memory_per_device:
                found.append(result)
                break
    return found


@pytest.mark.parametrize(
    ("cut_bytes", "memory", "fused"),
    [(1_000_000, 2**30, 2.0), (50_000_000, 2**30, 2.0), (1_000_000, 120 * 2**20, 2.0), (50_000_000, 2**30, 1.2)],
    ids=["cheap-comm", "costly-comm", "tight-memory", "cheap-fused-backward"],
)
@pytest.mark.parametrize("allow_async", [False, True])
def test_search_picks_the_fastest_feasible_candidate(cut_bytes, memory, fused, allow_async):
    profile = synthetic_profile(cut_bytes=cut_bytes, heavy_last=2.0, fused_backward=fused)
    cluster = make_cluster(4, memory=memory)
    config = SearchConfig(
        global_batch_size=16,
        microbatch_sizes=(1, 2),
        allow_async=allow_async,
        numerics=numerics("adamw", "bf16-mixed"),
    )
    result = search_plans(profile, cluster, config)
    brute = _brute_force(profile, cluster, config)
    assert result.fastest.step_ms == pytest.approx(min(e.step_ms for e in brute))
    assert result.best.peak_memory_bytes <= memory
    steps = [e.step_ms for e in result.ranked]
    assert steps == sorted(steps)
    assert all(r.reason for r in result.rejected)


def test_pruned_candidates_are_really_slower():
    """Each layout pruned by the balanced estimate or the busiest-device bound, evaluated in full, is no faster than
    the search's fastest plan (the pruning is safe), and its reason says by how much it was expected to lose."""
    profile, cluster = synthetic_profile(cut_bytes=20_000_000), make_cluster(4)
    config = SearchConfig(global_batch_size=32, microbatch_sizes=(1, 2, 4), numerics=numerics("adamw", "bf16-mixed"))
    result = search_plans(profile, cluster, config)
    pruned = [r for r in result.rejected if r.kind in ("bound", "estimate")]
    assert pruned, "expected the estimate or the bound to prune something"
    assert all(re.search(r"(at least|estimated) [0-9.]+% slower", r.reason) for r in pruned)
    evaluated = {id(r): _fitting(r.layout, profile, cluster, config) for r in pruned}
    assert sum(map(len, evaluated.values())) >= len(pruned) // 2, "most pruned layouts should fit when evaluated"
    for r in pruned:
        for evaluation in evaluated[id(r)]:
            assert evaluation.step_ms >= result.fastest.step_ms * (1 - 1e-9), (r.layout, r.reason)


def test_forced_schedule_is_used():
    profile = synthetic_profile()
    result = search_plans(
        profile,
        make_cluster(4),
        SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed")),
        schedules=["zbv"],
    )
    assert {e.layout.schedule for e in result.ranked} == {"zbv"}
    assert result.best.schedule.num_chunks == 2


@pytest.mark.parametrize("depths", [(2,), (1, 4)])
def test_forced_pipeline_depth_is_the_only_one_tried(depths):
    config = SearchConfig(global_batch_size=16, pipeline_depths=depths, numerics=numerics("adamw", "bf16-mixed"))
    result = search_plans(synthetic_profile(), make_cluster(4, memory=2**32), config)
    considered = [e.layout for e in result.ranked] + [r.layout for r in result.rejected]
    assert {layout.pipeline_devices for layout in considered} == set(depths)
    free = search_plans(
        synthetic_profile(),
        make_cluster(4, memory=2**32),
        SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed")),
    )
    assert result.fastest.step_ms >= free.fastest.step_ms  # a restriction of the full search


@pytest.mark.parametrize("depth", [2, 4])
@pytest.mark.parametrize("fused", [2.0, 1.2])
def test_forced_pipeline_depth_search_matches_brute_force(depth, fused):
    """With a forced depth no P=1 data-parallel layout is there to cover for a replicated layout that collapses
    to fewer stages: the estimate used for pruning must still not drop it."""
    profile = synthetic_profile(cut_bytes=5_000_000, fused_backward=fused)
    cluster = make_cluster(4, memory=2**32)
    config = SearchConfig(global_batch_size=16, pipeline_depths=(depth,), numerics=numerics("adamw", "bf16-mixed"))
    result = search_plans(profile, cluster, config)
    assert result.fastest.step_ms == pytest.approx(min(e.step_ms for e in _brute_force(profile, cluster, config)))


def test_forced_pipeline_depth_must_divide_the_devices():
    config = SearchConfig(global_batch_size=12, pipeline_depths=(2, 3), numerics=numerics("adamw", "bf16-mixed"))
    with pytest.raises(ConfigError, match=r"^--parallel pp=3 must divide --devices \(4\)$"):
        search_plans(synthetic_profile(), make_cluster(4), config)


def test_unsupported_shapes_are_recorded():
    # interleaved needs m to be a multiple of p: with b=2, 6 microbatches on 4 devices are refused
    config = SearchConfig(global_batch_size=12, microbatch_sizes=(1, 2), numerics=numerics("adamw", "bf16-mixed"))
    result = search_plans(synthetic_profile(), make_cluster(4), config, schedules=["interleaved"])
    reasons = [r for r in result.rejected if r.layout.num_microbatches % r.layout.pipeline_devices]
    assert reasons and all(r.kind == "schedule" and "interleaved" in r.reason for r in reasons)


def test_no_supported_shape_is_one_line_error():
    with pytest.raises(InfeasibleError, match="no plan is possible on 4 device.*--global-batch-size") as info:
        search_plans(
            synthetic_profile(),
            make_cluster(4),
            SearchConfig(global_batch_size=2, numerics=numerics("adamw", "bf16-mixed")),
            ["interleaved"],
        )
    assert "\n" not in str(info.value)


def test_replication_wins_for_an_unbalanced_model():
    # the last layer is 6x heavier and one device cannot hold the model: replicating the heavy layer's stage
    # (PipeDream) beats every straight 3-stage split
    profile = synthetic_profile(4, heavy_last=6.0, params=1_000_000, activation_bytes=1_000_000, cut_bytes=1000)
    cluster = make_cluster(3, memory=60 * 2**20)
    result = search_plans(
        profile, cluster, SearchConfig(global_batch_size=12, zero=0, numerics=numerics("adamw", "bf16-mixed")), ["1f1b"]
    )  # ZeRO-1: plain DP
    assert result.best.layout.mode == "replicated"
    assert result.best.partition.replicas == (1, 2)
    assert result.best.pipeline.device_ops[1] == tuple(
        op for op in result.best.schedule.op_strings()[1] if int(op[2:]) % 2 == 0
    )
    straight = _brute_force(
        profile,
        cluster,
        SearchConfig(global_batch_size=12, replication=False, zero=0, numerics=numerics("adamw", "bf16-mixed")),
    )
    assert result.fastest.step_ms < min(e.step_ms for e in straight if e.layout.schedule == "1f1b")


def test_infeasible_error_names_the_smallest_memory_that_fits():
    profile = synthetic_profile()
    cluster = make_cluster(2, memory=40 * 2**20)
    config = SearchConfig(global_batch_size=8, microbatch_sizes=(1,), numerics=numerics("adamw", "bf16-mixed"))
    with pytest.raises(InfeasibleError) as info:
        search_plans(profile, cluster, config)
    message = str(info.value)
    assert "\n" not in message and "--memory" in message
    size = re.search(r"smallest that fits is ([0-9.]+ [KMG]iB)", message).group(1).replace(" ", "")
    needed = parse_size(size)
    fits = search_plans(profile, make_cluster(2, memory=int(needed * 1.01)), config)
    assert fits.best.peak_memory_bytes <= needed * 1.01
    with pytest.raises(InfeasibleError):
        search_plans(profile, make_cluster(2, memory=int(needed * 0.97)), config)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 10, "microbatch_sizes": (4,)}, "divisible by --microbatch-size"),
        ({"global_batch_size": 0}, "--global-batch-size"),
        ({"global_batch_size": 8, "pipeline_depths": (0, 2)}, "--parallel pp"),
        ({"global_batch_size": 8, "pipeline_depths": ()}, "--parallel pp"),
    ],
)
def test_search_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SearchConfig(**{"numerics": numerics("adamw", "bf16-mixed"), **kwargs})
    with pytest.raises(ConfigError, match="--optimizer"):
        numerics("lion", "bf16-mixed")  # resolved once, before any config holds it


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="zb-h1"):
        search_plans(
            synthetic_profile(),
            make_cluster(2),
            SearchConfig(global_batch_size=4, numerics=numerics("adamw", "bf16-mixed")),
            ["nope"],
        )


def _fake(step_ms, replicas, microbatches, peak, label, zero=0, recomputing=0):
    return SimpleNamespace(
        step_ms=step_ms,
        peak_memory_bytes=peak,
        partition=SimpleNamespace(replicas=replicas),
        layout=SimpleNamespace(num_microbatches=microbatches, label=label),
        zero=zero,
        recomputing=recomputing,
    )


def test_simpler_layout_preferred_only_within_the_prediction_margin():
    fastest = _fake(100.0, (16, 2, 2, 35), 1024, 78e9, "replicated")
    straight = _fake(100.0 * (1 + PREDICTION_MARGIN) - 1e-9, (1, 1, 1, 1), 128, 60e9, "straight")
    assert prefer_simple((fastest, straight), 80e9) is straight
    slower = _fake(100.0 * (1 + PREDICTION_MARGIN) + 1e-6, (1, 1, 1, 1), 128, 60e9, "straight")
    assert prefer_simple((fastest, slower), 80e9) is fastest
    fewer_counts = _fake(101.0, (2, 2, 2, 2), 1024, 79e9, "uniform")
    assert prefer_simple((fastest, fewer_counts), 80e9) is fewer_counts
    headroom = _fake(101.0, (16, 2, 2, 35), 1024, 70e9, "headroom")
    assert prefer_simple((fastest, headroom), 80e9) is headroom


def test_memory_reserve_is_kept_free_and_reported():
    profile = synthetic_profile()
    cluster = make_cluster(4, memory=2**30)
    plain = search_plans(profile, cluster, SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed")))
    need = plain.best.peak_memory_bytes
    reserve = cluster.memory_per_device - need + 1  # leaves one byte too few for that candidate
    result = search_plans(
        profile,
        cluster,
        SearchConfig(global_batch_size=16, memory_reserve_bytes=reserve, numerics=numerics("adamw", "bf16-mixed")),
    )
    assert all(e.peak_memory_bytes <= cluster.memory_per_device - reserve for e in result.ranked)
    assert need > cluster.memory_per_device - reserve and result.ranked  # others still fit
    assert default_memory_reserve(80 * 10**9) == 4 * 10**9  # 5% of an 80 GB H100
    assert default_memory_reserve(8 * 2**30) == 2**30  # at least 1 GiB
    assert default_memory_reserve(100 * 2**20) == 25 * 2**20  # at most a quarter
    with pytest.raises(ConfigError, match="--memory reserve="):
        search_plans(
            profile,
            cluster,
            SearchConfig(global_batch_size=16, memory_reserve_bytes=2**30, numerics=numerics("adamw", "bf16-mixed")),
        )
