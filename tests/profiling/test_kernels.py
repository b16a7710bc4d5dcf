"""Kernels by shape: tile and wave quantization, FlashAttention's thread blocks, the FP8 cast, the backward kernels
and the rank shapes tensor and context parallelism give."""

from __future__ import annotations

import math

import pytest

from pipeplan.profiling.kernels import Kernel, KernelRates, backward_kernels, kernel_seconds, pass_kernels

PEAK = 312e12  # A100 bf16 dense (datasheet)
RATES = KernelRates(gemm_flops_per_s=PEAK, attention_flops_per_s=PEAK, bytes_per_s=2e12, sm_count=108)


def _linear(**fields) -> Kernel:
    base = dict(kind="gemm", m=8192, n=18432, k=6144, tp="n", cp="m", tokens="m", weight=True)
    return Kernel(**{**base, **fields})


def test_a_full_wave_runs_at_the_rate_and_a_partial_wave_costs_more():
    # 108 SMs: 12 x 9 tiles of 256 x 128 are exactly one wave (compute-bound at k = 16384)
    full = Kernel(kind="gemm", m=256 * 12, n=128 * 9, k=16384)
    assert kernel_seconds(full, RATES) == pytest.approx(full.flops / PEAK)
    wider = Kernel(kind="gemm", m=256 * 12, n=128 * 10, k=16384)  # 120 tiles: no tile shape fills whole waves
    achieved = wider.flops / kernel_seconds(wider, RATES)
    assert achieved == pytest.approx(PEAK * 10 / 9 / 1.5)  # best: 240 tiles of 128 x 128 in 3 waves


def test_skinny_shards_run_below_peak_and_without_sms_there_is_no_quantization():
    shard = _linear().on_rank(t=8)
    assert (shard.m, shard.n, shard.k) == (8192, 2304, 6144)
    achieved = shard.flops / kernel_seconds(shard, RATES)
    assert achieved < 0.98 * PEAK  # no tile shape fills whole waves of 108
    flat = KernelRates(gemm_flops_per_s=PEAK, attention_flops_per_s=PEAK, bytes_per_s=2e12)
    assert kernel_seconds(shard, flat) == pytest.approx(shard.flops / PEAK)


def test_memory_bound_matmuls_take_their_bytes_time():
    skinny = Kernel(kind="gemm", m=8, n=8192, k=8192)  # a decode-like matmul: reads the whole weight
    assert kernel_seconds(skinny, RATES) == pytest.approx(skinny.bytes / 2e12)


def test_rank_shapes_follow_the_tags():
    kernel = _linear()
    rank = kernel.on_rank(t=4, cp=2, batch_scale=3.0)
    assert (rank.m, rank.n, rank.k) == (8192 * 3 // 2, 18432 // 4, 6144)
    row = _linear(tp="k", n=6144, k=18432)
    assert row.on_rank(t=4).k == 18432 // 4 and row.on_rank(t=4).n == 6144


def test_backward_kernels_have_the_forward_s_flops_and_move_the_tags():
    kernel = _linear()
    back = backward_kernels(kernel)
    (dgrad,), (wgrad,) = back["input_grad"], back["weight_grad"]
    assert dgrad.flops == wgrad.flops == kernel.flops
    assert (dgrad.m, dgrad.n, dgrad.k, dgrad.tp) == (8192, 6144, 18432, "k")  # column-parallel: dgrad contracts n/t
    assert (wgrad.m, wgrad.n, wgrad.k, wgrad.cp, wgrad.tokens) == (6144, 18432, 8192, "k", "k")
    assert backward_kernels(_linear(input_grad=False))["input_grad"] == []
    scores = Kernel(kind="gemm", m=2048, n=2048, k=128, batch=64, tp="b", cp="m", tokens="b", core=True)
    both = backward_kernels(scores)
    assert len(both["input_grad"]) == 2 and not both["weight_grad"]
    assert sum(k.flops for k in pass_kernels((scores,), "input_grad")) == 2 * scores.flops


def test_attention_counts_the_causal_half_and_its_backward_is_two_and_a_half_forwards():
    attention = Kernel(kind="attention", m=4096, n=4096, k=128, batch=32, causal=True, tp="b", cp="m", tokens="b")
    assert attention.flops == 4 * 32 * 4096 * 4096 * 128 / 2  # FlashAttention's benchmark counter, causal
    (backward,) = backward_kernels(attention)["input_grad"]
    assert backward.flops == pytest.approx(2.5 * attention.flops)
    blocks = 32 * math.ceil(4096 / 128)
    waves = math.ceil(blocks / 108)
    per_block = 4 * 128 * 4096 * 128 / 2
    assert kernel_seconds(attention, RATES) == pytest.approx(waves * per_block / (PEAK / 108))
    ring = attention.on_rank(cp=2)  # context parallelism: half the queries against every key
    assert (ring.m, ring.n) == (2048, 4096) and ring.flops == pytest.approx(attention.flops / 2)


def test_fp8_runs_linears_at_the_fp8_rate_after_casting_their_activation():
    fp8 = KernelRates(
        gemm_flops_per_s=PEAK, attention_flops_per_s=PEAK, bytes_per_s=2e12, sm_count=None, fp8_flops_per_s=2 * PEAK
    )
    kernel = _linear()
    cast = 3.0 * kernel.m * kernel.k / 2e12  # read 2 bytes, write 1 per element of the activation operand
    assert kernel_seconds(kernel, fp8) == pytest.approx(kernel.flops / (2 * PEAK) + cast)
    scores = Kernel(kind="gemm", m=2048, n=2048, k=128, batch=64)  # not a linear: stays in 16 bits, no cast
    assert kernel_seconds(scores, fp8) == pytest.approx(max(scores.flops / PEAK, scores.bytes / 2e12))
