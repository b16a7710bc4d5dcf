"""`pipeplan run --post-validate`: the optimizer step without a global barrier before it (Zero Bubble Pipeline
Parallelism, Qi et al., ICLR 2024, section 4 "bypassing optimizer synchronizations", and appendix C).

A synchronized step waits for every rank's loss and gradient norm (step_checks.gather_rows) before any rank may
step, because the step depends on them: gradient clipping needs the global norm, and a NaN/inf anywhere must stop
(or, under fp16 loss scaling, skip) the step everywhere. Both rarely change anything in a healthy run, so here each
rank steps eagerly on its own gradients as soon as they are reduced, as if neither triggered, starts the next step
at once and validates later:

- before stepping it copies what the step writes (its parameters, or with ZeRO-1 its flat buffers, its AdamW state
  and the fp16 loss scaler) into buffers kept across steps (StepUndo), and keeps a reference to the step's
  gradients (the next step's backward fills fresh ones);
- after stepping it starts an all-gather of its row of the global table on a process group of its own
  (`async_op`: no rank waits for it on the step path) and goes straight on to the next step's forwards;
- the next step runs its forwards and backwards on the eager weights; before its optimizer step (or wherever the
  run needs settled weights: a checkpoint, the weight check, the end) the rank waits for the table. If the verdict
  (step_checks.judge, the synchronized step's own rule) is the plain step, the eager step stands and the next one
  goes on. Otherwise the rank restores the copy (bit for bit), puts the kept gradients back and carries out the
  verdict as the synchronized step would (clip and step again, skip on fp16 overflow, or stop), then discards the
  started step's gradients and runs that step again from its first forward on the corrected weights. Every rank
  gets the same table and so the same verdict: all of them redo the same step, making the same point-to-point and
  collective calls.

So a rank waits for the slowest rank only one step later, and only for its row: under a zero-bubble schedule whose
first stage ends its step first, that stage starts the next step's warm-up while the others finish their
cool-down, and the step time becomes the period between step ends rather than the makespan plus a barrier.
The paper's in-place AdamW inversion is arithmetically but not bitwise exact in floating point; pipeplan keeps a
copy instead (memory: one more copy of the rank's parameters and optimizer state, and one step's gradients held
through the next step's backward). The paper also lets a stage skip its eager step when the partial state it
received already shows a trigger; pipeplan always steps eagerly, so that ranks sharing a ZeRO-1 bucket always make
the same collective calls (the all-gather inside the step).
Gradient reductions among the ranks that share a parameter (data parallelism, replicas, tied weights) still precede
the step: they are part of computing the gradient, not a global check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeplan.artifact.plan import Plan
from pipeplan.errors import ConfigError
from pipeplan.runtime.train.step_checks import GlobalState, apply_verdict, gather_rows, judge
from pipeplan.schedules.registry import schedule_info


def check_post_validate(plan: Plan, post_validate: bool | None) -> None:
    """--post-validate is for schedules that flush the pipeline and step synchronously (None: not asked for)."""
    if post_validate and schedule_info(plan.schedule).asynchronous:
        raise ConfigError(
            f"--post-validate validates a synchronous step, but schedule {plan.schedule!r} updates weights without a "
            "flush; drop --post-validate or plan a synchronous schedule"
        )


class StepUndo:
    """A copy of what one optimizer step changes, taken before it; `restore()` puts it back bit for bit (parameters
    and every state tensor, AdamW's step count included; a parameter that had no state yet loses the new one).
    The copy buffers are allocated once and reused."""

    def __init__(self, optimizer: torch.optim.Optimizer, written: list[torch.Tensor]) -> None:
        self.optimizer, self.written = optimizer, written
        self.copies = [torch.empty_like(t) for t in written]
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), key) -> copy of that state tensor
        self.kept: dict[int, dict[str, object] | None] = {}  # id(param) -> state at take() (None: no state yet)

    @torch.no_grad()
    def take(self) -> None:
        if self.written:
            torch._foreach_copy_(self.copies, self.written)
        for param in self.params:
            state = self.optimizer.state.get(param)
            self.kept[id(param)] = (
                {key: self._keep(param, key, value) for key, value in state.items()} if state else None
            )

    def _keep(self, param: torch.Tensor, key: str, value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        buffer = self.buffers.get((id(param), key))
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = self.buffers[(id(param), key)] = torch.empty_like(value)
        return buffer.copy_(value)

    @torch.no_grad()
    def restore(self) -> None:
        if self.written:
            torch._foreach_copy_(self.written, self.copies)
        for param in self.params:
            kept = self.kept[id(param)]
            if kept is None:
                self.optimizer.state.pop(param, None)
                continue
            state = self.optimizer.state[param]
            for key in [k for k in state if k not in kept]:
                del state[key]
            for key, value in kept.items():
                current = state.get(key)
                if (
                    isinstance(value, torch.Tensor)
                    and isinstance(current, torch.Tensor)
                    and current.shape == value.shape
                ):
                    current.copy_(value)
                else:
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value


@dataclass
class Pending:
    """An eager step whose verdict is not known yet."""

    step: int
    table: torch.Tensor  # filled by the all-gather
    work: dist.Work
    grads: dict[torch.Tensor, torch.Tensor | None]  # the optimizer's parameters -> the gradients it stepped on
    scaler: dict | None  # the loss scaler's fields before the step
    ended: float  # time.perf_counter() when the eager step was done


@dataclass(frozen=True)
class Settled:
    """A step whose verdict is known: its global state, when it ended on this rank, whether it was redone."""

    step: int
    state: GlobalState
    ended: float
    rolled_back: bool


class PostValidator:
    """Step eagerly, learn the verdict one step later; counts the steps it rolled back and the started steps it
    discarded and ran again."""

    def __init__(self, plan: Plan, device: torch.device, optimizer, max_norm: float | None) -> None:
        check_post_validate(plan, True)
        self.group = dist.new_group(list(range(plan.world_size)))  # the tables never mix with other collectives
        self.undo = StepUndo(optimizer.optimizer, optimizer.written_by_step())
        self.params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.rollbacks = 0  # eager steps undone (clipping, NaN/inf or overflow found after)
        self.redone = 0  # already-started steps discarded and run again because of a rollback
        self.pending: Pending | None = None

    def step_eagerly(self, step: int, row: torch.Tensor, scaler) -> None:
        """Take the step as if it were plain and start gathering the table; returns without waiting."""
        assert self.pending is None, "settle() the previous step first"
        self.undo.take()
        kept = dict(vars(scaler)) if scaler is not None else None
        self.optimizer.step()
        if scaler is not None:
            scaler.stepped()
        table, work = gather_rows(row, group=self.group, async_op=True)
        grads = {p: p.grad for p in self.params}
        self.pending = Pending(step, table, work, grads, kept, time.perf_counter())

    def settle(self, scaler) -> Settled:
        """Wait for the pending step's table; keep its eager step, or roll it back and do what the verdict says
        (raises RunError on a stop, with the weights as before that step)."""
        pending, self.pending = self.pending, None
        assert pending is not None
        pending.work.wait()
        state = GlobalState.from_table(pending.table)
        verdict = judge(state, step=pending.step, max_norm=self.max_norm, loss_scaling=scaler is not None)
        if verdict.plain_step:
            return Settled(pending.step, state, pending.ended, rolled_back=False)
        self.undo.restore()
        if scaler is not None:
            vars(scaler).update(pending.scaler)
        for param, grad in pending.grads.items():
            param.grad = grad
        self.rollbacks += 1
        apply_verdict(verdict, self.optimizer, scaler)
        return Settled(pending.step, state, time.perf_counter(), rolled_back=True)
