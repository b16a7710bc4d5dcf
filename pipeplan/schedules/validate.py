"""One `validate(schedule)`: every (stage, microbatch) runs F, then B or (I then W), exactly once, on its stage's
device; cross-stage dependencies hold; the per-device lists run in order without deadlock. Failures raise
ScheduleError with a step x device grid of op strings, the failing op marked `[1F3]!`.

Dependencies (the same ones `simulate()` times): F(s, mb) needs F(s-1, mb); I/B(s, mb) needs F(s, mb) and the
backward (I or B) of (s+1, mb); W(s, mb) needs I(s, mb).
"""

from __future__ import annotations

from collections import defaultdict

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import Op, Schedule

Key = tuple[str, int, int]  # (kind, stage, microbatch)
_GRID_ROWS = 12  # rows shown either side of the failing step


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (with a marked grid) unless `schedule` is complete, well placed and deadlock-free."""
    validated_order(schedule)


def validated_order(schedule: Schedule) -> list[tuple[int, Op, tuple[Key, ...]]]:
    """`validate()` and return `execution_order()` (what `simulate()` walks)."""
    _check_placement(schedule)
    _check_complete(schedule)
    return execution_order(schedule)


def execution_order(schedule: Schedule) -> list[tuple[int, Op, tuple[Key, ...]]]:
    """(device, op, dependency keys) for every op, in an order where each op follows its dependencies and the
    ops before it on its device. Raises ScheduleError naming the stuck ops when the lists deadlock."""
    bwd_kind = backward_kinds(schedule)
    last = schedule.num_stages - 1
    done: set[Key] = set()
    waiting: dict[Key, list[int]] = defaultdict(list)
    pos = [0] * schedule.num_devices
    runnable = list(range(schedule.num_devices - 1, -1, -1))
    order: list[tuple[int, Op, tuple[Key, ...]]] = []
    while runnable:
        device = runnable.pop()
        ops = schedule.device_ops[device]
        while pos[device] < len(ops):
            o = ops[pos[device]]
            deps = dependency_keys(o, bwd_kind, last)
            missing = next((k for k in deps if k not in done), None)
            if missing is not None:
                waiting[missing].append(device)
                break
            key = (o.kind, o.stage, o.microbatch)
            done.add(key)
            order.append((device, o, deps))
            pos[device] += 1
            runnable.extend(waiting.pop(key, ()))
    stuck = [(d, pos[d]) for d in range(schedule.num_devices) if pos[d] < len(schedule.device_ops[d])]
    if stuck:
        d, step = stuck[0]
        o = schedule.device_ops[d][step]
        need = next(k for k in dependency_keys(o, bwd_kind, last) if k not in done)
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks: device {d} waits at step {step} on {o} for "
            f"{need[1]}{need[0]}{need[2]}, which never runs first (reorder the op lists)\n"
            + format_grid(schedule, marks=set(stuck))
        )
    return order


def backward_kinds(schedule: Schedule) -> dict[tuple[int, int], str]:
    """(stage, microbatch) -> "B" or "I": which op carries that microbatch's input gradient."""
    kinds: dict[tuple[int, int], str] = {}
    for ops in schedule.device_ops:
        for o in ops:
            if o.kind == "B" or o.kind == "I":
                kinds[(o.stage, o.microbatch)] = o.kind
    return kinds


def dependency_keys(o: Op, bwd_kind: dict[tuple[int, int], str], last_stage: int) -> tuple[Key, ...]:
    kind, stage, mb = o.kind, o.stage, o.microbatch
    if kind == "F":
        return (("F", stage - 1, mb),) if stage > 0 else ()
    if kind == "W":
        return (("I", stage, mb),)
    if stage < last_stage:
        return (("F", stage, mb), (bwd_kind.get((stage + 1, mb), "I"), stage + 1, mb))
    return (("F", stage, mb),)


def _check_placement(schedule: Schedule) -> None:
    seen: set[Op] = set()
    for device, ops in enumerate(schedule.device_ops):
        for step, o in enumerate(ops):
            problem = None
            if o.stage >= schedule.num_stages:
                problem = f"stage {o.stage} does not exist ({schedule.num_stages} stages)"
            elif o.microbatch >= schedule.num_microbatches:
                problem = f"microbatch {o.microbatch} does not exist ({schedule.num_microbatches} microbatches)"
            elif schedule.stage_device[o.stage] != device:
                problem = f"stage {o.stage} is placed on device {schedule.stage_device[o.stage]}, not {device}"
            elif o in seen:
                problem = "it runs twice"
            if problem:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: op {o} on device {device} at step {step}: {problem}\n"
                    + format_grid(schedule, marks={(device, step)})
                )
            seen.add(o)


def _check_complete(schedule: Schedule) -> None:
    present = {(o.kind, o.stage, o.microbatch) for ops in schedule.device_ops for o in ops}
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            has = {k for k in "FBIW" if (k, stage, mb) in present}
            problem = None
            if "F" not in has:
                problem = f"has no forward {stage}F{mb}"
            elif "B" in has and has & {"I", "W"}:
                problem = "has both a full backward B and a split backward I/W"
            elif "B" not in has and has & {"I", "W"} != {"I", "W"}:
                missing = "I" if "I" not in has else "W"
                problem = f"needs B or both I and W; {stage}{missing}{mb} is missing"
            if problem:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: stage {stage} microbatch {mb} {problem}\n"
                    + format_grid(schedule, marks=set())
                )


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
