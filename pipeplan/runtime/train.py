"""The training loop each rank runs (inside an initialized process group): build the rank's stages, then per
step draw the global batch, run the planned op list, all-reduce shared gradients, check the step globally (loss,
gradient norm, NaN/inf: step_checks.py; after an eager step with --post-validate: post_validate.py), step AdamW, log
on rank 0, and write checkpoints and the measured trace."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeplan.console import out, warn
from pipeplan.errors import RunError
from pipeplan.plan.plan import Plan
from pipeplan.precision import get_precision
from pipeplan.runtime import checkpoint
from pipeplan.runtime.comm import make_direction_groups
from pipeplan.runtime.config import FaultSpec, RunConfig
from pipeplan.runtime.executor import Executor, MicroBatch
from pipeplan.runtime.grads import GradientSync
from pipeplan.runtime.post_validate import PostValidator
from pipeplan.runtime.precision_run import (
    LossScaler,
    apply_param_dtype,
    apply_wire_dtypes,
    gather_peak_memory,
    memory_versus,
)
from pipeplan.runtime.routing import build_routing
from pipeplan.runtime.stages import build_pipeline_model
from pipeplan.runtime.step_checks import GlobalState, apply_verdict, clip_coefficient, gather_rows, judge, local_row
from pipeplan.runtime.trace_io import write_trace
from pipeplan.runtime.zero import make_step_optimizer
from pipeplan.schedules.registry import schedule_info
from pipeplan.units import format_gib


@dataclass
class RunResult:
    rank: int
    losses: list[float] = field(default_factory=list)  # global mean loss per step run
    step_ms: list[float] = field(default_factory=list)
    first_step: int = 0
    grads: dict[str, torch.Tensor] | None = None  # after the first step's all-reduce (when asked for)
    optimizer_state_numel: int = 0  # elements of AdamW state this rank holds at the end (1/d of shared ones: zero=1)
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated over the run (None on CPU)
    grad_norms: list[float] = field(default_factory=list)  # global gradient norm per step run, before clipping
    rollbacks: int = 0  # --post-validate: eager optimizer steps undone (clipping, NaN/inf or overflow found after)
    microbatch_grads: dict[int, dict[str, torch.Tensor]] | None = None  # async runs: per microbatch (when asked)


def microbatches_for(
    plan: Plan, rank: int, batch: MicroBatch, wanted: set[int], device: torch.device, param_dtype=torch.float32
) -> dict[int, MicroBatch]:
    """This rank's slices of the global batch: pipeline p owns samples [p*M*b, (p+1)*M*b), microbatch m of it
    the m-th run of b samples. Floating inputs take a low `param_dtype` (bf16 parameters get bf16 inputs)."""
    low = param_dtype if param_dtype != torch.float32 else None
    inputs, target = batch
    b, m = plan.training.microbatch_size, plan.training.num_microbatches
    base = plan.ranks[rank].pipeline * m * b
    found = inputs[0].shape[0] if inputs else target.shape[0]
    if found != plan.training.global_batch_size:
        raise RunError(
            f"the model's data gave a batch of {found} samples; the plan needs {plan.training.global_batch_size}"
        )
    sliced: dict[int, MicroBatch] = {}
    for mb in wanted:
        lo = base + mb * b
        pieces = tuple(x[lo : lo + b].to(device, low if low and x.is_floating_point() else x.dtype) for x in inputs)
        sliced[mb] = (pieces, target[lo : lo + b].to(device))
    return sliced


def _adamw(plan: Plan, config: RunConfig):
    """AdamW over given tensors with the run's learning rate and weight decay."""
    if plan.training.optimizer.lower() != "adamw":
        raise RunError(f"plan optimizer {plan.training.optimizer!r} is not supported; pipeplan run trains with adamw")
    lr = config.lr if config.lr is not None else plan.training.lr
    decay = config.weight_decay if config.weight_decay is not None else plan.training.weight_decay
    return lambda tensors: torch.optim.AdamW(tensors, lr=lr, weight_decay=decay)


