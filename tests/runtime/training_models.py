"""Model factories for the training-option tests (loaded by path): the byte-level text model of
examples/text_model.py, and the same with its own optimizer (no weight decay on 1-D parameters) and schedule."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import torch

from pipeplan.models.spec import ModelSpec

_EXAMPLE = Path(__file__).parents[2] / "examples" / "text_model.py"
TEXT = f"{_EXAMPLE}:text_lm"
TINY_TEXT = {"layers": 2, "hidden": 16, "heads": 2, "seq": 8}


def _text_lm():
    spec = importlib.util.spec_from_file_location("text_model_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.text_lm


def decay_groups(named, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norm weights (1-D), with it on the rest."""
    flat = [p for _, p in named if p.dim() < 2]
    rest = [p for _, p in named if p.dim() >= 2]
    groups = [{"params": rest, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def halving(step: int) -> float:
    return 0.5 ** (step // 2)


def own_optimizer_lm(layers: int = 2, hidden: int = 16, heads: int = 2, seq: int = 8) -> ModelSpec:
    spec = _text_lm()(layers=layers, hidden=hidden, heads=heads, seq=seq)
    return dataclasses.replace(spec, optimizer=decay_groups, lr_lambda=halving)
