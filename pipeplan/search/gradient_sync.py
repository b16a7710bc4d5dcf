"""The gradient exchange a step ends with, per stage and per step (the formulas are the cost module's)."""

from __future__ import annotations

from pipeplan.cluster import Cluster
from pipeplan.costs import busiest_device_ms, gradient_sync_ms, stages_per_device
from pipeplan.partition.result import Partition
from pipeplan.profiling.profile import Profile


def stage_param_bytes(profile: Profile, first_layer: int, last_layer: int) -> int:
    return sum(layer.param_bytes for layer in profile.layers[first_layer : last_layer + 1])


def stage_allreduce_ms(
    profile: Profile, cluster: Cluster, part: Partition, data_parallel: int, *, zero: int = 0
) -> tuple[float, ...]:
    """Per stage, the ring all-reduce of its gradients over its replicas in every pipeline (pipeline k's device d
    is global rank k x P + d), or ZeRO-1's reduce-scatter + all-gather (`costs.gradient_sync_ms`; gradients are
    in the parameters' dtype, so both move the stage's parameter bytes)."""
    times = []
    for stage in part.stages:
        group = [k * part.num_devices + d for k in range(data_parallel) for d in stage.devices]
        grad_bytes = stage_param_bytes(profile, stage.first_layer, stage.last_layer)
        times.append(gradient_sync_ms(grad_bytes, grad_bytes, len(group), cluster.link_between(group), zero))
    return tuple(times)


def allreduce_step_ms(part: Partition, per_stage_ms: tuple[float, ...]) -> float:
    """After the flush each device reduces its stages (chunks) one after another; devices run in parallel."""
    return busiest_device_ms(per_stage_ms, stages_per_device([s.devices for s in part.stages]))
