"""Build what one rank runs: trace the plan's model on the meta device, check the fingerprint, split the graph by
the plan's FX node names and materialize the tensors of the rank's own stages exactly as the whole-model build
has them (materialize.py).

`PipelineModel` also describes the *whole* split (every stage's input/output values, parameter names, the shape
and dtype of every cut value per microbatch), which every rank needs to route messages and build gradient groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from pipeplan.artifact.plan import Plan
from pipeplan.errors import PipeplanError, RunError
from pipeplan.graph.export_trace import retarget_device
from pipeplan.graph.run_dtypes import export_dtype
from pipeplan.graph.stage import (
    StageModule,
    build_stage_module,
    last_stage_outputs,
    stage_boundary,
    value_tensor_meta,
)
from pipeplan.graph.trace import TracedModel, trace_model, traced_constants
from pipeplan.models import load_model
from pipeplan.models.registry import file_of, file_sha256
from pipeplan.models.spec import ModelSpec
from pipeplan.runtime.step.comm import TensorMeta
from pipeplan.runtime.step.messages import StageIO
from pipeplan.runtime.step.recompute_run import check_recompute
from pipeplan.runtime.weights.init_weights import load_initial_weights
from pipeplan.runtime.weights.materialize import (
    build_whole,
    materialize,
    materialize_from_whole,
    named_tensors,
    refuse_or_announce_meta_path,
    whole_build_fits,
)


@dataclass(kw_only=True)
class PipelineModel:
    spec: ModelSpec
    traced: TracedModel
    stage_io: list[StageIO]
    model_inputs: tuple[str, ...]  # placeholder names, in forward-argument order
    model_outputs: tuple[str, ...]  # the values the model's output is built from (all read by the last stage)
    value_meta: dict[str, TensorMeta]  # per microbatch, for every value crossing a cut
    stage_params: list[tuple[str, ...]]  # canonical parameter names used by each stage
    modules: dict[int, StageModule]  # this rank's stages, materialized
    params: dict[str, nn.Parameter]  # canonical name -> this rank's materialized Parameter

    @property
    def differentiable(self) -> set[str]:
        return {name for name, meta in self.value_meta.items() if meta.dtype.is_floating_point}

    def output_stage(self) -> int:
        return len(self.stage_io) - 1

    def build_output(self, values: dict[str, torch.Tensor]):
        """The model's output, as its forward returns it (tensor, tuple, dict, ModelOutput), for loss_fn."""
        return self.traced.build_output(values)


def check_model_file(plan: Plan) -> None:
    """Refuse a plan whose model file changed since it was planned (its stage node names may no longer fit)."""
    path = file_of(plan.model.ref)
    if not plan.model.file_sha256 or path is None:
        return
    if not path.is_file():
        raise RunError(f"the plan's model file {str(path)!r} does not exist on this machine; put it there or re-plan")
    if file_sha256(path) != plan.model.file_sha256:
        raise RunError(
            f"model file {str(path)!r} changed since the plan was made (sha256 differs); re-run `pipeplan plan`"
        )


def load_spec(plan: Plan) -> ModelSpec:
    check_model_file(plan)
    return load_model(plan.model.ref, dict(plan.model.options))


def check_plan_runs(plan: Plan, *, trace: bool = True) -> None:
    """Everything about a plan that can be checked before a rank starts: runnable (stage FX nodes), a recorded
    graph fingerprint that the model still traces to, every node in exactly one stage, the model file unchanged,
    and its op lists executable (the same re-simulation `show` does: completeness, order, deadlock)."""
    from pipeplan.artifact.timing import plan_timeline

    plan.require_runnable()
    if not plan.model.fingerprint:
        raise RunError("the plan records no model fingerprint, so the model it was made for cannot be checked; re-plan")
    if trace:  # (a rank skips it here: building its stages traces the model the same way)
        trace_for_plan(plan, load_spec(plan))  # the model file unchanged, its graph the plan's, each node in one stage
    else:
        check_model_file(plan)
    try:
        plan_timeline(plan)
    except PipeplanError as exc:
        raise RunError(f"the plan's op lists cannot run: {exc}") from None


