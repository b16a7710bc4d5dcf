"""The torch.fx frontend: symbolic tracing (honouring ModelSpec.leaf_modules) and shape propagation.

Shape propagation runs the traced graph on sample inputs. On the meta device a leaf module with data-dependent
code (`.item()`, `nonzero`, boolean-mask indexing) cannot run, so the shapes are then taken from one run of a
CPU build of the model instead (same graph, same node names). Every node records which of its input values it
modified in place (`meta["mutates"]`), read off the tensors' version counters, so a stage can copy such an input
before modifying it.
"""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._pytree import tree_leaves

from pipeplan.errors import TraceError
from pipeplan.graph.grouping import leaf_layer
from pipeplan.graph.moe import recognise
from pipeplan.models.spec import ModelSpec


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


def symbolic_trace(module: nn.Module, spec: ModelSpec, *, auto_leaves: bool = False) -> fx.GraphModule:
    """fx-trace `module`, with the spec's leaf modules as leaves. With `auto_leaves`, a module whose code fx cannot
    trace (data-dependent routing: `if mask.any()`, `nonzero`) becomes a leaf too when it lies inside one layer (a
    repeated block, or a top-level child: grouping.leaf_layer; an MoE layer counts as one), and the trace is tried
    again (each such class once): it then runs eagerly inside its layer, so cuts stay at block boundaries. The
    leaves' paths are kept in `gm.meta["eager_modules"]`."""
    leaf_types = tuple(spec.leaf_modules)
    while True:
        tracer = _Tracer(leaf_types)
        try:
            graph = tracer.trace(module)
        except Exception as exc:  # torch.fx raises many types for untraceable code
            failed = tracer.failed_module
            if auto_leaves and failed is not None and failed[1] not in leaf_types and _may_be_leaf(module, failed[0]):
                leaf_types += (failed[1],)
                continue
            raise _trace_error(exc, module, failed) from None
        gm = fx.GraphModule(module, graph, class_name=type(module).__name__)
        calls = [str(n.target) for n in graph.nodes if n.op == "call_module"]
        eager = [path for path in calls if leaf_types and isinstance(gm.get_submodule(path), leaf_types)]
        gm.meta["eager_modules"] = tuple(dict.fromkeys(eager))  # a module called twice is listed once
        return gm


def _may_be_leaf(module: nn.Module, path: str) -> bool:
    """Whether the module at `path` may become an automatic leaf: it lies within one layer (an MoE layer holding its
    experts counts as one unit)."""
    return bool(leaf_layer(module, path, whole=lambda m: recognise(m) is not None))


def _trace_error(exc: Exception, module: nn.Module, failed: tuple[str, type] | None) -> TraceError:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if failed is not None:
        path, cls = failed
        where = f"module {path!r} ({cls.__name__})"
        fix = f"mark it a leaf: leaf_modules=({cls.__name__},) in the factory's ModelSpec"
    else:
        where = f"the top-level forward of {type(module).__name__}"
        fix = "move the data-dependent code into a submodule and list its class in ModelSpec.leaf_modules"
    return TraceError(f"torch.fx cannot trace {where}: {reason}; {fix}")


class _ShapeProp(ShapeProp):
    """ShapeProp that also records the Python type of non-tensor values (an int size crossing a cut) and which
    input values each node modifies in place."""

    def run_node(self, n: fx.Node):
        before = {
            arg.name: [(t, t._version) for t in tree_leaves(self.env.get(arg)) if isinstance(t, torch.Tensor)]
            for arg in n.all_input_nodes
        }
        result = super().run_node(n)
        n.meta["value_type"] = type(result).__name__
        n.meta["mutates"] = tuple(name for name, seen in before.items() if any(t._version != v for t, v in seen))
        return result


def _propagate(gm: fx.GraphModule, inputs: tuple) -> None:
    # ShapeProp prints the traceback of a failing node itself; the caller reports failures in one line
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        _ShapeProp(gm).propagate(*inputs)


def propagate_shapes(gm: fx.GraphModule, spec: ModelSpec, inputs: tuple, device: str, cpu_inputs) -> None:
    """Record tensor_meta on every node of `gm` for `inputs` (on `device`; `cpu_inputs()` makes the same sample
    batch on the CPU); see the module docstring."""
    try:
        _propagate(gm, inputs)
        return
    except Exception as exc:
        first = exc
    if device == "meta":  # data-dependent code cannot run on meta: run a CPU build of the model once instead
        try:
            with torch.device("cpu"):
                module = spec.build()
            cpu_graph = copy.deepcopy(gm.graph)
            _propagate(fx.GraphModule(module, cpu_graph), cpu_inputs())
        except Exception:  # the CPU run fails too: report the original error
            pass
        else:
            by_name = {node.name: node for node in cpu_graph.nodes}
            for node in gm.graph.nodes:
                found = by_name[node.name].meta
                node.meta.update({k: found[k] for k in ("tensor_meta", "value_type", "mutates") if k in found})
            return
    reason = f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}"
    raise TraceError(
        f"running the traced {spec.name!r} on sample inputs failed: {reason} (check the factory's sample_batch)"
    ) from None
