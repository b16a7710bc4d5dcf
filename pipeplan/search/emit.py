"""Turn the search's winner into a Plan (plan.json): its training settings, stages with their node names, rank map
and op lists, prediction, alternatives and rationale.

Stage node names come from the traced LayerGraph; a plan made from a profile alone has none and is marked not
runnable (`Plan.runnable`). Rank `r` runs the op list of pipeline device `r % P`; microbatches are numbered per
pipeline, so every pipeline runs the same lists. `pipeplan.artifact.timing` turns a Plan back into the schedule and
costs it was timed with.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import TYPE_CHECKING, Any

from pipeplan.artifact.plan import ModelRef, Plan, Predicted, StagePlan, TrainingConfig, run_device_for
from pipeplan.artifact.ranks import rank_infos
from pipeplan.errors import FormatError
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.retime import layers_breakdown
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import stage_value
from pipeplan.search.candidate import Evaluation
from pipeplan.search.rationale import alternatives, memory_choices, rationale
from pipeplan.search.search import SearchResult
from pipeplan.version import VERSION

if TYPE_CHECKING:  # a plan from a profile file alone is made without importing torch
    from pipeplan.graph.trace import LayerGraph


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
    layout, numerics = chosen.layout, result.config.numerics
    profile = result.profiles[layout.microbatch_size]
    if layer_graph is not None:
        _check_graph_matches(profile, layer_graph)
    training = TrainingConfig(
        global_batch_size=result.config.global_batch_size,
        microbatch_size=layout.microbatch_size,
        num_microbatches=layout.num_microbatches,
        data_parallel=layout.data_parallel,
        optimizer=numerics.optimizer_label,  # what the memory was counted for (adamw, sgd, sgd-nomomentum)
        optimizer_bytes_per_param=result.config.per_param,
        dtype=numerics.precision.compute_dtype_name,
        precision=numerics.precision.name,
        attention=profile.provenance.attention,
        device=run_device_for(profile.provenance.device),
        zero=chosen.zero,
        tensor_parallel=result.config.tensor_parallel,
        context_parallel=result.config.context_parallel,
        expert_parallel=result.config.expert_parallel,
        overlap=result.config.overlap.label,
        **_step_settings(chosen),
    )
    pipe, tokens = chosen.pipeline, model.tokens_per_sample
    world = pipe.num_devices * layout.data_parallel
    return Plan(
        model=model,
        cluster=result.cluster,
        training=training,
        schedule=layout.schedule,
        chunks=chosen.schedule.num_chunks,
        stages=_stage_plans(chosen, profile, layer_graph),
        ranks=rank_infos(pipe, layout.data_parallel, result.cluster, result.config.groups),
        rank_ops=tuple(pipe.device_ops[rank % pipe.num_devices] for rank in range(world)),
        predicted=Predicted(
            step_ms=chosen.step_ms,
            samples_per_s=chosen.samples_per_s,
            tokens_per_s=chosen.samples_per_s * tokens if tokens else None,
            bubble_rate=chosen.timeline.bubble_rate,
            peak_memory_bytes=tuple(chosen.device_memory_bytes[rank % pipe.num_devices] for rank in range(world)),
            memory_limit_bytes=result.usable_memory_bytes,
            memory_reserve_bytes=result.config.memory_reserve_bytes,
        ),
        alternatives=alternatives(result, chosen, limit=num_alternatives),
        rationale=" ".join(part for part in (_sentence(tensor_parallel_reason), rationale(result, chosen)) if part),
        memory_choices=memory_choices(result, chosen),
        pipeplan_version=VERSION,
        torch_version=torch_version(),
    )


def _step_settings(chosen: Evaluation) -> dict[str, Any]:
    """How the chosen step ends: post-validated or not, and a synchronized step's global checks (learned by refine)."""
    return {"post_validate": chosen.post_validate, "step_checks_ms": chosen.inputs.step_checks_ms}


def torch_version() -> str:
    """The torch a plan is made with: the imported one's version, else the installed one's (a plan from a profile
    file is made without importing torch)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    return importlib.metadata.version("torch")


def _sentence(reason: str) -> str:
    """The rationale's opening: why this tensor/context-parallel size (`t=8: ...`), or a whole sentence already."""
    if not reason:
        return ""
    return f"Tensor parallelism {reason}." if reason.startswith("t=") else reason


def _check_graph_matches(profile: Profile, graph: LayerGraph) -> None:
    names = [layer.name for layer in graph.layers]
    if names != [layer.name for layer in profile.layers]:
        raise FormatError(
            f"the profile's {profile.num_layers} layers do not match the traced model's {len(names)} layers; "
            "re-profile the model (or pass the same --granularity)"
        )


def _stage_plans(chosen: Evaluation, profile: Profile, graph: LayerGraph | None) -> tuple[StagePlan, ...]:
    stage_memory: dict[int, float] = {}
    for device, held in enumerate(chosen.pipeline.device_stages):
        for index in held:
            stage_memory[index] = chosen.device_memory_bytes[device]
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
                expert_param_count=sum(layer.expert_param_count for layer in profile.layers[first : last + 1]),
                memory_bytes=int(stage_memory[index]),
                comm_ms=stage_value(chosen.costs.comm_ms, index) if index + 1 < len(chosen.partition.stages) else 0.0,
                activation_bytes=int(stage_value(chosen.memory.activation_bytes, index)),
                activation_freed_by_input_grad_bytes=int(stage_value(chosen.memory.input_grad_freed_bytes, index)),
                allreduce_ms=chosen.stage_allreduce_ms[index],
                optimizer_ms=chosen.stage_optimizer_ms[index],
                compute_breakdown=_breakdown(profile, first, last, stage.recompute, chosen.partition.schedule),
                **_recompute_fields(chosen, index),
            )
        )
    return tuple(plans)


def _breakdown(profile: Profile, first: int, last: int, recompute: str, schedule: str) -> dict[str, float]:
    """One microbatch of the stage as the schedule runs it (F + B, or F + I + W), by part
    (`profiling.retime.layers_breakdown`); {} for a profile timed without a kernel model (measured: nothing to
    split)."""
    rates = profile.provenance.kernel_rates
    if not rates:
        return {}
    split = schedule_info(schedule).split_backward
    return layers_breakdown(profile.layers[first : last + 1], rates, recompute, split_backward=split).as_dict()


def _recompute_fields(chosen: Evaluation, index: int) -> dict:
    """The stage's recomputation as searched: mode, added time, kept and re-created bytes."""
    stage, memory = chosen.partition.stages[index], chosen.memory
    if memory.kept_bytes is None:
        return {}
    return dict(
        recompute=stage.recompute,
        recompute_ms=stage.recompute_ms,
        kept_bytes=int(stage_value(memory.kept_bytes, index)),
        recompute_bytes=int(stage_value(memory.recompute_bytes, index)),
    )
