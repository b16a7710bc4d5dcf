"""Search over pipeline depth, data-parallel pipelines, microbatch size/count and schedule for the highest
predicted throughput that fits memory — `search_plans(profile, cluster, config)`.

Enumeration: for each microbatch size b and each data-parallel degree d dividing the device count N (each
pipeline gets P = N / d devices, m = B / (d b) microbatches; `SearchConfig.pipeline_depths` keeps only the given
P), every schedule (the asynchronous pipedream ones only with `allow_async`: `config.searched_schedules`), straight
(one stage per device, or per chunk) and — for fixed-order schedules with one stage per device (gpipe, 1f1b, zb-h1,
zb-h2) — PipeDream-style replicated stages (the partitioner picks the number of stages <= P and their replicas).

Pruning keeps it fast (pipeplan.search.estimate): weights + gradients + optimizer state spread evenly over P
devices bound memory from below, so a pipeline too short to hold the model is rejected before partitioning.
Candidates are evaluated in order of a balanced-stage estimate (the schedule simulated with every stage 1/S of the
model); one whose estimate is already slower than the best plan found is not partitioned, and one whose
partition's busiest-device bound is slower is not simulated. When the simulated peak of a partition is over memory
(the partitioner's per-stage screen is a bound, not the exact peak: zb-auto and paced replicas hold more), the
layout is partitioned again with a budget that screens that partition out (at most `variants.MEMORY_RETRIES` times).
Every rejected candidate records why it lost. A schedule whose every candidate was pruned still gets its
best-estimated candidates evaluated (until one fits, at most `PER_SCHEDULE_TRIES`), so the summary can say what
each schedule would give.

Memory: candidates are checked against the device memory less `SearchConfig.memory_reserve_bytes`, kept free for
what the model does not count (CUDA context and library workspaces, communication buffers, allocator
fragmentation); `default_memory_reserve` is the CLI's default. Each layout is evaluated under the memory options
(`planner.variants`): activation recomputation per stage only when it does not fit without, ZeRO-1 beside ZeRO-0
where stages have several holders.

Choice: among the candidates within `PREDICTION_MARGIN` of the fastest predicted step — differences the
prediction cannot resolve — the simplest layout is preferred (`simplicity_key`: no replication, then fewer
distinct replica counts, no ZeRO-1, fewer recomputing stages, fewer microbatches, more memory headroom), and the
rationale says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pipeplan.cluster import Cluster, MemoryBudget
from pipeplan.costs import (
    spread_static_bytes,
)
from pipeplan.errors import ConfigError, InfeasibleError, ScheduleError
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.placement import LOOPED, stage_copies
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info
from pipeplan.search.candidate import (
    REPLICATED,
    STRAIGHT,
    Evaluation,
    Layout,
    Rejection,
    min_memory_bytes,
)
from pipeplan.search.config import PREDICTION_MARGIN, SearchConfig, searched_schedules
from pipeplan.search.estimate import balanced_estimate_ms
from pipeplan.search.scaling import scale_profile
from pipeplan.search.sharding import split_inputs
from pipeplan.search.variants import evaluate_layout, zero_choices
from pipeplan.units import format_bytes

PER_SCHEDULE_TRIES = 4  # pruned candidates evaluated per schedule that has none, best estimate first


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """`ranked`: candidates that fit, fastest first; `rejected`: the rest, each with its reason; `best`: the
    chosen one (the simplest within PREDICTION_MARGIN of the fastest); `cluster`: the devices. With
    config.tensor_parallel t > 1: one rank's `profiles`, searched on the cluster's t x cp groups (`group_cluster`)."""

    ranked: tuple[Evaluation, ...]
    rejected: tuple[Rejection, ...]
    profiles: dict[int, Profile] = field(repr=False)  # microbatch size -> scaled profile
    cluster: Cluster
    config: SearchConfig

    @property
    def fastest(self) -> Evaluation:
        return self.ranked[0]

    @property
    def best(self) -> Evaluation:
        return prefer_simple(self.ranked, self.usable_memory_bytes)

    @property
    def budget(self) -> MemoryBudget:
        """A device's memory: physical, the reserve, and the usable rest the candidates' peaks were checked against."""
        return self.config.budget(self.cluster.memory_bytes)

    @property
    def usable_memory_bytes(self) -> int:
        return self.budget.usable

    @property
    def group_cluster(self) -> Cluster:
        """The devices the pipelines were searched on: the cluster's t x cp groups (`SearchConfig.groups`)."""
        return self.config.groups.of(self.cluster)


