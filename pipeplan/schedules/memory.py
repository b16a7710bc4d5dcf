"""The activation-memory model the partitioner and planner use — the single source of truth.

A microbatch's activations on a stage are alive from its F until its W (split backward) or B (full backward).
`inflight_per_stage` counts, per stage, the most microbatches alive at once, read from the op order alone (all of a
stage's ops run on one device, in list order), so it holds for any op timings.
"""

from __future__ import annotations

import functools

from pipeplan.schedules.ops import Schedule


def inflight_per_stage(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the max number of microbatches whose activations are alive (F done, W or B not yet done)."""
    alive = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for ops in schedule.device_ops:
        for o in ops:
            if o.kind == "F":
                alive[o.stage] += 1
                if alive[o.stage] > peak[o.stage]:
                    peak[o.stage] = alive[o.stage]
            elif o.kind == "B" or o.kind == "W":
                alive[o.stage] -= 1
    return tuple(peak)


def inflight_per_device(schedule: Schedule) -> tuple[int, ...]:
    """Per device, the max number of (stage, microbatch) activations alive at once over all its stages. Exact
    from the op order too: a device runs its list in order. (With V placement this is less than the sum of its
    stages' `inflight_per_stage` peaks, which need not coincide.)"""
    peaks = []
    for ops in schedule.device_ops:
        alive = peak = 0
        for o in ops:
            if o.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif o.kind == "B" or o.kind == "W":
                alive -= 1
        peaks.append(peak)
    return tuple(peaks)


@functools.lru_cache(maxsize=1024)
def memory_model(
    name: str,
    num_devices: int,
    num_microbatches: int,
    chunks: int | None = None,
    memory_limit: int | None = None,
) -> tuple[int, ...]:
    """`inflight_per_stage` of schedule `name` generated with unit costs (cached). Index = global stage id;
    the stage -> device placement is `registry.stage_device(name, num_devices, chunks)`."""
    from pipeplan.schedules.registry import generate

    schedule = generate(
        name,
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        chunks=chunks,
        memory_limit=memory_limit,
    )
    return inflight_per_stage(schedule)
