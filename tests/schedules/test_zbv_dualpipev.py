"""Adaptive ZB-V (never worse than the fixed order at its peak memory, the same order when F = I = W) and
dualpipev's overlapped F&B pairs timed as one unit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.errors import ScheduleError
from pipeplan.schedules import StageCosts, generate, peak_activation_per_device, simulate, unit_memory, validate
from pipeplan.schedules.dualpipev import fused_pairs, overlapped_pairs
from pipeplan.schedules.simulate import activation_deltas
from pipeplan.schedules.zbv import zbv_fixed
from pipeplan.schedules.zbv_greedy import greedy_candidates

_TOL = 1e-9


@settings(max_examples=40)
@given(
    p=st.integers(1, 5),
    m=st.integers(1, 16),
    f=st.floats(0.2, 3.0),
    i=st.floats(0.2, 3.0),
    w=st.floats(0.0, 3.0),
    comm=st.floats(0.0, 1.0),
    frees=st.floats(0.0, 1.0),
)
def test_zbv_adaptive_never_worse_than_fixed_at_equal_peak(p, m, f, i, w, comm, frees):
    costs = StageCosts(forward_ms=f, input_grad_ms=i, weight_grad_ms=w, comm_ms=comm)
    memory = unit_memory(2, input_grad_frees=frees)
    fixed = zbv_fixed(p, m)
    adaptive = generate("zbv", num_devices=p, num_microbatches=m, costs=costs, memory=memory)
    validate(adaptive)
    assert max(peak_activation_per_device(adaptive, memory)) <= max(peak_activation_per_device(fixed, memory)) + _TOL
    assert simulate(adaptive, costs).makespan <= simulate(fixed, costs).makespan + _TOL


@settings(max_examples=25)
@given(p=st.integers(2, 5), m=st.integers(4, 16), w=st.floats(0.2, 3.0), comm=st.floats(0.0, 1.0))
def test_greedy_runs_time_like_simulate(p, m, w, comm):
    costs = StageCosts(forward_ms=1.0, input_grad_ms=1.5, weight_grad_ms=w, comm_ms=comm).per_stage(2 * p)
    memory = unit_memory(2)
    limit = max(peak_activation_per_device(zbv_fixed(p, m), memory))
    for schedule, (makespan, span) in greedy_candidates(p, m, costs, activation_deltas(memory, 2 * p), limit):
        validate(schedule)
        timeline = simulate(schedule, costs)
        assert makespan == pytest.approx(timeline.makespan) and span == pytest.approx(timeline.max_span)
        assert max(peak_activation_per_device(schedule, memory)) <= limit + _TOL


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (2, 8), (4, 7), (4, 12), (8, 16)])
def test_zbv_same_order_when_f_i_w_equal(p, m):
    costs = StageCosts(forward_ms=2.0, input_grad_ms=2.0, weight_grad_ms=2.0)
    assert generate("zbv", num_devices=p, num_microbatches=m, costs=costs) == zbv_fixed(p, m)


def test_zbv_adapts_where_the_fixed_order_has_bubbles():
    # a slow W on a deep pipeline: the paper's greedy is found strictly faster than the fixed order
    p, m = 4, 8
    costs = StageCosts(forward_ms=0.5, input_grad_ms=1.0, weight_grad_ms=1.0, comm_ms=0.1)
    adaptive = simulate(generate("zbv", num_devices=p, num_microbatches=m, costs=costs), costs)
    assert adaptive.makespan < simulate(zbv_fixed(p, m), costs).makespan


def test_dualpipev_pairs_are_the_overlapped_steps():
    p, m = 4, 10
    schedule = generate("dualpipev", num_devices=p, num_microbatches=m)
    pairs = overlapped_pairs(schedule)
    # steps 4 and 5 of DualPipeV: 2 pairs per main-loop iteration (m-2p+d+1) plus one per step-5 iteration (p-1-d)
    assert len(pairs) == sum(2 * (m - 2 * p + d + 1) + (p - 1 - d) for d in range(p))
    for d, step in pairs:
        a, b = schedule.device_ops[d][step], schedule.device_ops[d][step + 1]
        assert a.kind == "F" and b.kind == "B" and a.stage != b.stage


def test_dualpipev_fused_pair_timing():
    p, m = 2, 4
    schedule = generate("dualpipev", num_devices=p, num_microbatches=m)
    costs = StageCosts(forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    halves = simulate(schedule, costs)
    fused = simulate(schedule, costs, fused=fused_pairs(schedule, 2.0))
    by_op = {(e.device, str(e.op)): e for e in fused.entries}
    for d, step in overlapped_pairs(schedule):
        a, b = (by_op[(d, str(o))] for o in schedule.device_ops[d][step : step + 2])
        assert a.start == b.start and a.end == b.end == a.start + 2.0  # one unit of --overlap-ms
    assert fused.makespan < halves.makespan  # F (1) + B (2) overlapped into 2 ms
    assert simulate(schedule, costs, fused={}).makespan == halves.makespan  # default: independent halves
    with pytest.raises(ScheduleError, match="--overlap-ms"):
        fused_pairs(generate("zbv", num_devices=2, num_microbatches=4), 2.0)


@settings(max_examples=20)
@given(p=st.integers(2, 4), m=st.integers(4, 12), i=st.floats(0.5, 2.0), w=st.floats(0.2, 2.0))
def test_greedy_skips_only_repeated_option_runs(p, m, i, w):
    from pipeplan.schedules.zbv_greedy import _chain

    costs = StageCosts(forward_ms=1.0, input_grad_ms=i, weight_grad_ms=w, comm_ms=0.1).per_stage(2 * p)
    memory = unit_memory(2)
    delta, limit = activation_deltas(memory, 2 * p), max(peak_activation_per_device(zbv_fixed(p, m), memory))
    every = {s for f in (True, False) for fi in (True, False) for s, _ in _chain(p, m, costs, delta, limit, f, fi)[0]}
    assert {s for s, _ in greedy_candidates(p, m, costs, delta, limit)} == every
