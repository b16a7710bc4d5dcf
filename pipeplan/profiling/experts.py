"""Mixture-of-experts figures of a profile: the parameters a token uses (active parameters) next to those every
rank of the model holds. A layer's routed-expert weights (`LayerProfile.expert_param_count`) are all held, but a
token passes through top_k of its experts: the share is read off the layer's grouped expert matmuls
(`Kernel.experts`: experts x tokens per expert = tokens x top_k, balanced routing in analytic profiles)."""

from __future__ import annotations

from pipeplan.profiling.profile import LayerProfile, Profile


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


__all__ = ["active_param_count", "expert_count", "is_moe", "routed_share"]
