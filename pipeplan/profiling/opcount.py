"""Counting what a meta-device run would cost on a GPU: per-op FLOPs/bytes with a roofline, and saved tensors.

- `OpRecorder` (a TorchDispatchMode) sees every aten op after autograd, with its inputs and outputs. FLOPs come
  from `torch.utils.flop_counter`'s registry (matmuls, convolutions, attention -- exactly what FlopCounterMode
  counts); bytes moved are the inputs' plus the outputs' sizes (views and allocations move nothing). Each op's
  time is its roofline `max(flops / (peak × matmul_eff), bytes / (hbm_bw × mem_eff))`, summed; `split_seconds`
  also times fused input+weight gradient kernels (conv, norms) as the two kernels a split backward launches.
- `SavedTensors` (saved_tensors_hooks) records every tensor autograd saves; `saved_split` de-duplicates storages,
  drops parameters/buffers and splits the rest into "freed once I is done" and "kept until W": a storage is kept
  until W when a weight-gradient computation reads it, i.e. it is saved by an autograd node with an edge that
  leads (through tensor-free reshapes/transposes/casts) to a parameter's AccumulateGrad -- the input of a Linear,
  a norm's input and statistics, the normalized input of an RMSNorm's weight multiply.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
_FREE_OPS = frozenset(
    (
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_like.default,
        aten._unsafe_view.default,
        aten.detach.default,
        aten.alias.default,
        aten.lift_fresh.default,
    )
)


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """Achievable matmul FLOP/s and memory bandwidth (peaks already multiplied by their efficiencies)."""

    flops_per_s: float
    bytes_per_s: float
    launch_s: float = 0.0  # calibrated per-kernel floor (Hardware.kernel_launch_s); 0: none

    def __post_init__(self) -> None:
        assert self.flops_per_s > 0 and self.bytes_per_s > 0, "roofline rates must be positive"
        assert self.launch_s >= 0, "kernel launch time must be >= 0"

    def seconds(self, flops: float, num_bytes: float) -> float:
        """One op's time: max(compute, memory traffic, kernel launch); an op that moves nothing (a view) is free."""
        if flops == 0 and num_bytes == 0:
            return 0.0
        return max(flops / self.flops_per_s, num_bytes / self.bytes_per_s, self.launch_s)


@dataclass
class OpTotals:
    """Sums over the ops one recorder saw."""

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    split_seconds: float = 0.0  # fused input+weight gradient kernels timed as two kernels (see `split_parts`)
    num_ops: int = 0


def _is_view(func: torch._ops.OpOverload) -> bool:
    arguments = func._schema.arguments
    return any(a.alias_info is not None and not a.alias_info.is_write for a in arguments)


