"""A stack of Linear + activation layers (a chain): the simplest pipeline."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec, check_sizes

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class LinearAct(nn.Module):
    def __init__(self, hidden: int, activation: str) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class MLPStack(nn.Module):
    def __init__(self, *, layers: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LinearAct(hidden, activation) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def mlp(layers: int = 8, hidden: int = 256, activation: str = "relu") -> ModelSpec:
    """`layers` x (Linear(hidden, hidden) + activation), trained with MSE against a random target."""
    check_sizes(layers=layers, hidden=hidden)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    options: dict[str, Any] = dict(layers=layers, hidden=hidden, activation=activation)

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        x = torch.randn(batch_size, hidden, generator=generator)
        target = torch.randn(batch_size, hidden, generator=generator)
        return (x,), target

    return ModelSpec(
        name="mlp",
        build=lambda: MLPStack(**options),
        sample_batch=sample_batch,
        loss_fn=F.mse_loss,
        options=options,
    )
