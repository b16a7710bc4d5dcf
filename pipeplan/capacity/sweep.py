"""Capacity sweeps: the best plan for a model on each of several cluster sizes of one hardware kind, and how many
devices a token budget needs — `capacity_sweep(profile, config)`.

For each device count N the planner's search (`search_plans`) runs on `cluster_for(hardware, N)`; a row reports
its best plan with step time, tokens/s, MFU, bubble rate, the peak device's memory split into weights / gradients /
optimizer state / activations (pipeplan.capacity.memory) and what binds:

- `memory`: a layout the search rejected for memory would have been faster (its balanced-stage estimate is below
  the chosen step time);
- otherwise the larger non-compute share of the chosen step (its period, `schedules.period`): `bubble` (idle time
  of the busiest device when transfers, gradient exchanges and updates are free) or `communication` (what they
  add to the period); `compute` when both are under 5% of the step.

Layouts: t x p x d — for each tensor-parallel size t the outer loop of `planner.tensor_search` tries (auto: 1, 2,
4, 8 dividing the devices per node, when the model is a transformer stack whose heads and hidden size t divides),
the screen and search below run on one tensor-parallel rank's profile and the t-device groups
(`planner.tensor_parallel`); the row is the best t's (the smallest within the search's prediction margin), with
`tensor_parallel_reason` saying why, and `per_tensor_parallel` keeps each t's row for plots.

MFU = tokens/s x model FLOPs per token / (peak bf16 FLOP/s x N). Model FLOPs per token are 3 x the analytic
profile's forward FLOPs per token (backward = 2 x forward): every matmul, i.e. 6 x the matmul parameters plus the
attention scores' 12·L·s·h (full, non-causal attention, as torch's FLOP counter and PaLM's MFU count it); the
embedding lookup costs no FLOPs; no recomputation is counted.

Pruning (capacity only): the default schedules (ScheduleInfo.capacity_default) leave out zb-auto (its list
scheduling is slow at this scale and, on uniform transformer stacks, it matches zb-h1/zb-h2); replicated stages
are off unless asked for; and a device count whose every layout has a memory lower bound above the device's
memory (capacity_memory.memory_floor_bytes) is reported as not fitting without running the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeplan.capacity.memory import screen_layouts
from pipeplan.capacity.report import (
    SECONDS_PER_DAY,
    CapacityReport,
    CapacityRow,
    answer_devices,
    target_answer,
)
from pipeplan.capacity.rows import ceil_or_none, mfu, result_row, time_split  # noqa: F401  (time_split: API)
from pipeplan.cluster import Cluster
from pipeplan.errors import ConfigError, InfeasibleError
from pipeplan.hardware import Hardware, cluster_for
from pipeplan.profiling.experts import active_param_count, is_moe
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import schedule_info, schedule_names
from pipeplan.search.config import SearchConfig, searched_schedules
from pipeplan.search.search import SearchResult, search_plans
from pipeplan.search.sharding import split_inputs
from pipeplan.search.stack import CONTEXT_PARALLEL_SIZES, TENSOR_PARALLEL_SIZES
from pipeplan.search.tensor_search import (
    TensorParallelTry,
    chosen_try,
    dominated_reason,
    parse_tensor_parallel,
    tensor_parallel_reason,
    tensor_parallel_sizes,
)
from pipeplan.units import format_bytes

DEFAULT_BATCH_TOKENS = 2**20  # default global batch: about a million tokens per step


@dataclass(frozen=True, kw_only=True)
class CapacityConfig:
    """What to sweep: the hardware and device counts, and `search`, the search's own config (global batch,
    microbatch sizes, optimizer and precision, memory reserve and options) used for every count as it is.
    `max_devices`: how far doubling may extend the listed counts (default 16 x the largest)."""

    hardware: Hardware
    device_counts: tuple[int, ...]
    search: SearchConfig
    devices_per_node: int = 8
    schedules: tuple[str, ...] = schedule_names(capacity_default=True)
    per_schedule: bool = False  # also the best plan of each schedule (for plots)
    target_tokens: float | None = None
    days: float | None = None
    max_devices: int | None = None
    tensor_parallel: str | int = "auto"  # auto, or one size t (search.tensor_search)
    context_parallel: str | int = 1  # auto, or one size cp
    expert_parallel: str | int = "auto"  # auto (1 for a dense model), or one size ep

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_parallel", parse_tensor_parallel(self.tensor_parallel))
        cp = parse_tensor_parallel(self.context_parallel, option="--parallel cp")
        object.__setattr__(self, "context_parallel", cp)
        ep = parse_tensor_parallel(self.expert_parallel, option="--parallel ep")
        object.__setattr__(self, "expert_parallel", ep)
        if not self.device_counts or any(n < 1 for n in self.device_counts):
            raise ConfigError(f"--devices needs counts >= 1, got {list(self.device_counts)}")
        object.__setattr__(self, "device_counts", tuple(sorted(set(self.device_counts))))
        if self.devices_per_node < 1:
            raise ConfigError(f"--devices-per-node must be >= 1, got {self.devices_per_node}")
        for n in self.device_counts:
            if n > self.devices_per_node and n % self.devices_per_node:
                raise ConfigError(f"--devices {n} is not a multiple of --devices-per-node ({self.devices_per_node})")
        for name in self.schedules or ("",):  # none named: the unknown-schedule error lists the choices
            schedule_info(name, also_accepted=("auto", "all"))
        allow_async = self.search.allow_async
        object.__setattr__(self, "schedules", searched_schedules(self.schedules, allow_async=allow_async, named=False))
        if (self.target_tokens is None) != (self.days is None):
            raise ConfigError("--target-tokens and --days go together; give both or neither")
        if self.target is not None and not (self.target[0] > 0 and self.target[1] > 0):
            raise ConfigError("--target-tokens and --days must be positive")
        if self.max_devices is None:
            object.__setattr__(self, "max_devices", 16 * self.device_counts[-1])
        if self.device_limit < self.device_counts[-1]:
            raise ConfigError(f"max_devices ({self.max_devices}) must be >= the largest --devices count")
        self.search.budget(self.hardware.memory_bytes)  # a reserve that leaves nothing: one line

    @property
    def target(self) -> tuple[float, float] | None:
        """(tokens, days) when both are given (__post_init__ refuses one without the other)."""
        if self.target_tokens is None or self.days is None:
            return None
        return self.target_tokens, self.days

    @property
    def device_limit(self) -> int:
        """max_devices (__post_init__ sets its default, 16 x the largest listed count)."""
        return self.max_devices if self.max_devices is not None else 16 * self.device_counts[-1]

    @property
    def tokens_per_s_needed(self) -> float | None:
        if self.target is None:
            return None
        tokens, days = self.target
        return tokens / (days * SECONDS_PER_DAY)


def default_global_batch(tokens_per_sample: int, microbatch_sizes: tuple[int, ...]) -> int:
    """About DEFAULT_BATCH_TOKENS tokens: the nearest power of two in samples, a multiple of every microbatch size."""
    samples = 2 ** max(0, round(math.log2(DEFAULT_BATCH_TOKENS / max(tokens_per_sample, 1))))
    step = math.lcm(*microbatch_sizes)
    return max(step, -(-samples // step) * step)


def model_flops_per_token(profile: Profile) -> float:
    """3 x the profile's forward FLOPs per token (see the module docstring)."""
    tokens = profile.provenance.batch_size * (profile.provenance.tokens_per_sample or 1)
    return 3.0 * sum(layer.flops for layer in profile.layers) / tokens


