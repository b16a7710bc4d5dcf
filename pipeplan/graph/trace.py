"""Trace a ModelSpec into a LayerGraph: layers (groups of graph nodes) in topological order and, for every cut
between two adjacent layers, the values live across it (skip connections and model inputs included).

Two frontends produce the graph: torch.fx symbolic tracing (`fx_trace`, honours ModelSpec.leaf_modules) and
torch.export in non-strict mode (`export_trace`, for models fx cannot trace, e.g. Hugging Face transformers).
`tracer="auto"` tries fx and falls back to export; the tracer used is recorded (profile, plan) so every later
step traces the same way. An export is specialized to the batch size and to the parameters' dtype (`dtype`: a
model exported in float32 records `x.to(input_dtype)` as a cast to float32, which a bfloat16 run would then keep);
every step that traces for a precision passes that precision's `export_dtype` (graph.run_dtypes). Layer grouping
(`grouping`) and cuts are the same for both; constant values are made again in each layer that reads them
(`constants`). The model's output may be any pytree (a tensor, tuple, dict, dataclass, Hugging Face ModelOutput):
`TracedModel.build_output` rebuilds it from its leaves for the loss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from pipeplan.errors import ConfigError, ModelError, TraceError
from pipeplan.graph.constants import rematerialize_constants
from pipeplan.graph.grouping import (
    assign_unowned,
    check_in_place,
    cut_producers,
    group,
    layer_keys,
    merge_data_dependent_cuts,
    normalize_graph,
)
from pipeplan.graph.tracers import check_tracer
from pipeplan.models.spec import ModelSpec


@dataclass(frozen=True)
class TensorInfo:
    producer: str  # graph node name of the value
    shape: tuple[int, ...]
    dtype: str  # torch dtype name ("float32"), or a Python type name for a non-tensor value
    bytes: int


@dataclass(frozen=True)
class Layer:
    name: str
    module_path: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class LayerGraph:
    layers: tuple[Layer, ...]
    cuts: tuple[tuple[TensorInfo, ...], ...]  # cuts[i]: values live between layers i and i+1
    input_names: tuple[str, ...]
    output_name: str  # the first (often only) tensor of the model's output
    fingerprint: str
    output_names: tuple[str, ...] = ()  # every graph value in the model's output (default: output_name)
    tracer: str = "fx"  # fx | export
    eager_modules: tuple[str, ...] = ()  # modules fx did not trace into (declared or automatic leaves), by path

    def __post_init__(self) -> None:
        assert len(self.cuts) == len(self.layers) - 1, "one cut between each pair of adjacent layers"
        if not self.output_names:
            object.__setattr__(self, "output_names", (self.output_name,))

    def cut_bytes(self, i: int) -> int:
        return sum(info.bytes for info in self.cuts[i])

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass
class TracedModel:
    module: nn.Module
    graph_module: fx.GraphModule
    layer_graph: LayerGraph
    spec: ModelSpec
    device: str = "cpu"
    batch_size: int = 1
    node_layer: dict[str, int] = field(default_factory=dict)  # graph node name -> layer index
    output_spec: TreeSpec | None = None  # pytree structure of the model's output
    output_leaves: tuple[Any, ...] = ()  # per leaf: ("node", name) or ("const", value)

    @property
    def tracer(self) -> str:
        return self.layer_graph.tracer

    def build_output(self, values: dict[str, Any]) -> Any:
        """The model's output (as its forward returns it) from the values of `layer_graph.output_names`."""
        leaves = [values[item] if kind == "node" else item for kind, item in self.output_leaves]
        return tree_unflatten(leaves, self.output_spec) if self.output_spec is not None else leaves[0]


def _value_info(node: fx.Node) -> TensorInfo:
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        dtype = str(meta.dtype).removeprefix("torch.")
        return TensorInfo(node.name, tuple(int(d) for d in meta.shape), dtype, _value_info_bytes(meta))
    total = sum(_value_info_bytes(m) for m in _flatten_meta(meta))
    return TensorInfo(node.name, (), node.meta.get("value_type", "object"), total)


def _flatten_meta(meta) -> list[TensorMetadata]:
    if isinstance(meta, TensorMetadata):
        return [meta]
    if isinstance(meta, list | tuple):
        return [m for item in meta for m in _flatten_meta(item)]
    if isinstance(meta, dict):
        return [m for item in meta.values() for m in _flatten_meta(item)]
    return []


