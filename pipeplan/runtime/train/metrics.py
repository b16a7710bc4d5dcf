"""`run --log FILE.jsonl`: one JSON object per finished step, written by rank 0 as the steps finish:

    {"step": 3, "loss": 4.1588249206543, "lr": 0.00075, "grad_norm": 1.2345, "step_ms": 12.3,
     "samples_per_s": 650.4, "tokens_per_s": 10406.5, "predicted_step_ms": 11.8}

- `step` counts from 1; `loss` is the mean loss over the global batch at full precision (JSON's round-trip repr);
- `lr` is the learning rate of that step's optimizer step: --lr (default the plan's) x the schedule's factor;
- `grad_norm` is the L2 norm of the whole model's gradient of that loss, before clipping (each parameter counted once,
  its gradient summed over microbatches and data-parallel pipelines; what torch.nn.utils.clip_grad_norm_ returns on
  one process); null for asynchronous schedules, whose stages step on their own;
- `step_ms` rank 0's wall time of the step; `samples_per_s` and `tokens_per_s` (null without tokens per sample)
  follow from it; `predicted_step_ms` is the plan's prediction (null without one).

Each line is appended with one write(2) on an O_APPEND descriptor, whole, so a reader never sees a half line while
the run lives. A fresh run starts the file anew; `--resume` keeps the lines up to the checkpoint's step and drops
the rest (steps it runs again, and a line a crash cut short). With --tensorboard DIR and tensorboard installed, the
same scalars also go to TensorBoard event files in DIR (torch.utils.tensorboard)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeplan.errors import ConfigError
from pipeplan.jsonio import atomic_write_text

Record = dict[str, Any]
SCALARS = ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s")  # what TensorBoard gets, under train/


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def check_tensorboard(directory: str | None) -> str | None:
    """--tensorboard's directory; refused in one line where tensorboard is not installed (never silently dropped)."""
    if directory is not None and not tensorboard_available():
        raise ConfigError(
            "--tensorboard needs the tensorboard package (pip install tensorboard); --log FILE.jsonl writes the same "
            "values without it"
        )
    return directory


def kept_lines(path: Path, last_step: int) -> str:
    """The log's whole lines of steps up to `last_step` (what a resumed run continues after)."""
    if not path.is_file():
        return ""
    kept = []
    for line in path.read_text(errors="replace").split("\n"):
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash, or an empty one
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line + "\n")
    return "".join(kept)


class MetricsLog:
    """Rank 0's --log file and TensorBoard writer over a run that starts after step `start` (0: a fresh run)."""

    def __init__(self, path: str | None, tensorboard_dir: str | None, *, start: int) -> None:
        self.fd: int | None = None
        self.writer = None
        if path is not None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)  # as every output's folder is made
                if start:  # the kept lines replace the file at once (temp file, rename): a crash keeps one or other
                    atomic_write_text(path, kept_lines(Path(path), start))
                self.fd = os.open(path, flags if start else flags | os.O_TRUNC, 0o644)
            except OSError as exc:
                raise ConfigError(f"--log {path!r} cannot be written: {exc.strerror or exc}") from None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=start + 1 if start else None)

    def write(self, record: Record) -> None:
        if self.fd is not None:
            line = (json.dumps(record, allow_nan=True) + "\n").encode()
            written = os.write(self.fd, line)
            if written != len(line):
                raise OSError(f"--log: short write ({written} of {len(line)} bytes; disk full?)")
        if self.writer is not None:
            for name in SCALARS:
                if record.get(name) is not None:
                    self.writer.add_scalar(f"train/{name}", record[name], global_step=record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def step_record(
    *,
    step: int,
    loss: float,
    lr: float,
    grad_norm: float | None,
    step_ms: float,
    samples: int,
    tokens: int | None,
    predicted_ms: float,
) -> Record:
    """One line of the log for 0-based `step` (rates from the step time)."""
    per_s = samples / (step_ms / 1000.0) if step_ms > 0 else None
    return {
        "step": step + 1,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_ms": step_ms,
        "samples_per_s": per_s,
        "tokens_per_s": per_s * tokens if per_s is not None and tokens else None,
        "predicted_step_ms": predicted_ms if predicted_ms > 0 else None,
    }
