"""Cheap step-time figures that order and prune the search before the partitioner runs, and a lower bound after.

- `balanced_estimate_ms` (before partitioning): the layout's schedule simulated with perfectly balanced stages —
  each stage gets 1/S of the model's F, I and W and the mean cut's transfer time — plus a lower bound on the
  gradient all-reduce (the model's gradients spread evenly over a pipeline, reduced over the pipelines). A real
  partition is never better balanced, so this is an estimate from below in practice (not a proof: per-stage
  transfer times differ from the mean). For many microbatches the schedule is simulated with
  m0 = 2P + (m mod P) microbatches and extended by the steady state, (m - m0) / P x the makespan's growth from m0
  to m0 + P microbatches: every generator's fill and drain cost does not depend on m once m >= 2P.
  It is raised to m x a lower bound on the busiest device's work (the best contiguous split's largest stage,
  each layer's backward costed as the cheaper of the forms — B, or I + W — the schedule's ops use).
  Replicated layouts get only that bubble-free bound: their partition may hold fewer than P stages.
- `partition_lower_bound_ms` (after partitioning, before generating and simulating the schedule): the busiest
  device's compute for all microbatches plus the all-reduce that follows the flush — a true lower bound on the
  simulated step.
"""

from __future__ import annotations

import functools

from pipeplan.cluster import Cluster
from pipeplan.costs import allreduce_ms, busiest_device_ms, stages_per_device, transfer_ms
from pipeplan.partition.result import Partition
from pipeplan.predict.gradient_sync import SyncGroup, allreduce_step_ms, stage_allreduce_ms
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import generate, schedule_info
from pipeplan.schedules.simulate import StageCosts, simulate
from pipeplan.search.candidate import REPLICATED, Layout, stage_work_ms
from pipeplan.search.config import SearchConfig


@functools.lru_cache(maxsize=512)
def _schedule(name: str, num_devices: int, num_microbatches: int, chunks: int | None = None) -> Schedule:
    """A fixed-order schedule (every generator but zb-auto ignores costs), cached across microbatch sizes."""
    return generate(name, num_devices=num_devices, num_microbatches=num_microbatches, chunks=chunks)


def probe_microbatches(num_devices: int, num_microbatches: int) -> int:
    """m itself when small, else 2P + (m mod P): same residue (divisibility rules hold), at least 2P."""
    if num_microbatches <= 3 * num_devices:
        return num_microbatches
    return 2 * num_devices + num_microbatches % num_devices


def balanced_estimate_ms(layout: Layout, profile: Profile, cluster: Cluster, *, grad_overlap: bool = False) -> float:
    """Step time of `layout` with perfectly balanced stages (see the module docstring). Raises ScheduleError
    when the schedule does not support the layout's shape."""
    p, m = layout.pipeline_devices, layout.num_microbatches
    chunks = layout.num_chunks
    stages = p * chunks
    forward = sum(layer.forward_ms for layer in profile.layers) / stages
    input_grad = sum(layer.input_grad_ms for layer in profile.layers) / stages
    weight_grad = sum(layer.weight_grad_ms for layer in profile.layers) / stages
    backward = sum(layer.backward_ms for layer in profile.layers) / stages
    cuts = profile.cut_bytes or (0,)
    comm = transfer_ms(sum(cuts) / len(cuts), cluster.link_for_consecutive(p)) if p > 1 else 0.0
    costs = StageCosts(
        forward_ms=forward, input_grad_ms=input_grad, weight_grad_ms=weight_grad, backward_ms=backward, comm_ms=comm
    )
    probe = schedule_info(layout.schedule).estimate_with or layout.schedule  # zb-auto: zb-h1 (the registry says why)
    m0 = probe_microbatches(p, m)
    looped = layout.chunks if layout.mode != REPLICATED else None
    schedule = _schedule(probe, p, m0, looped)
    busiest = per_device_bound_ms(layout, profile, backward_kinds(schedule))
    if layout.mode == REPLICATED or schedule_info(layout.schedule).asynchronous:
        # the partitioner may replicate stages down to fewer than P stages (even one: plain data parallelism, no
        # bubble), so only the bubble-free bound is safe here; an asynchronous stream has no flush either
        pipeline = m * busiest
    else:
        makespan = simulate(schedule, costs).makespan
        if m > m0:  # steady state: P more microbatches cost the same whatever m is, once m >= 2P
            makespan += (m - m0) / p * (simulate(_schedule(probe, p, m0 + p, looped), costs).makespan - makespan)
        pipeline = max(makespan, m * busiest)
    return pipeline + (0.0 if grad_overlap else allreduce_lower_bound_ms(layout, profile, cluster))


