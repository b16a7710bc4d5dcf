"""The training loop each rank runs (inside an initialized process group), one for every schedule: build the rank's
trainer (trainer.py), then run the steps as segments through the schedule's step strategy and, between segments,
inject the test faults, log on rank 0, compare shared weights across ranks and write checkpoints; at the end write
the measured trace (the last --trace-steps steps on one clock per rank) and the summary.

A step strategy says what a segment of steps is and does (`StepStrategy`): a synchronous schedule runs one step per
segment and checks every step globally (trainer.SynchronousSteps); an asynchronous one runs a stream of steps
without flushes, cut only at checkpoints (asynchronous.AsynchronousSteps). Under --post-validate a step is settled
during the next one, so nothing between steps waits for other ranks: steps are logged once settled, and the run
settles the pending step only where it needs settled weights (the --check-every comparison, a checkpoint, the end).
A step's time is the interval between consecutive step ends on the rank (the end of its optimizer step): with
overlapping steps that is the period."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from pipeplan.artifact.plan import Plan
from pipeplan.console import out, warn
from pipeplan.runtime.step.precision_run import gather_peak_memory, memory_versus
from pipeplan.runtime.train.asynchronous import AsynchronousSteps
from pipeplan.runtime.train.config import FaultSpec, RunConfig
from pipeplan.runtime.train.metrics import MetricsLog, step_record
from pipeplan.runtime.train.optim import run_plan
from pipeplan.runtime.train.run_notes import RunSource, run_notes
from pipeplan.runtime.train.step_checks import clip_coefficient
from pipeplan.runtime.train.trace_io import write_trace
from pipeplan.runtime.train.trainer import RunResult, SynchronousSteps, TracedStep, Trainer
from pipeplan.schedules.registry import schedule_info
from pipeplan.units import format_gib


class StepStrategy(Protocol):
    """What a segment of steps [first, end) is and does, for `train`."""

    def segments(self, start: int) -> list[tuple[int, int]]:
        """The [first, end) step ranges from `start` to --steps, in order."""
        ...

    def check_due(self, end: int) -> bool:
        """Whether shared weights are compared across ranks after the segment ending at `end` (--check-every)."""
        ...

    def run(self, first: int, end: int, batches: Iterator) -> list[TracedStep]:
        """Run the segment, drawing one global batch per step; append each settled step's global loss and step time
        (and what else it records) to the result. Returns the settled steps with this rank's op times."""
        ...

    def settle(self) -> list[TracedStep]:
        """Settle and record whatever step is still pending (before checks, checkpoints and the end)."""
        ...


def train(  # noqa: PLR0913
    plan: Plan,
    config: RunConfig,
    *,
    rank: int,
    device: torch.device,
    capture_grads: bool = False,
    watchdog=None,
    plan_path: str | None = None,
) -> RunResult:
    """Run `plan` (loaded from `plan_path`: the trace names it) on this rank; its result."""
    loaded = plan
    plan = run_plan(plan, config)  # --seed, --lr and --weight-decay in place of the plan's
    strategy = AsynchronousSteps if schedule_info(plan.schedule).asynchronous else SynchronousSteps
    strategy.check(plan, config)  # before building anything
    trainer = Trainer(plan, config, rank=rank, device=device)
    trainer.source = RunSource(plan=loaded, path=plan_path)
    start = trainer.restore() if config.resume else 0
    result = RunResult(rank=rank, first_step=start)
    steps: StepStrategy = strategy(trainer, result, capture_grads=capture_grads)
    if start >= config.steps and rank == 0:
        warn(f"the checkpoint is at step {start} >= --steps {config.steps}: no step to run")
    shard = (plan.ranks[rank].pipeline, plan.training.data_parallel)  # this pipeline's part of each global batch
    batches = trainer.model.spec.shard_batches(plan.training.global_batch_size, plan.training.seed, shard)
    for _ in range(start):  # the same data order as an uninterrupted run
        next(batches)
    metrics = MetricsLog(config.log_path, config.tensorboard_dir, start=start) if rank == 0 else None
    try:
        _run_segments(trainer, steps, result, batches, start, watchdog, metrics)
    finally:
        if metrics is not None:
            metrics.close()
    return result


