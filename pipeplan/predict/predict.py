"""`predict(inputs) -> Prediction`: one pipeline's step — its op lists timed, its period, bubble, each device's
peak bytes and its gradient exchanges — from `StepInputs`, the one call both the search's candidates
(`search.candidate`) and a plan's re-simulation (`artifact.timing`: `show`, timeline.json, `run`'s predicted lines)
make.

`StepInputs.memory` holds static bytes without `run --post-validate`'s undo copy: a post-validated prediction adds
it to each device's peak (`Prediction.device_memory_bytes`); `with_undo_copy` gives the memory a post-validated run
holds, for a timeline whose peaks include it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.costs import Numerics
from pipeplan.costs.optimizer import undo_copy_bytes
from pipeplan.costs.overlap import Overlap, eager_update_ms
from pipeplan.predict.layout import PipelineLayout, layout_steps, simulate_layout, transfer_costs
from pipeplan.predict.memory import with_undo_copy
from pipeplan.predict.step import Period, StepSync, per_device, period, post_validated_floor_ms, repeated_steps
from pipeplan.schedules.period import LayoutSteps, Steady, StepEnd, steady_state
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """Everything one pipeline's step is predicted from: its schedule and layout (op lists per pipeline device),
    per stage one op's time on one device and per boundary the transfer (`costs`, before `transfer_costs` makes
    transfers block), per stage its activation bytes and per device its static bytes (`memory`, no undo copy), per
    stage its parameters, gradient exchange and optimizer update (on one of its devices), how the step is held
    (`numerics`) and which communication overlaps."""

    schedule: str
    pipeline: PipelineLayout
    num_stages: int
    num_microbatches: int
    costs: StageCosts
    memory: MemoryCosts
    param_counts: tuple[int, ...]
    stage_sync_ms: tuple[float, ...]
    stage_optimizer_ms: tuple[float, ...]
    numerics: Numerics
    overlap: Overlap = Overlap()
    step_checks_ms: float = 0.0  # a synchronized step's global checks, on every device (`Provenance.step_checks_ms`)

    @property
    def timed_costs(self) -> StageCosts:
        """`costs` as a step runs them (transfers blocking their senders unless `overlap.p2p`)."""
        return transfer_costs(self.costs, self.pipeline, self.overlap)

    def steps(self) -> LayoutSteps:
        """The one-step op lists and their timer from each device's ready time."""
        return layout_steps(self.pipeline, self.schedule, self.num_stages, self.num_microbatches, self.timed_costs)

    def sync(self, *, post_validate: bool) -> StepSync:
        """What ends each device's step: its stages' exchanges and its optimizer update (post-validated: with the
        undo copy's reads and writes, `costs.overlap.eager_update_ms`; synchronized: after the global checks,
        `step_checks_ms`, which a post-validated step settles during the next one and an asynchronous one has not)."""
        stages = self.pipeline.device_stages
        updates = per_device(self.stage_optimizer_ms, stages)
        if post_validate:
            updates = tuple(eager_update_ms(updates, self.numerics))
        elif self.step_checks_ms and not schedule_info(self.schedule).asynchronous:
            updates = tuple(ms + self.step_checks_ms for ms in updates)
        return StepSync(
            device_stages=stages,
            stage_sync_ms=self.stage_sync_ms,
            device_update_ms=updates,
            overlap=self.overlap,
            num_microbatches=self.num_microbatches,
        )


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A step as predicted: `timeline` the first step's (an asynchronous schedule's stream) op times and peaks
    (without the undo copy), its `bubble_rate` the period's; `step_ms` the period; `device_memory_bytes` each
    pipeline device's peak as run holds it (static + live activations, + the undo copy when `post_validate`)."""

    timeline: Timeline
    step_ms: float
    device_memory_bytes: tuple[int, ...]
    post_validate: bool

    @property
    def bubble_rate(self) -> float:
        return self.timeline.bubble_rate


def simulate_step(inputs: StepInputs, costs: StageCosts | None = None) -> Timeline:
    """One step of the op lists (`costs`: other per-stage costs, e.g. measured ones, transfers as given)."""
    timed = inputs.timed_costs if costs is None else costs
    return simulate_layout(
        inputs.pipeline, inputs.schedule, inputs.num_stages, inputs.num_microbatches, timed, inputs.memory
    )


def peak_bytes(timeline: Timeline) -> tuple[int, ...]:
    """Each device's simulated peak, in whole bytes."""
    return tuple(int(round(b)) for b in timeline.peak_memory_bytes)


def predict(
    inputs: StepInputs,
    *,
    post_validate: bool = False,
    timeline: Timeline | None = None,
    steps: LayoutSteps | None = None,
) -> Prediction:
    """The step of `inputs`, synchronized or post-validated; `timeline` / `steps`: the first step and the step
    timer when already made (`simulate_step`, `StepInputs.steps`)."""
    first = simulate_step(inputs) if timeline is None else timeline
    timer = inputs.steps() if steps is None and not schedule_info(inputs.schedule).asynchronous else steps
    found = period(inputs.schedule, first, timer, inputs.sync(post_validate=post_validate), post_validate=post_validate)
    peaks = first.peak_memory_bytes
    if post_validate:
        undo = undo_copy_bytes(inputs.param_counts, inputs.pipeline.device_stages, inputs.numerics)
        peaks = tuple(b + u for b, u in zip(peaks, undo))
    return Prediction(
        timeline=replace(first, bubble_rate=found.bubble_rate),
        step_ms=found.step_ms,
        device_memory_bytes=tuple(int(round(b)) for b in peaks),
        post_validate=post_validate,
    )


def post_validated_floor(inputs: StepInputs, timeline: Timeline, steps: LayoutSteps) -> float:
    """A lower bound on the post-validated period from the first step alone (`step.post_validated_floor_ms`)."""
    return post_validated_floor_ms(steps, timeline, inputs.sync(post_validate=True))


def steady_steps(inputs: StepInputs, *, post_validate: bool, min_steps: int = 2) -> Steady | None:
    """Several steps until their period repeats (at least `min_steps`); None for an asynchronous schedule, whose
    timeline is already its stream of steps."""
    if schedule_info(inputs.schedule).asynchronous:
        return None
    return repeated_steps(
        inputs.steps(), inputs.sync(post_validate=post_validate), post_validate=post_validate, min_steps=min_steps
    )


def compute_period_ms(inputs: StepInputs, *, post_validate: bool) -> float:
    """The period of a synchronous step with free transfers and nothing after the last op (no exchange, no update):
    what is left is compute and the schedule's bubble."""
    free = replace(inputs, costs=replace(inputs.costs, comm_ms=0.0))
    steps = free.steps()
    return steady_state(steps.schedule, steps.timer, StepEnd(), post_validate=post_validate).period_ms


def held_memory(inputs: StepInputs, *, post_validate: bool) -> MemoryCosts:
    """The memory a run holds: `inputs.memory`, with the undo copy when post-validated."""
    if not post_validate:
        return inputs.memory
    return with_undo_copy(inputs.memory, inputs.param_counts, inputs.pipeline.device_stages, inputs.numerics)


__all__ = ["Period", "Prediction", "StepInputs", "predict", "simulate_step"]
