"""Analytic (meta-device) profiles against the standard transformer formulas (Korthikanti et al. 2022 activation
memory, Megatron-LM FLOPs), the I/W split, the GPU-equivalence corrections and the resource budget."""

from __future__ import annotations

import resource
import time

import pytest
import torch
import torch.nn.functional as F
from helpers.transformer_reference import (
    activation_bytes_per_layer,
    forward_flops_per_layer,
    lm_head_flops,
)
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.errors import ConfigError
from pipeplan.graph.saved_tensors import SavedTensors
from pipeplan.hardware import load_hardware
from pipeplan.models import load_model
from pipeplan.models.gpt import Block
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.gpu_ops import GpuSemantics
from pipeplan.profiling.kernels import pass_kernels
from pipeplan.profiling.layer_count import count_layer
from pipeplan.profiling.opcount import Roofline, split_parts
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.retime import pass_breakdown

SEQ, BATCH, HIDDEN, HEADS, VOCAB = 256, 2, 256, 4, 128


def _gpt(dropout=0.1, layers=2, seq=SEQ, hidden=HIDDEN, heads=HEADS):
    options = dict(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=VOCAB, dropout=dropout)
    return load_model("gpt", {k: str(v) for k, v in options.items()})


def _profile(spec, **kwargs):
    return profile_analytic(spec, **{"batch_size": BATCH, "hardware": "h100", "precision": "bf16-mixed", **kwargs})


def _blocks(profile):
    return [layer for layer in profile.layers if layer.name.startswith("blocks.")]


@pytest.fixture(scope="module")
def flash_profile():
    return _profile(_gpt(), attention="auto", precision="bf16")


@pytest.fixture(scope="module")
def math_profile():
    return _profile(_gpt(), attention="math", precision="bf16")


def _relative_error(value, reference):
    return abs(value - reference) / reference


@pytest.mark.parametrize("flash", [True, False])
def test_saved_bytes_per_block_match_34sbh_formula(flash, flash_profile, math_profile):
    profile = flash_profile if flash else math_profile
    expected = activation_bytes_per_layer(seq=SEQ, batch=BATCH, hidden=HIDDEN, heads=HEADS, flash_attention=flash)
    blocks = _blocks(profile)
    assert len(blocks) == 2
    for block in blocks:
        assert _relative_error(block.activation_bytes, expected) < 0.05, (block.activation_bytes, expected)
        assert block.activation_bytes >= expected  # only small float32 statistics come on top


def test_dropout_masks_count_one_byte_per_element(flash_profile):
    """Two dropouts per block (attention output, MLP output): 1-byte masks are exactly 2·s·b·h more."""
    without = _blocks(_profile(_gpt(dropout=0.0), precision="bf16"))[0].activation_bytes
    assert _blocks(flash_profile)[0].activation_bytes - without == 2 * SEQ * BATCH * HIDDEN


def test_math_attention_adds_5as2b(flash_profile, math_profile):
    extra = _blocks(math_profile)[0].activation_bytes - _blocks(flash_profile)[0].activation_bytes
    five_as2b = 5 * HEADS * SEQ**2 * BATCH
    assert _relative_error(extra, five_as2b) < 0.03
    # the rest: the math path's s×s bool causal mask, less flash's float32 logsumexp (and its rng state)
    assert abs(extra - five_as2b - SEQ**2 + 4 * HEADS * SEQ * BATCH) <= 64
    assert _blocks(math_profile)[0].forward_ms > _blocks(flash_profile)[0].forward_ms


def test_forward_flops_per_block_are_exact(flash_profile, math_profile):
    for profile, causal in ((flash_profile, True), (math_profile, False)):  # the math path computes masked scores
        expected = forward_flops_per_layer(seq=SEQ, batch=BATCH, hidden=HIDDEN, causal=causal)
        assert [block.flops for block in _blocks(profile)] == [expected, expected]
    head = flash_profile.layers[-1]
    assert head.name == "head" and head.flops == lm_head_flops(seq=SEQ, batch=BATCH, hidden=HIDDEN, vocab=VOCAB)
    assert flash_profile.layers[0].flops == 0  # embedding lookups do no matmuls


def _meta_block(dtype=torch.bfloat16, dropout=0.1):
    with torch.device("meta"):
        block = Block(HIDDEN, HEADS, dropout).to(dtype)
    return block, torch.empty(BATCH, SEQ, HIDDEN, device="meta", dtype=dtype)


def _roofline():
    return Roofline(flops_per_s=500e12, bytes_per_s=2e12)


