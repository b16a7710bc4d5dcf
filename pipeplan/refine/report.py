"""What `pipeplan refine` prints: predicted (the plan's) vs measured (the run) vs predicted again with the refined
costs (the run's own plan and schedule), each measured op's median beside the plan's time, and the new plan; or all
of it as one JSON object (--json)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.scripts import describe
from pipeplan.refine.job import Refined


def refined_dict(result: Refined) -> dict[str, Any]:
    record = result.run.record
    return {
        "trace": result.run.path,
        "plan": str(result.plan_path),
        "schedule": result.plan.schedule,
        "predicted_ms": record.predicted_ms,
        "measured_ms": record.measured_ms,
        "refined_ms": result.refined_ms,
        "threads": record.threads,
        "profile_threads": result.plan.profile.threads if result.plan.profile else None,
        "step_tail_ms": {
            "measured": list(result.run.tail_ms),
            "planned": planned_tails(result.plan),
            "refined": planned_tails(result.retimed),
            "parts": tail_parts(result),
        },
        "ops": [
            {"stage": s, "kind": kind, "planned_ms": planned, "measured_ms": measured, "refined_ms": refined}
            for s, kind, planned, measured, refined in result.rows()
        ],
        "new_plan": {
            "dir": str(result.output),
            "description": describe(result.new_plan),
            "schedule": result.new_plan.schedule,
            "predicted_ms": result.new_plan.predicted.step_ms,
        },
    }


def planned_tails(plan: Plan) -> list[float]:
    """Per rank, what `plan` counts after its last op: its stages' gradient exchange and optimizer update."""
    stages = plan.stages
    return [sum(stages[s].allreduce_ms + stages[s].optimizer_ms for s in info.stages) for info in plan.ranks]


def tail_parts(result: Refined) -> list[dict[str, dict[str, float]]]:
    """Per rank, its tail's parts as the run measured them (`MeasuredRun.tail_parts_ms`: the gradient exchange, the
    global checks with the waits in them, the update) beside what the plan counts for each (no checks); [] when the
    trace has no parts."""
    stages = result.plan.stages
    rows = []
    for info, (exchange, checks, update) in zip(result.plan.ranks, result.run.tail_parts_ms):
        planned = {
            "exchange": sum(stages[s].allreduce_ms for s in info.stages),
            "checks": 0.0,
            "update": sum(stages[s].optimizer_ms for s in info.stages),
        }
        rows.append({"measured": {"exchange": exchange, "checks": checks, "update": update}, "planned": planned})
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def render_refined(console: Console, result: Refined) -> None:
    record, plan = result.run.record, result.plan
    console.print(
        f"run of {result.plan_path} ({plan.schedule}): predicted {record.predicted_ms:.2f} ms/step, measured "
        f"{record.measured_ms:.2f} ms (measured/predicted {_ratio(record.measured_ms, record.predicted_ms)}), "
        f"refined {result.refined_ms:.2f} ms (measured/refined {_ratio(record.measured_ms, result.refined_ms)}: the "
        "same plan and schedule timed with the run's own op costs)",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(title="op times per microbatch: the plan's vs the run's median vs refined (ms)")
    for column in ("stage", "op", "planned", "measured", "refined", "measured/planned"):
        table.add_column(column, justify="right")
    for s, kind, planned, measured, refined in result.rows():
        table.add_row(str(s), kind, f"{planned:.3f}", f"{measured:.3f}", f"{refined:.3f}", _ratio(measured, planned))
    console.print(table)
    tails = zip(result.run.tail_ms, planned_tails(result.plan), planned_tails(result.retimed))
    console.print(
        "after each rank's last op (gradient exchange, optimizer update, global checks, waits), measured vs planned "
        f"vs refined ms per rank: {', '.join(f'{m:.1f} vs {p:.1f} vs {r:.1f}' for m, p, r in tails)} (refined: the "
        "updates at the rate the run's tails imply, refine.updates)",
        highlight=False,
        soft_wrap=True,
    )
    parts = tail_parts(result)
    if parts:
        ranks = [", ".join(f"{k} {r['measured'][k]:.1f} vs {r['planned'][k]:.1f}" for k in r["planned"]) for r in parts]
        console.print(
            f"the tails' parts, measured vs planned ms per rank: {'; '.join(ranks)} (checks: the gradient-norm row "
            "and the all-gather where each rank waits for the others)",
            highlight=False,
            soft_wrap=True,
        )
    new = result.new_plan
    console.print(f"re-planned: {describe(new)}: predicted {new.predicted.step_ms:.2f} ms/step", highlight=False)
    console.print(
        f"wrote {result.output}/plan.json, launch.sh, job.sbatch, timeline.json, profile.json (the refined profile); "
        f"run it: pipeplan run {result.output}/plan.json",
        highlight=False,
        soft_wrap=True,
    )
