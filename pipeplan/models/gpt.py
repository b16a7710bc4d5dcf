"""A decoder-only transformer (GPT-2 style) in plain torch, written so torch.fx can trace it.

Layout: `embed` (token + position embedding, dropout), `blocks.{i}` (pre-LN: causal self-attention, MLP),
`head` (final LayerNorm, LM head). The partitioner cuts between these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec, check_sizes


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = self.pos.weight[: idx.shape[1]]
        return self.drop(self.tok(idx) + positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # (b, s, h) -> (b, heads, s, h / heads)
        q = q.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k = k.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        v = v.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).flatten(-2)))


class MLP(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class GPT(nn.Module):
    def __init__(
        self,
        *,
        layers: int,
        hidden: int,
        heads: int,
        seq: int,
        vocab: int,
        tie_embeddings: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embed = Embedding(vocab, hidden, seq, dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.head = Head(hidden, vocab)
        if tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt(
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    seq: int = 64,
    vocab: int = 512,
    tie_embeddings: bool = False,
    dropout: float = 0.0,
) -> ModelSpec:
    """Decoder-only transformer: token + position embedding, pre-LN blocks, final norm, LM head."""
    check_sizes(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    options: dict[str, Any] = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=vocab,
        tie_embeddings=tie_embeddings,
        dropout=dropout,
    )

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    return ModelSpec(
        name="gpt",
        build=lambda: GPT(**options),
        sample_batch=sample_batch,
        loss_fn=lm_loss,
        options=options,
        tokens_per_sample=seq,
        init_module=_init_weights,
    )