def _value_info_bytes(meta: TensorMetadata) -> int:
    numel = 1
    for dim in meta.shape:
        numel *= int(dim)
    return numel * torch.empty((), dtype=meta.dtype, device="meta").element_size()


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    return getattr(target, "__qualname__", "")


def _fingerprint(gm: fx.GraphModule, layers: Sequence[Layer], tracer: str) -> str:
    digest = hashlib.sha256()
    if tracer != "fx":
        digest.update(f"tracer {tracer}\n".encode())
    for node in gm.graph.nodes:
        target = _target_name(node.target)
        digest.update(f"{node.op}|{node.name}|{target}|{[a.name for a in node.all_input_nodes]}\n".encode())
    first_owner: dict[int, str] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        owner = first_owner.setdefault(id(param), name)  # tied weights hash differently from untied ones
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{owner}\n".encode())
    for layer in layers:
        digest.update(f"layer {layer.name} {len(layer.nodes)}\n".encode())
    return digest.hexdigest()[:16]


def _output_tree(gm: fx.GraphModule, export_spec: TreeSpec | None) -> tuple[TreeSpec, tuple, tuple[str, ...]]:
    """(pytree spec, leaves as ("node", name) / ("const", value), the node names among them)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if export_spec is not None:
        flat, spec = list(output.args[0]), export_spec
    else:
        value = output.args[0]
        if isinstance(value, list | tuple) and len(value) == 1:
            value = value[0]
        flat, spec = tree_flatten(value)
    leaves = tuple(("node", v.name) if isinstance(v, fx.Node) else ("const", v) for v in flat)
    names = tuple(dict.fromkeys(item for kind, item in leaves if kind == "node"))
    if not names:
        raise TraceError("the model's forward returns no tensor computed from its inputs (the value for loss_fn)")
    return spec, leaves, names


def _sample_inputs(
    spec: ModelSpec, batch_size: int, device: str, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    """The sample batch's inputs on `device`, floating-point ones in `dtype` (when given)."""
    inputs, _ = spec.sample_batch(batch_size, generator=torch.Generator().manual_seed(0))
    cast = lambda t: t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device)  # noqa: E731
    return tuple(cast(t) for t in inputs)


def build_module(spec: ModelSpec, device: str) -> nn.Module:
    """Build the spec's module directly on `device` ("meta" allocates nothing)."""
    try:
        with torch.device(device):
            return spec.build()
    except (ValueError, TypeError) as exc:
        raise ModelError(f"building model {spec.name!r} failed: {exc}") from None


