"""Why the winner won: its alternatives with predicted metrics and a one-paragraph rationale, both stored in
plan.json. Alternatives are the best candidate of every other schedule plus the next fastest candidates overall."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from pipeplan.costs import bytes_per_param, device_static_bytes
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import schedule_info
from pipeplan.search.candidate import Evaluation, Layout
from pipeplan.search.post_validation import synchronized_period_ms
from pipeplan.search.recompute_choice import recompute_reasons
from pipeplan.units import format_bytes

if TYPE_CHECKING:
    from pipeplan.search.search import SearchResult

_KIND_WORDS = {
    "memory": "out of memory",
    "schedule": "unsupported by the schedule",
    "topology": "impossible layout",
    "duplicate": "duplicate",
    "estimate": "pruned by the balanced-stage estimate",
    "bound": "pruned by the busiest-device bound",
}


def layout_dict(layout: Layout) -> dict[str, Any]:
    return {
        "label": layout.label,
        "schedule": layout.schedule,
        "mode": layout.mode,
        "pipeline_devices": layout.pipeline_devices,
        "data_parallel": layout.data_parallel,
        "microbatch_size": layout.microbatch_size,
        "num_microbatches": layout.num_microbatches,
        "tensor_parallel": layout.tensor_parallel,
    }


def evaluation_dict(evaluation: Evaluation, best: Evaluation) -> dict[str, Any]:
    return {
        **layout_dict(evaluation.layout),
        "num_stages": len(evaluation.partition.stages),
        "replicas": [s.replicas for s in evaluation.partition.stages],
        "step_ms": evaluation.step_ms,
        "samples_per_s": evaluation.samples_per_s,
        "bubble_rate": evaluation.timeline.bubble_rate,
        "allreduce_ms": evaluation.allreduce_ms,
        "peak_memory_bytes": evaluation.peak_memory_bytes,
        "slower_pct": (evaluation.step_ms / best.step_ms - 1.0) * 100.0,
        "zero": evaluation.zero,
        "recompute": [s.recompute for s in evaluation.partition.stages],
    }


def alternatives(result: SearchResult, chosen: Evaluation, *, limit: int = 3) -> tuple[dict[str, Any], ...]:
    """The best candidate of each other (schedule, mode) and the `limit` next fastest, fastest first; then, for
    each schedule with no candidate that fits, why its most promising candidate was rejected."""
    picked: dict[int, Evaluation] = {}
    seen: set[tuple[str, str]] = {(chosen.layout.schedule, chosen.layout.mode)}
    for evaluation in result.ranked:  # fastest first: the first seen per (schedule, mode) is its best
        key = (evaluation.layout.schedule, evaluation.layout.mode)
        if key not in seen:
            seen.add(key)
            picked[id(evaluation)] = evaluation
    for evaluation in [e for e in result.ranked if e is not chosen][:limit]:
        picked[id(evaluation)] = evaluation
    rows = [evaluation_dict(e, chosen) for e in sorted(picked.values(), key=lambda e: e.step_ms)]
    fitting = {e.layout.schedule for e in result.ranked}
    informative = [r for r in result.rejected if r.kind in ("memory", "schedule")]
    for name in dict.fromkeys(r.layout.schedule for r in informative):
        if name not in fitting:
            first = next(r for r in informative if r.layout.schedule == name)
            rows.append({**layout_dict(first.layout), "rejected": first.kind, "reason": first.reason})
    return tuple(rows)


def memory_choices(result: SearchResult, chosen: Evaluation) -> tuple[str, ...]:
    """One line per memory option the chosen plan uses, with why: each recomputing stage and the peak it would
    reach without recomputing (`recompute_choice.recompute_reasons`), how much faster it is than the best plan
    without recomputation (when one fits), and ZeRO-1 with the peak without it, or how
    much faster it is than the best plan without it."""
    limit = result.usable_memory_bytes
    modes = [s.recompute for s in chosen.partition.stages]
    lines = recompute_reasons(chosen.memory, modes, chosen.pipeline.device_ops, limit)
    plain = [e for e in result.ranked if not e.recomputing]
    if chosen.recomputing and plain:
        gap = plain[0].step_ms / chosen.step_ms - 1.0
        other = plain[0].layout.label
        than = (
            "this layout without it, whose cuts memory unbalances"
            if other == chosen.layout.label
            else f"the best plan without it ({other})"
        )
        lines.append(f"recomputing is {gap:.1%} faster than {than}")
    if chosen.zero:
        groups = sorted({s.replicas * chosen.layout.data_parallel for s in chosen.partition.stages})
        head = f"ZeRO-1 shards the optimizer state over {'/'.join(map(str, groups))} devices"
        plain = [e for e in result.ranked if not e.zero]
        without = _peak_without_zero(result, chosen)
        if without > limit:
            lines.append(f"{head}: without it needs {format_bytes(without)} of {format_bytes(limit)}")
        elif result.config.zero != "auto":
            lines.append(f"{head}: as asked (--memory zero=1 or --layout zero=1)")
        elif plain:
            gap = plain[0].step_ms / chosen.step_ms - 1.0
            lines.append(f"{head}: {gap:.1%} faster than the best plan without it ({plain[0].layout.label})")
        else:
            lines.append(f"{head}: no plan without it fits")
    return tuple(lines)


def _peak_without_zero(result: SearchResult, chosen: Evaluation) -> float:
    """The chosen plan's peak device memory with every optimizer state whole (same activations)."""
    per_param = bytes_per_param(result.config.numerics)
    counts = [s.param_count for s in chosen.partition.stages]
    whole = device_static_bytes(counts, chosen.pipeline.device_stages, per_param)
    static = chosen.memory.static_bytes
    assert isinstance(static, tuple)
    return max(p - s + w for p, s, w in zip(chosen.timeline.peak_memory_bytes, static, whole, strict=True))