def _run_segments(trainer: Trainer, steps: StepStrategy, result: RunResult, batches, start, watchdog, metrics) -> None:
    """The run from step `start` on: its segments, the checks and checkpoints between them, the end of the run."""
    config, rank, device = trainer.config, trainer.rank, trainer.device
    fault = FaultSpec.from_env()
    traced: list[TracedStep] = []
    checked = None  # the step after which shared weights were last compared
    logged = start  # the first step not logged yet
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()  # the trace's one clock: every rank leaves the barrier at about the same time
    origin = time.perf_counter()
    for first, end in steps.segments(start):
        for step in range(first, end):  # (a stream has no step boundary to stop at: faults fire at its start)
            _maybe_fail(fault, rank, step, watchdog, trainer)
        traced += steps.run(first, end, batches)
        check = bool(config.check_every) and steps.check_due(end)
        save = bool(config.checkpoint_dir) and _checkpoint_due(config, end - 1)
        if check or save:  # both need the settled weights
            traced += steps.settle()
        logged = _log_steps(trainer, result, logged, metrics)
        if check:
            trainer.sync.check_in_sync(checked := end - 1)
        if save:
            trainer.save(end)
        del traced[: -config.trace_steps]
    traced += steps.settle()
    _log_steps(trainer, result, logged, metrics)
    if config.check_every and checked != config.steps - 1:
        trainer.sync.check_in_sync(config.steps - 1)
    _finish(trainer, result, traced[-config.trace_steps :], origin)
    _maybe_fail(fault, rank, config.steps, watchdog, trainer)  # step = --steps: in the shutdown, after the summary


def _finish(trainer: Trainer, result: RunResult, traced: list[TracedStep], origin: float) -> None:
    """What the run leaves: optimizer state size, rollbacks and peak memory in the result, the measured trace of
    the last steps, the summary lines."""
    plan, config, rank, device = trainer.plan, trainer.config, trainer.rank, trainer.device
    source = trainer.source or RunSource(plan=plan)
    result.optimizer_state_numel = trainer.optimizer.state_numel()
    if config.track_saved:
        result.saved_peak_bytes = trainer.saved_peak_bytes
    if trainer.post_validator is not None:
        result.rollbacks, result.redone = trainer.post_validator.rollbacks, trainer.post_validator.redone
    if trainer.executor.pairs is not None:
        result.pairs = trainer.executor.pairs.describe()
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    gathered: list = [None] * plan.world_size  # every rank's median step time and F&B pairs
    if result.step_ms:  # --quiet drops only the per-step lines
        dist.all_gather_object(gathered, (_median_step(result.step_ms), result.pairs))
    predicted = predicted_ms(plan, bool(config.post_validate))
    measured = max(period for period, _ in gathered) if result.step_ms else 0.0
    if config.trace_path:
        run = source.record(config, device.type, measured_ms=measured, predicted_ms=predicted) if rank == 0 else None
        write_trace(config.trace_path, rank, traced, origin=origin, world_size=plan.world_size, run=run)
    if result.step_ms:
        peaks = gather_peak_memory(device)
        if rank == 0:
            _log_summary(plan, predicted, result.step_ms, [period for period, _ in gathered], peaks)
            for line in run_notes(source, config, device.type, measured, predicted):
                out.print(line, highlight=False, soft_wrap=True)
            _log_checks(config, result)
            for rank_of, (_, pairs) in enumerate(gathered):
                if pairs is not None:
                    out.print(f"rank {rank_of}: F&B pairs ran {pairs}", highlight=False, soft_wrap=True)


def _log_steps(trainer: Trainer, result: RunResult, logged: int, metrics: MetricsLog | None) -> int:
    """Rank 0 writes every step recorded since step `logged` to --log and prints every --log-every'th (every rank
    takes part in reading peaks, except under --post-validate: a collective between steps would wait for the
    slowest rank). Returns the first step not logged yet."""
    config, plan = trainer.config, trainer.plan
    predicted = predicted_ms(plan, bool(config.post_validate)) if metrics is not None else 0.0
    done = result.first_step + len(result.losses)
    index = {step: step - result.first_step for step in range(logged, done)}  # result.losses[index[step]] is step's
    for step, at in index.items() if metrics is not None else ():
        norm = result.grad_norms[at] if len(result.grad_norms) == len(result.losses) else None
        record = step_record(
            step=step,
            loss=result.losses[at],
            lr=plan.training.lr * trainer.schedule.factor(step),
            grad_norm=norm,
            step_ms=result.step_ms[at],
            samples=plan.training.global_batch_size,
            tokens=plan.model.tokens_per_sample,
            predicted_ms=predicted,
        )
        assert metrics is not None  # (the loop runs only with --log)
        metrics.write(record)
    if config.quiet or not config.log_every:
        return done
    due = [step for step in index if (step + 1) % config.log_every == 0]
    if not due:
        return done
    peaks = None if config.post_validate else gather_peak_memory(trainer.device)  # one small all_gather on CUDA
    if trainer.rank == 0:
        predicted = predicted_ms(plan, bool(config.post_validate))
        for step in due:
            lr = plan.training.lr * trainer.schedule.factor(step)
            _log_step(plan, predicted, step, result.losses[index[step]], lr, result.step_ms[index[step]], peaks)
    return done


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