def simplicity_key(evaluation: Evaluation, memory_per_device: int) -> tuple:
    """Simpler first: no replication, fewer distinct replica counts, no ZeRO-1, fewer recomputing stages, fewer
    microbatches, more memory headroom."""
    replicas = evaluation.partition.replicas
    return (
        max(replicas) > 1,
        len(set(replicas)),
        evaluation.zero,
        evaluation.recomputing,
        evaluation.layout.num_microbatches,
        evaluation.peak_memory_bytes / memory_per_device,
        evaluation.step_ms,
        evaluation.layout.label,
    )


def prefer_simple(ranked: tuple[Evaluation, ...], memory_per_device: int) -> Evaluation:
    """The simplest candidate predicted within PREDICTION_MARGIN of the fastest (ranked fastest first)."""
    close = [e for e in ranked if e.step_ms <= ranked[0].step_ms * (1.0 + PREDICTION_MARGIN)]
    return min(close, key=lambda e: simplicity_key(e, memory_per_device))


Progress = Callable[[int, int], None]  # (done, total)


def enumerate_layouts(num_layers: int, cluster: Cluster, config: SearchConfig, schedules: tuple[str, ...]) -> list:
    """Every (layout | rejection) the search considers, before evaluation."""
    found: list[Layout | Rejection] = []
    n, per_node = cluster.num_devices, cluster.devices_per_node
    config.check_devices(n)
    depths = config.pipeline_depths
    for b in sorted(set(config.microbatch_sizes)):
        for d in (d for d in range(1, n + 1) if n % d == 0):
            if depths is not None and n // d not in depths:
                continue  # --parallel pp= forces other depths
            if config.global_batch_size % (d * b):
                continue  # this many pipelines cannot split the batch evenly at this microbatch size
            p = n // d
            m = config.global_batch_size // (d * b)
            for name in schedules:
                shape = Layout(
                    schedule=name,
                    microbatch_size=b,
                    data_parallel=d,
                    pipeline_devices=p,
                    num_microbatches=m,
                    tensor_parallel=config.tensor_parallel,
                    context_parallel=config.context_parallel,
                    expert_parallel=config.expert_parallel,
                )
                for layout in _variants(shape, config, p):
                    found.append(_static_rejection(layout, num_layers, per_node, schedules) or layout)
    return found


def _variants(layout: Layout, config: SearchConfig, p: int) -> list[Layout]:
    """`layout` straight, with each interleave factor of `config.interleave` for looped schedules, and replicated
    where the schedule allows it."""
    info = schedule_info(layout.schedule)
    found = [layout]
    if info.placement == LOOPED:
        found = [replace(layout, chunks=v) for v in config.interleave]
    if config.replication and info.replicable and p > 1:
        found.append(replace(layout, mode=REPLICATED))
    return found


