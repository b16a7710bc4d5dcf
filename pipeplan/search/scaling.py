"""Rescale a Profile to another microbatch size.

A profile holds costs for one microbatch of `provenance.batch_size` samples. The planner scales every
per-microbatch quantity linearly by `microbatch_size / batch_size`: activation (under every recompute mode) /
output / cut / input bytes and FLOPs. Parameter counts and bytes do not depend on the batch. Times: an analytic
layer's are taken again from its work at the new size (`profiling.retime`: its matmuls at the new shapes, so a
larger microbatch's better tile use shows); other layers' scale linearly, which is exact for compute-bound layers
and pessimistic when growing the batch on an under-utilized device, so the planner profiles at the smallest
microbatch size it considers and only scales up.
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.profiling.kernels import KernelRates
from pipeplan.profiling.profile import LayerProfile, Profile
from pipeplan.profiling.retime import reshaped_layer


def _scale_layer(layer: LayerProfile, factor: float, rates: KernelRates | None) -> LayerProfile:
    activation = round(layer.activation_bytes * factor)
    freed = min(activation, round(layer.activation_freed_by_input_grad_bytes * factor))
    retimed = reshaped_layer(layer, rates, batch_scale=factor)
    if retimed is not None:
        return replace(
            retimed,
            activation_bytes=activation,
            activation_freed_by_input_grad_bytes=freed,
            output_bytes=round(layer.output_bytes * factor),
            flops=layer.flops * factor,
            selective_activation_bytes=min(activation, round(layer.kept_bytes("selective") * factor)),
            full_activation_bytes=round(layer.kept_bytes("full") * factor),
        )
    return replace(
        layer,
        forward_ms=layer.forward_ms * factor,
        input_grad_ms=layer.input_grad_ms * factor,
        weight_grad_ms=layer.weight_grad_ms * factor,
        backward_ms=layer.backward_ms * factor,
        activation_bytes=activation,
        activation_freed_by_input_grad_bytes=freed,
        output_bytes=round(layer.output_bytes * factor),
        flops=layer.flops * factor,
        selective_activation_bytes=min(activation, round(layer.kept_bytes("selective") * factor)),
        full_activation_bytes=round(layer.kept_bytes("full") * factor),
        full_recompute_ms=layer.recompute_ms("full") * factor,
        selective_recompute_ms=layer.selective_recompute_ms * factor,
    )


def scale_profile(profile: Profile, microbatch_size: int) -> Profile:
    """`profile` as if measured with `microbatch_size` samples per microbatch (linear in the sample count)."""
    assert microbatch_size >= 1
    base = profile.provenance.batch_size
    if microbatch_size == base:
        return profile
    factor = microbatch_size / base

    def scale_optional(value: float | None) -> float | None:
        return None if value is None else value * factor

    return replace(
        profile,
        layers=tuple(_scale_layer(layer, factor, profile.provenance.kernel_rates) for layer in profile.layers),
        cut_bytes=tuple(round(b * factor) for b in profile.cut_bytes),
        input_bytes=round(profile.input_bytes * factor),
        whole_forward_ms=scale_optional(profile.whole_forward_ms),
        whole_backward_ms=scale_optional(profile.whole_backward_ms),
        whole_split_backward_ms=scale_optional(profile.whole_split_backward_ms),
        provenance=replace(
            profile.provenance,
            batch_size=microbatch_size,
            notes=(profile.provenance.notes + f" scaled from batch size {base}").strip(),
        ),
    )
