"""Model factories for runtime tests, loaded by path (`tests/runtime/toy_models.py:repeated_gpt`): a tiny gpt
whose training data repeats one batch, so a few steps must lower the loss (random tokens never could)."""

from __future__ import annotations

import dataclasses

import torch

from pipeplan.models.gpt import gpt
from pipeplan.models.spec import ModelSpec


def repeated_gpt(
    layers: int = 4, hidden: int = 32, heads: int = 2, seq: int = 16, vocab: int = 64, tie_embeddings: bool = True
) -> ModelSpec:
    spec = gpt(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, tie_embeddings=tie_embeddings)

    def data(batch_size: int, seed: int):
        batch = spec.sample_batch(batch_size, generator=torch.Generator().manual_seed(seed))
        while True:
            yield batch

    return dataclasses.replace(spec, data=data)


class _InputSkip(torch.nn.Module):
    """A chain whose output also adds the model input: the last stage reads a model input directly."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.layers:
            y = torch.tanh(layer(y))
        return y + x


def input_skip_mlp(layers: int = 4, hidden: int = 16) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        return (torch.randn(batch_size, hidden, generator=generator),), torch.randn(
            batch_size, hidden, generator=generator
        )

    return ModelSpec(
        name="input_skip_mlp",
        build=lambda: _InputSkip(layers, hidden),
        sample_batch=sample_batch,
        loss_fn=torch.nn.functional.mse_loss,
        options={"layers": layers, "hidden": hidden},
    )


def poisoned_mlp(layers: int = 4, hidden: int = 16, bad_step: int = 2) -> ModelSpec:
    """input_skip_mlp whose training data turns infinite at step `bad_step` (0-based): the run must stop there."""
    spec = input_skip_mlp(layers=layers, hidden=hidden)

    def data(batch_size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        step = 0
        while True:
            (x,), y = spec.sample_batch(batch_size, generator=generator)
            yield ((x * float("inf"),) if step == bad_step else (x,)), y
            step += 1

    return dataclasses.replace(spec, data=data)
