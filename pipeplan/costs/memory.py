"""Static memory (weights, gradients, optimizer state with any master copy) of stages and devices, and the
partitioner's per-stage memory screen, in bytes. Bytes per parameter come from `costs.optimizer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeplan.costs.arrays import LayerArrays
from pipeplan.costs.optimizer import expert_holders, optimizer_shards, zero_bytes_per_param
from pipeplan.costs.options import CostOptions
from pipeplan.costs.recompute import (
    mode_offered,
    stage_freed_bytes,
    stage_kept_bytes,
    stage_recompute_bytes,
    stage_recompute_ms,
)


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


def stage_optimizer_state_bytes(
    param_count, expert_param_count, optimizer_bytes_per_param: float, group_size, zero: int, expert_parallel: int = 1
):
    """`optimizer_state_bytes` of a stage whose `param_count` parameters include `expert_param_count` routed-expert
    ones: under expert parallelism those are held by `expert_holders(group_size, expert_parallel)` devices, so ZeRO-1
    shards their state over that many instead of the stage's whole group. The one formula the search's static bytes
    (`stage_static_per_param`) and capacity's optimizer column both use."""
    experts = expert_param_count if expert_parallel > 1 else 0
    dense = optimizer_state_bytes(np.asarray(param_count) - experts, optimizer_bytes_per_param, group_size, zero)
    holders = expert_holders(group_size, expert_parallel)
    return dense + optimizer_state_bytes(experts, optimizer_bytes_per_param, holders, zero)


def stage_static_per_param(
    split: tuple[float, float, float], param_count: int, expert_param_count: int, group_size, zero: int, ep: int = 1
) -> float:
    """Static bytes per parameter of a stage: weights + gradients + `stage_optimizer_state_bytes` / its parameters
    (`split`: `static_split`); `zero_bytes_per_param` for a stage without routed experts or ep = 1."""
    if not param_count or not expert_param_count or ep == 1:
        return float(zero_bytes_per_param(split, group_size, zero))
    state = stage_optimizer_state_bytes(param_count, expert_param_count, split[2], group_size, zero, ep)
    return split[0] + split[1] + float(state) / param_count


def spread_static_bytes(param_count, per_param: float, num_devices: int) -> float:
    """`static_bytes` of the whole model spread evenly over `num_devices`: a lower bound on what the fullest of
    them holds, needing no partition."""
    return float(static_bytes(param_count, per_param) / num_devices)


def device_static_bytes(
    stage_param_counts: Sequence[int], device_stages: Sequence[Sequence[int]], per_param: float | Sequence[float]
) -> tuple[float, ...]:
    """Per device: `static_bytes` of the stages (chunks) it holds (`device_stages[d]`: their indices); `per_param`
    one figure, or one per stage (ZeRO-1: each stage's group shards its optimizer state)."""
    each = list(per_param) if isinstance(per_param, Sequence) else [per_param] * len(stage_param_counts)
    return tuple(float(sum(static_bytes(stage_param_counts[s], each[s]) for s in stages)) for stages in device_stages)


def replica_share(count, replicas) -> np.ndarray:
    """A replica's round-robin share of `count` microbatches of its stage, ceil(count / replicas): replicated
    stages run their microbatches in order. Elementwise."""
    return np.ceil(np.asarray(count, dtype=np.float64) / np.asarray(replicas, dtype=np.float64))


