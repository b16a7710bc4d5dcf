"""Counting what a meta-device run would cost on a GPU: per-op FLOPs/bytes with a roofline.

- `OpRecorder` (a TorchDispatchMode) sees every aten op after autograd, with its inputs and outputs. FLOPs come
  from `torch.utils.flop_counter`'s registry (matmuls, convolutions, attention -- exactly what FlopCounterMode
  counts); bytes moved are the inputs' plus the outputs' sizes (views and allocations move nothing).
- Matmuls and attention (`KERNEL_OPS`) are `profiling.kernels.Kernel`s, timed by shape (tile and wave
  quantization); `OpRecorder` leaves them out of `rest_seconds` and, with `trace_kernels`, records the forward's
  with the dimension a tensor-parallel rank splits (`KernelTracer`). Every other op's time is its roofline
  `max(flops / (peak × matmul_eff), bytes / (hbm_bw × mem_eff), launch)`, summed into `rest_seconds`;
  `rest_split_seconds` times fused input+weight gradient kernels (conv, norms) as the two kernels a split backward
  launches.
(What a run saves for backward is counted by `saved_tensors`.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from pipeplan.profiling.kernel_tracer import KernelTracer, grouped_mm_flops, is_grouped_mm, is_kernel_op
from pipeplan.profiling.kernels import Kernel, KernelRates
from pipeplan.profiling.stack_traffic import OpTraffic

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
    """Achievable matmul FLOP/s and memory bandwidth (peaks already multiplied by their efficiencies), and what
    kernels are timed with (`profiling.kernels`): attention's rate, the SM count (None: no quantization)."""

    flops_per_s: float
    bytes_per_s: float
    launch_s: float = 0.0  # calibrated per-kernel floor (Hardware.kernel_launch_s); 0: none
    attention_flops_per_s: float | None = None  # None: flops_per_s
    sm_count: int | None = None
    fp8_flops_per_s: float | None = None
    gemm_overhead_s: float = 0.0  # per matmul / attention kernel (profiling.kernels)
    epilogue_exposed: float = 0.0
    grad_bytes: int = 0
    tile_reuse_half: float = 0.0
    stream_k: bool = False

    def __post_init__(self) -> None:
        assert self.flops_per_s > 0 and self.bytes_per_s > 0, "roofline rates must be positive"
        assert self.launch_s >= 0, "kernel launch time must be >= 0"

    @property
    def kernel_rates(self) -> KernelRates:
        return KernelRates(
            gemm_flops_per_s=self.flops_per_s,
            attention_flops_per_s=self.attention_flops_per_s or self.flops_per_s,
            bytes_per_s=self.bytes_per_s,
            sm_count=self.sm_count,
            launch_s=self.launch_s,
            fp8_flops_per_s=self.fp8_flops_per_s,
            gemm_overhead_s=self.gemm_overhead_s,
            epilogue_exposed=self.epilogue_exposed,
            grad_bytes=self.grad_bytes,
            tile_reuse_half=self.tile_reuse_half,
            stream_k=self.stream_k,
        )

    def seconds(self, flops: float, num_bytes: float) -> float:
        """One op's time: max(compute, memory traffic, kernel launch); an op that moves nothing (a view) is free."""
        if flops == 0 and num_bytes == 0:
            return 0.0
        return max(flops / self.flops_per_s, num_bytes / self.bytes_per_s, self.launch_s)


@dataclass
class OpTotals:
    """Sums over the ops one recorder saw: FLOPs and bytes of all; times of the ops that are not kernels."""

    flops: float = 0.0
    bytes: float = 0.0
    rest_seconds: float = 0.0
    rest_split_seconds: float = 0.0  # fused input+weight gradient kernels timed as two kernels (`split_parts`)
    kernel_flops: float = 0.0  # of the matmul and attention ops (timed as kernels, not here)
    num_ops: int = 0
    kernels: list[Kernel] = field(default_factory=list)  # the forward's, with trace_kernels
    calls: list[OpTraffic] = field(default_factory=list)  # every op that moves or computes (profiling.stack_traffic)
    pinned: list = field(default_factory=list, repr=False)  # the storages seen: their keys stay unique (tensors are
    # not held: autograd would then copy a gradient it could otherwise keep)


