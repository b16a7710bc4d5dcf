"""Make a meta-device run save and compute what a CUDA run would, for the ops where they differ.

On CPU and meta tensors PyTorch takes fallback paths a GPU run does not take:

- `F.dropout` multiplies by a bernoulli noise tensor in the input's dtype and saves it (2 bytes per element in
  bf16); CUDA runs the fused `native_dropout` kernel and saves a 1-byte bool mask (the accounting behind
  Megatron's 34·s·b·h). `GpuSemantics` routes dropout to `aten.native_dropout`, which saves the bool mask.
- `F.scaled_dot_product_attention` (and `aten.scaled_dot_product_attention`, what an exported graph calls) takes
  the math path. `GpuSemantics(attention=...)` runs each call as the kernel PyTorch dispatches it to on a GPU:
  * `auto` / `flash` / `flash2` (flash2: the same kernel, counted as `flash2`, which the analytic profile times at the
    hardware's FlashAttention-2 rate): without a mask, FlashAttention-2 (`aten._scaled_dot_product_flash_attention`,
    which has meta kernels and FLOP formulas): saves q, k, v, the output (laid out (b, s, heads, d) as the CUDA kernel
    returns it, so `out.transpose(1, 2)` is free) and the float32 logsumexp, no s² tensors; grouped-query attention
    (`enable_gqa`) runs natively: only the key/value heads are saved. With a mask (FlashAttention takes none), the
    memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`): no s² tensor of its own either, but the
    whole score matrix is computed (the mask is not exploited) and the mask, turned into an additive bias in q's dtype
    when it is boolean (as SDPA does before dispatching), is saved with q, k, v and the output; so is a call whose
    values have a head size other than the queries' (MLA: 192 / 128), which FlashAttention-2 does not take (causal,
    without a mask: half the scores);
  * `math`: the Megatron-style math path: the scores matmul, softmax (saves its output, 2·a·s²·b bytes), dropout
    (1-byte mask, a·s²·b) and the matmul with v (saves the dropped probabilities, 2·a·s²·b) -- the 5·a·s²·b term
    of Korthikanti et al. (2022).
  Inputs that are not 4-D run the math path whatever the mode. `kernels_used` counts the calls by kernel.
  Attention a model writes by hand (softmax(QKᵀ)V) is not an SDPA call: it runs as written, the math path.
- `F.rms_norm` decomposes into elementwise ops that save their intermediates; CUDA engines run a fused kernel
  (Apex, Transformer Engine) that saves the input and the fp32 reciprocal RMS: `_FusedRMSNorm` does that.
- `silu(gate) * up` (a SwiGLU MLP) saves gate, silu's output and up; fused SwiGLU kernels save gate and up only
  and recompute silu in the backward: `_FusedGLU`; GeGLU (`gelu(gate) * up`, Gemma's MLP) likewise (Transformer
  Engine's geglu, Megatron's bias_geglu).
- MoE routing written for eager PyTorch (weighting in the experts' dtype, a float32 router): `gpu_routing`.
- Under an FP8 recipe (`fp8_linears`), each linear with a parameter weight is recorded (`fp8_saved.Fp8Linears`):
  Transformer Engine saves its input's FP8 copy, not the 16-bit input (`fp8_saved.fp8_saved_split`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeplan.profiling.fp8_saved import Fp8Linears
from pipeplan.profiling.gpu_routing import LINEARS, UPCASTS, upcast_linear, upcast_source, weighted_experts
from pipeplan.profiling.kernel_tracer import is_grouped_mm
from pipeplan.profiling.profile_options import ATTENTION_MODES

aten = torch.ops.aten
KERNEL_NAMES = ("flash", "flash2", "memory-efficient", "math")  # GpuSemantics.kernels_used keys


def gpu_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout as CUDA runs it: `native_dropout`, which saves a bool mask for backward."""
    if not training or p == 0.0:
        return x
    return aten.native_dropout(x, p, True)[0]