Progress = Callable[[int, int, str], None]  # (done, total, what is being searched)


def capacity_sweep(
    profile: Profile, config: CapacityConfig, *, model: str | None = None, progress: Progress | None = None
) -> CapacityReport:
    """Plan every listed device count; extend by doubling when a count that fits (or meets the target) is missing.
    `model` names the model in the report (default: the profile's)."""
    sweep = _Sweep(profile, config)
    counts = config.device_counts
    for done, n in enumerate(counts):
        if progress is not None:
            progress(done, len(counts), f"{n} devices")
        sweep.row(n)
    if progress is not None:
        progress(len(counts), len(counts), "done")
    needed = config.tokens_per_s_needed
    if not any(sweep.rows[n].fits for n in counts) or (
        needed is not None and answer_devices(sweep.listed(), needed) is None
    ):
        sweep.extend(lambda row: row.fits and (needed is None or (row.tokens_per_s or 0.0) >= needed), progress)
    rows = sweep.all_rows()
    rows = tuple(_with_needed_devices(row, rows) for row in rows)
    answer = None
    if needed is not None and config.target is not None:
        tokens, days = config.target
        answer = target_answer(rows, target_tokens=tokens, days=days, tokens_per_s_needed=needed)
    return CapacityReport(
        model=model or profile.provenance.model,
        hardware=config.hardware.name,
        budget=config.search.budget(config.hardware.memory_bytes),
        global_batch_size=config.search.global_batch_size,
        tokens_per_sample=profile.provenance.tokens_per_sample or 1,
        param_count=sum(layer.param_count for layer in profile.layers),
        active_param_count=round(active_param_count(profile)) if is_moe(profile) else None,
        flops_per_token=sweep.flops_per_token,
        attention=profile.provenance.attention,
        rows=rows,
        per_schedule={name: tuple(rs) for name, rs in sweep.schedule_rows.items()},
        per_tensor_parallel={key: tuple(rs) for key, rs in sweep.family_rows.items()},
        answer=answer,
    )


