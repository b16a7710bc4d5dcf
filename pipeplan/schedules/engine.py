"""The timing engine: every device runs its op list in order; an op starts when its device is free and its
dependencies are done, plus the boundary's transfer time when the producing stage sits on another device.

Dependencies: F(s, mb) needs F(s-1, mb); I/B(s, mb) needs F(s, mb) and the backward (I or B) of (s+1, mb);
W(s, mb) needs I(s, mb). `execute` expects lists that passed `validate.check_complete` (it is given the
backward kinds that returns); `validate.run_in_order` checks, then calls it, and `replicate` calls it on
expanded lists whose stages sit on several devices. A deadlock raises ScheduleError with a marked grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import KIND_INDEX, KINDS, Op, Schedule, format_grid


def execute(
    schedule: Schedule,
    backward_kind: bytearray,
    *,
    op_ms: Mapping[str, Sequence[float]] | None = None,
    comm_ms: Sequence[float] | None = None,
    fused: Mapping[tuple[int, int], float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-device start and end times, aligned with `device_ops`. `op_ms[kind][stage]` gives durations (all 0
    when None); `comm_ms[boundary]` is charged when producer and consumer are on different devices (by
    `schedule.stage_device`). `fused[(device, step)] = ms` runs that op and the next one as one unit (DualPipe's
    overlapped F&B pair): it starts when both ops' inputs are ready and both end after `ms`. `backward_kind[slot]`
    (slot = stage * m + microbatch) is the kind index (B or I) carrying that slot's input gradient."""
    return _Executor(schedule, backward_kind, op_ms, comm_ms).run(fused or {})


class _Executor:
    def __init__(self, schedule: Schedule, backward_kind: bytearray, op_ms, comm_ms) -> None:  # type: ignore[no-untyped-def]
        S, m = schedule.num_stages, schedule.num_microbatches
        self.schedule, self.backward_kind, self.S, self.m, self.n = schedule, backward_kind, S, m, S * m
        self.dur = {k: (op_ms[k] if op_ms else [0.0] * S) for k in "FBIW"}
        self.comm = comm_ms if comm_ms is not None else [0.0] * max(S - 1, 0)
        self.end: list[float | None] = [None] * (4 * self.n)  # by key = kind_index * n + stage * m + mb

    def ready(self, d: int, o: Op, start: float) -> tuple[float, int]:
        """(start time, -1) for op `o` on device `d` free at `start`, or (_, key it waits on)."""
        kind, s, m, n, end = o.kind, o.stage, self.m, self.n, self.end
        placement = self.schedule.stage_device
        slot = s * m + o.microbatch
        if kind == "F":
            if s > 0:
                e = end[slot - m]
                if e is None:
                    return start, slot - m
                if placement[s - 1] != d:
                    e += self.comm[s - 1]
                start = max(start, e)
        elif kind == "W":
            e = end[2 * n + slot]
            if e is None:
                return start, 2 * n + slot
            start = max(start, e)
        else:
            e = end[slot]
            if e is None:
                return start, slot
            start = max(start, e)
            if s + 1 < self.S:
                key = self.backward_kind[slot + m] * n + slot + m
                e = end[key]
                if e is None:
                    return start, key
                start = max(start, e + self.comm[s] if placement[s + 1] != d else e)
        return start, -1

    def run(self, fused: Mapping[tuple[int, int], float]) -> tuple[list[list[float]], list[list[float]]]:
        device_ops, n, m, end, dur = self.schedule.device_ops, self.n, self.m, self.end, self.dur
        starts = [[0.0] * len(ops) for ops in device_ops]
        ends = [[0.0] * len(ops) for ops in device_ops]
        pos, free = [0] * len(device_ops), [0.0] * len(device_ops)
        waiting: dict[int, list[int]] = {}
        runnable = list(range(len(device_ops) - 1, -1, -1))
        while runnable:
            d = runnable.pop()
            ops, i, t = device_ops[d], pos[d], free[d]
            while i < len(ops):
                start, wait_on = self.ready(d, ops[i], t)
                unit = fused.get((d, i)) if fused else None
                if unit is not None and wait_on < 0:
                    start, wait_on = self.ready(d, ops[i + 1], start)
                if wait_on >= 0:
                    waiting.setdefault(wait_on, []).append(d)
                    break
                count = 1 if unit is None else 2
                t = start + (dur[ops[i].kind][ops[i].stage] if unit is None else unit)
                for o in ops[i : i + count]:
                    key = KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch
                    end[key] = t
                    starts[d][i], ends[d][i] = start, t
                    i += 1
                    if key in waiting:
                        runnable.extend(waiting.pop(key))
            pos[d], free[d] = i, t
        _raise_if_stuck(self.schedule, pos, waiting)
        return starts, ends


def _raise_if_stuck(schedule: Schedule, pos: list[int], waiting: dict[int, list[int]]) -> None:
    stuck = [(d, pos[d]) for d in range(schedule.num_devices) if pos[d] < len(schedule.device_ops[d])]
    if not stuck:
        return
    n, m = schedule.num_stages * schedule.num_microbatches, schedule.num_microbatches
    need = {d: key for key, devices in waiting.items() for d in devices}
    d, step = stuck[0]
    key = need[d]
    kind, stage, mb = KINDS[key // n], (key % n) // m, key % m
    raise ScheduleError(
        f"schedule {schedule.name!r} deadlocks: device {d} waits at step {step} on {schedule.device_ops[d][step]} "
        f"for {stage}{kind}{mb}, which never runs first (reorder the op lists)\n"
        + format_grid(schedule, marks=set(stuck))
    )
