"""Helpers for the planner tests: small synthetic profiles (no torch work) and clusters."""

from __future__ import annotations

from pipeplan.cluster import Cluster
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance


def synthetic_profile(
    num_layers: int = 8,
    *,
    forward_ms: float = 1.0,
    params: int = 1_000_000,
    activation_bytes: int = 4_000_000,
    cut_bytes: int = 1_000_000,
    heavy_last: float = 1.0,
    batch_size: int = 1,
    model: str = "synthetic",
    fused_backward: float = 2.0,
) -> Profile:
    """A transformer-like chain: equal layers (the last `heavy_last` times heavier), I = W = forward and the fused
    backward B = `fused_backward` x forward."""
    layers = []
    for i in range(num_layers):
        scale = heavy_last if i == num_layers - 1 else 1.0
        f = forward_ms * scale
        layers.append(
            LayerProfile(
                name=f"layer{i}",
                forward_ms=f,
                input_grad_ms=f,
                weight_grad_ms=f,
                backward_ms=fused_backward * f,
                activation_bytes=activation_bytes,
                activation_freed_by_input_grad_bytes=activation_bytes // 2,
                param_count=params,
                param_bytes=4 * params,
                output_bytes=cut_bytes,
            )
        )
    return Profile(
        layers=tuple(layers),
        cut_bytes=(cut_bytes,) * (num_layers - 1),
        provenance=Provenance(source="analytic", batch_size=batch_size, model=model, tokens_per_sample=16),
    )


def make_cluster(num_devices: int = 4, memory: int = 2**30, devices_per_node: int | None = None) -> Cluster:
    return Cluster(
        num_devices=num_devices,
        devices_per_node=devices_per_node or num_devices,
        memory_per_device=memory,
        intra_node_bandwidth=1e10,
        inter_node_bandwidth=1e9,
    )