def _log_checks(config: RunConfig, result: RunResult) -> None:
    """How often --clip-grad-norm clipped and --post-validate rolled back."""
    steps = len(result.grad_norms)
    if config.clip_grad_norm is not None:
        clipped = sum(clip_coefficient(norm, config.clip_grad_norm) < 1.0 for norm in result.grad_norms)
        out.print(f"clipped {clipped} of {steps} steps (--clip-grad-norm {config.clip_grad_norm:g})", highlight=False)
    if config.post_validate:
        rolled = f"post-validate: {result.rollbacks} of {steps} eager optimizer steps rolled back and redone"
        rolled += f"; {result.redone} steps already started on their weights run again" if result.redone else ""
        out.print(rolled, highlight=False)


def _log_step(  # noqa: PLR0913
    plan: Plan, predicted: float, step: int, loss: float, lr: float, step_ms: float, peaks: list[int] | None = None
) -> None:
    """One step's line (`predicted`: the plan's step for the setting run, `predicted_ms`)."""
    samples = plan.training.global_batch_size / (step_ms / 1000.0)
    tokens = f"  tokens/s {samples * plan.model.tokens_per_sample:,.0f}" if plan.model.tokens_per_sample else ""
    versus = f"  predicted {predicted:.1f} ms ({step_ms / predicted:.2f}x)" if predicted > 0 else ""
    memory = memory_versus(plan, peaks)
    versus += f"  mem GiB {memory}" if memory else ""
    rates = f"samples/s {samples:,.1f}{tokens}{versus}"
    out.print(
        f"step {step + 1:>5}  loss {loss:.6g}  lr {lr:.3g}  step {step_ms:8.1f} ms  {rates}",
        highlight=False,
        soft_wrap=True,
    )


def _median_step(step_ms: list[float]) -> float:
    """A rank's measured step: the median of its step times (intervals between step ends), the first step (warm-up)
    left out when there are more."""
    return statistics.median(step_ms[1:] if len(step_ms) > 1 else step_ms)


def _log_summary(
    plan: Plan, predicted: float, step_ms: list[float], periods: list[float], peaks: list[int] | None = None
) -> None:
    median = max(periods)
    slowest = periods.index(median)
    timed = len(step_ms) - 1 if len(step_ms) > 1 else 1
    versus = (
        f" vs predicted {predicted:.1f} ms; measured/predicted {median / predicted:.2f}"
        if predicted > 0
        else " (the plan has no prediction)"
    )
    what = f"median step {median:.1f} ms over {timed} steps (the interval between step ends, rank {slowest}'s, slowest)"
    out.print(f"summary: {what}{versus}", highlight=False, soft_wrap=True)
    if peaks is None:
        out.print("peak memory: not measured on CPU (CUDA runs report each rank's)", highlight=False)
        return
    predicted_peaks = plan.predicted.peak_memory_bytes
    for rank, peak in enumerate(peaks):
        expected = predicted_peaks[rank] if rank < len(predicted_peaks) else 0
        versus = f" vs predicted {format_gib(expected)} GiB ({peak / expected:.2f}x)" if expected > 0 else ""
        measured = f"rank {rank}: peak memory {format_gib(peak)} GiB (torch.cuda.max_memory_allocated)"
        out.print(measured + versus, highlight=False)


def predicted_ms(plan: Plan, post_validate: bool) -> float:
    """The plan's predicted step for the setting run: its stored period, or, when --post-validate or
    --no-post-validate differs from the plan's, the period of the other setting (`artifact.timing.plan_step_ms`: the
    search's `predict.predict` again)."""
    if post_validate == plan.training.post_validate or schedule_info(plan.schedule).asynchronous:
        return plan.predicted.step_ms
    from pipeplan.artifact.timing import plan_step_ms

    return plan_step_ms(plan, post_validate=post_validate)
