"""The period: consecutive steps of one synchronous schedule and the steady interval between their ends — the step
time a run settles into, which is the makespan only when every step waits for the previous one everywhere.

A synchronous schedule has no data dependency between steps (the weights change between them, on each device for
its own stages), so K steps of the same op lists are K timings of one step by the one engine
(`validate.run_in_order`: `engine.replay` along the checked order, or `replicate.time_expanded`), each device
starting at its own time (`ready`). `repeated` writes the K steps as one op list per device (microbatches offset
by m per step, `Op.shifted`) for the several-step timeline.

The end of device d's step (`StepEnd`): its gradient exchange is done at `reduced(d, ops, starts, ends)` (default:
its last op's end plus `sync_ms[d]`; the planner passes `costs.overlap.Reductions`, which starts each stage's
reduction as its rules allow), then it applies its optimizer update (`update_ms[d]`). Where step k+1 may start:

- post-validated (`post_validate=True`: `run --post-validate`; Zero Bubble, section 4): device d as soon as its
  own step k has ended (reduced + update); the global checks follow along the pipeline;
- synchronized: after the global check — every device's reduced gradients, plus `check_ms` (the all-gather of
  each rank's loss, norm and NaN/inf row) — each device applies its update, then starts.

Step k ends when the last device may start step k+1. The ready times of step k+1 follow from step k's by a
max-plus linear map, so shifting all of step k's by c shifts step k+1's by c: once the ready times of a step,
relative to their earliest, repeat those of an earlier step j (within float rounding), the steps repeat with
cycle k - j and the period is the growth of the earliest ready time per step over the cycle. Synchronized, this
happens by step 2 (step 1 if every update takes as long); post-validated it takes a few steps more. At most
`max_steps` (default 2p + 6) are simulated; without a repeat by then the period is the mean over the second half
(`Steady.converged` False).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.simulate import (
    MemoryCosts,
    StageCosts,
    Timeline,
    build_timeline,
    makespan_and_span,
    op_durations,
)
from pipeplan.schedules.validate import run_in_order

Times = tuple[list[list[float]], list[list[float]]]  # per device, starts and ends aligned with its op list
StepTimer = Callable[[Sequence[float]], Times]  # one step's times from each device's ready time
Reduced = Callable[[int, Sequence[Op], Sequence[float], Sequence[float]], float]
_TOLERANCE = 1e-9


class LayoutSteps(NamedTuple):
    """A pipeline's one-step op lists and the timer that times them from each device's ready time."""

    schedule: Schedule
    timer: StepTimer


@dataclass(frozen=True, kw_only=True)
class StepEnd:
    """Per device, what ends its step after its last op: its gradient exchange (`sync_ms`, or the rule `reduced`
    when given) and its optimizer update (`update_ms`); `check_ms`: the global check a synchronized step waits for
    (module docstring). Empty sequences: nothing."""

    sync_ms: Sequence[float] = ()
    update_ms: Sequence[float] = ()
    check_ms: float = 0.0
    reduced: Reduced | None = field(default=None, compare=False)

    def reduced_ms(self, device: int, ops: Sequence[Op], starts: Sequence[float], ends: Sequence[float]) -> float:
        if self.reduced is not None:
            return self.reduced(device, ops, starts, ends)
        return (ends[-1] if ends else 0.0) + (self.sync_ms[device] if self.sync_ms else 0.0)

    def update(self, device: int) -> float:
        return self.update_ms[device] if self.update_ms else 0.0


@dataclass(frozen=True, kw_only=True)
class Steady:
    """K simulated steps of `schedule`: `step_times[k]` its (starts, ends), `ready[k]` when each device could start
    step k (`ready[0]` all 0), `period_ms` the steady interval between step ends, `first_step_ms` the first step's
    end (the one-step prediction: makespan, exchanges, updates), `makespan_ms` the first step's last op."""

    schedule: Schedule
    post_validate: bool
    step_times: tuple[Times, ...] = field(repr=False)
    ready: tuple[tuple[float, ...], ...]
    period_ms: float
    first_step_ms: float
    makespan_ms: float
    converged: bool

    @property
    def steps(self) -> int:
        return len(self.step_times)

    @property
    def step_ends(self) -> tuple[float, ...]:
        """When each simulated step ends (the last device may start the next)."""
        return tuple(max(r) for r in self.ready[1:])

    def busy_per_step(self) -> tuple[float, ...]:
        starts, ends = self.step_times[0]
        return tuple(sum(e - s for s, e in zip(row_s, row_e)) for row_s, row_e in zip(starts, ends))

    def bubble_rate(self) -> float:
        """The idle share of the period: 1 - busy per step / (devices x period)."""
        total = self.schedule.num_devices * self.period_ms
        return max(0.0, 1.0 - sum(self.busy_per_step()) / total) if total > 0 else 0.0

    def timeline(self, memory: MemoryCosts | None = None) -> Timeline:
        """The several-step Timeline (`repeated` op lists; peaks are one step's: each step frees what it holds)."""
        several = repeated(self.schedule, self.steps)
        starts = [[t for s, _ in self.step_times for t in s[d]] for d in range(self.schedule.num_devices)]
        ends = [[t for _, e in self.step_times for t in e[d]] for d in range(self.schedule.num_devices)]
        return build_timeline(several, starts, ends, memory or MemoryCosts(activation_bytes=0.0))


