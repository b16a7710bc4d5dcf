"""Repeated layers, counted once: a transformer's blocks are the same code on parameters and inputs of the same
shapes, so their analytic counts (times, bytes, FLOPs, kernels) are equal, and the analytic profiler counts one
block of each kind and gives the others its counts. A 70B model's 80 blocks then cost one block's counting.

`layer_key` is what decides it: the layer's graph with every name made relative (nodes numbered in order, each
parameter or buffer named below the layer's own module path, a module path elsewhere kept as is: a tied weight),
each op's target and constant arguments, the shapes and dtypes of its parameters, buffers and inputs, and which
inputs need gradients. Two layers with equal keys run the same ops on equal shapes: on the meta device, where no
value is read, their counts are equal. A module run eagerly inside the layer (an fx leaf) joins the key with its
class, its parameters' shapes and its plain attributes (numbers, strings, flags); a layer holding an eager module
with any other attribute (an object whose effect cannot be compared) gets no key and is counted itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

_PLAIN = (int, float, str, bool, type(None))


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) :] if prefix and name.startswith(prefix) else f"@{name}"


def _tensor_sig(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), bool(value.requires_grad))
    return ("value", repr(value))


def _module_sig(module: nn.Module) -> tuple | None:
    attributes = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or isinstance(value, nn.Module | torch.Tensor):
            continue
        if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
            attributes.append((key, value))
        else:
            return None
    tensors = [(name, *_tensor_sig(t)) for name, t in (*module.named_parameters(), *module.named_buffers())]
    children = [_module_sig(child) for child in module.children()]
    if any(child is None for child in children):
        return None
    return (type(module).__qualname__, tuple(attributes), tuple(tensors), tuple(children))


def _argument(value, numbers: dict[fx.Node, int]):
    if isinstance(value, fx.Node):
        return ("node", numbers[value])
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_argument(v, numbers) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _argument(v, numbers)) for k, v in value.items()))
    return ("const", repr(value))


def layer_key(stage: fx.GraphModule, prefix: str, inputs: Sequence, needs: Sequence[bool]) -> tuple | None:
    """The layer's key (module docstring), or None when it cannot be compared; `prefix`: its module path."""
    prefix = f"{prefix}." if prefix else ""
    numbers: dict[fx.Node, int] = {}
    ops = []
    for index, node in enumerate(stage.graph.nodes):
        numbers[node] = index
        target = node.target
        detail: tuple[Any, ...]
        if node.op == "get_attr":
            detail = (_relative(str(target), prefix), _tensor_sig(_attribute(stage, str(target))))
        elif node.op == "call_module":
            signature = _module_sig(stage.get_submodule(str(target)))
            if signature is None:
                return None
            detail = (_relative(str(target), prefix), signature)
        elif node.op == "placeholder":
            detail = ()
        elif isinstance(target, str):  # call_method
            detail = (target,)
        else:
            detail = (f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', str(target))}",)
        args = (_argument(node.args, numbers), _argument(node.kwargs, numbers))
        ops.append((node.op, detail, args))
    values = tuple((_tensor_sig(value), bool(need)) for value, need in zip(inputs, needs, strict=True))
    return tuple(ops), values


def _attribute(module: nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)
