"""What planning asynchronous schedules (pipedream, pipedream-2bw) changes, in one place.

- They change the optimization (stale weights: `ScheduleInfo.staleness`), so the search considers them only when
  asked (`--allow-async`); naming one without the flag is refused in one line.
- A candidate simulates the stream of `schedules.simulate.stream_steps` steps `run` would start with and predicts
  its steady state: the step is `stream_step_ms` (no fill, no drain, no flush), plus one gradient all-reduce per
  update (m per step for pipedream, one for 2BW) — each stage blocks for it where its update group completes.
  The bubble is the steady state's idle share: 1 - busy per step / (devices x step).
- Memory adds each stage's stashed weight copies: one more copy of a stage's parameters (in the precision's
  parameter dtype) per version it holds beyond the first (`MemoryCosts.weight_version_bytes`, counted by the
  simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipeplan.costs.overlap import Overlap, Reductions
from pipeplan.errors import ConfigError
from pipeplan.precision import get_precision
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.period import LayoutSteps, StepEnd, post_validated_floor, steady_state
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import MemoryCosts, Timeline, stream_step_ms


def searched_schedules(
    names: Sequence[str], *, allow_async: bool, zero: int | str = 0, named: bool = True
) -> tuple[str, ...]:
    """The schedules to search among `names`: the asynchronous ones only with `allow_async` and ZeRO off (`auto`
    evaluates them with ZeRO 0). When the user `named` them (not `auto`), an asynchronous one without
    --allow-async, or with --zero 1, is refused."""
    sharded = zero not in (0, "0", "auto")
    found = [name for name in names if schedule_info(name).asynchronous]
    if found and named and not allow_async:
        raise ConfigError(
            f"--schedule {found[0]} is asynchronous (stale weights, no flush: it changes what training computes); "
            "pass --allow-async to plan with it"
        )
    if found and named and sharded:
        raise ConfigError(f"--schedule {found[0]} runs with --zero 0 (ZeRO-1 cannot keep stashed weight versions)")
    keep = allow_async and not sharded
    return tuple(name for name in names if keep or not schedule_info(name).asynchronous)


def with_weight_versions(memory: MemoryCosts, name: str, param_counts: Sequence[int], precision: str) -> MemoryCosts:
    """`memory` with each stage's bytes per stashed weight copy when `name` is asynchronous: its parameters in the
    precision's parameter dtype (what `run` stashes)."""
    if not schedule_info(name).asynchronous:
        return memory
    size = get_precision(precision).param_bytes
    return replace(memory, weight_version_bytes=tuple(float(count * size) for count in param_counts))


def updates_per_step(name: str, num_microbatches: int) -> int:
    """Weight updates (each with its gradient all-reduce) per step: 0 for a synchronous schedule (its one
    all-reduce follows the flush), m / update_every for an asynchronous one."""
    if not schedule_info(name).asynchronous:
        return 0
    return num_microbatches // schedule_info(name).update_every(num_microbatches)


def predicted_step(
    name: str,
    timeline: Timeline,
    num_microbatches: int,
    device_stages: Sequence[Sequence[int]],
    stage_sync_ms: Sequence[float],
    device_optimizer_ms: Sequence[float] = (),
    overlap: Overlap = Overlap(),
    *,
    steps: LayoutSteps | None = None,
    post_validate: bool = False,
) -> tuple[float, float]:
    """(step ms, bubble rate) of a simulated step or stream. Synchronous: the period of steps of `timeline`'s op
    lists (`schedules.period`, timed again by `steps`, the first step is `timeline`): each device's last op, its
    stages' gradient exchanges (`stage_sync_ms`, `costs.overlap.Reductions`) and optimizer update, the next step
    after the global check or, `post_validate`d, after the device's own end; the bubble is the period's idle share.
    Asynchronous: the steady state (module docstring), each update paying the slowest device's exchange and
    update."""
    optimizer = list(device_optimizer_ms) or [0.0] * len(device_stages)
    if not schedule_info(name).asynchronous:
        assert steps is not None, "a synchronous step is timed again for its period"
        end = StepEnd(update_ms=optimizer, reduced=Reductions(device_stages, stage_sync_ms, overlap, num_microbatches))
        first = ([list(row) for row in timeline.starts], [list(row) for row in timeline.ends])
        steady = steady_state(steps.schedule, steps.timer, end, post_validate=post_validate, first=first)
        return steady.period_ms, steady.bubble_rate()
    step = stream_step_ms(timeline, num_microbatches)
    busy = sum(busy_per_step(timeline, num_microbatches))
    bubble = max(0.0, 1.0 - busy / (timeline.num_devices * step)) if step > 0 else 0.0
    sync = [sum(stage_sync_ms[s] for s in stages) for stages in device_stages]
    update = max(sync, default=0.0) + max(optimizer, default=0.0)
    return step + updates_per_step(name, num_microbatches) * update, bubble


def post_validated_floor_ms(
    schedule: Schedule,
    timeline: Timeline,
    num_microbatches: int,
    device_stages: Sequence[Sequence[int]],
    stage_sync_ms: Sequence[float],
    device_optimizer_ms: Sequence[float],
    overlap: Overlap = Overlap(),
) -> float:
    """A lower bound on `predicted_step`'s post-validated period of a synchronous `timeline` (`schedule`: its op
    lists), from that one step (`schedules.period.post_validated_floor`): the search skips simulating more steps
    where it is no shorter than the synchronized period."""
    end = StepEnd(
        update_ms=device_optimizer_ms, reduced=Reductions(device_stages, stage_sync_ms, overlap, num_microbatches)
    )
    first = ([list(row) for row in timeline.starts], [list(row) for row in timeline.ends])
    return post_validated_floor(schedule, first, end)


def busy_per_step(timeline: Timeline, num_microbatches: int) -> tuple[float, ...]:
    """Per device, its compute per step of a stream's timeline (every step of a stream does the same work)."""
    steps = 1 + max(h.microbatch for entry in timeline.entries for h in entry.op.parts) // num_microbatches
    return tuple(busy / steps for busy in timeline.device_busy)


def staleness(name: str, num_devices: int) -> str:
    """The summary's staleness line ("" for synchronous schedules)."""
    return schedule_info(name).describe_staleness(num_devices)
