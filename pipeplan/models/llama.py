"""A LLaMA-style decoder in plain torch, written so torch.fx can trace it.

Differences from `gpt`: RMSNorm instead of LayerNorm, rotary position embeddings (no position table),
grouped-query attention (`kv_heads` key/value heads shared by `heads // kv_heads` query heads), a SwiGLU MLP
(`down(silu(gate(x)) * up(x))`), no biases, untied LM head. Same top-level layout as `gpt` (`embed`,
`blocks.{i}`, `head`) so layer grouping and partitioning treat both alike. Shapes follow Touvron et al.,
"LLaMA" (2023) and "Llama 2" (2023). The same family's later members are options: `head_dim` other than hidden /
heads (Gemma's 256), biases on the q/k/v projections (`qkv_bias`: Qwen2), a GeGLU MLP (`activation=gelu_tanh`:
Gemma), an LM head tied to the embedding (`tie_embeddings`: Gemma, small Qwen2.5 and Llama 3.2), a squared-ReLU
MLP of two matrices (`mlp=relu2`: Nemotron-4, `down(relu(up(x))²)`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.gpt import lm_loss
from pipeplan.models.spec import SIZE_LIMITS, ModelSpec, check_sizes


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, rope_theta: float, head_dim: int = 0, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim or hidden // heads
        self.rope_theta = rope_theta
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def _rotary(self, x: torch.Tensor, seq: int) -> torch.Tensor:
        """Rotate pairs (i, i + d/2) of each head by position * theta^(-2i/d); angles computed in float32."""
        exponents = torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float32) / self.head_dim
        positions = torch.arange(seq, device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.rope_theta**-exponents)
        angles = torch.cat((angles, angles), dim=-1)
        return x * angles.cos().to(x.dtype) + _rotate_half(x) * angles.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        # (b, s, heads * d) -> (b, heads, s, d)
        q = self.q(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.k(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        q, k = self._rotary(q, seq), self._rotary(k, seq)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).flatten(-2))


ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU (Gemma: GELU's tanh form)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.tanh_gelu = activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down(gate * self.up(x))


class SquaredReluMLP(nn.Module):
    """`down(relu(up(x))²)`: Nemotron-4's MLP (Parmar et al. 2024), two matrices instead of SwiGLU's three."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


MLPS = {"swiglu": MLP, "relu2": SquaredReluMLP}


class Block(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, intermediate: int, eps: float, theta: float, **o
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = Attention(hidden, heads, kv_heads, theta, o.get("head_dim", 0), o.get("qkv_bias", False))
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp: nn.Module
        if o.get("mlp", "swiglu") == "relu2":
            self.mlp = SquaredReluMLP(hidden, intermediate)
        else:
            self.mlp = MLP(hidden, intermediate, o.get("activation", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class Llama(nn.Module):
    def __init__(
        self,
        *,
        layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        intermediate: int,
        vocab: int,
        norm_eps: float,
        rope_theta: float,
        tie_embeddings: bool = False,
        **variant,
    ) -> None:
        super().__init__()
        self.embed = Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, kv_heads, intermediate, norm_eps, rope_theta, **variant) for _ in range(layers)
        )
        self.head = Head(hidden, vocab, norm_eps)
        if tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight
        self.apply(init_llama_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_llama_weights(module: nn.Module) -> None:
    """Initialize one submodule's own parameters, so per-submodule init matches a whole-model build."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, RMSNorm):
        module.reset_parameters()


def _check_variant(norm_eps: float, rope_theta: float, mlp: str, activation: str) -> None:
    if norm_eps <= 0 or rope_theta <= 0:
        raise ValueError("norm_eps and rope_theta must be positive")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if mlp not in MLPS:
        raise ValueError(f"mlp must be one of {', '.join(MLPS)}, got {mlp!r}")
    if mlp == "relu2" and activation != "silu":
        raise ValueError(f"activation ({activation!r}) is the gated MLP's; mlp=relu2 has no gate: drop activation")


def llama(
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 4,
    intermediate: int = 344,
    seq: int = 64,
    vocab: int = 512,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    head_dim: int = 0,
    qkv_bias: bool = False,
    activation: str = "silu",
    tie_embeddings: bool = False,
    mlp: str = "swiglu",
) -> ModelSpec:
    """LLaMA-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP (or `mlp=relu2`:
    Nemotron-4's squared-ReLU MLP), untied LM head (the module docstring's options: head_dim 0 = hidden / heads)."""
    check_sizes(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, seq=seq, vocab=vocab
    )
    if head_dim and (head_dim < 0 or head_dim % 2 or head_dim > SIZE_LIMITS["hidden"]):
        raise ValueError(f"head_dim ({head_dim}) must be 0 (hidden / heads) or a positive even size")
    if not head_dim and (hidden % heads or (hidden // heads) % 2):
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads}) into an even head size")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    _check_variant(norm_eps, rope_theta, mlp, activation)
    options = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        seq=seq,
        vocab=vocab,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        activation=activation,
        tie_embeddings=tie_embeddings,
        **({"mlp": mlp} if mlp != "swiglu" else {}),  # the default stays out: earlier options and plans match
    )
    module_options: dict[str, Any] = {key: value for key, value in options.items() if key != "seq"}

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    return ModelSpec(
        name="llama",
        build=lambda: Llama(**module_options),
        sample_batch=sample_batch,
        loss_fn=lm_loss,
        options=options,
        tokens_per_sample=seq,
        init_module=init_llama_weights,
    )