def trace_model(
    spec: ModelSpec,
    *,
    batch_size: int = 1,
    granularity: int | None = None,
    device: str = "cpu",
    tracer: str = "auto",
    dtype: torch.dtype | None = None,
) -> TracedModel:
    """Build `spec` on `device`, trace it, propagate shapes for `batch_size` samples and group nodes into layers;
    `dtype`: the parameters' dtype an export is specialized to (module docstring; fx graphs do not depend on it)."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if granularity is not None and granularity < 1:
        raise ConfigError(f"--granularity must be >= 1 (module depth), got {granularity}")
    check_tracer(tracer)
    module = build_module(spec, device)
    return trace_module(
        module, spec, batch_size=batch_size, granularity=granularity, device=device, tracer=tracer, dtype=dtype
    )


def _capture(module: nn.Module, spec: ModelSpec, batch_size: int, device: str, tracer: str, dtype=None):
    """(GraphModule with tensor_meta on its nodes, export's output spec or None, the tracer used).

    auto: fx, else export, else fx with automatic leaves (a module inside a repeated block that neither can trace,
    such as an MoE layer with data-dependent routing, runs eagerly: fx_trace.symbolic_trace)."""
    from pipeplan.graph.eager_check import check_runs_eagerly
    from pipeplan.graph.fx_trace import propagate_shapes, symbolic_trace

    if tracer == "export":
        try:
            return (*_export(module, spec, batch_size, device, dtype), "export")
        except TraceError:
            check_runs_eagerly(module, spec, _sample_inputs(spec, batch_size, device, dtype))
            raise
    try:
        gm = symbolic_trace(module, spec)
    except TraceError as fx_error:
        export_error = None
        if tracer == "auto":
            try:
                return (*_export(module, spec, batch_size, device, dtype), "export")
            except TraceError as error:
                export_error = error
        try:
            gm = symbolic_trace(module, spec, auto_leaves=True)
        except TraceError:
            check_runs_eagerly(module, spec, _sample_inputs(spec, batch_size, device, dtype))  # the model's own error
            if export_error is None:
                raise TraceError(f"{fx_error}; or trace with --tracer export") from None
            raise TraceError(f"{fx_error}; and {export_error}") from None
    inputs = _sample_inputs(spec, batch_size, device)
    propagate_shapes(gm, spec, inputs, device, lambda: _sample_inputs(spec, batch_size, "cpu"))
    return gm, None, "fx"


def _export(module: nn.Module, spec: ModelSpec, batch_size: int, device: str, dtype: torch.dtype | None = None):
    """Export on the meta device (one graph whatever device the model is on): see export_trace.export_graph; with
    `dtype`, of the model with parameters in that dtype (a meta module cast: no memory)."""
    from pipeplan.graph.export_trace import export_graph

    meta_inputs = _sample_inputs(spec, batch_size, "meta", dtype)
    if device == "meta":
        return export_graph(module.to(dtype) if dtype is not None else module, spec, meta_inputs)
    meta_module = build_module(spec, "meta")
    return export_graph(
        module,
        spec,
        meta_inputs,
        meta_module=meta_module.to(dtype) if dtype is not None else meta_module,
        real_inputs=lambda: _sample_inputs(spec, batch_size, device, dtype),
    )


def traced_constants(module: nn.Module, spec: ModelSpec, *, granularity: int | None, tracer: str) -> nn.Module:
    """A module holding, under their qualified names, the tensor constants the tracer captures, computed from
    `module`'s real tensors: fx's (ops on buffers alone) from tracing it; export's from an export on the module's
    own device, where a constant the forward makes from Python values (an index list such as `x[..., [-2], :]`,
    lifted by export under the submodule that made it) keeps the value the meta export has lost."""
    if tracer != "export":
        return trace_module(module, spec, batch_size=1, granularity=granularity, tracer=tracer or "fx").graph_module
    from pipeplan.graph.export_trace import export_program

    device = next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))
    with spec.tracing():
        return export_program(module, spec, _sample_inputs(spec, 1, str(device)))[0]


def trace_module(
    module: nn.Module,
    spec: ModelSpec,
    *,
    batch_size: int = 1,
    granularity: int | None = None,
    device: str = "cpu",
    tracer: str = "auto",
    dtype: torch.dtype | None = None,
) -> TracedModel:
    """Like trace_model, for an already-built module (its parameters are referenced, never copied)."""
    with spec.tracing():  # the model's own trace context (ModelSpec.trace_context)
        gm, export_spec, used = _capture(module, spec, batch_size, device, check_tracer(tracer), dtype)
    normalize_graph(gm)
    nodes = list(gm.graph.nodes)
    keys = assign_unowned(nodes, layer_keys(gm, module, granularity))
    grouped, node_layer = group(nodes, keys)
    if rematerialize_constants(gm, node_layer):  # constant values made again where read, not sent across cuts
        nodes = list(gm.graph.nodes)
        names = [name for name, _ in grouped]
        keys = [names[node_layer[n.name]] if n.op not in ("placeholder", "output") else "" for n in nodes]
        grouped, node_layer = group(nodes, keys)
    grouped, node_layer = merge_data_dependent_cuts(nodes, grouped, node_layer)  # no cut carries an unknown size
    layers = [Layer(name=name, module_path=name, nodes=tuple(names)) for name, names in grouped]
    output = next(n for n in nodes if n.op == "output")
    node_layer[output.name] = len(layers) - 1
    aliasing = check_in_place(nodes, node_layer)
    if aliasing:
        raise TraceError(f"{aliasing}, in another layer; make that op out-of-place or use a coarser --granularity")
    cuts = [tuple(_value_info(n) for n in cut) for cut in cut_producers(nodes, node_layer, len(layers))]
    output_spec, output_leaves, output_names = _output_tree(gm, export_spec)
    graph = LayerGraph(
        layers=tuple(layers),
        cuts=tuple(cuts),
        input_names=tuple(n.name for n in nodes if n.op == "placeholder"),
        output_name=output_names[0],
        output_names=output_names,
        fingerprint=_fingerprint(gm, layers, used),
        tracer=used,
        eager_modules=tuple(gm.meta.get("eager_modules", ())),
    )
    return TracedModel(
        module=module,
        graph_module=gm,
        layer_graph=graph,
        spec=spec,
        device=device,
        batch_size=batch_size,
        node_layer=node_layer,
        output_spec=output_spec,
        output_leaves=output_leaves,
    )
