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


def test_a_float32_router_runs_as_megatrons_router_gating_and_splits_its_backward():
    """transformers' DeepSeek-V3 router, `F.linear(x.float(), w.float())` of a bf16 activation, under GpuSemantics
    (profiling.gpu_routing): the logits and both gradients equal the model's own float32 computation to bf16
    rounding; the bf16 input is saved, no float32 copy; and I computes the input gradient alone (one matmul), W the
    weight gradient alone (one matmul), as autograd splits a plain linear."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeplan.graph.split_backward import backward_input, backward_weight

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=generator).to(torch.bfloat16).requires_grad_(True)
    weight = torch.nn.Parameter(torch.randn(4, 16, generator=generator).to(torch.bfloat16))
    router = lambda a: F.linear((a * 2).float(), weight.float())  # noqa: E731  (a * 2: the norm before it)
    reference = router(x)
    grad = torch.randn(reference.shape, generator=generator)
    want = torch.autograd.grad(reference, (x, weight), grad)
    saved = SavedTensors()
    with GpuSemantics(attention="auto"), saved:
        logits = router(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference, rtol=2e-2, atol=2e-2)
    assert torch.float32 not in {t.dtype for t in saved.tensors}  # the bf16 input (and weight) only
    with Matmuls() as input_pass:
        (grad_x,), state = backward_input([logits], [grad], [x], [weight])
    assert input_pass.count == 1 and weight.grad is None
    with Matmuls() as weight_pass:
        backward_weight(state)
    assert weight_pass.count == 1
    torch.testing.assert_close(grad_x, want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weight.grad, want[1], rtol=2e-2, atol=2e-2)
