"""The search over t x p x d: search_plans with a tensor-parallel size runs the pipeline search on one rank's profile
and the cluster of t-device groups, plans record t and `run` refuses them; the outer loop (planner.tensor_search)
picks the sizes, chooses between them and says why."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from helpers.search import make_cluster, stack_profile

from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.cluster import DeviceGroups
from pipeplan.costs import numerics
from pipeplan.errors import ConfigError, InfeasibleError, RunError
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.scaling import scale_profile
from pipeplan.search.search import search_plans
from pipeplan.search.sharding import Links, group_links, split_profile
from pipeplan.search.tensor_search import (
    TensorParallelTry,
    chosen_try,
    parse_tensor_parallel,
    search_tensor_parallel,
    tensor_parallel_reason,
    tensor_parallel_sizes,
)

MB = 10**6
# t = 1 does not fit: 1F1B over 2 devices holds 2 microbatches of 2 blocks (720 MB with the static bytes); t = 2
# holds one microbatch of half of every block on each device of the group (520 MB)
BIG = dict(param_count=10_000_000, param_bytes=40_000_000, activation_bytes=100 * MB)


def _config(**fields) -> SearchConfig:
    """Tensor parallelism alone: no recomputation, no ZeRO (capacity's tests combine them)."""
    return SearchConfig(
        **{
            "numerics": numerics("adamw", "bf16-mixed"),
            "global_batch_size": 4,
            "replication": False,
            "recompute": "none",
            "zero": 0,
            **fields,
        }
    )


def test_search_with_t_runs_on_one_rank_and_the_groups():
    profile, cluster = stack_profile(), make_cluster(8, memory=2**30)
    result = search_plans(profile, cluster, _config(tensor_parallel=2), ["1f1b"])
    assert all(e.layout.tensor_parallel == 2 and e.layout.label.endswith(" t=2") for e in result.ranked)
    assert result.cluster == cluster and result.group_cluster == DeviceGroups(tensor_parallel=2).of(cluster)
    same = search_plans(
        split_profile(profile, 2, 1, Links(tensor=cluster.intra_link, context=cluster.intra_link)),
        DeviceGroups(tensor_parallel=2).of(cluster),
        _config(),
        ["1f1b"],
    )
    assert [e.step_ms for e in result.ranked] == [e.step_ms for e in same.ranked]
    assert [e.peak_memory_bytes for e in result.ranked] == [e.peak_memory_bytes for e in same.ranked]


def test_a_tensor_parallel_plan_records_t_and_run_refuses_it():
    cluster = make_cluster(8, memory=2**30, devices_per_node=4)
    result = search_plans(stack_profile(), cluster, _config(tensor_parallel=2), ["1f1b"])
    plan = build_plan(result, model=ModelRef(ref="stack"))
    assert plan.training.tensor_parallel == 2 and plan.cluster == cluster
    assert plan.world_size * 2 == result.best.layout.pipeline_devices * result.best.layout.data_parallel * 2
    assert [info.node for info in plan.ranks] == [2 * info.rank // 4 for info in plan.ranks]
    assert Plan.from_dict(plan.to_dict()) == plan
    assert not plan.runnable
    with pytest.raises(RunError, match=r"tensor parallelism \(t=2\).*--parallel tp=1"):
        plan.require_runnable()


def test_t_that_the_cluster_cannot_take_is_refused_by_the_search():
    with pytest.raises(ConfigError, match="--parallel tp=4: t=4 must divide the 3 devices per node"):
        search_plans(stack_profile(), make_cluster(12, devices_per_node=3), _config(tensor_parallel=4))


def test_a_given_t_may_fill_whole_nodes_and_then_talks_over_the_network():
    """Asked for, tensor parallelism spans whole nodes; auto keeps it inside one."""
    profile, cluster = stack_profile(), make_cluster(4, devices_per_node=2)
    result = search_plans(profile, cluster, _config(tensor_parallel=4))
    assert result.group_cluster.num_devices == 1 and result.cluster == cluster
    assert group_links(cluster, 4, 1).tensor == cluster.inter_link != cluster.intra_link
    assert 4 not in [item.tensor_parallel for item in tensor_parallel_sizes("auto", profile, cluster)]


def test_tensor_parallelism_fits_where_the_pipeline_alone_does_not():
    profile, cluster = stack_profile(block=BIG), make_cluster(2, memory=600 * MB)
    config = _config(global_batch_size=2)
    with pytest.raises(InfeasibleError, match="memory is the binding constraint"):
        search_plans(profile, cluster, config, ["1f1b"])
    tries = search_tensor_parallel(profile, cluster, config, tensor_parallel_sizes("auto", profile, cluster), ["1f1b"])
    assert [item.tensor_parallel for item in tries] == [1, 2]
    assert chosen_try(tries).tensor_parallel == 2
    why = tensor_parallel_reason(tries, lambda r: f"{r.best.samples_per_s:.1f} samples/s")
    assert why.startswith("t=2: ") and why.endswith("t=1: no plan fits in memory")


def test_when_no_size_fits_the_largest_one_s_reason_is_raised():
    profile, cluster = stack_profile(block=BIG), make_cluster(2, memory=300 * MB)
    sizes = tensor_parallel_sizes("auto", profile, cluster)
    with pytest.raises(InfeasibleError, match="on 2 device\\(s\\) with tensor parallelism t=2"):
        search_tensor_parallel(profile, cluster, _config(global_batch_size=2), sizes, ["1f1b"])


def test_auto_sizes_divide_the_node_and_the_model_and_measured_profiles_plan_one():
    cluster = make_cluster(16, devices_per_node=8)
    assert [i.tensor_parallel for i in tensor_parallel_sizes("auto", stack_profile(), cluster)] == [1, 2, 4, 8]
    sizes = tensor_parallel_sizes("auto", stack_profile(options={"heads": 6}), cluster)
    assert [(i.tensor_parallel, bool(i.reason)) for i in sizes] == [(1, False), (2, False), (4, True), (8, True)]
    assert "6 attention heads" in sizes[2].reason
    measured = stack_profile()
    measured = replace(measured, provenance=replace(measured.provenance, source="measured"))
    assert [i.tensor_parallel for i in tensor_parallel_sizes("auto", measured, cluster)] == [1]
    with pytest.raises(ConfigError, match="--parallel tp=2 plans analytically"):
        tensor_parallel_sizes(2, measured, cluster)
    with pytest.raises(ConfigError, match="--parallel tp=3"):
        tensor_parallel_sizes(3, stack_profile(), cluster)
    assert [i.tensor_parallel for i in tensor_parallel_sizes(4, stack_profile(), cluster)] == [4]


@pytest.mark.parametrize(("text", "expected"), [(None, "auto"), ("auto", "auto"), ("AUTO", "auto"), ("8", 8)])
def test_parse_tensor_parallel(text, expected):
    assert parse_tensor_parallel(text) == expected


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_parse_tensor_parallel_refuses(text):
    with pytest.raises(ConfigError, match="--parallel tp"):
        parse_tensor_parallel(text)


def _try(t: int, step_ms: float | None) -> TensorParallelTry:
    if step_ms is None:
        return TensorParallelTry(tensor_parallel=t, reason="no plan fits ... memory ...", searched=True)
    result = SimpleNamespace(best=SimpleNamespace(step_ms=step_ms))
    return TensorParallelTry(tensor_parallel=t, result=result, searched=True)


def test_the_smallest_t_within_the_prediction_margin_wins_and_the_reason_says_so():
    tries = (_try(1, None), _try(2, 101.0), _try(4, 100.0), _try(8, 120.0))
    assert chosen_try(tries).tensor_parallel == 2
    why = tensor_parallel_reason(tries, lambda r: f"{r.best.step_ms:.0f} ms")
    assert why == (
        "t=2: 101 ms vs 100 ms at t=4 (within the prediction margin: the smaller group is preferred), 120 ms at t=8; "
        "t=1: no plan fits in memory"
    )
    heads = "must divide the model's 25 attention heads (heads)"
    odd = (_try(1, 5.0), *(TensorParallelTry(tensor_parallel=t, reason=f"t={t} {heads}") for t in (2, 4, 8)))
    assert tensor_parallel_reason(odd, lambda r: "fast") == f"t=1: fast; t=2, t=4, t=8: {heads}"
    clear = (_try(2, 110.0), _try(4, 100.0))
    assert tensor_parallel_reason(clear, lambda r: f"{r.best.step_ms:.0f} ms") == "t=4: 100 ms vs 110 ms at t=2"
    assert tensor_parallel_reason((_try(1, 5.0),), lambda r: "") == ""


def test_profiles_are_sharded_after_scaling_to_the_microbatch():
    """The collectives' latency is paid once per message: sharding the scaled profile, not scaling the sharded."""
    profile, cluster = stack_profile(hidden_bytes=1 << 20), make_cluster(4, memory=2**30)
    result = search_plans(profile, cluster, _config(microbatch_sizes=(1, 2), tensor_parallel=2), ["1f1b"])
    link = cluster.intra_link
    assert result.profiles[2] == split_profile(scale_profile(profile, 2), 2, 1, Links(tensor=link, context=link))
    scaled_after = scale_profile(split_profile(profile, 2, 1, Links(tensor=link, context=link)), 2)
    assert result.profiles[2].layers[1].forward_ms < scaled_after.layers[1].forward_ms
