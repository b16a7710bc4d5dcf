"""ZeRO-1 cost formulas (pipeplan/costs/) against their sources: Megatron's distributed-optimizer
bytes-per-parameter table and the ring all-reduce they replace."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.megatron_bytes import MEGATRON_SPLITS, MEGATRON_TABLE

from pipeplan.cluster import Cluster, Link
from pipeplan.costs import (
    check_zero_stage,
    numerics,
    optimizer_state_bytes,
    static_split,
    zero1_exchange_ms,
    zero_bytes_per_param,
)
from pipeplan.errors import ConfigError


@pytest.mark.parametrize("row", list(MEGATRON_TABLE))
@pytest.mark.parametrize("d", [1, 2, 8, 64, 1000])
def test_bytes_per_param_are_megatrons_table(row, d):
    unsharded, (constant, numerator) = MEGATRON_TABLE[row]
    split = MEGATRON_SPLITS[row]
    assert zero_bytes_per_param(split, d, 0) == unsharded
    assert zero_bytes_per_param(split, d, 1) == pytest.approx(constant + numerator / d, rel=1e-12)


def test_pipeplan_precisions_follow_the_table():
    """fp32 and bf16-mixed (fp32 parameters are the master weights) are Megatron's fp32 row; bf16 has no master
    copy and keeps AdamW's moments in bf16."""
    d = np.array([1, 2, 4, 16])
    fp32_row = 8 + 8 / d
    for precision in ("fp32", "bf16-mixed"):
        np.testing.assert_allclose(zero_bytes_per_param(static_split(numerics("adamw", precision)), d, 1), fp32_row)
    np.testing.assert_allclose(zero_bytes_per_param(static_split(numerics("adamw", "bf16")), d, 1), 4 + 4 / d)


def test_optimizer_state_bytes_shrink_by_the_group_size():
    params = np.array([1e6, 7e9])
    np.testing.assert_allclose(optimizer_state_bytes(params, 8.0, 4, 0), 8 * params)
    np.testing.assert_allclose(optimizer_state_bytes(params, 8.0, np.array([4, 8]), 1), [2e6, 7e9])
    np.testing.assert_allclose(optimizer_state_bytes(params, 12.0, 1, 1), 12 * params)  # one holder: no sharding


def test_reduce_scatter_plus_all_gather_is_the_ring_all_reduce():
    for same_node in (True, False):
        cluster = Cluster(num_devices=64, devices_per_node=8, memory_per_device=1 << 30)
        bandwidth = cluster.intra_node_bandwidth if same_node else cluster.inter_node_bandwidth
        latency = cluster.intra_node_latency_s if same_node else cluster.inter_node_latency_s
        for d in (1, 2, 3, 8, 64):
            for size in (0.0, 1e3, 4e9):
                link = Link(bandwidth=bandwidth, latency_s=latency)
                both = zero1_exchange_ms(size, size, d, link) / 1e3
                assert float(both) == pytest.approx(cluster.allreduce_s(size, d, same_node=same_node), rel=1e-12)


def test_each_ring_half_moves_d_minus_one_over_d_of_the_buffer():
    link = Link(bandwidth=100e9, latency_s=5e-6)
    d = np.array([2, 4, 8])
    expected = (d - 1) * 5e-6 + (d - 1) / d * 1e9 / 100e9  # d - 1 steps of 1/d of a 1 GB buffer
    np.testing.assert_allclose(link.reduce_scatter_s(1e9, d), expected)
    np.testing.assert_allclose(link.all_gather_s(1e9, d), expected)
    # bf16 parameters gathered, fp32 gradients reduce-scattered (Megatron's float16-param, fp32-grad row)
    np.testing.assert_allclose(zero1_exchange_ms(4e9, 2e9, 8, link) / 1e3, 2 * 7 * 5e-6 + 7 / 8 * 6e9 / 100e9)


def test_only_zero_stages_0_and_1():
    assert check_zero_stage(1) == 1
    for bad in (2, 3, -1, True):
        with pytest.raises(ConfigError, match="--memory zero=.* not supported.*ZeRO-1"):
            check_zero_stage(bad)
    with pytest.raises(ConfigError):
        zero_bytes_per_param((4, 4, 8), 2, 3)


# Optimizer-state precision under the main-weight modes, by hand: (weights, gradients, optimizer state) per
# parameter. Main copy + two Adam moments: fp32 + fp32 (12), fp32 + bf16 (Megatron's precision-aware optimizer,
# --exp-avg-dtype/--exp-avg-sq-dtype bf16: 4 + 2 + 2 = 8), all bf16 (NeMo's distributed Adam, optim.dtype bf16:
# 2 + 2 + 2 = 6). FP8 adds its 2-byte weight copy; -bf16grads halves the gradient buffer.
STATE_TABLE = {
    ("bf16-main", "adamw"): (2, 4, 12),
    ("bf16-main", "adamw-bf16moments"): (2, 4, 8),
    ("bf16-main", "adamw-bf16state"): (2, 4, 6),
    ("bf16-main-bf16grads", "adamw-bf16moments"): (2, 2, 8),
    ("bf16-main-bf16grads", "adamw-bf16state"): (2, 2, 6),
    ("fp16-main", "adamw-bf16state"): (2, 4, 6),
    ("fp8", "adamw-bf16moments"): (4, 4, 8),
    ("fp8-bf16grads", "adamw-bf16state"): (4, 2, 6),
}


@pytest.mark.parametrize(("precision", "optimizer"), list(STATE_TABLE))
def test_optimizer_state_precision_bytes_are_the_hand_table(precision, optimizer):
    weights, gradients, state = STATE_TABLE[(precision, optimizer)]
    assert static_split(numerics(optimizer, precision)) == (weights, gradients, state)
    d = np.array([1, 2, 8])  # ZeRO-1 shards only the optimizer state (main copy and moments)
    np.testing.assert_allclose(
        zero_bytes_per_param(static_split(numerics(optimizer, precision)), d, 1), weights + gradients + state / d
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_16_bit_optimizer_state_needs_a_main_weight_mode(precision):
    with pytest.raises(ConfigError, match="no main copy") as refused:
        numerics("adamw-bf16state", precision)
    assert "\n" not in str(refused.value)
