"""Kernels by shape: tile and wave quantization, operand reuse, small-K, split-K and stream-K, the per-kernel
overhead, FlashAttention's thread blocks, the FP8 casts, the backward kernels, the rank shapes tensor and context
parallelism give — and the model against a published table of measured H100 matmuls."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipeplan.hardware import load_hardware
from pipeplan.profiling.kernels import (
    Kernel,
    KernelRates,
    backward_kernels,
    fp8_cast_bytes,
    kernel_seconds,
    pass_kernels,
)

PEAK = 312e12  # A100 bf16 dense (datasheet)
RATES = KernelRates(gemm_flops_per_s=PEAK, attention_flops_per_s=PEAK, bytes_per_s=2e12, sm_count=108)
REUSE = replace(RATES, tile_reuse_half=79.0)  # small tiles run below the largest's rate (hardware.json's fit)
XLA_TABLE = Path(__file__).parents[1] / "data" / "xla_sm90_bf16_matmuls.txt"


def _linear(**fields) -> Kernel:
    base = dict(kind="gemm", m=8192, n=18432, k=6144, tp="n", cp="m", tokens="m", weight=True)
    return Kernel(**{**base, **fields})


def test_a_full_wave_runs_at_the_rate_and_a_partial_wave_costs_more_unless_stream_k_spreads_it():
    # 108 SMs: 12 x 9 tiles of 256 x 128 are exactly one wave (compute-bound at k = 16384)
    full = Kernel(kind="gemm", m=256 * 12, n=128 * 9, k=16384)
    assert kernel_seconds(full, REUSE) == pytest.approx(full.flops / PEAK)
    wider = Kernel(kind="gemm", m=256 * 12, n=128 * 10, k=16384)  # 120 large tiles: a second, mostly empty wave
    waves = wider.flops / kernel_seconds(wider, REUSE)
    assert waves < 0.85 * PEAK  # smaller tiles fill waves better but run below the largest tile's rate
    spread = wider.flops / kernel_seconds(wider, replace(REUSE, stream_k=True))
    assert waves < spread < PEAK and spread > 0.95 * PEAK  # stream-K: every SM an equal share of the k-steps
    free = wider.flops / kernel_seconds(wider, RATES)  # without the reuse term small tiles would be free
    assert free > waves


def test_small_tiles_run_below_the_largest_tiles_rate():
    """A tile's rate falls with its operand reuse r = tm·tn / (tm + tn), multiply-adds per loaded element: a
    64-row matmul's best tile here is 64 x 64 (108 tiles, one wave; k too short to split), at
    (1 + R / r_max) / (1 + R / r) of the largest tile's rate, r = 32."""
    skinny = Kernel(kind="gemm", m=64, n=64 * 108, k=384)
    factor = (1 + 79 / (128 * 256 / 384)) / (1 + 79 / 32)
    expected = 2.0 * 64 * 64 * 384 / (PEAK * factor / 108)
    assert kernel_seconds(skinny, replace(REUSE, bytes_per_s=1e30)) == pytest.approx(expected)
    assert factor < 0.6


def test_small_k_runs_below_the_rate_by_its_exposed_epilogue():
    """A tile's output write (b bytes per element at the SM's share of the memory rate: b·R / (2·BW) steps of k)
    shows for `epilogue_exposed` of its time: a full wave at depth k runs at k / (k + k0) of the rate, rising with
    k; a weight gradient accumulating into an fp32 buffer reads and writes 8 bytes per element, 4x the steps."""
    rates = replace(REUSE, epilogue_exposed=0.73)
    k0 = 0.73 * 2 * PEAK / (2 * 2e12)  # a bf16 result: 2 bytes per element
    achieved = []
    for k in (256, 1024, 4096, 16384):
        full = Kernel(kind="gemm", m=256 * 12, n=128 * 9, k=k, element_bytes=2)
        achieved.append(full.flops / kernel_seconds(full, rates))
        assert achieved[-1] == pytest.approx(PEAK * k / (k + k0))
    assert achieved == sorted(achieved)
    wgrad = Kernel(kind="gemm", m=256 * 12, n=128 * 9, k=2048, accumulates=True)
    fp32 = replace(rates, grad_bytes=4)
    assert wgrad.flops / kernel_seconds(wgrad, fp32) == pytest.approx(PEAK * 2048 / (2048 + 4 * k0))
    assert kernel_seconds(wgrad, rates) == kernel_seconds(replace(wgrad, accumulates=False), rates)  # eager: written


def test_skinny_outputs_split_k_and_each_kernel_pays_its_overhead():
    """4 tiles on 108 SMs: split-K cuts k into 16 slices (partial sums written and read back); a kernel of almost no
    work still takes gemm_overhead_s."""
    skinny = Kernel(kind="gemm", m=256, n=256, k=16384)
    one_wave = 2.0 * 128 * 256 * 16384 / (PEAK / 108)  # without split-K: 2 tiles of 128 x 256, one wave
    split = kernel_seconds(skinny, replace(REUSE, bytes_per_s=1e30))
    assert split < one_wave / 8
    tiny = Kernel(kind="gemm", m=16, n=16, k=16)
    assert kernel_seconds(tiny, replace(REUSE, gemm_overhead_s=5e-6)) == pytest.approx(
        kernel_seconds(tiny, REUSE) + 5e-6
    )


