"""The built-in mixture-of-experts model: its index-based dispatch against a per-token reference, the grouped
(balanced) expert path against the per-expert one, and the presets' published parameter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeplan.errors import ModelError
from pipeplan.models import load_model
from pipeplan.models.moe import MoE


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: gate scores, top-k, each chosen expert's SwiGLU weighted, plus the shared experts."""
    out = torch.zeros_like(x)
    for i, token in enumerate(x):
        logits = moe.router(token).float()
        scores = logits.softmax(-1) if moe.gate_fn == "softmax" else logits.sigmoid()
        weights, chosen = scores.topk(moe.top_k)
        if moe.normalize:
            weights = weights / weights.sum()
        for w, e in zip(weights * moe.scale, chosen.tolist(), strict=True):
            gate, up = (token @ moe.experts.gate_up[e]).split(moe.experts.ffn)
            out[i] += w.to(x.dtype) * ((F.silu(gate) * up) @ moe.experts.down[e])
        if moe.shared is not None:
            out[i] += moe.shared(token)
    return out


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_moe_dispatch_equals_per_token_reference(gate):
    torch.manual_seed(0)
    moe = MoE(hidden=16, experts=5, top_k=2, ffn=8, shared=1, gate=gate, normalize=gate == "sigmoid", scale=1.5)
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(moe(x), _reference(moe, x.reshape(-1, 16)).reshape(x.shape))


def test_grouped_expert_path_equals_per_expert_path():
    torch.manual_seed(0)
    moe = MoE(hidden=16, experts=4, top_k=2, ffn=8, shared=0, gate="softmax", normalize=True, scale=1.0)
    routed = torch.randn(12, 16)
    grouped = moe.experts(routed, [3, 3, 3, 3])  # one batched matmul
    per_expert = torch.cat([moe.experts(routed[:3], [3, 0, 0, 0])] + [moe.experts(routed[3:], [0, 3, 3, 3])])
    torch.testing.assert_close(grouped, per_expert)


def test_moe_model_trains_and_builds_on_meta():
    spec = load_model("moe")
    torch.manual_seed(0)
    model = spec.build()
    (tokens,), target = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    loss = spec.loss_fn(model(tokens), target)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.blocks[1].mlp.router.weight.grad is not None and model.blocks[1].mlp.experts.down.grad is not None
    with torch.device("meta"):
        assert load_model("moe").build()(tokens.to("meta")).shape == (2, 32, 256)


# Mixtral 8x7B: 46.7B (Jiang et al. 2024); DeepSeek-V3: 671B without its multi-token-prediction module (its report,
# Table 1 / §4.2), with its multi-head latent attention (187M parameters per layer).
@pytest.mark.parametrize(("name", "published"), [("mixtral-8x7b", 46.7e9), ("deepseek-v3", 671e9)])
def test_moe_presets_match_published_parameter_counts(name, published):
    with torch.device("meta"):
        count = sum(p.numel() for p in load_model(name).build().parameters())
    assert abs(count - published) / published < 0.01, f"{name}: {count:,}"


def test_moe_options_are_checked():
    with pytest.raises(ModelError, match="top_k"):
        load_model("moe", {"top_k": 5})
    with pytest.raises(ModelError, match="gate"):
        load_model("moe", {"gate": "relu"})
    with pytest.raises(ModelError, match="fixes"):
        load_model("deepseek-v3", {"experts": 8})
