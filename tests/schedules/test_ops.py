"""Op text form, Schedule CSV / JSON round trips, and torch's CSV loader accepting our CSV."""

from __future__ import annotations

import json

import pytest

from pipeplan.errors import FormatError, PipeplanError, ScheduleError
from pipeplan.schedules import SCHEDULE_NAMES, Op, Schedule, generate, schedule_info
from pipeplan.schedules.placement import stage_copies


def _examples() -> list[Schedule]:
    """Every synchronous schedule with one copy of each stage (torch's CSV has no weight versions: the asynchronous
    ones round-trip through JSON in tests/schedules/test_async.py; dualpipe's mirrored copies, which torch's CSV
    cannot place, in tests/schedules/test_dualpipe.py)."""
    synchronous = [
        name
        for name in SCHEDULE_NAMES
        if not schedule_info(name).asynchronous and stage_copies(schedule_info(name).placement) == 1
    ]
    return [generate(name, num_devices=3, num_microbatches=6) for name in synchronous if name != "interleaved"] + [
        generate("interleaved", num_devices=3, num_microbatches=6, chunks=3)
    ]


@pytest.mark.parametrize("text", ["2F0", "1I3", "0W2", "12B105"])
def test_op_text_round_trip(text):
    assert str(Op.parse(text)) == text
    assert Op.parse(f"  {text} ") == Op.parse(text)


def test_op_positional_and_fields():
    o = Op("I", 1, 3)
    assert (o.kind, o.stage, o.microbatch) == ("I", 1, 3) and str(o) == "1I3"


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "-1F0", "1UNSHARD", "1F0x"])
def test_op_parse_rejects(bad):
    with pytest.raises(FormatError, match="bad op"):
        Op.parse(bad)


def test_op_rejects_bad_kind():
    with pytest.raises(ScheduleError):
        Op("Q", 0, 0)


@pytest.mark.parametrize("schedule", _examples(), ids=lambda s: s.name)
def test_csv_round_trip(schedule):
    text = schedule.to_csv()
    assert len(text.splitlines()) == schedule.num_devices
    back = Schedule.from_csv(text, name=schedule.name)
    assert back == schedule


@pytest.mark.parametrize("schedule", _examples(), ids=lambda s: s.name)
def test_json_round_trip(schedule):
    data = json.loads(json.dumps(schedule.to_dict()))
    assert data["schema_version"] == 1
    assert Schedule.from_dict(data) == schedule


def test_from_csv_errors():
    with pytest.raises(FormatError, match="empty"):
        Schedule.from_csv("")
    with pytest.raises(FormatError, match="devices 0 and 1"):
        Schedule.from_csv("0F0,0B0\n0F1\n")
    with pytest.raises(FormatError, match="missing field"):
        Schedule.from_dict({"name": "x"})


def test_schedule_checks_shape():
    with pytest.raises(ScheduleError, match="stage_device"):
        Schedule(name="x", num_devices=1, num_stages=2, num_microbatches=1, stage_device=(0,), device_ops=((),))


@pytest.mark.parametrize("schedule", _examples(), ids=lambda s: s.name)
def test_torch_csv_loader_accepts_our_csv(schedule, tmp_path):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action

    path = tmp_path / "schedule.csv"
    path.write_text(schedule.to_csv())
    loader = PipelineScheduleMulti.__new__(PipelineScheduleMulti)  # no process group needed to parse
    loader.pipeline_order = {}
    loader.pp_group_size = schedule.num_devices
    loader._num_stages = schedule.num_stages
    loader._n_microbatches = schedule.num_microbatches
    loader._stages = []
    loader._load_csv(str(path))
    assert loader.stage_index_to_group_rank == dict(enumerate(schedule.stage_device))
    assert [[str(a) for a in row] for row in loader.pipeline_order.values()] == schedule.op_strings()
    assert all(isinstance(a, _Action) for row in loader.pipeline_order.values() for a in row)


def test_overlapped_op_text_round_trips_as_torch_writes_it():
    from pipeplan.schedules.ops import OVERLAP

    o = Op.overlap(Op("F", 0, 3), Op("B", 3, 1))
    assert str(o) == "(0F3;3B1)OVERLAP_F_B" and o.kind == OVERLAP  # torch's _Action repr of a composite
    assert Op.parse(str(o)) == o and Op.parse(" (0F3;3B1)OVERLAP_F_B ") == o
    assert o.parts == (Op("F", 0, 3), Op("B", 3, 1)) and Op("W", 1, 2).parts == (Op("W", 1, 2),)
    assert o.shifted(4) == Op.overlap(Op("F", 0, 7), Op("B", 3, 5)) and Op("I", 1, 2).shifted(3) == Op("I", 1, 5)
    schedule = generate("dualpipev", num_devices=2, num_microbatches=5)
    assert Schedule.from_csv(schedule.to_csv(), name="dualpipev") == schedule
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    from torch.distributed.pipelining import schedules as torch_schedules

    theirs = torch_schedules._Action.from_str(str(o))  # torch's composite action, its halves as sub-actions
    assert theirs.computation_type == torch_schedules.OVERLAP_F_B and [str(a) for a in theirs.sub_actions] == [
        "0F3",
        "3B1",
    ]
    rows = {d: [torch_schedules._Action.from_str(str(op)) for op in ops] for d, ops in enumerate(schedule.device_ops)}
    lowered = torch_schedules._add_send_recv(rows, lambda s: schedule.stage_device[s], schedule.num_stages)
    assert sum(str(a).endswith("OVERLAP_F_B") for a in lowered[0]) == sum(
        x.halves is not None for x in schedule.device_ops[0]
    )
    for bad in (
        "(0F3;3I1)OVERLAP_F_B",
        "(0B3;3F1)OVERLAP_F_B",
        "(1F3;1B1)OVERLAP_F_B",
        "(0F3)OVERLAP_F_B",
        "(0F3;3B1)",
    ):
        with pytest.raises(PipeplanError):
            Op.parse(bad)