def trace_for_plan(plan: Plan, spec: ModelSpec) -> TracedModel:
    """Trace on the meta device at the microbatch size, with the plan's tracer (shapes from one CPU run where the
    model has data-dependent code); refuse a model whose graph differs from the plan's."""
    plan.require_runnable()
    traced = trace_model(
        spec,
        batch_size=plan.training.microbatch_size,
        granularity=plan.model.granularity,
        device="meta",
        tracer=plan.model.tracer or "fx",
        dtype=export_dtype(plan.training.precision),
    )
    expected, found = plan.model.fingerprint, traced.layer_graph.fingerprint
    if expected and expected != found:
        raise RunError(
            f"model {plan.model.ref!r} traces ({traced.tracer}, microbatch size {plan.training.microbatch_size}) to "
            f"graph fingerprint {found} but the plan was made for {expected}; re-run `pipeplan plan` for this model "
            "and options"
        )
    known = {node.name for node in traced.graph_module.graph.nodes}
    for stage in plan.stages:
        unknown = [name for name in stage.node_names if name not in known]
        if unknown:
            raise RunError(f"plan stage {stage.index} names FX nodes {unknown[:3]} the model does not have; re-plan")
    layered = sorted(name for layer in traced.layer_graph.layers for name in layer.nodes)
    named = sorted(name for stage in plan.stages for name in stage.node_names)
    if named != layered:  # each of the model's nodes computed by exactly one stage
        missing = sorted(set(layered) - set(named)) or sorted({n for n in named if named.count(n) > 1})
        raise RunError(f"the plan's stages do not compute each FX node exactly once (e.g. {missing[:3]}); re-plan")
    check_recompute(plan, traced)
    return traced


def _value_meta(traced: TracedModel, stage_io: list[StageIO]) -> dict[str, TensorMeta]:
    metas: dict[str, TensorMeta] = {}
    for stage, io in enumerate(stage_io):
        for name in io.inputs:
            meta = value_tensor_meta(traced, name)
            if not isinstance(meta, TensorMetadata):
                raise RunError(
                    f"stage {stage} needs non-tensor value {name!r} from an earlier stage; move the cut so it is "
                    "computed where it is used"
                )
            metas[name] = TensorMeta(shape=tuple(int(d) for d in meta.shape), dtype=meta.dtype)
    return metas


def stage_outputs(traced: TracedModel, stage_nodes: list[tuple[str, ...]]) -> list[list[str]]:
    """Each stage's output values: what later stages read, and for the last stage every value the model's output
    is built from (passed through from its inputs when an earlier stage computes it), so the loss runs there."""
    found = [stage_boundary(traced, names)[2] for names in stage_nodes[:-1]]
    return [*found, last_stage_outputs(traced, stage_nodes[-1])]


@dataclass(frozen=True)
class StageTensors:
    """A stage's parameters (canonical name -> shape, dtype at run time) and buffers (name -> shape)."""

    params: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buffers: dict[str, tuple[int, ...]]


def stage_tensors(plan: Plan, traced: TracedModel, param_dtype: torch.dtype) -> list[StageTensors]:
    """What each of the plan's stages holds, from the meta trace (floating tensors in the run's `param_dtype`): what
    a checkpoint of the plan's run must hold."""
    outputs = stage_outputs(traced, [stage.node_names for stage in plan.stages])
    canonical = _canonical_names(traced.module)
    found = []
    for stage, out in zip(plan.stages, outputs):
        module = build_stage_module(traced, stage.node_names, outputs=out)
        params = {
            canonical[id(p)]: (tuple(p.shape), param_dtype if p.is_floating_point() else p.dtype)
            for p in module.parameters()
        }
        found.append(StageTensors(params, {name: tuple(b.shape) for name, b in module.named_buffers()}))
    return found


