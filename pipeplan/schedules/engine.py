"""The timing engine: every device runs its op list in order; an op starts when its device is free and its
dependencies are done, plus the boundary's transfer time when the producing stage sits on another device.

Dependencies (`dependencies`, the one rule): F(s, mb) needs F(s-1, mb); I/B(s, mb) needs F(s, mb) and the backward
(I or B) of (s+1, mb); W(s, mb) needs I(s, mb). An OVERLAP_F_B op (DualPipe's F&B pair) needs both halves'
dependencies, starts once all are done and takes `overlapped_ms` (the one cost formula of an overlapped pair);
both halves end with it. `execute` expects lists that passed `validate.check_complete` (it
is given the backward kinds that returns); `replicate` calls it on expanded lists whose stages sit on several
devices. Which op can run next depends only on which ops are done, never on durations, so `timing_order` records
one run's order once and `replay` times the same op lists under any costs along it (`validate.run_in_order` does,
keeping the order with the schedule's checks). A deadlock raises ScheduleError with a marked grid.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping, Sequence

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import KIND_INDEX, KINDS, Op, Schedule, format_grid

Dependencies = tuple[int, int, int, int]  # (key, boundary charged or -1) of the first and second dependency, or -1
Order = array  # of int64: 9 per op half, see `timing_order`
NO_DEPENDENCIES: Dependencies = (-1, -1, -1, -1)
_OPEN, _CLOSE = len(KINDS), len(KINDS) + 1  # `timing_order`'s kind of an OVERLAP_F_B's forward and backward half
_Row = tuple[int, int, int, int, int, int, int, int, int]  # `timing_order`'s 9 ints of one op (or one half)


def overlapped_ms(forward_ms: float, backward_ms: float, overlap_ms: float | None) -> float:
    """The time of one OVERLAP_F_B op, the forward `forward_ms` and the full backward `backward_ms` overlapped:
    `overlap_ms` where given (`StageCosts.overlap_ms`, simulate's --overlap-ms), else the two halves' sum (no
    gain counted from the overlap: what a runtime without spare compute for it gives)."""
    return forward_ms + backward_ms if overlap_ms is None else overlap_ms


def execute(
    schedule: Schedule,
    backward_kind: bytes | bytearray,
    *,
    op_ms: Mapping[str, Sequence[float]] | None = None,
    comm_ms: Sequence[float] | None = None,
    overlap_ms: float | None = None,
    ready: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-device start and end times, aligned with `device_ops`; `ready[d]`: when device d may start its first op
    (default 0: a step of several, `schedules.period`, starts each device at its own time). `op_ms[kind][stage]`
    gives durations (all 0 when None); `comm_ms[boundary]` is charged when producer and consumer are on different
    devices (by `schedule.op_device`); an OVERLAP_F_B op takes `overlapped_ms(F, B, overlap_ms)`.
    `backward_kind[slot]` (slot = stage * m + microbatch) is the kind index (B or I) carrying that slot's input
    gradient."""
    return replay(schedule, timing_order(schedule, backward_kind), op_ms, comm_ms, overlap_ms, ready)


def dependencies(schedule: Schedule, backward_kind: bytes | bytearray, device: int, o: Op) -> Dependencies:
    """What op `o` on `device` waits for: the keys (kind index * S * m + stage * m + microbatch) of the ops it
    needs, each with the boundary whose transfer is charged on it (-1: none, the producer is on the same device)."""
    s, mb, m, n = o.stage, o.microbatch, schedule.num_microbatches, schedule.num_stages * schedule.num_microbatches
    slot = s * m + mb
    if o.kind == "F":
        if s == 0:
            return NO_DEPENDENCIES
        return slot - m, s - 1 if schedule.op_device(s - 1, mb) != device else -1, -1, -1
    if o.kind == "W":
        return 2 * n + slot, -1, -1, -1
    if s + 1 < schedule.num_stages:
        return slot, -1, backward_kind[slot + m] * n + slot + m, (s if schedule.op_device(s + 1, mb) != device else -1)
    return slot, -1, -1, -1


def timing_order(schedule: Schedule, backward_kind: bytes | bytearray) -> Order:
    """The ops in the order they can run (each after its dependencies and its device's previous op), 9 ints per
    op as (device, step, key, kind index, stage, *`dependencies`): what `replay` needs. An OVERLAP_F_B op is two
    such rows, its forward (kind `_OPEN`) then its backward (`_CLOSE`), placed once both halves can start. Raises
    ScheduleError (with a marked grid) on a deadlock."""
    n, m = schedule.num_stages * schedule.num_microbatches, schedule.num_microbatches

    def encode(d: int, i: int, o: Op, kind: int) -> _Row:
        return (d, i, KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch, kind, o.stage) + dependencies(
            schedule, backward_kind, d, o
        )

    rows: list[list[_Row | tuple[_Row, _Row]]] = [
        [
            encode(d, i, o, KIND_INDEX[o.kind])
            if o.halves is None
            else (encode(d, i, o.halves[0], _OPEN), encode(d, i, o.halves[1], _CLOSE))
            for i, o in enumerate(ops)
        ]
        for d, ops in enumerate(schedule.device_ops)
    ]
    done = bytearray(4 * n)
    order: list[_Row] = []
    pos = [0] * len(rows)
    waiting: dict[int, list[int]] = {}
    runnable = list(range(len(rows) - 1, -1, -1))
    while runnable:
        d = runnable.pop()
        row, i = rows[d], pos[d]
        while i < len(row):
            op = row[i]
            if len(op) != 2:  # one op (an OVERLAP_F_B is a pair of rows, below)
                wait_on = op[5] if op[5] >= 0 and not done[op[5]] else op[7] if op[7] >= 0 and not done[op[7]] else -1
                if wait_on >= 0:
                    waiting.setdefault(wait_on, []).append(d)
                    break
                done[op[2]] = 1
                order.append(op)
                i += 1
                if op[2] in waiting:
                    runnable.extend(waiting.pop(op[2]))
                continue
            wait_on = next((k for half in op for k in (half[5], half[7]) if k >= 0 and not done[k]), -1)
            if wait_on >= 0:
                waiting.setdefault(wait_on, []).append(d)
                break
            for half in op:
                done[half[2]] = 1
                order.append(half)
                if half[2] in waiting:
                    runnable.extend(waiting.pop(half[2]))
            i += 1
        pos[d] = i
    _raise_if_stuck(schedule, pos, waiting)
    return array("q", itertools.chain.from_iterable(order))  # flat: a third of the tuples' memory


def replay(
    schedule: Schedule,
    order: Order,
    op_ms: Mapping[str, Sequence[float]] | None,
    comm_ms: Sequence[float] | None,
    overlap_ms: float | None = None,
    ready: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end times of every op along `timing_order(schedule, ...)` (the longest path: each op starts
    when its device is free and its dependencies, plus their transfers, are done): `execute`'s arguments. The
    order holds for any `ready` (it depends only on which ops are done)."""
    S = schedule.num_stages
    dur = [op_ms[k] if op_ms else [0.0] * S for k in KINDS]
    comm = comm_ms if comm_ms is not None else [0.0] * max(S - 1, 0)
    starts = [[0.0] * len(ops) for ops in schedule.device_ops]
    ends = [[0.0] * len(ops) for ops in schedule.device_ops]
    end = [0.0] * (4 * S * schedule.num_microbatches)
    free = list(ready) if ready is not None else [0.0] * schedule.num_devices
    fields = [iter(order)] * 9
    opened = (0.0, 0, 0)  # an OVERLAP_F_B's forward half: (its earliest start, key, stage)
    for d, i, key, kind, s, first, first_comm, second, second_comm in zip(*fields):
        start = free[d]
        if first >= 0:
            start = max(start, end[first] + comm[first_comm] if first_comm >= 0 else end[first])
            if second >= 0:
                start = max(start, end[second] + comm[second_comm] if second_comm >= 0 else end[second])
        if kind < _OPEN:
            t = start + dur[kind][s]
        elif kind == _OPEN:
            opened = (start, key, s)
            continue
        else:  # the backward half closes the pair: both start together and end after the pair's time
            start = max(start, opened[0])
            t = start + overlapped_ms(dur[0][opened[2]], dur[1][s], overlap_ms)
            end[opened[1]] = t
        end[key] = free[d] = t
        starts[d][i], ends[d][i] = start, t
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
