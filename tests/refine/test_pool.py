"""`refine TRACE --with TRACE2` (issue 37): several runs of one plan pooled; the medians per (stage, kind) over every
run's steps (each run's warm-up left out), tails and measured step the medians over the runs; a trace of another
plan refused in one line. Bookkeeping only, on synthetic runs."""

from __future__ import annotations

import dataclasses

import pytest
from refine.test_bookkeeping import STEPS, _plan, _synthetic_run, _true_ms

from pipeplan.artifact.measured import step_tails, tail_parts
from pipeplan.errors import ConfigError
from pipeplan.refine.bookkeeping import measured_medians
from pipeplan.refine.pool import pooled


def _scaled(run, factor: float, *, tails: tuple[float, ...], measured: float):
    ops = tuple(dataclasses.replace(op, ms=op.ms * factor) for op in run.ops)
    record = dataclasses.replace(run.record, measured_ms=measured)
    return dataclasses.replace(run, ops=ops, tail_ms=tails, record=record, path=f"x{factor}.json")


def test_pooled_medians_are_over_every_runs_steps():
    plan = _plan("1f1b")
    base = _synthetic_run(plan)
    runs = [
        _scaled(base, 1.0, tails=(1.0, 2.0), measured=10.0),
        _scaled(base, 3.0, tails=(5.0, 6.0), measured=30.0),  # a run slowed by other work
        _scaled(base, 1.0, tails=(2.0, 3.0), measured=11.0),
        _scaled(base, 1.0, tails=(2.0, 3.0), measured=11.0),
    ]
    run = pooled(runs)
    assert len(run.steps) == 4 * (STEPS - 1) and 0 not in run.steps  # each run's warm-up step left out
    medians = measured_medians(plan, run)
    for (stage, kind), ms in medians.items():
        assert ms == pytest.approx(_true_ms(plan, stage, kind))  # one slowed run of four does not move them
    assert run.tail_ms == (2.0, 3.0) and run.record.measured_ms == 11.0
    assert run.record.plan_fingerprint == runs[0].record.plan_fingerprint
    assert pooled(runs[:1]) is runs[0]


def test_a_trace_of_another_plan_is_refused():
    one, other = _synthetic_run(_plan("1f1b")), _synthetic_run(_plan("zb-h1"))
    with pytest.raises(ConfigError, match="ran another plan .*--with takes traces of the same plan"):
        pooled([one, other])


def test_tail_parts_from_the_marks_and_pooled():
    """A synchronized step's marks split its tail (last op's end -> step end) into the gradient exchange, the global
    checks and the update: per rank the medians over its steps but the warm-up; pooled: the medians over runs."""

    def step(number: int, last: float, marks: list[float] | None, end: float) -> dict:
        entry = {"step": number, "end_ms": end, "ops": [["0F0", 0.0, last - 1.0], ["0B0", last - 1.0, last]]}
        return {**entry, "marks_ms": marks} if marks is not None else entry

    ranks = [
        {"rank": 0, "steps": [step(0, 50.0, [90.0, 99.0], 100.0), step(1, 110.0, [114.0, 115.0], 118.0)]},
        {"rank": 1, "steps": [step(0, 60.0, [90.0, 99.0], 100.0), step(1, 112.0, [114.0, 116.0], 119.0)]},
    ]
    parts = tail_parts(ranks)
    assert parts == ((4.0, 1.0, 3.0), (2.0, 2.0, 3.0))  # the warm-up step 0 left out
    assert all(sum(p) == pytest.approx(t) for p, t in zip(parts, step_tails(ranks)))  # the parts make up the tail
    del ranks[1]["steps"][1]["marks_ms"]  # a step without marks (post-validated, older traces): no parts
    assert tail_parts(ranks) == ()
    base = dataclasses.replace(_synthetic_run(_plan("1f1b")), tail_ms=(8.0, 7.0))
    runs = [
        dataclasses.replace(base, tail_ms=(8.0, 7.0), tail_parts_ms=((i, 1.0, 3.0), (2.0, i, 3.0))) for i in (4, 2, 9)
    ]
    assert pooled(runs).tail_parts_ms == ((4.0, 1.0, 3.0), (2.0, 4.0, 3.0))
    assert pooled([runs[0], base]).tail_parts_ms == ()  # one run without parts: none pooled
