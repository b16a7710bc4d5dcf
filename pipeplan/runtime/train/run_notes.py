"""What a run says of its own prediction and records for `pipeplan refine`: the run's record in its trace
(`plan.measured.RunRecord`: which plan, which profile, the threads per rank, measured and predicted step), and the
lines the summary adds after "measured/predicted": when the plan's profile was measured with another CPU thread
count than the ranks ran with, and, when measured is more than 15% off the prediction, the command that refines
the plan from this run."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeplan.artifact.measured import refined_dir, run_record
from pipeplan.artifact.plan import Plan
from pipeplan.runtime.train.config import RunConfig

REFINE_TOLERANCE = 0.15  # |measured / predicted - 1| beyond which the summary names `pipeplan refine`


@dataclass(frozen=True)
class RunSource:
    """The plan a run loaded (before --seed / --lr replace its values) and its file (None: not known)."""

    plan: Plan
    path: str | None = None

    def record(self, config: RunConfig, device_type: str, *, measured_ms: float, predicted_ms: float) -> dict:
        """The trace's "run" entry (`plan.measured.run_record`)."""
        return run_record(
            self.plan,
            self.path,
            threads=torch.get_num_threads() if device_type == "cpu" else None,
            device=device_type,
            post_validate=bool(config.post_validate),
            measured_ms=measured_ms,
            predicted_ms=predicted_ms,
        )


def run_notes(source: RunSource, config: RunConfig, device_type: str, measured: float, predicted: float) -> list[str]:
    """The summary's lines after measured vs predicted (module docstring)."""
    notes = []
    profile = source.plan.profile
    threads = torch.get_num_threads()
    if device_type == "cpu" and profile is not None and profile.threads and profile.threads != threads:
        notes.append(
            f"note: the plan's profile was measured with {profile.threads} CPU thread(s), each rank ran with "
            f"{threads}: its op costs are not the run's; profile with --threads {threads} (or run with --threads "
            f"{profile.threads}), or refine the plan from this run"
        )
    if predicted > 0 and measured > 0 and abs(measured / predicted - 1.0) > REFINE_TOLERANCE:
        notes.append(refine_hint(source, config, measured / predicted))
    return notes


def refine_hint(source: RunSource, config: RunConfig, ratio: float) -> str:
    """The exact commands that re-plan from this run's measured ops (with --trace: this run's trace)."""
    off = f"measured is {abs(ratio - 1.0):.0%} {'above' if ratio > 1 else 'below'} the prediction (> 15%)"
    plan = source.path or "PLAN"
    output = shlex.quote(str(refined_dir(plan))) if source.path else "DIR"
    if config.trace_path:
        trace = shlex.quote(config.trace_path)
        return f"{off}: re-plan from this run's measured ops with `pipeplan refine {trace} -o {output}`"
    trace = shlex.quote(str(Path(plan).resolve().parent / "measured.json")) if source.path else "measured.json"
    return (
        f"{off}: run again with --trace to record the ops, then re-plan from them: `pipeplan run {shlex.quote(plan)} "
        f"--trace {trace}` and `pipeplan refine {trace} -o {output}`"
    )
