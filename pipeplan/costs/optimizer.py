"""Bytes per parameter of static memory: weights, gradients and optimizer state (master copies included), by
optimizer and precision, sharded or not. One formula, `sharded_bytes_per_param`: weights + gradients + optimizer
state / d, with d the devices that share the optimizer state (1 without ZeRO); the parts, and the table the tests
check them against:

- pipeplan's modes, `static_split(numerics)` (`Numerics`: the precision and the optimizer, resolved once by
  `numerics`): each part in the precision's parameter dtype (`pipeplan.precision`). `adamw` holds 2 state tensors
  per parameter (Adam's moments), `sgd` 1 (momentum), `sgd-nomomentum` none, so `adamw` = 4 + 4 + 8 = 16 B/param
  under fp32, bf16-mixed and fp16-mixed (the fp32 parameters are the master weights; autocast's low-precision copies
  live with the activations) and 2 + 2 + 4 = 8 under bf16. A number as optimizer is the whole figure per parameter.
  `adamw-fp32` / `adamw-bf16` are strict aliases of adamw under fp32 / bf16-mixed.
- Megatron-LM's distributed-optimizer table (the tests' oracle: tests/helpers/megatron_bytes.py; Megatron Core
  developer guide, "Distributed Optimizer", https://docs.nvidia.com/megatron-core/developer-guide/latest/
  api-guide/dist_optimizer.html), bytes per parameter unsharded -> sharded over d:
      16-bit parameters, 16-bit gradients   20  ->  4 + 16/d
      16-bit parameters, fp32 gradients     18  ->  6 + 12/d
      fp32 parameters, fp32 gradients       16  ->  8 + 8/d
  The optimizer state is Adam's fp32 moments (8) plus the fp32 main copies the model's own dtypes do not already
  provide. pipeplan's fp32 and bf16-mixed are the last row; bf16 (no master copy, moments in bf16) is 4 + 4/d.
- Optimizer-state precision, under the main-weight modes only (`MAIN_STATE_BYTES`: main copy, each moment):
  `adamw` holds an fp32 main copy and fp32 moments (4 + 2 x 4 = 12 B); `adamw-bf16moments` bf16 moments with the
  fp32 main copy (4 + 2 x 2 = 8 B: Megatron-Core's precision-aware distributed optimizer,
  `--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`, OptimizerConfig
  exp_avg_dtype / exp_avg_sq_dtype); `adamw-bf16state` the whole state in bf16, main copy included (2 + 2 x 2 =
  6 B: apex's DistributedFusedAdam as NeMo configures it with `optim.dtype: bf16` — "dtype: floating-point type for
  optimizer state", and its default `store_params=True` keeps a distributed copy of the parameters in that dtype;
  Megatron's `--main-params-dtype` offers fp32 or fp16, no bf16, so the Megatron export refuses it).
  Under the other modes they are refused in one line (their parameters are the master weights).

ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer state over the devices holding the same parameters (a
stage's replicas in every data-parallel pipeline), as `pipeplan run --zero 1` executes it (runtime/step/zero.py);
stages 2 and 3 are refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeplan.errors import ConfigError
from pipeplan.precision import Precision, get_precision

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}  # state tensors per parameter
# Under the main-weight modes: bytes of (the main copy, each state tensor) per parameter (sources in the docstring)
MAIN_STATE_BYTES = {"adamw-bf16moments": (4, 2), "adamw-bf16state": (2, 2)}
OPTIMIZER_STATES.update({name: 2 for name in MAIN_STATE_BYTES})  # Adam's two moments
_MAIN_DTYPES = {4: "fp32", 2: "bf16"}  # a main-weight optimizer's state: bytes per element -> its dtype
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
OPTIMIZER_ALIASES = {"adamw-fp32": ("adamw", "fp32"), "adamw-bf16": ("adamw", "bf16-mixed")}
OPTIMIZER_NAMES = (*OPTIMIZER_STATES, *OPTIMIZER_ALIASES)
ZERO_STAGES = (0, 1)  # 2 (gradients sharded) and 3 (parameters sharded) are not supported


def sharded_bytes_per_param(split: tuple[float, float, float], shards):
    """weights + gradients + optimizer state / shards, from `split` = (weights, gradients, optimizer state with
    master copies) per parameter; elementwise over `shards`."""
    weights, gradients, optimizer = split
    return weights + gradients + optimizer / np.asarray(shards, dtype=np.float64)


@dataclass(frozen=True)
class Numerics:
    """What a training step holds and computes in, resolved once by the command (`numerics`) and passed down: the
    precision mode and the optimizer — by name, or as a whole figure of static bytes per parameter
    (`optimizer_bytes`: no state to shard, no update to time). Every bytes-per-parameter figure below reads it."""

    precision: Precision
    optimizer: str = "adamw"  # adamw, sgd or sgd-nomomentum; "" when `optimizer_bytes` gives the bytes instead
    optimizer_bytes: float | None = None

    @property
    def named(self) -> bool:
        """Whether the optimizer is named (its state can be sharded by ZeRO-1 and its update timed)."""
        return self.optimizer_bytes is None

    @property
    def optimizer_label(self) -> str:
        """The optimizer as plan.json records it: its name, or its bytes per parameter."""
        return self.optimizer if self.named else str(self.optimizer_bytes)

    @property
    def optimizer_states(self) -> int:
        """State tensors per parameter of a named optimizer."""
        return OPTIMIZER_STATES[self.optimizer]

    @property
    def main_state_bytes(self) -> tuple[int, int]:
        """Under a main-weight mode: bytes of the optimizer's main copy and of each state tensor per parameter
        (fp32 both, unless the optimizer names 16-bit state: `MAIN_STATE_BYTES`)."""
        return MAIN_STATE_BYTES.get(self.optimizer, (4, 4))

    @property
    def state_layout(self) -> str:
        """The optimizer and what its state holds per parameter, in words (what `show` prints), from the figures
        `static_split` counts: e.g. `adamw-bf16state (bf16 main copy + 2 bf16 moments: 6 B/param)`."""
        if not self.named:
            return f"{self.optimizer_bytes:g} B/param of static memory (given as a number)"
        states = self.optimizer_states
        kind = {0: "", 1: "momentum"}.get(states, "moments")
        if self.precision.main_weights:
            main, per_state = self.main_state_bytes
            held = [f"{_MAIN_DTYPES[main]} main copy"] + [f"{states} {_MAIN_DTYPES[per_state]} {kind}"] * bool(states)
            return f"{self.optimizer} ({' + '.join(held)}: {main + per_state * states} B/param)"
        dtype = _DTYPE_NAMES.get(self.precision.param_dtype_name, self.precision.param_dtype_name)
        held = [f"{states} {dtype} {kind}"] * bool(states) + [f"the {dtype} weights as master copy"]
        return f"{self.optimizer} ({', '.join(held)}: {self.precision.param_bytes * states} B/param)"


def numerics(optimizer: str | float, precision: str) -> Numerics:
    """`optimizer` (a name, an alias, or bytes per parameter) and `precision` (a mode's name) checked and resolved:
    an alias unfolded; one that names another precision than the one given is refused. The precision is the
    command's (no default here)."""
    if isinstance(optimizer, str) and optimizer in OPTIMIZER_ALIASES:
        name, implied = OPTIMIZER_ALIASES[optimizer]
        if precision != implied:
            raise ConfigError(
                f"--optimizer {optimizer} means adamw under --precision {implied}, not {precision}; use --optimizer "
                "adamw (its bytes follow --precision)"
            )
        return Numerics(get_precision(implied), name)
    mode = get_precision(precision)
    if isinstance(optimizer, bool) or not isinstance(optimizer, str | int | float):
        raise ConfigError("--optimizer must be a name or a number of bytes per parameter")
    if isinstance(optimizer, str) and optimizer not in OPTIMIZER_STATES:
        raise ConfigError(
            f"unknown --optimizer {optimizer!r}; choose from: {', '.join(OPTIMIZER_NAMES)} or bytes per parameter"
        )
    if isinstance(optimizer, str) and optimizer in MAIN_STATE_BYTES and not mode.main_weights:
        raise ConfigError(
            f"optimizer {optimizer} sets the dtype of a main-weight optimizer's state; --precision {precision} has "
            "no main copy: use it with bf16-main, fp16-main, fp8 (or their -bf16grads), or use adamw"
        )
    if isinstance(optimizer, str):
        return Numerics(mode, optimizer)
    if not math.isfinite(optimizer) or optimizer < 0:
        raise ConfigError(f"optimizer bytes per parameter must be a finite number >= 0, got {optimizer}")
    return Numerics(mode, "", optimizer)


FP8_WEIGHT_COPY_BYTES = 2  # Transformer Engine's FP8 weight and its transpose (Hopper), kept through a step


@functools.lru_cache(maxsize=64)
def static_split(numerics: Numerics) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer state with any master copy) under `precision`. A
    number as optimizer is the whole figure (counted as optimizer state). Main-weight modes (`bf16-main`,
    `fp16-main`, `fp8`: Megatron's layout) hold fp32 gradients and, in the optimizer, a main copy and the moments
    (`Numerics.main_state_bytes`: fp32 unless the optimizer names 16-bit state): 2 + 4 + (4 + 4 x states) for
    adamw's fp32 state; `fp8` adds its FP8 weight copies to the weights. Cached: the partitioner asks for it per
    candidate stage."""
    if numerics.optimizer_bytes is not None:  # not named: the whole figure
        return 0.0, 0.0, float(numerics.optimizer_bytes)
    mode, states = numerics.precision, numerics.optimizer_states
    weights = float(mode.param_bytes + (FP8_WEIGHT_COPY_BYTES if mode.fp8_linears else 0))
    if mode.main_weights:
        main, per_state = numerics.main_state_bytes
        return weights, float(mode.grad_bytes), float(main + per_state * states)
    return weights, float(mode.grad_bytes), mode.param_bytes * float(states)


def bytes_per_param(numerics: Numerics, *, zero: int = 0, group_size=1):
    """Weights + gradients + optimizer state per parameter on one device: what `static_bytes` multiplies. With
    `zero` 1 the optimizer state is split over the `group_size` devices holding the same parameters
    (`zero_bytes_per_param`; elementwise over group_size, a float for a scalar). A number as optimizer is refused
    with ZeRO: its bytes have no optimizer-state part to shard."""
    if zero and not numerics.named:
        raise ConfigError(
            "ZeRO-1 (zero=1) needs a named optimizer (adamw, sgd): a number of bytes has no state to shard"
        )
    value = zero_bytes_per_param(static_split(numerics), group_size, zero)
    return float(value) if np.ndim(value) == 0 else value


def expert_bytes_per_param(numerics: Numerics, *, zero: int, group_size, expert_parallel: int):
    """`bytes_per_param` of a routed-expert parameter: expert parallelism `expert_parallel` splits the experts over
    ranks carved from the `group_size` devices holding a stage's dense parameters (Megatron-Core), so each expert
    is held by group_size / expert_parallel of them, over which ZeRO-1 shards its optimizer state."""
    if not zero or expert_parallel == 1:
        return bytes_per_param(numerics, zero=zero, group_size=group_size)
    return bytes_per_param(numerics, zero=zero, group_size=expert_holders(group_size, expert_parallel))


def expert_holders(group_size, expert_parallel: int):
    """Devices holding the same routed expert (the expert data-parallel group): the `group_size` devices holding a
    stage's dense parameters / `expert_parallel`, at least 1 (Megatron-Core carves ep ranks from them). Elementwise;
    what ZeRO-1 shards expert optimizer state over and expert gradients are exchanged over."""
    return np.maximum(np.asarray(group_size, dtype=np.float64) / expert_parallel, 1.0)


def check_zero_stage(zero: int | str, *, option: str = "--memory zero") -> int:
    """`zero` if pipeplan supports that ZeRO stage, else one ConfigError naming the option."""
    if not isinstance(zero, int) or isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ConfigError(
            f"{option}={zero} is not supported: pipeplan shards optimizer state only (ZeRO-1); use {option}=0 or 1"
        )
    return zero


def optimizer_shards(group_size, zero: int) -> np.ndarray:
    """How many ways the optimizer state is split: the group size d under ZeRO-1, else 1 (elementwise)."""
    d = np.asarray(group_size, dtype=np.float64)
    if np.any(d < 1):
        raise ValueError("group sizes must be >= 1")
    return d if check_zero_stage(zero) == 1 else np.ones_like(d)


def zero_bytes_per_param(split: tuple[float, float, float], group_size, zero: int) -> np.ndarray:
    """Bytes per parameter on one device of a group of `group_size` holding the same parameters, under ZeRO stage
    `zero`: weights + gradients + optimizer state / d (d = 1 when zero is 0)."""
    return sharded_bytes_per_param(split, optimizer_shards(group_size, zero))


def undo_copy_bytes(
    param_counts: Sequence[int], device_stages: Sequence[Sequence[int]], numerics: Numerics
) -> tuple[float, ...]:
    """Per device, what `run --post-validate` keeps to undo an eager step (runtime/train/post_validate.py, StepUndo):
    its stages' parameters and optimizer state once more, and the eager step's gradients, held while the next step's
    backward fills fresh ones (whole parameters: ZeRO-1's shards are not counted here)."""
    weights, gradients, state = static_split(numerics)
    return tuple(sum(param_counts[s] for s in stages) * (weights + gradients + state) for stages in device_stages)
