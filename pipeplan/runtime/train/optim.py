"""The optimizer `pipeplan run` steps and its learning-rate schedule, decided once before any rank starts.

Optimizer: the plan's (`training.optimizer`, the name its memory was counted for: adamw, sgd or sgd-nomomentum, as
costs/optimizer.py counts their state) unless the model's factory supplies its own (`ModelSpec.optimizer`). `run
--optimizer NAME` only confirms the plan's: another name is refused, since the plan's memory was counted for its
own. A plan made with `--optimizer BYTES` names no algorithm: `run --optimizer NAME` picks one whose bytes fit
the plan's accounting (a heavier one is refused).

    adamw            torch.optim.AdamW(lr, weight_decay)
    sgd              torch.optim.SGD(lr, momentum (default 0.9), weight_decay)
    sgd-nomomentum   torch.optim.SGD(lr, momentum=0, weight_decay)

Schedule: before the optimizer step of step s (0-based), every parameter group's learning rate is set to its initial
learning rate x factor(s) (what torch.optim.lr_scheduler.LambdaLR does; a function of the step alone, so a resumed
run continues it exactly):

    warm-up    s < W:        (s + 1) / W
    constant   afterwards:   1
    linear     afterwards:   1 - p                    p = (s - W) / (D - W), at most 1
    cosine     afterwards:   (1 + cos(pi p)) / 2

with W = --warmup-steps and D = --decay-steps (default --steps). A factory's `ModelSpec.lr_lambda(s)` replaces the
factor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeplan.artifact.plan import Plan
from pipeplan.errors import ConfigError
from pipeplan.models.spec import ModelSpec
from pipeplan.runtime.train.config import OPTIMIZERS, RunConfig

SGD_MOMENTUM = 0.9
FACTORY = "the model factory's"  # the optimizer name of a run whose factory supplies the optimizer

MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def lr_factor(step: int, *, schedule: str, warmup_steps: int, decay_steps: int) -> float:
    """The multiplier of the initial learning rate at 0-based `step` (the module docstring's formula)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(decay_steps - warmup_steps, 1), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    return (1.0 + math.cos(math.pi * progress)) / 2.0


def run_optimizer(plan: Plan, spec: ModelSpec, *, optimizer: str | None, momentum: float | None) -> str:
    """The optimizer the run steps (a name of OPTIMIZERS, or FACTORY), or one ConfigError naming the option."""
    planned = plan.training.optimizer
    if spec.optimizer is not None:
        if optimizer is not None or momentum is not None:
            flag = "--optimizer" if optimizer is not None else "--momentum"
            raise ConfigError(f"model {spec.name!r} supplies its own optimizer (ModelSpec.optimizer); drop {flag}")
        if plan.training.zero:
            raise ConfigError(
                f"model {spec.name!r} supplies its own optimizer, which steps whole parameters; ZeRO-1 steps flat "
                "shards of them: re-plan with --memory zero=0"
            )
        return FACTORY
    if plan.training.numerics.named and plan.training.numerics.main_state_bytes != (4, 4):
        raise ConfigError(
            f"the plan keeps the optimizer's state in 16 bits ({planned}), which pipeplan's runtime does not run (its "
            "AdamW keeps fp32 state): export it for Megatron-LM (`pipeplan export --format megatron`) or re-plan with "
            "--precision MODE,adamw"
        )
    if planned in OPTIMIZERS:
        if optimizer is not None and optimizer != planned:
            raise ConfigError(
                f"--optimizer {optimizer} but the plan counted memory for {planned}; re-plan with `--precision "
                f"MODE,{optimizer}` or drop --optimizer"
            )
        name = planned
    elif optimizer is None:
        raise ConfigError(
            f"the plan counts {planned} bytes per parameter but names no optimizer; pass --optimizer "
            f"{'|'.join(OPTIMIZERS)}"
        )
    else:
        name = optimizer
        if plan.training.unplanned_optimizer_bytes(name) > 1e-9:
            raise ConfigError(
                f"--optimizer {name} needs more than the {planned} bytes per parameter the plan counted under "
                f"{plan.training.precision}; re-plan with `--precision MODE,{name}` or pick a lighter optimizer"
            )
    if momentum is not None and name != "sgd":
        raise ConfigError(f"--momentum applies to --optimizer sgd only, and this run steps {name}; drop --momentum")
    return name


def optimizer_factory(
    name: str, spec: ModelSpec, params: dict[str, nn.Parameter], *, lr: float, weight_decay: float, momentum: float
) -> MakeOptimizer:
    """How a rank builds its optimizer over the tensors it steps (runtime/step/zero.py hands them over)."""
    if name == FACTORY:  # (no ZeRO-1: the tensors handed over are the parameters themselves)
        make = spec.optimizer
        assert make is not None, "run_optimizer chooses the factory's optimizer only where it has one"
        named = {id(p): (n, p) for n, p in params.items()}
        return lambda tensors: make([named[id(t)] for t in tensors], lr, weight_decay)
    if name == "adamw":
        return lambda tensors: torch.optim.AdamW(tensors, lr=lr, weight_decay=weight_decay)
    momentum = momentum if name == "sgd" else 0.0
    return lambda tensors: torch.optim.SGD(tensors, lr=lr, momentum=momentum, weight_decay=weight_decay)


def state_keys(name: str, momentum: float | None) -> frozenset[str] | None:
    """The per-parameter state the optimizer `name` keeps once it has stepped a parameter (what a checkpoint of it
    holds); None for a factory's optimizer, whose state pipeplan does not know."""
    if name == FACTORY:
        return None
    if name == "adamw":
        return frozenset({"step", "exp_avg", "exp_avg_sq"})
    with_momentum = name == "sgd" and (momentum if momentum is not None else SGD_MOMENTUM) != 0
    return frozenset({"momentum_buffer"}) if with_momentum else frozenset()


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """The learning-rate factor per step: the factory's `lr_lambda`, or --lr-schedule with its warm-up and decay."""

    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 1
    lr_lambda: Callable[[int], float] | None = None

    def factor(self, step: int) -> float:
        if self.lr_lambda is not None:
            value = float(self.lr_lambda(step))
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"the model's lr_lambda({step}) returned {value}; it must be a finite number >= 0")
            return value
        return lr_factor(step, schedule=self.schedule, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Set every parameter group's learning rate for the optimizer step of `step`."""
        factor = self.factor(step)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * factor


def check_schedule(spec: ModelSpec, *, schedule: str, warmup_steps: int, decay_steps: int | None) -> None:
    """A factory's lr_lambda is the whole schedule: the schedule flags must keep their defaults beside it."""
    if spec.lr_lambda is None:
        return
    given = [
        flag
        for flag, set_ in (
            ("--lr-schedule", schedule != "constant"),
            ("--warmup-steps", warmup_steps != 0),
            ("--decay-steps", decay_steps is not None),
        )
        if set_
    ]
    if given:
        raise ConfigError(f"model {spec.name!r} supplies its own schedule (ModelSpec.lr_lambda); drop {given[0]}")


def run_schedule(spec: ModelSpec, config: RunConfig) -> LrSchedule:
    """The run's learning-rate schedule (the factory's lr_lambda, or --lr-schedule over --decay-steps or --steps)."""
    check_schedule(spec, schedule=config.lr_schedule, warmup_steps=config.warmup_steps, decay_steps=config.decay_steps)
    return LrSchedule(
        schedule=config.lr_schedule,
        warmup_steps=config.warmup_steps,
        decay_steps=config.decay_steps or config.steps,
        lr_lambda=spec.lr_lambda,
    )


def run_plan(plan: Plan, config: RunConfig) -> Plan:
    """The plan with the run's --seed, --lr and --weight-decay in place of its own (what every rank trains with)."""
    settings = {"seed": config.seed, "lr": config.lr, "weight_decay": config.weight_decay}
    given: dict[str, Any] = {name: value for name, value in settings.items() if value is not None}
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, **given)) if given else plan


def check_training(plan: Plan, spec: ModelSpec, config: RunConfig) -> str:
    """Before any rank starts: the optimizer the run steps (one ConfigError if the options contradict the plan or
    the model's factory) and the schedule options beside a factory's own schedule."""
    name = run_optimizer(plan, spec, optimizer=config.optimizer, momentum=config.momentum)
    run_schedule(spec, config)
    return name