class _Sweep:
    """Rows by device count, computed once each."""

    def __init__(self, profile: Profile, config: CapacityConfig) -> None:
        self.profile, self.config = profile, config
        self.flops_per_token = model_flops_per_token(profile)
        self.rows: dict[int, CapacityRow] = {}
        self.schedule_rows: dict[str, list[CapacityRow]] = {name: [] for name in config.schedules}
        self.family_rows: dict[str, list[CapacityRow]] = {}

    def row(self, n: int, *, extended: bool = False) -> CapacityRow:
        if n not in self.rows:
            row = plan_device_count(
                self.profile, self.config, n, self.flops_per_token, self.schedule_rows, self.family_rows
            )
            self.rows[n] = replace(row, extended=extended)
        return self.rows[n]

    def listed(self) -> list[CapacityRow]:
        return [self.rows[n] for n in self.config.device_counts]

    def all_rows(self) -> tuple[CapacityRow, ...]:
        return tuple(self.rows[n] for n in sorted(self.rows))

    def extend(self, wanted: Callable[[CapacityRow], bool], progress: Progress | None) -> None:
        """Double the largest listed count until a row is `wanted`, up to max_devices; beyond global batch x layers
        x the largest tensor-parallel size devices no straight pipeline exists, so the doubling stops there too."""
        n = self.config.device_counts[-1] * 2
        layouts = self.config.search.global_batch_size * self.profile.num_layers
        layouts *= max(TENSOR_PARALLEL_SIZES) * max(CONTEXT_PARALLEL_SIZES)
        limit = min(self.config.device_limit, layouts)
        while n <= limit:
            if progress is not None:
                progress(0, 1, f"{n} devices (extending)")
            if wanted(self.row(n, extended=True)):
                return
            n *= 2


def plan_device_count(
    profile: Profile,
    config: CapacityConfig,
    num_devices: int,
    flops_per_token: float,
    schedule_rows: dict[str, list[CapacityRow]] | None = None,
    family_rows: dict[str, list[CapacityRow]] | None = None,
) -> CapacityRow:
    """The row of one device count: the best over the tensor- and context-parallel sizes (see the module
    docstring). With config.per_schedule each schedule's best over the sizes is appended to `schedule_rows`; each
    size's row to `family_rows[label]` (`family_label`)."""
    cluster = cluster_for(config.hardware, num_devices, config.devices_per_node)
    tries: list[TensorParallelTry] = []
    rows: dict[str, CapacityRow] = {}
    schedule_best: dict[str, CapacityRow] = {}
    sizes = tensor_parallel_sizes(
        config.tensor_parallel, profile, cluster, config.context_parallel, config.expert_parallel
    )
    for item in sizes:
        if item.reason:
            tries.append(item)
            continue
        pruned = "" if config.per_schedule else dominated_reason(profile, cluster, config.search, item, tries)
        if pruned:  # an ep that cannot be chosen (its compute floor): no row of its own
            tries.append(replace(item, reason=pruned))
            continue
        key = family_label(item.tensor_parallel, item.context_parallel, item.expert_parallel)
        rows[key], result, per_schedule = _plan_split(profile, config, cluster, item, flops_per_token)
        tries.append(replace(item, result=result, reason="" if result else rows[key].reason, searched=True))
        for name, row in per_schedule.items():
            if name not in schedule_best or _faster(row, schedule_best[name]):
                schedule_best[name] = row
    for key, row in rows.items():
        if family_rows is not None:
            family_rows.setdefault(key, []).append(row)
    if config.per_schedule and schedule_rows is not None:
        for name in config.schedules:
            schedule_rows[name].append(schedule_best[name])
    if not rows:  # no size could be searched: say why (the first reason)
        reason = next((item.reason for item in tries if item.reason), "no tensor/context-parallel size applies")
        return CapacityRow(num_devices=num_devices, binding="does-not-fit", reason=reason)
    if not any(item.result is not None for item in tries):
        return rows[list(rows)[-1]]  # the largest group searched: the least memory per device
    chosen = chosen_try(tuple(tries))
    score = lambda result: f"MFU {mfu(result, config.hardware.peak_bf16_flops, flops_per_token, num_devices):.0%}"  # noqa: E731
    key = family_label(chosen.tensor_parallel, chosen.context_parallel, chosen.expert_parallel)
    return replace(rows[key], tensor_parallel_reason=tensor_parallel_reason(tuple(tries), score))


