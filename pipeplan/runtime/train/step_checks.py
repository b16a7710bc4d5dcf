"""The global checks before an optimizer step takes effect, in one place for both ways `pipeplan run` gathers them.

Every rank contributes one row, (the sum of its scaled microbatch losses, the squared L2 norm of the gradients it
owns: `owned_grads()` in zero.py counts each element of each summed gradient on exactly one rank). The table of
all rows gives the step's global state: the mean loss, the global gradient norm and whether either is not finite.
`Trainer` gathers the table with one all-gather before stepping (the synchronized step); `--post-validate` starts
the same all-gather after an eager step and waits for it one step later (post_validate.py). Either way the same
table gives the same verdict bit for bit: rows are summed with math.fsum (exactly rounded, so independent of order).

The verdict follows the synchronized step's rules: a non-finite loss, or non-finite gradients without fp16 loss
scaling, stops the run before the step; under loss scaling non-finite gradients skip the step on every rank and
halve the scale; otherwise the gradients are clipped as torch.nn.utils.clip_grad_norm_(max_norm) clips them (the
norm of all gradients of all stages and replicas; coefficient max_norm / (norm + 1e-6), at most 1) and AdamW steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeplan.errors import RunError

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard in max_norm / (total_norm + eps)


def local_row(loss_sum: torch.Tensor | None, owned: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's row: (its scaled loss sum, squared norm of its owned gradients), float64. Per-tensor norms are
    taken in the gradients' dtype, as clip_grad_norm_ takes them; a NaN or inf anywhere makes the square non-finite."""
    row = torch.zeros(2, dtype=torch.float64, device=device)
    if loss_sum is not None:
        row[0] = loss_sum
    if owned:
        row[1] = torch.stack(torch._foreach_norm(owned)).double().square().sum()
    return row


def gather_rows(row: torch.Tensor, *, group=None, async_op: bool = False):
    """Every rank's row, in rank order (one all-gather over the world: the synchronized step's barrier). With
    `async_op`: (the table, its Work), the table valid once the work is waited on (post_validate.py)."""
    size = dist.get_world_size(group)
    flat = torch.empty(size * row.numel(), dtype=row.dtype, device=row.device)
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work = collective(flat, row, group=group, async_op=async_op)
    table = flat.view(-1, row.numel())
    return (table, work) if async_op else table


def _total(values: list[float]) -> float:
    return math.fsum(values) if all(math.isfinite(v) for v in values) else sum(values)


@dataclass(frozen=True)
class GlobalState:
    loss: float  # mean loss over the global batch (the microbatch losses are pre-scaled)
    grad_norm: float  # L2 norm of all summed gradients, before clipping

    @classmethod
    def from_table(cls, table: torch.Tensor) -> GlobalState:
        losses, squares = zip(*table.tolist(), strict=True)
        return cls(loss=_total(list(losses)), grad_norm=math.sqrt(_total(list(squares))))


def clip_coefficient(grad_norm: float, max_norm: float | None) -> float:
    """What clip_grad_norm_ multiplies the gradients by: max_norm / (norm + 1e-6), at most 1 (1 without clipping)."""
    if max_norm is None:
        return 1.0
    return min(max_norm / (grad_norm + CLIP_EPS), 1.0)


@dataclass(frozen=True)
class Verdict:
    stop: str | None = None  # the run stops before the step with this message
    skip: bool = False  # fp16 overflow: every rank skips the step and halves the loss scale
    coefficient: float = 1.0  # the gradients are multiplied by this before the step

    @property
    def plain_step(self) -> bool:
        """The step as taken on the unchanged gradients (what post-validation assumes before it knows)."""
        return self.stop is None and not self.skip and self.coefficient == 1.0


def judge(state: GlobalState, *, step: int, max_norm: float | None, loss_scaling: bool) -> Verdict:
    if loss_scaling and math.isfinite(state.loss) and not math.isfinite(state.grad_norm):
        return Verdict(skip=True)
    if not (math.isfinite(state.loss) and math.isfinite(state.grad_norm)):
        what = f"loss is {state.loss}" if not math.isfinite(state.loss) else "gradients are not finite"
        return Verdict(
            stop=f"step {step + 1}: {what}; stopped before the optimizer step (nothing saved): lower --lr or check "
            "the model and data"
        )
    return Verdict(coefficient=clip_coefficient(state.grad_norm, max_norm))


def apply_verdict(verdict: Verdict, optimizer, scaler) -> None:
    """Carry out the verdict with this rank's optimizer (zero.py) and fp16 loss scaler (None without)."""
    if verdict.stop is not None:
        raise RunError(verdict.stop)
    if verdict.skip:
        scaler.overflowed()
        return
    if verdict.coefficient < 1.0:
        grads = optimizer.grads()  # shared gradients on every holder, so the copies stay equal
        if grads:
            torch._foreach_mul_(grads, verdict.coefficient)
    optimizer.step()
    if scaler is not None:
        scaler.stepped()