def stage_memory_bytes(
    arrays: LayerArrays,
    config: CostOptions,
    first: np.ndarray | int,
    last: np.ndarray | int,
    replicas,
    held,
    *,
    mode: str = "none",
    group_size=None,
) -> np.ndarray:
    """The partitioner's per-device screen: static bytes + a bound on the live activations of a stage. `held` =
    (in flight, in flight before I) per stage position (`partition.single.inflight_counts`): microbatches whose F
    ran and whose W (or B) has not / whose I (or B) has not. At any moment live bytes = before-I x K + after-I x
    (A - f), with A the saved bytes, f what I frees and K what a microbatch keeps before its I (A without
    recomputation, `costs.recompute` with it), plus what recomputation re-creates while one I or B runs (R).
    Without recomputation that is <= in-flight x (A - f) + before-I x f; with it <= in-flight x (A - f) +
    before-I x max(0, K - (A - f)) + R (a fused B frees all, so there A - f counts as 0). Each count is a replica's
    `replica_share`. Static bytes follow `config.static_bytes_per_param(group_size)` (ZeRO-1 shards the optimizer
    state over the group, by default the replicas in every data-parallel pipeline; routed-expert weights under
    expert parallelism ep over group / ep). The planner checks every
    candidate's exact peak with the simulator."""
    total, before_i = held
    total_r, before_r = replica_share(total, replicas), replica_share(before_i, replicas)
    saved, freed = arrays.span("activation", first, last), stage_freed_bytes(arrays, mode, first, last)
    group = np.asarray(replicas, dtype=np.float64) * config.data_parallel if group_size is None else group_size
    params = static_bytes(arrays.span("param_count", first, last), config.static_bytes_per_param(group))
    ep = config.expert_parallel
    if ep > 1:  # routed-expert weights: ZeRO-1 shards their state over group / ep (`expert_bytes_per_param`)
        holders = expert_holders(group, ep)
        expert_shift = config.static_bytes_per_param(holders) - config.static_bytes_per_param(group)
        params = params + static_bytes(arrays.span("expert_param_count", first, last), expert_shift)
    if mode == "none":
        return params + total_r * (saved - freed) + before_r * freed
    after_i = saved - freed if config.splits_backward else 0.0
    per_layer = config.layer_recompute
    kept = stage_kept_bytes(arrays, mode, first, last, per_layer=per_layer)
    rise = stage_recompute_bytes(arrays, mode, first, last, per_layer=per_layer)
    return params + total_r * after_i + before_r * np.maximum(kept - after_i, 0.0) + rise


def least_stage_memory_bytes(
    arrays: LayerArrays, config: CostOptions, first: np.ndarray | int, last: np.ndarray | int, replicas, held
) -> np.ndarray:
    """The least `stage_memory_bytes` over the recomputation modes the stage may take (`config.recompute`)."""
    found = [
        np.where(
            mode_offered(arrays, mode, first, last),
            stage_memory_bytes(arrays, config, first, last, replicas, held, mode=mode),
            np.inf,
        )
        for mode in config.recompute_modes
    ]
    return found[0] if len(found) == 1 else np.minimum.reduce(np.broadcast_arrays(*found))


def screened_recompute(
    arrays: LayerArrays,
    config: CostOptions,
    first: np.ndarray | int,
    last: np.ndarray | int,
    replicas,
    held,
    limit: float,
    *,
    group_size=None,
) -> tuple[np.ndarray, np.ndarray]:
    """The recomputation mode of each candidate stage (elementwise over first, replicas, held): the one of
    `config.recompute_modes` offered there whose `stage_memory_bytes` fits `limit` with the least added time,
    earlier modes on ties. Returns (added ms per microbatch, inf where no mode fits; index into recompute_modes).
    Without recomputation: 0 where the stage fits, inf where not."""
    best: np.ndarray | None = None
    best_mode: np.ndarray | None = None
    for index, mode in enumerate(config.recompute_modes):
        memory = stage_memory_bytes(arrays, config, first, last, replicas, held, mode=mode, group_size=group_size)
        fits = (memory <= limit) & mode_offered(arrays, mode, first, last)
        added = np.where(fits, stage_recompute_ms(arrays, mode, first, last), np.inf)
        if best is None or best_mode is None:  # the first mode
            best, best_mode = added, np.zeros(np.shape(added), dtype=np.int64)
        else:
            better = added < best
            best, best_mode = np.where(better, added, best), np.where(better, index, best_mode)
    assert best is not None and best_mode is not None
    return best, best_mode
