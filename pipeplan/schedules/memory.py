"""In-flight microbatch counts per stage, read from the op order alone (a stage's ops run in list order on its
device, so the counts hold for any op timings).

These are counts, not the memory figure: planning checks the simulator's per-device peak in bytes
(`schedules.simulate.peak_activation_per_device` / `Timeline.peak_memory_bytes`: F adds a stage's saved bytes, I
frees what the profile says it frees, W the rest, B all). The partitioner screens candidate cuts with these counts
(`partition.single.inflight_counts`), which it can combine per stage before any schedule is timed.
"""

from __future__ import annotations

from pipeplan.schedules.ops import Schedule

Held = tuple[int, int]  # (microbatches in flight, of which before their I) on one stage


def held_per_stage(schedule: Schedule) -> tuple[Held, ...]:
    """Per stage: (max in flight: F run, W or B not yet; max before I: F run, I or B not yet)."""
    total, before = [0] * schedule.num_stages, [0] * schedule.num_stages
    peak_total, peak_before = [0] * schedule.num_stages, [0] * schedule.num_stages
    for ops in schedule.device_ops:
        for o in (part for op in ops for part in op.parts):  # an OVERLAP_F_B counts as F then B
            s = o.stage
            if o.kind == "F":
                total[s] += 1
                before[s] += 1
                peak_total[s] = max(peak_total[s], total[s])
                peak_before[s] = max(peak_before[s], before[s])
            elif o.kind == "I":
                before[s] -= 1
            elif o.kind == "W":
                total[s] -= 1
            else:
                total[s] -= 1
                before[s] -= 1
    return tuple(zip(peak_total, peak_before))


def inflight_per_stage(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the max number of microbatches whose activations are alive (F done, W or B not yet done)."""
    return tuple(total for total, _ in held_per_stage(schedule))