def rejection_counts(result: SearchResult) -> dict[str, int]:
    return dict(Counter(r.kind for r in result.rejected))


def rationale(result: SearchResult, chosen: Evaluation) -> str:
    from pipeplan.search.config import PREDICTION_MARGIN

    layout = chosen.layout
    reserve = result.config.memory_reserve_bytes
    parts = [
        f"Chose {layout.label}: {chosen.samples_per_s:.2f} samples/s predicted "
        f"({chosen.step_ms:.2f} ms/step, bubble {chosen.timeline.bubble_rate:.1%}, {_sync_words(chosen)} "
        f"{chosen.allreduce_ms:.2f} ms, peak memory {format_bytes(chosen.peak_memory_bytes)} of "
        f"{format_bytes(result.usable_memory_bytes)}, after a {format_bytes(reserve)} reserve)."
    ]
    if chosen.post_validate:
        parts.append(_post_validation_words(result, chosen))
    fastest = result.fastest
    if fastest is not chosen:
        gap = (chosen.step_ms / fastest.step_ms - 1.0) * 100.0
        parts.append(
            f"The fastest prediction, {fastest.label_with_replicas}, is only {gap:.1f}% faster (within the "
            f"{PREDICTION_MARGIN:.0%} prediction margin) with peak memory {format_bytes(fastest.peak_memory_bytes)}"
            f"; preferred the simpler layout ({_simpler(chosen, fastest)})."
        )
    runner_up = next((e for e in result.ranked if e is not chosen), None)
    if runner_up is not None and fastest is chosen:
        gap = (runner_up.step_ms / chosen.step_ms - 1.0) * 100.0
        parts.append(f"The runner-up, {runner_up.label_with_replicas}, is {gap:.1f}% slower.")
    other_schedules = {e.layout.schedule for e in result.ranked} - {layout.schedule}
    if other_schedules:
        parts.append(f"Other schedules that fit: {', '.join(sorted(other_schedules))}.")
    parts += _mirrored_words(result, chosen)
    counts = rejection_counts(result)
    if counts:
        words = ", ".join(f"{n} {_KIND_WORDS.get(kind, kind)}" for kind, n in sorted(counts.items()))
        parts.append(f"{len(result.ranked)} candidate(s) fit; {sum(counts.values())} rejected ({words}).")
    else:
        parts.append(f"{len(result.ranked)} candidate(s) fit; none rejected.")
    choices = memory_choices(result, chosen)
    if choices:
        parts.append(f"Memory: {'; '.join(choices)}.")
    return " ".join(parts)


def _mirrored_words(result: SearchResult, chosen: Evaluation) -> list[str]:
    """Why a ranked mirrored schedule (dualpipe: every stage twice per pipeline) lost: its best candidate's step
    and the memory of its second parameter copy, against the chosen plan's."""
    if stage_copies(schedule_info(chosen.layout.schedule).placement) > 1:
        return []
    best = next((e for e in result.ranked if stage_copies(schedule_info(e.layout.schedule).placement) > 1), None)
    if best is None:
        return []
    gap = (best.step_ms / chosen.step_ms - 1.0) * 100.0
    slower = f"{gap:.1f}% slower" if gap > 0 else f"only {-gap:.1f}% faster (within the prediction margin)"
    static = best.memory.static_bytes
    assert isinstance(static, tuple)
    return [
        f"{best.layout.schedule} loses: its best, {best.label_with_replicas}, is {slower} and holds every "
        f"stage twice (static {format_bytes(max(static))} per device, peak {format_bytes(best.peak_memory_bytes)} "
        f"vs {format_bytes(chosen.peak_memory_bytes)})."
    ]


def _post_validation_words(result: SearchResult, chosen: Evaluation) -> str:
    """Why the plan post-validates (`--post-validate auto` turned it on, or `on` asked), with the period it gains."""
    synced = synchronized_period_ms(chosen.inputs, chosen.timeline)
    why = "as --post-validate on asks" if result.config.post_validate == "on" else "it shortens the period"
    gain = 1.0 - chosen.step_ms / synced if synced > 0 else 0.0
    shorter = f"{gain:.1%} shorter" if gain > 0 else "no shorter"
    return (
        f"Post-validation on ({why}; `run` follows it): period {chosen.step_ms:.1f} ms vs {synced:.1f} ms "
        f"synchronized ({shorter}: each rank starts its next step at its own end, its undo copy counted in the "
        "memory)."
    )


def _sync_words(evaluation: Evaluation) -> str:
    return "gradient reduce-scatter + all-gather" if evaluation.zero else "gradient all-reduce"


def _simpler(chosen: Evaluation, other: Evaluation) -> str:
    words = []
    if max(chosen.partition.replicas) == 1 and max(other.partition.replicas) > 1:
        words.append("no replicated stages")
    elif len(set(chosen.partition.replicas)) < len(set(other.partition.replicas)):
        words.append("fewer distinct replica counts")
    if chosen.zero < other.zero:
        words.append("no ZeRO-1")
    if chosen.recomputing < other.recomputing:
        words.append("fewer recomputing stages")
    if chosen.layout.num_microbatches < other.layout.num_microbatches:
        words.append(f"{chosen.layout.num_microbatches} microbatches instead of {other.layout.num_microbatches}")
    if chosen.peak_memory_bytes < other.peak_memory_bytes:
        words.append("more memory headroom")
    return ", ".join(words) or "as simple, more headroom"
