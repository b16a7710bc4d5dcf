"""Mixture-of-experts figures of a profile: the parameters a token uses (active parameters) next to those every
rank of the model holds. A layer's routed-expert weights (`LayerProfile.expert_param_count`) are all held, but a
token passes through top_k of its experts: the share is read off the layer's grouped expert matmuls
(`Kernel.experts`: experts x tokens per expert = tokens x top_k, balanced routing in analytic profiles)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeplan.errors import ConfigError
from pipeplan.profiling.profile import LayerProfile, Profile

if TYPE_CHECKING:  # the figures of a profile file need no torch; the check below has a model
    from torch import nn

    from pipeplan.graph.trace import Layer


def routed_share(layer: LayerProfile, tokens: int) -> float:
    """top_k / experts of the layer: the rows one grouped expert matmul runs per expert, over the microbatch's
    `tokens` (1.0 for a layer without grouped expert matmuls)."""
    kernels = [k for k in (layer.work.kernels if layer.work is not None else ()) if k.experts]
    if not kernels or tokens < 1:
        return 1.0
    return min(1.0, kernels[0].m / tokens)


def expert_count(layer: LayerProfile) -> int:
    """Routed experts of the layer: its grouped expert matmuls' batch (0 without)."""
    kernels = [k for k in (layer.work.kernels if layer.work is not None else ()) if k.experts]
    return kernels[0].batch if kernels else 0


def active_param_count(profile: Profile) -> float:
    """Parameters one token uses: every layer's dense ones and top_k / experts of its routed-expert weights."""
    tokens = profile.provenance.batch_size * (profile.provenance.tokens_per_sample or 1)
    return float(
        sum(
            layer.param_count - layer.expert_param_count * (1.0 - routed_share(layer, tokens))
            for layer in profile.layers
        )
    )


def is_moe(profile: Profile) -> bool:
    """Whether any layer holds routed-expert weights."""
    return any(layer.expert_param_count for layer in profile.layers)


def check_experts_counted(model: nn.Module, layers: Sequence[Layer], profiles: Sequence[LayerProfile]) -> None:
    """Refuse an analytic profile that missed a model's routed experts: every MoE layer `graph.moe` finds must
    show up as a layer with grouped expert matmuls. On the meta device a layer that dispatches by the routing
    (an expert loop that skips experts no token reaches) runs no expert at all, so its profile would count
    attention and the router only; grouped matmuls (transformers' default, the built-in `moe`) are counted."""
    from pipeplan.graph.moe import moe_modules

    for found in moe_modules(model):
        inside = [i for i, layer in enumerate(layers) if f"{found.path}.".startswith(f"{layer.module_path}.")]
        owner = inside[0] if inside else None
        if owner is not None and not profiles[owner].expert_param_count:
            raise ConfigError(
                f"analytic profiling cannot count the experts of {found.path!r}: they dispatch by the routing, which "
                "the meta device cannot run; profile with --device cpu or cuda (docs/models.md)"
            )


__all__ = ["check_experts_counted", "active_param_count", "expert_count", "is_moe", "routed_share"]
