"""The attention kernel as a profile fact (`--attention auto|flash|math`, issues 34 and 35): each
scaled_dot_product_attention call runs as the kernel a GPU would run it with — FlashAttention without a mask,
memory-efficient attention with one (or with a value head size of its own, as MLA's) — or as the math path; the
profile records what ran, the plan carries it, `show` says it; a measured profile refuses the option."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.cli import one_error_line
from torch import nn
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.errors import ConfigError
from pipeplan.hardware import load_hardware
from pipeplan.models import load_model
from pipeplan.models.spec import ModelSpec
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.kernels import kernel_seconds
from pipeplan.profiling.retime import pass_breakdown

runner = CliRunner()
SEQ, HEADS, HEAD = 32, 4, 8
GPT = ["gpt", "-a", "layers=2", "-a", "hidden=32", "-a", "heads=4", "-a", f"seq={SEQ}", "-a", "vocab=64"]


class _Attention(nn.Module):
    """Attention over 4 heads with a mask (`masked`), grouped key/value heads (`kv`), or values of their own head
    size (`value`)."""

    def __init__(self, masked: bool, kv: int = HEADS, value: int = HEAD) -> None:
        super().__init__()
        self.masked, self.kv, self.value = masked, kv, value
        self.q = nn.Linear(HEADS * HEAD, HEADS * HEAD)
        self.kv_proj = nn.Linear(HEADS * HEAD, kv * (HEAD + value))
        self.o = nn.Linear(HEADS * value, HEADS * HEAD)
        self.register_buffer("mask", torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (HEADS, HEAD)).transpose(1, 2)
        k, v = self.kv_proj(x).unflatten(-1, (self.kv, -1)).transpose(1, 2).split((HEAD, self.value), dim=-1)
        grouped = self.kv != HEADS
        if self.masked:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=grouped)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.o(y.transpose(1, 2).flatten(-2))


class _Model(nn.Module):
    def __init__(self, **attention) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, HEADS * HEAD)
        self.blocks = nn.ModuleList(_Attention(**attention) for _ in range(2))
        self.head = nn.Linear(HEADS * HEAD, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _profile(attention: str = "auto", **shape):
    spec = ModelSpec(
        name="attention",
        build=lambda: _Model(**shape),
        sample_batch=lambda b, generator=None: (
            (torch.randint(0, 64, (b, SEQ), generator=generator),),
            torch.randint(0, 64, (b, SEQ), generator=generator),
        ),
        loss_fn=lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()),
        tokens_per_sample=SEQ,
    )
    return profile_analytic(spec, batch_size=2, hardware="h100", precision="bf16", attention=attention)


def _core(profile):
    return [k for k in profile.layers[1].work.kernels if k.kind == "attention"]


def test_each_call_runs_as_the_kernel_a_gpu_gives_it():
    flash, masked = _profile(masked=False), _profile(masked=True)
    assert flash.provenance.attention == "flash" and masked.provenance.attention == "memory-efficient"
    (causal,), (full,) = _core(flash), _core(masked)
    assert causal.causal and not full.causal and full.flops == 2 * causal.flops  # the mask is not exploited
    for profile in (flash, masked):  # fused kernels save no s x s tensor: selective has nothing to drop
        assert all(la.selective_activation_bytes == la.activation_bytes for la in profile.layers)
    bias = 2 * SEQ * SEQ  # the boolean mask turned into a bf16 additive bias, saved with q, k, v
    assert masked.layers[1].activation_bytes - flash.layers[1].activation_bytes == pytest.approx(bias, abs=16)
    assert _profile(masked=True, kv=2).provenance.attention == "math"  # mask and grouped heads: PyTorch's math path
    mla = _profile(masked=False, value=4)  # values of their own head size (MLA): memory-efficient, causal
    (kernel,) = _core(mla)
    assert mla.provenance.attention == "memory-efficient" and kernel.causal and kernel.k == (HEAD + 4) // 2


def test_math_keeps_the_scores_and_flash_refuses_attention_written_by_hand():
    math = _profile("math", masked=False)
    assert math.provenance.attention == "math" and "--attention math" in math.provenance.notes
    block = math.layers[1]
    probabilities = 2 * HEADS * SEQ * SEQ * 2  # bf16 softmax output of 4 heads x 2 samples (no dropout)
    assert block.activation_bytes - block.selective_activation_bytes == probabilities + SEQ * SEQ  # + causal mask
    assert _profile("flash", masked=False).provenance.attention == "flash"
    spec = load_model("gpt", {"layers": "1", "hidden": "32", "heads": "4", "seq": "16", "vocab": "64"})
    assert profile_analytic(spec, batch_size=1, hardware="h100", precision="bf16").provenance.attention == "flash"
    with pytest.raises(ConfigError, match="--attention must be one of"):
        _profile("fast", masked=False)


def test_flash2_is_the_same_kernel_timed_at_flashattention_2s_rate():
    """`--attention flash2`: the FlashAttention call of `flash`, recorded as flash2, its kernels at the preset's
    flash2_attention_efficiency (H100: 0.31 against FlashAttention-3's 0.58); the matmuls and the bytes unchanged.
    Where a preset gives no FlashAttention-2 figure (A100: FlashAttention-2 is its attention_efficiency), the same."""
    flash, flash2 = _profile("flash", masked=False), _profile("flash2", masked=False)
    assert flash2.provenance.attention == "flash2" and "--attention flash2" in flash2.provenance.notes
    assert [la.activation_bytes for la in flash2.layers] == [la.activation_bytes for la in flash.layers]
    rates, rates2 = flash.provenance.kernel_rates, flash2.provenance.kernel_rates
    assert rates2.attention_flops_per_s / rates.attention_flops_per_s == pytest.approx(0.31 / 0.58)
    assert rates2.gemm_flops_per_s == rates.gemm_flops_per_s
    for name in ("forward", "input_grad"):
        part = pass_breakdown(flash.layers[1].work, rates, name)
        part2 = pass_breakdown(flash2.layers[1].work, rates2, name)
        assert part2.attention > part.attention > 0 and part2.gemm == pytest.approx(part.gemm)
    for kernel in _core(flash):  # each kernel's work (beyond its launch) at 0.58 / 0.31 of the time
        work, work2 = (kernel_seconds(kernel, r) - r.gemm_overhead_s for r in (rates, rates2))
        assert work2 == pytest.approx(work * 0.58 / 0.31)
    a100 = load_hardware("a100-80gb")
    assert a100.attention_flops_per_s(torch.bfloat16, flash2=True) == a100.attention_flops_per_s(torch.bfloat16)


def test_attention_is_recorded_in_the_plan_and_shown(tmp_path):
    out = tmp_path / "plan"
    args = ["plan", *GPT, "--device", "meta", "--hardware", "h100", "-n", "2", "-B", "4", "--attention", "math"]
    result = runner.invoke(app, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["training"]["attention"] == "math"
    shown = runner.invoke(app, ["show", str(out / "plan.json")])
    assert shown.exit_code == 0 and "math attention" in shown.output
    profile = runner.invoke(app, ["profile", *GPT, "--device", "meta", "--hardware", "h100", "--json"])
    assert json.loads(profile.stdout)["provenance"]["attention"] == "flash"


def test_measured_profiles_refuse_the_option():
    line = one_error_line(runner.invoke(app, ["profile", *GPT, "--attention", "math"]))
    assert "--attention math is for analytic profiles" in line
    line = one_error_line(runner.invoke(app, ["plan", *GPT, "--attention", "flash", "-n", "2"]))
    assert "--attention flash is for analytic profiles" in line
    line = one_error_line(runner.invoke(app, ["capacity", *GPT, "--hardware", "h100", "-n", "8", "--attention", "x"]))
    assert "--attention must be one of auto, flash, flash2, math" in line
