"""Several traced runs of one plan pooled into one (`pipeplan refine TRACE --with TRACE2 ...`).

On a shared machine one run can be up to 2x off another run of the same plan minutes later (another job's load
comes and goes), and a refine from that one run carries its error into every later plan. Pooled, the medians per
(stage, kind) are taken over every run's steps (each run's own warm-up step left out), the step tails per rank and
the measured step are the medians over the runs, and the record is the first trace's. Every trace must be of the
same plan (its fingerprint): one line refuses any other.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from pipeplan.artifact.measured import MeasuredRun, warm_up_step
from pipeplan.errors import ConfigError


def pooled(runs: list[MeasuredRun]) -> MeasuredRun:
    """`runs` (the first: the trace named first) as one run (module docstring)."""
    first = runs[0]
    if len(runs) == 1:
        return first
    for other in runs[1:]:
        if other.record.plan_fingerprint != first.record.plan_fingerprint:
            raise ConfigError(
                f"trace {other.path!r} ran another plan than {first.path!r} (plan fingerprint "
                f"{other.record.plan_fingerprint}, not {first.record.plan_fingerprint}); --with takes traces of the "
                "same plan"
            )
        if len(other.tail_ms) != len(first.tail_ms):
            raise ConfigError(f"trace {other.path!r} has other ranks than {first.path!r}; give traces of one plan")
    ops, steps, offset = [], [], 1  # steps numbered from 1 on: no pooled step is taken for a warm-up
    for run in runs:
        warm = warm_up_step(run.steps)
        kept = [s for s in run.steps if s != warm]
        number = {step: offset + i for i, step in enumerate(kept)}
        ops += [replace(op, step=number[op.step]) for op in run.ops if op.step in number]
        steps += list(number.values())
        offset += len(kept)
    tails = tuple(statistics.median(run.tail_ms[rank] for run in runs) for rank in range(len(first.tail_ms)))
    measured = statistics.median(run.record.measured_ms for run in runs)
    traced = all(len(run.tail_parts_ms) == len(first.tail_ms) for run in runs)  # every run marked its tails' parts
    parts = tuple(
        (
            statistics.median(run.tail_parts_ms[rank][0] for run in runs),
            statistics.median(run.tail_parts_ms[rank][1] for run in runs),
            statistics.median(run.tail_parts_ms[rank][2] for run in runs),
        )
        for rank in range(len(first.tail_ms) if traced else 0)
    )
    return MeasuredRun(
        path=" + ".join(run.path for run in runs),
        record=replace(first.record, measured_ms=measured),
        ops=tuple(ops),
        steps=tuple(steps),
        tail_ms=tails,
        tail_parts_ms=parts,
    )
