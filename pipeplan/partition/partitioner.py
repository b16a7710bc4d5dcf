"""`partition(profile, cluster, config)`: choose stage cuts, replicas and devices; explain infeasibility."""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeplan.cluster import Cluster
from pipeplan.costs import (
    LayerArrays,
    device_totals,
    stage_memory_bytes,
    stage_op_ms,
    stages_per_device,
    static_bytes,
)
from pipeplan.errors import ConfigError, InfeasibleError
from pipeplan.partition import single
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.level import Level
from pipeplan.partition.result import Partition, StageAssignment
from pipeplan.profiling.profile import Profile
from pipeplan.units import format_bytes


def partition(profile: Profile, cluster: Cluster, config: PartitionConfig, *, explain: bool = True) -> Partition:
    """The partition with the smallest bottleneck stage time that fits in memory (see `costs` for the model).

    Raises InfeasibleError naming the memory per device that would fit when none does (`explain`; that takes a
    binary search over the memory, so callers that will try again with other options may skip it)."""
    arrays = LayerArrays.from_profile(profile)
    _check_sizes(arrays, cluster, config)
    raw = _solve(arrays, cluster, config, config.memory_limit(cluster))
    if raw is None:
        if not explain:
            raise InfeasibleError(_no_fit(cluster, config))
        raise _infeasible(arrays, cluster, config)
    objective, stages, layer_groups = raw
    return build_partition(arrays, cluster, config, stages, objective=objective, layer_groups=layer_groups)


def _check_sizes(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig) -> None:
    n = arrays.num_items
    if config.num_stages is not None and config.num_stages > n:
        raise ConfigError(f"num_stages ({config.num_stages}) exceeds the profile's {n} layers; lower num_stages")
    if config.num_stages is not None and config.num_stages > cluster.num_devices * config.num_chunks:
        raise ConfigError(
            f"num_stages ({config.num_stages}) needs more than --devices ({cluster.num_devices}) x --chunks"
            f" ({config.num_chunks}); lower num_stages"
        )
    if config.num_chunks > 1 and n < config.num_chunks:
        raise InfeasibleError(f"{config.schedule} needs at least {config.num_chunks} layers; lower --chunks")


def _solve(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig, memory_limit: float):
    """(objective, raw stages, layer groups) or None when nothing fits."""
    if config.num_chunks > 1:
        from pipeplan.partition.chunks import solve_chunked

        return solve_chunked(arrays, cluster, config, memory_limit)
    multi_node = cluster.num_devices > cluster.devices_per_node
    if (
        multi_node
        and config.stage_mode == "replicated"
        and config.cost_model == "pipeplan"
        and config.num_stages is None
    ):
        from pipeplan.partition.hierarchy import solve_two_level

        return solve_two_level(arrays, cluster, config, memory_limit)
    level = one_level(arrays, cluster, config, memory_limit)
    found = single.solve_level(level)
    if found is None:
        return None
    return found[0], single.describe(level, found[1]), arrays.num_items


def one_level(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig, memory_limit: float) -> Level:
    """A single DP level over all devices. Replicated pipelines on several nodes charge every link as inter-node;
    straight ones know which cuts cross a node boundary; the pipedream cost model uses no latency."""
    intra, inter = cluster.intra_link, cluster.inter_link
    if config.cost_model == "pipedream":
        intra = dataclasses.replace(intra, latency_s=0.0)
        inter = dataclasses.replace(inter, latency_s=0.0)
        if cluster.num_devices > cluster.devices_per_node:
            intra = inter
    return Level(
        arrays=arrays,
        config=config,
        units=cluster.num_devices,
        intra=intra,
        inter=inter,
        devices_per_node=cluster.devices_per_node,
        memory_limit=memory_limit,
    )


def _compact(raw: list[single.RawStage]) -> list[single.RawStage]:
    """Device ids renumbered 0..n-1 in order: the two-level solver gives each block of stages at most a node's
    devices and may leave a node's last ones unused, but a pipeline's devices are consecutive ranks (no idle rank
    inside a pipeline)."""
    ids = {d: i for i, d in enumerate(sorted({d for st in raw for d in st.devices}))}
    return [dataclasses.replace(st, devices=tuple(ids[d] for d in st.devices)) for st in raw]


