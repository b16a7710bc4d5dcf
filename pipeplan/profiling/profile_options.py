"""`pipeplan profile`'s options, declared once and checked before the model is built."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeplan.console import warn
from pipeplan.errors import ConfigError
from pipeplan.graph.tracers import check_tracer
from pipeplan.models.assignments import parse_assignments
from pipeplan.options import argument, option
from pipeplan.paths import check_output_file
from pipeplan.precision import check_device_precision, default_precision

MODEL_HELP = "Built-in model name (`pipeplan models`), file.py:factory or pkg.mod:factory."
PRECISION_HELP = (
    "fp32, bf16-mixed, fp16-mixed (CUDA), bf16, or with --device meta bf16-main, fp16-main, fp8 (default: fp32 on "
    "cpu, bf16-mixed on cuda, bf16-main on meta), e.g. --precision bf16-mixed."
)
TRACER_HELP = "fx, export (torch.export) or auto: fx, else export (e.g. --tracer export)."
# what an analytic profile runs each scaled_dot_product_attention as
ATTENTION_MODES = ("auto", "flash", "flash2", "math")
ATTENTION_HELP = (
    "Analytic profiles: auto (what the model and device run: FlashAttention, or memory-efficient attention with a "
    "mask), flash (the same; refuses attention written by hand), flash2 (as flash, timed as FlashAttention-2: e.g. "
    "Transformer Engine with NVTE_FUSED_ATTN=0 on an H100) or math (unfused softmax), e.g. --attention math."
)
DEFAULT_WARMUP, DEFAULT_REPEATS, DEFAULT_TIMER = 2, 5, "wall"


def check_concurrent(concurrent: int, kind: str) -> None:
    """One line refusing --concurrent below 1, or above 1 where nothing runs on this machine's CPU (kind: the
    device kind the profile measures on)."""
    if concurrent < 1:
        raise ConfigError(f"--concurrent must be >= 1, got {concurrent}")
    if concurrent > 1 and kind != "cpu":
        raise ConfigError(f"--concurrent measures beside sibling CPU processes; drop it with --device {kind}")


def check_attention(mode: str, device: str) -> None:
    """One line refusing an unknown --attention, or one given where nothing is analytic (a measured profile runs the
    attention the model and device run)."""
    if mode not in ATTENTION_MODES:
        raise ConfigError(f"--attention must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}")
    if mode != "auto" and device != "meta":
        raise ConfigError(
            f"--attention {mode} is for analytic profiles (--device meta --hardware NAME); a --device {device} "
            "profile measures the attention the model runs"
        )


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    model: str = argument(help=MODEL_HELP)
    assignments: list[str] | None = option(None, "--arg", "-a", help="Model option key=value (repeatable).")
    batch_size: int = option(1, "--batch-size", "--microbatch-size", "-b", help="Samples per profiled microbatch.")
    device: str = option("cpu", "--device", help="cpu or cuda (measured), meta (analytic, needs --hardware).")
    hardware: str | None = option(None, "--hardware", help="Hardware preset for --device meta (h100, a100-80gb, ...).")
    hardware_file: Path | None = option(None, "--hardware-file", help="JSON file adding presets (pipeplan calibrate).")
    granularity: int | None = option(None, "--granularity", help="Module depth of a layer (default: repeated blocks).")
    tracer: str = option("auto", "--tracer", help=TRACER_HELP)
    warmup: int = option(DEFAULT_WARMUP, "--warmup", help="Untimed rounds (every layer once each) before measuring.")
    repeats: int = option(
        DEFAULT_REPEATS, "--repeats", help="Timed rounds; the median is kept, checked from 3 up (e.g. --repeats 9)."
    )
    threads: int | None = option(
        None,
        "--threads",
        help="CPU threads to measure with (default on CPU: each rank's share of the cores in a 2-rank run).",
    )
    concurrent: int = option(
        1,
        "--concurrent",
        help="CPU: measure beside N-1 sibling processes running the model, as N ranks share this machine in a run: "
        "layers in CPU time x the slowest process's wall-clock / this one's CPU time per step (e.g. --concurrent 2).",
    )
    timer: str = option(DEFAULT_TIMER, "--timer", help="wall, or cpu: process CPU time (steady on a busy CPU).")
    precision: str | None = option(None, "--precision", help=PRECISION_HELP)
    attention: str = option("auto", "--attention", help=ATTENTION_HELP)
    output: str | None = option(None, "--output", "-o", help="Write the Profile JSON here (atomically).")
    as_json: bool = option(False, "--json", help="Print only the Profile JSON on stdout.")

    def __post_init__(self) -> None:
        parse_assignments(self.assignments)
        if self.output is not None:  # checked, and the path kept as it will be written (~ expanded)
            object.__setattr__(self, "output", str(check_output_file(self.output, "--output")))
        self._check_device()
        check_device_precision(self.run_precision, self.device.partition(":")[0])
        check_tracer(self.tracer)
        check_attention(self.attention, self.device)
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        kind = self.device.partition(":")[0]
        check_concurrent(self.concurrent, "cpu" if kind == "meta" else kind)  # meta: ignored (_warn_ignored)
        self._warn_ignored()

    @property
    def run_precision(self) -> str:
        """--precision, or the device's default."""
        return self.precision or default_precision(self.device)

    def _check_device(self) -> None:
        device = self.device
        if device not in ("cpu", "cuda", "meta") and not device.startswith("cuda:"):
            raise unknown_device(device)
        if device == "meta" and not self.hardware:
            raise ConfigError("--device meta estimates costs analytically and needs --hardware NAME (e.g. h100)")
        if self.hardware:  # an unknown name is an error even where it is then ignored
            from pipeplan.hardware import resolve_hardware

            resolve_hardware(self.hardware, self.hardware_file)
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda requested but CUDA is not available here; use --device cpu")

    def _warn_ignored(self) -> None:
        if self.device == "meta":
            if self.threads is not None or self.concurrent != 1:
                warn("--threads/--concurrent are ignored with --device meta (nothing is run)")
            if (self.warmup, self.repeats, self.timer) != (DEFAULT_WARMUP, DEFAULT_REPEATS, DEFAULT_TIMER):
                warn("--warmup/--repeats/--timer are ignored with --device meta (nothing is run)")
        elif self.hardware or self.hardware_file:
            warn(f"--hardware/--hardware-file are ignored with --device {self.device} (measured)")


def unknown_device(device: str, *, count_flag: str = "") -> ConfigError:
    """--device's one line for a value that is no device; where the command has `count_flag` (plan's --devices), a
    count (`--device 2`, `2x8`) was meant for it."""
    meant = count_flag and re.fullmatch(r"\d+(x\d+)?", device.strip())
    hint = f"; did you mean {count_flag} {device.strip()} (how many devices)?" if meant else ""
    return ConfigError(f"--device must be cpu, cuda or meta, got {device!r}{hint}")
