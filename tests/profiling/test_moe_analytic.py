"""Analytic profiles of mixture-of-experts layers against hand counts: parameters (all experts held), active
parameters and forward FLOPs per token (router, shared experts on every token, top_k routed experts), the grouped
expert matmuls' kernel time (balanced routing), and DeepSeek-V3's published 671B total / 37B active."""

from __future__ import annotations

import math

import pytest

from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.experts import active_param_count, is_moe
from pipeplan.profiling.kernels import Kernel, KernelRates, kernel_seconds

SEQ, BATCH = 32, 2


def _moe_profile(**options):
    spec = load_model("moe", {key: str(value) for key, value in options.items()})
    return profile_analytic(spec, batch_size=BATCH, hardware="h100", precision="bf16")


def _hand(h=64, heads=4, kv=2, experts=4, top_k=2, f=32, shared=1):
    """(parameters, active parameters, forward FLOPs per token at SEQ) of one MoE block of the `moe` model."""
    head_dim = h // heads
    attention = 2 * h * h + 2 * h * kv * head_dim
    router, expert = h * experts, 3 * h * f
    params = attention + router + (experts + shared) * expert + 2 * h  # + two RMSNorm weights
    active = params - (experts - top_k) * expert
    core = 4 * heads * head_dim * (SEQ + 1) / 2  # causal attention: each query reads (i + 1) keys on average
    flops = 2 * (attention + router + (top_k + shared) * expert) + core
    return params, active, flops, experts * expert


def test_moe_block_counts_match_hand_formulas():
    profile = _moe_profile()
    assert is_moe(profile)
    params, active, flops, routed = _hand()
    block = profile.layers[2]  # blocks.1: the first MoE block (blocks.0 is dense)
    assert block.param_count == params and block.expert_param_count == routed
    assert block.flops / (BATCH * SEQ) == pytest.approx(flops, rel=0.02)
    dense = sum(layer.param_count for layer in profile.layers) - 3 * params
    assert active_param_count(profile) == pytest.approx(dense + 3 * active)
    assert profile.layers[1].expert_param_count == 0


def test_routed_experts_are_one_grouped_matmul_of_balanced_tokens_per_expert():
    profile = _moe_profile(experts=8, top_k=2)
    grouped = [k for k in profile.layers[2].work.kernels if k.experts]
    assert [(k.batch, k.m) for k in grouped] == [(8, BATCH * SEQ * 2 // 8)] * 2  # gate_up, down


def test_deepseek_v3_shapes_reproduce_published_total_and_active_parameters():
    """Two MoE layers of DeepSeek-V3's shapes, profiled, extrapolated to its 3 dense + 58 MoE layers: 671B total and
    37B active (its report, §4.2). The MHA stand-in for MLA adds 18M per layer (205M vs 187M): +1.1B."""
    shapes = dict(layers=5, hidden=7168, heads=128, kv_heads=128, vocab=129280, seq=4096, gate="sigmoid")
    experts = dict(experts=256, top_k=8, expert_intermediate=2048, shared_experts=1)
    options = dict(**shapes, **experts, dense_layers=3, intermediate=18432)
    spec = load_model("moe", {key: str(value) for key, value in options.items()})
    profile = profile_analytic(spec, batch_size=1, hardware="h100", precision="fp8")
    embed, dense, moe, head = profile.layers[0], profile.layers[1], profile.layers[4], profile.layers[-1]
    total = embed.param_count + head.param_count + 3 * dense.param_count + 58 * moe.param_count
    assert total == pytest.approx(671e9, rel=0.01)
    share = 8 / 256
    active_moe = moe.param_count - moe.expert_param_count * (1 - share)
    active = embed.param_count + head.param_count + 3 * dense.param_count + 58 * active_moe
    assert active == pytest.approx(37e9, rel=0.05)  # 38.7B: the MHA stand-in and the untied embedding
    assert active_param_count(profile) == pytest.approx(
        embed.param_count + head.param_count + 3 * dense.param_count + 2 * active_moe
    )


def test_grouped_expert_kernel_quantizes_tiles_per_expert_and_shares_waves():
    rates = KernelRates(gemm_flops_per_s=132e12, attention_flops_per_s=132e12, bytes_per_s=3e12, sm_count=132)
    kernel = Kernel(kind="gemm", m=100, n=256, k=4096, batch=64, tp="n", cp="m", tokens="m", weight=True, experts=True)
    # per expert: 100 rows padded to one 128-row tile, 256 columns two 128-wide ones: 128 tiles in all, one wave of
    # 132 SMs, each tile 2 * 128 * 128 * 4096 FLOPs at 1 TFLOP/s per SM (128 x 256 tiles: 64, one wave twice as long)
    assert kernel_seconds(kernel, rates) == pytest.approx(2 * 128 * 128 * 4096 / 1e12)
    on_rank = kernel.on_rank(ep=8, batch_scale=2)  # 8 experts per rank, each on the tokens of 8 ranks x 2
    assert (on_rank.batch, on_rank.m, on_rank.n) == (8, 1600, 256)
    tiles = 8 * math.ceil(1600 / 128) * 2  # 128 x 128 tiles: 208 tiles, 2 waves
    assert kernel_seconds(on_rank, rates) <= math.ceil(tiles / 132) * 2 * 128 * 128 * 4096 / 1e12
    assert on_rank.flops == pytest.approx(kernel.flops * 2)  # ep moves work between ranks, it adds none
