"""Training precision modes: the one place that says what each mode computes in and what it holds per parameter.

- `fp32`: fp32 parameters, gradients and optimizer state; no autocast.
- `bf16-mixed` / `fp16-mixed`: fp32 parameters (they are the master weights), fp32 gradients and optimizer state;
  each stage's forward (and the loss) runs under torch.autocast in bf16 / fp16, so matmuls and the activations
  they save are in the low dtype, and backward follows the forward's dtypes. fp16 adds a torch.amp.GradScaler
  (CUDA only: one global scale, inf checks all-reduced so every rank skips an overflowing step together).
- `bf16`: bf16 parameters, gradients and optimizer state (AdamW's moments take the parameters' dtype); no fp32
  master copy, no autocast: the cheapest and least accurate mode.

Static memory per parameter is weights + gradients + optimizer state (master copies included), each in its own
dtype: `static_split(optimizer, precision)`. `--optimizer` names the algorithm (`adamw`: 2 states, `sgd`: 1
momentum buffer, `sgd-nomomentum`: none) or gives bytes per parameter; `adamw-fp32` and `adamw-bf16` remain as
strict aliases of `adamw` under `fp32` and `bf16-mixed`. Activations are counted in the compute dtype (measured
profiles measure them under the mode's autocast); bytes crossing a cut in the dtype the runtime sends.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from pipeplan.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype  # what the parameters (and their gradients, optimizer state) are stored in
    autocast_dtype: torch.dtype | None  # torch.autocast's dtype around each forward, None: no autocast
    grad_scaler: bool = False  # fp16: loss scaling with torch.amp.GradScaler

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype

    @property
    def compute_dtype_name(self) -> str:
        return str(self.compute_dtype).removeprefix("torch.")

    @property
    def param_bytes(self) -> int:
        return torch.empty((), dtype=self.param_dtype).element_size()

    def autocast(self, device_type: str):
        """The context each stage forward (and the loss) runs in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, None),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16),
    "fp16-mixed": Precision("fp16-mixed", torch.float32, torch.float16, grad_scaler=True),
    "bf16": Precision("bf16", torch.bfloat16, None),
}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}  # state tensors per parameter
OPTIMIZER_ALIASES = {"adamw-fp32": ("adamw", "fp32"), "adamw-bf16": ("adamw", "bf16-mixed")}
OPTIMIZER_NAMES = (*OPTIMIZER_STATES, *OPTIMIZER_ALIASES)


def get_precision(name: str, *, option: str = "--precision") -> Precision:
    if name not in PRECISIONS:
        raise ConfigError(f"{option} {name!r} is not supported; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def default_precision(device: str) -> str:
    """bf16-mixed on a GPU (cuda, or meta: analytic for a GPU preset), fp32 on the CPU."""
    return "fp32" if device == "cpu" else "bf16-mixed"


def profile_precision(provenance) -> str:
    """A profile's precision; older profiles recorded only a dtype (float32 measured, bfloat16 analytic)."""
    if getattr(provenance, "precision", ""):
        return provenance.precision
    return "fp32" if provenance.dtype == "float32" else "bf16-mixed"


def check_device_precision(precision: str, device: str) -> None:
    """fp16 loss scaling is a CUDA feature here: refuse fp16-mixed on the CPU with one line."""
    get_precision(precision)
    if precision == "fp16-mixed" and device == "cpu":
        raise ConfigError(
            "--precision fp16-mixed needs CUDA (its gradient scaler is not supported on the CPU); use bf16-mixed"
        )


def resolve_optimizer(optimizer: str | float, precision: str | None) -> tuple[str | float, str]:
    """(optimizer, precision) with an alias unfolded; precision None takes the alias's, else bf16-mixed. An alias
    that names another precision than the one given is refused."""
    if isinstance(optimizer, str) and optimizer in OPTIMIZER_ALIASES:
        name, implied = OPTIMIZER_ALIASES[optimizer]
        if precision is not None and precision != implied:
            raise ConfigError(
                f"--optimizer {optimizer} means adamw under --precision {implied}, not {precision}; use --optimizer "
                "adamw (its bytes follow --precision)"
            )
        return name, implied
    precision = precision or "bf16-mixed"
    get_precision(precision)
    if isinstance(optimizer, bool) or not isinstance(optimizer, str | int | float):
        raise ConfigError("--optimizer must be a name or a number of bytes per parameter")
    if isinstance(optimizer, str) and optimizer not in OPTIMIZER_STATES:
        raise ConfigError(
            f"unknown --optimizer {optimizer!r}; choose from: {', '.join(OPTIMIZER_NAMES)} or bytes per parameter"
        )
    if not isinstance(optimizer, str) and (not math.isfinite(optimizer) or optimizer < 0):
        raise ConfigError(f"optimizer bytes per parameter must be a finite number >= 0, got {optimizer}")
    return optimizer, precision


def static_split(optimizer: str | float, precision: str | None = None) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer state with any master copy) under `precision`. A
    number as optimizer is the whole figure (counted as optimizer state)."""
    optimizer, precision = resolve_optimizer(optimizer, precision)
    if not isinstance(optimizer, str):
        return 0.0, 0.0, float(optimizer)
    size = float(PRECISIONS[precision].param_bytes)
    return size, size, size * OPTIMIZER_STATES[optimizer]


def bytes_per_param(optimizer: str | float, precision: str | None = None) -> float:
    """Weights + gradients + optimizer state per parameter: what `partition.costs.static_bytes` multiplies."""
    return sum(static_split(optimizer, precision))


def wire_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype of a floating value under `precision` where no run says otherwise (analytic profiles): the
    compute dtype for low-precision parameters, else as traced."""
    mode = PRECISIONS[precision]
    return mode.param_dtype if dtype.is_floating_point and mode.autocast_dtype is None else dtype
