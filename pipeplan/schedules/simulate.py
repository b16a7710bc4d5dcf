"""One `simulate()`: time a Schedule's op lists under per-stage costs, comm and memory.

An op starts when its device is free (each device runs its list in order) and its dependencies are done, plus
the stage-boundary comm time when the producing stage sits on another device (a same-device hand-off is free).
Deterministic: the result is the longest-path timing of the op DAG, independent of processing order.

Asynchronous schedules (PipeDream, PipeDream-2BW) are streams without a flush: `stream_steps` says how many steps
of one to simulate and `stream_step_ms` reads the steady-state step time off its timeline; their memory adds each
stashed weight version a stage holds beyond the first (`MemoryCosts.weight_version_bytes`, `versions.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pipeplan.errors import ConfigError, ScheduleError
from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.validate import run_in_order
from pipeplan.schedules.versions import held_versions

Number = float | int
PAPER_INPUT_GRAD_FREES = 0.5  # Zero Bubble paper: I frees half of a microbatch's activations (F +2, I -1, W -1)
PerStage = Number | Sequence[Number]


def stage_value(value: PerStage, index: int) -> float:
    """Stage `index`'s value of a per-stage figure (a scalar is every stage's)."""
    return float(value) if isinstance(value, int | float) else float(value[index])


def _broadcast(value: PerStage, length: int, *, option: str) -> tuple[float, ...]:
    if isinstance(value, int | float):
        values = (float(value),) * length
    else:
        values = tuple(float(v) for v in value)
        if len(values) != length:
            raise ConfigError(f"{option} has {len(values)} values; expected {length} (or one scalar)")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ConfigError(f"{option} must be finite and >= 0, got {values}")
    return values


@dataclass(kw_only=True, frozen=True)
class StageCosts:
    """Per-stage op times in ms (scalars broadcast to every stage). `backward_ms` (full B) defaults to I + W.
    `comm_ms[s]` is the transfer time across the boundary s -> s+1, the same for activations forward and
    gradients backward, charged only when the two stages are on different devices. `overlap_ms`: the time of every
    OVERLAP_F_B op (dualpipev's overlapped F&B pairs; None: F + B, see `engine.overlapped_ms`)."""

    forward_ms: PerStage = 1.0
    input_grad_ms: PerStage = 1.0
    weight_grad_ms: PerStage = 1.0
    backward_ms: PerStage | None = None
    comm_ms: PerStage = 0.0
    overlap_ms: float | None = None

    def __post_init__(self) -> None:
        if self.overlap_ms is not None and not (math.isfinite(self.overlap_ms) and self.overlap_ms >= 0):
            raise ConfigError(f"overlap_ms (--overlap-ms) must be finite and >= 0, got {self.overlap_ms}")
        for name in ("forward_ms", "input_grad_ms", "weight_grad_ms", "backward_ms", "comm_ms"):
            value = getattr(self, name)
            if value is not None:
                _broadcast(value, 1 if isinstance(value, int | float) else len(value), option=name)

    def per_stage(self, num_stages: int) -> PerStageCosts:
        """A copy with every field a tuple: num_stages entries (num_stages - 1 for comm_ms)."""
        fwd = _broadcast(self.forward_ms, num_stages, option="forward_ms")
        igrad = _broadcast(self.input_grad_ms, num_stages, option="input_grad_ms")
        wgrad = _broadcast(self.weight_grad_ms, num_stages, option="weight_grad_ms")
        if self.backward_ms is None:
            bwd = tuple(i + w for i, w in zip(igrad, wgrad))
        else:
            bwd = _broadcast(self.backward_ms, num_stages, option="backward_ms")
        comm = _broadcast(self.comm_ms, num_stages - 1, option="comm_ms")
        return PerStageCosts(
            forward_ms=fwd,
            input_grad_ms=igrad,
            weight_grad_ms=wgrad,
            backward_ms=bwd,
            comm_ms=comm,
            overlap_ms=self.overlap_ms,
        )


@dataclass(kw_only=True, frozen=True)
class PerStageCosts(StageCosts):
    """`StageCosts.per_stage`'s result: the same costs with every field a tuple, one entry per stage (per boundary
    for `comm_ms`), so the engine and the generators index them."""

    forward_ms: tuple[float, ...]
    input_grad_ms: tuple[float, ...]
    weight_grad_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    comm_ms: tuple[float, ...]


@dataclass(kw_only=True, frozen=True)
class MemoryCosts:
    """Per stage and microbatch: `activation_bytes` A, what the backward needs (saved by autograd); the part of it
    freed when I ends (`input_grad_freed_bytes` f: the rest, A - f, lives until W; B frees all); static bytes per
    device (weights, gradients, optimizer state).

    Activation recomputation (`kept_bytes`, `recompute_bytes`; defaults: none) follows the runtime
    (runtime/step/executor.py, runtime/step/recompute_run.py): from F to the stage's I (or B) a microbatch holds only
    `kept_bytes` (K: the stage's inputs under full recomputation, A less the attention internals under selective);
    while its I (or B) runs, recomputation re-creates `recompute_bytes` (R) on top of that (full: A - K, the whole
    stage's saved tensors, rebuilt right before the backward; selective: one attention call's internals at a time,
    the largest); after I it holds A - f until W, as without recomputation.

    `weight_version_bytes`: per stage, one more copy of its weights, what each weight version an asynchronous
    schedule holds beyond the first costs (the first is in the static bytes)."""

    activation_bytes: PerStage = 1.0
    input_grad_freed_bytes: PerStage = 0.0
    static_bytes: PerStage = 0.0
    kept_bytes: PerStage | None = None  # held from F to I or B (None: activation_bytes, no recomputation)
    recompute_bytes: PerStage = 0.0  # re-created while I or B runs, on top of kept_bytes
    weight_version_bytes: PerStage = 0.0

    def __post_init__(self) -> None:
        names = ("activation_bytes", "input_grad_freed_bytes", "static_bytes", "kept_bytes", "recompute_bytes")
        for name in (*names, "weight_version_bytes"):
            value = getattr(self, name)
            if value is not None:
                _broadcast(value, 1 if isinstance(value, int | float) else len(value), option=name)


class TimelineEntry(NamedTuple):
    device: int
    op: Op
    start: float
    end: float


@dataclass(kw_only=True, frozen=True)
class Timeline:
    """Simulated timing of every op plus metrics.

    - makespan: last op end (the first op starts at 0).
    - device_span[d]: first op start to last op end on device d; max_span their max.
    - bubble_rate: 1 - sum(busy) / (num_devices * makespan).
    - zb_bubble_ms: the zero-bubble papers' bubble: max over devices d with span_d == max_span (float ties
      allowed) of (max_span - busy_d), where busy_d is the compute time of d's ops (= m * sum(F + I + W) over
      d's stages when B = I + W); zb_bubble_rate = zb_bubble_ms / max_span.
    - peak_memory_bytes[d]: static bytes + max live activation bytes on device d.
    """

    schedule_name: str
    num_devices: int
    device_ops: tuple[tuple[Op, ...], ...] = field(repr=False)  # per device, the ops timed, in list order
    starts: tuple[tuple[float, ...], ...] = field(repr=False)  # aligned with device_ops
    ends: tuple[tuple[float, ...], ...] = field(repr=False)
    makespan: float
    device_span: tuple[float, ...]
    device_busy: tuple[float, ...]
    max_span: float
    bubble_rate: float
    zb_bubble_ms: float
    zb_bubble_rate: float
    peak_memory_bytes: tuple[float, ...]

    @functools.cached_property
    def entries(self) -> tuple[TimelineEntry, ...]:
        """Every op with its device and times, device by device in list order (built on first use: a search reads
        only the metrics of most timelines)."""
        return tuple(
            TimelineEntry(device, o, start, end)
            for device, ops in enumerate(self.device_ops)
            for o, start, end in zip(ops, self.starts[device], self.ends[device])
        )

    def metrics(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule_name,
            "num_devices": self.num_devices,
            "makespan_ms": self.makespan,
            "max_span_ms": self.max_span,
            "bubble_rate": self.bubble_rate,
            "zb_bubble_ms": self.zb_bubble_ms,
            "zb_bubble_rate": self.zb_bubble_rate,
            "device_span_ms": list(self.device_span),
            "device_busy_ms": list(self.device_busy),
            "peak_memory_bytes": list(self.peak_memory_bytes),
        }

    def rows(self) -> list[tuple[int, str, float, float]]:
        """Plain (device, op string, start_ms, end_ms) rows, the input of `timeline_to_chrome_trace`."""
        return [(e.device, str(e.op), e.start, e.end) for e in self.entries]


def simulate(
    schedule: Schedule,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
) -> Timeline:
    """Validate and time `schedule` (unit costs, no comm, 1 byte per activation by default; an OVERLAP_F_B op
    takes `engine.overlapped_ms` of `costs.overlap_ms`)."""
    cost = (costs or StageCosts()).per_stage(schedule.num_stages)
    starts, ends = run_in_order(schedule, op_ms=op_durations(cost), comm_ms=cost.comm_ms, overlap_ms=cost.overlap_ms)
    if not all(math.isfinite(end) for row in ends for end in row[-1:]):
        raise ConfigError("the simulated step time overflows a float: the op or transfer times are too large")
    return build_timeline(schedule, starts, ends, memory or MemoryCosts())


def op_durations(cost: PerStageCosts) -> dict[str, Sequence[float]]:
    """The engine's `op_ms` (per kind, per stage) of costs made `per_stage`."""
    return {"F": cost.forward_ms, "I": cost.input_grad_ms, "W": cost.weight_grad_ms, "B": cost.backward_ms}


def makespan_and_span(schedule: Schedule, costs: StageCosts | None = None) -> tuple[float, float]:
    """`simulate(schedule, costs)`'s makespan and max_span without building the timeline (for ranking)."""
    cost = (costs or StageCosts()).per_stage(schedule.num_stages)
    starts, ends = run_in_order(schedule, op_ms=op_durations(cost), comm_ms=cost.comm_ms, overlap_ms=cost.overlap_ms)
    rows = [(s[0], e[-1]) for s, e in zip(starts, ends) if s]
    return max(e for _, e in rows), max(e - s for s, e in rows)


def build_timeline(
    schedule: Schedule, starts: Sequence[Sequence[float]], ends: Sequence[Sequence[float]], memory: MemoryCosts
) -> Timeline:
    """The Timeline (metrics and peak bytes) of `schedule`'s ops timed to start and end at `starts[d][i]`,
    `ends[d][i]` (aligned with its device_ops)."""
    num_devices = schedule.num_devices
    makespan = max((row[-1] for row in ends if row), default=0.0)
    span = tuple(e[-1] - s[0] if s else 0.0 for s, e in zip(starts, ends))
    busy = tuple(sum(end - start for start, end in zip(s, e)) for s, e in zip(starts, ends))
    max_span = max(span)
    zb_bubble = max(s - b for s, b in zip(span, busy) if s >= max_span - 1e-9 * max(1.0, max_span))
    return Timeline(
        schedule_name=schedule.name,
        num_devices=num_devices,
        device_ops=schedule.device_ops,
        starts=tuple(map(tuple, starts)),
        ends=tuple(map(tuple, ends)),
        makespan=makespan,
        device_span=span,
        device_busy=busy,
        max_span=max_span,
        bubble_rate=1.0 - sum(busy) / (num_devices * makespan) if makespan > 0 else 0.0,
        zb_bubble_ms=zb_bubble,
        zb_bubble_rate=zb_bubble / max_span if max_span > 0 else 0.0,
        peak_memory_bytes=tuple(
            st + pk
            for st, pk in zip(
                _broadcast(memory.static_bytes, num_devices, option="static_bytes"),
                peak_activation_per_device(schedule, memory),
            )
        ),
    )


def activation_deltas(memory: MemoryCosts, num_stages: int) -> dict[str, tuple[float, ...]]:
    """Per op kind, per stage: the change in live activation bytes once the op is done (F keeps K, the kept
    bytes: A without recomputation; I leaves A - f, so changes it by A - f - K; W frees A - f; B frees K). The one
    memory formula, with `activation_rises` for what an op holds while it runs: the simulator's peaks,
    `peak_activation_per_device` and the generators that schedule under a memory limit all use them."""
    act = _broadcast(memory.activation_bytes, num_stages, option="activation_bytes")
    freed_by_i = _broadcast(memory.input_grad_freed_bytes, num_stages, option="input_grad_freed_bytes")
    if any(f > a for f, a in zip(freed_by_i, act)):
        raise ConfigError("input_grad_freed_bytes must not exceed activation_bytes for any stage")
    if memory.kept_bytes is None:
        return {
            "F": act,
            "I": tuple(-f for f in freed_by_i),
            "W": tuple(f - a for f, a in zip(freed_by_i, act)),
            "B": tuple(-a for a in act),
        }
    kept = _broadcast(memory.kept_bytes, num_stages, option="kept_bytes")
    return {
        "F": kept,
        "I": tuple(a - f - k for a, f, k in zip(act, freed_by_i, kept)),
        "W": tuple(f - a for f, a in zip(freed_by_i, act)),
        "B": tuple(-k for k in kept),
    }


def activation_rises(memory: MemoryCosts, num_stages: int) -> dict[str, tuple[float, ...]]:
    """Per op kind, per stage: the most the live bytes rise above their level before the op while it runs: F its
    kept bytes; I and B the recomputed bytes R (I at least its own growth A - f - K, which full recomputation can
    make positive); W nothing. Without recomputation an op's peak is where F ends, as before."""
    delta = activation_deltas(memory, num_stages)
    extra = _broadcast(memory.recompute_bytes, num_stages, option="recompute_bytes")
    zero = (0.0,) * num_stages
    return {
        "F": delta["F"],
        "I": tuple(max(0.0, r, d) for r, d in zip(extra, delta["I"])),
        "W": zero,
        "B": tuple(max(0.0, r) for r in extra),
    }


def unit_memory(schedule_chunks: int, *, input_grad_frees: float = PAPER_INPUT_GRAD_FREES) -> MemoryCosts:
    """Unit mode: one microbatch of a device's full slice is 1 (so a stage of a v-chunk schedule holds 1/v), and
    I frees the fraction `input_grad_frees` of it (the Zero Bubble paper's setting is 0.5)."""
    if not 0.0 <= input_grad_frees <= 1.0:
        raise ConfigError(f"--input-grad-frees must be in [0, 1], got {input_grad_frees}")
    v = float(schedule_chunks)
    return MemoryCosts(activation_bytes=1.0 / v, input_grad_freed_bytes=input_grad_frees / v)


def peak_activation_per_device(schedule: Schedule, memory: MemoryCosts | None = None) -> tuple[float, ...]:
    """Per device, the most live activation bytes at once, with the stashed weight versions of asynchronous
    schedules (static bytes not included). Exact from the op order: a device runs its list in order, so the peak
    holds for any op timings. `memory=None`: unit mode."""
    memory = memory or unit_memory(schedule.num_chunks)
    delta = activation_deltas(memory, schedule.num_stages)
    rise = activation_rises(memory, schedule.num_stages)
    version_bytes = _broadcast(memory.weight_version_bytes, schedule.num_stages, option="weight_version_bytes")
    if schedule.asynchronous and any(version_bytes):
        return _peaks_with_versions(schedule, delta, rise, version_bytes)
    return tuple(device_activation_peak(ops, delta, rise) for ops in schedule.device_ops)


def device_activation_peak(ops: Sequence[Op], delta: Mapping, rise: Mapping) -> float:
    """The most live activation bytes while one device runs `ops` in order (`activation_deltas`, `activation_rises`
    of the memory). An OVERLAP_F_B op rises by both halves' rises (they run at once) and changes by both deltas."""
    live = peak = 0.0
    for o in ops:
        if o.halves is not None:  # both halves run at once: each may be at its top together; both changes stay
            top = live + sum(rise[h.kind][h.stage] for h in o.halves)
            live += sum(delta[h.kind][h.stage] for h in o.halves)
            peak = max(peak, top, live)
            continue
        top = live + rise[o.kind][o.stage]
        if top > peak:
            peak = top
        live += delta[o.kind][o.stage]
    return peak


def _peaks_with_versions(
    schedule: Schedule, delta: Mapping, rise: Mapping, version_bytes: tuple[float, ...]
) -> tuple[float, ...]:
    """Activations plus (versions held - 1) x a weight copy per stage, after every op (`versions.held_versions`);
    `rise`: what an op re-creates while it runs (recomputation)."""
    peaks = [0.0] * schedule.num_devices
    live = [0.0] * schedule.num_devices
    held: dict[int, int] = {}  # stage -> versions it holds (each stage is on one device)
    for device, _, o, count in held_versions(schedule):
        peaks[device] = max(peaks[device], live[device] + rise[o.kind][o.stage])
        live[device] += delta[o.kind][o.stage] + (count - held.get(o.stage, 1)) * version_bytes[o.stage]
        held[o.stage] = count
        peaks[device] = max(peaks[device], live[device])
    return tuple(peaks)


def stream_steps(num_devices: int, num_microbatches: int) -> int:
    """Steps of m microbatches an asynchronous schedule is simulated for: the fill reaches into the first
    ceil((p-1)/m) steps and the drain into as many last ones; two steady steps are measured between them."""
    lead = -(-(num_devices - 1) // num_microbatches)
    return 2 * lead + 3


def stream_step_ms(timeline: Timeline, num_microbatches: int) -> float:
    """Steady-state time of one step (m microbatches) of an asynchronous stream, no flush: the mean gap between
    the completions of consecutive steps (a step completes with its last microbatch's last op) over the steps
    neither the fill nor the drain reaches (see `stream_steps`)."""
    done: dict[int, float] = {}
    for entry in timeline.entries:
        step = entry.op.microbatch // num_microbatches
        done[step] = max(done.get(step, 0.0), entry.end)
    lead = -(-(timeline.num_devices - 1) // num_microbatches)
    first, last = lead, len(done) - 1 - lead
    if last - first < 2:
        raise ScheduleError(
            f"a stream of {len(done)} steps has no steady part to measure; simulate at least "
            f"{stream_steps(timeline.num_devices, num_microbatches)} (--steps)"
        )
    return (done[last] - done[first]) / (last - first)


def fits_limit(peak: float, limit: float) -> bool:
    """`peak <= limit` up to float rounding of summed byte counts."""
    return peak <= limit + 1e-9 * max(1.0, abs(limit))
