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
