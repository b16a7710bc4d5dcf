"""A mixture-of-experts decoder in plain torch: LLaMA-style blocks (`models.llama`: RMSNorm, rotary, grouped-query
attention, untied head) whose feed-forward is a mixture of SwiGLU experts — optional shared experts on every token
plus `experts` routed ones, each token sent to its `top_k` highest-scoring routed experts (Shazeer et al. 2017;
Mixtral, Jiang et al. 2024; DeepSeekMoE, Dai et al. 2024; DeepSeek-V3, 2024), optionally after `dense_layers`
ordinary SwiGLU blocks (DeepSeek-V3's first 3).

Routing (`MoE.forward`): router logits (a bias-free linear) -> gate scores (`softmax` over all experts, or
`sigmoid` per expert as DeepSeek-V3) -> the top_k per token, their scores renormalized to sum to 1 (`normalize`;
Mixtral and DeepSeek-V3 do) and times `scale` -> tokens sorted by expert (index-based dispatch, as real MoE code
does) -> each expert's SwiGLU on its tokens -> the outputs weighted and scattered back (scatter_add, as
Megatron-Core's unpermute). No auxiliary
load-balancing loss (DeepSeek-V3 balances with a bias instead; neither it nor group-limited routing is modelled).

On a real device the tokens per expert are counted (bincount: data-dependent). On the meta device and on fake
tensors (analytic profiles) they cannot be, so routing is taken as balanced: every routed expert processes tokens x
top_k / experts tokens (which must divide), and the experts run as one grouped matmul (a batched matmul over the
stacked expert weights) — analytic profiles assume balanced routing.
The module is a torch.fx leaf (`ModelSpec.leaf_modules`): its data-dependent
part runs eagerly inside its block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from pipeplan.models.gpt import lm_loss
from pipeplan.models.llama import MLP, Attention, Embedding, Head, RMSNorm
from pipeplan.models.mla import LatentAttention, LatentShape
from pipeplan.models.spec import ModelSpec, check_sizes

GATES = ("softmax", "sigmoid")
MAX_EXPERTS = 4096


class Experts(nn.Module):
    """`num` SwiGLU experts as stacked weights: `gate_up` (num, hidden, 2 x ffn), `down` (num, ffn, hidden)."""

    def __init__(self, num: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.ffn = ffn
        self.gate_up = nn.Parameter(torch.empty(num, hidden, 2 * ffn))
        self.down = nn.Parameter(torch.empty(num, ffn, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up, mean=0.0, std=0.02)
        nn.init.normal_(self.down, mean=0.0, std=0.02)

    def _swiglu(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = hidden.split(self.ffn, dim=-1)
        return F.silu(gate) * up

    def forward(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`routed` (sum(counts), hidden): tokens sorted by expert, counts[e] of them for expert e."""
        num = self.gate_up.shape[0]
        if len(set(counts)) == 1:  # equal counts (balanced routing): one grouped matmul over the experts
            grouped = routed.reshape(num, counts[0], routed.shape[-1])
            out = torch.bmm(self._swiglu(torch.bmm(grouped, self.gate_up)), self.down)
            return out.reshape(routed.shape)
        parts = routed.split(counts)
        outs = [self._swiglu(part @ self.gate_up[e]) @ self.down[e] for e, part in enumerate(parts)]
        return torch.cat(outs)


class MoE(nn.Module):
    """Shared experts (one SwiGLU of shared x expert_ffn, on every token) + top-k routed experts (module
    docstring)."""

    def __init__(
        self, *, hidden: int, experts: int, top_k: int, ffn: int, shared: int, gate: str, normalize: bool, scale: float
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.gate_fn = experts, top_k, gate
        self.normalize, self.scale = normalize, scale
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)
        self.shared = MLP(hidden, shared * ffn) if shared else None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen experts), each (tokens, top_k): gate scores in fp32, the top_k, renormalized."""
        logits = self.router(flat).float()
        scores = logits.softmax(dim=-1) if self.gate_fn == "softmax" else logits.sigmoid()
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.scale).to(flat.dtype), chosen

    def counts(self, chosen: torch.Tensor) -> list[int]:
        """Tokens per expert: counted on a real device; balanced on the meta device (module docstring)."""
        total = chosen.numel()
        if chosen.device.type == "meta" or is_fake(chosen):  # no data to count (analytic profiling, dtype runs)
            if total % self.num_experts:
                raise ValueError(
                    f"balanced routing needs tokens x top_k ({total}) divisible by experts ({self.num_experts}); "
                    "change the batch size or seq"
                )
            return [total // self.num_experts] * self.num_experts
        return torch.bincount(chosen.flatten(), minlength=self.num_experts).tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        order = chosen.flatten().argsort(stable=True)  # token slots sorted by expert
        token = order // self.top_k
        routed = self.experts(flat[token], self.counts(chosen))
        # combine as Megatron-Core's unpermute and torchtitan do: the weighted outputs scatter-added into the shared
        # experts' output over an expanded token index, which is all autograd saves for it (index_add would also
        # save its source, a second copy of the tokens x top_k expert outputs that no production run keeps)
        out = self.shared(flat) if self.shared is not None else torch.zeros_like(flat)
        index = token.unsqueeze(-1).expand(-1, flat.shape[-1])
        out = out.scatter_add(0, index, routed * weights.flatten()[order].unsqueeze(-1))
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, *, hidden: int, heads: int, kv_heads: int, eps: float, theta: float, ffn: nn.Module, latent):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn: LatentAttention | Attention
        if latent is not None:  # multi-head latent attention (models/mla.py)
            self.attn = LatentAttention(hidden, heads, latent, theta, eps)
        else:
            self.attn = Attention(hidden, heads, kv_heads, theta)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MoEModel(nn.Module):
    def __init__(self, *, layers: int, dense_layers: int, vocab: int, hidden: int, heads: int, kv_heads: int, **o):
        super().__init__()
        eps, theta, intermediate = o.pop("norm_eps"), o.pop("rope_theta"), o.pop("intermediate")
        attn = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, eps=eps, theta=theta, latent=o.pop("latent"))
        self.embed = Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            MoEBlock(**attn, ffn=MLP(hidden, intermediate) if i < dense_layers else MoE(hidden=hidden, **o))
            for i in range(layers)
        )
        self.head = Head(hidden, vocab, eps)
        self.apply(init_moe_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_moe_weights(module: nn.Module) -> None:
    """Initialize one submodule's own parameters (a complete per-submodule initializer)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, RMSNorm | Experts):
        module.reset_parameters()


