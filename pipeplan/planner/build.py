"""Turn the search's winner into a Plan (plan.json), and a Plan back into the schedule and costs it was timed
with (`pipeplan show`, timeline.json).

Stage node names come from the traced LayerGraph; a plan made from a profile alone has none and is marked not
runnable (`Plan.runnable`). Rank `r` runs the op list of pipeline device `r % P`; microbatches are numbered per
pipeline, so every pipeline runs the same lists.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import pipeplan
from pipeplan.errors import FormatError
from pipeplan.partition.costs import busiest_device_ms, bytes_per_param, device_static_bytes
from pipeplan.planner.asynchronous import predicted_step, with_weight_versions
from pipeplan.planner.candidate import Evaluation
from pipeplan.planner.layout import PipelineLayout, rank_infos, simulate_layout
from pipeplan.planner.plan import ModelRef, Plan, Prediction, StagePlan, TrainingConfig, run_device_for
from pipeplan.planner.rationale import alternatives, memory_choices, rationale
from pipeplan.planner.search import SearchResult
from pipeplan.planner.tensor_parallel import devices_cluster
from pipeplan.precision import get_precision
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.trace import LayerGraph
from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.registry import generate
from pipeplan.schedules.replicate import replicate_paced
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline


def build_plan(
    result: SearchResult,
    *,
    model: ModelRef,
    layer_graph: LayerGraph | None = None,
    evaluation: Evaluation | None = None,
    num_alternatives: int = 3,
    tensor_parallel_reason: str = "",
) -> Plan:
    """The Plan for `evaluation` (default: the best candidate of `result`); `tensor_parallel_reason` (why this
    tensor-parallel size, `planner.tensor_search`) opens the rationale."""
    chosen = evaluation or result.best
    layout = chosen.layout
    profile = result.profiles[layout.microbatch_size]
    if layer_graph is not None:
        _check_graph_matches(profile, layer_graph)
    training = TrainingConfig(
        global_batch_size=result.config.global_batch_size,
        microbatch_size=layout.microbatch_size,
        num_microbatches=layout.num_microbatches,
        data_parallel=layout.data_parallel,
        optimizer=str(result.config.optimizer).split("-")[0],  # the algorithm (adamw, sgd); --precision the bytes
        optimizer_bytes_per_param=result.config.per_param,
        dtype=get_precision(result.config.precision).compute_dtype_name,
        precision=result.config.precision,
        device=run_device_for(profile.provenance.device),
        zero=chosen.zero,
        tensor_parallel=result.config.tensor_parallel,
    )
    pipe = chosen.pipeline
    world = pipe.num_devices * layout.data_parallel
    tokens = model.tokens_per_sample
    return Plan(
        model=model,
        cluster=devices_cluster(result.cluster, result.config.tensor_parallel),
        training=training,
        schedule=layout.schedule,
        chunks=chosen.schedule.num_chunks,
        stages=_stage_plans(chosen, profile, layer_graph),
        ranks=rank_infos(pipe, layout.data_parallel, result.cluster),
        rank_ops=tuple(pipe.device_ops[rank % pipe.num_devices] for rank in range(world)),
        predicted=Prediction(
            step_ms=chosen.step_ms,
            samples_per_s=chosen.samples_per_s,
            tokens_per_s=chosen.samples_per_s * tokens if tokens else None,
            bubble_rate=chosen.timeline.bubble_rate,
            peak_memory_bytes=tuple(chosen.device_memory_bytes[rank % pipe.num_devices] for rank in range(world)),
            memory_limit_bytes=result.cluster.memory_per_device - result.config.memory_reserve_bytes,
            memory_reserve_bytes=result.config.memory_reserve_bytes,
        ),
        alternatives=alternatives(result, chosen, limit=num_alternatives),
        rationale=" ".join(part for part in (_sentence(tensor_parallel_reason), rationale(result, chosen)) if part),
        memory_choices=memory_choices(result, chosen),
        pipeplan_version=pipeplan.__version__,
        torch_version=torch.__version__,
    )


def _sentence(reason: str) -> str:
    return f"Tensor parallelism {reason}." if reason else ""


def _check_graph_matches(profile: Profile, graph: LayerGraph) -> None:
    names = [layer.name for layer in graph.layers]
    if names != [layer.name for layer in profile.layers]:
        raise FormatError(
            f"the profile's {profile.num_layers} layers do not match the traced model's {len(names)} layers; "
            "re-profile the model (or pass the same --granularity)"
        )


def _stage_plans(chosen: Evaluation, profile: Profile, graph: LayerGraph | None) -> tuple[StagePlan, ...]:
    stage_memory = {}
    for device, stages in enumerate(chosen.pipeline.device_stages):
        for stage in stages:
            stage_memory[stage] = chosen.device_memory_bytes[device]
    plans = []
    for index, stage in enumerate(chosen.partition.stages):
        first, last = stage.first_layer, stage.last_layer
        nodes = tuple(n for layer in graph.layers[first : last + 1] for n in layer.nodes) if graph else ()
        plans.append(
            StagePlan(
                index=index,
                first_layer=first,
                last_layer=last,
                layer_names=tuple(layer.name for layer in profile.layers[first : last + 1]),
                node_names=nodes,
                replicas=stage.replicas,
                forward_ms=stage.forward_ms,
                input_grad_ms=stage.input_grad_ms,
                weight_grad_ms=stage.weight_grad_ms,
                backward_ms=stage.backward_ms,
                param_count=sum(layer.param_count for layer in profile.layers[first : last + 1]),
                memory_bytes=int(stage_memory[index]),
                comm_ms=chosen.costs.comm_ms[index] if index + 1 < len(chosen.partition.stages) else 0.0,
                activation_bytes=int(chosen.memory.activation_bytes[index]),
                activation_freed_by_input_grad_bytes=int(chosen.memory.input_grad_freed_bytes[index]),
                allreduce_ms=chosen.stage_allreduce_ms[index],
                **_recompute_fields(chosen, index),
            )
        )
    return tuple(plans)


def _recompute_fields(chosen: Evaluation, index: int) -> dict:
    """The stage's recomputation as searched: mode, added time, kept and re-created bytes."""
    stage, memory = chosen.partition.stages[index], chosen.memory
    if memory.kept_bytes is None:
        return {}
    rise = memory.recompute_bytes
    return dict(
        recompute=stage.recompute,
        recompute_ms=stage.recompute_ms,
        kept_bytes=int(memory.kept_bytes[index]),  # type: ignore[index]
        recompute_bytes=int(rise[index] if isinstance(rise, tuple | list) else rise),
    )


