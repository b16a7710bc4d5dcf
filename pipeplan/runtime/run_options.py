"""`pipeplan run`'s options, declared once: the `run` command and the per-rank worker that launch.sh and job.sbatch
start under torchrun (`python -m pipeplan.runtime.worker PLAN [options]`) both parse them from these fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import ConfigError
from pipeplan.options import argument, option
from pipeplan.paths import check_output_dir, check_output_file
from pipeplan.runtime.config import CLIP_HELP, POST_VALIDATE_HELP, RunConfig, heartbeat_timeout_from_env

INIT_FROM_HELP = (
    "Initial weights: a whole-model state_dict (.pt, .safetensors or a directory of .safetensors shards); each rank "
    "reads only its stages' tensors."
)
PRECISION_HELP = (
    "fp32, bf16-mixed, fp16-mixed (CUDA) or bf16; must be the plan's (default), e.g. --precision bf16-mixed."
)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    plan: Path = argument(help="plan.json written by `pipeplan plan`.")
    steps: int = option(10, "--steps", help="Training steps (total, counting resumed ones).")
    trace: str | None = option(None, "--trace", help="Write the measured Chrome trace of the last step here.")
    checkpoint_dir: str | None = option(None, "--checkpoint-dir", help="Save per-stage checkpoints here.")
    checkpoint_every: int = option(0, "--checkpoint-every", help="Steps between checkpoints (0: at the end).")
    resume: bool = option(False, "--resume", help="Continue from the latest checkpoint in --checkpoint-dir.")
    init_from: Path | None = option(None, "--init-from", help=INIT_FROM_HELP)
    lr: float | None = option(None, "--lr", help="AdamW learning rate (default: the plan's).")
    weight_decay: float | None = option(None, "--weight-decay", help="AdamW weight decay (default: the plan's).")
    heartbeat_timeout: float | None = option(
        None, "--heartbeat-timeout", help="Seconds without a peer's heartbeat before every rank stops (default 60)."
    )
    device: str | None = option(
        None, "--device", help="cpu (gloo) or cuda (nccl, one GPU per rank); default: the plan's device."
    )
    precision: str | None = option(None, "--precision", help=PRECISION_HELP)
    threads: int | None = option(
        None, "--threads", help="CPU threads per rank (default on CPU: the cores divided by the ranks on this machine)."
    )
    check_every: int = option(
        10, "--check-every", help="Steps between checks that replicas and tied weights agree (0: never)."
    )
    quiet: bool = option(False, "--quiet", help="No per-step log lines (the summary is still printed).")
    clip_grad_norm: float | None = option(None, "--clip-grad-norm", help=CLIP_HELP)
    post_validate: bool = option(False, "--post-validate", help=POST_VALIDATE_HELP)
    config: RunConfig = dataclasses.field(init=False, repr=False)  # what the ranks run with, built from the above

    def __post_init__(self) -> None:
        trace = check_output_file(self.trace, "--trace") if self.trace is not None else None
        checkpoints = None
        if self.checkpoint_dir is not None:
            checkpoints = check_output_dir(self.checkpoint_dir, "--checkpoint-dir")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.init_from is not None and not self.init_from.exists():
            raise ConfigError(f"--init-from {str(self.init_from)!r} does not exist")
        heartbeat = self.heartbeat_timeout if self.heartbeat_timeout is not None else heartbeat_timeout_from_env()
        config = RunConfig(
            steps=self.steps,
            lr=self.lr,
            weight_decay=self.weight_decay,
            trace_path=str(trace) if trace else None,
            checkpoint_dir=str(checkpoints) if checkpoints else None,
            checkpoint_every=self.checkpoint_every,
            resume=self.resume,
            init_from=str(self.init_from.resolve()) if self.init_from else None,
            check_every=self.check_every,
            heartbeat_timeout_s=heartbeat,
            quiet=self.quiet,
            device=self.device,
            precision=self.precision,
            clip_grad_norm=self.clip_grad_norm,
            post_validate=self.post_validate,
        )
        object.__setattr__(self, "config", config)
