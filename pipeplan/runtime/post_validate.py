"""`pipeplan run --post-validate`: the optimizer step without a global barrier before it (Zero Bubble Pipeline
Parallelism, Qi et al., ICLR 2024, section 4 "bypassing optimizer synchronizations", and appendix C).

A synchronized step waits for every rank's loss and gradient norm (step_checks.gather_rows) before any rank may
step, because the step depends on them: gradient clipping needs the global norm, and a NaN/inf anywhere must stop
(or, under fp16 loss scaling, skip) the step everywhere. Both rarely change anything in a healthy run, so here each
rank steps eagerly on its own gradients as soon as they are reduced, as if neither triggered, and validates after:

- before stepping it copies what the step writes (its parameters, or with ZeRO-1 its flat buffers, and its AdamW
  state) into buffers kept across steps (StepUndo);
- after stepping it passes its row of the global table along a chain of ranks (StateChain) and the last rank of the
  chain sends the completed table back to every rank, so each rank learns the global state;
- if the verdict (step_checks.judge, the synchronized step's own rule) is the plain step, the eager step stands;
  otherwise the rank restores the copy (bit for bit) and carries out the verdict as the synchronized step would:
  clip and step again, skip (fp16 overflow), or stop. Every rank gets the same table and so the same verdict.

The chain runs in the order ranks finish their backward passes in pipeplan's synchronous schedules: ranks holding
later stages first, the rank holding stage 0 (which ends the step and starts the next) last. That rank completes the
table as soon as its own step is done, and each other rank receives the table before its next forward could start.
The paper's in-place AdamW inversion is arithmetically but not bitwise exact in floating point; pipeplan keeps a
copy instead (memory: one more copy of the rank's parameters and optimizer state). The paper also lets a stage skip
its eager step when the partial state it received already shows a trigger; pipeplan always steps eagerly, so that
ranks sharing a ZeRO-1 bucket always make the same collective calls (the all-gather inside the step).
Gradient reductions among the ranks that share a parameter (data parallelism, replicas, tied weights) still precede
the step: they are part of computing the gradient, not a global check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeplan.errors import ConfigError
from pipeplan.plan.plan import Plan
from pipeplan.runtime.step_checks import GlobalState, apply_verdict, judge
from pipeplan.schedules.registry import schedule_info

CHAIN_TAG, TABLE_TAG = 1, 2


def check_post_validate(plan: Plan, post_validate: bool) -> None:
    """--post-validate is for schedules that flush the pipeline and step synchronously."""
    if post_validate and schedule_info(plan.schedule).asynchronous:
        raise ConfigError(
            f"--post-validate validates a synchronous step, but schedule {plan.schedule!r} updates weights without a "
            "flush; drop --post-validate or plan a synchronous schedule"
        )


def validation_order(plan: Plan) -> list[int]:
    """Ranks in the order the global state passes through them: later stages first, ties by pipeline, replica."""
    ranks = sorted(plan.ranks, key=lambda info: (-min(info.stages), info.pipeline, info.stage_replica, info.rank))
    return [info.rank for info in ranks]


class StateChain:
    """Gather every rank's row into the table along `validation_order`, then send the table back to all ranks.
    Collective to create (a process group of its own, so the transfers never mix with the pipeline's)."""

    def __init__(self, plan: Plan, rank: int, device: torch.device) -> None:
        self.order = validation_order(plan)
        self.group = dist.new_group(list(range(plan.world_size)))
        self.rank, self.device = rank, device
        position = self.order.index(rank)
        self.before = self.order[position - 1] if position > 0 else None
        self.after = self.order[position + 1] if position + 1 < len(self.order) else None
        self.last = self.order[-1]

    def exchange(self, row: torch.Tensor) -> torch.Tensor:
        """The full table (rows in rank order); blocks until the chain has come round."""
        table = torch.zeros(len(self.order), row.numel(), dtype=row.dtype, device=self.device)
        if self.before is not None:
            dist.recv(table, src=self.before, group=self.group, tag=CHAIN_TAG)
        table[self.rank] = row
        if self.after is not None:
            sent = dist.isend(table.clone(), dst=self.after, group=self.group, tag=CHAIN_TAG)
            dist.recv(table, src=self.last, group=self.group, tag=TABLE_TAG)
            sent.wait()
            return table
        sends = [dist.isend(table, dst=r, group=self.group, tag=TABLE_TAG) for r in self.order if r != self.rank]
        for work in sends:
            work.wait()
        return table


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


class PostValidator:
    """Step eagerly, then validate against the global state; counts the steps it had to roll back."""

    def __init__(self, plan: Plan, rank: int, device: torch.device, optimizer, max_norm: float | None) -> None:
        check_post_validate(plan, True)
        self.chain = StateChain(plan, rank, device)
        self.undo = StepUndo(optimizer.optimizer, optimizer.written_by_step())
        self.optimizer, self.max_norm = optimizer, max_norm
        self.rollbacks = 0

    def update(self, step: int, row: torch.Tensor, scaler) -> GlobalState:
        """Step now; once the table has come round, keep the step or roll it back and do what the verdict says."""
        self.undo.take()
        self.optimizer.step()
        state = GlobalState.from_table(self.chain.exchange(row))
        verdict = judge(state, step=step, max_norm=self.max_norm, loss_scaling=scaler is not None)
        if verdict.plain_step:
            if scaler is not None:
                scaler.stepped()
            return state
        self.undo.restore()
        self.rollbacks += 1
        apply_verdict(verdict, self.optimizer, scaler)
        return state
