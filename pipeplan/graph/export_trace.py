"""The torch.export frontend (non-strict): for models torch.fx cannot trace symbolically (Hugging Face
transformers, code that branches on shapes or inspects its arguments).

`torch.export.export(module, inputs, strict=False)` runs the real Python forward on fake tensors and records ATen
ops; every node keeps the module path it ran under (`nn_module_stack`) and its fake value (`val`), so the graph
groups into layers exactly like an fx graph and needs no separate shape propagation. `ep.module()` is an unlifted
GraphModule whose parameters and buffers are the original module's, under their original qualified names. Shapes
are specialized to the sample batch, so the graph is exported again at each batch size it runs at; the model's
output structure (a dict, a dataclass, a Hugging Face ModelOutput) comes back as the pytree spec of the outputs.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._pytree import TreeSpec

from pipeplan.errors import TraceError
from pipeplan.models.spec import ModelSpec


def export_graph(
    module: nn.Module,
    spec: ModelSpec,
    inputs: tuple,
    *,
    meta_module: nn.Module | None = None,
    real_inputs: Callable[[], tuple] | None = None,
) -> tuple[fx.GraphModule, TreeSpec | None]:
    """(unlifted GraphModule with tensor_meta and mutation records on its nodes, the output's pytree spec).

    The export always runs on the meta device (`inputs` on meta; `meta_module`: the same model built on meta,
    when `module` lives on a real device): the captured ops depend on the device's kernels (strides decide whether
    a `.contiguous()` is recorded), and the profile, the plan and every rank must see one graph. The graph then
    uses `module`'s own parameters and buffers (bound by qualified name) and its device, and the values of the
    constants its forward makes from Python values (`real_inputs()`: the sample batch on `module`'s device)."""
    gm, out_spec = export_program(meta_module if meta_module is not None else module, spec, inputs)
    if meta_module is not None:
        _bind_state(gm, module)
        if real_inputs is not None:
            _bind_constants(gm, module, spec, real_inputs)
        device = next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))
        retarget_device(gm, device)
    return gm, out_spec


def _bind_state(gm: fx.GraphModule, module: nn.Module) -> None:
    """Make every parameter and buffer of `gm` the tensor of the same qualified name in `module` (ties kept)."""
    real: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    real.update(module.named_buffers(remove_duplicate=False))
    for store in ("_parameters", "_buffers"):
        for path, owner in gm.named_modules(remove_duplicate=False):
            for attr in list(getattr(owner, store)):
                name = f"{path}.{attr}" if path else attr
                if name not in real:
                    raise TraceError(f"the exported graph holds {name!r}, which the model does not; use --tracer fx")
                getattr(owner, store)[attr] = real[name]


