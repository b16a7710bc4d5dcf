"""The plan summary `pipeplan plan` and `pipeplan show` print: as rich tables, or as one JSON object (--json)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.scripts import describe
from pipeplan.console import wide
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.render import gantt
from pipeplan.schedules.simulate import Timeline
from pipeplan.units import format_bytes


def stage_ranks(plan: Plan, stage: int) -> list[int]:
    """Ranks of pipeline 0 holding `stage`."""
    return [info.rank for info in plan.ranks if info.pipeline == 0 and stage in info.stages]


def summary_dict(plan: Plan, *, plan_dir: str | None = None, timeline: Timeline | None = None) -> dict[str, Any]:
    """`plan --json` / `show --json`; `timeline`: the predicted steps (`plan.timing.plan_steps_timeline`), for one
    step's makespan beside the predicted step (the period)."""
    limit = memory_limit(plan)
    stages = [
        {
            "index": s.index,
            "first_layer": s.first_layer,
            "last_layer": s.last_layer,
            "layers": [s.layer_names[0], s.layer_names[-1]] if s.layer_names else [],
            "replicas": s.replicas,
            "ranks": stage_ranks(plan, s.index),
            "forward_ms": s.forward_ms,
            "input_grad_ms": s.input_grad_ms,
            "weight_grad_ms": s.weight_grad_ms,
            "comm_ms": s.comm_ms,
            "allreduce_ms": s.allreduce_ms,
            "memory_bytes": s.memory_bytes,
            "memory_limit_bytes": limit,
            "recompute": s.recompute,
            "recompute_ms": s.recompute_ms,
        }
        for s in plan.stages
    ]
    data = plan.to_dict()
    breakdown = compute_breakdown(plan)
    return {
        "plan_dir": plan_dir,
        "description": describe(plan),
        "runnable": plan.runnable,
        "model": data["model"],
        "cluster": data["cluster"],
        "training": data["training"],
        "schedule": plan.schedule,
        "chunks": plan.chunks,
        "world_size": plan.world_size,
        "stages": stages,
        "predicted": data["predicted"],
        "makespan_ms": one_step_makespan(plan, timeline),
        "alternatives": list(plan.alternatives),
        "per_schedule": per_schedule(plan),
        "rationale": plan.rationale,
        "staleness": _staleness(plan) or None,
        "zero": plan.training.zero,
        "memory_choices": list(plan.memory_choices),
        "compute_breakdown": breakdown,
        "compute_breakdown_reason": None if breakdown else BREAKDOWN_ABSENT,
    }


def memory_limit(plan: Plan) -> int | None:
    """What the plan's peaks were checked against (hand-made plans: the device memory when known, else None)."""
    return plan.predicted.memory_limit_bytes or plan.cluster.memory_per_device


BREAKDOWN_WORDS = {
    "gemm_ms": "GEMM",
    "attention_ms": "attention",
    "memory_ms": "memory-bound",
    "launch_ms": "launches",
    "collectives_ms": "exposed collectives",
    "other_ms": "other",
}


# why a plan holds no breakdown: its stages' times came without a kernel model (emit.py writes {} then)
BREAKDOWN_ABSENT = (
    "not split by kernel: the plan's profile was measured or imported (or the plan predates the split), so its "
    "times have no kernel model to split into GEMM, attention, memory-bound kernels and launches"
)


def compute_breakdown(plan: Plan) -> dict[str, float] | None:
    """The busiest rank of pipeline 0: one step's compute by part (its stages' `compute_breakdown`, one
    microbatch's, x the microbatches each runs); None when the plan's stages hold none (a measured profile's)."""
    if not all(stage.compute_breakdown for stage in plan.stages):
        return None
    found: dict[str, float] | None = None
    for info in plan.ranks:
        if info.pipeline != 0:
            continue
        parts: dict[str, float] = {}
        for index in info.stages:
            stage = plan.stages[index]
            for key, ms in stage.compute_breakdown.items():
                parts[key] = parts.get(key, 0.0) + ms * plan.training.num_microbatches / stage.replicas
        total = sum(parts.values())
        if found is None or total > found["total_ms"]:
            found = {"rank": info.rank, **parts, "total_ms": total}
    return found


def _compute_words(plan: Plan) -> str:
    """`show`'s Compute line: the busiest rank's split of one step, or why the plan holds none."""
    parts = compute_breakdown(plan)
    if not parts:
        return BREAKDOWN_ABSENT
    return f"{parts['total_ms']:,.1f} ms per step on rank {int(parts['rank'])} (the busiest): {breakdown_words(parts)}"