@pytest.mark.parametrize("flash", [True, False])
def test_recorder_flops_equal_flop_counter_mode(flash):
    block, x = _meta_block()
    counts = count_layer(block, [x], roofline=_roofline(), attention="auto" if flash else "math")
    with GpuSemantics(attention="auto" if flash else "math"), FlopCounterMode(display=False) as counter:
        block(x.requires_grad_())
    assert counts.forward.flops == counter.get_total_flops()


def test_backward_split_weight_grads_are_the_linear_matmuls():
    block, x = _meta_block()
    counts = count_layer(block, [x], roofline=_roofline(), attention="auto")
    linear_flops = 24 * BATCH * SEQ * HIDDEN**2
    weight_grad_flops = counts.backward.flops - counts.input_grad.flops
    assert weight_grad_flops == linear_flops  # W = one mat1ᵀ @ grad per Linear, same size as its forward
    attention_forward = counts.forward.flops - linear_flops
    assert counts.input_grad.flops - linear_flops >= 2 * attention_forward  # dq, dk, dv, dp (+ recompute)
    work = counts.work()
    assert 0 < work.rest_weight_grad_ms < work.rest_backward_ms
    split_total = work.rest_input_grad_ms + work.rest_weight_grad_ms
    assert work.rest_backward_ms <= split_total < 1.1 * work.rest_backward_ms  # layer norms run as 2 kernels


@pytest.mark.parametrize("flash", [True, False])
def test_backward_kernels_follow_from_the_forwards(flash):
    """The kernels each pass is timed with (derived from the forward's) do the FLOPs the recorded matmuls and
    attention calls of that pass do; the linears' roles alternate column, row as Megatron splits a block."""
    block, x = _meta_block()
    counts = count_layer(block, [x], roofline=_roofline(), attention="auto" if flash else "math")
    kernels = counts.kernels
    attention = sum(k.flops for k in kernels if k.kind == "attention")  # causal: half of what torch counts
    assert all(k.causal for k in kernels if k.kind == "attention") and (attention > 0) == flash
    assert sum(k.flops for k in pass_kernels(kernels, "forward")) + attention == counts.forward.kernel_flops
    derived_i = sum(k.flops for k in pass_kernels(kernels, "input_grad"))
    derived_w = sum(k.flops for k in pass_kernels(kernels, "weight_grad"))
    assert derived_w == pytest.approx(counts.backward.kernel_flops - counts.input_grad.kernel_flops)
    if not flash:  # FlashAttention's backward is 2.5x its forward in time; torch counts its FLOPs as 2x
        assert derived_i == pytest.approx(counts.input_grad.kernel_flops)
    linears = [k.tp for k in kernels if k.weight]
    assert linears == ["n", "k", "n", "k"]  # qkv and fc column-parallel, proj and the MLP's output row-parallel
    assert all(k.tp == "b" for k in kernels if not k.weight)  # attention split by heads


def test_kept_until_weight_grad_holds_linear_and_norm_inputs():
    """Kept for W: inputs of ln1, qkv, proj, ln2, fc (2·s·b·h each) and of the MLP's second Linear (8·s·b·h)."""
    block, x = _meta_block()
    counts = count_layer(block, [x], roofline=_roofline(), attention="auto")
    sbh = SEQ * BATCH * HIDDEN
    assert _relative_error(counts.kept_until_weight_grad_bytes, 18 * sbh) < 0.01
    freed = counts.saved_bytes - counts.kept_until_weight_grad_bytes
    assert _relative_error(freed, 16 * sbh) < 0.01  # q/k/v 6, GELU input 8, two dropout masks 2


def test_fused_backward_kernels_are_split_for_weight_grads():
    conv = torch.nn.Conv2d(8, 16, 3, padding=1, device="meta", dtype=torch.bfloat16)
    x = torch.empty(4, 8, 32, 32, device="meta", dtype=torch.bfloat16)
    roofline = Roofline(flops_per_s=1e12, bytes_per_s=1e15)  # compute-bound: times are FLOPs
    counts = count_layer(conv, [x], roofline=roofline)
    conv_flops = 2 * 4 * 16 * 32 * 32 * 8 * 9
    assert counts.forward.flops == conv_flops
    assert counts.input_grad.flops == conv_flops and counts.backward.flops == 2 * conv_flops
    assert counts.work().rest_weight_grad_ms == pytest.approx(conv_flops / 1e12 * 1e3)  # convolutions stay rest
    parts = split_parts(
        torch.ops.aten.native_layer_norm_backward.default,
        *_layer_norm_backward_call(),
    )
    assert len(parts) == 2 and parts[0][1] > 0 and parts[1][1] > 0


