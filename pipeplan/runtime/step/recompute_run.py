"""Activation recomputation in the runtime, per stage (the plan's `StagePlan.recompute`, modes in
profiling/recompute.py, where the profiles record what each mode keeps and costs):

- `full` lives in the executor: the forward runs without a graph, keeping only the stage's inputs, and runs again
  with grad right before the stage's I (or B), seeded by the same `forward_seed`; I and W proceed as without it.
- `selective` is here: while such a stage runs its forward, `SelectiveRecompute` (a torch function mode) routes
  each scaled_dot_product_attention call that would take the math path (the one that saves the s×s scores,
  probabilities and dropout mask; a fused kernel saves none and is left alone, as the profiles count it) through
  `_RecomputedAttention`: the forward runs without a graph and keeps only the call's tensor arguments (q, k, v,
  mask), the RNG state and the autocast settings; the backward runs the call again with grad under that same
  state (its dropout draws repeat exactly) and backpropagates through it. The attention node has no parameters,
  so in a split backward I computes it and W never touches it.

Either way losses and gradients are those of the run without recomputation, bit for bit.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipeplan.artifact.plan import Plan
from pipeplan.errors import RunError
from pipeplan.graph.recompute_modes import is_attention
from pipeplan.graph.trace import TracedModel


def check_recompute(plan: Plan, traced: TracedModel) -> None:
    """Refuse a `selective` stage that calls no scaled_dot_product_attention: nothing there could be recomputed,
    and its memory would not be what the plan assumed."""
    targets = {node.name: node.target for node in traced.graph_module.graph.nodes if node.op == "call_function"}
    for stage in plan.stages:
        if stage.recompute != "selective":
            continue
        if not any(is_attention(targets.get(name)) for name in stage.node_names):
            raise RunError(
                f"plan stage {stage.index} asks for selective recomputation but calls no "
                "scaled_dot_product_attention; set its recompute to 'full' or 'none'"
            )


class SelectiveRecompute(TorchFunctionMode):
    """Active around a selective stage's forward: attention calls keep only their inputs (see the module)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_attention(func) or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not any(leaves[i].requires_grad for i in positions) or not _saves_internals(args, kwargs):
            return func(*args, **kwargs)
        call = _Call(func, leaves, spec, positions)
        return _RecomputedAttention.apply(call, *[leaves[i] for i in positions])


def _saves_internals(args: tuple, kwargs: dict) -> bool:
    """Whether this attention call takes the math path (s×s internals saved for backward), not a fused kernel."""
    try:
        return torch._fused_sdp_choice(*args, **kwargs) == SDPBackend.MATH.value
    except (RuntimeError, TypeError):  # a call the chooser does not take: recompute it, which is exact anyway
        return True


class _Call:
    """One attention call: the function and its non-tensor arguments, the tensors given separately."""

    def __init__(self, func, leaves: list, spec, positions: list[int]) -> None:
        self.func, self.spec, self.positions = func, spec, positions
        self.leaves = [None if i in positions else leaf for i, leaf in enumerate(leaves)]

    def __call__(self, tensors) -> torch.Tensor:
        leaves = list(self.leaves)
        for i, tensor in zip(self.positions, tensors, strict=True):
            leaves[i] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.func(*args, **kwargs)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors: torch.Tensor) -> torch.Tensor:
        device = tensors[0].device
        ctx.call, ctx.device = call, device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        ctx.autocast = _autocast_state(device.type)
        ctx.save_for_backward(*tensors)
        return call(tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        wanted = ctx.needs_input_grad[1:]
        leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, wanted, strict=True)]
        device = ctx.device
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, device)
            with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=enabled):
                out = ctx.call(leaves)
        targets = [leaf for leaf, need in zip(leaves, wanted, strict=True) if need]
        found = iter(torch.autograd.grad(out, targets, grad, allow_unused=True))
        grads = [next(found) if need else None for need in wanted]
        return (None, *grads)
