"""A decoder-only transformer as a team might write its own: RMSNorm written out, rotary tables kept as buffers,
grouped-query attention through F.scaled_dot_product_attention, a SwiGLU MLP. Nothing in it is declared for
pipeplan: the analytic profile finds each block's roles by structure (q/k/v and the MLP's gate/up column-parallel,
o and down row-parallel, the norms), so tensor parallelism is searched for it as for the built-ins
(docs/models.md, "Your transformer at scale").

    pipeplan capacity examples/decoder_model.py:build -a layers=80 -a hidden=8192 -a heads=64 -a kv_heads=8 \
        -a ffn=28672 -a vocab=128256 -a seq=8192 --hardware h100 -n 64 -B 512
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, seq: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        inverse = 1.0 / (500000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(seq).float(), inverse).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos.to(x.dtype) + turned * self.sin.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        y = F.scaled_dot_product_attention(self._rotate(q), self._rotate(k), v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).flatten(-2))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(hidden)
        self.attention = SelfAttention(hidden, heads, kv_heads, seq)
        self.ffn_norm = RMSNorm(hidden)
        self.feed_forward = FeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, kv_heads, ffn, seq) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 160,
    vocab: int = 256,
    seq: int = 32,
) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return (tokens[:, :-1],), tokens[:, 1:]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    return ModelSpec(
        name="decoder",
        build=lambda: Decoder(layers, hidden, heads, kv_heads, ffn, vocab, seq),
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        options=dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq),
        tokens_per_sample=seq,
    )