def _static_rejection(layout: Layout, num_layers: int, per_node: int, schedules: tuple[str, ...]) -> Rejection | None:
    p = layout.pipeline_devices
    if p == 1 and layout.schedule != "1f1b" and "1f1b" in schedules:
        return Rejection(layout=layout, kind="duplicate", reason="a one-device pipeline runs every schedule like 1f1b")
    if p > per_node and p % per_node:
        return Rejection(
            layout=layout, kind="topology", reason=f"{p} devices per pipeline do not tile nodes of {per_node}"
        )
    ep, cp = layout.expert_parallel, layout.context_parallel
    if (layout.data_parallel * cp) % ep:
        reason = f"ep={ep} must divide the {layout.data_parallel} pipeline(s) x cp={cp} (its ranks come from them)"
        return Rejection(layout=layout, kind="topology", reason=reason)
    stages = p * layout.num_chunks
    if layout.mode == STRAIGHT and stages > num_layers:
        return Rejection(
            layout=layout, kind="topology", reason=f"needs {stages} stages but the model has {num_layers} layers"
        )
    return None


def search_plans(
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    schedules: tuple[str, ...] | list[str] | None = None,
    *,
    progress: Progress | None = None,
) -> SearchResult:
    """Rank every layout that fits; raise InfeasibleError naming the binding constraint when none does."""
    names = tuple(schedules) if schedules else tuple(n for n in SCHEDULE_NAMES if not schedule_info(n).named_only)
    for name in names:
        schedule_info(name, also_accepted=("auto",))
    names = searched_schedules(names, allow_async=config.allow_async, zero=config.zero, named=bool(schedules))
    profiles = {b: scale_profile(profile, b) for b in sorted(set(config.microbatch_sizes))}
    t, cp = config.tensor_parallel, config.context_parallel  # after scaling: each message's latency counted once
    profiles = {
        b: split_inputs(scaled, cluster, t, cp, overlap=config.overlap, ep=config.expert_parallel)[0]
        for b, scaled in profiles.items()
    }
    groups, usable = config.groups.of(cluster), config.budget(cluster.memory_bytes).usable
    pending: list[tuple[float, Layout]] = []
    rejected: list[Rejection] = []
    for item in enumerate_layouts(profile.num_layers, groups, config, names):
        if isinstance(item, Rejection):
            rejected.append(item)
            continue
        scaled = profiles[item.microbatch_size]
        try:
            estimate = balanced_estimate_ms(item, scaled, groups, grad_overlap=config.overlap.grad_reduce)
        except ScheduleError as exc:  # the schedule cannot run this shape at all: say that before memory
            rejected.append(Rejection(layout=item, kind="schedule", reason=str(exc)))
            continue
        early = _static_memory_rejection(item, scaled, usable, config)
        if early is not None:
            rejected.append(early)
        else:
            pending.append((estimate, item))
    pending.sort(key=lambda pair: (pair[0], pair[1].label))
    evaluated: list[Evaluation] = []
    best_ms = float("inf")
    for done, (estimate, layout) in enumerate(pending, start=1):
        found, why = evaluate_layout(layout, estimate, best_ms, profiles[layout.microbatch_size], groups, config)
        evaluated += found
        rejected += [why] if why is not None else []
        best_ms = min([best_ms, *(e.step_ms for e in found)])
        if progress is not None:
            progress(done, len(pending))
    _evaluate_each_schedule(pending, evaluated, rejected, profiles, groups, config)
    if not evaluated:
        smallest = smallest_fitting_memory(rejected, profiles, groups, config)
        raise InfeasibleError(infeasible_message(rejected, groups, smallest, config))
    evaluated.sort(key=lambda e: (e.step_ms, e.peak_memory_bytes, e.layout.label))
    return SearchResult(
        ranked=tuple(evaluated), rejected=tuple(rejected), profiles=profiles, cluster=cluster, config=config
    )


