"""Static memory (weights, gradients, optimizer state with any master copy) of stages and devices, and the
partitioner's per-stage memory screen, in bytes. Bytes per parameter come from `costs.optimizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipeplan.partition.costs.arrays import LayerArrays
from pipeplan.partition.costs.optimizer import optimizer_shards

if TYPE_CHECKING:
    from pipeplan.partition.config import PartitionConfig


def static_bytes(param_count, per_param: float):
    """Weights + gradients + optimizer state of `param_count` parameters (`per_param` from `bytes_per_param`, or
    one part of `static_split`): the one static-memory formula the partitioner, planner and capacity use.
    Vectorized; an array in, an array out."""
    return np.asarray(param_count, dtype=np.float64) * per_param


def optimizer_state_bytes(param_count, optimizer_bytes_per_param: float, group_size, zero: int) -> np.ndarray:
    """Optimizer state (master copies included) one device holds for `param_count` parameters held by `group_size`
    devices: all of it with zero 0, 1/d with zero 1 (the last shard rounds the buffer up to d x ceil(count / d)
    elements, at most d - 1 more, which this ignores)."""
    return static_bytes(param_count, optimizer_bytes_per_param) / optimizer_shards(group_size, zero)


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
