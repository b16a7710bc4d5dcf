"""Make a meta-device run save and compute what a CUDA run would, for the two ops where they differ.

On CPU and meta tensors PyTorch takes fallback paths a GPU run does not take:

- `F.dropout` multiplies by a bernoulli noise tensor in the input's dtype and saves it (2 bytes per element in
  bf16); CUDA runs the fused `native_dropout` kernel and saves a 1-byte bool mask (the accounting behind
  Megatron's 34·s·b·h). `GpuSemantics` routes dropout to `aten.native_dropout`, which saves the bool mask.
- `F.scaled_dot_product_attention` takes the math path. With `flash_attention=True` it is replaced by
  FlashAttention-2 (`aten._scaled_dot_product_flash_attention`, which has meta kernels and FLOP formulas): saves
  q, k, v, the output (laid out (b, s, heads, d) as the CUDA kernel returns it, so `out.transpose(1, 2)` is free)
  and the float32 logsumexp, no s² tensors. With `flash_attention=False` it is the Megatron-style math path: the
  scores matmul, softmax (saves its output, 2·a·s²·b bytes), dropout (1-byte mask, a·s²·b) and the matmul with
  v (saves the dropped probabilities, 2·a·s²·b) -- the 5·a·s²·b term of Korthikanti et al. (2022).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeplan.console import warn

aten = torch.ops.aten


def gpu_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout as CUDA runs it: `native_dropout`, which saves a bool mask for backward."""
    if not training or p == 0.0:
        return x
    return aten.native_dropout(x, p, True)[0]


class _FlashAttention(torch.autograd.Function):
    """FlashAttention-2 forward/backward via the aten flash ops (meta kernels exist for both)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
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
        grad_q, grad_k, grad_v = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, scale=scale
        )
        return grad_q, grad_k, grad_v, None, None, None


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


class GpuSemantics(TorchFunctionMode):
    """Torch-function mode that swaps dropout and attention for their CUDA equivalents (see module docstring)."""

    def __init__(self, *, flash_attention: bool) -> None:
        super().__init__()
        self.flash_attention = flash_attention
        self._warned = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            bound = {**dict(p=0.5, training=True), **dict(zip(("input", "p", "training"), args, strict=False))}
            bound.update({k: v for k, v in kwargs.items() if k != "inplace"})
            return gpu_dropout(bound["input"], bound["p"], bound["training"])
        if func is torch.dropout:
            return gpu_dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(_sdpa_arguments(args, kwargs))
        return func(*args, **kwargs)

    def _attention(self, bound: dict[str, Any]) -> torch.Tensor:
        q, k, v = bound["query"], bound["key"], bound["value"]
        if bound["enable_gqa"] and k.shape[-3] != q.shape[-3]:
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        use_flash = self.flash_attention and bound["attn_mask"] is None and q.dim() == 4
        if self.flash_attention and not use_flash and not self._warned:
            self._warned = True
            warn(
                "flash_attention ignored for an attention call with an explicit mask or non-4D inputs "
                "(profiled as the math path)"
            )
        if use_flash:
            return _FlashAttention.apply(q, k, v, bound["dropout_p"], bound["is_causal"], bound["scale"])
        return math_attention(q, k, v, bound["attn_mask"], bound["dropout_p"], bound["is_causal"], bound["scale"])
