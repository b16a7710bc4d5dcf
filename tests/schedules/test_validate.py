"""validate() catches broken schedules and shows a step x device grid with the failing op marked."""

from __future__ import annotations

import re

import pytest

from pipeplan.errors import ScheduleError
from pipeplan.schedules import Op, Schedule, generate, validate
from pipeplan.schedules.ops import KIND_INDEX, make_schedule
from pipeplan.schedules.validate import check_complete


def _edit(schedule: Schedule, device: int, ops: list[Op]) -> Schedule:
    rows = [list(r) for r in schedule.device_ops]
    rows[device] = ops
    return make_schedule("broken", schedule.num_microbatches, schedule.stage_device, rows)


def test_deadlock_grid_marks_stuck_op():
    good = generate("1f1b", num_devices=2, num_microbatches=4)
    # device 1 runs 1F3 first: it needs 0F3, which device 0 only runs after 0B0, which needs 1B0 -> deadlock
    row = list(good.device_ops[1])
    row.remove(Op("F", 1, 3))
    broken = _edit(good, 1, [Op("F", 1, 3), *row])
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "deadlocks" in message.splitlines()[0]
    assert "[1F3]!" in message
    assert "dev 0" in message and "dev 1" in message and "step 0" in message


def test_backward_before_forward():
    good = generate("gpipe", num_devices=1, num_microbatches=2)
    broken = _edit(good, 0, [Op("B", 0, 0), Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 1)])
    with pytest.raises(ScheduleError, match=r"\[0B0\]!"):
        validate(broken)


def test_w_before_i_is_caught():
    broken = make_schedule("x", 1, (0,), [[Op("F", 0, 0), Op("W", 0, 0), Op("I", 0, 0)]])
    with pytest.raises(ScheduleError, match=r"\[0W0\]!"):
        validate(broken)


def test_missing_weight_grad():
    broken = make_schedule("x", 1, (0,), [[Op("F", 0, 0), Op("I", 0, 0)]])
    with pytest.raises(ScheduleError, match="0W0 is missing"):
        validate(broken)


def test_both_full_and_split_backward():
    broken = make_schedule("x", 1, (0,), [[Op("F", 0, 0), Op("B", 0, 0), Op("I", 0, 0), Op("W", 0, 0)]])
    with pytest.raises(ScheduleError, match="both"):
        validate(broken)


def test_wrong_device_and_duplicates_and_range():
    good = generate("1f1b", num_devices=2, num_microbatches=2)
    moved = _edit(good, 0, [*good.device_ops[0], Op("F", 1, 0)])
    with pytest.raises(ScheduleError, match=r"placed on device 1.*\n(.|\n)*\[1F0\]!"):
        validate(moved)
    twice = _edit(good, 0, [*good.device_ops[0], Op("F", 0, 0)])
    with pytest.raises(ScheduleError, match="runs twice"):
        validate(twice)
    beyond = _edit(good, 0, [*good.device_ops[0], Op("F", 0, 9)])
    with pytest.raises(ScheduleError, match="microbatch 9 does not exist"):
        validate(beyond)


def test_missing_forward():
    broken = make_schedule("x", 2, (0,), [[Op("F", 0, 0), Op("B", 0, 0)]])
    with pytest.raises(ScheduleError, match="no forward 0F1"):
        validate(broken)


def test_grid_is_windowed_for_long_schedules():
    good = generate("1f1b", num_devices=2, num_microbatches=64)
    row = list(good.device_ops[1])
    row.remove(Op("F", 1, 63))
    broken = _edit(good, 1, [*row[:100], Op("F", 1, 63), *row[100:]])
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "[1F63]!" in message and "earlier steps" in message and len(message.splitlines()) < 40


def test_check_complete_is_the_one_completeness_rule():
    ops = [Op("F", 0, 0), Op("B", 0, 0), Op("F", 0, 1), Op("I", 0, 1), Op("W", 0, 1)]
    assert list(check_complete(reversed(ops), 1, 2)) == [KIND_INDEX["B"], KIND_INDEX["I"]]
    cases = [
        (ops[:4], "stage 0 microbatch 1 0W1 is missing"),
        ([*ops, Op("W", 0, 1)], "0W1 runs twice"),
        ([*ops, Op("I", 0, 0), Op("W", 0, 0)], "both a full backward B and a split backward I/W"),
        ([*ops, Op("F", 1, 0)], "op 1F0 is outside 1 stage(s) x 2 microbatch(es)"),
        ([o for o in ops if o != Op("F", 0, 1)], "no forward 0F1"),
        ([ops[0], *ops[2:]], "no backward: 0B0 (or 0I0 and 0W0) is missing"),
    ]
    for broken, message in cases:
        with pytest.raises(ScheduleError, match=re.escape(message)) as info:
            check_complete(broken, 1, 2)
        assert "\n" not in str(info.value)
