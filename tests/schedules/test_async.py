"""Asynchronous schedules (pipedream, pipedream-2bw): the weight versions on their ops follow the papers' rules, the
version checks catch every kind of broken list, the memory model charges stashed weight copies, and the steady-state
step has no bubble."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.errors import FormatError, ScheduleError
from pipeplan.schedules import MemoryCosts, Op, Schedule, StageCosts, generate, simulate, validate
from pipeplan.schedules.simulate import peak_activation_per_device, stream_step_ms, stream_steps
from pipeplan.schedules.versions import check_versions


def _forward_versions(schedule: Schedule) -> dict[tuple[int, int], int]:
    return {(o.stage, o.microbatch): o.version for ops in schedule.device_ops for o in ops if o.kind == "F"}


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize(("m", "steps"), [(1, 1), (2, 3), (4, 2), (7, 4)])
def test_pipedream_forward_reads_the_newest_version_and_backward_the_stashed_one(p, m, steps):
    schedule = generate("pipedream", num_devices=p, num_microbatches=m, steps=steps)
    validate(schedule)
    assert schedule.num_microbatches == steps * m and schedule.update_every == 1
    for device, ops in enumerate(schedule.device_ops):
        backwards_done = 0  # one update per microbatch: the newest version is the number of backwards run
        for o in ops:
            if o.kind == "F":
                assert o.version == backwards_done == max(0, o.microbatch - (p - 1 - device)), o
            else:
                assert o.version == _forward_versions(schedule)[(o.stage, o.microbatch)]
                backwards_done += 1


@pytest.mark.parametrize("p", [1, 2, 4])
def test_pipedream_stashes_p_minus_d_versions_on_device_d(p):
    schedule = generate("pipedream", num_devices=p, num_microbatches=4, steps=stream_steps(p, 4))
    assert check_versions(schedule) == tuple(p - d for d in range(p))


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (3, 2), (4, 3), (4, 8), (5, 4)])
def test_2bw_every_microbatch_of_step_t_uses_version_t_minus_1_on_every_stage(p, m):
    steps = 4
    schedule = generate("pipedream-2bw", num_devices=p, num_microbatches=m, steps=steps)
    validate(schedule)
    assert schedule.update_every == m and schedule.weight_versions == 2
    for ops in schedule.device_ops:
        for o in ops:
            assert o.version == max(0, o.microbatch // m - 1), o
    assert check_versions(schedule) == (2,) * p  # double buffering: never a third copy


def test_2bw_refuses_too_few_microbatches_for_two_versions():
    generate("pipedream-2bw", num_devices=5, num_microbatches=2, steps=1)  # one step never needs a second version
    with pytest.raises(ScheduleError) as info:
        generate("pipedream-2bw", num_devices=5, num_microbatches=2, steps=2)
    assert "\n" not in str(info.value) and "--microbatches" in str(info.value)


def _replace_op(schedule: Schedule, device: int, step: int, op: Op, **fields) -> Schedule:
    rows = [list(ops) for ops in schedule.device_ops]
    rows[device][step] = op
    return Schedule(**{**schedule.__dict__, "device_ops": tuple(map(tuple, rows)), **fields})


def test_validate_catches_a_backward_on_another_version_than_its_forward():
    schedule = generate("pipedream", num_devices=2, num_microbatches=4, steps=2)
    step = next(i for i, o in enumerate(schedule.device_ops[0]) if o.kind == "B" and o.microbatch == 3)
    wrong = _replace_op(schedule, 0, step, Op("B", 0, 3, 0))
    with pytest.raises(ScheduleError, match=r"0B3v0 .* uses weight version 0 but its forward 0F3 used version 2"):
        validate(wrong)


def test_validate_catches_a_forward_reading_a_version_not_made_yet():
    schedule = generate("pipedream-2bw", num_devices=2, num_microbatches=2, steps=3)
    wrong = Schedule(
        **{
            **schedule.__dict__,
            "device_ops": tuple(
                tuple(Op(o.kind, o.stage, o.microbatch, o.microbatch // 2) for o in ops) for ops in schedule.device_ops
            ),
        }
    )
    with pytest.raises(ScheduleError, match="reads weight version 1 of stage 0, which is not made yet"):
        validate(wrong)


def test_validate_enforces_the_version_bound_and_the_tags():
    schedule = generate("pipedream", num_devices=3, num_microbatches=3, steps=3)
    with pytest.raises(ScheduleError, match="holding 3 weight versions, over the schedule's bound of 2"):
        validate(Schedule(**{**schedule.__dict__, "weight_versions": 2}))
    untagged = _replace_op(schedule, 1, 0, Op("F", 1, 0))
    with pytest.raises(ScheduleError, match="carries no weight version"):
        validate(untagged)
    sync = generate("1f1b", num_devices=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="carries a weight version but the schedule is synchronous"):
        validate(_replace_op(sync, 0, 0, Op("F", 0, 0, 0)))
    with pytest.raises(ScheduleError, match="whole update groups"):
        Schedule(**{**schedule.__dict__, "update_every": 2})


@pytest.mark.parametrize("p", [2, 4])
def test_memory_counts_stashed_weight_copies(p):
    """Unit activations per microbatch and a weight copy of 10: in steady state pipedream's device d holds p-d
    microbatches and p-d versions (p-d-1 stashed copies); 2BW holds one stashed copy."""
    memory = MemoryCosts(activation_bytes=1.0, weight_version_bytes=10.0)
    pipedream = generate("pipedream", num_devices=p, num_microbatches=4, steps=stream_steps(p, 4))
    assert peak_activation_per_device(pipedream, memory) == tuple((p - d) + 10.0 * (p - d - 1) for d in range(p))
    two = generate("pipedream-2bw", num_devices=p, num_microbatches=4, steps=stream_steps(p, 4))
    assert peak_activation_per_device(two, memory) == tuple((p - d) + 10.0 for d in range(p))
    plain = generate("1f1b", num_devices=p, num_microbatches=4)
    assert peak_activation_per_device(plain, memory) == tuple(float(p - d) for d in range(p))  # no versions
    timed = simulate(two, memory=MemoryCosts(activation_bytes=1.0, weight_version_bytes=10.0, static_bytes=3.0))
    assert timed.peak_memory_bytes == tuple(3.0 + (p - d) + 10.0 for d in range(p))


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
@pytest.mark.parametrize(("p", "m"), [(1, 2), (4, 3), (4, 8), (3, 1)])
def test_steady_state_has_no_bubble(name, p, m):
    """Balanced stages: one microbatch per F + B on every device, i.e. m (F + B) per step; a flushed 1F1B step
    takes (m + p - 1)(F + B)."""
    costs = StageCosts(forward_ms=1.0, backward_ms=2.0)
    if name == "pipedream-2bw" and m < p - 1:
        pytest.skip("2bw needs m >= p - 1")
    stream = generate(name, num_devices=p, num_microbatches=m, steps=stream_steps(p, m))
    assert stream_step_ms(simulate(stream, costs), m) == pytest.approx(3.0 * m)
    flushed = simulate(generate("1f1b", num_devices=p, num_microbatches=m), costs).makespan
    assert flushed == pytest.approx(3.0 * (m + p - 1))


def test_steady_state_runs_at_the_slowest_stage():
    costs = StageCosts(forward_ms=(1.0, 2.0, 1.0), backward_ms=(2.0, 5.0, 1.0))
    stream = generate("pipedream-2bw", num_devices=3, num_microbatches=4, steps=stream_steps(3, 4))
    assert stream_step_ms(simulate(stream, costs), 4) == pytest.approx(4 * 7.0)


def test_steady_state_needs_a_long_enough_stream():
    short = simulate(generate("pipedream", num_devices=4, num_microbatches=2, steps=3))
    with pytest.raises(ScheduleError, match="at least 7"):
        stream_step_ms(short, 2)


def test_versions_round_trip_as_text_and_json_but_not_csv():
    assert str(Op.parse("0F5v2")) == "0F5v2" and Op.parse(" 3B12v0 ") == Op("B", 3, 12, 0)
    schedule = generate("pipedream-2bw", num_devices=3, num_microbatches=2, steps=3)
    assert Schedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule
    with pytest.raises(ScheduleError, match="asynchronous"):
        schedule.to_csv()
    with pytest.raises(FormatError, match="weight versions"):
        Schedule.from_csv("0F0v0,0B0v0\n")
    with pytest.raises(ScheduleError, match="--steps"):
        generate("1f1b", num_devices=2, num_microbatches=2, steps=2)


def test_simulate_cli_prints_the_steady_state():
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "--schedule", "pipedream", "-p", "4", "-m", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["steady_microbatch_ms"] == pytest.approx(3.0)  # F 1 + B (I 1 + W 1)
    assert data["weight_versions_per_stage"] == [4, 3, 2, 1] and data["num_microbatches"] == 5 * 8
    text = runner.invoke(app, ["simulate", "--schedule", "pipedream-2bw", "-p", "2", "-m", "2"]).output
    assert "steady state (no flush): 3.000 ms per microbatch" in text and "per stage: 2, 2" in text