def _is_view(func: torch._ops.OpOverload) -> bool:
    arguments = func._schema.arguments
    return any(a.alias_info is not None and not a.alias_info.is_write for a in arguments)


def _distinct_elements(tensor: torch.Tensor) -> int:
    """Elements a kernel reads from memory: a broadcast (stride-0, `expand`ed) dimension repeats the same addresses,
    which come from cache (e.g. the token index Megatron-Core's and torchtitan's MoE combine expand over the
    hidden size for scatter_add), so it counts once."""
    if tensor.layout != torch.strided:
        return tensor.numel()
    repeated = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride == 0 and size > 1:
            repeated *= size
    return tensor.numel() // repeated


def _tensor_bytes(values: Iterable) -> int:
    return sum(_distinct_elements(v) * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _storages(values: Iterable) -> tuple[tuple[int, int], ...]:
    """(storage key, bytes) of each tensor in `values` (views share their base's key), a broadcast dimension
    counted once (`_distinct_elements`: an expanded index or rotary key is read from cache, as op_cost counts it)."""
    return tuple(
        (v.untyped_storage()._cdata, _distinct_elements(v) * v.element_size())
        for v in values
        if isinstance(v, torch.Tensor)
    )


# ops that overwrite every element of their first argument without reading it: its old values are not read (a key
# built by slice assignment, `k[..., :d].copy_(k_nope)`, writes its slices once, as a concatenation does)
_OVERWRITES = frozenset((aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default))


def op_call(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out, compute_seconds: float = 0.0) -> OpTraffic:
    """One op as `profiling.stack_traffic` sees it: a kernel (matmul, attention) or not, what it reads and writes."""
    read = args[1:] if func in _OVERWRITES and args else args
    return OpTraffic(
        kernel=is_kernel_op(func),
        reads=_storages(tree_flatten((read, kwargs))[0]),
        writes=_storages(tree_flatten(out)[0]),
        compute_seconds=compute_seconds,
        extents=tuple(
            (v.untyped_storage()._cdata, v.untyped_storage().nbytes())
            for v in tree_flatten(out)[0]
            if isinstance(v, torch.Tensor)
        ),
    )


def op_cost(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> tuple[float, int]:
    """(FLOPs, bytes moved) of one aten op call."""
    if func in _FREE_OPS or _is_view(func):
        return 0.0, 0
    flops = grouped_mm_flops(args) if is_grouped_mm(func) else 0.0
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
    """Dispatch mode summing each op's FLOPs, bytes and (for ops that are not kernels) roofline time into
    `totals`; with `trace_kernels` (a forward) the kernels, their tensor-parallel roles found by `KernelTracer`
    over `params`."""

    def __init__(self, roofline: Roofline, *, trace_kernels: bool = False, params=()) -> None:
        super().__init__()
        self.roofline = roofline
        self.totals = OpTotals()
        self.tracer = KernelTracer(params) if trace_kernels else None
        if self.tracer is not None:
            self.totals.kernels = self.tracer.kernels  # as the tracer finally splits them

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, moved = op_cost(func, args, kwargs, out)
        totals = self.totals
        totals.flops += flops
        totals.bytes += moved
        totals.num_ops += 1
        if self.tracer is not None:
            self.tracer.see(func, args, out)
        if flops or moved:
            bound = self.roofline.seconds(flops, moved) if flops and not is_kernel_op(func) else 0.0
            totals.calls.append(op_call(func, args, kwargs, out, bound))
            tensors = tree_flatten((args, kwargs, out))[0]
            totals.pinned.extend(t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor))
        if is_kernel_op(func):
            totals.kernel_flops += flops
            return out
        totals.rest_seconds += self.roofline.seconds(flops, moved)
        parts = split_parts(func, args, kwargs, out) if func not in _FREE_OPS else []
        totals.rest_split_seconds += sum(self.roofline.seconds(f, b) for f, b in parts)
        return out
