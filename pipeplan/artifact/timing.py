"""A Plan read back into what its step was predicted from (`plan_inputs`: `predict.StepInputs`) and predicted again
by the one call the search made (`predict.predict`): what `pipeplan show`, timeline.json and `run`'s "predicted"
read (the search stored these figures in plan.json, so all three reproduce it).
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.artifact.plan import Plan, StagePlan
from pipeplan.errors import FormatError
from pipeplan.predict.layout import PipelineLayout, layout_schedule
from pipeplan.predict.memory import StaticRule, with_weight_versions
from pipeplan.predict.predict import Prediction, StepInputs, held_memory, predict, simulate_step, steady_steps
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.period import Steady
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import generate, schedule_info
from pipeplan.schedules.replicate import replicate_paced
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline


def plan_pipeline(plan: Plan) -> PipelineLayout:
    """Pipeline 0's layout as the plan's rank map and op lists state it."""
    ranks = [info for info in plan.ranks if info.pipeline == 0]
    return PipelineLayout(
        device_stages=tuple(info.stages for info in ranks),
        device_replica=tuple(info.stage_replica for info in ranks),
        device_ops=tuple(plan.rank_ops[info.rank] for info in ranks),
    )


def plan_costs(plan: Plan) -> StageCosts:
    """Per-stage op times on one device and the per-boundary transfer times, as the search stored them (before
    `predict.layout.transfer_costs` makes transfers block their senders where the plan does not overlap them)."""
    return StageCosts(
        forward_ms=tuple(s.forward_ms for s in plan.stages),
        input_grad_ms=tuple(s.input_grad_ms for s in plan.stages),
        weight_grad_ms=tuple(s.weight_grad_ms for s in plan.stages),
        backward_ms=tuple(_backward(s) for s in plan.stages),
        comm_ms=tuple(s.comm_ms for s in plan.stages[:-1]),
    )


def _backward(stage: StagePlan) -> float:
    return stage.input_grad_ms + stage.weight_grad_ms if stage.backward_ms is None else stage.backward_ms


def _searched_memory(plan: Plan, device_stages: tuple[tuple[int, ...], ...]) -> MemoryCosts:
    """Per stage activation bytes (and I's frees, and under recomputation what is kept and re-created), per
    pipeline-0 rank static bytes (`predict.memory.StaticRule`, as the search counted them), stashed weight copies."""
    training = plan.training
    copies = stage_copies(schedule_info(plan.schedule).placement)  # a mirrored schedule holds each stage twice
    rule = StaticRule(
        numerics=training.numerics,
        zero=training.zero,
        holders=training.data_parallel * training.context_parallel * copies,
        ep=training.expert_parallel,
    )
    counts = [s.param_count for s in plan.stages]
    experts, replicas = [s.expert_param_count for s in plan.stages], [s.replicas for s in plan.stages]
    memory = MemoryCosts(
        activation_bytes=tuple(float(s.activation_bytes) for s in plan.stages),
        input_grad_freed_bytes=tuple(float(s.activation_freed_by_input_grad_bytes) for s in plan.stages),
        static_bytes=rule.device_bytes(counts, experts, replicas, device_stages),
    )
    memory = with_weight_versions(memory, plan.schedule, counts, training.numerics)
    if all(s.kept_bytes is None for s in plan.stages):
        return memory
    return replace(
        memory,
        kept_bytes=tuple(float(s.activation_bytes if s.kept_bytes is None else s.kept_bytes) for s in plan.stages),
        recompute_bytes=tuple(float(s.recompute_bytes) for s in plan.stages),
    )


def plan_inputs(plan: Plan) -> StepInputs:
    """What the search predicted the plan's step from, read back from plan.json (static bytes without the undo
    copy: `predict.predict`)."""
    pipe = plan_pipeline(plan)
    return StepInputs(
        schedule=plan.schedule,
        pipeline=pipe,
        num_stages=len(plan.stages),
        num_microbatches=plan.training.num_microbatches,
        costs=plan_costs(plan),
        memory=_searched_memory(plan, pipe.device_stages),
        param_counts=tuple(s.param_count for s in plan.stages),
        stage_sync_ms=tuple(s.allreduce_ms for s in plan.stages),
        stage_optimizer_ms=tuple(s.optimizer_ms for s in plan.stages),
        numerics=plan.training.numerics,
        overlap=plan.training.overlap_options,
        step_checks_ms=plan.training.step_checks_ms,
    )


def plan_memory(plan: Plan) -> MemoryCosts:
    """The memory a run of the plan holds, as searched: `plan_inputs`' with the undo copy `run --post-validate`
    keeps when the plan post-validates."""
    return held_memory(plan_inputs(plan), post_validate=plan.training.post_validate)


def plan_schedule(plan: Plan) -> Schedule:
    """The one-device-per-stage-slot Schedule the plan's op lists come from. With replicated stages it is
    regenerated from the schedule name (a fixed order) and checked against the op lists."""
    pipe = plan_pipeline(plan)
    num_stages, m = len(plan.stages), plan.training.num_microbatches
    if all(s.replicas == 1 for s in plan.stages):
        return layout_schedule(pipe, plan.schedule, num_stages, m)
    schedule = generate(plan.schedule, num_devices=num_stages, num_microbatches=m)
    expanded = replicate_paced(schedule, tuple(s.replicas for s in plan.stages))
    if sorted(tuple(row) for row in expanded.op_strings()) != sorted(pipe.device_ops):
        raise FormatError(f"plan rank_ops do not match schedule {plan.schedule} with replicated stages; re-plan")
    return schedule


def plan_timeline(plan: Plan, costs: StageCosts | None = None) -> Timeline:
    """Pipeline 0's op lists (rank_ops) simulated again with the plan's costs, transfers as the plan runs them, or
    with `costs` as given (e.g. measured op times for a replay): the search's first step (without the gradient
    exchange and updates that follow it) and its per-rank peak bytes as the run holds them (`plan_memory`)."""
    inputs = plan_inputs(plan)
    held = replace(inputs, memory=held_memory(inputs, post_validate=plan.training.post_validate))
    return simulate_step(held, costs)


def plan_prediction(plan: Plan, *, post_validate: bool | None = None) -> Prediction:
    """The plan's step predicted again (`predict.predict`, as the search did), post-validated as the plan says or as
    `post_validate` overrides (`run`'s flags)."""
    eager = plan.training.post_validate if post_validate is None else post_validate
    return predict(plan_inputs(plan), post_validate=eager)


def plan_step_ms(plan: Plan, *, post_validate: bool | None = None) -> float:
    """The step the plan predicts (`plan_prediction`'s period: each rank's end, its stages' gradient exchange and
    optimizer updates, as the search timed it)."""
    return plan_prediction(plan, post_validate=post_validate).step_ms


def plan_steps(plan: Plan, *, post_validate: bool | None = None, min_steps: int = 2) -> Steady | None:
    """Several steps of the plan's op lists until their period repeats (at least `min_steps`): each rank's next
    step after its own end (post-validated) or after every rank's (`schedules.period`); None for an asynchronous
    schedule, whose timeline is already its stream of steps (`plan_timeline`)."""
    eager = plan.training.post_validate if post_validate is None else post_validate
    return steady_steps(plan_inputs(plan), post_validate=eager, min_steps=min_steps)


def plan_steps_timeline(plan: Plan, *, post_validate: bool | None = None) -> Timeline:
    """What `show` draws and timeline.json holds: the steps of `plan_steps` (microbatches of step k numbered from
    k x m, `schedules.period.repeated`), or an asynchronous plan's stream (`plan_timeline`)."""
    steady = plan_steps(plan, post_validate=post_validate)
    return plan_timeline(plan) if steady is None else steady.timeline(plan_memory(plan))


def timeline_rows(plan: Plan, timeline: Timeline) -> list[tuple[int, str, float, float]]:
    """(rank, op, start_ms, end_ms) of pipeline 0 (the other pipelines run the same lists at the same times):
    pipeline 0's rank r is pipeline device r."""
    assert timeline.num_devices == sum(1 for info in plan.ranks if info.pipeline == 0), "not this plan's timeline"
    return [(entry.device, str(entry.op), entry.start, entry.end) for entry in timeline.entries]