def breakdown_words(parts: dict[str, float]) -> str:
    """`GEMM 78%, attention 9%, ...` of a breakdown's total (parts under 0.5% left out)."""
    total = parts.get("total_ms") or sum(v for k, v in parts.items() if k in BREAKDOWN_WORDS)
    shares = [(words, parts.get(key, 0.0) / total) for key, words in BREAKDOWN_WORDS.items()] if total else []
    return ", ".join(f"{words} {share:.0%}" for words, share in shares if share >= 0.005)


def per_schedule(plan: Plan) -> list[dict[str, Any]]:
    """Per schedule the search tried: its best fitting candidate (step, bubble, peak memory) or why none fits."""
    p = plan.predicted
    chosen = {
        "schedule": plan.schedule,
        "label": _chosen_label(plan),
        "step_ms": p.step_ms,
        "bubble_rate": p.bubble_rate,
        "peak_memory_bytes": max(p.peak_memory_bytes, default=0),
        "chosen": True,
    }
    rows: dict[str, dict[str, Any]] = {plan.schedule: chosen}
    for alt in plan.alternatives:  # fastest first: a schedule's first row is its best
        name = alt["schedule"]
        if name in rows:
            continue
        if "reason" in alt:
            rows[name] = {"schedule": name, "label": alt["label"], "reason": alt["reason"]}
        else:
            keep = ("label", "step_ms", "bubble_rate", "peak_memory_bytes")
            rows[name] = {"schedule": name, **{k: alt[k] for k in keep}}
    return list(rows.values())


def _stage_table(plan: Plan) -> Table:
    limit = memory_limit(plan)
    words = f"memory limit {format_bytes(limit)}" if limit else "no memory limit"
    title = f"Stages of pipeline 0 (all {plan.training.data_parallel} are alike); {words}"
    table = Table(title=title, title_justify="left")
    columns = ("stage", "layers", "replicas", "ranks", "F ms", "I ms", "W ms", "comm ms", "recompute", "memory")
    for column in columns:
        table.add_column(column, justify="left" if column in ("layers", "ranks", "recompute") else "right")
    for s in plan.stages:
        names = f"{s.layer_names[0]}..{s.layer_names[-1]}" if len(s.layer_names) > 1 else "".join(s.layer_names)
        table.add_row(
            str(s.index),
            f"{s.first_layer}-{s.last_layer} {names}",
            str(s.replicas),
            ",".join(str(r) for r in stage_ranks(plan, s.index)),
            f"{s.forward_ms:.3f}",
            f"{s.input_grad_ms:.3f}",
            f"{s.weight_grad_ms:.3f}",
            f"{s.comm_ms:.3f}",
            s.recompute if s.recompute == "none" else f"{s.recompute} +{s.recompute_ms:.3f} ms",
            f"{format_bytes(s.memory_bytes)} ({s.memory_bytes / limit:.0%})" if limit else format_bytes(s.memory_bytes),
        )
    return table


def _alternatives_table(plan: Plan) -> Table:
    title = "Alternatives, fastest first (schedule PxD: P devices per pipeline x D pipelines, m microbatches of b)"
    table = Table(title=title, title_justify="left")
    for column in ("candidate", "samples/s", "step ms", "vs chosen", "bubble", "peak memory"):
        table.add_column(column, justify="left" if column == "candidate" else "right")
    table.add_row(
        Text(f"* {_chosen_label(plan)}", style="bold green"),
        f"{plan.predicted.samples_per_s:.2f}",
        f"{plan.predicted.step_ms:.2f}",
        "-",
        f"{plan.predicted.bubble_rate:.1%}",
        format_bytes(max(plan.predicted.peak_memory_bytes, default=0)),
    )
    for alt in plan.alternatives:
        if "reason" in alt:
            table.add_row(alt["label"], "-", "-", Text(alt["reason"], style="red"), "-", "-")
            continue
        table.add_row(
            alt["label"],
            f"{alt['samples_per_s']:.2f}",
            f"{alt['step_ms']:.2f}",
            f"{alt['slower_pct']:+.1f}%",
            f"{alt['bubble_rate']:.1%}",
            format_bytes(alt["peak_memory_bytes"]),
        )
    return table