def _layer_norm_backward_call():
    x = torch.empty(64, 32, device="meta")
    weight, bias = torch.empty(32, device="meta"), torch.empty(32, device="meta")
    mean, rstd = torch.empty(64, 1, device="meta"), torch.empty(64, 1, device="meta")
    args = (x, x, [32], mean, rstd, weight, bias, [True, True, True])
    out = torch.ops.aten.native_layer_norm_backward.default(*args)
    return args, {}, out


def test_dropout_correction_saves_a_bool_mask():
    x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with GpuSemantics(attention="auto"), SavedTensors() as saved:
        F.dropout(x, 0.1, training=True)
    assert [t.dtype for t in saved.tensors] == [torch.bool]
    with GpuSemantics(attention="auto"), SavedTensors() as saved:
        F.dropout(x, 0.1, training=False)
    assert saved.tensors == []


def test_times_follow_the_roofline(flash_profile):
    h100 = load_hardware("h100")
    block = _blocks(flash_profile)[0]
    matmul_floor_ms = block.flops / (h100.peak_bf16_flops * h100.matmul_efficiency) * 1e3
    assert block.forward_ms >= matmul_floor_ms
    assert block.backward_ms <= block.input_grad_ms + block.weight_grad_ms
    embed = flash_profile.layers[0]
    assert embed.input_grad_ms == 0 and embed.weight_grad_ms == embed.backward_ms > 0  # token ids: W only
    base = _profile(_gpt(), precision="bf16")
    low = _profile(_gpt(), precision="bf16", matmul_efficiency=0.1, memory_efficiency=0.1)
    fast, slow = (pass_breakdown(_blocks(p)[0].work, p.provenance.kernel_rates, "forward") for p in (base, low))
    assert slow.memory == pytest.approx(fast.memory * h100.memory_efficiency / 0.1)  # bytes over the memory rate
    assert slow.launch == fast.launch > 0  # launches do not depend on the rates
    overhead = h100.gemm_overhead_s * 1e3 * sum(k.kind == "gemm" and not k.core for k in _blocks(base)[0].work.kernels)
    assert slow.gemm - overhead == pytest.approx((fast.gemm - overhead) * h100.matmul_efficiency / 0.1, rel=0.05)
    faster = _blocks(_profile(_gpt(), hardware="b200", precision="bf16"))[0]  # as flash_profile
    assert faster.forward_ms < block.forward_ms and faster.flops == block.flops


