"""Shared helpers for the runtime tests: tiny model options, plan files and the single-process reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeplan.models.spec import ModelSpec
from pipeplan.plan.manual import manual_plan
from pipeplan.plan.plan import Plan
from pipeplan.runtime.step.stages import load_spec
from pipeplan.runtime.weights import checkpoint
from pipeplan.runtime.weights.init_weights import load_initial_weights
from pipeplan.runtime.weights.materialize import build_whole, named_tensors

TINY_GPT = dict(layers=4, hidden=32, heads=2, seq=16, vocab=64)
TINY_GPT_TIED = {**TINY_GPT, "tie_embeddings": True}
TINY_MLP = dict(layers=4, hidden=32)
TINY_RESNET = dict(blocks=4, channels=8, image=8, classes=5)


def save_plan(folder: Path, name: str, plan: Plan) -> str:
    path = folder / f"{name}.json"
    plan.save(path)
    return str(path)


def make_plan(folder: Path, name: str, model: str, options: dict, **layout) -> tuple[str, Plan]:
    layout.setdefault("num_microbatches", 4)
    layout.setdefault("microbatch_size", 2)
    plan = manual_plan(model, options, **layout)
    return save_plan(folder, name, plan), plan


def build_reference_model(
    plan: Plan, device: torch.device | str = "cpu", *, init_from: str | None = None
) -> tuple[ModelSpec, torch.nn.Module]:
    """The whole model exactly as the factory builds it with the plan's seed (what every rank's stages hold, the
    runtime's own `build_whole`), with the `init_from` file's values where given (for single-process checks)."""
    spec = load_spec(plan)
    module = build_whole(spec, plan.training.seed)
    if init_from:
        load_initial_weights(init_from, model=module, tensors=list(named_tensors(module)))
    return spec, module.to(device)


def checkpoint_files(root: str) -> dict[str, dict]:
    """The latest checkpoint's stage files in `root`: file name -> its saved dict (params, optimizer, ...)."""
    step = checkpoint.latest_step(root)
    return {p.name: torch.load(p, weights_only=True) for p in sorted(checkpoint.step_dir(root, step).glob("*.pt"))}


def reference_step(plan: Plan) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the first global batch on one process, whole model, same initialization."""
    spec, module = build_reference_model(plan)
    inputs, target = next(spec.batches(plan.training.global_batch_size, plan.training.seed))
    b = plan.training.microbatch_size
    count = plan.training.num_microbatches * plan.training.data_parallel
    total = torch.zeros(())
    for mb in range(count):
        piece = slice(mb * b, (mb + 1) * b)
        loss = spec.loss_fn(module(*(x[piece] for x in inputs)), target[piece]) / count
        loss.backward()
        total += loss.detach()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return float(total), grads


def gathered_grads(per_rank) -> dict[str, list[torch.Tensor]]:
    """name -> the gradient each holding rank reported."""
    found: dict[str, list[torch.Tensor]] = {}
    for result in per_rank:
        for name, grad in (result.grads or {}).items():
            if grad is not None:  # no gradient at all (e.g. an expert no token was routed to), as in the reference
                found.setdefault(name, []).append(grad)
    return found


def assert_matches_reference(plan: Plan, per_rank, label: str) -> None:
    loss, grads = reference_step(plan)
    for result in per_rank:
        torch.testing.assert_close(result.losses[0], loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} loss: {m}")
    found = gathered_grads(per_rank)
    assert set(found) == set(grads), f"{label}: parameters {sorted(set(grads) ^ set(found))[:5]} differ"
    for name, copies in found.items():
        for grad in copies:
            torch.testing.assert_close(
                grad, grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{label} {n}: {m}"
            )


def reference_losses(
    plan: Plan, steps: int, *, lr: float, weight_decay: float, init_from: str | None = None
) -> list[float]:
    """Single-process AdamW training of the whole model on the plan's batches (mean loss over the global batch)."""
    return reference_training(plan, steps, lr=lr, weight_decay=weight_decay, init_from=init_from).losses


@dataclass
class ReferenceRun:
    losses: list[float]
    grad_norms: list[float]  # before clipping, one per step (with `clip_grad_norm` only)
    first_grads: dict[str, torch.Tensor]  # the first step's gradients (clipped, with `clip_grad_norm`)
    module: torch.nn.Module | None = None  # the trained whole model


def global_batch_backward(spec, module: torch.nn.Module, batch, plan: Plan) -> float:
    """Backward of the mean loss over one global batch of the plan, microbatch by microbatch (gradients accumulate
    in `module`); returns that loss."""
    inputs, target = batch
    b = plan.training.microbatch_size
    count = plan.training.num_microbatches * plan.training.data_parallel
    total = 0.0
    for mb in range(count):
        piece = slice(mb * b, (mb + 1) * b)
        loss = spec.loss_fn(module(*(x[piece] for x in inputs)), target[piece]) / count
        loss.backward()
        total += float(loss.detach())
    return total


def reference_training(
    plan: Plan,
    steps: int,
    *,
    lr: float,
    weight_decay: float,
    init_from: str | None = None,
    clip_grad_norm: float | None = None,
) -> ReferenceRun:
    """Single-process AdamW training of the whole model on the plan's batches (mean loss over the global batch),
    optionally with torch.nn.utils.clip_grad_norm_ before each update."""
    spec, module = build_reference_model(plan, init_from=init_from)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    batches = spec.batches(plan.training.global_batch_size, plan.training.seed)
    run = ReferenceRun(losses=[], grad_norms=[], first_grads={}, module=module)
    for _ in range(steps):
        optimizer.zero_grad()
        total = global_batch_backward(spec, module, next(batches), plan)
        if clip_grad_norm is not None:
            run.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad_norm)))
        if not run.first_grads:
            run.first_grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        optimizer.step()
        run.losses.append(total)
    return run
