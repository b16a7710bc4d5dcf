"""Adaptive ZB-V (never worse than the fixed order at its peak memory, the same order when F = I = W) and
dualpipev's overlapped F&B ops (OVERLAP_F_B) timed as one unit by the engine, against a naive longest-path oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.schedules import StageCosts, generate, peak_activation_per_device, simulate, unit_memory, validate
from pipeplan.schedules.generators.zbv import zbv_fixed
from pipeplan.schedules.generators.zbv_greedy import greedy_candidates
from pipeplan.schedules.ops import OVERLAP, Op, make_schedule
from pipeplan.schedules.simulate import MemoryCosts, activation_deltas

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


def test_dualpipev_overlapped_ops_are_its_steps_4_and_5():
    p, m = 4, 10
    schedule = generate("dualpipev", num_devices=p, num_microbatches=m)
    fused = [(d, o) for d, ops in enumerate(schedule.device_ops) for o in ops if o.kind == OVERLAP]
    # steps 4 and 5 of DualPipeV: 2 pairs per main-loop iteration (m-2p+d+1) plus one per step-5 iteration (p-1-d)
    assert len(fused) == sum(2 * (m - 2 * p + d + 1) + (p - 1 - d) for d in range(p))
    for d, o in fused:
        forward, backward = o.parts
        assert {forward.stage, backward.stage} == {d, 2 * p - 1 - d} and (forward.kind, backward.kind) == ("F", "B")
    validate(schedule)


def _oracle(schedule, costs, overlap_ms):
    """Naive longest path: repeatedly start any device's next op whose halves' inputs are all done (+ comm across
    devices); an overlapped op takes overlap_ms (F + B when None) and ends both halves."""
    cost = costs.per_stage(schedule.num_stages)
    ms = {"F": cost.forward_ms, "B": cost.backward_ms, "I": cost.input_grad_ms, "W": cost.weight_grad_ms}
    end, pos, free, out = {}, [0] * schedule.num_devices, [0.0] * schedule.num_devices, {}
    split = {(h.stage, h.microbatch) for ops in schedule.device_ops for o in ops for h in o.parts if h.kind == "I"}

    def needs(h):
        s, mb = h.stage, h.microbatch
        if h.kind == "F":
            return [("F", s - 1, mb)] if s else []
        if h.kind == "W":
            return [("I", s, mb)]
        later = [("I" if (s + 1, mb) in split else "B", s + 1, mb)] if s + 1 < schedule.num_stages else []
        return [("F", s, mb), *later]

    progress = True
    while progress:
        progress = False
        for d, ops in enumerate(schedule.device_ops):
            if pos[d] == len(ops):
                continue
            o = ops[pos[d]]
            deps = [dep for h in o.parts for dep in needs(h)]
            if any(dep not in end for dep in deps):
                continue
            start = free[d]
            for kind, s, mb in deps:
                hop = schedule.stage_device[s] != d
                boundary = min(s, min(h.stage for h in o.parts))
                start = max(start, end[(kind, s, mb)] + (cost.comm_ms[boundary] if hop else 0.0))
            if o.halves is None:
                t = start + ms[o.kind][o.stage]
            else:
                f, b = o.halves
                t = start + (ms["F"][f.stage] + ms["B"][b.stage] if overlap_ms is None else overlap_ms)
            for h in o.parts:
                end[(h.kind, h.stage, h.microbatch)] = t
            out[(d, pos[d])] = (start, t)
            free[d], pos[d], progress = t, pos[d] + 1, True
    return out


@pytest.mark.parametrize("overlap_ms", [None, 2.0, 0.7])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8)])
def test_dualpipev_overlapped_op_timing(p, m, overlap_ms):
    schedule = generate("dualpipev", num_devices=p, num_microbatches=m)
    costs = StageCosts(
        forward_ms=[1.0 + 0.1 * s for s in range(2 * p)],
        input_grad_ms=0.9,
        weight_grad_ms=0.6,
        comm_ms=0.2,
        overlap_ms=overlap_ms,
    )
    timeline = simulate(schedule, costs)
    expected = _oracle(schedule, costs, overlap_ms)
    got = {
        (d, i): (e.start, e.end)
        for d, ops in enumerate(timeline.starts)
        for i, e in enumerate([type("E", (), {"start": a, "end": b}) for a, b in zip(ops, timeline.ends[d])])
    }
    assert got.keys() == expected.keys()
    for key, (start, end) in expected.items():
        assert got[key] == pytest.approx((start, end), abs=1e-9)
    fused = [e for e in timeline.entries if e.op.halves is not None]
    assert fused and all(e.end - e.start == pytest.approx(overlap_ms) for e in fused if overlap_ms is not None)


def test_dualpipev_overlap_shortens_the_step_and_is_refused_without_pairs():
    schedule = generate("dualpipev", num_devices=2, num_microbatches=4)
    plain = StageCosts(forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    overlapped = StageCosts(forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0, overlap_ms=2.0)
    assert simulate(schedule, overlapped).makespan < simulate(schedule, plain).makespan  # F (1) + B (2) in 2 ms
    with pytest.raises(Exception, match="--overlap-ms"):
        StageCosts(overlap_ms=-1.0)


def test_overlapped_op_memory_counts_both_halves():
    # one device holding stages 0 and 1 (a V of one device): 1F1 overlapped with 0B0
    first = [Op("F", 0, 0), Op("F", 1, 0), Op("B", 1, 0), Op("F", 0, 1)]
    last = [Op("B", 1, 1), Op("B", 0, 1)]
    halves = make_schedule("halves", 2, (0, 0), [[*first, Op("F", 1, 1), Op("B", 0, 0), *last]])
    fused = make_schedule("fused", 2, (0, 0), [[*first, Op.overlap(Op("F", 1, 1), Op("B", 0, 0)), *last]])
    validate(fused)
    # both halves at their top at once (F's kept bytes and B's re-created ones) is where F then B peaks too
    recompute = MemoryCosts(activation_bytes=1.0, kept_bytes=(0.25, 0.5), recompute_bytes=(0.75, 0.5))
    for memory in (unit_memory(2), recompute):
        assert peak_activation_per_device(fused, memory) == peak_activation_per_device(halves, memory)
    assert peak_activation_per_device(fused, recompute)[0] == pytest.approx(0.25 + 0.25 + 0.5 + 0.75)


@settings(max_examples=20)
@given(p=st.integers(2, 4), m=st.integers(4, 12), i=st.floats(0.5, 2.0), w=st.floats(0.2, 2.0))
def test_greedy_skips_only_repeated_option_runs(p, m, i, w):
    from pipeplan.schedules.generators.zbv_greedy import _chain

    costs = StageCosts(forward_ms=1.0, input_grad_ms=i, weight_grad_ms=w, comm_ms=0.1).per_stage(2 * p)
    memory = unit_memory(2)
    delta, limit = activation_deltas(memory, 2 * p), max(peak_activation_per_device(zbv_fixed(p, m), memory))
    every = {s for f in (True, False) for fi in (True, False) for s, _ in _chain(p, m, costs, delta, limit, f, fi)[0]}
    assert {s for s, _ in greedy_candidates(p, m, costs, delta, limit)} == every
