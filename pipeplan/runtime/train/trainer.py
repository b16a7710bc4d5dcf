"""One rank's trainer: its stages built from the plan, the executor over its op list, the gradient reductions
and the optimizer; the synchronous step (run the planned op list, all-reduce shared gradients, check the step
globally: loss, gradient norm, NaN/inf in step_checks.py, or after an eager step with --post-validate in
post_validate.py, then step the optimizer at the step's learning rate: optim.py); checkpoint save and restore.
A post-validated step is settled one step later (`run_step` settles the step before, `settle` the last one).
The run loop is train.py; the asynchronous step is asynchronous.py."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.artifact.plan import Plan
from pipeplan.errors import RunError
from pipeplan.precision import get_precision
from pipeplan.runtime.step.comm import make_direction_groups
from pipeplan.runtime.step.executor import Executor, MicroBatch
from pipeplan.runtime.step.grads import GradientSync
from pipeplan.runtime.step.messages import build_routing
from pipeplan.runtime.step.precision_run import LossScaler, apply_param_dtype, apply_wire_dtypes
from pipeplan.runtime.step.stages import StageTensors, build_pipeline_model
from pipeplan.runtime.step.zero import make_step_optimizer
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.optim import SGD_MOMENTUM, optimizer_factory, run_optimizer, run_schedule, state_keys
from pipeplan.runtime.train.post_validate import PostValidator, Settled
from pipeplan.runtime.train.run_notes import RunSource
from pipeplan.runtime.train.step_checks import GlobalState, apply_verdict, gather_rows, judge, local_row
from pipeplan.runtime.weights import checkpoint
from pipeplan.schedules.registry import schedule_info

OpTimes = list[tuple[str, float, float]]  # (op, start, end) of one step's ops on this rank, time.perf_counter() s
# (step, its op times, when its optimizer step ended, when its gradient exchange and its global checks ended (a
# synchronized step; () otherwise)): trace_io.write_trace
TracedStep = tuple[int, OpTimes, float, tuple[float, ...]]


@dataclass
class RunResult:
    rank: int
    losses: list[float] = field(default_factory=list)  # global mean loss per step run
    step_ms: list[float] = field(default_factory=list)
    first_step: int = 0
    grads: dict[str, torch.Tensor | None] | None = None  # after the first step's all-reduce (when asked for)
    optimizer_state_numel: int = 0  # elements of AdamW state this rank holds at the end (1/d of shared ones: zero=1)
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated over the run (None on CPU)
    grad_norms: list[float] = field(default_factory=list)  # global gradient norm per step run, before clipping
    rollbacks: int = 0  # --post-validate: eager optimizer steps undone (clipping, NaN/inf or overflow found after)
    redone: int = 0  # --post-validate: steps already started on undone weights, discarded and run again
    pairs: str | None = None  # how this rank ran its overlapped F&B pairs (overlap.PairRunner.describe), if any
    microbatch_grads: dict[int, dict[str, torch.Tensor]] | None = None  # async runs: per microbatch (when asked)
    saved_peak_bytes: int | None = None  # with RunConfig.track_saved: the most activation bytes held (executor's)
    cores: tuple[int, ...] | None = None  # the CPU cores the rank's process could run on (pinned: its block)


def microbatches_for(
    plan: Plan, rank: int, shard: MicroBatch, wanted: set[int], device: torch.device, param_dtype=torch.float32
) -> dict[int, MicroBatch]:
    """This rank's microbatches from its pipeline's shard of the global batch (`ModelSpec.shard_batches`: pipeline
    p's samples [p*M*b, (p+1)*M*b)): microbatch m is the shard's m-th run of b samples. Floating inputs take a low
    `param_dtype` (bf16 parameters get bf16 inputs)."""
    low = param_dtype if param_dtype != torch.float32 else None
    inputs, target = shard
    b, m = plan.training.microbatch_size, plan.training.num_microbatches
    found = inputs[0].shape[0] if inputs else target.shape[0]
    if found != m * b:
        raise RunError(f"pipeline {plan.ranks[rank].pipeline} got {found} samples of a step; the plan needs {m * b}")
    sliced: dict[int, MicroBatch] = {}
    for mb in wanted:
        lo = mb * b
        pieces = tuple(x[lo : lo + b].to(device, low if low and x.is_floating_point() else x.dtype) for x in inputs)
        sliced[mb] = (pieces, target[lo : lo + b].to(device))
    return sliced


class Trainer:
    def __init__(self, plan: Plan, config: RunConfig, *, rank: int, device: torch.device) -> None:
        self.plan, self.config, self.rank, self.device = plan, config, rank, device
        self.source: RunSource | None = None  # the plan as loaded and its file (`train` sets it): the trace's record
        self.model = build_pipeline_model(plan, rank, device, init_from=config.init_from)
        self.precision = get_precision(plan.training.precision)
        apply_param_dtype(self.model, self.precision)
        apply_wire_dtypes(self.model, self.precision, device.type)
        routing = build_routing(plan, self.model.stage_io, self.model.model_inputs, self.model.differentiable)
        # NCCL matches p2p in issue order per communicator: give each direction its own (see comm.py); on gloo
        # too by default (`RunConfig.direction_groups`): transfers both ways at once no longer share one pair's
        # connection (an asynchronous stream measured 1.7x slower on one pair; dualpipev 1.06-1.13x of
        # torch.distributed.pipelining on one, 1.00-1.05x with a pair per direction: bench_runtime (a), 3 runs)
        asynchronous = schedule_info(plan.schedule).asynchronous
        wanted = dist.get_backend() == "nccl" or config.direction_groups or asynchronous
        groups = make_direction_groups(routing) if wanted else None
        self.direction_groups = groups
        self.executor = Executor(
            plan, rank, self.model, routing, device, direction_groups=groups, overlap_pairs=config.overlap_pairs
        )
        self.executor.cuda_events = device.type == "cuda" and bool(config.trace_path)
        self.executor.track_saved = config.track_saved
        self.saved_peak_bytes = 0  # the most `Executor.held_activation_bytes` over the steps (track_saved)
        self.executor.autocast = lambda: self.precision.autocast(device.type)
        self.scaler = LossScaler() if self.precision.grad_scaler else None
        self.sync = GradientSync(plan, rank, self.model.stage_params, self.model.params)
        self.optimizer_name = run_optimizer(plan, self.model.spec, optimizer=config.optimizer, momentum=config.momentum)
        make = optimizer_factory(
            self.optimizer_name,
            self.model.spec,
            self.model.params,
            lr=plan.training.lr,
            weight_decay=plan.training.weight_decay,
            momentum=config.momentum if config.momentum is not None else SGD_MOMENTUM,
        )  # (the run's --lr, --weight-decay and --seed are in `plan`: train.run_plan)
        self.optimizer = make_step_optimizer(plan.training.zero, self.sync, self.model.params, make, rank)
        # zero=1: the optimizer state sharded over each group of ranks holding the same parameters (zero.py)
        self.schedule = run_schedule(self.model.spec, config)
        self.wanted = {f.microbatch for o in self.executor.ops for f in o.parts if f.kind == "F"}
        self.fingerprint = self.model.traced.layer_graph.fingerprint
        self.post_validator = (
            PostValidator(plan, device, self.optimizer, config.clip_grad_norm) if config.post_validate else None
        )  # --post-validate: step eagerly, check one step later (post_validate.py)
        self.inject_nan_at: int | None = None  # PIPEPLAN_FAULT mode=nan: a NaN gradient at this step
        self.last_state: GlobalState | None = None  # the last settled step's global loss and gradient norm
        self.settled: list[Settled] = []  # steps whose verdict is known, until `take_settled`
        self._op_times: dict[int, OpTimes] = {}  # step -> the op times of its last run
        self._tail_marks: dict[int, list[float]] = {}  # step -> when its exchange and its global checks ended

    def one_step(self, step: int, shard: MicroBatch) -> tuple[float, OpTimes]:
        """Run one training step and settle it before returning (no overlap with the next step); returns (global
        mean loss, this rank's op times). A non-finite loss or gradient anywhere stops every rank at this step with
        the weights as before it (fp16: every rank skips the step)."""
        self.run_step(step, shard)
        self.settle()
        ((settled, op_times, _),) = self.take_settled()
        return settled.state.loss, op_times

    def run_step(self, step: int, shard: MicroBatch) -> None:
        """Run step `step` up to its optimizer step: synchronized, checked globally and taken; post-validated, taken
        eagerly once the step before is settled (its verdict may undo the weights this step's passes ran on: then
        they run again). A stop raises RunError on every rank with the weights as before the stopped step."""
        record = self._gradients(step, shard)
        validator = self.post_validator
        if validator is not None and validator.pending is not None and self._settle().rolled_back:
            validator.redone += 1
            record = self._gradients(step, shard)
        self.schedule.apply(self.optimizer.optimizer, step)
        row = self._local_row(record)
        if validator is not None:
            validator.step_eagerly(step, row, self.scaler)
        else:
            self.last_state = self._synchronized_update(step, row)
            self.settled.append(Settled(step, self.last_state, time.perf_counter(), rolled_back=False))

    def settle(self) -> None:
        """Learn the verdict of a post-validated step still pending and carry it out (nothing otherwise)."""
        if self.post_validator is not None and self.post_validator.pending is not None:
            self._settle()

    def _settle(self) -> Settled:
        validator = self.post_validator
        assert validator is not None and validator.pending is not None, "_settle runs with a step pending"
        self.schedule.apply(self.optimizer.optimizer, validator.pending.step)  # a rolled-back step: again at its lr
        settled = validator.settle(self.scaler)
        self.last_state = settled.state
        self.settled.append(settled)
        return settled

    def take_settled(self) -> list[tuple[Settled, OpTimes, tuple[float, ...]]]:
        """The steps settled since the last call, in order, each with its op times and its tail's marks (when its
        gradient exchange and its global checks ended: a synchronized step's; () otherwise)."""
        taken = [(s, self._op_times.pop(s.step), tuple(self._tail_marks.pop(s.step, ()))) for s in self.settled]
        self.settled = []
        return taken

    def _gradients(self, step: int, shard: MicroBatch):
        """The step's forward and backward passes, then the gradient reductions among each parameter's holders."""
        self.optimizer.zero_grad()
        if self.scaler is not None:
            self.executor.loss_grad = self.scaler.scale
        pieces = microbatches_for(self.plan, self.rank, shard, self.wanted, self.device, self.precision.param_dtype)
        record = self.executor.run_step(pieces, step=step)
        self.saved_peak_bytes = max(self.saved_peak_bytes, record.saved_peak_bytes)
        self._op_times[step] = [(name, record.began + a, record.began + b) for name, a, b in record.op_times]
        if self.inject_nan_at == step:
            _poison_a_gradient(self.model.params)
        self.optimizer.reduce_gradients()
        self._tail_marks[step] = [time.perf_counter()]
        return record

    def _local_row(self, record) -> torch.Tensor:
        """This rank's contribution to the global checks (fp16: of the unscaled gradients)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer.grads())
        return local_row(record.loss_sum, self.optimizer.owned_grads(), self.device)

    def _synchronized_update(self, step: int, row: torch.Tensor) -> GlobalState:
        """Wait for every rank's row (one all-gather), then step as the global state says (step_checks.py)."""
        state = GlobalState.from_table(gather_rows(row))  # only output-stage ranks add a loss, pre-scaled
        self._tail_marks[step].append(time.perf_counter())
        verdict = judge(state, step=step, max_norm=self.config.clip_grad_norm, loss_scaling=self.scaler is not None)
        apply_verdict(verdict, self.optimizer, self.scaler)
        return state

    def grads(self) -> dict[str, torch.Tensor | None]:
        """Every held parameter's summed gradient (collective under zero=1: every rank calls it)."""
        return self.optimizer.full_grads()

    def save(self, step: int) -> None:
        """Pipeline 0's first replica of each stage writes it; rank 0 publishes `latest` once all are written."""
        root = self.config.checkpoint_dir
        assert root is not None, "a run saves checkpoints only with --checkpoint-dir"
        info = self.plan.ranks[self.rank]
        writes = info.pipeline == 0 and info.stage_replica == 0
        wanted = {n for stage in info.stages for n in self.model.stage_params[stage]} if writes else set()
        states = self.optimizer.gathered_states(wanted)  # collective under zero=1
        if writes:
            for stage in info.stages:
                names = self.model.stage_params[stage]
                checkpoint.save_stage(
                    root,
                    step=step,
                    stage=stage,
                    names=names,
                    params=self.model.params,
                    buffers=dict(self.model.modules[stage].named_buffers()),
                    optimizer_states=states,
                    fingerprint=self.fingerprint,
                    partition=checkpoint.partition_key(self.plan),
                    num_stages=len(self.plan.stages),
                )
        dist.barrier()
        if self.rank == 0:  # a resumed run started from what the run it resumes started from
            start = self.config.init_from or (checkpoint.recorded_init_from(root) if self.config.resume else None)
            checkpoint.mark_latest(root, step, self.plan, start)
        dist.barrier()

    def restore(self) -> int:
        """Load this rank's stages of the newest checkpoint, each stage file checked whole first (the launcher
        checked every stage already; a rank under torchrun checks its own)."""
        root = self.config.checkpoint_dir
        assert root is not None, "a run resumes only with --checkpoint-dir"
        step = checkpoint.latest_step(root)
        checkpoint.check_complete(root, step, len(self.plan.stages))
        keys = state_keys(self.optimizer_name, self.config.momentum)
        states: dict[str, dict[str, Any]] = {}
        for stage in self.plan.ranks[self.rank].stages:
            buffers = dict(self.model.modules[stage].named_buffers())
            held = StageTensors(
                {
                    n: (tuple(self.model.params[n].shape), self.model.params[n].dtype)
                    for n in self.model.stage_params[stage]
                },
                {name: tuple(value.shape) for name, value in buffers.items()},
            )
            (expected,) = checkpoint.expected_stages(self.plan, [held], keys, step)
            expected = dataclasses.replace(expected, fingerprint=self.fingerprint)
            states |= checkpoint.load_stage(
                root, stage=stage, expected=expected, params=self.model.params, buffers=buffers
            )
        self.optimizer.load_states(states)
        return step


def _poison_a_gradient(params: dict[str, torch.nn.Parameter]) -> None:
    """PIPEPLAN_FAULT mode=nan: one element of this rank's first gradient (by name) becomes NaN."""
    name = next(n for n in sorted(params) if params[n].grad is not None)
    grad = params[name].grad
    assert grad is not None
    grad[(0,) * grad.dim()] = float("nan")


class SynchronousSteps:
    """The step strategy of schedules that flush (train.train): one step at a time, each a segment of its own; the
    step ends with every rank's gradients checked globally and the optimizer step (Trainer.run_step), or with
    --post-validate with the eager optimizer step, checked during the next step (`settle` before anything that
    needs the settled weights)."""

    def __init__(self, trainer: Trainer, result: RunResult, *, capture_grads: bool) -> None:
        self.trainer, self.result, self.capture_grads = trainer, result, capture_grads
        self.last_end: float | None = None  # when the last recorded step ended on this rank

    @staticmethod
    def check(plan: Plan, config: RunConfig) -> None:
        """Nothing a synchronous plan cannot run with (launch.py checks the options up front)."""

    def segments(self, start: int) -> list[tuple[int, int]]:
        return [(step, step + 1) for step in range(start, self.trainer.config.steps)]

    def check_due(self, end: int) -> bool:
        """--check-every counts steps."""
        return end % self.trainer.config.check_every == 0

    def run(self, first: int, end: int, batches: Iterator) -> list[TracedStep]:
        """Run step `first` (the segment [first, first + 1)); record the steps settled by now (post-validated: the
        step before) and the gradients after the run's first step when asked. Returns the settled steps' times."""
        (step,) = range(first, end)
        if self.last_end is None:
            self.last_end = time.perf_counter()
        self.trainer.run_step(step, next(batches))
        if self.capture_grads and step == self.result.first_step:
            self.trainer.settle()  # (tests) the gradients as the settled step used them
            self.result.grads = self.trainer.grads()
        return self._record()

    def settle(self) -> list[TracedStep]:
        """Settle the step still pending (post-validated runs) and record it."""
        self.trainer.settle()
        return self._record()

    def _record(self) -> list[TracedStep]:
        """Each settled step's loss, gradient norm and time: the interval since the step before ended on this rank
        (the first one's since the run began), so that steps overlapping under --post-validate count the period."""
        traced: list[TracedStep] = []
        for settled, op_times, marks in self.trainer.take_settled():
            self.result.losses.append(settled.state.loss)
            self.result.grad_norms.append(settled.state.grad_norm)
            assert self.last_end is not None, "run() starts the clock before any step settles"
            self.result.step_ms.append((settled.ended - self.last_end) * 1000.0)
            self.last_end = settled.ended
            traced.append((settled.step, op_times, settled.ended, marks if len(marks) == 2 else ()))
        return traced
