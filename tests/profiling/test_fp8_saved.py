"""FP8 activation memory against what Transformer Engine's autograd functions save (profiling/fp8_saved.py).

Counted by hand from TE 1.x (`_Linear.forward`: under FP8 `saved_inputmat` is the FP8 cast of the input, 1 byte per
element, never the 16-bit input; `_LayerNormLinear`: the 16-bit norm input and the FP8 `ln_out`), with q/k/v and
gate/up as Megatron-Core's fused linears (one cast each), and attention's output saved by the attention kernel
(16 bits) and cast again by the output projection. Units: s·b·h elements."""

from __future__ import annotations

import pytest
import torch

from pipeplan.models.gpt import Block as GptBlock
from pipeplan.models.llama import Block as LlamaBlock
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.layer_count import count_layer
from pipeplan.profiling.opcount import Roofline

SEQ, BATCH, HIDDEN, HEADS, KV_HEADS, FFN = 128, 2, 256, 4, 2, 640
SBH = SEQ * BATCH * HIDDEN


def _counts(block: torch.nn.Module, fp8: bool):
    x = torch.empty(BATCH, SEQ, HIDDEN, device="meta", dtype=torch.bfloat16)
    roofline = Roofline(flops_per_s=500e12, bytes_per_s=2e12)
    return count_layer(block, [x], roofline=roofline, attention="auto", fp8_linears=fp8)


def _meta(factory):
    with torch.device("meta"):
        return factory().to(torch.bfloat16)


def test_gpt_block_keeps_fp8_linear_inputs():
    """GPT block (LayerNorm, GELU MLP of 4h, dropout): qkv's input (ln1 out) 2 -> 1, proj's input (attention out)
    2 -> 2 + 1, fc's input (ln2 out) 2 -> 1, fc2's input (GELU out, 4h) 8 -> 4: 5 s·b·h fewer bytes. Kept until W
    (16-bit: ln1 in/out, attention out, ln2 in/out, GELU out = 18): ln1 in 2, its FP8 out 1, attention out's FP8
    copy 1 (its 16-bit self is attention's, freed with I), ln2 in 2, FP8 out 1, FP8 GELU out 4 = 11; both with the
    norms' fp32 mean and reciprocal deviation (2 norms x 2 x 4 bytes x s·b)."""
    stats = 2 * 2 * 4 * SEQ * BATCH
    bf16, fp8 = (_counts(_meta(lambda: GptBlock(HIDDEN, HEADS, 0.1)), flag) for flag in (False, True))
    assert bf16.saved_bytes - fp8.saved_bytes == 5 * SBH
    assert bf16.kept_until_weight_grad_bytes == 18 * SBH + stats
    assert fp8.kept_until_weight_grad_bytes == 11 * SBH + stats


def test_llama_block_shares_one_cast_per_fused_linear():
    """Llama block (RMSNorm, GQA, SwiGLU of FFN): q, k, v read one norm output (one FP8 copy: 2 -> 1), the output
    projection's input 2 -> 2 + 1, gate and up one copy (2 -> 1), down's input (FFN wide) 2 -> 1 per element."""
    make = lambda: LlamaBlock(HIDDEN, HEADS, KV_HEADS, FFN, 1e-5, 10000.0)  # noqa: E731
    bf16, fp8 = (_counts(_meta(make), flag) for flag in (False, True))
    ffn = SEQ * BATCH * FFN
    assert bf16.saved_bytes - fp8.saved_bytes == SBH + ffn
    # kept until W: the norm outputs 2 -> 1 each, attention out's 16 bits -> its FP8 copy, down's input 2 -> 1
    assert bf16.kept_until_weight_grad_bytes - fp8.kept_until_weight_grad_bytes == 3 * SBH + ffn


@pytest.mark.parametrize("precision", ["fp8", "bf16-main"])
def test_profile_records_the_fp8_saved_bytes(precision):
    """Through the analytic profiler: an fp8 profile's blocks keep the FP8 bytes, bf16-main's the 16-bit ones."""
    from pipeplan.models import load_model

    options = dict(layers=1, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=FFN, seq=SEQ, vocab=512)
    spec = load_model("llama", {k: str(v) for k, v in options.items()})
    profile = profile_analytic(spec, batch_size=BATCH, hardware="h100", precision=precision)
    block = next(layer for layer in profile.layers if layer.name.startswith("blocks."))
    reference = _counts(_meta(lambda: LlamaBlock(HIDDEN, HEADS, KV_HEADS, FFN, 1e-5, 10000.0)), precision == "fp8")
    assert block.activation_bytes == reference.saved_bytes


def test_the_lm_head_stays_out_of_fp8():
    """Megatron-Core's output layer is not a Transformer Engine module (torchtitan's float8 skips `output` too): an
    fp8 profile times and keeps the head as bf16-main's does, while its blocks run FP8."""
    from pipeplan.models import load_model

    options = dict(layers=1, hidden=1024, heads=8, kv_heads=2, intermediate=2816, seq=512, vocab=32000)
    spec = load_model("llama", {k: str(v) for k, v in options.items()})
    fp8, bf16 = (profile_analytic(spec, batch_size=2, hardware="h100", precision=p) for p in ("fp8", "bf16-main"))
    head, head16 = fp8.layers[-1], bf16.layers[-1]
    assert [k.fp8 for k in head.work.kernels if k.weight] == [False]
    assert all(k.fp8 for k in fp8.layers[1].work.kernels if k.weight)
    assert head.forward_ms == pytest.approx(head16.forward_ms) and head.backward_ms == pytest.approx(head16.backward_ms)
    assert head.activation_bytes == head16.activation_bytes
    assert fp8.layers[1].forward_ms < bf16.layers[1].forward_ms
