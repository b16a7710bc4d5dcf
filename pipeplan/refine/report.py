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
            "planned": planned_tails(result.plan, synchronized=not record.post_validate),
            "refined": planned_tails(result.retimed, synchronized=not record.post_validate),
            "parts": tail_parts(result),
        },
        "learned": learned_dict(result),
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


def learned_dict(result: Refined) -> dict[str, float | None]:
    """What the refined profile learned beyond the layers (`refine.updates`, `bookkeeping.op_overhead_ms`)."""
    prov = result.profile.provenance
    return {
        "op_overhead_ms": prov.op_overhead_ms,
        "exchange_efficiency": prov.exchange_efficiency,
        "step_checks_ms": prov.step_checks_ms,
        "update_bytes_per_s": prov.update_bytes_per_s,
    }


def planned_tails(plan: Plan, *, synchronized: bool = True) -> list[float]:
    """Per rank, what `plan` counts after its last op: its stages' gradient exchange and optimizer update, and a
    synchronized step's global checks."""
    return [sum(_counted(plan, info.stages, synchronized=synchronized).values()) for info in plan.ranks]


def tail_parts(result: Refined) -> list[dict[str, dict[str, float]]]:
    """Per rank, its tail's parts as the run measured them (`MeasuredRun.tail_parts_ms`: the gradient exchange, the
    global checks with the waits in them, the update) beside what the plan counts for each and what the run's plan
    counts with what was learned (`Refined.retimed`); [] when the trace has no parts."""
    rows = []
    for info, (exchange, checks, update) in zip(result.plan.ranks, result.run.tail_parts_ms):
        rows.append(
            {
                "measured": {"exchange": exchange, "checks": checks, "update": update},
                "planned": _counted(result.plan, info.stages),
                "refined": _counted(result.retimed, info.stages),
            }
        )
    return rows


def _counted(plan: Plan, held: tuple[int, ...], *, synchronized: bool = True) -> dict[str, float]:
    """What `plan` counts for each part of the tail of a rank holding stages `held`."""
    stages = plan.stages
    return {
        "exchange": sum(stages[s].allreduce_ms for s in held),
        "checks": plan.training.step_checks_ms if synchronized else 0.0,
        "update": sum(stages[s].optimizer_ms for s in held),
    }


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
    _render_tails(console, result)
    new = result.new_plan
    console.print(f"re-planned: {describe(new)}: predicted {new.predicted.step_ms:.2f} ms/step", highlight=False)
    console.print(
        f"wrote {result.output}/plan.json, launch.sh, job.sbatch, timeline.json, profile.json (the refined profile); "
        f"run it: pipeplan run {result.output}/plan.json",
        highlight=False,
        soft_wrap=True,
    )


def _render_tails(console: Console, result: Refined) -> None:
    """The ranks' step tails (and their parts) measured vs planned vs refined, and what refine learned of them."""
    synced = not result.run.record.post_validate
    planned = planned_tails(result.plan, synchronized=synced)
    tails = zip(result.run.tail_ms, planned, planned_tails(result.retimed, synchronized=synced))
    console.print(
        "after each rank's last op (gradient exchange, global checks, optimizer update, waits), measured vs planned "
        f"vs refined ms per rank: {', '.join(f'{m:.1f} vs {p:.1f} vs {r:.1f}' for m, p, r in tails)} (refined: "
        "the run's plan with what its tails taught, refine.updates)",
        highlight=False,
        soft_wrap=True,
    )
    parts = tail_parts(result)
    if parts:
        cells = [
            ", ".join(
                f"{k} {r['measured'][k]:.1f} vs {r['planned'][k]:.1f} vs {r['refined'][k]:.1f}" for k in r["planned"]
            )
            for r in parts
        ]
        console.print(
            f"the tails' parts, measured vs planned vs refined ms per rank: {'; '.join(cells)} (checks: the "
            "gradient-norm row and the all-gather where each rank waits for the others)",
            highlight=False,
            soft_wrap=True,
        )
    learned = learned_dict(result)
    shown = {
        "per-op term": _shown(learned["op_overhead_ms"], "{:.2f} ms"),
        "gradient exchange at": _shown(learned["exchange_efficiency"], "{:.2f}x the link model's speed"),
        "global checks": _shown(learned["step_checks_ms"], "{:.2f} ms per synchronized step"),
        "updates at": _shown(learned["update_bytes_per_s"] and learned["update_bytes_per_s"] / 1e9, "{:.2f} GB/s"),
    }
    console.print(
        "learned: " + "; ".join(f"{name} {text}" for name, text in shown.items()), highlight=False, soft_wrap=True
    )


def _shown(value: float | None, form: str) -> str:
    return "not learned" if value is None else form.format(value)
