"""The step a pipeline settles into: the period of its steps, from one step's timeline and what ends each device's
step (its gradient exchanges and optimizer update: `StepSync`).

- Synchronous schedules: steps of the op lists replayed from each device's ready time (`schedules.period`) until
  their ready times repeat; the next step starts after the global check, or post-validated after the device's own
  end (`run --post-validate`). The bubble is the period's idle share.
- Asynchronous schedules (pipedream, pipedream-2bw) change the optimization (stale weights:
  `ScheduleInfo.staleness`); a candidate simulates the stream of `schedules.simulate.stream_steps` steps `run`
  would start with and predicts its steady state: the step is `stream_step_ms` (no fill, no drain, no flush), plus
  one gradient all-reduce per update (m per step for pipedream, one for 2BW) — each stage blocks for it where its
  update group completes. The bubble is the steady state's idle share: 1 - busy per step / (devices x step). Their
  memory adds each stage's stashed weight copies (`predict.memory.with_weight_versions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.costs.overlap import Overlap, Reductions
from pipeplan.schedules.period import LayoutSteps, Steady, StepEnd, post_validated_floor, steady_state
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import Timeline, stream_step_ms


@dataclass(frozen=True, kw_only=True)
class StepSync:
    """What follows each device's last op in a step: per stage its gradient exchange (`stage_sync_ms`, reduced as
    `overlap` allows: `costs.overlap.Reductions`), per device its optimizer update (`device_update_ms`)."""

    device_stages: tuple[tuple[int, ...], ...]
    stage_sync_ms: tuple[float, ...]
    device_update_ms: tuple[float, ...]
    overlap: Overlap
    num_microbatches: int

    def step_end(self) -> StepEnd:
        reduced = Reductions(self.device_stages, self.stage_sync_ms, self.overlap, self.num_microbatches)
        return StepEnd(update_ms=list(self.device_update_ms), reduced=reduced)


@dataclass(frozen=True)
class Period:
    """The steady interval between step ends and its idle share."""

    step_ms: float
    bubble_rate: float


def updates_per_step(name: str, num_microbatches: int) -> int:
    """Weight updates (each with its gradient all-reduce) per step: 0 for a synchronous schedule (its one
    all-reduce follows the flush), m / update_every for an asynchronous one."""
    if not schedule_info(name).asynchronous:
        return 0
    return num_microbatches // schedule_info(name).update_every(num_microbatches)


def period(
    name: str, timeline: Timeline, steps: LayoutSteps | None, sync: StepSync, *, post_validate: bool = False
) -> Period:
    """The period of a simulated step or stream (module docstring). Synchronous: `timeline` is the first step,
    `steps` times the others; the next step starts after the global check or, `post_validate`d, after the device's
    own end. Asynchronous (`steps` unused): the steady state, each update paying the slowest device's exchange and
    update."""
    if not schedule_info(name).asynchronous:
        assert steps is not None, "a synchronous schedule's period needs its step timer"
        first = ([list(row) for row in timeline.starts], [list(row) for row in timeline.ends])
        steady = steady_state(steps.schedule, steps.timer, sync.step_end(), post_validate=post_validate, first=first)
        return Period(steady.period_ms, steady.bubble_rate())
    m = sync.num_microbatches
    step = stream_step_ms(timeline, m)
    busy = sum(busy_per_step(timeline, m))
    bubble = max(0.0, 1.0 - busy / (timeline.num_devices * step)) if step > 0 else 0.0
    exchange = [sum(sync.stage_sync_ms[s] for s in stages) for stages in sync.device_stages]
    update = max(exchange, default=0.0) + max(sync.device_update_ms, default=0.0)
    return Period(step + updates_per_step(name, m) * update, bubble)


def post_validated_floor_ms(steps: LayoutSteps, timeline: Timeline, sync: StepSync) -> float:
    """A lower bound on `period`'s post-validated period of a synchronous `timeline` (`steps.schedule`: its op
    lists), from that one step (`schedules.period.post_validated_floor`): the search skips simulating more steps
    where it is no shorter than the synchronized period."""
    first = ([list(row) for row in timeline.starts], [list(row) for row in timeline.ends])
    return post_validated_floor(steps.schedule, first, sync.step_end())


def repeated_steps(steps: LayoutSteps, sync: StepSync, *, post_validate: bool, min_steps: int = 2) -> Steady:
    """Several steps of a synchronous pipeline until their period repeats (at least `min_steps`): what `show` draws
    and timeline.json holds."""
    return steady_state(steps.schedule, steps.timer, sync.step_end(), post_validate=post_validate, min_steps=min_steps)


def busy_per_step(timeline: Timeline, num_microbatches: int) -> tuple[float, ...]:
    """Per device, its compute per step of a stream's timeline (every step of a stream does the same work)."""
    steps = 1 + max(h.microbatch for entry in timeline.entries for h in entry.op.parts) // num_microbatches
    return tuple(busy / steps for busy in timeline.device_busy)


def per_device(per_stage: Sequence[float], device_stages: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Per device of a pipeline, the sum over the stages (chunks) it holds."""
    return tuple(sum(per_stage[s] for s in stages) for stages in device_stages)
