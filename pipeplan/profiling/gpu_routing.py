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
  (`moe_router_dtype=fp32`, RouterGatingLinearFunction): Transformer Engine's GEMM of the 16-bit input and weight
  with a float32 output, the 16-bit input saved for backward and cast inside, not a float32 copy of it; its input
  and weight gradients float32 GEMMs cast back, in I and W apart (`UpcastLinear`).
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
    """x Wᵀ as Megatron-Core's float32 router gating runs it (module docstring; RouterGatingLinearFunction with
    Transformer Engine's general GEMM): the 16-bit x and W in, float32 logits out, the 16-bit x and W saved — the
    float32 copies the model made (`x32`, `w32`) are not read (so not written: `stack_traffic`), and get no
    gradient. Its backward is that function's: float32 GEMMs cast back to x's and W's dtypes, each computed only
    when the pass wants it (`_wanted`): the input gradient in I, the weight gradient in W, as autograd's own
    linear splits them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x32: torch.Tensor, weight: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight).to(w32.dtype)  # a 16-bit GEMM with a float32 output (TE writes it in fp32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight.float()).to(x.dtype) if _wanted(ctx, 0) else None
        grad_w = None
        if _wanted(ctx, 2):
            rows = grad.reshape(-1, grad.shape[-1])
            grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        return grad_x, None, grad_w, None


def upcast_linear(x: torch.Tensor, x32: torch.Tensor, weight: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """`UpcastLinear` with the weight passed through an alias node: a parameter's own node (AccumulateGrad) cannot
    be asked whether an `autograd.grad` pass runs it, the alias's can (`_wanted`)."""
    return UpcastLinear.apply(x, x32, _Alias.apply(weight), w32)


class _Alias(torch.autograd.Function):
    """The tensor itself (a view: no copy, no traffic), as a node of its own in the backward graph."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wanted(ctx: Any, index: int) -> bool:
    """Whether this backward pass wants the gradient of input `index`: the engine runs the node it flows to (I runs
    the input side only, W the weight side only, B both); True when that cannot be asked (a leaf under
    autograd.grad)."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    try:
        return node is None or bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True
