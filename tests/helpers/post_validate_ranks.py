"""Rank side of test_post_validate's direct runs: each rank builds a `Trainer` and steps it itself, so a test can put a
NaN into one rank's gradient at a given step, force fp16-style loss scaling (runtime LossScaler) on the CPU, and read
back every rank's parameters and full optimizer state after a run that stopped. `run_cases` starts the ranks through
torch's elastic launcher (as the benchmarks do) and returns {label: [outcome of rank 0, rank 1, ...]}."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeplan.artifact.plan import Plan
from pipeplan.errors import RunError
from pipeplan.runtime.step.precision_run import LossScaler
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.trainer import Trainer


@dataclass(frozen=True)
class Case:
    label: str
    plan_path: str
    config: RunConfig
    nan_at: tuple[int, int] | None = None  # (rank, step): that rank's first gradient gets a NaN after that backward
    loss_scale: float | None = None  # run with LossScaler(init_scale=this), as fp16-mixed does on CUDA


@dataclass
class Outcome:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    error: str | None = None  # the RunError that stopped the run
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    states: dict[str, dict] = field(default_factory=dict)  # full per-parameter optimizer state
    rollbacks: int = 0
    redone: int = 0  # post-validated: started steps discarded and run again after a rollback
    skipped_steps: int = 0  # loss scaler: steps skipped for overflow
    final_scale: float | None = None


def _run_case(case: Case, rank: int) -> Outcome:
    plan = Plan.load(case.plan_path)
    trainer = Trainer(plan, case.config, rank=rank, device=torch.device("cpu"))
    if case.loss_scale is not None:
        trainer.scaler = LossScaler(init_scale=case.loss_scale)
    if case.nan_at is not None and case.nan_at[0] == rank:
        trainer.inject_nan_at = case.nan_at[1]
    shard = (plan.ranks[rank].pipeline, plan.training.data_parallel)
    batches = trainer.model.spec.shard_batches(plan.training.global_batch_size, plan.training.seed, shard)
    outcome = Outcome()
    try:  # a post-validated step is settled during the next one (Trainer.run_step), the last by settle()
        for step in range(case.config.steps):
            trainer.run_step(step, next(batches))
            _record(outcome, trainer)
        trainer.settle()
        _record(outcome, trainer)
    except RunError as exc:  # every rank stops at the same step with the same message
        outcome.error = str(exc)
    states = trainer.optimizer.gathered_states(list(trainer.model.params))  # collective under zero=1
    outcome.states = {name: {k: _copy(v) for k, v in state.items()} for name, state in states.items()}
    outcome.params = {name: p.detach().clone() for name, p in trainer.model.params.items()}
    if trainer.post_validator is not None:
        outcome.rollbacks, outcome.redone = trainer.post_validator.rollbacks, trainer.post_validator.redone
    if trainer.scaler is not None:
        outcome.skipped_steps, outcome.final_scale = trainer.scaler.skipped_steps, trainer.scaler.scale
    return outcome


def _record(outcome: Outcome, trainer: Trainer) -> None:
    for settled, *_ in trainer.take_settled():
        outcome.losses.append(settled.state.loss)
        outcome.grad_norms.append(settled.state.grad_norm)


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _entry(cases: list[Case]) -> dict[str, Outcome]:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    outcomes = {case.label: _run_case(case, rank) for case in cases}
    dist.barrier()
    dist.destroy_process_group()
    return outcomes


def run_cases(cases: list[Case], world_size: int) -> dict[str, list[Outcome]]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pipeplan.runtime.launch.local import _free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id="post-validate-test",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    results = elastic_launch(config, _entry)(cases)
    return {case.label: [results[rank][case.label] for rank in range(world_size)] for case in cases}
