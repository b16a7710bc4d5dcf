"""A run's measured trace as data: what `pipeplan run --trace FILE` records besides the Chrome events
(`runtime/train/trace_io.py` writes it under "pipeplan_measured") and what `pipeplan refine` reads back.

    "pipeplan_measured": {"clock": ..., "ranks": [{"rank": 0, "steps": [{"step": 3, "end_ms": 41.2,
                                                                        "ops": [["0F0", 0.0, 1.9], ...]}, ...]}, ...],
                          "run": {"plan": "/abs/plan/plan.json", "plan_fingerprint": ..., ...}}

`run` (a `RunRecord`) names the plan the ranks ran (its path and `Plan.fingerprint`), the model's graph fingerprint,
the profile the plan was made from (`Plan.profile`), the CPU threads each rank used, whether steps were
post-validated, and the summary's measured and predicted step. A trace without it (written before traces recorded
their plan) cannot be refined from: `read_measured` says so in one line.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeplan.artifact.plan import Plan
from pipeplan.errors import FormatError, PipeplanError
from pipeplan.jsonio import build_dataclass
from pipeplan.schedules.ops import Op


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """Which plan a traced run ran, and how (module docstring)."""

    plan: str  # absolute path of the plan.json the ranks loaded ("": not known, `refine --plan` names it)
    plan_fingerprint: str  # Plan.fingerprint of it
    model_fingerprint: str  # plan.model.fingerprint: the traced graph the ranks built
    profile_fingerprint: str = ""  # plan.profile.fingerprint ("" when the plan records no profile)
    threads: int | None = None  # torch's CPU threads per rank (None on CUDA)
    device: str = "cpu"
    post_validate: bool = False  # the setting the run used (its prediction is that setting's period)
    measured_ms: float = 0.0  # the summary's: the slowest rank's median step (0: no step timed)
    predicted_ms: float = 0.0  # the plan's predicted step for the setting run


REFINED_SUFFIX = "-refined"


def refined_dir(plan_path: str | os.PathLike) -> Path:
    """Where `pipeplan refine` writes by default: beside the run's plan directory, named after it (plan ->
    plan-refined)."""
    folder = Path(plan_path).resolve().parent
    return folder.with_name(folder.name + REFINED_SUFFIX)


def run_record(plan: Plan, plan_path: str | os.PathLike | None, **fields) -> dict:
    """The "run" entry of a trace for `plan` loaded from `plan_path` (None: not known, "" recorded); `fields`:
    RunRecord's other fields."""
    ref = plan.profile.fingerprint if plan.profile is not None else ""
    record = RunRecord(
        plan=str(Path(plan_path).resolve()) if plan_path else "",
        plan_fingerprint=plan.fingerprint,
        model_fingerprint=plan.model.fingerprint,
        profile_fingerprint=ref,
        **fields,
    )
    return asdict(record)


@dataclass(frozen=True)
class TracedOp:
    """One op a rank ran in a traced step, and how long it computed (ms, receive waits excluded)."""

    rank: int
    step: int
    op: Op
    ms: float


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    """A trace file's record and every traced op (each rank's steps, in order)."""

    path: str
    record: RunRecord
    ops: tuple[TracedOp, ...]
    steps: tuple[int, ...]  # the traced steps (every rank traces the same)
    tail_ms: tuple[float, ...] = ()  # per rank, the median time from its last op to its step's end (`step_tails`)
    # per rank, that tail's parts (`tail_parts`): its gradient exchange, global checks and update (() if not traced)
    tail_parts_ms: tuple[tuple[float, float, float], ...] = ()


def read_measured(path: str | os.PathLike) -> MeasuredRun:
    """A trace written by `pipeplan run --trace`, checked: one FormatError line for anything else."""
    where = f"trace {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FormatError(f"{where} does not exist; give the file `pipeplan run --trace FILE` wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{where} is not a JSON trace: {exc}") from None
    measured = data.get("pipeplan_measured") if isinstance(data, dict) else None
    if not isinstance(measured, dict) or not isinstance(measured.get("ranks"), list):
        raise FormatError(f"{where} is not a measured trace of `pipeplan run --trace` (no pipeplan_measured)")
    if not isinstance(measured.get("run"), dict):
        raise FormatError(
            f"{where} does not say which plan it ran (written before traces recorded it); run the plan again "
            "with --trace FILE"
        )
    record = build_dataclass(RunRecord, measured["run"], where=f"{where} run")
    ops = tuple(_traced_ops(measured["ranks"], where))
    if not ops:
        raise FormatError(f"{where} holds no traced op; run at least one step with --trace")
    steps = tuple(sorted({o.step for o in ops}))
    try:
        tails, parts = step_tails(measured["ranks"]), tail_parts(measured["ranks"])
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{where}: ranks[].steps[] must hold end_ms and ops (and marks_ms: two times)") from None
    return MeasuredRun(path=str(path), record=record, ops=ops, steps=steps, tail_ms=tails, tail_parts_ms=parts)


def warm_up_step(steps: tuple[int, ...]) -> int | None:
    """The traced step left out of medians: the run's first (allocations, first calls), when others were traced."""
    return steps[0] if len(steps) > 1 and steps[0] == 0 else None


def step_tails(ranks: list) -> tuple[float, ...]:
    """Per rank, the median over its traced steps (the warm-up left out) of the time from its last op's end to
    its step's end: the gradient exchange, the optimizer update and the global checks, waits included."""
    tails = []
    for entry in ranks:
        steps = [step for step in entry["steps"] if step["ops"]]
        warm = warm_up_step(tuple(step["step"] for step in steps))
        gaps = [step["end_ms"] - max(op[2] for op in step["ops"]) for step in steps if step["step"] != warm]
        tails.append(statistics.median(gaps) if gaps else 0.0)
    return tuple(tails)


def tail_parts(ranks: list) -> tuple[tuple[float, float, float], ...]:
    """Per rank, the medians over its traced steps (the warm-up left out) of its tail's parts, from its `marks_ms`:
    the gradient exchange (last op's end to the exchange's end), the global checks (to the all-gather's end: the
    gradient-norm row and the wait for every rank) and the optimizer update (to the step's end). () when a step
    has no marks (post-validated or asynchronous runs, older traces)."""
    parts: list[tuple[float, float, float]] = []
    for entry in ranks:
        steps = [step for step in entry["steps"] if step["ops"]]
        warm = warm_up_step(tuple(step["step"] for step in steps))
        rows = []
        for step in steps:
            if step["step"] == warm:
                continue
            if len(step.get("marks_ms") or ()) != 2:
                return ()
            exchanged, checked = (float(t) for t in step["marks_ms"])
            last = max(op[2] for op in step["ops"])
            rows.append((exchanged - last, checked - exchanged, step["end_ms"] - checked))
        if not rows:
            return ()
        exchange, checks, update = (statistics.median(row[i] for row in rows) for i in range(3))
        parts.append((exchange, checks, update))
    return tuple(parts)


def _traced_ops(ranks: list, where: str):
    try:
        for entry in ranks:
            for step in entry["steps"]:
                for text, start, end in step["ops"]:
                    yield TracedOp(int(entry["rank"]), int(step["step"]), Op.parse(text), float(end) - float(start))
    except PipeplanError as exc:
        raise FormatError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{where}: ranks[].steps[].ops must be [op, start_ms, end_ms] lists") from None
