"""partition(): configuration, memory, placement, two-level topology, baselines and the result's JSON form."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pipeplan.costs import LayerArrays
from pipeplan.errors import ConfigError, InfeasibleError, ScheduleError
from pipeplan.partition import (
    Cluster,
    PartitionConfig,
    parameter_balanced_partition,
    partition,
    uniform_partition,
)
from pipeplan.partition.partitioner import min_memory_per_device
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance
from pipeplan.schedules.memory import held_per_stage
from pipeplan.schedules.registry import generate
from pipeplan.schedules.simulate import MemoryCosts, peak_activation_per_device

GIB = 2**30


def make_profile(times, *, params=1_000_000, act=10_000_000, cut=1_000_000, freed=0) -> Profile:
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward_ms=t,
            input_grad_ms=t,
            weight_grad_ms=t,
            backward_ms=2 * t,
            activation_bytes=act,
            activation_freed_by_input_grad_bytes=freed,
            param_count=params,
            param_bytes=2 * params,
        )
        for i, t in enumerate(times)
    )
    return Profile(layers=layers, cut_bytes=(cut,) * (len(times) - 1), provenance=Provenance(source="analytic"))


def test_optimizer_presets_and_override():
    # torch.autocast keeps fp32 parameters (the master copy): 4 + 4 + 8 under bf16-mixed as under fp32
    assert (
        PartitionConfig(num_microbatches=1, optimizer="adamw-bf16", precision="bf16-mixed").optimizer_bytes_per_param
        == 16
    )
    assert PartitionConfig(num_microbatches=1, optimizer="adamw", precision="bf16").optimizer_bytes_per_param == 8
    assert PartitionConfig(num_microbatches=1, optimizer="sgd", precision="fp32").optimizer_bytes_per_param == 12
    assert PartitionConfig(num_microbatches=1, optimizer=6.5, precision="bf16-mixed").optimizer_bytes_per_param == 6.5
    with pytest.raises(ConfigError, match="optimizer"):
        PartitionConfig(num_microbatches=1, optimizer="lion", precision="bf16-mixed")
    with pytest.raises(ConfigError, match="optimizer"):
        PartitionConfig(num_microbatches=1, optimizer=-1.0, precision="bf16-mixed")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_microbatches": 0}, "--microbatches"),
        ({"num_microbatches": 4, "schedule": "chimera"}, "--schedule"),
        ({"num_microbatches": 4, "mode": "tensor"}, "mode"),
        ({"num_microbatches": 4, "schedule": "zbv", "mode": "replicated"}, "straight"),
        ({"num_microbatches": 4, "cost_model": "alpa"}, "cost_model"),
        ({"num_microbatches": 4, "schedule": "interleaved", "cost_model": "pipedream"}, "pipeplan"),
        ({"num_microbatches": 4, "schedule": "zbv", "num_stages": 3}, "multiple of --chunks"),
        ({"num_microbatches": 4, "num_stages": 0}, "num_stages"),
    ],
)
def test_config_errors_name_the_option(kwargs, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        PartitionConfig(**{"precision": "bf16-mixed", **kwargs})


def test_chunked_schedules_default_to_straight():
    assert PartitionConfig(num_microbatches=4, schedule="dualpipev", precision="bf16-mixed").mode == "straight"
    assert PartitionConfig(num_microbatches=4, schedule="interleaved", chunks=3, precision="bf16-mixed").chunks == 3
    assert PartitionConfig(num_microbatches=4, precision="bf16-mixed").mode == "replicated"


def test_balanced_layers_give_balanced_stages():
    profile = make_profile([1.0] * 8, params=0, cut=0)
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    result = partition(profile, cluster, PartitionConfig(num_microbatches=8, mode="straight", precision="bf16-mixed"))
    assert result.stage_ranges == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert result.objective_ms == pytest.approx(6.0)  # 2 layers x (F 1 + B 2)
    assert [s.devices for s in result.stages] == [(0,), (1,), (2,), (3,)]


def test_memory_uses_schedule_inflight_counts_per_position():
    profile = make_profile([1.0] * 4, params=0)
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    result = partition(
        profile, cluster, PartitionConfig(num_microbatches=8, mode="straight", num_stages=4, precision="bf16-mixed")
    )
    assert [s.inflight_microbatches for s in result.stages] == [4, 3, 2, 1]  # 1f1b: p - s in flight
    assert [s.memory_bytes for s in result.stages] == [4e7, 3e7, 2e7, 1e7]


def test_screen_counts_what_input_grad_frees():
    """zb-h1 at p=4, m=8: stage 0 holds 4 in flight, at most 4 of them before I (zb-h1 runs I before W,
    so the count before I is also bounded by 1F1B's p - s); freeing half at I cuts the post-I share."""
    profile = make_profile([1.0] * 4, params=0, freed=5_000_000)
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    config = PartitionConfig(
        num_microbatches=8, schedule="zb-h1", mode="straight", num_stages=4, precision="bf16-mixed"
    )
    result = partition(profile, cluster, config)
    schedule = generate("zb-h1", num_devices=4, num_microbatches=8)
    expect = held_per_stage(schedule)
    assert [(s.inflight_microbatches, s.inflight_before_input_grad) for s in result.stages] == list(expect)
    for s, (total, before) in zip(result.stages, expect):
        assert s.memory_bytes == total * 5_000_000 + before * 5_000_000
    # the screen bounds the simulator's exact byte peak from above
    exact = peak_activation_per_device(schedule, MemoryCosts(activation_bytes=1e7, input_grad_freed_bytes=5e6))
    assert all(s.memory_bytes >= peak for s, peak in zip(result.stages, exact))


def test_tight_memory_changes_the_split_and_error_gives_the_memory_that_fits():
    profile = make_profile([1.0, 1.0, 1.0, 1.0, 4.0, 4.0], params=0, act=10_000_000)
    cluster = Cluster(num_devices=3, devices_per_node=3, memory_per_device=GIB)
    config = PartitionConfig(num_microbatches=8, mode="straight", precision="bf16-mixed")
    loose = partition(profile, cluster, config)
    # stage 0 of 1f1b keeps 3 microbatches: a memory cap forces it to hold few layers
    tight_cluster = dataclasses.replace(cluster, memory_per_device=45_000_000)
    tight = partition(profile, tight_cluster, config)
    assert all(s.memory_bytes <= 45_000_000 for s in tight.stages)
    assert tight.objective_ms >= loose.objective_ms
    too_small = dataclasses.replace(cluster, memory_per_device=15_000_000)
    with pytest.raises(InfeasibleError, match="--memory-per-device") as info:
        partition(profile, too_small, config)
    assert "\n" not in str(info.value)
    need = min_memory_per_device(LayerArrays.from_profile(profile), too_small, config)
    partition(profile, dataclasses.replace(cluster, memory_per_device=need), config)  # fits
    with pytest.raises(InfeasibleError):
        partition(profile, dataclasses.replace(cluster, memory_per_device=int(need * 0.98)), config)


def test_replication_divides_compute_and_inflight():
    profile = make_profile([10.0, 1.0], params=1000, act=1000, cut=0)
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB, intra_node_bandwidth=1e12)
    result = partition(profile, cluster, PartitionConfig(num_microbatches=8, precision="bf16-mixed"))
    assert result.replicas[0] >= 3  # the heavy first layer is replicated
    first = result.stages[0]
    work = first.forward_ms + first.backward_ms
    assert first.time_ms == pytest.approx(work / first.replicas + first.allreduce_ms / 8)
    in_flight = held_per_stage(generate("1f1b", num_devices=result.num_stages, num_microbatches=8))[0][0]
    assert first.inflight_microbatches == -(-in_flight // first.replicas)


def test_two_level_keeps_subpipelines_inside_nodes():
    profile = make_profile([1.0 + (i % 3) for i in range(24)], params=10_000_000, cut=50_000_000)
    cluster = Cluster(
        num_devices=8,
        devices_per_node=4,
        memory_per_device=64 * GIB,
        inter_node_bandwidth=1e8,
        intra_node_bandwidth=1e11,
    )
    result = partition(profile, cluster, PartitionConfig(num_microbatches=16, precision="bf16-mixed"))
    devices = [d for s in result.stages for d in s.devices]
    assert len(devices) == len(set(devices)) == result.num_devices <= 8
    for s in result.stages:  # a stage's replicas: the same local slots in each node its block spans
        nodes = sorted({d // 4 for d in s.devices})
        assert len(s.devices) == len(nodes) * len({d % 4 for d in s.devices})
    assert result.objective_ms == pytest.approx(max(s.time_ms for s in result.stages))
    straight = partition(
        profile, cluster, PartitionConfig(num_microbatches=16, mode="straight", precision="bf16-mixed")
    )
    assert result.objective_ms <= straight.objective_ms * 1.0001 or result.num_devices <= 8


def test_two_level_groups_many_layers():
    profile = make_profile([1.0] * 300, params=1000, cut=1000)
    cluster = Cluster(num_devices=16, devices_per_node=4, memory_per_device=64 * GIB)
    result = partition(
        profile, cluster, PartitionConfig(num_microbatches=16, max_layer_groups=40, precision="bf16-mixed")
    )
    assert result.layer_groups <= 40 and result.stages[-1].last_layer == 299


@pytest.mark.parametrize(("schedule", "expected"), [("interleaved", [0, 1, 2, 0, 1, 2]), ("zbv", [0, 1, 2, 2, 1, 0])])
def test_chunk_placement(schedule, expected):
    profile = make_profile([1.0] * 6, params=0, cut=0)
    cluster = Cluster(num_devices=3, devices_per_node=3, memory_per_device=GIB)
    result = partition(profile, cluster, PartitionConfig(num_microbatches=6, schedule=schedule, precision="bf16-mixed"))
    assert [s.devices[0] for s in result.stages] == expected
    assert result.device_load_ms == pytest.approx((6.0, 6.0, 6.0))


def test_unsupported_schedule_shape_raises_schedule_error():
    profile = make_profile([1.0] * 8)
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    with pytest.raises(ScheduleError):
        partition(
            profile,
            cluster,
            PartitionConfig(num_microbatches=3, schedule="interleaved", num_stages=8, precision="bf16-mixed"),
        )


def test_too_many_stages_is_a_config_error():
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    with pytest.raises(ConfigError, match="num_stages"):
        partition(
            make_profile([1.0] * 3), cluster, PartitionConfig(num_microbatches=4, num_stages=4, precision="bf16-mixed")
        )


def test_baselines_are_never_better_than_the_dp():
    profile = make_profile([1.0, 5.0, 1.0, 1.0, 7.0, 1.0, 2.0, 2.0], params=0)
    profile = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(la, param_count=(i + 1) * 10) for i, la in enumerate(profile.layers))
    )
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    config = PartitionConfig(num_microbatches=8, mode="straight", num_stages=4, precision="bf16-mixed")
    best = partition(profile, cluster, config)
    uniform = uniform_partition(profile, cluster, config)
    balanced = parameter_balanced_partition(profile, cluster, config)
    assert uniform.stage_ranges == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert (
        max(s.param_count for s in balanced.stages) == 110
    )  # min-max of counts 10..80 in 4 runs: 10-40 | 50 60 | 70 | 80
    assert best.objective_ms <= min(uniform.objective_ms, balanced.objective_ms)


def test_to_dict_is_json_and_deterministic():
    profile = make_profile([1.0, 2.0, 3.0, 1.0, 1.0])
    cluster = Cluster(num_devices=4, devices_per_node=2, memory_per_device=GIB)
    config = PartitionConfig(num_microbatches=4, precision="bf16-mixed")
    first = json.loads(json.dumps(partition(profile, cluster, config).to_dict()))
    assert first["schema_version"] == 1 and first["num_stages"] == len(first["stages"])
    assert first["stages"][0]["first_layer"] == 0 and first["cost_model"] == "pipeplan"
    assert json.loads(json.dumps(partition(profile, cluster, config).to_dict())) == first


@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_chunked_plans_fit_device_memory_when_it_binds(schedule):
    profile = make_profile([1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 1.0, 1.0], params=0, act=10_000_000, cut=0)
    roomy = Cluster(num_devices=2, devices_per_node=2, memory_per_device=GIB)
    config = PartitionConfig(num_microbatches=4, schedule=schedule, precision="bf16-mixed")
    loose = partition(profile, roomy, config)
    limit = int(max(loose.device_memory_bytes) * 0.8)
    tight = partition(profile, dataclasses.replace(roomy, memory_per_device=limit), config)  # fits: costs more time
    assert max(tight.device_memory_bytes) <= limit
    assert tight.objective_ms >= loose.objective_ms


def test_two_level_plans_fit_memory_when_it_binds():
    profile = make_profile([1.0] * 12, params=100_000, act=10_000_000, cut=1000)
    roomy = Cluster(num_devices=8, devices_per_node=4, memory_per_device=GIB, inter_node_bandwidth=1e8)
    config = PartitionConfig(num_microbatches=8, precision="bf16-mixed")
    loose = partition(profile, roomy, config)
    for fraction in (0.9, 0.7):
        limit = int(max(s.memory_bytes for s in loose.stages) * fraction)
        cluster = dataclasses.replace(roomy, memory_per_device=limit)
        try:
            tight = partition(profile, cluster, config)
        except InfeasibleError:  # the suggested memory must then work
            need = min_memory_per_device(LayerArrays.from_profile(profile), cluster, config)
            assert need > limit
            cluster = dataclasses.replace(roomy, memory_per_device=need)
            limit, tight = need, partition(profile, cluster, config)
        assert max(s.memory_bytes for s in tight.stages) <= limit


def test_exact_minimum_memory_for_replicated_one_node_search():
    profile = make_profile([1.0, 2.0, 1.0, 3.0, 1.0], params=50_000, act=3_000_000)
    cluster = Cluster(num_devices=4, devices_per_node=4, memory_per_device=GIB)
    config = PartitionConfig(num_microbatches=6, precision="bf16-mixed")
    need = min_memory_per_device(LayerArrays.from_profile(profile), cluster, config)
    fitted = partition(profile, dataclasses.replace(cluster, memory_per_device=need), config)
    assert max(s.memory_bytes for s in fitted.stages) <= need
    with pytest.raises(InfeasibleError, match=re.escape("--memory-per-device")):
        partition(profile, dataclasses.replace(cluster, memory_per_device=need - 1), config)
