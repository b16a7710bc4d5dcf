"""Counting what a meta-device run would cost on a GPU: per-op FLOPs/bytes with a roofline.

- `OpRecorder` (a TorchDispatchMode) sees every aten op after autograd, with its inputs and outputs. FLOPs come
  from `torch.utils.flop_counter`'s registry (matmuls, convolutions, attention -- exactly what FlopCounterMode
  counts); bytes moved are the inputs' plus the outputs' sizes (views and allocations move nothing). Each op's
  time is its roofline `max(flops / (peak × matmul_eff), bytes / (hbm_bw × mem_eff))`, summed; `split_seconds`
  also times fused input+weight gradient kernels (conv, norms) as the two kernels a split backward launches.
(What a run saves for backward is counted by `saved_tensors`.)
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
