"""A Plan back into the schedule, costs and memory it was timed with, and its timeline simulated again: what
`pipeplan show`, timeline.json and `run`'s "predicted" read (the search stored these figures in plan.json, so all
three reproduce it).
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.costs import device_static_bytes, stage_static_per_param, static_split
from pipeplan.costs.optimizer import undo_copy_bytes
from pipeplan.costs.overlap import Overlap, Reductions, eager_update_ms
from pipeplan.errors import FormatError
from pipeplan.plan.asynchronous import predicted_step, with_weight_versions
from pipeplan.plan.layout import PipelineLayout, layout_schedule, layout_steps, simulate_layout, transfer_costs
from pipeplan.plan.plan import Plan, StagePlan
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.period import Steady, StepEnd, steady_state
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
    `plan.layout.transfer_costs` makes transfers block their senders where the plan does not overlap them)."""
    return StageCosts(
        forward_ms=tuple(s.forward_ms for s in plan.stages),
        input_grad_ms=tuple(s.input_grad_ms for s in plan.stages),
        weight_grad_ms=tuple(s.weight_grad_ms for s in plan.stages),
        backward_ms=tuple(_backward(s) for s in plan.stages),
        comm_ms=tuple(s.comm_ms for s in plan.stages[:-1]),
    )


def plan_memory(plan: Plan) -> MemoryCosts:
    """Per stage activation bytes (and I's frees, and under recomputation what is kept and re-created), per
    pipeline-0 rank static bytes (ZeRO-1: each stage's optimizer state split over its holders, its routed experts'
    over 1/ep of them), as searched."""
    device_stages = [info.stages for info in plan.ranks if info.pipeline == 0]
    training = plan.training
    per_param: float | list[float] = training.optimizer_bytes_per_param
    if training.zero:  # the search's `stage_bytes_per_param`: routed experts' state over 1/ep of the holders
        split = static_split(training.optimizer, training.precision)
        holders = (
            training.data_parallel * training.context_parallel * stage_copies(schedule_info(plan.schedule).placement)
        )
        per_param = [
            stage_static_per_param(
                split, s.param_count, s.expert_param_count, s.replicas * holders, 1, training.expert_parallel
            )
            for s in plan.stages
        ]
    static = device_static_bytes([s.param_count for s in plan.stages], device_stages, per_param)
    if training.post_validate:  # the undo copy `run --post-validate` keeps
        undo = undo_copy_bytes(
            [s.param_count for s in plan.stages], device_stages, training.optimizer, training.precision
        )
        static = [b + u for b, u in zip(static, undo)]
    memory = MemoryCosts(
        activation_bytes=tuple(float(s.activation_bytes) for s in plan.stages),
        input_grad_freed_bytes=tuple(float(s.activation_freed_by_input_grad_bytes) for s in plan.stages),
        static_bytes=static,
    )
    counts = [s.param_count for s in plan.stages]
    memory = with_weight_versions(memory, plan.schedule, counts, plan.training.precision)
    if all(s.kept_bytes is None for s in plan.stages):
        return memory
    return replace(
        memory,
        kept_bytes=tuple(float(s.activation_bytes if s.kept_bytes is None else s.kept_bytes) for s in plan.stages),
        recompute_bytes=tuple(float(s.recompute_bytes) for s in plan.stages),
    )


def _backward(stage: StagePlan) -> float:
    return stage.input_grad_ms + stage.weight_grad_ms if stage.backward_ms is None else stage.backward_ms


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
    """Simulate pipeline 0's op lists (rank_ops) again with the plan's costs, transfers as the plan runs them
    (`plan.layout.transfer_costs`), or with `costs` as given (e.g. measured op times for a replay): the search's
    step (without the gradient exchange and updates that follow it) and its per-rank peak bytes."""
    pipe = plan_pipeline(plan)
    num_stages, m = len(plan.stages), plan.training.num_microbatches
    if costs is None:
        costs = transfer_costs(plan_costs(plan), pipe, Overlap.parse(plan.training.overlap))
    return simulate_layout(pipe, plan.schedule, num_stages, m, costs, plan_memory(plan))


def plan_step_ms(plan: Plan, timeline: Timeline, *, post_validate: bool | None = None) -> float:
    """The step the plan predicts, again from a timeline of its op lists (`plan_timeline`): the period of its steps
    (`plan.asynchronous.predicted_step`, as the search timed it: each rank's end, its stages' gradient exchange
    and optimizer updates), post-validated as the plan says or as `post_validate` overrides (`run`'s flags)."""
    return plan_period(plan, timeline, post_validate=post_validate)[0]


def plan_period(plan: Plan, timeline: Timeline, *, post_validate: bool | None = None) -> tuple[float, float]:
    """(period ms, its bubble rate) of `plan_step_ms`."""
    pipe, steps, overlap, eager, updates = _step_inputs(plan, post_validate)
    sync = [s.allreduce_ms for s in plan.stages]
    args = (plan.schedule, timeline, plan.training.num_microbatches, pipe.device_stages, sync, updates, overlap)
    return predicted_step(*args, steps=steps, post_validate=eager)


def _step_inputs(plan: Plan, post_validate: bool | None):  # type: ignore[no-untyped-def]
    """(pipeline 0's layout, its one-step timer, the overlap options, whether steps are post-validated, per rank
    its stages' optimizer updates as the search timed them, with the undo copy when post-validated:
    `costs.overlap.eager_update_ms`)."""
    pipe = plan_pipeline(plan)
    overlap = Overlap.parse(plan.training.overlap)
    costs = transfer_costs(plan_costs(plan), pipe, overlap)
    steps = layout_steps(pipe, plan.schedule, len(plan.stages), plan.training.num_microbatches, costs)
    eager = plan.training.post_validate if post_validate is None else post_validate
    updates = [sum(plan.stages[s].optimizer_ms for s in stages) for stages in pipe.device_stages]
    if eager:
        updates = eager_update_ms(updates, plan.training.optimizer, plan.training.precision)
    return pipe, steps, overlap, eager, updates


def plan_steps(plan: Plan, *, post_validate: bool | None = None, min_steps: int = 2) -> Steady | None:
    """Several steps of the plan's op lists until their period repeats (at least `min_steps`): each rank's next
    step after its own end (post-validated) or after every rank's (`schedules.period`); None for an asynchronous
    schedule, whose timeline is already its stream of steps (`plan_timeline`)."""
    if schedule_info(plan.schedule).asynchronous:
        return None
    pipe, steps, overlap, eager, updates = _step_inputs(plan, post_validate)
    m = plan.training.num_microbatches
    reductions = Reductions(pipe.device_stages, [s.allreduce_ms for s in plan.stages], overlap, m)
    end = StepEnd(update_ms=updates, reduced=reductions)
    return steady_state(steps.schedule, steps.timer, end, post_validate=eager, min_steps=min_steps)


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
