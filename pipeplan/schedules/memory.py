"""In-flight microbatch counts from the op order (zb-auto's in-flight limit, until it schedules by bytes).

Planning no longer counts microbatches: the one memory figure is the simulator's per-device peak in bytes
(`schedules.simulate.peak_activation_per_device` / `Timeline.peak_memory_bytes`: F adds a stage's saved bytes, I
frees what the profile says it frees, W the rest, B all). The partitioner screens with its own per-stage bound
(`partition.single.inflight_counts`).
"""

from __future__ import annotations

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