def backward_kinds(schedule: Schedule) -> frozenset[str]:
    """Which backward ops the schedule runs: {"B"}, {"I", "W"} or both (dualpipev mixes them)."""
    return frozenset(part.kind for ops in schedule.device_ops for op in ops for part in op.parts) - {"F"}


def per_device_bound_ms(layout: Layout, profile: Profile, kinds: frozenset[str]) -> float:
    """A lower bound on the busiest device's work per microbatch: the model's compute (F + the cheaper of the
    backward forms the schedule uses) over P devices, and for straight pipelines the smallest possible largest
    stage when cutting the layers into S contiguous stages."""
    work = [la.forward_ms + _cheapest_backward(la, kinds) for la in profile.layers]
    even = sum(work) / layout.pipeline_devices
    if layout.mode == REPLICATED or _mirrored(layout):  # (dualpipe: a device runs half the microbatches of two)
        return even
    stages = layout.pipeline_devices * layout.num_chunks
    return max(even, min_largest_stage(work, stages))


def _cheapest_backward(layer, kinds: frozenset[str]) -> float:
    options = [layer.backward_ms] if "B" in kinds else []
    if "I" in kinds:
        options.append(layer.input_grad_ms + layer.weight_grad_ms)
    return min(options)


def min_largest_stage(work: list[float], num_stages: int) -> float:
    """Largest stage of the best split of `work` into <= num_stages contiguous stages, from below (bisection on
    the greedy packing test, returning the infeasible end: never above the optimum)."""
    low, high = max(work), sum(work)
    if num_stages >= len(work):
        return low
    for _ in range(40):
        middle = (low + high) / 2
        stages, current = 1, 0.0
        for w in work:
            if current + w > middle:
                stages, current = stages + 1, w
            else:
                current += w
        if stages <= num_stages:
            high = middle
        else:
            low = middle
    return low


def _mirrored(layout: Layout) -> bool:
    return stage_copies(schedule_info(layout.schedule).placement) > 1


def allreduce_lower_bound_ms(layout: Layout, profile: Profile, cluster: Cluster) -> float:
    """The gradients spread evenly over a pipeline's devices, ring all-reduced over the pipelines."""
    if layout.data_parallel == 1:
        return 0.0
    grad_bytes = sum(layer.param_bytes for layer in profile.layers) / layout.pipeline_devices
    link = cluster.link_for_consecutive(layout.pipeline_devices * layout.data_parallel)
    return allreduce_ms(grad_bytes, layout.data_parallel, link)


def partition_lower_bound_ms(
    layout: Layout, part: Partition, profile: Profile, cluster: Cluster, config: SearchConfig
) -> float:
    """m x the busiest device's work per microbatch (its stages' F + backward, / replicas) + the gradient
    all-reduce (not when the reduction overlaps the backward: it may hide)."""
    work = stage_work_ms(part)
    if _mirrored(layout):  # device d runs half the microbatches through each of stages d and P-1-d
        work = tuple((w + work[-1 - s]) / 2 for s, w in enumerate(work))
    busiest = busiest_device_ms(work, stages_per_device([s.devices for s in part.stages]))
    if config.overlap.grad_reduce:
        return layout.num_microbatches * busiest
    group = SyncGroup(
        data_parallel=layout.data_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
    )
    per_stage = stage_allreduce_ms(profile, cluster, part, group, numerics=config.numerics)
    return layout.num_microbatches * busiest + allreduce_step_ms(part, per_stage)