def family_label(t: int, cp: int, ep: int = 1) -> str:
    """How reports and plots name a (t, cp, ep) family: `8`, `8x2` with context parallelism, `1 ep=8` with expert
    parallelism."""
    return (f"{t}x{cp}" if cp > 1 else str(t)) + (f" ep={ep}" if ep > 1 else "")


def _faster(row: CapacityRow, other: CapacityRow) -> bool:
    """A row that fits (has a step) and is faster than `other` or `other` does not fit."""
    if row.step_ms is None:
        return False
    return other.step_ms is None or row.step_ms < other.step_ms


def _plan_split(
    profile: Profile, config: CapacityConfig, cluster: Cluster, item: TensorParallelTry, flops_per_token: float
) -> tuple[CapacityRow, SearchResult | None, dict[str, CapacityRow]]:
    """One (t, cp)'s row, its best search result (None: nothing fits) and, with config.per_schedule, each
    schedule's row. Schedules whose every layout is over memory by `screen_layouts` are not searched."""
    t, cp, ep = item.tensor_parallel, item.context_parallel, item.expert_parallel
    search_config = replace(config.search, tensor_parallel=t, context_parallel=cp, expert_parallel=ep)
    split = split_inputs(profile, cluster, t, cp, overlap=search_config.overlap, ep=ep)
    screen = screen_layouts(*split, search_config, config.schedules)
    num_devices = cluster.num_devices
    names = screen.schedules
    groups = [(name,) for name in names] if config.per_schedule else [names] if names else []
    results: dict[tuple[str, ...], SearchResult | InfeasibleError] = {}
    for group in groups:
        try:
            results[group] = search_plans(profile, cluster, search_config, group)
        except InfeasibleError as exc:
            results[group] = exc
    found = [r for r in results.values() if isinstance(r, SearchResult)]
    over = [rej for r in found for rej in r.rejected if rej.kind == "memory"] + list(screen.rejected)
    no_fit = CapacityRow(
        num_devices=num_devices,
        binding="does-not-fit",
        reason=screen.reason(cluster),
        needed_memory_bytes=ceil_or_none(screen.floor_bytes),
        tensor_parallel=t,
        context_parallel=cp,
        expert_parallel=ep,
    )
    per_schedule = {}
    if config.per_schedule:
        for name in config.schedules:
            result = results.get((name,))
            per_schedule[name] = (
                result_row(result, num_devices, config.hardware.peak_bf16_flops, flops_per_token, over)
                if result
                else no_fit
            )
    if not found:
        return _no_fit_row(no_fit, results, screen, names), None, per_schedule
    best = min(found, key=lambda r: r.best.step_ms)
    return result_row(best, num_devices, config.hardware.peak_bf16_flops, flops_per_token, over), best, per_schedule


def _no_fit_row(no_fit: CapacityRow, results: dict, screen, names: tuple[str, ...]) -> CapacityRow:
    if not results:
        return no_fit
    if not screen.rejected:
        return replace(no_fit, reason=min(map(str, results.values())), needed_memory_bytes=None)
    floor = min(r.needed_memory_bytes or 0 for r in screen.rejected)
    reason = (
        f"out of memory: no {'/'.join(names)} plan fits (searched) and every other layout needs at least "
        f"{format_bytes(floor)} per device"
    )
    return replace(no_fit, reason=reason, needed_memory_bytes=None)


def _with_needed_devices(row: CapacityRow, rows: tuple[CapacityRow, ...]) -> CapacityRow:
    if row.fits:
        return row
    larger = [r.num_devices for r in rows if r.fits and r.num_devices > row.num_devices]
    return replace(row, needed_devices=min(larger)) if larger else row
