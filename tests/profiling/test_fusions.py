"""Norms and activations written out op by op are counted as the kernels the built-ins call (profiling/fusions.py):
a hand-written RMSNorm (weight or 1 + weight) saves what F.rms_norm's fused kernel saves, GPT-2's tanh-formula GELU
what F.gelu saves; a module that only looks like one (a scale, a quick-GELU) is left as written."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec
from pipeplan.profiling.analytic import profile_analytic

WIDTH, SEQ = 64, 16


class _RMSNorm(nn.Module):
    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(WIDTH) if offset else torch.ones(WIDTH))
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (self.offset + self.weight.float())).type_as(x)


class _FusedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (WIDTH,), self.weight, 1e-6)


class _Scale(nn.Module):  # one weight, but no normalization
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight).type_as(x)


class _TanhGelu(nn.Module):  # GPT-2's NewGELUActivation
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class _QuickGelu(nn.Module):  # x * sigmoid(1.702 x): not GELU to float32 rounding
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class _Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class _Halves(nn.Module):  # no weight, its output half as wide as its input (as attention's q, k, v -> out)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (2, -1)).sum(-2)


class _Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.halves = _Halves()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.halves(torch.cat([x, x], -1))


class _Block(nn.Module):
    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.part = part
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.part(x))


class _Model(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.blocks = nn.ModuleList(_Block(make()) for _ in range(2))
        self.head = nn.Linear(WIDTH, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _block_saved(make, tracer: str = "fx") -> int:
    spec = ModelSpec(
        name="fusion",
        build=lambda: _Model(make),
        sample_batch=lambda b, generator=None: (
            (torch.randint(0, 32, (b, SEQ), generator=generator),),
            torch.randint(0, 32, (b, SEQ), generator=generator),
        ),
        loss_fn=lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()),
    )
    profile = profile_analytic(spec, batch_size=2, hardware="h100", precision="bf16", tracer=tracer)
    return profile.layers[1].activation_bytes


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_hand_written_rmsnorm_saves_what_the_fused_kernel_saves(tracer):
    fused = _block_saved(_FusedNorm, tracer)
    assert _block_saved(_RMSNorm, tracer) == fused
    assert _block_saved(lambda: _RMSNorm(offset=1.0), tracer) == fused  # Gemma's (1 + weight)
    assert _block_saved(_Scale, tracer) > fused  # not a norm: its float32 copy stays saved


def test_hand_written_gelu_is_counted_as_the_gelu_kernel_and_quick_gelu_is_not():
    kernel = _block_saved(_Gelu)
    assert _block_saved(_TanhGelu) == kernel
    assert _block_saved(_QuickGelu) > kernel


def test_a_region_whose_output_is_not_its_inputs_shape_is_left_as_written():
    """The probe feeds a region an input as wide as its output: a region that changes the width (here both ways;
    attention's, from q, k, v together to its output, at GPT-3 22B's width) gives a result of another shape, which is
    no activation (it used to raise from the comparison)."""
    assert _block_saved(_Doubled) == _block_saved(_Doubled, "export") > 0
