"""The built-in gpt with a loss that saves nothing for backward (the mean of the logits), loaded by path
(`tests/runtime/mean_loss_model.py:gpt_mean_loss`): profiles count the layers' saved tensors, not the loss's
(cross-entropy keeps its log-softmax), so the memory model's bytes are compared with a run on this model."""

from __future__ import annotations

from dataclasses import replace

import torch

from pipeplan.models.gpt import gpt
from pipeplan.models.spec import ModelSpec


def mean_of_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return logits.mean()


def gpt_mean_loss(
    layers: int = 4, hidden: int = 32, heads: int = 2, seq: int = 16, vocab: int = 64, dropout: float = 0.0
) -> ModelSpec:
    spec = gpt(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, dropout=dropout)
    return replace(spec, loss_fn=mean_of_logits)