def _canonical_names(module: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def build_pipeline_model(plan: Plan, rank: int, device: torch.device, *, init_from: str | None = None) -> PipelineModel:
    """The whole split on the meta device plus this rank's stages materialized on `device`: exactly the whole-model
    build's tensors (see runtime/weights/materialize.py), then the `init_from` file's values where given."""
    spec = load_spec(plan)
    traced = trace_for_plan(plan, spec)
    outputs = stage_outputs(traced, [stage.node_names for stage in plan.stages])
    canonical = _canonical_names(traced.module)
    meta_modules = [build_stage_module(traced, st.node_names, outputs=out) for st, out in zip(plan.stages, outputs)]
    stage_io = [StageIO(inputs=m.inputs, outputs=m.outputs) for m in meta_modules]
    stage_params = [tuple(sorted({canonical[id(p)] for p in m.parameters()})) for m in meta_modules]
    own = plan.ranks[rank].stages
    materialize_stages(
        plan, spec, traced, [meta_modules[s] for s in own], rank=rank, device=device, init_from=init_from
    )
    del meta_modules  # they hold the meta tensors; the own stages are rebuilt on the materialized ones
    if traced.tracer == "export":
        retarget_device(traced.graph_module, device)  # export captured the meta device in its constants
    modules = {s: build_stage_module(traced, plan.stages[s].node_names, outputs=outputs[s]) for s in own}
    if init_from:
        own_tensors = [item for s in own for item in named_tensors(modules[s])]
        load_initial_weights(init_from, model=traced.module, tensors=own_tensors)
    by_name = dict(traced.module.named_parameters(remove_duplicate=False))
    params = {name: by_name[name] for s in own for name in stage_params[s]}
    unmade = [name for module in modules.values() for name, tensor in named_tensors(module) if tensor.is_meta]
    if unmade:  # only the meta path can leave one: a value the tracer computed from meta buffers
        raise RunError(
            f"rank {rank} cannot initialize {unmade[0]!r} from the meta device; build the model on a host where it "
            "fits whole, or have its forward use buffers through submodules"
        )
    return PipelineModel(
        spec=spec,
        traced=traced,
        stage_io=stage_io,
        model_inputs=traced.layer_graph.input_names,
        model_outputs=traced.layer_graph.output_names,
        value_meta=_value_meta(traced, stage_io),
        stage_params=stage_params,
        modules=modules,
        params=params,
    )


def materialize_stages(
    plan: Plan,
    spec: ModelSpec,
    traced: TracedModel,
    stages: list[nn.Module],
    *,
    rank: int,
    device: torch.device,
    init_from: str | None = None,
) -> None:
    """Give `stages` (modules naming their tensors by model-qualified names) real tensors on `device`, swapped in
    everywhere in the traced model: the whole-model build's (default) or, for a model too large to build whole on
    this host, its declared per-submodule initializer's (the meta path)."""
    roots = [traced.module, traced.graph_module]
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fits, needed, available = whole_build_fits(traced.module, ranks_here)
    if all_ranks_agree(fits, device):  # one mechanism for all ranks: ties and replicas must start equal
        whole = build_whole(spec, plan.training.seed)

        def constants() -> nn.Module:  # the tracer's constants (ops on buffers alone), from the real whole model
            if init_from:  # computed from the file's buffers, so the whole file is read
                load_initial_weights(init_from, model=whole, tensors=list(named_tensors(whole)))
            return traced_constants(whole, spec, granularity=plan.model.granularity, tracer=plan.model.tracer)

        materialize_from_whole(whole, stages, roots=roots, device=device, constants=constants)
        return
    refuse_or_announce_meta_path(spec, rank=rank, needed=needed, available=available, ranks=ranks_here)
    own_tensors = [t for stage in stages for _, t in named_tensors(stage)]
    assert spec.init_module is not None, "refuse_or_announce_meta_path refuses a factory without init_module"
    materialize(
        traced.module,
        needed=own_tensors,
        seed=plan.training.seed,
        device=device,
        init_module=spec.init_module,
        also_replace_in=[traced.graph_module, *stages],
    )


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True when `flag` holds on every rank of the process group (this rank alone outside one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
