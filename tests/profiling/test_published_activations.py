"""Analytic activation bytes per transformer block against the published formula, at a published shape: Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023), Table 2 / eqs. 1-2: with
16-bit activations and dropout, one layer saves s·b·h·(34 + 5·a·s/h) bytes without recomputation and s·b·h·34 with
selective recomputation (the s×s attention core recomputed). The shape is the paper's GPT-3 175B (Table 3:
h 12288, a 96, s 2048) at micro-batch 1. The numbers below are the paper's, computed here by hand — not pipeplan's
own formula helper — and the only differences allowed are ones a CUDA run really has on top, named one by one."""

from __future__ import annotations

import pytest

from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic

S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B (Korthikanti Table 3), micro-batch 1
NO_RECOMPUTE = S * B * H * (34 + 5 * A * S // H)  # 2,868,903,936 bytes per layer (Table 2, first row)
SELECTIVE = S * B * H * 34  # 855,638,016 bytes per layer (Table 2, selective recomputation)
NORM_STATS = 2 * 8 * S * B  # torch's layer_norm saves float32 mean and rstd per token, two norms per block
CAUSAL_MASK = S * S  # the math path's s×s bool causal mask (1 byte per element, not in the paper's count)


@pytest.fixture(scope="module")
def gpt3_block():
    """One GPT-3 175B block on meta (bf16 parameters and activations: no autocast weight copies)."""
    spec = load_model("gpt", dict(layers="1", hidden=str(H), heads=str(A), seq=str(S), vocab="51200", dropout="0.1"))
    profile = profile_analytic(spec, batch_size=B, hardware="h100", precision="bf16", attention="math")
    (block,) = [layer for layer in profile.layers if layer.name.startswith("blocks.")]
    return block


def test_gpt3_block_saves_korthikanti_table_2_bytes(gpt3_block):
    assert NO_RECOMPUTE == 2_868_903_936 and SELECTIVE == 855_638_016
    assert gpt3_block.activation_bytes == NO_RECOMPUTE + NORM_STATS + CAUSAL_MASK
    assert gpt3_block.selective_activation_bytes == SELECTIVE + NORM_STATS
    assert gpt3_block.full_activation_bytes == 2 * S * B * H  # full recomputation keeps the block's input only