def _check(*, experts: int, top_k: int, shared_experts: int, dense_layers: int, layers: int, gate: str) -> None:
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be positive and at most {MAX_EXPERTS}, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must lie in [1, experts={experts}], got {top_k}")
    if not 0 <= shared_experts <= MAX_EXPERTS or not 0 <= dense_layers <= layers:
        raise ValueError(f"shared_experts must be >= 0 and dense_layers in [0, layers={layers}]")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {', '.join(GATES)}, got {gate!r}")


def _latent_shape(
    *, kv_lora_rank: int, q_lora_rank: int, qk_nope_dim: int, qk_rope_dim: int, v_head_dim: int
) -> LatentShape | None:
    """MLA's sizes (checked) when kv_lora_rank > 0, else None (standard attention)."""
    if not kv_lora_rank:
        return None
    shape = LatentShape(
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope=qk_nope_dim, qk_rope=qk_rope_dim, v_head=v_head_dim
    )
    shape.check()
    return shape


def moe(
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 4,
    top_k: int = 2,
    expert_intermediate: int = 32,
    shared_experts: int = 1,
    dense_layers: int = 1,
    intermediate: int = 128,
    gate: str = "softmax",
    normalize: bool = True,
    scale: float = 1.0,
    seq: int = 32,
    vocab: int = 256,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    kv_lora_rank: int = 0,
    q_lora_rank: int = 0,
    qk_nope_dim: int = 128,
    qk_rope_dim: int = 64,
    v_head_dim: int = 128,
) -> ModelSpec:
    """Mixture-of-experts decoder: LLaMA-style attention (or, with kv_lora_rank > 0, multi-head latent attention:
    models/mla.py), shared + top-k routed SwiGLU experts, first dense_layers dense (module docstring)."""
    sizes = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seq=seq, vocab=vocab)
    check_sizes(**sizes, intermediate=max(intermediate, expert_intermediate))
    _check(
        experts=experts, top_k=top_k, shared_experts=shared_experts, dense_layers=dense_layers, layers=layers, gate=gate
    )
    if hidden % heads or (hidden // heads) % 2 or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) / heads ({heads}) must be even and heads a multiple of kv_heads")
    if norm_eps <= 0 or rope_theta <= 0 or scale <= 0:
        raise ValueError("norm_eps, rope_theta and scale must be positive")
    routing = dict(experts=experts, top_k=top_k, gate=gate, normalize=normalize, scale=scale)
    latent = dict(kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_nope_dim=qk_nope_dim, qk_rope_dim=qk_rope_dim)
    latent["v_head_dim"] = v_head_dim
    options: dict[str, Any] = dict(
        **sizes, **routing, expert_intermediate=expert_intermediate, shared_experts=shared_experts
    )
    options.update(dense_layers=dense_layers, intermediate=intermediate, norm_eps=norm_eps, rope_theta=rope_theta)
    options.update(latent)
    module = {k: v for k, v in options.items() if k not in ("seq", "expert_intermediate", "shared_experts", *latent)}
    module.update(ffn=expert_intermediate, shared=shared_experts, latent=_latent_shape(**latent))

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    return ModelSpec(
        name="moe",
        build=lambda: MoEModel(**module),
        sample_batch=sample_batch,
        loss_fn=lm_loss,
        options=options,
        tokens_per_sample=seq,
        leaf_modules=(MoE,),
        init_module=init_moe_weights,
    )