class Trainer:
    def __init__(self, plan: Plan, config: RunConfig, *, rank: int, device: torch.device) -> None:
        self.plan, self.config, self.rank, self.device = plan, config, rank, device
        self.model = build_pipeline_model(plan, rank, device, init_from=config.init_from)
        self.precision = get_precision(plan.training.precision)
        apply_param_dtype(self.model, self.precision)
        apply_wire_dtypes(self.model, self.precision, device.type)
        routing = build_routing(plan, self.model.stage_io, self.model.model_inputs, self.model.differentiable)
        # NCCL matches p2p in issue order per communicator: give each direction its own (see comm.py)
        groups = make_direction_groups(routing) if dist.get_backend() == "nccl" or config.direction_groups else None
        self.direction_groups = groups
        self.executor = Executor(plan, rank, self.model, routing, device, direction_groups=groups)
        self.executor.cuda_events = device.type == "cuda" and bool(config.trace_path)
        self.executor.autocast = lambda: self.precision.autocast(device.type)
        self.scaler = LossScaler() if self.precision.grad_scaler else None
        self.sync = GradientSync(plan, rank, self.model.stage_params, self.model.params)
        self.optimizer = make_step_optimizer(
            plan.training.zero, self.sync, self.model.params, _adamw(plan, config), rank
        )  # zero=1: AdamW state sharded over each group of ranks holding the same parameters (zero.py)
        self.wanted = {o.microbatch for o in self.executor.ops if o.kind == "F"}
        self.fingerprint = self.model.traced.layer_graph.fingerprint
        self.post_validator = (
            PostValidator(plan, rank, device, self.optimizer, config.clip_grad_norm) if config.post_validate else None
        )  # --post-validate: step eagerly, check after (post_validate.py)
        self.inject_nan_at: int | None = None  # PIPEPLAN_FAULT mode=nan: a NaN gradient at this step
        self.last_state: GlobalState | None = None  # the last step's global loss and gradient norm

    def one_step(self, step: int, batch: MicroBatch) -> tuple[float, list[tuple[str, float, float]]]:
        """Run one training step; returns (global mean loss, this rank's op times). A non-finite loss or gradient
        anywhere stops every rank at this step with the weights as before it (fp16: every rank skips the step)."""
        record = self._gradients(step, batch)
        row = self._local_row(record)
        if self.post_validator is not None:
            self.last_state = self.post_validator.update(step, row, self.scaler)
        else:
            self.last_state = self._synchronized_update(step, row)
        return self.last_state.loss, record.op_times

    def _gradients(self, step: int, batch: MicroBatch):
        """The step's forward and backward passes, then the gradient reductions among each parameter's holders."""
        self.optimizer.zero_grad()
        if self.scaler is not None:
            self.executor.loss_grad = self.scaler.scale
        pieces = microbatches_for(self.plan, self.rank, batch, self.wanted, self.device, self.precision.param_dtype)
        record = self.executor.run_step(pieces, step=step)
        if self.inject_nan_at == step:
            _poison_a_gradient(self.model.params)
        self.optimizer.reduce_gradients()
        return record

    def _local_row(self, record) -> torch.Tensor:
        """This rank's contribution to the global checks (fp16: of the unscaled gradients)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer.grads())
        return local_row(record.loss_sum, self.optimizer.owned_grads(), self.device)

    def _synchronized_update(self, step: int, row: torch.Tensor) -> GlobalState:
        """Wait for every rank's row (one all-gather), then step as the global state says (step_checks.py)."""
        state = GlobalState.from_table(gather_rows(row))  # only output-stage ranks add a loss, pre-scaled
        verdict = judge(state, step=step, max_norm=self.config.clip_grad_norm, loss_scaling=self.scaler is not None)
        apply_verdict(verdict, self.optimizer, self.scaler)
        return state

    def grads(self) -> dict[str, torch.Tensor]:
        """Every held parameter's summed gradient (collective under zero=1: every rank calls it)."""
        return self.optimizer.full_grads()

    def save(self, step: int) -> None:
        """Pipeline 0's first replica of each stage writes it; rank 0 publishes `latest` once all are written."""
        root = self.config.checkpoint_dir
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
        if self.rank == 0:
            checkpoint.mark_latest(root, step)
        dist.barrier()

    def restore(self) -> int:
        step = checkpoint.latest_step(self.config.checkpoint_dir)
        checkpoint.check_complete(self.config.checkpoint_dir, step, len(self.plan.stages))
        states = {}
        for stage in self.plan.ranks[self.rank].stages:
            states |= checkpoint.load_stage(
                self.config.checkpoint_dir,
                step=step,
                stage=stage,
                params=self.model.params,
                buffers=dict(self.model.modules[stage].named_buffers()),
                fingerprint=self.fingerprint,
                partition=checkpoint.partition_key(self.plan),
            )
        self.optimizer.load_states(states)
        return step


def train(
    plan: Plan, config: RunConfig, *, rank: int, device: torch.device, capture_grads: bool = False, watchdog=None
) -> RunResult:
    if schedule_info(plan.schedule).asynchronous:  # a stream without flushes (runtime/asynchronous.py)
        from pipeplan.runtime.asynchronous import train_async

        return train_async(plan, config, rank=rank, device=device, capture_grads=capture_grads, watchdog=watchdog)
    trainer = Trainer(plan, config, rank=rank, device=device)
    start = trainer.restore() if config.resume else 0
    result = RunResult(rank=rank, first_step=start)
    if start >= config.steps and rank == 0:
        warn(f"the checkpoint is at step {start} >= --steps {config.steps}: no step to run")
    fault = FaultSpec.from_env()
    batches = trainer.model.spec.batches(plan.training.global_batch_size, plan.training.seed)
    for _ in range(start):  # the same data order as an uninterrupted run
        next(batches)
    last_times: list[tuple[str, float, float]] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start, config.steps):
        _maybe_fail(fault, rank, step, watchdog, trainer)
        batch = next(batches)
        began = time.perf_counter()
        loss, last_times = trainer.one_step(step, batch)
        step_ms = (time.perf_counter() - began) * 1000.0
        result.losses.append(loss)
        result.step_ms.append(step_ms)
        result.grad_norms.append(trainer.last_state.grad_norm)
        if capture_grads and step == start:
            result.grads = trainer.grads()
        if not config.quiet and config.log_every and (step + 1) % config.log_every == 0:
            peaks = gather_peak_memory(device)  # every rank takes part (one small all_gather on CUDA)
            if rank == 0:
                _log_step(plan, step, loss, step_ms, peaks)
        if config.check_every and (step + 1) % config.check_every == 0:
            trainer.sync.check_in_sync(step)
        if config.checkpoint_dir and _checkpoint_due(config, step):
            trainer.save(step + 1)
    if config.check_every:
        trainer.sync.check_in_sync(config.steps - 1)
    result.optimizer_state_numel = trainer.optimizer.state_numel()
    result.rollbacks = trainer.post_validator.rollbacks if trainer.post_validator is not None else 0
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    if config.trace_path:
        write_trace(config.trace_path, rank, last_times, world_size=plan.world_size)
    if not config.quiet and result.step_ms:
        peaks = gather_peak_memory(device)
        if rank == 0:
            _log_summary(plan, result.step_ms, peaks)
            _log_checks(config, result)
    return result