def _expand_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads (grouped-query attention); unchanged when they match."""
    groups = heads // tensor.shape[-3]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


class _FlashAttention(torch.autograd.Function):
    """FlashAttention-2 forward/backward via the aten flash ops (meta kernels exist for both). Grouped-query
    attention runs natively as FlashAttention-2 does it: the kernel reads each key/value head for its group of
    query heads, so only the key/value heads are saved (the expansion here only feeds the aten op its shapes)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool, scale):
        heads = q.shape[-3]
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, _expand_heads(k, heads), _expand_heads(v, heads), dropout_p, is_causal, False, scale=scale
        )
        # the CUDA kernel writes (b, s, heads, d) and returns it transposed to (b, heads, s, d)
        batch, heads, seq, head_dim = out.shape
        out = out.new_empty((batch, seq, heads, head_dim)).transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.flash_args = (cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale = ctx.flash_args
        heads, kv_heads = q.shape[-3], k.shape[-3]
        grad_q, grad_k, grad_v = aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            q,
            _expand_heads(k, heads),
            _expand_heads(v, heads),
            out,
            lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            seed,
            offset,
            scale=scale,
        )
        if kv_heads != heads:  # each key/value head's gradient sums over its group of query heads
            grad_k, grad_v = (g.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3) for g in (grad_k, grad_v))
        return grad_q, grad_k, grad_v, None, None, None


class _EfficientAttention(torch.autograd.Function):
    """The memory-efficient SDPA kernel (the aten ops have meta kernels), with an additive bias or causal: saves q, k,
    v, the bias, the output and the float32 logsumexp; every score is computed where a bias is given (it is not
    exploited), half of them when causal."""

    @staticmethod
    def forward(ctx: Any, q, k, v, bias: torch.Tensor | None, dropout_p, scale, causal: bool):
        expanded = bias.expand(*q.shape[:-1], k.shape[-2]) if bias is not None else None
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, expanded, True, dropout_p, causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)
        ctx.args = (dropout_p, scale, causal)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
        dropout_p, scale, causal = ctx.args
        expanded = bias.expand(*q.shape[:-1], k.shape[-2]) if bias is not None else None
        grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out,
            q,
            k,
            v,
            expanded,
            out,
            lse,
            seed,
            offset,
            dropout_p,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return grad_q, grad_k, grad_v, None, None, None, None


def _additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA turns it into an additive bias (0 where kept, -inf elsewhere) in q's dtype; a float
    mask as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as the fused kernels of production engines run it (Apex / Transformer Engine): saves the input and
    the fp32 reciprocal root mean square only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int, eps: float, offset: float = 0.0):
        """`offset`: the kernel scales by weight + offset (Gemma's 1 + weight), computed inside it."""
        reduce = tuple(range(-dims, 0))
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32, as the kernels accumulate
        rstd = torch.rsqrt(wide.pow(2).mean(reduce, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.dims, ctx.offset = reduce, offset
        normed = (wide * rstd).to(x.dtype)
        return normed * (weight + offset if offset else weight) if weight is not None else normed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        scale = weight + ctx.offset if weight is not None and ctx.offset else weight
        grad_normed = (grad * scale if scale is not None else grad).to(rstd.dtype)
        mean = (grad_normed * normed).mean(ctx.dims, keepdim=True)
        grad_x = ((grad_normed - normed * mean) * rstd).to(x.dtype)
        if weight is None:
            return grad_x, None, None, None, None
        sum_dims = tuple(range(grad.dim() - weight.dim()))
        grad_w = (grad.to(rstd.dtype) * normed).sum(sum_dims).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, *, offset: float) -> torch.Tensor:
    """RMSNorm as one fused kernel (`_FusedRMSNorm`) scaled by weight + offset (Gemma's 1 + weight), in the dtype of
    x and the weight together: what a hand-written RMSNorm is counted as (profiling.fusions)."""
    return _FusedRMSNorm.apply(x, weight, 1, 1e-6, offset)


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v with a GPU-style (1-byte mask) dropout on the probabilities."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(gpu_dropout(probs, dropout_p, True), v)


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults: dict[str, Any] = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    bound = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
    return bound


_MULTIPLY = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, aten.mul.Tensor)