def plan_pipeline(plan: Plan) -> PipelineLayout:
    """Pipeline 0's layout as the plan's rank map and op lists state it."""
    ranks = [info for info in plan.ranks if info.pipeline == 0]
    return PipelineLayout(
        device_stages=tuple(info.stages for info in ranks),
        device_replica=tuple(info.stage_replica for info in ranks),
        device_ops=tuple(plan.rank_ops[info.rank] for info in ranks),
    )


def plan_costs(plan: Plan) -> StageCosts:
    """Per-stage op times on one device and the per-boundary transfer times, as the search simulated them."""
    return StageCosts(
        forward_ms=tuple(s.forward_ms for s in plan.stages),
        input_grad_ms=tuple(s.input_grad_ms for s in plan.stages),
        weight_grad_ms=tuple(s.weight_grad_ms for s in plan.stages),
        backward_ms=tuple(_backward(s) for s in plan.stages),
        comm_ms=tuple(s.comm_ms for s in plan.stages[:-1]),
    )


def plan_memory(plan: Plan) -> MemoryCosts:
    """Per stage activation bytes (and I's frees, and under recomputation what is kept and re-created), per
    pipeline-0 rank static bytes (ZeRO-1: each stage's optimizer state split over its holders), as searched."""
    device_stages = [info.stages for info in plan.ranks if info.pipeline == 0]
    training = plan.training
    per_param: float | list[float] = training.optimizer_bytes_per_param
    if training.zero:
        per_param = [
            float(
                bytes_per_param(
                    training.optimizer, training.precision, zero=1, group_size=s.replicas * training.data_parallel
                )
            )
            for s in plan.stages
        ]
    static = device_static_bytes([s.param_count for s in plan.stages], device_stages, per_param)
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
        placement = {stage: device for device, stages in enumerate(pipe.device_stages) for stage in stages}
        return Schedule(
            name=plan.schedule,
            num_devices=pipe.num_devices,
            num_stages=num_stages,
            num_microbatches=m,
            stage_device=tuple(placement[s] for s in range(num_stages)),
            device_ops=tuple(tuple(Op.parse(text) for text in ops) for ops in pipe.device_ops),
        )
    schedule = generate(plan.schedule, num_devices=num_stages, num_microbatches=m)
    expanded = replicate_paced(schedule, tuple(s.replicas for s in plan.stages))
    if sorted(tuple(row) for row in expanded.op_strings()) != sorted(pipe.device_ops):
        raise FormatError(f"plan rank_ops do not match schedule {plan.schedule} with replicated stages; re-plan")
    return schedule


def plan_timeline(plan: Plan, costs: StageCosts | None = None) -> Timeline:
    """Simulate pipeline 0's op lists (rank_ops) again with the plan's costs (or `costs`, e.g. measured op times
    for a replay): the search's step (without the gradient all-reduce that follows it) and its per-rank peak
    bytes."""
    pipe = plan_pipeline(plan)
    num_stages, m = len(plan.stages), plan.training.num_microbatches
    return simulate_layout(pipe, plan.schedule, num_stages, m, costs or plan_costs(plan), plan_memory(plan))


def plan_step_ms(plan: Plan, timeline: Timeline) -> float:
    """The predicted step: the pipeline's makespan plus the all-reduce after the flush (each rank reduces its
    stages in turn; ranks in parallel); for an asynchronous plan the stream's steady state (planner/asynchronous)."""
    allreduce = busiest_device_ms([s.allreduce_ms for s in plan.stages], [info.stages for info in plan.ranks])
    return predicted_step(plan.schedule, timeline, plan.training.num_microbatches, allreduce)[0]


def timeline_rows(plan: Plan, timeline: Timeline) -> list[tuple[int, str, float, float]]:
    """(rank, op, start_ms, end_ms) of pipeline 0 (the other pipelines run the same lists at the same times):
    pipeline 0's rank r is pipeline device r."""
    assert timeline.num_devices == sum(1 for info in plan.ranks if info.pipeline == 0), "not this plan's timeline"
    return [(entry.device, str(entry.op), entry.start, entry.end) for entry in timeline.entries]
