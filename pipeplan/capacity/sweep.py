"""Capacity sweeps: the best plan for a model on each of several cluster sizes of one hardware kind, and how many
devices a token budget needs — `capacity_sweep(profile, config)`.

For each device count N the planner's search (`search_plans`) runs on `cluster_for(hardware, N)`; a row reports
its best plan with step time, tokens/s, MFU, bubble rate, the peak device's memory split into weights / gradients /
optimizer state / activations (pipeplan.capacity.memory) and what binds:

- `memory`: a layout the search rejected for memory would have been faster (its balanced-stage estimate is below
  the chosen step time);
- otherwise the larger non-compute share of the chosen step: `bubble` (idle time of the busiest device when
  transfers are free) or `communication` (the step's growth from point-to-point transfers, plus the gradient
  all-reduce after the flush); `compute` when both are under 5% of the step.

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

from pipeplan.capacity.memory import device_memory_split, screen_layouts
from pipeplan.capacity.report import (
    SECONDS_PER_DAY,
    CapacityReport,
    CapacityRow,
    TimeSplit,
    answer_devices,
    target_answer,
)
from pipeplan.errors import ConfigError, InfeasibleError, ScheduleError
from pipeplan.planner.asynchronous import busy_per_step, searched_schedules
from pipeplan.planner.candidate import Evaluation, Rejection
from pipeplan.planner.search import SearchConfig, SearchResult, default_memory_reserve, search_plans
from pipeplan.profiling.hardware import Hardware, cluster_for
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import schedule_info, schedule_names
from pipeplan.schedules.simulate import stream_step_ms
from pipeplan.units import format_bytes

DEFAULT_BATCH_TOKENS = 2**20  # default global batch: about a million tokens per step
MINOR_SHARE = 0.05  # bubble and communication both below this share of the step: compute binds


@dataclass(frozen=True, kw_only=True)
class CapacityConfig:
    """What to sweep. `max_devices`: how far doubling may extend the listed counts (default 16 x the largest)."""

    hardware: Hardware
    device_counts: tuple[int, ...]
    global_batch_size: int
    devices_per_node: int = 8
    microbatch_sizes: tuple[int, ...] = (1,)
    schedules: tuple[str, ...] = schedule_names(capacity_default=True)
    optimizer: str = "adamw"
    precision: str = "bf16-mixed"  # what the analytic profiles and the optimizer bytes assume
    replication: bool = False
    per_schedule: bool = False  # also the best plan of each schedule (for plots)
    target_tokens: float | None = None
    days: float | None = None
    max_devices: int | None = None
    memory_reserve_bytes: int | None = None  # device memory kept free; None: search.default_memory_reserve
    allow_async: bool = False  # keep the asynchronous schedules (pipedream, pipedream-2bw) in `schedules`

    def __post_init__(self) -> None:
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
        object.__setattr__(
            self, "schedules", searched_schedules(self.schedules, allow_async=self.allow_async, named=False)
        )
        if (self.target_tokens is None) != (self.days is None):
            raise ConfigError("--target-tokens and --days go together; give both or neither")
        if self.target_tokens is not None and not (self.target_tokens > 0 and self.days > 0):
            raise ConfigError("--target-tokens and --days must be positive")
        if self.max_devices is None:
            object.__setattr__(self, "max_devices", 16 * self.device_counts[-1])
        if self.max_devices < self.device_counts[-1]:
            raise ConfigError(f"max_devices ({self.max_devices}) must be >= the largest --devices count")
        self.search_config  # validates batch, microbatch sizes and optimizer  # noqa: B018

    @property
    def search_config(self) -> SearchConfig:
        reserve = self.memory_reserve_bytes
        return SearchConfig(
            global_batch_size=self.global_batch_size,
            microbatch_sizes=self.microbatch_sizes,
            optimizer=self.optimizer,
            precision=self.precision,
            replication=self.replication,
            memory_reserve_bytes=default_memory_reserve(self.hardware.memory_bytes) if reserve is None else reserve,
            allow_async=self.allow_async,
        )

    @property
    def tokens_per_s_needed(self) -> float | None:
        if self.target_tokens is None:
            return None
        return self.target_tokens / (self.days * SECONDS_PER_DAY)


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
    if needed is not None:
        answer = target_answer(rows, target_tokens=config.target_tokens, days=config.days, tokens_per_s_needed=needed)
    return CapacityReport(
        model=model or profile.provenance.model,
        hardware=config.hardware.name,
        memory_per_device=config.hardware.memory_bytes,
        memory_reserve_bytes=config.search_config.memory_reserve_bytes,
        global_batch_size=config.global_batch_size,
        tokens_per_sample=profile.provenance.tokens_per_sample or 1,
        param_count=sum(layer.param_count for layer in profile.layers),
        flops_per_token=sweep.flops_per_token,
        rows=rows,
        per_schedule={name: tuple(rs) for name, rs in sweep.schedule_rows.items()},
        answer=answer,
    )


class _Sweep:
    """Rows by device count, computed once each."""

    def __init__(self, profile: Profile, config: CapacityConfig) -> None:
        self.profile, self.config = profile, config
        self.flops_per_token = model_flops_per_token(profile)
        self.rows: dict[int, CapacityRow] = {}
        self.schedule_rows: dict[str, list[CapacityRow]] = {name: [] for name in config.schedules}

    def row(self, n: int, *, extended: bool = False) -> CapacityRow:
        if n not in self.rows:
            row = plan_device_count(self.profile, self.config, n, self.flops_per_token, self.schedule_rows)
            self.rows[n] = replace(row, extended=extended)
        return self.rows[n]

    def listed(self) -> list[CapacityRow]:
        return [self.rows[n] for n in self.config.device_counts]

    def all_rows(self) -> tuple[CapacityRow, ...]:
        return tuple(self.rows[n] for n in sorted(self.rows))

    def extend(self, wanted: Callable[[CapacityRow], bool], progress: Progress | None) -> None:
        """Double the largest listed count until a row is `wanted`, up to max_devices; beyond global batch x layers
        devices no straight pipeline exists, so the doubling stops there too."""
        n = self.config.device_counts[-1] * 2
        limit = min(self.config.max_devices, self.config.global_batch_size * self.profile.num_layers)
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
) -> CapacityRow:
    """The row of one device count (and, with config.per_schedule, each schedule's best appended to
    `schedule_rows`). Schedules whose every layout is over memory by `screen_layouts` are not searched."""
    cluster = cluster_for(config.hardware, num_devices, config.devices_per_node)
    screen = screen_layouts(profile, cluster, config.search_config, config.schedules)
    names = screen.schedules
    groups = [(name,) for name in names] if config.per_schedule else [names] if names else []
    results: dict[tuple[str, ...], SearchResult | InfeasibleError] = {}
    for group in groups:
        try:
            results[group] = search_plans(profile, cluster, config.search_config, group)
        except InfeasibleError as exc:
            results[group] = exc
    found = [r for r in results.values() if isinstance(r, SearchResult)]
    over = [rej for r in found for rej in r.rejected if rej.kind == "memory"] + list(screen.rejected)
    no_fit = CapacityRow(
        num_devices=num_devices,
        binding="does-not-fit",
        reason=screen.reason(cluster),
        needed_memory_bytes=_ceil_or_none(screen.floor_bytes),
    )
    if config.per_schedule and schedule_rows is not None:
        for name in config.schedules:
            result = results.get((name,))
            row = no_fit if result is None else _result_row(result, num_devices, config, flops_per_token, over)
            schedule_rows[name].append(row)
    if not found:
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
    best = min(found, key=lambda r: r.best.step_ms)
    return _result_row(best, num_devices, config, flops_per_token, over)


def _ceil_or_none(value: float) -> int | None:
    return int(math.ceil(value)) if math.isfinite(value) else None


def _result_row(
    result: SearchResult | InfeasibleError,
    num_devices: int,
    config: CapacityConfig,
    flops_per_token: float,
    rejected: list[Rejection],
) -> CapacityRow:
    if isinstance(result, InfeasibleError):
        return CapacityRow(num_devices=num_devices, binding="does-not-fit", reason=str(result))
    best = result.best
    layout = best.layout
    tokens_per_s = best.samples_per_s * (result.profiles[layout.microbatch_size].provenance.tokens_per_sample or 1)
    time = time_split(best)
    binding, reason = _binding(best, time, rejected, result)
    return CapacityRow(
        num_devices=num_devices,
        binding=binding,
        reason=reason,
        schedule=layout.schedule,
        pipeline_devices=layout.pipeline_devices,
        data_parallel=layout.data_parallel,
        num_microbatches=layout.num_microbatches,
        microbatch_size=layout.microbatch_size,
        step_ms=best.step_ms,
        tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * flops_per_token / (config.hardware.peak_bf16_flops * num_devices),
        bubble_rate=best.timeline.bubble_rate,
        memory=device_memory_split(best, result.profiles[layout.microbatch_size], result.config.split),
        time=time,
    )


def time_split(best: Evaluation) -> TimeSplit:
    """compute = the busiest device's op time; bubble = the rest of the step with free transfers; comm = what the
    transfers add to the simulated step, plus the all-reduce after the flush (asynchronous schedules: per step of
    their steady state, and the all-reduces of their updates)."""
    free = best.resimulate(replace(best.costs, comm_ms=0.0))
    if schedule_info(best.layout.schedule).asynchronous:
        m = best.layout.num_microbatches
        no_comm, compute = stream_step_ms(free, m), max(busy_per_step(best.timeline, m))
        return TimeSplit(compute_ms=compute, bubble_ms=max(no_comm - compute, 0.0), comm_ms=best.step_ms - no_comm)
    no_comm = free.makespan
    compute = max(best.timeline.device_busy)
    return TimeSplit(
        compute_ms=compute,
        bubble_ms=max(no_comm - compute, 0.0),
        comm_ms=max(best.timeline.makespan - no_comm, 0.0) + (best.step_ms - best.timeline.makespan),
    )


def _binding(best: Evaluation, time: TimeSplit, rejected: list[Rejection], result: SearchResult) -> tuple[str, str]:
    from pipeplan.planner.estimate import balanced_estimate_ms

    for rejection in sorted((r for r in rejected if r.kind == "memory"), key=lambda r: r.layout.label):
        layout = rejection.layout
        try:
            estimate = balanced_estimate_ms(layout, result.profiles[layout.microbatch_size], result.cluster)
        except ScheduleError:
            continue
        if estimate < best.step_ms:
            return "memory", f"{layout.label} (~{estimate:.1f} ms/step) does not fit in memory"
    share = max(time.bubble_ms, time.comm_ms) / best.step_ms if best.step_ms > 0 else 0.0
    if share < MINOR_SHARE:
        return "compute", ""
    if time.bubble_ms >= time.comm_ms:
        return "bubble", f"the busiest device idles {time.bubble_ms / best.step_ms:.0%} of the step"
    return "communication", f"{time.comm_ms / best.step_ms:.0%} of the step in transfers and all-reduce"


def _with_needed_devices(row: CapacityRow, rows: tuple[CapacityRow, ...]) -> CapacityRow:
    if row.fits:
        return row
    larger = [r.num_devices for r in rows if r.fits and r.num_devices > row.num_devices]
    return replace(row, needed_devices=min(larger)) if larger else row
