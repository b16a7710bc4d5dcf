"""The step strategy of `pipeplan run` for asynchronous schedules (pipedream, pipedream-2bw; train.py runs the
loop): the run is a stream of steps x m microbatches with no flush between steps; each stage steps its own weights
whenever one of its update groups is complete (`async_weights.py`), without waiting for the other stages.

The op lists come from the schedule's generator for the number of steps run — the same generator whose stream the
plan stores and the search simulated (checked against plan.rank_ops first). Checkpoints drain the pipeline: the
stream is cut into segments at every --checkpoint-every boundary (and at --steps), each a stream of its own that
starts from the newest weights with no stashed version and no pending gradient, so a checkpoint holds just the
weights and AdamW state, and a run resumed from one equals the uninterrupted run with the same --checkpoint-every
(its first step after each boundary computes on the boundary's weights: 2BW's staleness restarts there).

Per step the output-stage ranks add up their microbatches' losses; they are summed over the ranks once per segment
(a collective in mid-stream would stall the pipeline like a flush), and so are the logs. Each rank's step time is
the gap between its completions of consecutive steps (its last backward of each step's last microbatch).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist

from pipeplan.artifact.plan import Plan
from pipeplan.errors import ConfigError, RunError
from pipeplan.runtime.step.async_weights import VersionStore
from pipeplan.runtime.step.executor import Executor, MicroBatch, forward_seed
from pipeplan.runtime.step.messages import Message, Routing, build_routing, parse_rank_ops
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.post_validate import check_post_validate
from pipeplan.runtime.train.trainer import RunResult, TracedStep, Trainer, microbatches_for
from pipeplan.schedules.ops import Op
from pipeplan.schedules.registry import generate, schedule_info


class StreamBatches:
    """Microbatch `local` of a segment's stream: the model's batches drawn in order, one global batch per step."""

    def __init__(self, trainer: Trainer, batches: Iterator, per_step: int) -> None:
        self.trainer, self.batches, self.per_step = trainer, batches, per_step
        self.step = -1
        self.pieces: dict[int, MicroBatch] = {}

    def __getitem__(self, local: int) -> MicroBatch:
        step, mb = divmod(local, self.per_step)
        assert step >= self.step, "forwards of one rank run in microbatch order"
        while self.step < step:
            t = self.trainer
            all_mb = set(range(self.per_step))
            dtype = t.precision.param_dtype
            self.pieces = microbatches_for(t.plan, t.rank, next(self.batches), all_mb, t.device, dtype)
            self.step += 1
        return self.pieces[mb]


class AsyncExecutor(Executor):
    """Runs one segment's op list: every op on its version's weights, the update after each last backward."""

    def __init__(self, plan: Plan, trainer: Trainer, *, first_step: int, capture: dict | None) -> None:
        model, rank = trainer.model, trainer.rank
        routing = build_routing(plan, model.stage_io, model.model_inputs, model.differentiable)
        super().__init__(plan, rank, model, routing, trainer.device, direction_groups=trainer.direction_groups)
        self.mailbox.settled_by = settled_by(routing, parse_rank_ops(plan), rank)
        self.autocast = trainer.executor.autocast
        self.per_step, self.first_step = plan.training.num_microbatches, first_step
        update_every = schedule_info(plan.schedule).update_every(self.per_step)
        self.loss_grad = self.per_step / update_every  # each update's gradient: its microbatches' mean loss

        def step_of(group: int) -> int:  # the 0-based step an update group belongs to
            return first_step + group * update_every // self.per_step

        self.weights = VersionStore(
            model,
            self.ops,
            update_every=update_every,
            optimizer=trainer.optimizer,
            capture=capture,
            describe_group=lambda stage, group: f"step {step_of(group) + 1}",
            before_update=lambda group: trainer.schedule.apply(trainer.optimizer.optimizer, step_of(group)),
        )
        steps = plan.num_op_microbatches // self.per_step
        self.step_losses = torch.zeros(steps, dtype=torch.float64, device=trainer.device)
        self.step_done = [0.0] * steps

    def _call_stage(self, o: Op, args: list[torch.Tensor]):
        return self.weights.call(o, args)

    def _grad_params(self, o: Op) -> list[torch.Tensor]:
        return self.weights.grad_leaves(o)

    def _forward_seed(self, o: Op) -> int:
        step, mb = divmod(o.microbatch, self.per_step)
        return forward_seed(self.plan.training.seed, self.first_step + step, self.pipeline, o.stage, mb)

    def _forward(self, o: Op, batch: MicroBatch) -> torch.Tensor | None:
        loss = super()._forward(o, batch)
        if loss is not None:
            self.step_losses[o.microbatch // self.per_step] += loss
        return loss

    def _backward_done(self, o: Op) -> None:
        self.weights.backward_done(o, self.first_step * self.per_step + o.microbatch)
        if o.microbatch % self.per_step == self.per_step - 1:
            self.step_done[o.microbatch // self.per_step] = time.perf_counter()


def settled_by(routing: Routing, rank_ops: list[list[Op]], rank: int) -> dict[Message, tuple[Message, ...]]:
    """Per message `rank` receives from a peer, the messages `rank` sent that peer which the peer consumed before
    sending it: its op list runs in order, so they have arrived once it has (`Mailbox.settled_by`). A stream has no
    step end to wait for its sends at, and gloo's send handles report completion only when waited."""
    index = [{_key(o.kind, o.stage, o.microbatch): i for i, o in enumerate(ops)} for ops in rank_ops]
    sent_at = {m: index[src][_key(o.kind, o.stage, o.microbatch)] for (src, o), ms in routing.sends.items() for m in ms}
    incoming: dict[int, list[tuple[int, Message]]] = defaultdict(list)  # peer -> (its op index, message), in order
    for message, position in sent_at.items():
        if message.dst == rank:
            incoming[message.src].append((position, message))
    positions = {peer: sorted(p for p, _ in found) for peer, found in incoming.items()}
    by_position = {peer: dict(found) for peer, found in incoming.items()}
    settled: dict[Message, list[Message]] = defaultdict(list)
    for message in sent_at:
        if message.src != rank or message.dst not in incoming:
            continue
        kind, stage = ("F", message.consumer) if message.kind == "act" else ("B", message.producer)
        consumed = index[message.dst][_key(kind, stage, message.microbatch)]
        later = bisect.bisect_left(positions[message.dst], consumed)
        if later < len(positions[message.dst]):
            settled[by_position[message.dst][positions[message.dst][later]]].append(message)
    return {n: tuple(ms) for n, ms in settled.items()}


