"""The production kernels the analytic profiler runs on the meta device: fused RMSNorm and SwiGLU compute what the
unfused ops compute (their backward checked on the CPU in float64) and save what the fused kernels save;
FlashAttention with grouped-query attention saves the key/value heads only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.transformer_reference import llama_activation_bytes_per_layer

from pipeplan.graph.saved_tensors import SavedTensors
from pipeplan.models.llama import Block
from pipeplan.profiling.gpu_ops import GpuSemantics

SEQ, BATCH, HIDDEN, HEADS, KV_HEADS, FFN = 256, 2, 512, 8, 2, 1408


def _grads(fn, *inputs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return out.detach(), [leaf.grad for leaf in leaves]


def test_fused_rms_norm_and_swiglu_equal_the_unfused_ops():
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(4, 16, 32, generator=generator, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    plain = _grads(lambda a, w: F.rms_norm(a, (32,), w, 1e-6), x, weight)
    with GpuSemantics(attention="auto"):
        fused = _grads(lambda a, w: F.rms_norm(a, (32,), w, 1e-6), x, weight)
    torch.testing.assert_close(fused[0], plain[0])
    for got, want in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(got, want)
    gate, up = torch.randn(8, 32, generator=generator, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)
    plain = _grads(lambda g, u: F.silu(g) * u, gate, up)
    with GpuSemantics(attention="auto"):
        fused = _grads(lambda g, u: F.silu(g) * u, gate, up)
    torch.testing.assert_close(fused[0], plain[0])
    for got, want in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(got, want)


def test_a_llama_block_saves_what_the_fused_kernels_save():
    """RMSNorm input + rstd, q + the key/value heads, attention output, SwiGLU's gate and up and its output:
    (s·b)·(12h + 4h·g/a + 6F) bytes in bf16 (the research notes' derivation), plus the fp32 rstds and logsumexp."""
    with torch.device("meta"):
        block = Block(HIDDEN, HEADS, KV_HEADS, FFN, 1e-5, 10000.0).to(torch.bfloat16)
    x = torch.empty(BATCH, SEQ, HIDDEN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    saved = SavedTensors()
    with GpuSemantics(attention="auto"), saved:
        block(x)
    expected = llama_activation_bytes_per_layer(
        seq=SEQ, batch=BATCH, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=FFN
    )
    fp32_extras = 2 * 4 * SEQ * BATCH + 4 * BATCH * HEADS * SEQ  # two rstds, the logsumexp
    total = sum(saved.storage_bytes(exclude=list(block.parameters())).values())  # parameters are not activations
    assert total == pytest.approx(expected + fp32_extras, rel=0.02)