class _FusedGLU(torch.autograd.Function):
    """act(gate) * up as fused SwiGLU / GeGLU kernels run it (Megatron's bias_swiglu and bias_geglu, Transformer
    Engine): saves gate and up and recomputes the activation in the backward (no saved activation output)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return activation(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.activation is F.silu:
            sig = torch.sigmoid(gate)
            silu = gate * sig
            return grad * up * (sig + silu * (1 - sig)), grad * silu, None
        with torch.enable_grad():  # GELU: its own backward kernel on the recomputed activation
            leaf = gate.detach().requires_grad_()
            act = ctx.activation(leaf)
            (slope,) = torch.autograd.grad(act, leaf, grad * up)
        return slope, grad * act.detach(), None


_SDPA = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
_RMS_NORM = (F.rms_norm, aten.rms_norm.default)
_GROUPED_MM = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None)
_GLU_ACTIVATIONS = (F.silu, aten.silu.default, F.gelu, aten.gelu.default)  # act(gate) * up: a fused GLU kernel


class GpuSemantics(TorchFunctionMode):
    """Torch-function mode that swaps dropout, attention, RMSNorm and SwiGLU for their CUDA equivalents (module
    docstring), seeing both the torch functions an fx graph calls and the ATen ops an exported graph calls.
    `attention`: one of ATTENTION_MODES; `kernels_used` counts the SDPA calls by the kernel they ran as;
    `fp8_linears`: where the linears an FP8 recipe runs are recorded (None: not an FP8 run)."""

    def __init__(self, *, attention: str = "auto", fp8_linears: Fp8Linears | None = None) -> None:
        super().__init__()
        assert attention in ATTENTION_MODES, attention
        self.attention = attention
        self.fp8_linears = fp8_linears
        self.kernels_used: Counter[str] = Counter()
        self._gates: dict[int, tuple] = {}  # id(activation output) -> (output, gate, the activation)
        self._expert_outputs: dict[int, torch.Tensor] = {}  # id -> a grouped expert matmul's output
        self._upcasts: dict[int, tuple] = {}  # id(float32 copy) -> (the copy, its 16-bit source)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            bound = {**dict(p=0.5, training=True), **dict(zip(("input", "p", "training"), args, strict=False))}
            bound.update({k: v for k, v in kwargs.items() if k != "inplace"})
            return gpu_dropout(bound["input"], bound["p"], bound["training"])
        if func is torch.dropout or func is aten.dropout.default:
            return gpu_dropout(*args, **kwargs)
        if func in _SDPA:
            return self._attention(_sdpa_arguments(args, kwargs))
        if func in _RMS_NORM:
            return self._rms_norm(args, kwargs)
        if func in _GLU_ACTIVATIONS and not kwargs.get("inplace", False) and len(args) <= 2:
            out = func(*args, **kwargs)
            self._gates[id(out)] = (out, args[0], _activation(func, args, kwargs))
            return out
        if func in _MULTIPLY and len(args) == 2 and not kwargs:
            fused = self._swiglu(*args)
            if fused is None:
                fused = weighted_experts(func, *args, self._expert_outputs)
            if fused is not None:
                return fused
        if func in _GROUPED_MM or is_grouped_mm(func):
            out = func(*args, **kwargs)
            self._expert_outputs[id(out)] = out
            return out
        if func in UPCASTS and args:
            out = func(*args, **kwargs)
            source = upcast_source(args[0], out)
            if source is not None:
                self._upcasts[id(out)] = (out, source)
            return out
        if func in LINEARS and len(args) == 2 and not kwargs:
            upcast = self._upcast_linear(*args)
            if upcast is not None:
                return upcast
        if func in LINEARS and self.fp8_linears is not None:
            return self._fp8_linear(func, args, kwargs)
        return func(*args, **kwargs)

    def _fp8_linear(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """A linear run as it is, recorded when its weight is a parameter (a leaf that wants a gradient)."""
        assert self.fp8_linears is not None
        out = func(*args, **kwargs)
        bound = {**dict(zip(("input", "weight"), args, strict=False)), **kwargs}
        x, weight = bound.get("input"), bound.get("weight")
        parameter = isinstance(weight, torch.Tensor) and weight.requires_grad and weight.grad_fn is None
        if parameter and isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
            self.fp8_linears.record(x, out)
        return out

    def _upcast_linear(self, x, weight) -> torch.Tensor | None:
        """A linear of a float32 copy of a 16-bit activation as a float32 router runs it (`gpu_routing`)."""
        found = self._upcasts.get(id(x)) if isinstance(x, torch.Tensor) else None
        if found is None or found[0] is not x:
            return None
        cast = self._upcasts.get(id(weight)) if isinstance(weight, torch.Tensor) else None
        source = cast[1] if cast is not None and cast[0] is weight else weight
        return upcast_linear(found[1], x, source, weight)

    def _swiglu(self, a, b) -> torch.Tensor | None:
        """act(gate) * up (either order) as one fused kernel (`_FusedGLU`)."""
        for first, other in ((a, b), (b, a)):
            found = self._gates.get(id(first)) if isinstance(first, torch.Tensor) else None
            if found is not None and found[0] is first and isinstance(other, torch.Tensor):
                return _FusedGLU.apply(found[1], other, found[2])
        return None

    def _rms_norm(self, args: tuple, kwargs: dict) -> torch.Tensor:
        names = ("input", "normalized_shape", "weight", "eps")
        bound = {**dict(weight=None, eps=None), **dict(zip(names, args, strict=False)), **kwargs}
        x = bound["input"]
        eps = bound["eps"] if bound["eps"] is not None else torch.finfo(x.dtype).eps
        return _FusedRMSNorm.apply(x, bound["weight"], len(tuple(bound["normalized_shape"])), eps)

    def _attention(self, bound: dict[str, Any]) -> torch.Tensor:
        q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
        grouped = bound["enable_gqa"] and k.shape[-3] != q.shape[-3]
        shape = dict(
            four_d=q.dim() == 4, masked=mask is not None, grouped=grouped, same_dims=q.shape[-1] == v.shape[-1]
        )
        kernel = _sdpa_kernel(self.attention, **shape)
        self.kernels_used["flash2" if kernel == "flash" and self.attention == "flash2" else kernel] += 1
        dropout, scale = bound["dropout_p"], bound["scale"]
        if kernel == "flash":
            return _FlashAttention.apply(q, k, v, dropout, bound["is_causal"], scale)
        if bound["enable_gqa"]:
            k, v = _expand_heads(k, q.shape[-3]), _expand_heads(v, q.shape[-3])
        if kernel == "memory-efficient":
            bias = _additive_bias(mask, q.dtype) if mask is not None else None
            return _EfficientAttention.apply(q, k, v, bias, dropout, scale, bias is None and bound["is_causal"])
        return math_attention(q, k, v, mask, dropout, bound["is_causal"], scale)


def _activation(func, args: tuple, kwargs: dict):
    """The GLU activation `func(gate, ...)` computes, as a one-argument function (GELU keeps its approximation)."""
    if func in (F.gelu, aten.gelu.default):
        approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
        return lambda gate: F.gelu(gate, approximate=approximate)
    return F.silu


def _sdpa_kernel(mode: str, *, four_d: bool, masked: bool, grouped: bool, same_dims: bool = True) -> str:
    """The kernel an SDPA call runs as under `mode` (one of KERNEL_NAMES): FlashAttention takes no mask and one head
    size for q, k and v; the memory-efficient kernel takes a mask and a value head size of its own (MLA's 192 / 128)
    but no grouped key/value heads (PyTorch then takes the math path)."""
    if mode == "math" or not four_d:
        return "math"
    if not masked and same_dims:
        return "flash"
    return "math" if grouped else "memory-efficient"


def attention_summary(kernels_used: Counter[str], by_hand: bool) -> str:
    """What a profile's attention ran as, for its provenance: the kernels of its SDPA calls (KERNEL_NAMES order),
    and `math (by hand)` when the model also writes softmax(QKᵀ)V itself; `none` without attention."""
    parts = [name for name in KERNEL_NAMES if kernels_used.get(name)]
    if by_hand:
        parts.append("math (by hand)")
    return ", ".join(parts) or "none"
