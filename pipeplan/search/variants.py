"""One layout's evaluation under the search's memory options: ZeRO-1 and activation recomputation.

- Recomputation (`SearchConfig.recompute` auto) only where memory needs it: the layout is first evaluated without
  it; if that does not fit, or fits but more than BALANCE_MARGIN slower than its balanced estimate (memory may
  have forced unbalanced cuts), it is partitioned again letting each stage recompute (the partitioner picks cuts
  and the cheapest fitting mode per stage together, `planner.recompute_choice` settles the modes on the exact
  peaks), and the faster evaluation is kept. So more memory never gives a slower plan for that reason.
- ZeRO-1 (`SearchConfig.zero` auto) where a stage has more than one holder (data-parallel pipelines or replicated
  stages): both settings are evaluated and both enter the ranking, where the usual rule picks (fastest that
  fits, the simpler within `PREDICTION_MARGIN`; ZeRO-1 counts as less simple). Its exchange takes the time of the
  all-reduce it replaces (equal bytes), so it can only win on memory: when its partition is the one without it and
  the schedule's op order does not depend on memory, it would repeat the same step and is not simulated.
Each evaluation is pruned as before: not partitioned when the balanced estimate is slower than the best plan so
far, not simulated when the partition's busiest-device bound is; a simulated peak over memory re-partitions with a
tighter screen (at most MEMORY_RETRIES times). A layout the partitioner finds no fit for is rejected without the
binary search for the memory that would fit (the search's own error names the smallest memory for all layouts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pipeplan.cluster import Cluster
from pipeplan.partition.result import Partition
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import schedule_info
from pipeplan.search.candidate import REPLICATED, Evaluation, Layout, Rejection, partition_layout
from pipeplan.search.estimate import partition_lower_bound_ms
from pipeplan.search.evaluate import evaluate_partition
from pipeplan.units import format_percent

if TYPE_CHECKING:
    from pipeplan.search.config import SearchConfig

MEMORY_RETRIES = 2  # re-partitions with a tighter screen when the simulated peak is over memory
BALANCE_MARGIN = 0.05  # a fitting plan this much slower than its balanced estimate is tried with recomputation


def zero_choices(layout: Layout, config: SearchConfig) -> tuple[int, ...]:
    """The ZeRO stages to evaluate `layout` with: the configured one, or under `auto` 0 and — where a stage's
    optimizer state has more than one holder to split over and the optimizer is named — 1."""
    if config.zero != "auto":
        return (int(config.zero),)
    if schedule_info(layout.schedule).asynchronous:
        return (0,)  # stashed weight versions need per-parameter tensors, not ZeRO-1's flat buffers
    shared = layout.holders > 1 or layout.mode == REPLICATED
    return (0, 1) if shared and config.numerics.named else (0,)


def evaluate_layout(
    layout: Layout, estimate: float, best_ms: float, profile: Profile, cluster: Cluster, config: SearchConfig
) -> tuple[list[Evaluation], Rejection | None]:
    """The fitting evaluations of `layout` on `cluster` (the search's devices: t x cp groups) within the usable
    memory (`SearchConfig.budget`), per ZeRO setting the one without recomputation and, when faster, one with it;
    or none and why."""
    if estimate >= best_ms:
        slower = format_percent(estimate / best_ms - 1.0)
        reason = f"estimated {slower} slower than the best plan even with balanced stages"
        return [], Rejection(layout=layout, kind="estimate", reason=reason)
    found: list[Evaluation] = []
    rejection: Rejection | None = None
    for zero in zero_choices(layout, config):
        if zero and found and _same_without_zero(found[0], layout, profile, cluster, config):
            continue
        bar = min([best_ms, *(e.step_ms for e in found)])
        result = _with_recompute_if_needed(layout, (estimate, bar), profile, cluster, config, zero)
        if isinstance(result, Rejection):
            rejection = rejection if rejection is not None and result.kind != "memory" else result
        else:
            found += result
    return found, (None if found else rejection)


def _with_recompute_if_needed(
    layout: Layout, bars: tuple[float, float], profile: Profile, cluster: Cluster, config: SearchConfig, zero: int
) -> list[Evaluation] | Rejection:
    """Without recomputation, then with it (when the search may) if that is over memory — or if it fits but is
    more than BALANCE_MARGIN slower than the layout's balanced estimate (`bars`: that estimate, then the step to
    beat), where memory may have pushed the cuts off balance and recomputing may buy a balanced split; then both
    are returned when the one with recomputation is faster (the search's choice weighs them)."""
    estimate, best_ms = bars
    plain = _evaluate_with_retries(layout, best_ms, profile, cluster, config, zero=zero, recompute="none")
    may = config.recompute == "auto" and not schedule_info(layout.schedule).asynchronous
    if isinstance(plain, Rejection):
        if plain.kind != "memory" or not may:
            return plain
        other = _evaluate_with_retries(layout, best_ms, profile, cluster, config, zero=zero, recompute="auto")
        return other if isinstance(other, Rejection) else [other]
    if not may or plain.step_ms <= estimate * (1.0 + BALANCE_MARGIN):
        return [plain]
    bar = min(best_ms, plain.step_ms)
    other = _evaluate_with_retries(layout, bar, profile, cluster, config, zero=zero, recompute="auto")
    return [plain, other] if isinstance(other, Evaluation) and other.step_ms < plain.step_ms else [plain]


def _same_without_zero(plain: Evaluation, layout: Layout, profile: Profile, cluster: Cluster, config) -> bool:
    """Whether ZeRO-1 would repeat `plain` (ZeRO 0, no recomputation, an op order that does not depend on memory):
    the partitioner gives it the same stages."""
    if plain.recomputing or schedule_info(layout.schedule).within_memory_limit:
        return False
    usable = config.budget(cluster.memory_bytes).usable
    part = partition_layout(layout, profile, cluster, config, memory_limit=usable, zero=1, explain=False)
    return not isinstance(part, Rejection) and (part.stage_ranges, part.replicas) == (
        plain.partition.stage_ranges,
        plain.partition.replicas,
    )


def _without_recompute_time(part: Partition) -> Partition:
    """`part` with I and B at their times without recomputation: settling the modes on the exact peaks may drop
    some, so only this bounds the step from below."""
    if all(s.recompute_ms == 0.0 for s in part.stages):
        return part
    stages = tuple(
        replace(s, input_grad_ms=s.input_grad_ms - s.recompute_ms, backward_ms=s.backward_ms - s.recompute_ms)
        for s in part.stages
    )
    return replace(part, stages=stages)


def _evaluate_with_retries(
    layout: Layout,
    best_ms: float,
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    *,
    zero: int,
    recompute: str,
) -> Evaluation | Rejection:
    """Partition (skip the schedule and simulation when the partition's lower bound is already slower than the best
    plan), evaluate, and re-partition with a tighter screen while the simulated peak is over memory."""
    usable = config.budget(cluster.memory_bytes).usable
    screen = usable  # the partitioner's budget: the usable memory, then tighter after a peak over it
    for _ in range(MEMORY_RETRIES + 1):
        part = partition_layout(
            layout, profile, cluster, config, memory_limit=screen, zero=zero, recompute=recompute, explain=False
        )
        if isinstance(part, Rejection):
            return part
        bound = partition_lower_bound_ms(layout, _without_recompute_time(part), profile, cluster, config)
        if bound >= best_ms:
            slower = format_percent(bound / best_ms - 1.0)
            reason = f"at least {slower} slower than the best plan (busiest device's compute bound)"
            return Rejection(layout=layout, kind="bound", reason=reason)
        result = evaluate_partition(
            layout, part, profile, cluster, config, memory_limit=usable, zero=zero, recompute=recompute
        )
        if not isinstance(result, Rejection) or not result.retry_budget_bytes:
            return result
        # the partitioner's screen let through a partition whose simulated peak does not fit: screen tighter
        screen = min(screen - 1, result.retry_budget_bytes)
    return result
