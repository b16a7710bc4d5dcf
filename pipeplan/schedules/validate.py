"""One `validate(schedule)`: every (stage, microbatch) runs F, then B or (I then W), exactly once, on its stage's
device; cross-stage dependencies hold; the per-device lists run in order without deadlock. Failures raise
ScheduleError with a step x device grid of op strings, the failing op marked `[1F3]!`.

Dependencies (the same ones `simulate()` times): F(s, mb) needs F(s-1, mb); I/B(s, mb) needs F(s, mb) and the
backward (I or B) of (s+1, mb); W(s, mb) needs I(s, mb).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import Op, Schedule

_KIND_INDEX = {"F": 0, "B": 1, "I": 2, "W": 3}
_GRID_ROWS = 12  # rows shown either side of the failing step


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (with a marked grid) unless `schedule` is complete, well placed and deadlock-free."""
    run_in_order(schedule)


def run_in_order(
    schedule: Schedule,
    *,
    op_ms: dict[str, Sequence[float]] | None = None,
    comm_ms: Sequence[float] | None = None,
    fused: Mapping[tuple[int, int], float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Validate, then execute every device's list in order: an op starts when its device is free and its
    dependencies are done (+ `comm_ms[boundary]` when the producer is on another device). `op_ms[kind][stage]`
    gives durations (all 0 when None). `fused[(device, step)] = ms` runs that op and the next one as one unit
    (DualPipe's overlapped F&B pair): it starts when both ops' inputs are ready and both end after `ms`.
    Returns per-device start and end times, aligned with `device_ops`."""
    _check_placement(schedule)
    backward_kind = _check_complete(schedule)
    return _Executor(schedule, backward_kind, op_ms, comm_ms).run(fused or {})


def _execute(
    schedule: Schedule,
    backward_kind: bytearray,
    op_ms: dict[str, Sequence[float]] | None,
    comm_ms: Sequence[float] | None,
) -> tuple[list[list[float]], list[list[float]]]:
    """`run_in_order` after its checks (used by `replicate` on an already checked expansion)."""
    return _Executor(schedule, backward_kind, op_ms, comm_ms).run({})


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
                    key = _KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch
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
    kind, stage, mb = "FBIW"[key // n], (key % n) // m, key % m
    raise ScheduleError(
        f"schedule {schedule.name!r} deadlocks: device {d} waits at step {step} on {schedule.device_ops[d][step]} "
        f"for {stage}{kind}{mb}, which never runs first (reorder the op lists)\n"
        + format_grid(schedule, marks=set(stuck))
    )


def _check_placement(schedule: Schedule) -> None:
    m, n = schedule.num_microbatches, schedule.num_stages * schedule.num_microbatches
    seen = bytearray(4 * n)
    for device, ops in enumerate(schedule.device_ops):
        for step, o in enumerate(ops):
            problem = None
            if o.stage >= schedule.num_stages:
                problem = f"stage {o.stage} does not exist ({schedule.num_stages} stages)"
            elif o.microbatch >= m:
                problem = f"microbatch {o.microbatch} does not exist ({m} microbatches)"
            elif schedule.stage_device[o.stage] != device:
                problem = f"stage {o.stage} is placed on device {schedule.stage_device[o.stage]}, not {device}"
            elif seen[_KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch]:
                problem = "it runs twice"
            if problem:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: op {o} on device {device} at step {step}: {problem}\n"
                    + format_grid(schedule, marks={(device, step)})
                )
            seen[_KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch] = 1


def _check_complete(schedule: Schedule) -> bytearray:
    """Check every (stage, mb) has F and B or I+W; return the kind index carrying each one's input gradient."""
    m, n = schedule.num_microbatches, schedule.num_stages * schedule.num_microbatches
    has = [0] * n  # bit mask over kinds F=1, B=2, I=4, W=8
    for ops in schedule.device_ops:
        for o in ops:
            has[o.stage * m + o.microbatch] |= 1 << _KIND_INDEX[o.kind]
    backward_kind = bytearray(n)
    for slot, mask in enumerate(has):
        if mask in (0b0011, 0b1101):
            backward_kind[slot] = 1 if mask & 0b0010 else 2
            continue
        stage, mb = divmod(slot, m)
        if not mask & 1:
            problem = f"has no forward {stage}F{mb}"
        elif mask & 0b0010:
            problem = "has both a full backward B and a split backward I/W"
        else:
            problem = f"needs B or both I and W; {stage}{'I' if not mask & 0b0100 else 'W'}{mb} is missing"
        raise ScheduleError(
            f"schedule {schedule.name!r}: stage {stage} microbatch {mb} {problem}\n"
            + format_grid(schedule, marks=set())
        )
    return backward_kind


def format_grid(schedule: Schedule, *, marks: set[tuple[int, int]]) -> str:
    """Step (row) x device (column) grid of op strings; (device, step) pairs in `marks` print as `[1F3]!`.
    Long schedules show the rows around the first mark."""
    num_steps = max((len(ops) for ops in schedule.device_ops), default=0)
    focus = min((step for _, step in marks), default=0)
    first = max(0, focus - _GRID_ROWS)
    last = min(num_steps, focus + _GRID_ROWS + 1) if marks else min(num_steps, 2 * _GRID_ROWS)
    cells: list[list[str]] = []
    for step in range(first, last):
        row = [f"step {step}"]
        for device, ops in enumerate(schedule.device_ops):
            text = str(ops[step]) if step < len(ops) else ""
            row.append(f"[{text}]!" if (device, step) in marks else text)
        cells.append(row)
    header = ["", *(f"dev {d}" for d in range(schedule.num_devices))]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *cells]]
    if first > 0:
        lines.insert(1, f"... ({first} earlier steps)")
    if last < num_steps:
        lines.append(f"... ({num_steps - last} later steps)")
    return "\n".join(lines)
