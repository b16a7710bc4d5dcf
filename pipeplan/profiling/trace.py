"""Trace a ModelSpec with torch.fx into a LayerGraph: layers (groups of FX nodes) in topological order and, for
every cut between two adjacent layers, the tensors live across it (skip connections and model inputs included).

Layers follow the model's module structure. By default each item of a repeated-block container (an
nn.ModuleList / nn.Sequential whose children share one type: gpt `blocks.{i}`, mlp `layers.{i}`) is a layer and
every other top-level child is one layer (gpt `embed`, `head`). `granularity=N` instead groups by the first N
components of each node's module path (1 = top-level children only; 3 splits a gpt block into ln1/attn/ln2/mlp).
Nodes outside any module at that depth (functional ops such as a top-level residual add) join the layer of the
nearest preceding node; nodes before the first module join the next one; placeholders join their first user.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from pipeplan.errors import ConfigError, ModelError, TraceError
from pipeplan.models.spec import ModelSpec


@dataclass(frozen=True)
class TensorInfo:
    producer: str  # FX node name of the value
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
    output_name: str
    fingerprint: str

    def __post_init__(self) -> None:
        assert len(self.cuts) == len(self.layers) - 1, "one cut between each pair of adjacent layers"

    def cut_bytes(self, i: int) -> int:
        return sum(info.bytes for info in self.cuts[i])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_index(self, name: str) -> int:
        for i, layer in enumerate(self.layers):
            if layer.name == name:
                return i
        raise KeyError(name)


@dataclass
class TracedModel:
    module: nn.Module
    graph_module: fx.GraphModule
    layer_graph: LayerGraph
    spec: ModelSpec
    device: str = "cpu"
    batch_size: int = 1
    node_layer: dict[str, int] = field(default_factory=dict)  # FX node name -> layer index


class _Tracer(fx.Tracer):
    """Honours the spec's leaf modules and remembers the innermost module being traced when tracing fails."""

    def __init__(self, leaf_types: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.failed_module: tuple[str, type] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:  # the innermost module fails first
                self.failed_module = (self.path_of_module(m), type(m))
            raise


def _symbolic_trace(module: nn.Module, spec: ModelSpec) -> fx.GraphModule:
    tracer = _Tracer(tuple(spec.leaf_modules))
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # torch.fx raises many types for untraceable code
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if tracer.failed_module is not None:
            path, cls = tracer.failed_module
            where = f"module {path!r} ({cls.__name__})"
            fix = f"mark it a leaf: leaf_modules=({cls.__name__},) in the factory's ModelSpec"
        else:
            where = f"the top-level forward of {type(module).__name__}"
            fix = "move the data-dependent code into a submodule and list its class in ModelSpec.leaf_modules"
        raise TraceError(f"torch.fx cannot trace {where}: {reason}; {fix}") from None
    return fx.GraphModule(module, graph, class_name=type(module).__name__)


def _node_module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        value = list(stack.values())[-1]
        return value[0] if isinstance(value, tuple) else str(value)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    return ""


def _repeated_containers(module: nn.Module) -> set[str]:
    """Paths of ModuleList/Sequential containers whose children all share one type (repeated blocks)."""
    found = set()
    for path, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList | nn.Sequential) and len({type(child) for child in sub}) == 1:
            found.add(path)
    return found


def _default_key(path: str, repeated: set[str], root_prefix: str) -> str:
    """Layer key of a module path under the repeated-block rule."""
    if not path:
        return ""
    if root_prefix and not (path == root_prefix or path.startswith(root_prefix + ".")):
        return path.split(".")[0]
    parts = path.split(".")
    start = len(root_prefix.split(".")) if root_prefix else 0
    if len(parts) <= start:
        return ""
    head = ".".join(parts[: start + 1])
    if head in repeated and len(parts) > start + 1:
        return ".".join(parts[: start + 2])
    return head


def _root_prefix(module: nn.Module) -> str:
    """Descend through single-child wrappers (`self.model = Inner()`) so they do not make a one-layer model."""
    prefix, current = "", module
    while True:
        children = list(current.named_children())
        if len(children) != 1:
            return prefix
        name, child = children[0]
        prefix = f"{prefix}.{name}" if prefix else name
        current = child


def _layer_keys(gm: fx.GraphModule, module: nn.Module, granularity: int | None) -> list[str]:
    """One key per node ('' = unowned), in graph order."""
    repeated = _repeated_containers(module)
    root_prefix = _root_prefix(module)
    has_children = {path for path, sub in module.named_modules() if next(sub.children(), None) is not None}
    keys = []
    for node in gm.graph.nodes:
        path = _node_module_path(node) if node.op not in ("placeholder", "output") else ""
        if granularity is None:
            keys.append(_default_key(path, repeated, root_prefix))
            continue
        parts = path.split(".") if path else []
        if len(parts) >= granularity:
            keys.append(".".join(parts[:granularity]))
        else:  # a shallower leaf module is its own layer; code of a subdivided module joins a neighbour
            keys.append(path if path and path not in has_children else "")
    return keys


def _assign_unowned(nodes: list[fx.Node], keys: list[str]) -> list[str]:
    """Give every unowned node the key of its nearest preceding owned node (or the next one at the start)."""
    resolved = list(keys)
    last = ""
    for i, key in enumerate(resolved):
        if key:
            last = key
        elif nodes[i].op not in ("placeholder", "output") and last:
            resolved[i] = last
    following = ""
    for i in range(len(resolved) - 1, -1, -1):
        if resolved[i]:
            following = resolved[i]
        elif nodes[i].op not in ("placeholder", "output"):
            resolved[i] = following
    if not any(resolved):
        resolved = ["model" if n.op not in ("placeholder", "output") else "" for n in nodes]
    return resolved


