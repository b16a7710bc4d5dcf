"""ZeRO-1 costs: the optimizer state sharded over the d devices that hold the same parameters (a stage's replicas
in every data-parallel pipeline), as `pipeplan run` executes it (runtime/zero.py). Vectorized over numpy arrays.

Memory per parameter on each device: weights + gradients + optimizer state / d, where the optimizer state counts
any fp32 master copy (`pipeplan.precision.static_split` gives the three parts for a precision). That is the table of
Megatron's distributed optimizer (Megatron Core developer guide, "Distributed Optimizer",
https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html), bytes per parameter:
    float16 param, float16 grads   20  ->  4 + 16/d
    float16 param, fp32 grads      18  ->  6 + 12/d
    fp32 param, fp32 grads         16  ->  8 + 8/d
pipeplan's fp32 and bf16-mixed (fp32 parameters are the master weights; autocast computes in bf16) are the last
row; bf16 (bf16 parameters, gradients and AdamW moments, no master copy) is 4 + 4/d.

Time: in place of the gradient all-reduce, a ring reduce-scatter of the gradients and, after the optimizer step, a
ring all-gather of the updated parameters; each takes d-1 steps, each step sending 1/d of the buffer:
    reduce-scatter = (d-1) latency + (d-1)/d x gradient bytes / bandwidth
    all-gather     = (d-1) latency + (d-1)/d x parameter bytes / bandwidth
With equal bytes the two add up to the ring all-reduce (`Cluster.allreduce_s`): ZeRO-1 moves as much as plain data
parallelism (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
section 7.2.1) but the all-gather sits after the optimizer step instead of inside the all-reduce.
"""

from __future__ import annotations

import numpy as np

from pipeplan.errors import ConfigError

ZERO_STAGES = (0, 1)  # 2 (gradients sharded) and 3 (parameters sharded) are not supported


def check_zero_stage(zero: int, *, option: str = "--zero") -> int:
    """`zero` if pipeplan supports that ZeRO stage, else one ConfigError naming the option."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ConfigError(
            f"{option} {zero} is not supported: pipeplan shards optimizer state only (ZeRO-1); use {option} 0 or 1"
        )
    return zero


def _shards(group_size, zero: int) -> np.ndarray:
    d = np.asarray(group_size, dtype=np.float64)
    if np.any(d < 1):
        raise ValueError("group sizes must be >= 1")
    return d if check_zero_stage(zero) == 1 else np.ones_like(d)


def zero_bytes_per_param(split: tuple[float, float, float], group_size, zero: int) -> np.ndarray:
    """Bytes per parameter on one device: weights + gradients + optimizer state / d (d = 1 when zero is 0).
    `split` is (weights, gradients, optimizer state with master copies) in bytes per parameter."""
    weights, gradients, optimizer = split
    return weights + gradients + optimizer / _shards(group_size, zero)


def optimizer_state_bytes(param_count, optimizer_bytes_per_param: float, group_size, zero: int) -> np.ndarray:
    """Optimizer state (master copies included) one device holds for `param_count` parameters held by
    `group_size` devices: all of it with zero 0, 1/d with zero 1 (the last shard rounds the buffer up to d x
    ceil(count / d) elements, at most d - 1 more, which this ignores)."""
    count = np.asarray(param_count, dtype=np.float64)
    return count * optimizer_bytes_per_param / _shards(group_size, zero)


def ring_reduce_scatter_s(num_bytes, group_size, *, bandwidth: float, latency_s: float) -> np.ndarray:
    """Seconds for a ring reduce-scatter of a `num_bytes` buffer over `group_size` devices."""
    return _ring_half(num_bytes, group_size, bandwidth, latency_s)


def ring_all_gather_s(num_bytes, group_size, *, bandwidth: float, latency_s: float) -> np.ndarray:
    """Seconds for a ring all-gather that leaves every device with the whole `num_bytes` buffer."""
    return _ring_half(num_bytes, group_size, bandwidth, latency_s)


def _ring_half(num_bytes, group_size, bandwidth: float, latency_s: float) -> np.ndarray:
    size = np.asarray(num_bytes, dtype=np.float64)
    d = np.asarray(group_size, dtype=np.float64)
    t = (d - 1) * latency_s + (d - 1) / np.maximum(d, 1.0) * size / bandwidth
    return np.where((d > 1) & (size > 0), t, 0.0)


def zero1_exchange_s(grad_bytes, param_bytes, group_size, *, bandwidth: float, latency_s: float) -> np.ndarray:
    """ZeRO-1's gradient and parameter exchange per step: the reduce-scatter of the gradients plus the all-gather
    of the updated parameters (what replaces the all-reduce)."""
    link = dict(bandwidth=bandwidth, latency_s=latency_s)
    return ring_reduce_scatter_s(grad_bytes, group_size, **link) + ring_all_gather_s(param_bytes, group_size, **link)
