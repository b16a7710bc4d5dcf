"""The timing engine: every device runs its op list in order; an op starts when its device is free and its
dependencies are done, plus the boundary's transfer time when the producing stage sits on another device.

Dependencies (`dependencies`, the one rule): F(s, mb) needs F(s-1, mb); I/B(s, mb) needs F(s, mb) and the backward
(I or B) of (s+1, mb); W(s, mb) needs I(s, mb). `execute` expects lists that passed `validate.check_complete` (it
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
Order = array  # of int64: 9 per op, see `timing_order`
NO_DEPENDENCIES: Dependencies = (-1, -1, -1, -1)


def execute(
    schedule: Schedule,
    backward_kind: bytes | bytearray,
    *,
    op_ms: Mapping[str, Sequence[float]] | None = None,
    comm_ms: Sequence[float] | None = None,
    fused: Mapping[tuple[int, int], float] | None = None,
    ready: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-device start and end times, aligned with `device_ops`; `ready[d]`: when device d may start its first op
    (default 0: a step of several, `schedules.period`, starts each device at its own time). `op_ms[kind][stage]` gives
    durations (all 0 when None); `comm_ms[boundary]` is charged when producer and consumer are on different devices (by
    `schedule.stage_device`). `fused[(device, step)] = ms` runs that op and the next one as one unit (DualPipe's
    overlapped F&B pair): it starts when both ops' inputs are ready and both end after `ms`. `backward_kind[slot]` (slot
    = stage * m + microbatch) is the kind index (B or I) carrying that slot's input gradient."""
    return _Executor(schedule, backward_kind, op_ms, comm_ms).run(fused or {}, ready)


def dependencies(schedule: Schedule, backward_kind: bytes | bytearray, device: int, o: Op) -> Dependencies:
    """What op `o` on `device` waits for: the keys (kind index * S * m + stage * m + microbatch) of the ops it
    needs, each with the boundary whose transfer is charged on it (-1: none, the producer is on the same device)."""
    s, m, n, placement = (
        o.stage,
        schedule.num_microbatches,
        schedule.num_stages * schedule.num_microbatches,
        schedule.stage_device,
    )
    slot = s * m + o.microbatch
    if o.kind == "F":
        return (slot - m, s - 1 if placement[s - 1] != device else -1, -1, -1) if s > 0 else NO_DEPENDENCIES
    if o.kind == "W":
        return 2 * n + slot, -1, -1, -1
    if s + 1 < schedule.num_stages:
        return slot, -1, backward_kind[slot + m] * n + slot + m, (s if placement[s + 1] != device else -1)
    return slot, -1, -1, -1


def timing_order(schedule: Schedule, backward_kind: bytes | bytearray) -> Order:
    """The ops in the order `execute` runs them (each after its dependencies and its device's previous op), 9 ints
    as (device, step, key, kind index, stage, *`dependencies`): what `replay` needs. Raises ScheduleError on a
    deadlock, as `execute` does (the same walk, without times)."""
    n, m = schedule.num_stages * schedule.num_microbatches, schedule.num_microbatches
    rows = [
        [
            (d, i, KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch, KIND_INDEX[o.kind], o.stage)
            + dependencies(schedule, backward_kind, d, o)
            for i, o in enumerate(ops)
        ]
        for d, ops in enumerate(schedule.device_ops)
    ]
    done = bytearray(4 * n)
    order = []
    pos = [0] * len(rows)
    waiting: dict[int, list[int]] = {}
    runnable = list(range(len(rows) - 1, -1, -1))
    while runnable:
        d = runnable.pop()
        row, i = rows[d], pos[d]
        while i < len(row):
            op = row[i]
            wait_on = op[5] if op[5] >= 0 and not done[op[5]] else op[7] if op[7] >= 0 and not done[op[7]] else -1
            if wait_on >= 0:
                waiting.setdefault(wait_on, []).append(d)
                break
            done[op[2]] = 1
            order.append(op)
            i += 1
            if op[2] in waiting:
                runnable.extend(waiting.pop(op[2]))
        pos[d] = i
    _raise_if_stuck(schedule, pos, waiting)
    return array("q", itertools.chain.from_iterable(order))  # flat: a third of the tuples' memory


def replay(
    schedule: Schedule,
    order: Order,
    op_ms: Mapping[str, Sequence[float]] | None,
    comm_ms: Sequence[float] | None,
    ready: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """`execute` without fused pairs, along `timing_order(schedule, ...)`: the same start and end times (the same
    float operations) without searching for the next op that can run. The order holds for any `ready` (it depends
    only on which ops are done)."""
    S = schedule.num_stages
    dur = [op_ms[k] if op_ms else [0.0] * S for k in KINDS]
    comm = comm_ms if comm_ms is not None else [0.0] * max(S - 1, 0)
    starts = [[0.0] * len(ops) for ops in schedule.device_ops]
    ends = [[0.0] * len(ops) for ops in schedule.device_ops]
    end = [0.0] * (4 * S * schedule.num_microbatches)
    free = list(ready) if ready is not None else [0.0] * schedule.num_devices
    fields = [iter(order)] * 9
    for d, i, key, kind, s, first, first_comm, second, second_comm in zip(*fields):
        start = free[d]
        if first >= 0:
            start = max(start, end[first] + comm[first_comm] if first_comm >= 0 else end[first])
            if second >= 0:
                start = max(start, end[second] + comm[second_comm] if second_comm >= 0 else end[second])
        t = start + dur[kind][s]
        end[key] = free[d] = t
        starts[d][i], ends[d][i] = start, t
    return starts, ends


class _Executor:
    def __init__(self, schedule: Schedule, backward_kind: bytes | bytearray, op_ms, comm_ms) -> None:  # type: ignore[no-untyped-def]
        S, m = schedule.num_stages, schedule.num_microbatches
        self.schedule, self.backward_kind, self.S, self.m, self.n = schedule, backward_kind, S, m, S * m
        self.dur = {k: (op_ms[k] if op_ms else [0.0] * S) for k in "FBIW"}
        self.comm = comm_ms if comm_ms is not None else [0.0] * max(S - 1, 0)
        self.end: list[float | None] = [None] * (4 * self.n)  # by key = kind_index * n + stage * m + mb

    def ready(self, d: int, o: Op, start: float) -> tuple[float, int]:
        """(start time, -1) for op `o` on device `d` free at `start`, or (_, key it waits on)."""
        first, first_comm, second, second_comm = dependencies(self.schedule, self.backward_kind, d, o)
        for key, boundary in ((first, first_comm), (second, second_comm)):
            if key < 0:
                break
            e = self.end[key]
            if e is None:
                return start, key
            start = max(start, e + self.comm[boundary] if boundary >= 0 else e)
        return start, -1

    def run(
        self, fused: Mapping[tuple[int, int], float], ready: Sequence[float] | None
    ) -> tuple[list[list[float]], list[list[float]]]:
        device_ops, n, m, end, dur = self.schedule.device_ops, self.n, self.m, self.end, self.dur
        starts = [[0.0] * len(ops) for ops in device_ops]
        ends = [[0.0] * len(ops) for ops in device_ops]
        pos, free = [0] * len(device_ops), list(ready) if ready is not None else [0.0] * len(device_ops)
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
