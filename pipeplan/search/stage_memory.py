"""A candidate's memory inputs: static bytes per parameter per stage, the per-stage activation costs the simulator
counts, and the budget zb-auto generates its schedule under."""

from __future__ import annotations

from pipeplan.cluster import Cluster
from pipeplan.costs import (
    LayerArrays,
    bytes_per_param,
    stage_freed_bytes,
    stage_static_per_param,
    static_bytes,
    static_split,
)
from pipeplan.partition.result import Partition
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.simulate import MemoryCosts
from pipeplan.search.recompute_choice import with_recompute_bytes


def stage_bytes_per_param(
    part: Partition,
    data_parallel: int,
    optimizer: str | float,
    precision: str,
    zero: int,
    *,
    profile: Profile | None = None,
    ep: int = 1,
) -> float | tuple[float, ...]:
    """Static bytes per parameter: one figure, or with ZeRO-1 one per stage (its optimizer state split over its
    replicas in every data-parallel pipeline; under expert parallelism `ep` its routed-expert weights' over 1/ep of
    them: `costs.stage_static_per_param`, with the routed-expert parameters of the stage's layers in `profile`)."""
    if not zero:
        return bytes_per_param(optimizer, precision)
    found = []
    for s in part.stages:
        group = s.replicas * data_parallel
        dense = bytes_per_param(optimizer, precision, zero=zero, group_size=group)  # checks the optimizer
        layers = profile.layers[s.first_layer : s.last_layer + 1] if profile is not None and ep > 1 else ()
        experts, count = sum(la.expert_param_count for la in layers), sum(la.param_count for la in layers)
        split = static_split(optimizer, precision)
        found.append(stage_static_per_param(split, count, experts, group, zero, ep) if experts else dense)
    return tuple(found)


def memory_costs(part: Partition, profile: Profile, *, per_layer: bool = False) -> MemoryCosts:
    """Per stage: one microbatch's saved activation bytes and the part of them I frees (none on the model's first
    stage, `costs.stage_freed_bytes`), and under recomputation what each stage keeps until its backward and
    re-creates while it runs (`costs.recompute`; static bytes per device are added once the layout is known,
    `partition.costs.device_static_bytes`)."""
    arrays = LayerArrays.from_profile(profile)
    ranges = part.stage_ranges
    memory = MemoryCosts(
        activation_bytes=tuple(float(arrays.span("activation", a, b)) for a, b in ranges),
        input_grad_freed_bytes=tuple(float(stage_freed_bytes(arrays, "none", a, b)) for a, b in ranges),
    )
    if all(s.recompute == "none" for s in part.stages):
        return memory
    return with_recompute_bytes(memory, arrays, ranges, [s.recompute for s in part.stages], per_layer=per_layer)


def activation_budget(part: Partition, cluster: Cluster, per_param) -> float:
    """Live activation bytes zb-auto (one stage per device) may use per device: memory less the largest stage's
    static bytes."""
    each = [per_param] * part.num_stages if isinstance(per_param, float) else per_param
    largest = max(float(static_bytes(s.param_count, each[s.index])) for s in part.stages)
    return max(cluster.memory_per_device - largest, 1e-9)
