"""Activation recomputation data per layer: what a layer keeps for backward under each mode, and what recomputing
costs. The measured profiler (`measured_attention_core`) and the analytic one (`analytic_recompute`) both call this.

Modes (the LayerProfile fields, see profiling.profile):
- none: everything autograd saves (`activation_bytes`, counted by the profilers themselves);
- selective: the same less the *attention internals*, which the backward recomputes from the attention core's
  inputs (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, §5: the QKᵀ,
  softmax, softmax-dropout and attention-over-V part, whose s×s tensors are the 5·a·s²·b term). The recompute time
  is that core's forward again (the ops of the core, below);
- full: only the layer's inputs (distinct storages of its tensor inputs, integer inputs included: recomputing
  needs them) -- what torch.utils.checkpoint or Megatron's full recomputation keeps; the recompute time is the
  layer's forward again.

The attention internals, found in the aten ops (after autograd, with their inputs and outputs) of one recorded
forward of the layer: every softmax (`_softmax`, `_safe_softmax`, `_masked_softmax`) is a candidate *anchor*. Its
*region* is the set of storages reached from the softmax's output and input through ops that are not matrix
products, in both directions, keeping only tensors whose last two dimensions equal the softmax output's
(s_q, s_k): the scaled and masked scores, the mask itself when the layer builds it, the probabilities, the dropout
mask or noise and the dropped probabilities. A matrix product stops the walk: its output joins the region when it
is the scores, its inputs never do (q, k, v stay: they are the core's inputs, part of the 34·s·b·h). The anchor is
attention only when a *batched* product (bmm, baddbmm) made its scores (QKᵀ): a softmax over a Linear's output (a
mixture-of-experts router) is not. The internals are the saved storages in attention regions, the layer's inputs
and parameters excepted; the core's ops are the region's ops plus the products making and consuming it (QKᵀ, the
product with V). A fused kernel (FlashAttention, memory-efficient or CPU flash SDPA) saves no s×s tensor and has
no softmax op: selective then keeps what none keeps and recomputes nothing, as a fused kernel already recomputes
its internals in its own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeplan.graph.saved_tensors import SavedTensors
from pipeplan.profiling.kernel_tracer import is_kernel_op
from pipeplan.profiling.opcount import Roofline, op_call, op_cost
from pipeplan.profiling.stack_traffic import OpTraffic, Traffic, traffic

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The aten op packets of `names` that this torch build has."""
    return frozenset(getattr(aten, name) for name in names if hasattr(aten, name))