def _tensor_bytes(values: Iterable) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def op_cost(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> tuple[float, int]:
    """(FLOPs, bytes moved) of one aten op call."""
    if func in _FREE_OPS or _is_view(func):
        return 0.0, 0
    flops = 0.0
    counter = flop_registry.get(func.overloadpacket)
    if counter is not None:
        flops = float(counter(*args, **kwargs, out_val=out))
    moved = _tensor_bytes(tree_flatten((args, kwargs))[0]) + _tensor_bytes(tree_flatten(out)[0])
    return flops, moved


def split_parts(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> list[tuple[float, int]]:
    """(FLOPs, bytes) of an op as a split backward runs it.

    Backward kernels with an `output_mask` (convolution, layer/batch/group norm) compute the input gradient
    (output 0) and the weight/bias gradients (the rest) in one launch; a split backward runs the two parts as
    separate kernels, each reading the inputs again. Every other op is one part.
    """
    names = [a.name for a in func._schema.arguments]
    if "output_mask" not in names or not isinstance(out, tuple | list):
        return [op_cost(func, args, kwargs, out)]
    position = names.index("output_mask")
    in_kwargs = "output_mask" in kwargs
    mask = list(kwargs["output_mask"] if in_kwargs else args[position])
    if not mask[0] or not any(mask[1:]):
        return [op_cost(func, args, kwargs, out)]
    parts = []
    for keep in ([True] + [False] * (len(mask) - 1), [False] + mask[1:]):
        part_mask = [m and k for m, k in zip(mask, keep)]
        part_out = tuple(o if k else None for o, k in zip(out, part_mask))
        if in_kwargs:
            part_args, part_kwargs = args, {**kwargs, "output_mask": part_mask}
        else:
            part_args, part_kwargs = (*args[:position], part_mask, *args[position + 1 :]), kwargs
        parts.append(op_cost(func, part_args, part_kwargs, part_out))
    return parts


class OpRecorder(TorchDispatchMode):
    """Dispatch mode summing each op's FLOPs, bytes and roofline time into `totals`."""

    def __init__(self, roofline: Roofline) -> None:
        super().__init__()
        self.roofline = roofline
        self.totals = OpTotals()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, moved = op_cost(func, args, kwargs, out)
        self.totals.flops += flops
        self.totals.bytes += moved
        self.totals.seconds += self.roofline.seconds(flops, moved)
        parts = split_parts(func, args, kwargs, out) if func not in _FREE_OPS else []
        self.totals.split_seconds += sum(self.roofline.seconds(f, b) for f, b in parts)
        self.totals.num_ops += 1
        return out


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (works on meta tensors, which have no data pointer)."""
    return tensor.untyped_storage()._cdata


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Records every tensor autograd saves in the block it wraps (the tensors stay referenced by `tensors`)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> SavedTensors:
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> int:
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def _unpack(self, index: int) -> torch.Tensor:
        return self.tensors[index]


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _node_saved_tensors(node) -> list[torch.Tensor]:
    kind = type(node)
    if kind not in _SAVED_ATTRS:
        _SAVED_ATTRS[kind] = tuple(name for name in dir(node) if name.startswith("_saved_"))
    found: list[torch.Tensor] = []
    for name in _SAVED_ATTRS[kind]:
        try:
            value = getattr(node, name)
        except RuntimeError:  # already freed or not applicable
            continue
        values = value if isinstance(value, tuple | list) else (value,)
        found.extend(v for v in values if isinstance(v, torch.Tensor))
    if hasattr(node, "saved_tensors"):  # custom autograd.Function
        found.extend(node.saved_tensors)
    return found


def _reaches_parameter(node, param_ids: set[int]) -> bool:
    """Whether `node` leads, through single-input nodes that save no tensors, to a parameter's AccumulateGrad."""
    while node is not None:
        variable = getattr(node, "variable", None)
        if variable is not None:
            return id(variable) in param_ids
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        if len(nexts) != 1 or _node_saved_tensors(node):
            return False
        node = nexts[0]
    return False


def _autograd_nodes(roots: Iterable[torch.Tensor]) -> list:
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    nodes = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return nodes


@dataclass(frozen=True, kw_only=True)
class SavedSplit:
    total_bytes: int  # de-duplicated storages saved for backward, parameters and buffers excluded
    kept_until_weight_grad_bytes: int  # storages a weight-gradient computation reads


def saved_split(saved: SavedTensors, outputs: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor]) -> SavedSplit:
    """Split what `saved` recorded into freed-by-I and kept-until-W bytes; call before running backward."""
    excluded = {storage_key(t) for t in exclude}
    storages: dict[int, int] = {}
    for tensor in saved.tensors:
        key = storage_key(tensor)
        if key not in excluded:
            storages[key] = tensor.untyped_storage().nbytes()
    param_ids = {id(t) for t in exclude}
    kept: set[int] = set()
    for node in _autograd_nodes(outputs):
        if not any(_reaches_parameter(fn, param_ids) for fn, _ in node.next_functions if fn is not None):
            continue
        kept.update(storage_key(t) for t in _node_saved_tensors(node))
    kept_bytes = sum(size for key, size in storages.items() if key in kept)
    return SavedSplit(total_bytes=sum(storages.values()), kept_until_weight_grad_bytes=kept_bytes)
