"""Mixture-of-experts layers in a model, found by their structure (what the cost models and summaries read).

`moe_modules(model)` lists every MoE layer, outermost first in module order: a module with a child whose name
contains "expert" holding the routed experts — an nn.ModuleList of two or more modules of one type (hand-written
MoE layers), or one module with a 3-D expert-stacked parameter (transformers' fused `experts`: `gate_up_proj` of
shape (experts, 2·intermediate, hidden)) — and a router: another child with a 2-D `weight` whose first dimension is
the number of experts (an `nn.Linear(hidden, experts)`, transformers' `MixtralTopKRouter`, DeepSeek-V3's
`DeepseekV3TopkRouter`). Children named `shared_expert*` (not `*_gate`) are shared experts every token runs
(Qwen2-MoE, DeepSeek-V3). This recognises transformers' mixtral, qwen2_moe, qwen3_moe and deepseek_v3 MoE blocks and the
usual hand-written layers; nothing is declared by the user.

How such a layer is traced: transformers' experts run as their grouped-matmul implementation, which torch.export
captures whole (routing included, no data-dependent shapes); a hand-written layer that dispatches with boolean
masks or `nonzero` cannot be traced, and becomes an eager leaf inside its block (`LayerGraph.eager_modules`, see
`fx_trace.symbolic_trace`). Either way each MoE layer lies inside one pipeline layer, and cuts stay at block
boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoEModule:
    path: str  # the MoE layer (router + experts), e.g. "model.layers.1.mlp" or "blocks.0.moe"
    module: nn.Module
    router: str  # child name of the router ("gate")
    experts: str  # child name of the routed experts ("experts")
    num_experts: int
    top_k: int | None  # experts per token, where the layer or its router says (`top_k`, `num_experts_per_tok`)
    shared: tuple[str, ...] = ()  # child names of shared experts


def _expert_count(child: nn.Module) -> int:
    if isinstance(child, nn.ModuleList):
        return len(child) if len(child) >= 2 and len({type(item) for item in child}) == 1 else 0
    stacked = [p.shape[0] for p in child.parameters(recurse=False) if p.dim() == 3]
    return int(stacked[0]) if stacked and stacked[0] >= 2 and len(set(stacked)) == 1 else 0


def _top_k(*modules: nn.Module) -> int | None:
    for module in modules:
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(module, attr, None)
            if isinstance(value, int) and value >= 1:
                return value
    return None


def recognise(module: nn.Module, path: str = "") -> MoEModule | None:
    """`module` as an MoE layer (see the module docstring), or None."""
    children = dict(module.named_children())
    for name, child in children.items():
        count = _expert_count(child) if "expert" in name and "shared" not in name else 0
        if not count:
            continue
        for router_name, router in children.items():
            weight = getattr(router, "weight", None)
            if (
                router_name != name
                and isinstance(weight, torch.Tensor)
                and weight.dim() == 2
                and weight.shape[0] == count
            ):
                shared = tuple(n for n in children if n.startswith("shared_expert") and not n.endswith("_gate"))
                return MoEModule(path, module, router_name, name, count, _top_k(module, router), shared)
    return None


def moe_modules(model: nn.Module) -> list[MoEModule]:
    """Every MoE layer of `model` (outermost only), in module order."""
    found: list[MoEModule] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{layer.path}.") for layer in found):
            continue
        layer = recognise(module, path)
        if layer is not None:
            found.append(layer)
    return found