def test_the_h100_preset_reproduces_a_published_table_of_measured_matmuls():
    """XLA's table of measured bf16 matmuls on H100 (tests/data/xla_sm90_bf16_matmuls.txt, its source in the file):
    the kernel model with the h100 preset's shape terms at the table's own fitted level (0.93) is within 7% rms of
    all 125 and unbiased (mean within 2%) on the 45 large ones; the model before (one efficiency, three tile shapes,
    no per-kernel terms) was 24% too fast on those. The preset's level comes from normally distributed inputs (the
    table does not say what it multiplied; random inputs draw more power): 4-9% slower than the table."""
    h100 = load_hardware("h100")
    table_level, preset_level = _xla_errors(h100, 0.93), _xla_errors(h100, h100.matmul_efficiency)
    errors, large = table_level
    assert len(errors) == 125 and len(large) == 45
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.07
    assert abs(sum(large) / len(large)) < 0.02
    assert 0.04 < sum(preset_level[1]) / len(preset_level[1]) < 0.09


def _xla_errors(h100, efficiency: float) -> tuple[list[float], list[float]]:
    """log(model / measured) time of each table entry, and of the large ones."""
    rates = KernelRates(
        gemm_flops_per_s=h100.peak_bf16_flops * efficiency,
        attention_flops_per_s=h100.peak_bf16_flops,
        bytes_per_s=h100.memory_bytes_per_s(),
        sm_count=h100.sm_count,
        gemm_overhead_s=h100.gemm_overhead_s,
        epilogue_exposed=h100.epilogue_exposed,
        tile_reuse_half=h100.tile_reuse_half,
        stream_k=h100.stream_k,
    )
    rows = [line.split() for line in XLA_TABLE.read_text().splitlines() if line and not line.startswith("#")]
    errors, large = [], []
    for m, n, k, tflops in rows:
        kernel = Kernel(kind="gemm", m=int(m), n=int(n), k=int(k))
        errors.append(math.log(kernel_seconds(kernel, rates) * float(tflops) * 1e12 / kernel.flops))
        if int(m) * int(n) >= 2**20 and int(k) >= 1024:
            large.append(errors[-1])
    return errors, large


def test_skinny_shards_run_below_peak_and_without_sms_there_is_no_quantization():
    shard = _linear().on_rank(t=8)
    assert (shard.m, shard.n, shard.k) == (8192, 2304, 6144)
    achieved = shard.flops / kernel_seconds(shard, REUSE)
    assert achieved < 0.98 * PEAK  # no tile shape fills whole waves of 108 at the largest tile's rate
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


def test_fp8_runs_linears_at_the_fp8_rate_beside_transformer_engines_casts():
    fp8 = KernelRates(
        gemm_flops_per_s=PEAK, attention_flops_per_s=PEAK, bytes_per_s=2e12, sm_count=None, fp8_flops_per_s=2 * PEAK
    )

    def cast_s(kernel, per_element):  # bytes per element of the kernel's m x k operand
        return per_element * kernel.m * kernel.k / 2e12

    column, row = _linear(), _linear(tp="k")
    # a column-parallel linear's input is the norm's FP8 output (the norm kernel casts it): no cast of its own
    assert kernel_seconds(column, fp8) == pytest.approx(column.flops / (2 * PEAK))
    assert fp8_cast_bytes(column) == 0 and fp8_cast_bytes(row) == 3  # read 2 bytes, write 1
    assert kernel_seconds(row, fp8) == pytest.approx(row.flops / (2 * PEAK) + cast_s(row, 3))
    for forward in (column, row):
        (dgrad,) = backward_kernels(forward)["input_grad"]
        (wgrad,) = backward_kernels(forward)["weight_grad"]
        assert dgrad.output_grad and not wgrad.output_grad
        assert fp8_cast_bytes(dgrad) == 4  # the output gradient cast and transposed in one kernel: read 2, write 2
        assert fp8_cast_bytes(wgrad) == 2  # the saved FP8 input transposed: read 1, write 1
        assert kernel_seconds(dgrad, fp8) == pytest.approx(dgrad.flops / (2 * PEAK) + cast_s(dgrad, 4))
    # k and v read the input q read (one fused QKV linear in Transformer Engine): cast and transposed once
    shared = _linear(tp="k", shared_input=True)
    (shared_wgrad,) = backward_kernels(shared)["weight_grad"]
    (shared_dgrad,) = backward_kernels(shared)["input_grad"]
    assert fp8_cast_bytes(shared) == fp8_cast_bytes(shared_wgrad) == 0 and fp8_cast_bytes(shared_dgrad) == 4
    scores = Kernel(kind="gemm", m=2048, n=2048, k=128, batch=64)  # not a linear: stays in 16 bits, no cast
    assert kernel_seconds(scores, fp8) == pytest.approx(max(scores.flops / PEAK, scores.bytes / 2e12))