def _checkpoint_due(config: RunConfig, step: int) -> bool:
    if step + 1 == config.steps:
        return True
    return bool(config.checkpoint_every) and (step + 1) % config.checkpoint_every == 0


def _maybe_fail(fault: FaultSpec | None, rank: int, step: int, watchdog, trainer: Trainer) -> None:
    if fault is None or fault.rank != rank or fault.step != step:
        return
    print(f"pipeplan rank {rank}: injected fault ({fault.mode}) at step {step}", file=sys.stderr, flush=True)
    if fault.mode == "exit":
        os._exit(1)
    if fault.mode == "nan":
        trainer.inject_nan_at = step
        return
    if fault.mode == "diverge":
        shared = trainer.sync.shared_names
        assert shared, "mode=diverge needs a rank holding a replicated or tied parameter"
        with torch.no_grad():
            trainer.model.params[shared[0]].add_(1e-3)
        return
    if fault.mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if watchdog is not None:
        watchdog.freeze()
    while True:
        time.sleep(3600)


def _poison_a_gradient(params: dict[str, torch.nn.Parameter]) -> None:
    """PIPEPLAN_FAULT mode=nan: one element of this rank's first gradient (by name) becomes NaN."""
    name = next(n for n in sorted(params) if params[n].grad is not None)
    grad = params[name].grad
    grad[(0,) * grad.dim()] = float("nan")


def _log_checks(config: RunConfig, result: RunResult) -> None:
    """How often --clip-grad-norm clipped and --post-validate rolled back."""
    steps = len(result.grad_norms)
    if config.clip_grad_norm is not None:
        clipped = sum(clip_coefficient(norm, config.clip_grad_norm) < 1.0 for norm in result.grad_norms)
        out.print(f"clipped {clipped} of {steps} steps (--clip-grad-norm {config.clip_grad_norm:g})", highlight=False)
    if config.post_validate:
        rolled = f"post-validate: {result.rollbacks} of {steps} eager optimizer steps rolled back and redone"
        out.print(rolled, highlight=False)


def _log_step(plan: Plan, step: int, loss: float, step_ms: float, peaks: list[int] | None = None) -> None:
    samples = plan.training.global_batch_size / (step_ms / 1000.0)
    tokens = f"  tokens/s {samples * plan.model.tokens_per_sample:,.0f}" if plan.model.tokens_per_sample else ""
    predicted = plan.predicted.step_ms
    versus = f"  predicted {predicted:.1f} ms ({step_ms / predicted:.2f}x)" if predicted > 0 else ""
    memory = memory_versus(plan, peaks)
    versus += f"  mem GiB {memory}" if memory else ""
    out.print(
        f"step {step + 1:>5}  loss {loss:.4f}  step {step_ms:8.1f} ms  samples/s {samples:,.1f}{tokens}{versus}",
        highlight=False,
        soft_wrap=True,
    )


def _log_summary(plan: Plan, step_ms: list[float], peaks: list[int] | None = None) -> None:
    timed = step_ms[1:] if len(step_ms) > 1 else step_ms  # the first step includes warm-up
    median = statistics.median(timed)
    predicted = plan.predicted.step_ms
    versus = (
        f" vs predicted {predicted:.1f} ms; measured/predicted {median / predicted:.2f}"
        if predicted > 0
        else " (the plan has no prediction)"
    )
    out.print(f"summary: median step {median:.1f} ms over {len(timed)} steps{versus}", highlight=False, soft_wrap=True)
    if peaks is None:
        out.print("peak memory: not measured on CPU (CUDA runs report each rank's)", highlight=False)
        return
    predicted = plan.predicted.peak_memory_bytes
    for rank, peak in enumerate(peaks):
        expected = predicted[rank] if rank < len(predicted) else 0
        versus = f" vs predicted {format_gib(expected)} GiB ({peak / expected:.2f}x)" if expected > 0 else ""
        measured = f"rank {rank}: peak memory {format_gib(peak)} GiB (torch.cuda.max_memory_allocated)"
        out.print(measured + versus, highlight=False)
