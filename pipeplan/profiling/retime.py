"""A layer's times taken again from its work (`LayerProfile.work`): on one rank of t tensor-parallel x cp
context-parallel ranks, for a microbatch `batch_scale` times the profiled one, on `rates` (the one timing model
the analytic profiler and the search's tensor/context parallelism and microbatch scaling share).

Each pass is its kernels at the rank's shape (`Kernel.on_rank`, `kernel_seconds`) plus the rest of its ops, whose
roofline time divides by t x cp (sequence parallelism splits norms, dropouts and residual adds along the sequence
as tensor parallelism splits the rest; context parallelism splits every position) and grows with the microbatch:
- F: the forward's kernels; I: their input gradients; W: their weight gradients; B: I's and W's kernels with the
  fused pass's rest;
- full recomputation: F again; selective: the attention core again (its kernels, and the rest of its ops) where
  it keeps less than none does (a fused attention kernel saves no s x s tensor: nothing to recompute).
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.profiling.kernels import KernelRates, kernels_seconds, pass_kernels
from pipeplan.profiling.profile import LayerProfile


def retime_layer(
    layer: LayerProfile, rates: KernelRates, *, t: int = 1, cp: int = 1, batch_scale: float = 1.0, fp8: bool = False
) -> LayerProfile:
    """`layer` with F, I, W, B and both recompute times taken from its work (unchanged without work)."""
    work = layer.work
    if work is None:
        return layer
    ranks = [k.on_rank(t=t, cp=cp, batch_scale=batch_scale) for k in work.kernels]
    rest = batch_scale / (t * cp)

    def timed(name: str) -> float:
        return kernels_seconds(pass_kernels(tuple(ranks), name), rates, fp8=fp8) * 1e3

    forward, input_grad, weight_grad = timed("forward"), timed("input_grad"), timed("weight_grad")
    core = kernels_seconds([k for k in ranks if k.core], rates, fp8=fp8) * 1e3
    forward_ms = work.rest_forward_ms * rest + forward
    return replace(
        layer,
        forward_ms=forward_ms,
        input_grad_ms=work.rest_input_grad_ms * rest + input_grad,
        weight_grad_ms=work.rest_weight_grad_ms * rest + weight_grad,
        backward_ms=work.rest_backward_ms * rest + input_grad + weight_grad,
        full_recompute_ms=forward_ms,
        selective_recompute_ms=(work.rest_selective_ms * rest + core) if _drops_attention(layer) else 0.0,
    )


def _drops_attention(layer: LayerProfile) -> bool:
    return layer.selective_activation_bytes < layer.activation_bytes