def _key(kind: str, stage: int, microbatch: int) -> tuple[str, int, int]:
    """An op's place, versions aside: a forward, or the backward (B or I) that consumes output gradients."""
    return (kind if kind in "FW" else "BI", stage, microbatch)


def stream_rank_ops(plan: Plan, steps: int) -> tuple[tuple[str, ...], ...]:
    """Every rank's op list for a stream of `steps` steps: pipeline device r % P's list of the generator's stream."""
    devices = plan.world_size // plan.training.data_parallel
    stream = generate(plan.schedule, num_devices=devices, num_microbatches=plan.training.num_microbatches, steps=steps)
    rows = stream.op_strings()
    return tuple(tuple(rows[rank % devices]) for rank in range(plan.world_size))


def check_stream(plan: Plan) -> None:
    """The plan's op lists are its schedule's stream (so regenerating it for --steps runs what was planned)."""
    steps = plan.num_op_microbatches // plan.training.num_microbatches
    if stream_rank_ops(plan, steps) != tuple(tuple(ops) for ops in plan.rank_ops):
        raise RunError(
            f"the plan's op lists are not the {plan.schedule} generator's stream of {steps} step(s); re-create the plan"
        )


def segments(start: int, config: RunConfig) -> list[tuple[int, int]]:
    """[first, end) step ranges of the streams: cut at every --checkpoint-every boundary and at --steps."""
    every = config.checkpoint_every if config.checkpoint_dir else 0
    bounds = sorted({config.steps, *(range(every, config.steps, every) if every else ())})
    found, first = [], start
    for bound in bounds:
        if bound > first:
            found.append((first, bound))
            first = bound
    return found


def check_async_run(plan: Plan, config: RunConfig) -> None:
    """What an asynchronous plan cannot run with (--post-validate: runtime/train/post_validate.py says it)."""
    if schedule_info(plan.schedule).asynchronous and config.clip_grad_norm is not None:
        raise ConfigError(
            f"--clip-grad-norm clips the global gradient of a synchronized step, but {plan.schedule} steps each stage "
            "on its own; drop --clip-grad-norm or plan a synchronous schedule"
        )


class AsynchronousSteps:
    """The step strategy of asynchronous schedules (train.train): each segment one stream of steps (`segments`),
    checked across ranks at its end; `microbatch_grads` instead of `grads` when gradients are captured."""

    def __init__(self, trainer: Trainer, result: RunResult, *, capture_grads: bool) -> None:
        self.trainer, self.result = trainer, result
        if capture_grads:
            result.microbatch_grads = {}

    @staticmethod
    def check(plan: Plan, config: RunConfig) -> None:
        check_stream(plan)
        check_async_run(plan, config)
        check_post_validate(plan, config.post_validate)

    def segments(self, start: int) -> list[tuple[int, int]]:
        return segments(start, self.trainer.config)

    def check_due(self, end: int) -> bool:
        """A segment ends drained: compare shared weights after every one."""
        return True

    def run(self, first: int, end: int, batches: Iterator) -> list[TracedStep]:
        """Run steps [first, end) as one stream; append their losses and this rank's step times to the result.
        Returns the segment's last step with its op times (for --trace)."""
        trainer, result = self.trainer, self.result
        plan = trainer.plan
        segment = dataclasses.replace(plan, rank_ops=stream_rank_ops(plan, end - first))
        executor = AsyncExecutor(segment, trainer, first_step=first, capture=result.microbatch_grads)
        began = time.perf_counter()
        record = executor.run_step(StreamBatches(trainer, batches, plan.training.num_microbatches), step=first)
        assert executor.weights.finished(), "a segment ends with every update made and nothing stashed"
        losses = executor.step_losses
        dist.all_reduce(losses)  # only output-stage ranks add a loss; each pipeline's losses are pre-scaled
        times = [began, *executor.step_done]
        for offset, loss in enumerate(losses.tolist()):
            if not math.isfinite(loss):
                raise RunError(f"step {first + offset + 1}: loss is {loss}; stopped (nothing saved): lower --lr")
        result.losses += losses.tolist()
        result.step_ms += [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
        last = (end - first - 1) * plan.training.num_microbatches
        at = record.began
        ops = [(name, at + a, at + b) for name, a, b in record.op_times if Op.parse(name).microbatch >= last]
        return [(end - 1, ops, times[-1], ())]

    def settle(self) -> list[TracedStep]:
        """A segment ends drained and checked: nothing is pending."""
        return []
