"""Static memory (weights, gradients, optimizer state with any master copy) and the partitioner's per-stage
memory screen, in bytes.

Bytes per parameter: `static_split(optimizer, precision)` = (weights, gradients, optimizer state), each in the
precision's parameter dtype (`pipeplan.precision`): `adamw` holds 2 state tensors per parameter (Adam's moments),
`sgd` 1 (momentum), `sgd-nomomentum` none, so `adamw` = 4 + 4 + 8 = 16 B/param under fp32, bf16-mixed and
fp16-mixed (the fp32 parameters are the master weights; autocast's low-precision copies live with the activations)
and 2 + 2 + 4 = 8 under bf16. A number as optimizer is the whole figure per parameter. `adamw-fp32` /
`adamw-bf16` are strict aliases of adamw under fp32 / bf16-mixed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipeplan.errors import ConfigError
from pipeplan.partition.costs.arrays import LayerArrays
from pipeplan.precision import PRECISIONS, get_precision

if TYPE_CHECKING:
    from pipeplan.partition.config import PartitionConfig

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}  # state tensors per parameter
OPTIMIZER_ALIASES = {"adamw-fp32": ("adamw", "fp32"), "adamw-bf16": ("adamw", "bf16-mixed")}
OPTIMIZER_NAMES = (*OPTIMIZER_STATES, *OPTIMIZER_ALIASES)


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
    """Weights + gradients + optimizer state per parameter: what `static_bytes` multiplies. Sharding options (e.g. a
    ZeRO degree dividing the optimizer state of `static_split`) belong here as keyword-only arguments, so every
    static figure downstream follows them."""
    return sum(static_split(optimizer, precision))


def static_bytes(param_count, per_param: float):
    """Weights + gradients + optimizer state of `param_count` parameters (`per_param` from `bytes_per_param`, or
    one part of `static_split`): the one static-memory formula the partitioner, planner and capacity use.
    Vectorized; an array in, an array out."""
    return np.asarray(param_count, dtype=np.float64) * per_param


def spread_static_bytes(param_count, per_param: float, num_devices: int) -> float:
    """`static_bytes` of the whole model spread evenly over `num_devices`: a lower bound on what the fullest of
    them holds, needing no partition."""
    return float(static_bytes(param_count, per_param) / num_devices)


def device_static_bytes(
    stage_param_counts: Sequence[int], device_stages: Sequence[Sequence[int]], per_param: float
) -> tuple[float, ...]:
    """Per device: `static_bytes` of the stages (chunks) it holds (`device_stages[d]`: their indices)."""
    return tuple(float(sum(static_bytes(stage_param_counts[s], per_param) for s in stages)) for stages in device_stages)


def replica_share(count, replicas) -> np.ndarray:
    """A replica's round-robin share of `count` microbatches of its stage, ceil(count / replicas): replicated
    stages run their microbatches in order. Elementwise."""
    return np.ceil(np.asarray(count, dtype=np.float64) / np.asarray(replicas, dtype=np.float64))


def stage_memory_bytes(
    arrays: LayerArrays, config: PartitionConfig, first: np.ndarray | int, last: int, replicas, held
) -> np.ndarray:
    """The partitioner's per-device screen: static bytes + a bound on the live activations of a stage. `held` =
    (in flight, in flight before I) per stage position (`partition.single.inflight_counts`): microbatches whose F
    ran and whose W (or B) has not / whose I (or B) has not. At any moment live bytes = before-I x saved +
    after-I x (saved - freed by I) <= in-flight x (saved - freed) + before-I x freed, each count a replica's
    `replica_share`. The planner checks every candidate's exact peak with the simulator."""
    total, before_i = held
    total_r, before_r = replica_share(total, replicas), replica_share(before_i, replicas)
    saved, freed = arrays.span("activation", first, last), arrays.span("freed", first, last)
    params = static_bytes(arrays.span("param_count", first, last), config.optimizer_bytes_per_param)
    return params + total_r * (saved - freed) + before_r * freed
