"""The per-op term `refine` learns (`refine.bookkeeping.op_overhead_ms`, `Provenance.op_overhead_ms`) and how the
one cost formula counts it (`costs.stage_op_ms`: once per op, whatever layers a stage groups), and the model's
first stage's W under a split backward (one backward pass: the layers' fused B, not their I + W)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.search import make_cluster, synthetic_profile

from pipeplan.artifact.measured import MeasuredRun, RunRecord, TracedOp, run_record
from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.scripts import with_profile
from pipeplan.costs import LayerArrays, numerics, span_compute_ms, stage_op_ms
from pipeplan.profiling.profile import Profile
from pipeplan.refine.bookkeeping import measured_medians, op_overhead_ms, retimed_plan
from pipeplan.refine.job import refined_profile
from pipeplan.schedules.ops import Op
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans

FIELDS = {"F": "forward_ms", "I": "input_grad_ms", "W": "weight_grad_ms", "B": "backward_ms"}
PER_OP, SLOWER = 0.7, 1.4  # the synthetic run: every op costs its planned work x 1.4 + 0.7 ms


def _profile(layers: int = 8) -> Profile:
    return synthetic_profile(num_layers=layers, cut_bytes=1000, fused_backward=1.5)  # B (1.5 F) < I + W (2 F)


def _plan(schedule: str, profile: Profile, depth: int = 2) -> Plan:
    config = SearchConfig(
        global_batch_size=8,
        microbatch_sizes=(1,),
        pipeline_depths=(depth,),
        numerics=numerics("adamw", "fp32"),
        recompute="none",
        post_validate="off",
    )
    result = search_plans(profile, make_cluster(2, memory=2**34), config, (schedule,))
    return with_profile(build_plan(result, model=ModelRef(ref="synthetic")), profile)


def _run(plan: Plan, steps: int = 4) -> MeasuredRun:
    """Each op: the plan's work x SLOWER + PER_OP (the first stage's I, which does no work: PER_OP alone)."""
    ops = [
        TracedOp(rank, step, op, getattr(plan.stages[op.stage], FIELDS[op.kind]) * SLOWER + PER_OP)
        for rank, names in enumerate(plan.rank_ops)
        for step in range(steps)
        for op in map(Op.parse, names)
    ]
    record = RunRecord(**run_record(plan, None, threads=1))
    return MeasuredRun(path="synthetic.json", record=record, ops=tuple(ops), steps=tuple(range(steps)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "interleaved"])
def test_refine_learns_the_per_op_term_and_the_layers_work(schedule):
    profile = _profile()
    plan = _plan(schedule, profile)
    run = _run(plan)
    medians = measured_medians(plan, run)
    refined = refined_profile(plan, profile, medians, run)
    assert refined.provenance.op_overhead_ms == pytest.approx(PER_OP)
    for old, new in zip(profile.layers, refined.layers):  # the work: x SLOWER, every pass, every layer
        for name in ("forward_ms", "input_grad_ms", "weight_grad_ms", "backward_ms"):
            assert getattr(new, name) == pytest.approx(getattr(old, name) * SLOWER)
    retimed = retimed_plan(plan, refined)  # the run's own plan: every op its median, the per-op term once in it
    for (stage, kind), ms in medians.items():
        assert getattr(retimed.stages[stage], FIELDS[kind]) == pytest.approx(ms)
    assert Profile.from_dict(refined.to_dict()).provenance.op_overhead_ms == pytest.approx(PER_OP)
    assert "op_overhead_ms" not in profile.to_dict()["provenance"]  # profiles without it: the same bytes as before


def test_the_per_op_term_is_counted_once_per_op_whatever_the_grouping():
    """Regrouping: stages of any cut pay the term once per F, I, W and B op (not per layer), and the
    partitioner's compute (span_compute_ms) is the sum of the plan's op times (stage_op_ms)."""
    base = _profile()
    counted = dataclasses.replace(base, provenance=dataclasses.replace(base.provenance, op_overhead_ms=PER_OP))
    plain, arrays = LayerArrays.from_profile(base), LayerArrays.from_profile(counted)
    assert arrays.op_ms == PER_OP and plain.op_ms == 0.0
    assert arrays.grouped(np.array([0, 3, 8])).op_ms == PER_OP and arrays.reversed().op_ms == PER_OP
    for cuts in ([0, 8], [0, 4, 8], [0, 1, 2, 5, 8], list(range(9))):
        stages = list(zip(cuts[:-1], [c - 1 for c in cuts[1:]]))
        for first, last in stages:
            with_term, without = stage_op_ms(arrays, first, last, "none"), stage_op_ms(plain, first, last, "none")
            for field in ("forward", "input_grad", "weight_grad", "backward"):
                assert getattr(with_term, field) == pytest.approx(getattr(without, field) + PER_OP)
            for split, ops in ((True, ("forward", "input_grad", "weight_grad")), (False, ("forward", "backward"))):
                options = dataclasses.make_dataclass("O", [("splits_backward", bool), ("cost_model", str)])
                compute = span_compute_ms(arrays, options(split, "pipeplan"), first, last)
                assert compute == pytest.approx(sum(getattr(with_term, op) for op in ops))
        total_f = sum(stage_op_ms(arrays, a, b, "none").forward for a, b in stages)
        assert total_f == pytest.approx(sum(la.forward_ms for la in base.layers) + len(stages) * PER_OP)


def test_the_first_stage_w_is_one_backward():
    """The model's first stage computes no input gradient: I does no work (it only recomputes) and W runs the whole
    backward once, costed as its layers' fused B (here 1.5 F per layer, against I + W = 2 F)."""
    arrays = LayerArrays.from_profile(_profile())
    first, later = stage_op_ms(arrays, 0, 3, "none"), stage_op_ms(arrays, 4, 7, "none")
    assert first.input_grad == 0.0 and first.weight_grad == pytest.approx(float(arrays.span("backward", 0, 3)))
    assert later.input_grad == pytest.approx(float(arrays.span("input_grad", 4, 7)))
    assert later.weight_grad == pytest.approx(float(arrays.span("weight_grad", 4, 7)))


def test_op_overhead_fit_bounds():
    assert op_overhead_ms([(1.0, 2.0), (3.0, 4.0)]) == pytest.approx(1.0)  # m = w + 1
    assert op_overhead_ms([(0.0, 0.5), (2.0, 3.3), (4.0, 6.1)]) == pytest.approx(0.5)  # a zero-work op anchors it
    assert op_overhead_ms([(2.0, 1.0), (4.0, 5.0)]) == 0.0  # a negative intercept: none
    assert op_overhead_ms([(0.0, 5.0), (1.0, 5.0), (10.0, 30.0), (1.0, 1.0)]) == 1.0  # at most the smallest median
    assert op_overhead_ms([(2.0, 3.0), (2.0, 4.0)]) == 0.0  # one work: no line to fit
    assert op_overhead_ms([(1.0, 3.0), (2.0, 2.0)]) == 0.0  # a falling line: none