def _group(nodes: list[fx.Node], keys: list[str]) -> tuple[list[Layer], dict[str, int]]:
    """Contiguous runs of equal keys become layers; a key seen before (a module called again later) stays in the
    current layer, so layers remain contiguous. Placeholders join the layer of their first user."""
    layers: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for node, key in zip(nodes, keys):
        if node.op in ("placeholder", "output"):
            continue
        if layers and key in seen:
            layers[-1][1].append(node.name)
        else:
            layers.append((key, [node.name]))
            seen.add(key)
    node_layer = {name: i for i, (_, names) in enumerate(layers) for name in names}
    for node in reversed([n for n in nodes if n.op == "placeholder"]):
        users = [node_layer[u.name] for u in node.users if u.name in node_layer]
        target = min(users, default=0)
        layers[target][1].insert(0, node.name)
        node_layer[node.name] = target
    built = [Layer(name=name, module_path=name, nodes=tuple(names)) for name, names in layers]
    return built, node_layer


def _value_info(node: fx.Node) -> TensorInfo:
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        dtype = str(meta.dtype).removeprefix("torch.")
        return TensorInfo(node.name, tuple(int(d) for d in meta.shape), dtype, _value_info_bytes(meta))
    total = sum(_value_info_bytes(m) for m in _flatten_meta(meta))
    return TensorInfo(node.name, (), node.meta.get("value_type", "object"), total)


class _ShapeProp(ShapeProp):
    """ShapeProp that also records the Python type of non-tensor values (an int size crossing a cut)."""

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        n.meta["value_type"] = type(result).__name__
        return result


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


def _cuts(nodes: list[fx.Node], node_layer: dict[str, int], num_layers: int) -> list[tuple[TensorInfo, ...]]:
    cuts: list[list[TensorInfo]] = [[] for _ in range(num_layers - 1)]
    for node in nodes:
        if node.op == "output" or not node.users:
            continue
        produced = node_layer[node.name]
        last_use = max(num_layers if u.op == "output" else node_layer[u.name] for u in node.users)
        if last_use > produced:
            info = _value_info(node)
            for cut in range(produced, min(last_use, num_layers - 1)):
                cuts[cut].append(info)
    return [tuple(cut) for cut in cuts]


def _fingerprint(gm: fx.GraphModule, layers: Sequence[Layer]) -> str:
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", "")
        digest.update(f"{node.op}|{node.name}|{target}|{[a.name for a in node.all_input_nodes]}\n".encode())
    first_owner: dict[int, str] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        owner = first_owner.setdefault(id(param), name)  # tied weights hash differently from untied ones
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{owner}\n".encode())
    for layer in layers:
        digest.update(f"layer {layer.name} {len(layer.nodes)}\n".encode())
    return digest.hexdigest()[:16]


def _output_name(gm: fx.GraphModule) -> str:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]
    if not isinstance(value, fx.Node):
        raise TraceError("the model's forward must return one tensor (the value passed to loss_fn); return it alone")
    return value.name


def _sample_inputs(spec: ModelSpec, batch_size: int, device: str) -> tuple[torch.Tensor, ...]:
    inputs, _ = spec.sample_batch(batch_size, generator=torch.Generator().manual_seed(0))
    return tuple(t.to(device) for t in inputs)


def build_module(spec: ModelSpec, device: str) -> nn.Module:
    """Build the spec's module directly on `device` ("meta" allocates nothing)."""
    try:
        with torch.device(device):
            return spec.build()
    except (ValueError, TypeError) as exc:
        raise ModelError(f"building model {spec.name!r} failed: {exc}") from None


def trace_model(
    spec: ModelSpec, *, batch_size: int = 1, granularity: int | None = None, device: str = "cpu"
) -> TracedModel:
    """Build `spec` on `device`, trace it, propagate shapes for `batch_size` samples and group nodes into layers."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if granularity is not None and granularity < 1:
        raise ConfigError(f"--granularity must be >= 1 (module depth), got {granularity}")
    module = build_module(spec, device)
    return trace_module(module, spec, batch_size=batch_size, granularity=granularity, device=device)


def trace_module(
    module: nn.Module, spec: ModelSpec, *, batch_size: int = 1, granularity: int | None = None, device: str = "cpu"
) -> TracedModel:
    """Like trace_model, for an already-built module (its parameters are referenced, never copied)."""
    gm = _symbolic_trace(module, spec)
    inputs = _sample_inputs(spec, batch_size, device)
    try:
        with torch.no_grad():
            _ShapeProp(gm).propagate(*inputs)
    except Exception as exc:
        raise TraceError(
            f"running the traced {spec.name!r} on sample inputs failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''} (check the factory's sample_batch)"
        ) from None
    nodes = list(gm.graph.nodes)
    keys = _assign_unowned(nodes, _layer_keys(gm, module, granularity))
    layers, node_layer = _group(nodes, keys)
    output = next(n for n in nodes if n.op == "output")
    node_layer[output.name] = len(layers) - 1
    cuts = _cuts(nodes, node_layer, len(layers))
    graph = LayerGraph(
        layers=tuple(layers),
        cuts=tuple(cuts),
        input_names=tuple(n.name for n in nodes if n.op == "placeholder"),
        output_name=_output_name(gm),
        fingerprint=_fingerprint(gm, layers),
    )
    return TracedModel(
        module=module,
        graph_module=gm,
        layer_graph=graph,
        spec=spec,
        device=device,
        batch_size=batch_size,
        node_layer=node_layer,
    )