def _evaluate_each_schedule(
    pending: list[tuple[float, Layout]],
    evaluated: list[Evaluation],
    rejected: list[Rejection],
    profiles: dict[int, Profile],
    cluster: Cluster,
    config: SearchConfig,
) -> None:
    """For every schedule with no fitting candidate whose candidates were pruned, evaluate its best-estimated
    ones (at most PER_SCHEDULE_TRIES) until one fits; their pruning rejections are replaced by the outcome."""
    fitting = {e.layout.schedule for e in evaluated}
    pruned = {id(r.layout): r for r in rejected if r.kind in ("estimate", "bound")}
    for name in dict.fromkeys(layout.schedule for _, layout in pending):
        if name in fitting:
            continue
        tries = [(e, layout) for e, layout in pending if layout.schedule == name and id(layout) in pruned]
        for estimate, layout in tries[:PER_SCHEDULE_TRIES]:
            scaled = profiles[layout.microbatch_size]
            found, why = evaluate_layout(layout, estimate, float("inf"), scaled, cluster, config)
            rejected.remove(pruned[id(layout)])
            if why is not None:
                rejected.append(why)
                continue
            evaluated.extend(found)
            break


def _static_memory_rejection(layout: Layout, profile: Profile, usable: int, config: SearchConfig) -> Rejection | None:
    copies = stage_copies(schedule_info(layout.schedule).placement)  # dualpipe holds the model twice per pipeline
    params = copies * sum(layer.param_count for layer in profile.layers)
    static = spread_static_bytes(params, config.least_per_param(layout.holders), layout.pipeline_devices)
    if static <= usable:
        return None
    return Rejection(
        layout=layout,
        kind="memory",
        needed_memory_bytes=int(static),
        reason=(
            f"out of memory: weights, gradients and optimizer state alone need {format_bytes(static)} per device "
            f"over {layout.pipeline_devices} device(s), limit {format_bytes(usable)}"
        ),
    )


def smallest_fitting_memory(
    rejected: list[Rejection], profiles: dict[int, Profile], cluster: Cluster, config: SearchConfig
) -> int | None:
    """The least memory per device at which some rejected-for-memory candidate fits on `cluster` (the search's
    devices; the partitioner's binary search from the usable memory, with the memory options that save the most:
    recomputation and ZeRO-1 where the search may use them); candidates whose static lower bound already exceeds the
    best found are skipped."""
    usable = config.budget(cluster.memory_bytes).usable
    memory = sorted((r for r in rejected if r.kind == "memory"), key=lambda r: r.needed_memory_bytes or 0)
    best: int | None = None
    for rejection in memory:
        if best is not None and (rejection.needed_memory_bytes or 0) >= best:
            break
        layout = rejection.layout
        zero, profile = max(zero_choices(layout, config)), profiles[layout.microbatch_size]
        try:
            need = min_memory_bytes(
                layout, profile, cluster, config, zero=zero, recompute=config.recompute, limit=usable
            )
        except (ConfigError, ScheduleError):  # rejected for memory first, but its shape is unsupported too
            continue
        if need is not None and (best is None or need < best):
            best = need
    return best


def infeasible_message(
    rejected: list[Rejection], cluster: Cluster, smallest_memory: int | None, config: SearchConfig
) -> str:
    """One line: the binding constraint and what would fit (`smallest_memory`: usable bytes, the reserve apart) on
    `cluster` as searched (groups of t x cp devices)."""
    devices = config.groups.phrase(cluster.num_devices)
    reserve = config.memory_reserve_bytes
    memory_bound = any(r.kind == "memory" for r in rejected)
    others = sorted({r.reason for r in rejected if r.kind in ("schedule", "topology")})
    if memory_bound and (smallest_memory is not None or not others):
        hint = f"; the smallest that fits is {format_bytes(smallest_memory)} per device" if smallest_memory else ""
        if smallest_memory and reserve:
            hint += f" plus the {format_bytes(reserve)} reserve"
        return (
            f"no plan fits in {format_bytes(cluster.memory_bytes)} per device on {devices}: memory is the "
            f"binding constraint{hint} (raise --memory or --devices)"
        )
    first = others[0] if others else "no candidate layouts"
    return f"no plan is possible on {devices}: {first}; change --devices or --global-batch-size"
