"""One `validate(schedule)`: every (stage, microbatch) runs F, then B or (I then W), exactly once, on its stage's
device; cross-stage dependencies hold; the per-device lists run in order without deadlock; asynchronous schedules
follow the weight-version rule (`versions.check_versions`: each backward uses its forward's version, a stage holds
at most `weight_versions`). Failures raise ScheduleError with a step x device grid of op strings, the failing op
marked `[1F3]!`.

`check_complete` is the one completeness rule (each (stage, microbatch) has one F and either one B or one I and
one W; an OVERLAP_F_B op counts as its two halves, `Op.parts`): validate, the plan-file check and the runtime's
routing call it. The dependencies are the timing engine's (`engine.py`), the same ones `simulate()` times.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence

from pipeplan.errors import ScheduleError
from pipeplan.schedules.engine import Order, replay, timing_order
from pipeplan.schedules.ops import KIND_INDEX, Op, Schedule, format_grid
from pipeplan.schedules.versions import check_versions

_F, _B, _I, _W = (1 << KIND_INDEX[kind] for kind in "FBIW")
COMPLETE_RULE = "each needs F and either B or I and W"


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (with a marked grid) unless `schedule` is complete, well placed and deadlock-free."""
    run_in_order(schedule)


def run_in_order(
    schedule: Schedule,
    *,
    op_ms: Mapping[str, Sequence[float]] | None = None,
    comm_ms: Sequence[float] | None = None,
    overlap_ms: float | None = None,
    ready: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Validate (`checked`: once per Schedule object), then time every device's list in order (`engine.replay`
    along the checked order: durations `op_ms[kind][stage]`, all 0 when None; `comm_ms[boundary]` across devices;
    an OVERLAP_F_B op `engine.overlapped_ms(F, B, overlap_ms)`; `ready[d]`: when device d may start, default 0).
    Returns per-device start and end times, aligned with `device_ops`."""
    _, order = checked(schedule)
    return replay(schedule, order, op_ms, comm_ms, overlap_ms, ready)


_CHECKED: dict[int, tuple[weakref.ref, tuple[bytes, Order]]] = {}  # id(schedule) -> (the schedule, `checked`)


def checked(schedule: Schedule) -> tuple[bytes, Order]:
    """`check_schedule(schedule)`, kept while the Schedule object lives: the checks depend on its op lists alone,
    which are immutable, so a schedule timed under many costs (a search) is checked once."""
    key = id(schedule)
    entry = _CHECKED.get(key)
    if entry is not None and entry[0]() is schedule:
        return entry[1]
    result = check_schedule(schedule)

    def forget(_: weakref.ref) -> None:  # the schedule is gone: so is its entry
        _CHECKED.pop(key, None)

    _CHECKED[key] = (weakref.ref(schedule, forget), result)
    return result


def check_schedule(schedule: Schedule) -> tuple[bytes, Order]:
    """Raise ScheduleError (with a marked grid) unless the op lists are well placed, complete, follow the
    weight-version rule and run without deadlock; returns `check_complete`'s backward kinds and the
    `engine.timing_order`."""
    _check_placement(schedule)
    try:
        ops = itertools.chain.from_iterable(schedule.device_ops)
        backward_kind = bytes(check_complete(ops, schedule.num_stages, schedule.num_microbatches))
    except ScheduleError as exc:
        raise ScheduleError(f"schedule {schedule.name!r}: {exc}\n" + format_grid(schedule, marks=set())) from None
    check_versions(schedule)
    return backward_kind, timing_order(schedule, backward_kind)


def check_complete(ops: Iterable[Op], num_stages: int, num_microbatches: int) -> bytearray:
    """Raise ScheduleError (one line) unless `ops` (in any order; an OVERLAP_F_B as its two halves) run every
    (stage, microbatch) F once and either B once or I and W once each. Returns, per slot
    stage * num_microbatches + microbatch, the kind index (B or I) that carries its input gradient — what
    `engine.execute` needs."""
    m = num_microbatches
    has = bytearray(num_stages * m)  # bit mask over kinds, bit KIND_INDEX[kind]
    for o in ops:
        if o.halves is not None:  # an OVERLAP_F_B: its halves
            _count(o.halves[0], has, num_stages, m)
            o = o.halves[1]
        _count(o, has, num_stages, m)
    return _backward_kinds(has, m)


def _count(o: Op, has: bytearray, num_stages: int, m: int) -> None:
    if o.stage >= num_stages or o.microbatch >= m:
        raise ScheduleError(f"op {o} is outside {num_stages} stage(s) x {m} microbatch(es)")
    slot, bit = o.stage * m + o.microbatch, 1 << KIND_INDEX[o.kind]
    if has[slot] & bit:
        raise ScheduleError(f"stage {o.stage} microbatch {o.microbatch}: {o} runs twice ({COMPLETE_RULE})")
    has[slot] |= bit


def _backward_kinds(has: bytearray, m: int) -> bytearray:
    backward_kind = bytearray(len(has))
    for slot, mask in enumerate(has):
        if mask in (_F | _B, _F | _I | _W):
            backward_kind[slot] = KIND_INDEX["B" if mask & _B else "I"]
            continue
        stage, mb = divmod(slot, m)
        if not mask & _F:
            problem = f"has no forward {stage}F{mb}"
        elif mask & _B:
            problem = "has both a full backward B and a split backward I/W"
        elif not mask & (_I | _W):
            problem = f"has no backward: {stage}B{mb} (or {stage}I{mb} and {stage}W{mb}) is missing"
        else:
            problem = f"{stage}{'I' if not mask & _I else 'W'}{mb} is missing"
        raise ScheduleError(f"stage {stage} microbatch {mb} {problem} ({COMPLETE_RULE})")
    return backward_kind


def _steps(ops: Sequence[Op]) -> Iterable[tuple[int, Op]]:
    """(step, op) of a device's list, an OVERLAP_F_B as its two halves at its step."""
    if not any(o.halves is not None for o in ops):
        return enumerate(ops)
    return ((step, part) for step, op in enumerate(ops) for part in op.parts)


def _check_placement(schedule: Schedule) -> None:
    m, n = schedule.num_microbatches, schedule.num_stages * schedule.num_microbatches
    seen = bytearray(4 * n)
    for device, ops in enumerate(schedule.device_ops):
        for step, o in _steps(ops):
            problem = None
            if o.stage >= schedule.num_stages:
                problem = f"stage {o.stage} does not exist ({schedule.num_stages} stages)"
            elif o.microbatch >= m:
                problem = f"microbatch {o.microbatch} does not exist ({m} microbatches)"
            elif (placed := schedule.op_device(o.stage, o.microbatch)) != device:
                problem = f"stage {o.stage} is placed on device {placed} for microbatch {o.microbatch}, not {device}"
            elif seen[KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch]:
                problem = "it runs twice"
            if problem:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: op {o} on device {device} at step {step}: {problem}\n"
                    + format_grid(schedule, marks={(device, step)})
                )
            seen[KIND_INDEX[o.kind] * n + o.stage * m + o.microbatch] = 1
