"""Gradient all-reduce for parameters held by several ranks, and the check that their copies never diverge.

A parameter is held by every rank whose stages use it: the replicas of its stage (PipeDream replication), the two
mirrored copies of a dualpipe stage (rank d holds stages d and p-1-d, one per direction), the same stage in every
data-parallel pipeline, and, for weights tied across stages (gpt tie_embeddings: the embedding is
the LM head), the ranks of each stage using it. Each such rank computed a partial gradient (its microbatches, its
use of the tied weight), and the losses are already scaled by 1 / (microbatches x pipelines), so the true gradient
is the SUM over the holders. Parameters with the same set of holders share one process group and one flat bucket.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from pipeplan.artifact.plan import Plan
from pipeplan.errors import RunError


def parameter_holders(plan: Plan, stage_params: list[tuple[str, ...]]) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> ranks that hold it (ascending)."""
    holders: dict[str, set[int]] = defaultdict(set)
    for info in plan.ranks:
        for stage in info.stages:
            for name in stage_params[stage]:
                holders[name].add(info.rank)
    return {name: tuple(sorted(ranks)) for name, ranks in holders.items()}


class GradientSync:
    """Create the groups (collectively: every rank calls this with the same plan) and reduce this rank's grads."""

    def __init__(self, plan: Plan, rank: int, stage_params: list[tuple[str, ...]], params: dict[str, nn.Parameter]):
        holders = parameter_holders(plan, stage_params)
        by_group: dict[tuple[int, ...], list[str]] = defaultdict(list)
        for name in sorted(holders):
            if len(holders[name]) > 1:
                by_group[holders[name]].append(name)
        self.rank = rank
        self.buckets: list[tuple[tuple[int, ...], object, list[nn.Parameter], list[str]]] = []
        for ranks in sorted(by_group):
            group = dist.new_group(list(ranks))  # every rank creates every group, in the same order
            if rank in ranks:
                names = by_group[ranks]
                self.buckets.append((ranks, group, [params[n] for n in names], names))

    @property
    def shared_names(self) -> list[str]:
        return [name for *_, names in self.buckets for name in names]

    def all_reduce(self) -> None:
        for _, group, params, _ in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for p in params:
                count = p.numel()
                p.grad = flat[offset : offset + count].view_as(p).clone()
                offset += count

    def check_in_sync(self, step: int) -> None:
        """Raise RunError if any shared parameter differs between its holders (a checksum per group)."""
        for ranks, group, params, names in self.buckets:
            with torch.no_grad():
                local = torch.stack([p.detach().double().sum() + p.detach().double().abs().sum() for p in params])
            bounds = torch.stack([local, -local])
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
            spread = bounds[0] + bounds[1]  # max - min, per parameter
            scale = bounds[0].abs().clamp_min(1.0)
            bad = (spread > 1e-9 * scale).nonzero().flatten().tolist()
            if bad:
                raise RunError(
                    f"step {step}: parameter {names[bad[0]]!r} differs between ranks {list(ranks)} (replicas, "
                    "mirrored or tied copies diverged); check for non-deterministic ops or restart from the last "
                    "checkpoint"
                )
