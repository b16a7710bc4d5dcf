"""A user mixture-of-experts factory (`moe_user_models.py:moe_lm`) written the way MoE layers are written by hand:
a softmax router picks the top-k experts per token and tokens are dispatched with data-dependent indexing (a
boolean mask, or `nonzero`, and a Python branch skipping experts no token chose), so neither torch.fx nor
torch.export can trace the MoE layer. Nothing is declared: pipeplan finds the MoE layer itself and runs it eagerly.

Every block returns its router logits; the model returns them with the logits and the loss adds a Switch-style
load-balancing loss over all layers, so the router logits of early stages must reach the last stage's loss.

Options: `layers`, `width`, `experts`, `top_k`, `dispatch` (`mask` or `nonzero`), `leaf` (1: declare the MoE
layer in ModelSpec.leaf_modules, as a user who read the old error message would), `aux` (the aux-loss weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec

VOCAB, SEQ = 48, 6


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class SparseMoE(nn.Module):
    """Top-k routing with renormalized weights; (output, router logits)."""

    def __init__(self, width: int, experts: int, top_k: int, dispatch: str) -> None:
        super().__init__()
        self.top_k, self.dispatch = top_k, dispatch
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        weights, chosen = logits.softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            if self.dispatch == "mask":
                mask = chosen == index  # (tokens, top_k): at most one True per token
                if not mask.any():  # data-dependent branch
                    continue
                rows = mask.any(-1)
                out[rows] += expert(flat[rows]) * weights[mask].unsqueeze(-1)
            else:
                token, slot = (chosen == index).nonzero(as_tuple=True)
                if token.numel() == 0:
                    continue
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot].unsqueeze(-1))
        return out.reshape(x.shape), logits


class Block(nn.Module):
    def __init__(self, width: int, experts: int, top_k: int, dispatch: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.moe = SparseMoE(width, experts, top_k, dispatch)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + torch.tanh(self.mix(self.norm1(h)))
        update, logits = self.moe(self.norm2(h))
        return h + update, logits


class MoELM(nn.Module):
    def __init__(self, layers: int, width: int, experts: int, top_k: int, dispatch: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, experts, top_k, dispatch) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        h = self.embed(ids)
        router_logits = []
        for block in self.blocks:
            h, logits = block(h)
            router_logits.append(logits)
        return {"logits": self.head(self.norm(h)), "router_logits": tuple(router_logits)}


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss summed over layers: experts x sum(fraction routed x mean probability)."""
    total = torch.zeros(())
    for logits in router_logits:
        probs = logits.softmax(-1)
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, probs.shape[-1]).sum(1).float()
        total = total + probs.shape[-1] * (chosen.mean(0) * probs.mean(0)).sum() / top_k
    return total


def moe_lm(
    layers: int = 4,
    width: int = 32,
    experts: int = 4,
    top_k: int = 2,
    dispatch: str = "mask",
    leaf: int = 0,
    aux: float = 0.01,
) -> ModelSpec:
    if dispatch not in ("mask", "nonzero"):
        raise ValueError(f"dispatch must be mask or nonzero, got {dispatch!r}")

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)
        return (ids,), ids.clone()

    def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
        logits = output["logits"][:, :-1]
        lm = F.cross_entropy(logits.reshape(-1, VOCAB), target[:, 1:].reshape(-1))
        return lm + aux * load_balancing_loss(output["router_logits"], top_k)

    return ModelSpec(
        name="moe_lm",
        build=lambda: MoELM(layers, width, experts, top_k, dispatch),
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        tokens_per_sample=SEQ,
        leaf_modules=(SparseMoE,) if leaf else (),
    )


class TopLevelMoELM(nn.Module):
    """The routing in the model's own forward (issue 38): per layer a router and a ModuleList of experts held in
    ModuleLists of the model, and the top-level loop dispatching tokens with boolean masks, `out[sel] = ...`."""

    def __init__(self, layers: int, width: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.embed = nn.Embedding(VOCAB, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.routers = nn.ModuleList(nn.Linear(width, experts, bias=False) for _ in range(layers))
        self.experts = nn.ModuleList(nn.ModuleList(Expert(width) for _ in range(experts)) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, router, experts in zip(self.norms, self.routers, self.experts):
            x = norm(h).reshape(-1, h.shape[-1])
            weights, chosen = router(x).softmax(-1).topk(self.top_k, dim=-1)
            out = torch.zeros_like(x)
            for index, expert in enumerate(experts):
                sel = (chosen == index).any(-1)
                gate = (weights * (chosen == index)).sum(-1, keepdim=True)
                out[sel] = out[sel] + expert(x[sel]) * gate[sel]
            h = h + out.reshape(h.shape)
        return self.head(self.norm(h))


def moe_top_level(layers: int = 2, width: int = 16, experts: int = 4, top_k: int = 2) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)
        return (ids,), ids.clone()

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target[:, 1:].reshape(-1))

    return ModelSpec(
        name="moe_top_level",
        build=lambda: TopLevelMoELM(layers, width, experts, top_k),
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        tokens_per_sample=SEQ,
    )
