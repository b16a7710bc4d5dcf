"""A layer's times taken from its work (`LayerProfile.work`), on `rates` (the profile's `provenance.kernel_rates`):
the one timing model the analytic profiler and the search's tensor/context parallelism and microbatch scaling
share. `reshaped_layer` first takes the work to one rank of t tensor- x cp context-parallel ranks and another
microbatch size (`LayerWork.reshaped`).

Each pass is its kernels (`kernel_seconds`) plus the rest of its ops:
- F: the forward's kernels; I: their input gradients; W: their weight gradients; B: I's and W's kernels with the
  fused pass's rest;
- full recomputation: F again; selective: the attention core again (its kernels, and the rest of its ops) where
  it keeps less than none does (a fused attention kernel saves no s x s tensor: nothing to recompute).
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.profiling.kernels import KernelRates, kernels_seconds, pass_kernels
from pipeplan.profiling.profile import LayerProfile


def retime_layer(layer: LayerProfile, rates: KernelRates | None) -> LayerProfile:
    """`layer` with F, I, W, B and both recompute times taken from its work (unchanged without work or rates)."""
    work = layer.work
    if work is None or rates is None:
        return layer

    def timed(name: str) -> float:
        return kernels_seconds(pass_kernels(work.kernels, name), rates) * 1e3

    forward, input_grad, weight_grad = timed("forward"), timed("input_grad"), timed("weight_grad")
    core = kernels_seconds([k for k in work.kernels if k.core], rates) * 1e3
    forward_ms = work.rest_forward_ms + forward
    return replace(
        layer,
        forward_ms=forward_ms,
        input_grad_ms=work.rest_input_grad_ms + input_grad,
        weight_grad_ms=work.rest_weight_grad_ms + weight_grad,
        backward_ms=work.rest_backward_ms + input_grad + weight_grad,
        full_recompute_ms=forward_ms,
        selective_recompute_ms=(work.rest_selective_ms + core) if _drops_attention(layer) else 0.0,
    )


def reshaped_layer(
    layer: LayerProfile, rates: KernelRates | None, *, t: int = 1, cp: int = 1, batch_scale: float = 1.0, ep: int = 1
) -> LayerProfile | None:
    """`layer`'s times on one rank of t x cp for a microbatch `batch_scale` times as large, from its work (its
    bytes are the caller's); None without work or rates (the caller scales linearly)."""
    if layer.work is None or rates is None:
        return None
    return retime_layer(replace(layer, work=layer.work.reshaped(t=t, cp=cp, batch_scale=batch_scale, ep=ep)), rates)


def _drops_attention(layer: LayerProfile) -> bool:
    return layer.kept_bytes("selective") < layer.activation_bytes
