"""Training precision modes: the one place that says what each mode computes in and what it holds per parameter.

- `fp32`: fp32 parameters, gradients and optimizer state; no autocast.
- `bf16-mixed` / `fp16-mixed`: fp32 parameters (they are the master weights), fp32 gradients and optimizer state;
  each stage's forward (and the loss) runs under torch.autocast in bf16 / fp16, so matmuls and the activations
  they save are in the low dtype, and backward follows the forward's dtypes. fp16 adds a torch.amp.GradScaler
  (CUDA only: one global scale, inf checks all-reduced so every rank skips an overflowing step together).
- `bf16`: bf16 parameters, gradients and optimizer state (AdamW's moments take the parameters' dtype); no fp32
  master copy, no autocast: the cheapest and least accurate mode.

Bytes per parameter (weights, gradients, optimizer state by optimizer and mode) are a cost: the one table is in
`pipeplan.costs.optimizer`, reading `Precision.param_bytes` from here. Activations are counted in the
compute dtype (measured profiles measure them under the mode's autocast); bytes crossing a cut in the dtype the
runtime sends.
"""

from __future__ import annotations

import contextlib
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
        return self.param_dtype.itemsize

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


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ConfigError(f"--precision {name!r} is not supported; choose one of: {', '.join(PRECISIONS)}")
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
