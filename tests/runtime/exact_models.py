"""Models whose initial state the old per-submodule re-initialization could not reproduce, loaded by path
(`tests/runtime/exact_models.py:quirky_lm`): an RMSNorm whose ones weight has no reset_parameters(), a parameter
initialized by hand in __init__, an `_init_weights` pass the factory applies after construction, a persistent causal
mask, non-persistent rotary `inv_freq` and `position_ids` buffers, a plain (unregistered) tensor attribute, and
optionally a tied LM head. Its training data repeats one batch, so a few steps must lower the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec


class OnesNorm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))  # no reset_parameters(): only __init__ sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.register_buffer("position_ids", torch.arange(seq).unsqueeze(0), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(self.position_ids)  # inputs are always `seq` tokens long


class Block(nn.Module):
    def __init__(self, hidden: int, seq: int) -> None:
        super().__init__()
        self.norm = OnesNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.gain = nn.Parameter(torch.rand(hidden) + 0.5)  # hand-made init in __init__
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hidden, 2, dtype=torch.float32) / hidden))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("position_ids_f", torch.arange(seq, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        angles = self.position_ids_f.unsqueeze(1) * self.inv_freq
        rot = torch.cat((angles.cos(), angles.sin()), dim=-1)
        scores = (q * rot) @ (k * rot).transpose(1, 2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~self.mask, float("-inf"))
        return x + self.out(scores.softmax(-1) @ v) * self.gain


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = OnesNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)
        self.shift = torch.randn(hidden) * 0.1  # a plain tensor attribute (neither parameter nor buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x) + self.shift)


class QuirkyLM(nn.Module):
    def __init__(self, layers: int, hidden: int, seq: int, vocab: int, tie: bool) -> None:
        super().__init__()
        self.embed = Embed(vocab, hidden, seq)
        self.blocks = nn.ModuleList(Block(hidden, seq) for _ in range(layers))
        self.head = Head(hidden, vocab)
        if tie:
            self.head.proj.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _init_weights(model: nn.Module) -> nn.Module:
    """What a factory applies after construction (`_init_weights`-style): no submodule could redo it alone."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.05)
            if module.bias is not None:
                nn.init.uniform_(module.bias, -0.1, 0.1)
    return model


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def quirky_lm(layers: int = 4, hidden: int = 16, seq: int = 8, vocab: int = 32, tie: bool = False) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    def data(batch_size: int, seed: int):
        batch = sample_batch(batch_size, generator=torch.Generator().manual_seed(seed))
        while True:
            yield batch

    return ModelSpec(
        name="quirky-lm",
        build=lambda: _init_weights(QuirkyLM(layers, hidden, seq, vocab, tie)),
        sample_batch=sample_batch,
        loss_fn=lm_loss,
        data=data,
        options=dict(layers=layers, hidden=hidden, seq=seq, vocab=vocab, tie=tie),
        tokens_per_sample=seq,
    )
