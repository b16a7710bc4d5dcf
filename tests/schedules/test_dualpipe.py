"""DualPipe (bidirectional, two mirrored copies of every stage) against the DualPipe README's figures and against
DualPipeV, the same schedule cut in half; its mirrored placement through validate, JSON and CSV."""

from __future__ import annotations

import json

import pytest

from pipeplan.errors import ScheduleError
from pipeplan.schedules import Op, Schedule, generate, validate
from pipeplan.schedules.ops import OVERLAP
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, peak_activation_per_device, simulate

SIZES = [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 20)]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_each_direction_runs_its_microbatches_on_its_own_copy(p, m):
    schedule = generate("dualpipe", num_devices=p, num_microbatches=m)
    validate(schedule)
    assert schedule.mirrored and schedule.num_stages == p
    for device, ops in enumerate(schedule.device_ops):
        assert schedule.device_stages(device) == (device, p - 1 - device)
        for o in (h for op in ops for h in op.parts):
            direction = o.microbatch % 2  # even: enters at device 0, stage s on device s; odd: on device p-1-s
            assert device == (o.stage if direction == 0 else p - 1 - o.stage), (device, str(o))
    forwards = [h for ops in schedule.device_ops for op in ops for h in op.parts if h.kind == "F"]
    assert len(forwards) == p * m  # every microbatch through every stage once, in its own direction


@pytest.mark.parametrize("w", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_bubble_is_the_readme_formula(p, w):
    """DualPipe README: bubble (PP/2-1)(F&B+B-3W); here F = I = 1 (B = 1 + W) and F&B = F + B (no overlap gain,
    what a CPU gets), W <= F; the first and last devices wait that long, the middle ones less."""
    f, i = 1.0, 1.0
    b = i + w
    timeline = simulate(generate("dualpipe", num_devices=p, num_microbatches=2 * p + 4), _costs(f, i, w))
    bubbles = [span - busy for span, busy in zip(timeline.device_span, timeline.device_busy)]
    assert max(bubbles) == pytest.approx((p / 2 - 1) * ((f + b) + b - 3 * w))
    assert bubbles[0] == bubbles[-1] == max(bubbles)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_activation_memory_is_pp_plus_one(p, m):
    """DualPipe README: activation memory PP+1 (microbatches of one stage, held until W), on every device."""
    schedule = generate("dualpipe", num_devices=p, num_microbatches=m)
    assert peak_activation_per_device(schedule, MemoryCosts(activation_bytes=1.0)) == (p + 1,) * p


@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize("input_grad_ms", [1.0, 1.2])
def test_cut_in_half_dualpipev_keeps_the_bubble_and_the_activations(p, m, input_grad_ms):
    """DualPipeV on p/2 devices with m/2 microbatches (each through both chunks) has, device for device, the
    bubble and the peak activations of DualPipe's mirrored pair of devices (h, p-1-h) with m microbatches: equal
    bubbles where I = F; otherwise DualPipe's middle devices, running their first F0 and B1 apart, shorten it."""
    costs = _costs(1.0, input_grad_ms, 0.6)
    dual_schedule = generate("dualpipe", num_devices=p, num_microbatches=m)
    v_schedule = generate("dualpipev", num_devices=p // 2, num_microbatches=m // 2)
    dual, v = simulate(dual_schedule, costs), simulate(v_schedule, costs)
    dual_bubbles = [span - busy for span, busy in zip(dual.device_span, dual.device_busy)]
    v_bubbles = [span - busy for span, busy in zip(v.device_span, v.device_busy)]
    mirrored = [v_bubbles[min(d, p - 1 - d)] for d in range(p)]
    if input_grad_ms == 1.0:
        assert dual_bubbles == pytest.approx(mirrored)
        assert dual.bubble_rate == pytest.approx(v.bubble_rate)
    else:
        assert all(b <= mb + 1e-9 for b, mb in zip(dual_bubbles, mirrored)) and dual.makespan <= v.makespan + 1e-9
    memory = MemoryCosts(activation_bytes=1.0, input_grad_freed_bytes=0.5)
    peaks = peak_activation_per_device(v_schedule, memory)
    assert peak_activation_per_device(dual_schedule, memory) == tuple(peaks[min(d, p - 1 - d)] for d in range(p))


def test_the_middle_devices_run_their_first_main_step_apart():
    """DualPipe's step 4 on the middle devices (h = p/2 - 1) starts with F0 and B1 as two ops, not one pair."""
    schedule = generate("dualpipe", num_devices=4, num_microbatches=8)
    for device in (1, 2):
        texts = [str(o) for o in schedule.device_ops[device]]
        first_pair = next(i for i, t in enumerate(texts) if OVERLAP in t)
        assert [schedule.device_ops[device][first_pair - k].kind for k in (2, 1)] == ["F", "B"]
    assert OVERLAP in str(schedule.device_ops[0][7])  # the outer devices' first main step is a pair


@pytest.mark.parametrize(
    ("p", "m", "match"), [(3, 8, "even --stages"), (4, 6, "--microbatches >= 2 x --stages"), (4, 9, "even")]
)
def test_refusals_name_the_option(p, m, match):
    with pytest.raises(ScheduleError, match=match):
        generate("dualpipe", num_devices=p, num_microbatches=m)


def test_a_mirrored_op_on_the_wrong_device_is_refused():
    schedule = generate("dualpipe", num_devices=2, num_microbatches=4)
    rows = [list(ops) for ops in schedule.device_ops]
    rows[0][0], rows[1][0] = rows[1][0], rows[0][0]  # 0F0 (direction 0: device 0) and 0F1 swapped
    swapped = Schedule(
        name="swapped",
        num_devices=2,
        num_stages=2,
        num_microbatches=4,
        stage_device=schedule.stage_device,
        device_ops=tuple(map(tuple, rows)),
        mirrored=True,
    )
    with pytest.raises(ScheduleError, match="op 0F1 on device 0 .* placed on device 1 for microbatch 1, not 0"):
        validate(swapped)


def test_json_keeps_the_mirrored_placement_and_csv_refuses_it():
    schedule = generate("dualpipe", num_devices=4, num_microbatches=8)
    back = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert back == schedule and back.mirrored
    with pytest.raises(ScheduleError, match="two devices"):
        schedule.to_csv()
    with pytest.raises(ScheduleError, match="mirrored"):
        Schedule(
            name="x",
            num_devices=3,
            num_stages=3,
            num_microbatches=2,
            stage_device=(0, 1, 2),
            device_ops=((),) * 3,
            mirrored=True,
        )
    assert Op.parse("(0F2;1B1)OVERLAP_F_B").parts == (Op("F", 0, 2), Op("B", 1, 1))


def _costs(f: float, i: float, w: float, overlap_ms: float | None = None) -> StageCosts:
    return StageCosts(forward_ms=f, input_grad_ms=i, weight_grad_ms=w, overlap_ms=overlap_ms)
