"""A model with data-dependent code: mixture-of-experts blocks that route each token to one expert.

    pipeplan profile examples/moe_model.py:build -a layers=4 --batch-size 4 -o moe-profile.json
    pipeplan plan examples/moe_model.py:build -a layers=4 --profile moe-profile.json --devices 2 -o moe-plan
    pipeplan run moe-plan/plan.json --steps 10

The routing (`argmax`, boolean-mask indexing, a Python `if` on `mask.any()`) depends on the values, so torch.fx
cannot trace through it and torch.export cannot capture it either. Nothing needs declaring: pipeplan keeps each MoE
call whole by itself (fx records it as one call inside its block, and every step runs it eagerly on real tensors;
where a step only needs shapes, as planning and each rank's set-up do, pipeplan takes them from one run of the
model on the CPU instead of the meta device). `ModelSpec(leaf_modules=(MoE,))` says the same explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec


class MoE(nn.Module):
    """Top-1 routing: each token goes to the expert its gate scores highest, scaled by that gate probability."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.gate(flat).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            if mask.any():
                out[mask] = expert(flat[mask]) * probs[mask, index : index + 1]
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.moe = MoE(width, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEClassifier(nn.Module):
    def __init__(self, features: int, width: int, layers: int, experts: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, experts) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def build(layers: int = 4, width: int = 64, experts: int = 4, tokens: int = 16, classes: int = 10) -> ModelSpec:
    features = 32

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        x = torch.randn(batch_size, tokens, features, generator=generator)
        return (x,), torch.randint(0, classes, (batch_size,), generator=generator)

    return ModelSpec(
        name="moe",
        build=lambda: MoEClassifier(features, width, layers, experts, classes),
        sample_batch=sample_batch,
        loss_fn=F.cross_entropy,
    )
