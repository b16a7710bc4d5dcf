"""How a mixture-of-experts model routes the profiled sample batch: one forward of the model itself (its own
routers, on the real sample batch, under the profile's precision) with hooks counting the (token, expert)
assignments each expert receives in every MoE layer that `graph.moe.moe_modules` finds:

- experts held as an nn.ModuleList (hand-written layers): the rows of the tokens each expert module is called with;
- fused experts (transformers: one module with expert-stacked weights called with `top_k_index`): the expert ids
  of its first integer tensor argument (ids outside [0, experts) — expert-parallel sentinels — are not counted);
  fused experts called with a list of tokens per expert (pipeplan's built-in `moe`): that list.
A layer whose assignments no hook saw is left out (never reported as zero tokens per expert).

The measured profiler times each layer on the activations of that same batch, so its expert times are those of
this routing; the profile records it (`Provenance.expert_routing`) and its summary prints it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipeplan.graph.moe import MoEModule, moe_modules
from pipeplan.profiling.profile import ExpertRouting


class _Counter:
    def __init__(self, layer: MoEModule) -> None:
        self.layer = layer
        self.tokens = 0
        self.per_expert = [0] * layer.num_experts

    def entering(self, module, args) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dim() >= 1:
            self.tokens += first.numel() // first.shape[-1]

    def expert_called(self, index: int) -> Callable:
        def hook(module, args) -> None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.dim() >= 1:
                self.per_expert[index] += first.numel() // first.shape[-1]

        return hook

    def fused_called(self, module, args, kwargs) -> None:
        values = (*args, *kwargs.values())
        found = [a for a in values if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        lists = [a for a in values if isinstance(a, list | tuple) and len(a) == self.layer.num_experts]
        if not found and lists and all(isinstance(n, int) for n in lists[0]):
            self.per_expert = [a + int(b) for a, b in zip(self.per_expert, lists[0], strict=True)]
            return
        if not found:
            return
        ids = found[0].flatten().long()
        ids = ids[(ids >= 0) & (ids < self.layer.num_experts)]
        counts = torch.bincount(ids.cpu(), minlength=self.layer.num_experts)
        self.per_expert = [a + int(b) for a, b in zip(self.per_expert, counts.tolist(), strict=True)]

    def result(self) -> ExpertRouting:
        layer = self.layer
        return ExpertRouting(
            module=layer.path,
            experts=layer.num_experts,
            top_k=layer.top_k,
            tokens=self.tokens,
            tokens_per_expert=tuple(self.per_expert),
        )


def _install(counter: _Counter) -> list:
    layer = counter.layer
    handles = [layer.module.register_forward_pre_hook(counter.entering)]
    experts = getattr(layer.module, layer.experts)
    if isinstance(experts, nn.ModuleList):
        handles += [expert.register_forward_pre_hook(counter.expert_called(i)) for i, expert in enumerate(experts)]
    else:
        handles.append(experts.register_forward_pre_hook(counter.fused_called, with_kwargs=True))
    return handles


def measure_routing(module: nn.Module, inputs: tuple, autocast: Callable) -> tuple[ExpertRouting, ...]:
    """Per MoE layer of `module`, how one forward on `inputs` routed its tokens (empty for a dense model)."""
    counters = [_Counter(layer) for layer in moe_modules(module)]
    if not counters:
        return ()
    handles = [handle for counter in counters for handle in _install(counter)]
    try:
        with torch.no_grad(), autocast():
            module(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(counter.result() for counter in counters if sum(counter.per_expert) > 0)