def _meta_constants(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Qualified name -> each plain tensor attribute on the meta device (export's lifted constants)."""
    found = {}
    for path, owner in gm.named_modules(remove_duplicate=False):
        for attr, value in vars(owner).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                found[f"{path}.{attr}" if path else attr] = value
    return found


def _bind_constants(gm: fx.GraphModule, module: nn.Module, spec: ModelSpec, real_inputs: Callable[[], tuple]) -> None:
    """Give the constants a forward makes from Python values (`x[..., [-2], :]`'s index, `torch.tensor(min)`) the
    values they have: export on the meta device lifts them without data; an export of the real `module` (only when
    there are such constants) computes them, under the same names."""
    constants = _meta_constants(gm)
    if not constants:
        return
    real, _ = export_program(module, spec, real_inputs())
    for name, meta in constants.items():
        owner_path, _, attr = name.rpartition(".")
        value = getattr(real.get_submodule(owner_path) if owner_path else real, attr, None)
        if not isinstance(value, torch.Tensor) or value.shape != meta.shape or value.dtype != meta.dtype:
            raise TraceError(f"torch.export captured constant {name!r} on the meta device but not on the model's")
        object.__setattr__(gm.get_submodule(owner_path) if owner_path else gm, attr, value)


def export_program(module: nn.Module, spec: ModelSpec, inputs: tuple) -> tuple[fx.GraphModule, TreeSpec | None]:
    try:
        with _quiet():
            program = torch.export.export(module, tuple(inputs), strict=False)
    except Exception as exc:  # export raises many types for code it cannot capture
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"torch.export cannot trace {spec.name!r}: {type(exc).__name__}: {reason[:300]}; use --tracer fx with "
            "the data-dependent submodule listed in ModelSpec.leaf_modules"
        ) from None
    gm = program.module()
    _drop_guards(gm)
    _portable_histc(gm)
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(value)
        node.meta["value_type"] = type(value).__name__ if value is not None else "NoneType"
        node.meta["mutates"] = _mutated_args(node)
    _refuse_constants(gm, module)
    return gm, getattr(gm, "_out_spec", None)


def _refuse_constants(gm: fx.GraphModule, module: nn.Module) -> None:
    """A tensor the forward creates from Python values is captured as a constant; on the meta device its value is
    lost, so such a model must be traced with fx (a silently wrong constant is not an option)."""
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    known.update(name for name, _ in module.named_buffers(remove_duplicate=False))
    for graph_module in _graph_modules(gm):
        for node in graph_module.graph.nodes:
            value = getattr(graph_module, str(node.target), None) if node.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and graph_module is gm and node.target not in known:
                raise TraceError(
                    f"torch.export captured a tensor constant ({node.target}) that the model creates in forward; "
                    "register it as a buffer in __init__, or use --tracer fx"
                )


@contextlib.contextmanager
def _quiet():
    """torch logs warnings, errors and partial graphs while an export fails; pipeplan reports it in one line."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove the checks export adds: the input-shape guard call (it checks the unlifted module's own inputs) and
    the tensor-metadata asserts (they pin the device the graph was exported on)."""
    for graph_module in _graph_modules(gm):  # higher-order ops (no_grad regions) keep their graph in a submodule
        for node in list(graph_module.graph.nodes):
            guard = node.op == "call_module" and str(node.target).startswith("_guards")
            assert_op = node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
            if guard or assert_op:
                graph_module.graph.erase_node(node)
        graph_module.graph.lint()
        graph_module.recompile()


def _portable_histc(gm: fx.GraphModule) -> None:
    """`histc` of integers has a CUDA kernel and no CPU one (and the reverse for floats under deterministic
    algorithms): Hugging Face MoE code picks the dtype by the device it runs on, so on the meta device it records an
    integer histc that a CPU rank cannot run. Give every histc a float32 copy of an integer input instead: counts
    below 2**24 are exact in float32, and the graph (its fingerprint) is the same whatever device it runs on."""
    histc = torch.ops.aten.histc.default
    for graph_module in _graph_modules(gm):
        changed = False
        for node in list(graph_module.graph.nodes):
            source = node.args[0] if node.op == "call_function" and node.target is histc else None
            value = source.meta.get("val") if isinstance(source, fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.is_floating_point():
                continue
            with graph_module.graph.inserting_before(node):
                copy = graph_module.graph.call_function(
                    torch.ops.aten._to_copy.default, (source,), {"dtype": torch.float32}
                )
            copy.meta["val"] = value.to(torch.float32)
            node.replace_input_with(source, copy)
            changed = True
        if changed:
            graph_module.graph.lint()
            graph_module.recompile()


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def retarget_device(gm: fx.GraphModule, device: torch.device | str) -> None:
    """Point the device constants an exported graph captured (`arange(device=meta)`, `to(device=meta)`) at
    `device`, so a graph traced on the meta device runs where its stages were materialized."""
    target = torch.device(device)

    def swap(value):
        return target if isinstance(value, torch.device) and value != target else value

    for graph_module in _graph_modules(gm):
        changed = False
        for node in graph_module.graph.nodes:
            args, kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            graph_module.recompile()


def _mutated_args(node: fx.Node) -> tuple[str, ...]:
    """Input nodes an in-place ATen op writes (`relu_`, `add_`), read off its schema."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return ()
    written: list[str] = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, fx.Node):
            written.append(value.name)
    return tuple(written)