def repeated(schedule: Schedule, steps: int) -> Schedule:
    """`steps` consecutive steps of `schedule` as one op list per device, step k's microbatches offset by k x m."""
    m = schedule.num_microbatches
    return Schedule(
        name=schedule.name,
        num_devices=schedule.num_devices,
        num_stages=schedule.num_stages,
        num_microbatches=m * steps,
        stage_device=schedule.stage_device,
        mirrored=schedule.mirrored,  # (microbatch parity kept: m is even)
        device_ops=tuple(tuple(o.shifted(k * m) for k in range(steps) for o in ops) for ops in schedule.device_ops),
    )


def simulate_steps(
    schedule: Schedule,
    costs: StageCosts | None = None,
    end: StepEnd = StepEnd(),
    *,
    post_validate: bool,
    max_steps: int | None = None,
) -> Steady:
    """The steady state of `schedule` under `costs` (module docstring): the entry point for one schedule."""
    timer = step_timer(schedule, costs or StageCosts())
    return steady_state(schedule, timer, end, post_validate=post_validate, max_steps=max_steps)


def step_timer(schedule: Schedule, costs: StageCosts) -> StepTimer:
    """One step of `schedule` (one device per stage) timed from each device's ready time by the one engine walk
    (`validate.run_in_order`: op times, transfers, overlapped F&B pairs)."""
    cost = costs.per_stage(schedule.num_stages)
    op_ms, comm, overlap = op_durations(cost), cost.comm_ms, cost.overlap_ms

    def timer(ready: Sequence[float]) -> Times:
        return run_in_order(schedule, op_ms=op_ms, comm_ms=comm, overlap_ms=overlap, ready=ready)

    return timer


def steady_state(
    schedule: Schedule,
    timer: StepTimer,
    end: StepEnd,
    *,
    post_validate: bool,
    max_steps: int | None = None,
    min_steps: int = 1,
    first: Times | None = None,
) -> Steady:
    """Steps of `schedule` timed by `timer` until they repeat (module docstring), at least `min_steps` (a timeline
    that shows the gap between steps); `first`: step 0's times when already simulated (from all devices at 0)."""
    p = schedule.num_devices
    limit = max_steps or 2 * p + 6
    ready: list[tuple[float, ...]] = [(0.0,) * p]
    shapes = [(0.0,) * p]
    times: list[Times] = []
    while True:
        step = first if first is not None and not times else timer(ready[-1])
        times.append(step)
        ready.append(_next_ready(schedule, step, end, post_validate))
        low = min(ready[-1])
        shape = tuple(r - low for r in ready[-1])
        scale = _TOLERANCE * max(1.0, max(ready[-1]))
        k = len(ready) - 1
        match = next((j for j in range(k - 1, -1, -1) if _same(shapes[j], shape, scale)), None)
        if (match is not None and k >= min_steps) or k >= limit:
            break
        shapes.append(shape)
    j = match if match is not None else k // 2
    period = (low - min(ready[j])) / (k - j) if k > j else max(ready[-1])
    starts, ends = times[0]
    makespan = max((row[-1] for row in ends if row), default=0.0)
    return Steady(
        schedule=schedule,
        post_validate=post_validate,
        step_times=tuple(times),
        ready=tuple(ready),
        period_ms=period,
        first_step_ms=max(ready[1]),
        makespan_ms=makespan,
        converged=match is not None,
    )


def _next_ready(schedule: Schedule, step: Times, end: StepEnd, post_validate: bool) -> tuple[float, ...]:
    starts, ends = step
    reduced = [end.reduced_ms(d, ops, starts[d], ends[d]) for d, ops in enumerate(schedule.device_ops)]
    if post_validate:
        return tuple(r + end.update(d) for d, r in enumerate(reduced))
    barrier = max(reduced) + end.check_ms
    return tuple(barrier + end.update(d) for d in range(schedule.num_devices))


def post_validated_floor(schedule: Schedule, first: Times, end: StepEnd) -> float:
    """A lower bound on the post-validated period from step 0 timed from all-zero ready times (`first`), without
    another step: where only one device has an op starting at 0, every op's start is its longest path from that
    device's first op (follow each op's binding predecessor back), so that device's own end after step 0 (its
    exchange and update) recurs in every step, wherever the others start (the map from ready times to step ends is
    monotone and shifts with them). 0 where two devices start at 0 (no bound)."""
    starts, ends = first
    firsts = [row[0] if row else float("inf") for row in starts]
    source = min(range(len(firsts)), key=firsts.__getitem__, default=0)
    if not firsts or firsts[source] > 0 or any(f <= 0 for d, f in enumerate(firsts) if d != source):
        return 0.0
    reduced = end.reduced_ms(source, schedule.device_ops[source], starts[source], ends[source])
    return reduced + end.update(source)


def _same(a: Sequence[float], b: Sequence[float], scale: float) -> bool:
    return all(abs(x - y) <= scale for x, y in zip(a, b))


def schedule_period(schedule: Schedule, costs: StageCosts, *, post_validate: bool) -> tuple[float, float]:
    """A generator's ranking key (zb-auto, zbv) for `schedule` alone (no exchange or update after it): its period
    and what breaks a tie first. Synchronized: the makespan, then the longest device span (the period should the
    run be post-validated after all); post-validated: the steady interval (0 second)."""
    if not post_validate:
        return makespan_and_span(schedule, costs)
    return simulate_steps(schedule, costs, post_validate=True).period_ms, 0.0


def faster(key: tuple[float, ...], best: tuple[float, ...] | None) -> bool:
    """Whether ranking `key` (period, then tie-breaks: span, memory, simplicity) beats `best`, periods within float
    rounding counting as a tie."""
    if best is None:
        return True
    if abs(key[0] - best[0]) > _TOLERANCE * max(1.0, abs(best[0])):
        return key[0] < best[0]
    return key[1:] < best[1:]