def build_partition(
    arrays: LayerArrays,
    cluster: Cluster,
    config: PartitionConfig,
    raw: list[single.RawStage],
    *,
    objective: float,
    layer_groups: int,
) -> Partition:
    stages = [_stage_assignment(index, st, arrays, config) for index, st in enumerate(_compact(raw))]
    used = sorted({d for s in stages for d in s.devices})
    held = stages_per_device([s.devices for s in stages])
    load = [float(ms) for ms in device_totals([s.time_ms for s in stages], held)]
    mem = device_totals([s.memory_bytes for s in stages], held)
    assert np.isclose(max(s.time_ms for s in stages), objective, rtol=1e-9, atol=1e-12), "objective mismatch"
    return Partition(
        stages=tuple(stages),
        num_layers=arrays.num_items,
        num_devices=len(used),
        schedule=config.schedule,
        chunks=config.num_chunks,
        mode=config.stage_mode,
        cost_model=config.cost_model,
        num_microbatches=config.num_microbatches,
        optimizer_bytes_per_param=config.optimizer_bytes_per_param,
        memory_limit_bytes=int(config.memory_limit(cluster)),
        objective_ms=float(objective),
        device_load_ms=tuple(load),
        device_memory_bytes=tuple(mem),
        layer_groups=layer_groups,
    )


def _stage_assignment(index: int, st: single.RawStage, arrays: LayerArrays, config: PartitionConfig) -> StageAssignment:
    """One stage's figures (times per microbatch, memory, parameters) from the DP's raw stage."""
    a, b = st.first_item, st.last_item
    replicas = len(st.devices)
    group = replicas * config.data_parallel
    memory = stage_memory_bytes(arrays, config, a, b, 1, st.inflight, mode=st.recompute, group_size=group)
    ops = stage_op_ms(arrays, a, b, st.recompute)
    return StageAssignment(
        index=index,
        first_layer=a,
        last_layer=b,
        replicas=replicas,
        devices=st.devices,
        forward_ms=ops.forward,
        input_grad_ms=ops.input_grad,
        weight_grad_ms=ops.weight_grad,
        backward_ms=ops.backward,
        recompute=st.recompute,
        recompute_ms=ops.recompute,
        comm_ms=st.comm_ms,
        allreduce_ms=st.allreduce_ms,
        output_transfer_ms=st.output_transfer_ms,
        time_ms=st.time_ms,
        inflight_microbatches=st.inflight[0],
        inflight_before_input_grad=st.inflight[1],
        param_count=int(round(float(arrays.span("param_count", a, b)))),
        memory_bytes=int(np.ceil(memory)),
    )


def min_memory_per_device(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig) -> int | None:
    """Memory per device (bytes) that fits, within 0.5% above the smallest that does; None if none at any size.

    Brackets from below with the largest single layer (any stage holds one, with a microbatch in flight) or the
    cluster's memory when that already failed, doubles until a partition fits, then bisects. One-node replicated
    gpipe/1f1b searches get the exact minimum from one DP instead."""
    multi_node = cluster.num_devices > cluster.devices_per_node
    if config.num_chunks == 1 and not multi_node:
        exact = single.min_memory_from_end(one_level(arrays, cluster, config, np.inf))
        if exact is not None:
            return int(np.ceil(exact)) if np.isfinite(exact) else None
    per_param = config.optimizer_bytes_per_param
    layer = static_bytes(np.diff(arrays.param_count), per_param) + np.diff(arrays.activation)
    lo = float(max(layer.max(), 0.0))
    if _solve(arrays, cluster, config, config.memory_limit(cluster)) is None:
        lo = max(lo, config.memory_limit(cluster))
    total = float(static_bytes(arrays.param_count[-1], per_param) + arrays.activation[-1] * 1.0)
    ceiling = 4 * max(total * config.num_microbatches, lo, 1.0)
    hi = max(2 * lo, 1024.0)
    while _solve(arrays, cluster, config, hi) is None:
        if hi > ceiling:
            return None
        lo, hi = hi, 2 * hi
    while hi - lo > max(5e-3 * hi, 1024.0):
        mid = (lo + hi) / 2
        if _solve(arrays, cluster, config, mid) is None:
            lo = mid
        else:
            hi = mid
    return int(np.ceil(hi))


def _infeasible(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig) -> InfeasibleError:
    need = min_memory_per_device(arrays, cluster, config)
    if need is None:
        return InfeasibleError(
            f"no partition of {arrays.num_items} layers over {cluster.num_devices} devices exists for schedule "
            f"{config.schedule}; change --devices or num_stages"
        )
    return InfeasibleError(
        f"{_no_fit(cluster, config)}; raise --memory to at least {format_bytes(need)}, add devices, or "
        "use fewer microbatches"
    )


def _no_fit(cluster: Cluster, config: PartitionConfig) -> str:
    return (
        f"no partition fits in {format_bytes(config.memory_limit(cluster))} per device with {cluster.num_devices} "
        f"devices and {config.num_microbatches} microbatches ({config.schedule})"
    )