SOFTMAX_OPS = _packets("_softmax", "_safe_softmax", "_masked_softmax")
BATCHED_PRODUCTS = _packets("bmm", "baddbmm")
PRODUCTS = BATCHED_PRODUCTS | _packets(
    "mm",
    "addmm",
    "addbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _storage(tensor: torch.Tensor) -> int | None:
    """Identity of a tensor's storage (meta tensors included); None for tensors without one."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


@dataclass
class OpCall:
    """One aten op of a recorded forward: the op, how it was called, and its tensor inputs and outputs."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    out: object
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def packet(self):
        return self.func.overloadpacket


class ForwardLog(TorchDispatchMode):
    """Records every aten op of the forward it wraps and every tensor autograd saves. It keeps references to all of
    them, so storage identities stay unique while the log lives (and memory is held: one layer at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OpCall] = []
        self._hooks = SavedTensors()

    @property
    def saved(self) -> list[torch.Tensor]:
        return self._hooks.tensors

    def __enter__(self) -> ForwardLog:
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append(OpCall(func, args, kwargs, out, _tensors((args, kwargs)), _tensors(out)))
        return out


@dataclass(frozen=True)
class AttentionCore:
    """The attention internals of one recorded forward (see the module docstring)."""

    saved_bytes: int  # distinct saved storages in attention regions (layer inputs and parameters excepted)
    calls: tuple[OpCall, ...]  # the core's ops, in forward order: what selective recomputation re-runs


def _trailing(tensor: torch.Tensor) -> tuple[int, ...] | None:
    return tuple(tensor.shape[-2:]) if tensor.dim() >= 2 else None


@dataclass(frozen=True)
class _Touch:
    """What one call reads and writes: storages, and (storage, last two dims) of each tensor."""

    is_product: bool
    batched: bool
    inputs: frozenset
    outputs: frozenset
    shaped: tuple[tuple[int | None, tuple[int, ...] | None], ...]

    @classmethod
    def of(cls, call: OpCall) -> _Touch:
        return cls(
            is_product=call.packet in PRODUCTS,
            batched=call.packet in BATCHED_PRODUCTS,
            inputs=frozenset(_storage(t) for t in call.inputs) - {None},
            outputs=frozenset(_storage(t) for t in call.outputs) - {None},
            shaped=tuple((_storage(t), _trailing(t)) for t in call.inputs + call.outputs),
        )


def _region(touches: list[_Touch], anchor: OpCall) -> tuple[set[int], set[int]] | None:
    """(storages, indices of the core's calls) of one softmax's attention region; None if it is not attention."""
    shape = _trailing(anchor.outputs[0])
    region = {key for t in anchor.outputs + anchor.inputs if _trailing(t) == shape and (key := _storage(t)) is not None}
    core: set[int] = set()
    scores = False
    changed = True
    while changed:
        changed = False
        for index, touch in enumerate(touches):
            if index in core or not (touch.inputs | touch.outputs) & region:
                continue
            core.add(index)
            if touch.is_product:  # the walk stops here; QKᵀ (batched, making the scores) marks attention
                scores = scores or (touch.batched and bool(touch.outputs & region))
                continue
            region |= {key for key, dims in touch.shaped if dims == shape and key is not None}
            changed = True
    return (region, core) if scores else None


def find_attention_core(log: ForwardLog, keep: Sequence[torch.Tensor] = ()) -> AttentionCore:
    """The attention internals of `log`'s forward; storages of `keep` (the layer's inputs and parameters) are never
    internals."""
    touches = [_Touch.of(call) for call in log.calls]
    region: set[int] = set()
    core: set[int] = set()
    for call in log.calls:
        if call.packet in SOFTMAX_OPS and call.outputs:
            found = _region(touches, call)
            if found is not None:
                region |= found[0]
                core |= found[1]
    region -= {_storage(t) for t in keep}
    saved = {_storage(t): t.untyped_storage().nbytes() for t in log.saved if _storage(t) in region}
    return AttentionCore(saved_bytes=sum(saved.values()), calls=tuple(log.calls[i] for i in sorted(core)))


def input_bytes(values: Sequence[object]) -> int:
    """Bytes full recomputation keeps: the distinct storages of the tensor inputs."""
    storages = {_storage(v): v.untyped_storage().nbytes() for v in values if isinstance(v, torch.Tensor)}
    storages.pop(None, None)
    return sum(storages.values())


@dataclass(frozen=True, kw_only=True)
class RecomputeCosts:
    """One layer's recompute data; `layer_fields` turns it into LayerProfile keyword arguments."""

    attention_bytes: int  # saved bytes selective recomputation drops
    input_bytes: int  # bytes full recomputation keeps
    full_recompute_ms: float  # the layer's forward again
    selective_recompute_ms: float  # the attention core's forward again
    attention_flops: float = 0.0  # FLOPs of the attention core's ops (analytic only; 0 when measured)

    def layer_fields(self, activation_bytes: int) -> dict[str, int | float]:
        assert 0 <= self.attention_bytes <= activation_bytes, "attention internals exceed the saved bytes"
        return dict(
            selective_activation_bytes=activation_bytes - self.attention_bytes,
            full_activation_bytes=self.input_bytes,
            full_recompute_ms=self.full_recompute_ms,
            selective_recompute_ms=self.selective_recompute_ms,
        )


@dataclass(frozen=True, kw_only=True)
class AnalyticRecompute:
    """What the analytic profiler finds of one layer's recomputation: the bytes each mode keeps, and the roofline
    time of the attention core's ops that are not kernels."""

    attention_bytes: int
    input_bytes: int
    selective_rest_seconds: float
    selective_calls: tuple[OpTraffic, ...] = ()  # the attention core's ops (`profiling.stack_traffic`)
    keep_storages: frozenset[int] = frozenset()  # what the core must write: saved for backward, its outputs

    def selective_traffic(self, stack: str) -> Traffic:
        """The attention core's other ops under `stack` (what selective recomputation re-runs besides kernels)."""
        return traffic(self.selective_calls, stack, self.keep_storages)

    def byte_fields(self, activation_bytes: int) -> dict[str, int]:
        assert 0 <= self.attention_bytes <= activation_bytes, "attention internals exceed the saved bytes"
        return dict(
            selective_activation_bytes=activation_bytes - self.attention_bytes, full_activation_bytes=self.input_bytes
        )


def record_forward(module: Callable, inputs: Sequence, context: Callable | None = None) -> tuple[ForwardLog, object]:
    """Run `module(*inputs)` once (inside `context()`, e.g. an autocast) under a ForwardLog."""
    with (context or contextlib.nullcontext)(), ForwardLog() as log:
        outputs = module(*inputs)
    return log, outputs


def _params(module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers()) if hasattr(module, "parameters") else []


def replay(calls: Sequence[OpCall]) -> None:
    """Re-run recorded ops on their recorded arguments (kernels only: no autograd graph is built): what selective
    recomputation re-runs of an attention core."""
    with torch.no_grad():
        for call in calls:
            call.func(*call.args, **call.kwargs)


def measured_attention_core(stage, inputs: Sequence, *, autocast: Callable) -> AttentionCore:
    """The attention core of one layer on a real device, from one recorded forward (under the precision's
    autocast). The measured profiler times the recomputation in its rounds (`profiling.timed_units`): full = the
    forward re-run (with autograd, as checkpointing re-runs it), selective = the core's ops replayed (`replay`)."""
    log, outputs = record_forward(stage, inputs, autocast)
    core = find_attention_core(log, keep=[*inputs, *_params(stage)])
    del outputs
    return core


def analytic_recompute(
    module,
    inputs: Sequence,
    *,
    roofline: Roofline,
    input_needs_grad: Sequence[bool],
    context: Callable | None = None,
) -> AnalyticRecompute:
    """Recompute data of one layer on the meta device: the attention core's saved bytes and the roofline time of its
    ops other than kernels (its matmuls and attention calls are the layer's kernels marked `core`, timed by
    `retime_layer`; full recompute is the forward again). Floating-point inputs become leaves that require a
    gradient where `input_needs_grad` says; `context()` wraps the forward as the analytic profiler's does (its GPU
    semantics: flash or math attention, 1-byte dropout masks)."""
    inputs = [
        value.detach().requires_grad_(need and value.is_floating_point()) if isinstance(value, torch.Tensor) else value
        for value, need in zip(inputs, input_needs_grad, strict=True)
    ]
    log, outputs = record_forward(module, inputs, context)
    core = find_attention_core(log, keep=[*inputs, *_params(module)])
    del outputs
    rest = [op_cost(call.func, call.args, call.kwargs, call.out) for call in core.calls if not is_kernel_op(call.func)]
    calls = []
    for call in core.calls:
        flops, moved = op_cost(call.func, call.args, call.kwargs, call.out)
        if flops or moved:
            bound = roofline.seconds(flops, moved) if flops and not is_kernel_op(call.func) else 0.0
            calls.append(op_call(call.func, call.args, call.kwargs, call.out, bound))
    return AnalyticRecompute(
        attention_bytes=core.saved_bytes,
        input_bytes=input_bytes(inputs),
        selective_rest_seconds=sum(roofline.seconds(flops, moved) for flops, moved in rest),
        selective_calls=tuple(calls),
        keep_storages=frozenset(s for t in log.saved if (s := _storage(t)) is not None),
    )
