"""Multi-head latent attention (MLA: DeepSeek-AI, "DeepSeek-V2", arXiv 2405.04434, 2024, §2.1; DeepSeek-V3,
arXiv 2412.19437, §2.1), in plain torch for the built-in `moe` family (`attention="mla"`).

Queries go down to a `q_lora_rank` latent (RMSNorm) and up to heads x (qk_nope + qk_rope); keys and values share
one `kv_lora_rank` latent (RMSNorm), up-projected to heads x (qk_nope + v_head), plus one qk_rope-sized rotary
key shared by all heads. Scores use the head size qk_nope + qk_rope (DeepSeek-V3: 128 + 64 = 192), values
v_head (128): scaled_dot_product_attention takes the two sizes (on a GPU the memory-efficient kernel, as
FlashAttention-2 needs one). `q_lora_rank=0` projects queries directly (DeepSeek-V2-Lite).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.llama import RMSNorm


@dataclass(frozen=True, kw_only=True)
class LatentShape:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int

    def check(self) -> None:
        sizes = (self.kv_lora_rank, self.qk_nope, self.qk_rope, self.v_head)
        if self.q_lora_rank < 0 or any(size < 1 for size in sizes) or self.qk_rope % 2:
            raise ValueError(
                "MLA sizes must be positive (q_lora_rank >= 0: 0 projects queries directly) and qk_rope_dim even"
            )


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding over x's last dimension (pairs i, i + d/2), positions along dim -2; angles in float32."""
    size, seq = x.shape[-1], x.shape[-2]
    exponents = torch.arange(0, size, 2, device=x.device, dtype=torch.float32) / size
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), theta**-exponents)
    angles = torch.cat((angles, angles), dim=-1)
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos().to(x.dtype) + torch.cat((-second, first), dim=-1) * angles.sin().to(x.dtype)


class LatentAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, shape: LatentShape, theta: float, eps: float) -> None:
        super().__init__()
        self.heads, self.shape, self.theta = heads, shape, theta
        qk = shape.qk_nope + shape.qk_rope
        if shape.q_lora_rank:
            self.q_down = nn.Linear(hidden, shape.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(shape.q_lora_rank, eps)
            self.q_up = nn.Linear(shape.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        self.kv_down = nn.Linear(hidden, shape.kv_lora_rank + shape.qk_rope, bias=False)
        self.kv_norm = RMSNorm(shape.kv_lora_rank, eps)
        self.kv_up = nn.Linear(shape.kv_lora_rank, heads * (shape.qk_nope + shape.v_head), bias=False)
        self.o = nn.Linear(heads * shape.v_head, hidden, bias=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape.q_lora_rank:
            return self.q_up(self.q_norm(self.q_down(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, heads = self.shape, self.heads
        q = self._queries(x).unflatten(-1, (heads, -1)).transpose(1, 2)  # (b, heads, s, qk)
        q_nope, q_rope = q.split((shape.qk_nope, shape.qk_rope), dim=-1)
        latent, k_rope = self.kv_down(x).split((shape.kv_lora_rank, shape.qk_rope), dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).unflatten(-1, (heads, -1)).transpose(1, 2)
        k_nope, v = kv.split((shape.qk_nope, shape.v_head), dim=-1)
        k_rope = _rotate(k_rope.unsqueeze(1), self.theta).expand(-1, heads, -1, -1)  # one rotary key for all heads
        q = torch.cat((q_nope, _rotate(q_rope, self.theta)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(-2))
