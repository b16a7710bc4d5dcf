"""`pipeplan run`'s options: the command and the per-rank worker that launch.sh and job.sbatch start under torchrun
(`python -m pipeplan.runtime.launch.worker PLAN [options]`) both parse them from these fields. Every flag a rank
needs is a field of RunConfig (declared once, in train/config.py); RunOptions adds only what a process needs: the
plan and threads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import ConfigError
from pipeplan.options import argument, option
from pipeplan.runtime.train.config import RunConfig


@dataclass(frozen=True, kw_only=True)
class RunOptions(RunConfig):
    """The run's RunConfig (the ranks get this object), with the plan to run and the CPU threads per rank."""

    plan: Path = argument(help="plan.json written by `pipeplan plan`.")
    threads: int | None = option(
        None, "--threads", help="CPU threads per rank (default on CPU: the cores divided by the ranks on this machine)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