def test_profile_metadata_cuts_and_round_trip(flash_profile, tmp_path):
    profile = flash_profile
    assert [layer.name for layer in profile.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    assert profile.cut_bytes == (SEQ * BATCH * HIDDEN * 2,) * 3  # one bf16 hidden state per cut
    assert profile.input_bytes == SEQ * BATCH * 8
    block = _blocks(profile)[0]
    assert block.param_count == 12 * HIDDEN**2 + 13 * HIDDEN and block.param_bytes == 2 * block.param_count
    assert block.output_bytes == SEQ * BATCH * HIDDEN * 2
    prov = profile.provenance
    assert (prov.source, prov.device, prov.hardware, prov.dtype, prov.batch_size) == (
        "analytic",
        "meta",
        "h100",
        "bfloat16",
        BATCH,
    )
    assert prov.graph_fingerprint and prov.tokens_per_sample == SEQ and prov.model_options["dropout"] == 0.1
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_float32_profile_doubles_bytes():
    spec = _gpt(dropout=0.0, layers=1)
    half, full = _profile(spec, precision="bf16"), _profile(spec, precision="fp32", model_ref="mine", model_options={})
    assert half.provenance.dtype == "bfloat16" and full.provenance.dtype == "float32"
    assert (half.provenance.precision, full.provenance.precision) == ("bf16", "fp32")
    assert full.provenance.model == "mine" and full.provenance.model_options == {}
    assert half.provenance.model == "gpt" and "tf32" in full.provenance.notes
    assert full.cut_bytes[0] == 2 * half.cut_bytes[0]
    assert full.layers[1].param_bytes == 2 * half.layers[1].param_bytes
    assert full.layers[1].flops == half.layers[1].flops


def test_bf16_mixed_profile_counts_what_cuda_autocast_keeps():
    """Under CUDA's autocast the parameters and gradients stay fp32, the residual stream (embedding output + bf16
    block outputs) is fp32, so each LayerNorm saves its input in fp32 (layer_norm is on autocast's fp32 list) while
    the matmuls run and save in bf16 (their inputs cast), and each forward's bf16 weight copies are saved for the
    backward (biases are cast too, but addmm's backward does not keep them)."""
    spec = _gpt(dropout=0.0, layers=1)
    mixed, pure = _profile(spec), _profile(spec, precision="bf16")
    assert (mixed.provenance.precision, mixed.provenance.dtype) == ("bf16-mixed", "bfloat16")
    assert mixed.layers[1].param_bytes == 4 * mixed.layers[1].param_count == 2 * pure.layers[1].param_bytes
    assert mixed.cut_bytes == tuple(2 * b for b in pure.cut_bytes)
    block = mixed.layers[1]
    weights = sum(p.numel() for n, p in spec.build().named_parameters() if n.startswith("blocks.0.") and "weight" in n)
    norms = 2 * HIDDEN  # ln1.weight, ln2.weight
    layer_norm_inputs = 2 * BATCH * SEQ * HIDDEN  # ln1's and ln2's inputs: 2 more bytes per element each
    assert block.activation_bytes - pure.layers[1].activation_bytes == 2 * layer_norm_inputs + 2 * (weights - norms)
    assert block.activation_freed_by_input_grad_bytes == pure.layers[1].activation_freed_by_input_grad_bytes
    # the same FLOPs; more time: autocast's casts (weights each forward, fp32 <-> bf16 activations) are memory traffic
    assert block.flops == pure.layers[1].flops and block.forward_ms > pure.layers[1].forward_ms
    # the head: its LayerNorm's input in fp32, its weight's bf16 copy, and the loss in fp32 (under bf16 in bf16):
    # log-softmax's b*s*V values and nll_loss's scalar total weight at 4 bytes instead of 2
    head, tokens = mixed.layers[-1], BATCH * SEQ
    more = 2 * tokens * HIDDEN + 2 * HIDDEN * VOCAB + 2 * tokens * VOCAB + 2
    assert head.activation_bytes - pure.layers[-1].activation_bytes == more


def test_llama_profile_with_grouped_query_attention():
    options = dict(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=512, seq=128, vocab=96)
    spec = load_model("llama", {k: str(v) for k, v in options.items()})
    profile = profile_analytic(spec, batch_size=1, hardware="a100-80gb", precision="bf16-mixed")
    block = profile.layers[1]
    assert block.name == "blocks.0"
    s, h = 128, 256
    kv = 2 * 32  # kv heads × head dim
    linear_flops = 2 * s * h * (h + 2 * kv + h) + 3 * 2 * s * h * 512
    assert block.flops == linear_flops + 4 * s * s * h // 2  # causal: FlashAttention skips the masked half
    assert block.param_count == 2 * h + h * (h + 2 * kv + h) + 3 * h * 512
    assert 0 < block.activation_freed_by_input_grad_bytes < block.activation_bytes
    # q, k and v read one input, as gate and up do: the FP8 recipe casts it once (profiling.kernels.fp8_cast_bytes)
    linears = [k for k in block.work.kernels if k.weight]
    assert [k.shared_input for k in linears] == [False, True, True, False, False, True, False]


def test_large_model_profile_fits_time_and_memory_budget():
    """The 6.7B shape (32 layers, hidden 4096, seq 2048): < 30 s, < 2 GiB peak RSS (timings: bench_analytic.py)."""
    spec = load_model("gpt", dict(layers="32", hidden="4096", heads="32", seq="2048", vocab="50257", dropout="0.1"))
    start = time.perf_counter()
    profile = profile_analytic(spec, batch_size=1, hardware="h100", precision="bf16")  # 34sbh: no weight copies
    elapsed = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    assert sum(layer.param_count for layer in profile.layers) > 6.7e9
    assert elapsed < 30 and peak_rss < 2 * 2**30, (elapsed, peak_rss)
    expected = activation_bytes_per_layer(seq=2048, batch=1, hidden=4096, heads=32, flash_attention=True)
    assert _relative_error(_blocks(profile)[0].activation_bytes, expected) < 0.05


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="int8"), "--precision 'int8'"),
        (dict(matmul_efficiency=1.5), "--matmul-efficiency"),
        (dict(memory_efficiency=0.0), "--memory-efficiency"),
        (dict(hardware="v100"), "unknown --hardware"),
        (dict(batch_size=0), "--batch-size"),
    ],
)
def test_bad_options_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _profile(_gpt(layers=1), **kwargs)


def test_formula_helpers():
    assert activation_bytes_per_layer(seq=2048, batch=1, hidden=4096, heads=32, flash_attention=True) == (
        34 * 2048 * 4096
    )
    assert activation_bytes_per_layer(seq=2, batch=3, hidden=4, heads=5, flash_attention=False) == 34 * 24 + 300
    assert forward_flops_per_layer(seq=2, batch=1, hidden=3) == 24 * 2 * 9 + 4 * 4 * 3
    with pytest.raises(ConfigError, match="seq must be >= 1"):
        activation_bytes_per_layer(seq=0, batch=1, hidden=1, heads=1, flash_attention=True)
