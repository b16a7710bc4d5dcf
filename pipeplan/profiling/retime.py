"""A layer's times taken from its work (`LayerProfile.work`), on `rates` (the profile's `provenance.kernel_rates`):
the one timing model the analytic profiler and the search's tensor/context parallelism and microbatch scaling
share. `reshaped_layer` first takes the work to one rank of t tensor- x cp context-parallel ranks and another
microbatch size (`LayerWork.reshaped`).

Each pass is its kernels (`kernel_seconds`) plus the rest of its ops:
- F: the forward's kernels; I: their input gradients; W: their weight gradients; B: I's and W's kernels with the
  fused pass's rest;
- full recomputation: F again; selective: the attention core again (its kernels, and the rest of its ops) where
  it keeps less than none does (a fused attention kernel saves no s x s tensor: nothing to recompute).

The rest of a pass on a GPU (rates with an SM count, a profile with traffic): every other kernel is memory-bound,
bytes / the memory rate plus one launch each (`profiling.stack_traffic` counts both under the stack's fusions), and the
ops whose FLOPs bind take their roofline time. Without an SM count (a CPU) or traffic (a schema-3 profile) the
rest is each op's roofline, as profiled.

`pass_breakdown` splits a pass's time into what it is spent on — matmuls (GEMM), attention (its kernels and, for
math attention, its matmuls), memory-bound kernels' bytes, kernel launches, and the other FLOP-bound ops — the
parts summing to the pass's time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.profiling.kernels import KernelRates, kernel_seconds, kernels_seconds, pass_kernels
from pipeplan.profiling.profile import LayerProfile, LayerWork

BREAKDOWN = ("gemm", "attention", "memory", "launch", "other", "collectives")  # ComputeBreakdown's parts


@dataclass(frozen=True)
class ComputeBreakdown:
    """Milliseconds by what they are spent on (module docstring; `collectives`: what a layer's times hold beyond
    its work, the exposed tensor- and context-parallel collectives `search.sharding` adds); `total_ms` is their
    sum."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    launch: float = 0.0
    other: float = 0.0
    collectives: float = 0.0

    @property
    def total_ms(self) -> float:
        return sum(getattr(self, f) for f in BREAKDOWN)

    def __add__(self, other: ComputeBreakdown) -> ComputeBreakdown:
        return ComputeBreakdown(*(getattr(self, f) + getattr(other, f) for f in BREAKDOWN))

    def scaled(self, factor: float) -> ComputeBreakdown:
        return ComputeBreakdown(*(getattr(self, f) * factor for f in BREAKDOWN))

    def as_dict(self) -> dict[str, float]:
        return {f"{f}_ms": getattr(self, f) for f in BREAKDOWN}


def pass_breakdown(work: LayerWork, rates: KernelRates, name: str) -> ComputeBreakdown:
    """One pass of `work` (forward, input_grad, weight_grad, backward or selective) on `rates`, by part."""
    if name == "backward":
        kernels = _kernel_part(work, rates, "input_grad") + _kernel_part(work, rates, "weight_grad")
        return kernels + _rest_breakdown(work, rates, "backward")
    if name == "selective":
        core = [k for k in work.kernels if k.core]
        return _kernels_breakdown(core, rates) + _rest_breakdown(work, rates, "selective")
    return _kernel_part(work, rates, name) + _rest_breakdown(work, rates, name)


def layer_breakdown(
    layer: LayerProfile, rates: KernelRates | None, recompute: str = "none", *, split_backward: bool = False
) -> ComputeBreakdown:
    """One microbatch of `layer` — its forward, its backward (the fused B, or I and W as separate passes when the
    schedule splits the backward: `costs.stage.compute_ms`) and what `recompute` re-runs — by part; the parts sum
    to forward_ms + (backward_ms or input_grad_ms + weight_grad_ms) + recompute_ms(recompute). A layer without work
    (a measured profile) is all `other`."""
    backward = layer.input_grad_ms + layer.weight_grad_ms if split_backward else layer.backward_ms
    total = layer.forward_ms + backward + layer.recompute_ms(recompute)
    if layer.work is None or rates is None:
        return ComputeBreakdown(other=total)
    passes = ("forward", "input_grad", "weight_grad") if split_backward else ("forward", "backward")
    parts = ComputeBreakdown()
    for name in passes:
        parts = parts + pass_breakdown(layer.work, rates, name)
    if recompute == "full":
        parts = parts + pass_breakdown(layer.work, rates, "forward")
    elif recompute == "selective" and layer.selective_recompute_ms > 0:
        parts = parts + pass_breakdown(layer.work, rates, "selective")
    return replace(parts, collectives=max(total - parts.total_ms, 0.0))


def layers_breakdown(
    layers, rates: KernelRates | None, recompute: str = "none", *, split_backward: bool = False
) -> ComputeBreakdown:
    """One microbatch of a stage's `layers` (`layer_breakdown` each, the stage's `recompute` mode)."""
    total = ComputeBreakdown()
    for layer in layers:
        total = total + layer_breakdown(layer, rates, recompute, split_backward=split_backward)
    return total


def _kernel_part(work: LayerWork, rates: KernelRates, name: str) -> ComputeBreakdown:
    return _kernels_breakdown(pass_kernels(work.kernels, name), rates)


def _kernels_breakdown(kernels, rates: KernelRates) -> ComputeBreakdown:
    gemm = attention = 0.0
    for kernel in kernels:
        ms = kernel_seconds(kernel, rates) * 1e3
        if kernel.kind == "attention" or kernel.core:
            attention += ms
        else:
            gemm += ms
    return ComputeBreakdown(gemm=gemm, attention=attention)


def _rest_breakdown(work: LayerWork, rates: KernelRates, name: str) -> ComputeBreakdown:
    """The rest of a pass (module docstring): traffic on a GPU, else the profiled roofline ms ("other")."""
    traffic = work.traffic(name)
    if traffic is None or not rates.sm_count:
        return ComputeBreakdown(other=getattr(work, f"rest_{name}_ms"))
    return ComputeBreakdown(
        memory=traffic.bytes / rates.bytes_per_s * 1e3,
        launch=traffic.kernels * rates.launch_s * 1e3,
        other=traffic.compute_ms,
    )


def rest_ms(work: LayerWork, rates: KernelRates, name: str) -> float:
    """The time of one pass's other ops (module docstring)."""
    return _rest_breakdown(work, rates, name).total_ms


def retime_layer(layer: LayerProfile, rates: KernelRates | None) -> LayerProfile:
    """`layer` with F, I, W, B and both recompute times taken from its work (unchanged without work or rates)."""
    work = layer.work
    if work is None or rates is None:
        return layer

    def timed(name: str) -> float:
        return kernels_seconds(pass_kernels(work.kernels, name), rates) * 1e3

    forward, input_grad, weight_grad = timed("forward"), timed("input_grad"), timed("weight_grad")
    core = kernels_seconds([k for k in work.kernels if k.core], rates) * 1e3
    forward_ms = rest_ms(work, rates, "forward") + forward
    return replace(
        layer,
        forward_ms=forward_ms,
        input_grad_ms=rest_ms(work, rates, "input_grad") + input_grad,
        weight_grad_ms=rest_ms(work, rates, "weight_grad") + weight_grad,
        backward_ms=rest_ms(work, rates, "backward") + input_grad + weight_grad,
        full_recompute_ms=forward_ms,
        selective_recompute_ms=(rest_ms(work, rates, "selective") + core) if _drops_attention(layer) else 0.0,
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
