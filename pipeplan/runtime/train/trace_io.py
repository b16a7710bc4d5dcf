"""The measured timeline of the last steps of a run as a Chrome trace, in the same format as the planner's
predicted timeline.json (schedules.render.timeline_to_chrome_trace: one event per op, pid = device, its step in
args), so the two overlay in Perfetto, plus the same times as plain numbers under "pipeplan_measured":

    {"clock": ..., "ranks": [{"rank": 0, "steps": [{"step": 3, "end_ms": 41.2, "ops": [["F0.0", 0.0, 1.9], ...]},
                                                    ...]}, ...]}

Every rank's times are on its own time.perf_counter(), started at the same instant (train.py takes the origin right
after a barrier) and shifted so that the earliest traced op starts at 0 ms; a step's `end_ms` is when its optimizer
step ended on that rank (with --post-validate, a step rolled back ends when the verdict's step was taken; a step run
again keeps the times of its last run); a synchronized step's `marks_ms` say when its gradient exchange and its
global checks (the gradient-norm row and the all-gather every rank waits in) ended: its tail after the last op is
exchange, checks, then the optimizer update. "pipeplan_measured" also holds "run": which plan the ranks ran and how
(`plan.measured.RunRecord`: the plan's path and fingerprint, its profile's, the threads per rank, the measured and
predicted step), what `pipeplan refine` checks and reads."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from pipeplan.jsonio import atomic_write_text
from pipeplan.schedules.render import timeline_to_chrome_trace

CLOCK = "ms on each rank's clock, taken together after a barrier at the start of the run; 0 = the first traced op"


def traced_steps(traced: list[tuple[int, list[tuple[str, float, float]], float, tuple]], origin: float) -> list[dict]:
    """One rank's (step, [(op, start_s, end_s)], end_s, marks_s) as {"step", "end_ms", "ops": [[op, start_ms,
    end_ms]]} and, for a synchronized step, "marks_ms": [when its gradient exchange ended, when its global checks
    ended], in ms since `origin` (seconds on the same clock)."""

    def ms(t: float) -> float:
        return (t - origin) * 1000.0

    steps = []
    for s, ops, end, marks in traced:
        entry = {"step": s, "end_ms": ms(end), "ops": [[op, ms(a), ms(b)] for op, a, b in ops]}
        if marks:
            entry["marks_ms"] = [ms(t) for t in marks]
        steps.append(entry)
    return steps


def measured_trace(per_rank: list[list[dict]], run: dict | None = None) -> dict:
    """The Chrome trace (with "pipeplan_measured") of every rank's `traced_steps`; `run`: the run's record
    (`plan.measured.run_record`)."""
    zero = min((op[1] for steps in per_rank for step in steps for op in step["ops"]), default=0.0)
    ranks: list[dict[str, Any]] = []
    for rank, steps in enumerate(per_rank):
        shifted = [
            {
                "step": step["step"],
                "end_ms": step["end_ms"] - zero,
                "ops": [[op, a - zero, b - zero] for op, a, b in step["ops"]],
                **({"marks_ms": [t - zero for t in step["marks_ms"]]} if step.get("marks_ms") else {}),
            }
            for step in steps
        ]
        ranks.append({"rank": rank, "steps": shifted})
    rows = [(r["rank"], op, a, b) for r in ranks for step in r["steps"] for op, a, b in step["ops"]]
    trace = timeline_to_chrome_trace(rows)
    numbers = [step["step"] for r in ranks for step in r["steps"] for _ in step["ops"]]
    for event, step in zip(trace["traceEvents"], numbers, strict=False):  # the op events come first, in row order
        event["args"]["step"] = step
    trace["pipeplan_measured"] = {"clock": CLOCK, "ranks": ranks}
    if run is not None:
        trace["pipeplan_measured"]["run"] = run
    return trace


def write_trace(
    path: str | os.PathLike, rank: int, traced: list, *, origin: float, world_size: int, run: dict | None = None
) -> None:
    """Collective: gather every rank's traced steps; rank 0 writes one merged trace file (with `run`, rank 0's)."""
    gathered: list[list[dict] | None] = [None] * world_size
    dist.all_gather_object(gathered, traced_steps(traced, origin))
    if rank == 0:
        atomic_write_text(path, json.dumps(measured_trace([g or [] for g in gathered], run)) + "\n")
