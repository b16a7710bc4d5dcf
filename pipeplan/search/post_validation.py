"""The search's post-validation policy (`--post-validate on|off|auto`): which candidates may post-validate, and the
prediction a candidate keeps — synchronized, or post-validated where that is asked for, or (auto) where it shortens
the period and its undo copy (`costs.optimizer.undo_copy_bytes`) fits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pipeplan.predict.predict import Prediction, StepInputs, peak_bytes, post_validated_floor, predict
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import Timeline

_SHORTER = 1 - 1e-9  # a period shorter than another by more than float rounding
Rejected = TypeVar("Rejected")


def post_validation_allowed(schedule: str, zero: int) -> bool:
    """Whether `auto` may post-validate: a synchronous schedule (`runtime.post_validate` refuses the others) without
    ZeRO-1 (the memory of the undo copy `run --post-validate` keeps is counted for whole parameters only:
    `costs.optimizer.undo_copy_bytes`)."""
    return not schedule_info(schedule).asynchronous and not zero


def may_post_validate(mode: str, schedule: str, zero: int) -> bool:
    """Whether a candidate's steps may be post-validated under `mode` (zb-auto and zbv rank their orders by it)."""
    return mode == "on" or (mode == "auto" and post_validation_allowed(schedule, zero))


def settled_prediction(
    inputs: StepInputs,
    timeline: Timeline,
    *,
    mode: str,
    zero: int,
    reject: Callable[[tuple[int, ...]], Rejected | None],
) -> Prediction | Rejected:
    """The prediction of a candidate whose first step is `timeline`, or the rejection `reject(peak bytes)` returns
    (None when they fit): of its peaks, or of a post-validation turned `on` whose undo copy does not fit (`auto`
    then keeps its steps synchronized)."""
    over = reject(peak_bytes(timeline))
    if over is not None:
        return over
    steps = None if schedule_info(inputs.schedule).asynchronous else inputs.steps()
    if mode == "on":
        chosen = predict(inputs, post_validate=True, timeline=timeline, steps=steps)
        return reject(chosen.device_memory_bytes) or chosen
    synced = predict(inputs, post_validate=False, timeline=timeline, steps=steps)
    if mode != "auto" or not post_validation_allowed(inputs.schedule, zero):
        return synced
    assert steps is not None, "post-validation is for synchronous schedules"
    if post_validated_floor(inputs, timeline, steps) >= synced.step_ms * _SHORTER:
        return synced  # post-validated steps cannot be shorter: not simulated
    chosen = predict(inputs, post_validate=True, timeline=timeline, steps=steps)
    if chosen.step_ms >= synced.step_ms * _SHORTER or reject(chosen.device_memory_bytes) is not None:
        return synced
    return chosen


def synchronized_period_ms(inputs: StepInputs, timeline: Timeline) -> float:
    """The period of a candidate's op lists had its steps been synchronized (what a post-validated plan's rationale
    compares its period with: `search.rationale`)."""
    return predict(inputs, post_validate=False, timeline=timeline).step_ms
