"""Run options (`pipeplan run` flags, `RunConfig`) and the fault-injection spec used by the fault tests."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pipeplan.console import warn
from pipeplan.errors import ConfigError
from pipeplan.options import option
from pipeplan.paths import check_output_dir, check_output_file
from pipeplan.runtime.step.pair_runner import PAIR_MODES
from pipeplan.runtime.train.metrics import check_tensorboard

FAULT_ENV = "PIPEPLAN_FAULT"  # e.g. "rank=1,step=2,mode=exit" (mode: exit | hang | stop | diverge | nan)
HEARTBEAT_ENV = "PIPEPLAN_HEARTBEAT_TIMEOUT"  # seconds; tests shorten it
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
# a rank beats about every second (watchdog.py), and the process group's timeout is twice this: below a second a
# live rank would be declared dead (1e-9 s timed out the ranks' own store connections)
MIN_HEARTBEAT_TIMEOUT_S = 1.0
FAULT_MODES = ("exit", "hang", "stop", "diverge", "nan")
FAULT_FORMAT = "rank=1,step=2,mode=" + "|".join(FAULT_MODES)

CLIP_HELP = (
    "Clip the gradients to this global L2 norm (all stages and replicas), as torch.nn.utils.clip_grad_norm_ does "
    "(default: no clipping)."
)
POST_VALIDATE_HELP = (
    "Step the optimizer without waiting for the global gradient checks (norm for --clip-grad-norm, NaN/inf); they "
    "follow along the pipeline and a step they invalidate is rolled back exactly and redone (Zero Bubble's "
    "post-validation). Default: as the plan was predicted (plan.json's training.post_validate)."
)
OVERLAP_PAIRS_HELP = (
    "How dualpipev's overlapped F&B ops run: on (the backward on a second thread while the forward runs), off (the "
    "forward, then the backward) or auto (default: on CPU, each rank times both over its first steps and keeps the "
    "faster; on CUDA, on)."
)
INIT_FROM_HELP = (
    "Initial weights: a whole-model state_dict (.pt, .safetensors or a directory of .safetensors shards); each rank "
    "reads only its stages' tensors."
)
OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum")  # the names costs/optimizer.py counts state for (a test compares)
LR_SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZER_HELP = (
    "adamw, sgd or sgd-nomomentum; must be the plan's (default: the plan's, whose memory was counted for it)."
)
SCHEDULE_HELP = "constant, cosine or linear decay after the warm-up, reaching 0 at --decay-steps."
SEED_HELP = "Seed of the initial weights, the data order and dropout (default: the plan's)."
LOG_HELP = (
    "Write one JSON line per finished step here: step, loss, lr, grad_norm, step_ms, samples/s, tokens/s and the "
    "predicted step (--resume appends)."
)
TENSORBOARD_HELP = "Also write the log's scalars as TensorBoard event files in this directory (needs tensorboard)."
TRACE_STEPS_HELP = (
    "Steps --trace keeps, the last ones (default 8): what `pipeplan refine` learns from; more where the machine's "
    "speed drifts during a run."
)
PRECISION_HELP = (
    "fp32, bf16-mixed, fp16-mixed (CUDA) or bf16; must be the plan's (default), e.g. --precision bf16-mixed."
)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every rank of a run gets: `pipeplan run`'s options (the fields with a flag, declared here once; the CLI
    and the per-rank worker parse them through run_options.RunOptions) and a few settings only tests and
    benchmarks change. Paths are checked and the heartbeat timeout resolved here, wherever the values come from."""

    steps: int = option(10, "--steps", help="Training steps (total, counting resumed ones).")
    trace_path: str | None = option(None, "--trace", help="Write the measured Chrome trace of the last steps here.")
    trace_steps: int = option(8, "--trace-steps", help=TRACE_STEPS_HELP)
    checkpoint_dir: str | None = option(None, "--checkpoint-dir", help="Save per-stage checkpoints here.")
    checkpoint_every: int = option(0, "--checkpoint-every", help="Steps between checkpoints (0: at the end).")
    resume: bool = option(False, "--resume", help="Continue from the latest checkpoint in --checkpoint-dir.")
    init_from: str | None = option(None, "--init-from", help=INIT_FROM_HELP, metavar="<path>")  # made absolute
    optimizer: str | None = option(None, "--optimizer", help=OPTIMIZER_HELP)  # None: the plan's (optim.py)
    lr: float | None = option(None, "--lr", help="Peak learning rate (default: the plan's).")
    lr_schedule: str = option("constant", "--lr-schedule", help=SCHEDULE_HELP)
    warmup_steps: int = option(0, "--warmup-steps", help="Steps of linear warm-up to --lr (default 0).")
    decay_steps: int | None = option(  # None: --steps
        None, "--decay-steps", help="Step at which cosine or linear decay reaches 0 (default: --steps)."
    )
    weight_decay: float | None = option(None, "--weight-decay", help="Weight decay (default: the plan's).")
    momentum: float | None = option(None, "--momentum", help="SGD momentum (--optimizer sgd only; default 0.9).")
    seed: int | None = option(None, "--seed", help=SEED_HELP)  # None: the plan's
    log_path: str | None = option(None, "--log", help=LOG_HELP, metavar="<file.jsonl>")
    tensorboard_dir: str | None = option(None, "--tensorboard", help=TENSORBOARD_HELP, metavar="<dir>")
    heartbeat_timeout_s: float | None = option(  # None: $PIPEPLAN_HEARTBEAT_TIMEOUT or 60 s (resolved at init)
        None, "--heartbeat-timeout", help="Seconds without a peer's heartbeat before every rank stops (default 60)."
    )
    device: str | None = option(  # None: the plan's training.device
        None, "--device", help="cpu (gloo) or cuda (nccl, one GPU per rank); default: the plan's device."
    )
    precision: str | None = option(None, "--precision", help=PRECISION_HELP)  # None: the plan's
    check_every: int = option(  # 0: never
        10, "--check-every", help="Steps between checks that replicas and tied weights agree (0: never)."
    )
    quiet: bool = option(False, "--quiet", help="No per-step lines; the summary is still printed.")
    clip_grad_norm: float | None = option(None, "--clip-grad-norm", help=CLIP_HELP)  # None: no clipping
    post_validate: bool | None = option(  # post_validate.py; None: the plan's setting (`for_plan`)
        None, "--post-validate/--no-post-validate", help=POST_VALIDATE_HELP
    )
    overlap_pairs: str = option("auto", "--overlap-pairs", help=OVERLAP_PAIRS_HELP, metavar="auto|on|off")
    # not flags: tests and benchmarks set them
    log_every: int = 1
    collective_timeout_s: float | None = None  # process-group timeout; default: 2 x heartbeat timeout
    direction_groups: bool = True  # a process group per transfer direction (step/comm.py; always on NCCL and async)
    track_saved: bool = False  # record each rank's peak of held activation bytes (RunResult.saved_peak_bytes)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.trace_steps < 1:
            raise ConfigError(f"--trace-steps must be >= 1, got {self.trace_steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")
        self._check_training()
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
        if self.overlap_pairs not in PAIR_MODES:
            raise ConfigError(f"--overlap-pairs must be auto, on or off, got {self.overlap_pairs!r}")
        if self.device is not None and self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.clip_grad_norm is not None and not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0):
            raise ConfigError(f"--clip-grad-norm must be a finite number > 0, got {self.clip_grad_norm}")
        heartbeat = heartbeat_timeout_from_env() if self.heartbeat_timeout_s is None else self.heartbeat_timeout_s
        object.__setattr__(self, "heartbeat_timeout_s", heartbeat)
        if not (math.isfinite(heartbeat) and heartbeat >= MIN_HEARTBEAT_TIMEOUT_S):
            raise ConfigError(
                f"--heartbeat-timeout must be a finite number of seconds >= {MIN_HEARTBEAT_TIMEOUT_S:g}, got "
                f"{heartbeat}"
            )
        self._check_paths()

    def _check_training(self) -> None:
        """The optimizer and schedule options by themselves (against the plan and model: optim.check_training)."""
        for flag, value in (("--weight-decay", self.weight_decay), ("--momentum", self.momentum)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{flag} must be a finite number >= 0, got {value}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}; choose from: {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown --lr-schedule {self.lr_schedule!r}; choose from: {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ConfigError(f"--decay-steps must be >= 1, got {self.decay_steps}")
        if self.decay_steps is not None and self.lr_schedule == "constant":
            warn("--decay-steps is ignored with --lr-schedule constant")
        horizon = self.decay_steps or self.steps
        if self.lr_schedule != "constant" and horizon <= self.warmup_steps:
            raise ConfigError(
                f"--lr-schedule {self.lr_schedule} decays from --warmup-steps {self.warmup_steps} to --decay-steps "
                f"{horizon} (default --steps): make --decay-steps larger than --warmup-steps"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed must be >= 0 and < 2**63, got {self.seed}")

    def _check_paths(self) -> None:
        """--trace, --log, --checkpoint-dir and --tensorboard writable, --init-from present (and made absolute: ranks
        may start elsewhere)."""
        if self.trace_path is not None:
            object.__setattr__(self, "trace_path", str(check_output_file(self.trace_path, "--trace")))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", str(check_output_dir(self.checkpoint_dir, "--checkpoint-dir")))
        if self.log_path is not None:
            object.__setattr__(self, "log_path", str(check_output_file(self.log_path, "--log")))
        if self.tensorboard_dir is not None:
            found = check_tensorboard(str(check_output_dir(self.tensorboard_dir, "--tensorboard")))
            object.__setattr__(self, "tensorboard_dir", found)
        if self.init_from is not None:
            if not Path(self.init_from).exists():
                raise ConfigError(f"--init-from {str(self.init_from)!r} does not exist")
            object.__setattr__(self, "init_from", str(Path(self.init_from).resolve()))

    def for_plan(self, plan_post_validate: bool) -> RunConfig:
        """This config with --post-validate / --no-post-validate settled: the plan's setting unless given."""
        if self.post_validate is not None:
            return self
        return dataclasses.replace(self, post_validate=plan_post_validate)

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
    def heartbeat_s(self) -> float:
        """`heartbeat_timeout_s` as __post_init__ settled it (None given: $PIPEPLAN_HEARTBEAT_TIMEOUT or 60 s)."""
        assert self.heartbeat_timeout_s is not None, "RunConfig.__post_init__ settles heartbeat_timeout_s"
        return self.heartbeat_timeout_s

    @property
    def pg_timeout_s(self) -> float:
        return self.collective_timeout_s or 2.0 * self.heartbeat_s

    def run_device(self, plan_device: str) -> str:
        """cpu or cuda: --device if given, else the plan's; cuda must be available here (one line if not)."""
        import torch

        device = self.device or plan_device
        if device == "cuda" and not torch.cuda.is_available():
            hint = "" if self.device else " (the plan was made for GPUs); pass --device cpu to run it on CPU"
            raise ConfigError(f"device cuda requested but CUDA is not available here{hint}")
        return device


def heartbeat_timeout_from_env() -> float:
    raw = os.environ.get(HEARTBEAT_ENV)
    if not raw:
        return DEFAULT_HEARTBEAT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{HEARTBEAT_ENV}={raw!r} must be a number of seconds") from None
    if not (math.isfinite(value) and value >= MIN_HEARTBEAT_TIMEOUT_S):
        raise ConfigError(
            f"{HEARTBEAT_ENV} must be a finite number of seconds >= {MIN_HEARTBEAT_TIMEOUT_S:g}, got {value}"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """Make rank `rank` fail at the start of step `step` (0-based): `exit` kills it, `hang` freezes it (Python
    still runs), `stop` sends it SIGSTOP (nothing runs, signals wait), `diverge` nudges its copy of a shared
    (replicated or tied) parameter so the divergence check must catch it, `nan` puts a NaN into one of its
    gradients after that step's backward passes (the step's non-finite check must catch it). `step` = --steps: after
    the run's summary, as the ranks shut down."""

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