def _chosen_label(plan: Plan) -> str:
    pipeline_devices = plan.world_size // plan.training.data_parallel
    replicated = " replicated" if any(s.replicas > 1 for s in plan.stages) else ""
    t = plan.training
    tensor = f" t={t.tensor_parallel}" if t.tensor_parallel > 1 else ""
    tensor += f" ep={t.expert_parallel}" if t.expert_parallel > 1 else ""
    return (
        f"{plan.schedule} {pipeline_devices}x{t.data_parallel} m={t.num_microbatches} b={t.microbatch_size}"
        f"{tensor}{replicated}"
    )


def _headline(plan: Plan, timeline: Timeline | None = None) -> Text:
    p = plan.predicted
    text = Text()
    text.append("Plan: ", style="bold")
    text.append(describe(plan) + "\n")
    text.append("Predicted: ", style="bold")
    zero = ", ZeRO-1 optimizer sharding" if plan.training.zero else ""
    attention = f", {plan.training.attention} attention" if plan.training.attention not in ("", "none") else ""
    text.append(f"{p.step_ms:.2f} ms/step{_period_words(plan, timeline)} in {plan.training.precision}{zero}{attention}")
    text.append(f", {p.samples_per_s:.2f} samples/s")
    if p.tokens_per_s:
        text.append(f", {p.tokens_per_s:,.0f} tokens/s")
    peak = max(p.peak_memory_bytes, default=0)
    text.append(f", bubble {p.bubble_rate:.1%}, peak memory {format_bytes(peak)}")
    if plan.cluster.memory_per_device is None:
        text.append(" (no memory limit: a hand-made plan)")
    else:
        text.append(
            f" of {format_bytes(p.memory_limit_bytes)} ({format_bytes(plan.cluster.memory_per_device)} less a "
            f"{format_bytes(p.memory_reserve_bytes)} reserve)"
        )
    text.append("\nOptimizer: ", style="bold")
    sharded = ", sharded by ZeRO-1 over each stage's holders" if plan.training.zero else ""
    text.append(f"{plan.training.numerics.state_layout}{sharded}")
    text.append("\nCompute: ", style="bold")
    text.append(_compute_words(plan))
    stale = _staleness(plan)
    if stale:  # asynchronous: what the speed costs in optimization semantics
        text.append("\nStaleness: ", style="bold yellow")
        text.append(f"{stale} (asynchronous: no flush, each stage steps on its own)")
    reason = plan.not_runnable_reason()
    if reason:
        text.append("\nNot runnable: ", style="bold yellow")
        text.append(reason.removeprefix("this plan "))
    return text


def render_summary(console: Console, plan: Plan, *, timeline: Timeline | None = None) -> None:
    """The summary; `timeline`: the predicted steps to draw (`plan.timing.plan_steps_timeline`). Into a pipe or a
    file (a job's log) the tables print whole (`console.wide`), not cut to 80 columns."""
    console.print(_headline(plan, timeline))
    wide(console).print(Group(_stage_table(plan), _alternatives_table(plan)))
    parts: list[Any] = []
    if plan.rationale:
        parts.append(Text("Why: ", style="bold") + Text(plan.rationale))
    if timeline is not None:
        m = plan.training.num_microbatches
        steps = 1 + max((e.op.microbatch for e in timeline.entries), default=0) // m
        what = f"{steps} steps, step k's microbatches numbered from k x {m}" if steps > 1 else "one step"
        parts.append(Text(f"Predicted steps (pipeline 0, one row per rank; {what}):", style="bold"))
        parts.append(gantt(timeline, width=console.width))
    console.print(Group(*parts))


def _staleness(plan: Plan) -> str:
    """The staleness line of an asynchronous plan ("" for a synchronous one)."""
    return schedule_info(plan.schedule).describe_staleness(plan.world_size // plan.training.data_parallel)


def _period_words(plan: Plan, timeline: Timeline | None) -> str:
    """What the predicted step is (`schedules.period`): the period of post-validated or synchronized steps, beside
    one step's makespan (its first op to its last, read from the drawn steps)."""
    if _staleness(plan):
        return ""  # asynchronous: the steady state of its stream
    how = "post-validated" if plan.training.post_validate else "synchronized"
    makespan = one_step_makespan(plan, timeline)
    words = "" if makespan is None else f"; one step's makespan {makespan:.2f} ms"
    return f" (the period of {how} steps{words})"


def one_step_makespan(plan: Plan, timeline: Timeline | None) -> float | None:
    """One step's makespan (its first op to its last) read from the drawn steps; None without them or for an
    asynchronous plan (a stream has no step boundary)."""
    if timeline is None or _staleness(plan):
        return None
    m = plan.training.num_microbatches
    first = [e.end for e in timeline.entries if e.op.microbatch < m]
    return max(first) if first else None
