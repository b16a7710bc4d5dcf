"""Helpers for the search (and capacity) tests: small synthetic profiles (no torch work) and clusters."""

from __future__ import annotations

from dataclasses import replace

from pipeplan.artifact.timing import plan_step_ms  # noqa: F401  (re-exported for the tests)
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
        provenance=Provenance(
            source="analytic", batch_size=batch_size, model=model, tokens_per_sample=16, loss_in_last_layer=True
        ),
    )


def make_cluster(num_devices: int = 4, memory: int = 2**30, devices_per_node: int | None = None) -> Cluster:
    return Cluster(
        num_devices=num_devices,
        devices_per_node=devices_per_node or num_devices,
        memory_per_device=memory,
        intra_node_bandwidth=1e10,
        inter_node_bandwidth=1e9,
    )


def _layer(name: str, **fields) -> LayerProfile:
    base = dict(
        forward_ms=1.0,
        input_grad_ms=1.0,
        weight_grad_ms=1.0,
        backward_ms=2.0,
        activation_bytes=800,
        activation_freed_by_input_grad_bytes=400,
        param_count=1000,
        param_bytes=4000,
        output_bytes=64,
        flops=1e9,
    )
    return LayerProfile(name=name, **{**base, **fields})


def stack_profile(
    num_blocks: int = 4, *, hidden_bytes: int = 64, block: dict | None = None, options: dict | None = None
) -> Profile:
    """Embedding (a lookup: no FLOPs, no input gradient), `num_blocks` alike blocks, LM head."""
    embed = _layer("embed", flops=0.0, input_grad_ms=0.0, activation_freed_by_input_grad_bytes=0)
    blocks = [_layer(f"blocks.{i}", **{"output_bytes": hidden_bytes, **(block or {})}) for i in range(num_blocks)]
    head = _layer("head", output_bytes=1000)
    return Profile(
        layers=(replace(embed, output_bytes=hidden_bytes), *blocks, head),
        cut_bytes=(2 * hidden_bytes,) * (num_blocks + 1),
        provenance=Provenance(
            source="analytic",
            batch_size=1,
            model="stack",
            tokens_per_sample=16,
            model_options=dict(options or {}),
            loss_in_last_layer=True,
        ),
    )


def capacity_config(**fields):
    """A CapacityConfig from flat keywords: SearchConfig's fields go to its `search` (precision bf16-mixed, optimizer
    adamw and the hardware's default memory reserve unless given), the rest to the CapacityConfig."""
    import dataclasses

    from pipeplan.capacity.sweep import CapacityConfig
    from pipeplan.costs import numerics
    from pipeplan.search.config import SearchConfig, default_memory_reserve

    names = {f.name for f in dataclasses.fields(SearchConfig)} - {"tensor_parallel"}  # capacity's own (auto or t)
    search = {k: fields.pop(k) for k in list(fields) if k in names}
    held = (fields.pop("optimizer", "adamw"), fields.pop("precision", "bf16-mixed"))
    search.setdefault("numerics", numerics(*held))
    search.setdefault("replication", False)  # capacity tries replicated stages only when asked
    search.setdefault("memory_reserve_bytes", default_memory_reserve(fields["hardware"].memory_bytes))
    return CapacityConfig(search=SearchConfig(**search), **fields)
