"""Single-process reference for asynchronous schedules: the whole model, microbatch by microbatch in stream order,
each stage's parameters at the version the schedule's F op of that stage names, and a new version of every
parameter per update group: version u+1 = AdamW(version u, summed gradients of group u) — for pipedream-2bw the
paper's one-step-stale rule W(t+1) = W(t) - lr grad f(W(t-1)) with AdamW.

It shares nothing with the runtime but the schedule's version tags (what is being executed) and the model build;
segments (checkpoint boundaries) start fresh streams from the weights reached, as the runtime documents."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from helpers.runtime import build_reference_model
from pipeplan.plan.plan import Plan
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.schedules.registry import generate


@dataclass
class Reference:
    losses: list[float] = field(default_factory=list)  # per step: mean loss over the global batch
    grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # (pipeline, mb) -> grads
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # at the end


def _stage_versions(plan: Plan, steps: int) -> tuple[dict[tuple[int, int], int], int]:
    """(stage, microbatch) -> version its F reads in a fresh stream of `steps` steps, and the update group size."""
    p = len(plan.stages)
    stream = generate(plan.schedule, num_devices=p, num_microbatches=plan.training.num_microbatches, steps=steps)
    reads = {(o.stage, o.microbatch): o.version for ops in stream.device_ops for o in ops if o.kind == "F"}
    return reads, stream.update_every


def async_reference(plan: Plan, segments: list[tuple[int, int]], *, lr: float, weight_decay: float) -> Reference:
    spec, module = build_reference_model(plan)
    stage_of = {
        name: s
        for s, names in enumerate(build_pipeline_model(plan, 0, torch.device("cpu")).stage_params)
        for name in names
    }
    params = dict(module.named_parameters())
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=weight_decay)
    batches = spec.batches(plan.training.global_batch_size, plan.training.seed)
    m, b, dp = plan.training.num_microbatches, plan.training.microbatch_size, plan.training.data_parallel
    out = Reference()
    for first, end in segments:
        reads, k = _stage_versions(plan, end - first)
        history = [{n: t.detach().clone() for n, t in params.items()}]
        summed: dict[str, torch.Tensor] = {}
        for step in range(end - first):
            inputs, target = next(batches)
            loss_total = 0.0
            for mb in range(m):
                local = step * m + mb
                weights = {n: history[reads[(stage_of[n], local)]][n].clone().requires_grad_() for n in params}
                for pipeline in range(dp):
                    piece = slice((pipeline * m + mb) * b, (pipeline * m + mb + 1) * b)
                    loss = spec.loss_fn(
                        functional_call(module, weights, tuple(x[piece] for x in inputs)), target[piece]
                    )
                    scaled = loss / (k * dp)  # each update's gradient: the mean loss of its k x dp microbatches
                    grads = torch.autograd.grad(scaled, list(weights.values()), allow_unused=True)
                    found = {n: g for n, g in zip(weights, grads) if g is not None}
                    out.grads[(pipeline, (first + step) * m + mb)] = found
                    for n, g in found.items():
                        summed[n] = summed[n] + g if n in summed else g.clone()
                    loss_total += float(loss.detach()) / (m * dp)
                if (local + 1) % k == 0:  # update group complete: every stage makes its next version
                    for n, param in params.items():
                        param.grad = summed.get(n)
                    optimizer.step()
                    optimizer.zero_grad()
                    summed = {}
                    history.append({n: t.detach().clone() for n, t in params.items()})
            out.losses.append(loss_total)
    out.params = {n: t.detach().clone() for n, t in params.items()}
    return out
