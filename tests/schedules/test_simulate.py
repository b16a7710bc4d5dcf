"""simulate(): heterogeneous costs, comm, memory, metrics and determinism."""

from __future__ import annotations

import random

import pytest

from pipeplan.errors import ConfigError
from pipeplan.schedules import SCHEDULE_NAMES, MemoryCosts, Op, StageCosts, generate, simulate
from pipeplan.schedules.engine import execute, replay
from pipeplan.schedules.ops import make_schedule
from pipeplan.schedules.validate import checked


def test_single_device_is_sum_of_ops():
    schedule = generate("1f1b", num_devices=1, num_microbatches=5)
    timeline = simulate(schedule, StageCosts(forward_ms=2, input_grad_ms=3, weight_grad_ms=4))
    assert timeline.makespan == 5 * (2 + 3 + 4)
    assert timeline.bubble_rate == 0 and timeline.zb_bubble_ms == 0


def test_heterogeneous_stage_costs_gpipe_by_hand():
    # gpipe, 2 stages, 2 microbatches; F = (1, 2), B = (3, 5)
    schedule = generate("gpipe", num_devices=2, num_microbatches=2)
    costs = StageCosts(forward_ms=(1, 2), input_grad_ms=(2, 3), weight_grad_ms=(1, 2))
    timeline = simulate(schedule, costs)
    times = {(e.device, str(e.op)): (e.start, e.end) for e in timeline.entries}
    assert times[(0, "0F0")] == (0, 1) and times[(0, "0F1")] == (1, 2)
    assert times[(1, "1F0")] == (1, 3) and times[(1, "1F1")] == (3, 5)
    assert times[(1, "1B0")] == (5, 10) and times[(1, "1B1")] == (10, 15)
    assert times[(0, "0B0")] == (10, 13) and times[(0, "0B1")] == (15, 18)
    assert timeline.makespan == 18
    assert timeline.device_span == (18, 14)
    assert timeline.device_busy == (8, 14)
    assert timeline.bubble_rate == pytest.approx(1 - 22 / 36)


def test_backward_ms_overrides_i_plus_w():
    schedule = generate("1f1b", num_devices=1, num_microbatches=1)
    assert simulate(schedule, StageCosts(backward_ms=7)).makespan == 8


def test_comm_charged_only_across_devices():
    costs = StageCosts(comm_ms=0.5)
    one = simulate(generate("1f1b", num_devices=2, num_microbatches=1), costs)
    assert one.makespan == 3 * 2 + 2 * 0.5  # one hop forward, one hop back
    # zbv: stages 1 -> 2 share the last device (free); 0 -> 1 and 2 -> 3 cross devices
    zbv = generate("zbv", num_devices=2, num_microbatches=1)
    base = simulate(zbv).makespan
    assert simulate(zbv, costs).makespan == base + 4 * 0.5  # 0->1 and 2->3, each forward and backward
    per_boundary = StageCosts(comm_ms=(0.25, 1.0, 0.25))  # the 1.0 boundary is on-device: free
    assert simulate(zbv, per_boundary).makespan == base + 4 * 0.25


def test_comm_grows_makespan_monotonically():
    schedule = generate("zb-h1", num_devices=4, num_microbatches=8)
    spans = [simulate(schedule, StageCosts(comm_ms=c)).makespan for c in (0, 0.1, 0.5, 1.0)]
    assert spans == sorted(spans) and spans[0] < spans[-1]


def test_memory_bytes_with_split_free():
    schedule = make_schedule(
        "x", 2, (0,), [[Op("F", 0, 0), Op("F", 0, 1), Op("I", 0, 0), Op("I", 0, 1), Op("W", 0, 0), Op("W", 0, 1)]]
    )
    mem = MemoryCosts(activation_bytes=10, input_grad_freed_bytes=6, static_bytes=100)
    assert simulate(schedule, memory=mem).peak_memory_bytes == (120,)
    late_f = make_schedule(
        "x", 2, (0,), [[Op("F", 0, 0), Op("I", 0, 0), Op("F", 0, 1), Op("W", 0, 0), Op("I", 0, 1), Op("W", 0, 1)]]
    )
    assert simulate(late_f, memory=mem).peak_memory_bytes == (100 + 4 + 10,)


def test_peak_memory_units_match_inflight():
    timeline = simulate(generate("1f1b", num_devices=4, num_microbatches=8))
    assert timeline.peak_memory_bytes == (4, 3, 2, 1)


def test_deterministic():
    schedule = generate("zb-auto", num_devices=4, num_microbatches=12)
    costs = StageCosts(forward_ms=(1, 1.5, 1, 2), comm_ms=0.2)
    assert simulate(schedule, costs) == simulate(schedule, costs)


def test_cost_validation():
    with pytest.raises(ConfigError, match="forward_ms has 2 values; expected 3"):
        simulate(generate("1f1b", num_devices=3, num_microbatches=3), StageCosts(forward_ms=(1, 2)))
    with pytest.raises(ConfigError, match="comm_ms"):
        StageCosts(comm_ms=-1)
    with pytest.raises(ConfigError, match="input_grad_freed_bytes"):
        simulate(
            generate("1f1b", num_devices=1, num_microbatches=1),
            memory=MemoryCosts(activation_bytes=1, input_grad_freed_bytes=2),
        )


def test_metrics_dict_and_rows():
    timeline = simulate(generate("zb-h1", num_devices=2, num_microbatches=3))
    metrics = timeline.metrics()
    assert metrics["makespan_ms"] == timeline.makespan and len(metrics["device_span_ms"]) == 2
    rows = timeline.rows()
    assert len(rows) == 2 * 3 * 3 and rows[0] == (0, "0F0", 0.0, 1.0)


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n != "dualpipev"])
def test_replay_along_the_checked_order_equals_the_engine_walk(name):
    """`engine.replay` (what simulate uses) gives exactly `engine.execute`'s start and end times under uneven
    per-stage costs and transfers: the order ops can run in does not depend on durations."""
    schedule = generate(name, num_devices=4, num_microbatches=8)
    rng = random.Random(name)
    stages = schedule.num_stages
    op_ms = {kind: [rng.uniform(0.1, 3.0) for _ in range(stages)] for kind in "FBIW"}
    comm_ms = [rng.uniform(0.0, 1.0) for _ in range(stages - 1)]
    backward_kind, order = checked(schedule)
    assert replay(schedule, order, op_ms, comm_ms) == execute(schedule, backward_kind, op_ms=op_ms, comm_ms=comm_ms)
