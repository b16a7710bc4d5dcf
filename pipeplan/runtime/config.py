"""Run options (`pipeplan run` flags) and the fault-injection spec used by the fault tests."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pipeplan.console import warn
from pipeplan.errors import ConfigError

FAULT_ENV = "PIPEPLAN_FAULT"  # e.g. "rank=1,step=2,mode=exit" (mode: exit | hang | stop | diverge | nan)
HEARTBEAT_ENV = "PIPEPLAN_HEARTBEAT_TIMEOUT"  # seconds; tests shorten it
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
FAULT_MODES = ("exit", "hang", "stop", "diverge", "nan")
FAULT_FORMAT = "rank=1,step=2,mode=" + "|".join(FAULT_MODES)

CLIP_HELP = (
    "Clip the gradients to this global L2 norm (all stages and replicas), as torch.nn.utils.clip_grad_norm_ does "
    "(default: no clipping)."
)
POST_VALIDATE_HELP = (
    "Step the optimizer without waiting for the global gradient checks (norm for --clip-grad-norm, NaN/inf); they "
    "follow along the pipeline and a step they invalidate is rolled back exactly and redone (Zero Bubble's "
    "post-validation)."
)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int = 10
    lr: float | None = None  # None: the plan's training.lr
    weight_decay: float | None = None  # None: the plan's training.weight_decay
    trace_path: str | None = None  # measured Chrome trace (merged over ranks), written by rank 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only after the last step (when checkpoint_dir is set)
    resume: bool = False
    init_from: str | None = None  # whole-model state_dict (.pt / .safetensors) giving the initial weights
    log_every: int = 1
    check_every: int = 10  # steps between replica/tie checksum comparisons (0: never)
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    collective_timeout_s: float | None = None  # process-group timeout; default: 2 x heartbeat timeout
    quiet: bool = False  # no per-step log lines (benchmarks)
    direction_groups: bool = False  # one process group per transfer direction (always on with NCCL; tests force it)
    device: str | None = None  # cpu (gloo) or cuda (nccl, one GPU per rank); None: the plan's training.device
    precision: str | None = None  # pipeplan.precision; None: the plan's (a different one is refused)
    clip_grad_norm: float | None = None  # max global gradient norm (torch.nn.utils.clip_grad_norm_); None: no clipping
    post_validate: bool = False  # step before the global checks arrive, roll back if they fail (post_validate.py)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
        if self.resume and self.init_from:
            raise ConfigError(
                "--resume continues from the checkpoint's weights; drop --init-from (it only sets a fresh run's)"
            )
        for name in ("checkpoint_every", "log_every", "check_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_every and not self.checkpoint_dir:
            warn("--checkpoint-every is ignored without --checkpoint-dir")
        if self.device is not None and self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.clip_grad_norm is not None and not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0):
            raise ConfigError(f"--clip-grad-norm must be a finite number > 0, got {self.clip_grad_norm}")
        if not (math.isfinite(self.heartbeat_timeout_s) and self.heartbeat_timeout_s > 0):
            raise ConfigError(
                f"--heartbeat-timeout must be a finite number of seconds > 0, got {self.heartbeat_timeout_s}"
            )

    def run_precision(self, plan_precision: str, device: str) -> str:
        """The plan's precision; --precision must name the same (the plan's costs and memory are for it)."""
        from pipeplan.precision import check_device_precision, get_precision

        if self.precision is not None:
            get_precision(self.precision)
            if self.precision != plan_precision:
                raise ConfigError(
                    f"--precision {self.precision} but the plan was made for {plan_precision}; re-run `pipeplan plan "
                    f"--precision {self.precision}` or drop --precision"
                )
        check_device_precision(plan_precision, device)
        return plan_precision

    @property
    def pg_timeout_s(self) -> float:
        return self.collective_timeout_s or 2.0 * self.heartbeat_timeout_s

    def run_device(self, plan_device: str) -> str:
        """cpu or cuda: --device if given, else the plan's; cuda must be available here (one line if not)."""
        import torch

        device = self.device or plan_device
        if device == "cuda" and not torch.cuda.is_available():
            hint = "" if self.device else " (the plan was made for GPUs); pass --device cpu to run it on CPU"
            raise ConfigError(f"device cuda requested but CUDA is not available here{hint}")
        return device


def heartbeat_timeout_from_env(default: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> float:
    raw = os.environ.get(HEARTBEAT_ENV)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{HEARTBEAT_ENV}={raw!r} must be a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{HEARTBEAT_ENV} must be a finite number of seconds > 0, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """Make rank `rank` fail at the start of step `step` (0-based): `exit` kills it, `hang` freezes it (Python
    still runs), `stop` sends it SIGSTOP (nothing runs, signals wait), `diverge` nudges its copy of a shared
    (replicated or tied) parameter so the divergence check must catch it, `nan` puts a NaN into one of its
    gradients after that step's backward passes (the step's non-finite check must catch it)."""

    rank: int
    step: int
    mode: str = "exit"

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ConfigError(f"{FAULT_ENV} mode must be one of {', '.join(FAULT_MODES)}, got {self.mode!r}")
        if self.rank < 0 or self.step < 0:
            raise ConfigError(f"{FAULT_ENV} rank and step must be >= 0")

    @classmethod
    def from_env(cls) -> FaultSpec | None:
        raw = os.environ.get(FAULT_ENV, "").strip()
        if not raw:
            return None
        fields: dict[str, str] = {}
        for part in raw.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("rank", "step", "mode"):
                raise ConfigError(f"{FAULT_ENV}={raw!r} must look like {FAULT_FORMAT}")
            fields[key.strip()] = value.strip()
        try:
            return cls(rank=int(fields["rank"]), step=int(fields["step"]), mode=fields.get("mode", "exit"))
        except (KeyError, ValueError):
            raise ConfigError(f"{FAULT_ENV}={raw!r} must look like {FAULT_FORMAT}") from None
