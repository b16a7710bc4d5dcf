"""Where a mixture-of-experts layer written for eager PyTorch (transformers' routers and grouped-mm experts) does
more memory traffic than the production MoE layers a GPU training run uses, the kernels those run, by structure
(`gpu_ops.GpuSemantics` calls these; analytic profiles only: the model and the runtime are unchanged):

- **Weighting in the experts' dtype.** A grouped expert matmul's output times routing weights of a wider dtype
  (transformers keeps the router's float32 weights, so the weighting, the return to token order and the sum over
  top_k would run in float32): production layers weight the expert outputs in their own dtype (Megatron-Core's
  weighted SwiGLU and fused unpermute, Transformer Engine's moe_unpermute with merging probs; torchtitan casts the
  product back), so the weights are cast to the outputs' dtype first (`weighted_experts`).
- **A float32 router on 16-bit activations.** A linear whose input is a float32 copy of a 16-bit activation
  (DeepSeek-V3's router: `F.linear(x.float(), w.float())`) runs as Megatron-Core's float32 router gating
  (`moe_router_dtype=fp32`, RouterGatingLinearFunction): the same float32 matmul, with the 16-bit input saved for
  backward and cast inside, not a float32 copy of it (`UpcastLinear`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten
UPCASTS = (aten.to.dtype, aten._to_copy.default, torch.Tensor.to, torch.Tensor.float, torch.Tensor.type)
LINEARS = (F.linear, aten.linear.default)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def weighted_experts(func, a, b, expert_outputs: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """`func(a, b)` (a multiply) with the routing weights in the expert outputs' dtype when one operand is a grouped
    expert matmul's output (`expert_outputs`: id -> output) and the other is wider; None when it is not that."""
    for outputs, weights in ((a, b), (b, a)):
        if not isinstance(outputs, torch.Tensor) or expert_outputs.get(id(outputs)) is not outputs:
            continue
        wider = isinstance(weights, torch.Tensor) and weights.is_floating_point()
        if wider and torch.promote_types(outputs.dtype, weights.dtype) != outputs.dtype:
            return func(outputs, weights.to(outputs.dtype))
    return None


def upcast_source(value, out) -> torch.Tensor | None:
    """`value` when `out` is a float32 copy of it, a 16-bit tensor; else None."""
    if not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor) or out is value:
        return None
    return value if value.dtype in LOW_PRECISION and out.dtype == torch.float32 else None


class UpcastLinear(torch.autograd.Function):
    """x Wᵀ in float32 from the float32 copies the model made (`x32`, `w32`), saving the 16-bit x and W they were
    made from: Megatron-Core's float32 router gating (module docstring). The copies get no gradient: x and W get
    theirs directly, as that function computes them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x32: torch.Tensor, weight: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x32, w32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight.float()).to(x.dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        return grad_x, None, grad_w, None
