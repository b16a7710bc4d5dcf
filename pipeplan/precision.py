"""Training precision modes: the one place that says what each mode computes in and what it holds per parameter.

- `fp32`: fp32 parameters, gradients and optimizer state; no autocast.
- `bf16-mixed` / `fp16-mixed`: fp32 parameters (they are the master weights), fp32 gradients and optimizer state;
  each stage's forward (and the loss) runs under torch.autocast in bf16 / fp16, so matmuls and the activations
  they save are in the low dtype, and backward follows the forward's dtypes. fp16 adds a torch.amp.GradScaler
  (CUDA only: one global scale, inf checks all-reduced so every rank skips an overflowing step together).
- `bf16`: bf16 parameters, gradients and optimizer state (AdamW's moments take the parameters' dtype); no fp32
  master copy, no autocast: the cheapest and least accurate mode.
- `bf16-main` / `fp16-main`: mixed precision as Megatron-Core holds it (its Float16 optimizer / distributed
  optimizer): 16-bit parameters and activations, fp32 gradients (the main-grad buffer), and an fp32 main copy of
  the parameters with fp32 Adam moments in the optimizer (2 + 4 + 12 bytes per parameter with AdamW); no
  per-microbatch weight casts. `fp16-main` scales the loss.
- `fp8`: `bf16-main` with Transformer Engine's FP8 linears (delayed scaling, HYBRID format): every linear's matmul
  (forward, input and weight gradients) at the FP8 peak, attention and everything else in bf16; each step keeps an
  FP8 copy of the weights and its transpose (2 bytes per parameter, Hopper's layout).
- `bf16-main-bf16grads` / `fp8-bf16grads`: the same with 16-bit gradient buffers and reductions (Megatron-Core's
  library default `grad_reduce_in_fp32=False`, NeMo 1.x's `grad_sync_dtype: bf16`; Megatron-LM's training script
  accumulates bf16 models' gradients in fp32: the modes without the suffix).
The main-weight modes are analytic (capacity, `plan --device meta`): `pipeplan run` executes the first four.

Bytes per parameter (weights, gradients, optimizer state by optimizer and mode) are a cost: the one table is in
`pipeplan.costs.optimizer`, reading `Precision.param_bytes` from here. Activations are counted in the
compute dtype (measured profiles measure them under the mode's autocast); bytes crossing a cut in the dtype the
runtime sends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeplan.errors import ConfigError

if TYPE_CHECKING:
    import torch

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dtype(name: str) -> torch.dtype:
    import torch  # here, not at the top: the commands that plan without torch (simulate, --help) import this file

    return getattr(torch, name)


@dataclass(frozen=True)
class Precision:
    """A precision mode; dtypes are held by name (torch's: float32, bfloat16, float16) and read as torch dtypes."""

    name: str
    param_dtype_name: str  # what the parameters (and their gradients, optimizer state) are stored in
    autocast_dtype_name: str | None  # torch.autocast's dtype around each forward, None: no autocast
    grad_scaler: bool = False  # fp16: loss scaling with torch.amp.GradScaler
    grad_dtype_name: str | None = None  # gradients (None: the parameters' dtype)
    main_weights: bool = False  # the optimizer holds an fp32 main copy of 16-bit parameters (and fp32 moments)
    fp8_linears: bool = False  # linears' matmuls run in FP8 (Transformer Engine)
    runnable: bool = True  # `pipeplan run` executes it (else analytic only)

    @property
    def param_dtype(self) -> torch.dtype:
        return _dtype(self.param_dtype_name)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.autocast_dtype_name is None else _dtype(self.autocast_dtype_name)

    @property
    def grad_dtype(self) -> torch.dtype | None:
        return None if self.grad_dtype_name is None else _dtype(self.grad_dtype_name)

    @property
    def compute_dtype(self) -> torch.dtype:
        return _dtype(self.compute_dtype_name)

    @property
    def compute_dtype_name(self) -> str:
        return self.autocast_dtype_name or self.param_dtype_name

    @property
    def param_bytes(self) -> int:
        return _ITEMSIZE[self.param_dtype_name]

    @property
    def grad_bytes(self) -> int:
        return _ITEMSIZE[self.grad_dtype_name or self.param_dtype_name]

    def autocast(self, device_type: str):
        """The context each stage forward (and the loss) runs in."""
        if self.autocast_dtype_name is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "float32", None),
    "bf16-mixed": Precision("bf16-mixed", "float32", "bfloat16"),
    "fp16-mixed": Precision("fp16-mixed", "float32", "float16", grad_scaler=True),
    "bf16": Precision("bf16", "bfloat16", None),
    "bf16-main": Precision("bf16-main", "bfloat16", None, grad_dtype_name="float32", main_weights=True, runnable=False),
    "fp16-main": Precision(
        "fp16-main", "float16", None, True, grad_dtype_name="float32", main_weights=True, runnable=False
    ),
    "fp8": Precision(
        "fp8", "bfloat16", None, grad_dtype_name="float32", main_weights=True, fp8_linears=True, runnable=False
    ),
    "bf16-main-bf16grads": Precision(
        "bf16-main-bf16grads", "bfloat16", None, grad_dtype_name="bfloat16", main_weights=True, runnable=False
    ),
    "fp8-bf16grads": Precision("fp8-bf16grads", "bfloat16", None, main_weights=True, fp8_linears=True, runnable=False),
}


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ConfigError(f"--precision {name!r} is not supported; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


ANALYTIC_PRECISION = "bf16-main"  # analytic profiles, plans and capacity (see `default_precision`)


def default_precision(device: str) -> str:
    """fp32 on the CPU, bf16-mixed measured on a GPU (what `pipeplan run` trains in there), and bf16-main analytic
    (`meta`: a GPU preset's run at scale, as the engines that run one hold it — Megatron-Core and NeMo keep bf16
    weights with fp32 gradients and fp32 main weights — the same default for `plan --device meta`, `profile --device
    meta` and `capacity`, so that they predict the same layout alike; a plan for pipeplan's own runtime names a
    runnable mode, e.g. --precision bf16-mixed)."""
    if device == "cpu":
        return "fp32"
    return ANALYTIC_PRECISION if device == "meta" else "bf16-mixed"


def profile_precision(provenance) -> str:
    """A profile's precision; older profiles recorded only a dtype (float32 measured, bfloat16 analytic)."""
    if getattr(provenance, "precision", ""):
        return provenance.precision
    return "fp32" if provenance.dtype == "float32" else "bf16-mixed"


def check_device_precision(precision: str, device: str) -> None:
    """One line refusing what cannot run on `device` (cpu, cuda or meta: analytic): the analytic-only modes
    anywhere but meta, and fp16 loss scaling (a CUDA feature here) on the CPU."""
    mode = get_precision(precision)
    if not mode.runnable and device != "meta":
        raise ConfigError(
            f"--precision {precision} is analytic only (pipeplan's runtime does not hold Megatron's fp32 main weights"
            f"{' or FP8 linears' if mode.fp8_linears else ''}): plan it with --device meta --hardware NAME, or run "
            "bf16-mixed or bf16"
        )
    if precision == "fp16-mixed" and device == "cpu":
        raise ConfigError(
            "--precision fp16-mixed needs CUDA (its gradient scaler is not supported on the CPU); use bf16-mixed"
        )
