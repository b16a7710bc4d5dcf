"""The cost module's formulas against hand computations, and its vectorized forms against scalar calls."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.cluster import Link
from pipeplan.costs import (
    LayerArrays,
    StageCostModel,
    all_gather_ms,
    allreduce_ms,
    busiest_device_ms,
    bytes_per_param,
    compute_ms,
    device_static_bytes,
    device_totals,
    exposed_transfer_ms,
    numerics,
    pipedream_stage_ms,
    pipedream_sync_ms,
    pipedream_transfer_ms,
    reduce_scatter_ms,
    replica_share,
    sharded_bytes_per_param,
    span_compute_ms,
    spread_static_bytes,
    stage_grad_ms,
    stage_memory_bytes,
    stage_ms,
    stages_per_device,
    static_bytes,
    static_split,
    transfer_ms,
)
from pipeplan.errors import ConfigError
from pipeplan.partition import Cluster, PartitionConfig
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance

LINK = Link(bandwidth=2e9, latency_s=1e-5)  # 2 GB/s, 10 us


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    assert LINK.transfer_s(4e6) == pytest.approx(1e-5 + 4e6 / 2e9, rel=1e-15)  # 2.01 ms
    assert transfer_ms(4e6, LINK) == pytest.approx(2.01, rel=1e-12)
    assert LINK.transfer_s(0) == 0.0 and transfer_ms(0, LINK) == 0.0  # nothing to send: no latency either
    assert isinstance(LINK.transfer_s(1), float)


def test_ring_collectives_by_hand():
    n, size = 4, 8e6
    # all-reduce: 2 (n-1) = 6 latency steps + 2 * 3/4 * 8 MB / 2 GB/s = 6 ms
    assert allreduce_ms(size, n, LINK) == pytest.approx(6 * 1e-2 + 6.0, rel=1e-12)
    # reduce-scatter and all-gather: one pass each, 3 steps + 3/4 * 8 MB / 2 GB/s = 3 ms
    assert reduce_scatter_ms(size, n, LINK) == pytest.approx(3 * 1e-2 + 3.0, rel=1e-12)
    assert all_gather_ms(size, n, LINK) == pytest.approx(3 * 1e-2 + 3.0, rel=1e-12)
    assert reduce_scatter_ms(size, n, LINK) + all_gather_ms(size, n, LINK) == pytest.approx(
        allreduce_ms(size, n, LINK), rel=1e-12
    )
    for fn in (allreduce_ms, reduce_scatter_ms, all_gather_ms):
        assert fn(size, 1, LINK) == 0.0  # one device: nothing to exchange
        assert fn(0, n, LINK) == 0.0


def test_cluster_picks_the_link():
    cluster = Cluster(
        num_devices=8,
        devices_per_node=4,
        memory_per_device=1 << 30,
        intra_node_bandwidth=1e10,
        inter_node_bandwidth=1e9,
        intra_node_latency_s=1e-6,
        inter_node_latency_s=1e-4,
    )
    assert cluster.link(same_node=True) == Link(bandwidth=1e10, latency_s=1e-6) == cluster.intra_link
    assert cluster.link(same_node=False) == Link(bandwidth=1e9, latency_s=1e-4) == cluster.inter_link
    assert cluster.link_between([0, 3]) == cluster.intra_link
    assert cluster.link_between([3, 4]) == cluster.inter_link
    assert cluster.link_for_consecutive(4) == cluster.intra_link
    assert cluster.link_for_consecutive(5) == cluster.inter_link
    assert cluster.transfer_s(1e6, same_node=False) == pytest.approx(1e-4 + 1e-3, rel=1e-15)
    assert cluster.allreduce_s(1e6, 2, same_node=True) == pytest.approx(2 * 1e-6 + 1e6 / 1e10, rel=1e-15)


def test_scalar_and_vector_link_formulas_agree_exactly():
    sizes = np.array([0.0, 1.0, 3e3, 7.5e5, 1.2e9])
    groups = np.array([1, 2, 3, 8, 1024])
    vector = LINK.transfer_s(sizes)
    assert vector.shape == sizes.shape
    assert [LINK.transfer_s(float(b)) for b in sizes] == vector.tolist()
    grid = allreduce_ms(sizes[:, None], groups[None, :], LINK)
    for i, b in enumerate(sizes):
        for j, n in enumerate(groups):
            assert allreduce_ms(float(b), int(n), LINK) == grid[i, j]
            assert reduce_scatter_ms(float(b), int(n), LINK) == reduce_scatter_ms(sizes, n, LINK)[i]
            assert all_gather_ms(float(b), int(n), LINK) == all_gather_ms(b, groups, LINK)[j]


def test_pipedream_terms_by_hand():
    # 2 x 1 MB / (1 GB/s x 2 replicas) = 1 ms; 4 x (3-1) x 3 MB / (1 GB/s x 3) = 8 ms
    assert pipedream_transfer_ms(1e6, 2, 1e9) == pytest.approx(1.0, rel=1e-12)
    assert pipedream_sync_ms(3e6, 3, 1e9) == pytest.approx(8.0, rel=1e-12)
    assert pipedream_sync_ms(3e6, 1, 1e9) == 0.0
    # (compute 10 + sync 8) / 3 = 6 against a transfer term of 7
    assert pipedream_stage_ms(10.0, 8.0, 7.0, 3) == 7.0
    assert pipedream_stage_ms(10.0, 8.0, 5.0, 3) == 6.0


def test_compute_and_stage_time_by_hand():
    assert compute_ms(1.0, 2.0, 3.0, 4.5, split_backward=True) == 6.0  # F + I + W
    assert compute_ms(1.0, 2.0, 3.0, 4.5, split_backward=False) == 5.5  # F + B
    assert exposed_transfer_ms(3.0, 5.0, 2) == 4.0
    # compute 12 over 3 replicas + all-reduce 8 over 4 microbatches = 6, against transfers 5
    assert stage_ms(12.0, 3, allreduce=8.0, num_microbatches=4, transfers=5.0) == 6.0
    assert stage_ms(12.0, 3, allreduce=8.0, num_microbatches=4, transfers=6.5) == 6.5


def _arrays() -> LayerArrays:
    layers = [
        LayerProfile(
            name=f"l{i}",
            forward_ms=1.0 + i,
            input_grad_ms=0.5 * i,
            weight_grad_ms=2.0,
            backward_ms=2.5 + i,
            activation_bytes=1000 * (i + 1),
            activation_freed_by_input_grad_bytes=400 * i,
            param_count=100 * (i + 2),
            param_bytes=400 * (i + 2),
        )
        for i in range(4)
    ]
    profile = Profile(layers=tuple(layers), cut_bytes=(3e6, 0, 5e6), provenance=Provenance(source="analytic"))
    return LayerArrays.from_profile(profile)


def test_stage_grad_ms_moves_the_first_stages_input_gradient_to_w():
    """A stage's I (with its recomputation) and W; the model's first stage has no input gradient, so its I only
    recomputes and W runs its layers' whole backward in one pass (their fused B, not I + W) — in model order and in
    reversed (V second half) order alike."""
    arrays = _arrays()  # I = 0, 0.5, 1, 1.5; W = 2 each; B = 2.5, 3.5, 4.5, 5.5
    assert stage_grad_ms(arrays, 1, 2, 0.25) == (1.5 + 0.25, 4.0)
    assert stage_grad_ms(arrays, 0, 2, 0.25) == (0.25, 2.5 + 3.5 + 4.5)
    back = arrays.reversed()  # item k is layer 3 - k: the model's first layer is the last item
    assert stage_grad_ms(back, 0, 1, 0.0) == (2.5, 4.0)
    assert stage_grad_ms(back, 2, 3, 0.0) == (0.0, 3.5 + 2.5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_stage_cost_model_agrees_with_the_scalar_formulas(schedule):
    """Every DP cell (first, replicas) equals the stage time assembled from the scalar formulas."""
    arrays, config = (
        _arrays(),
        PartitionConfig(num_microbatches=4, schedule=schedule, numerics=numerics("adamw", "bf16-mixed")),
    )
    model = StageCostModel(arrays=arrays, config=config, link=LINK, num_microbatches=4)
    other = Link(bandwidth=1e9, latency_s=3e-5)
    replicas = np.arange(1, 4)
    for last in range(arrays.num_items):
        table = model.times(last, replicas, in_link=other, out_link=LINK)
        for a in range(last + 1):
            layers = range(a, last + 1)
            f = sum(1.0 + i for i in layers)
            i_w = sum(0.5 * i + 2.0 for i in layers)
            b = sum(2.5 + i for i in layers)
            compute = f + (i_w if schedule == "zb-h1" and a > 0 else b)  # the first stage: W is one backward
            assert float(span_compute_ms(arrays, config, a, last)) == pytest.approx(compute, rel=1e-12)
            params = sum(400 * (i + 2) for i in layers)
            for r in replicas:
                t_in, t_out = transfer_ms(arrays.cut[a], other), transfer_ms(arrays.cut[last + 1], LINK)
                expected = stage_ms(
                    float(span_compute_ms(arrays, config, a, last)),
                    int(r),
                    allreduce=allreduce_ms(params, r, LINK),
                    num_microbatches=4,
                    transfers=exposed_transfer_ms(t_in, t_out, int(r)),
                )
                assert table[a, r - 1] == expected
                by_hand = max(compute / r + allreduce_ms(params, r, LINK) / 4, (t_in + t_out) / r)
                assert table[a, r - 1] == pytest.approx(by_hand, rel=1e-12)


def test_pipedream_stage_cost_model_by_hand():
    arrays = _arrays()
    config = PartitionConfig(num_microbatches=2, cost_model="pipedream", numerics=numerics("adamw", "bf16-mixed"))
    link = Link(bandwidth=1e9, latency_s=0.0)
    model = StageCostModel(arrays=arrays, config=config, link=link, num_microbatches=2)
    table = model.times(2, np.array([1, 2]), in_link=link, out_link=link)
    # stage [1..2], 2 replicas: F + B = (2 + 3) + (3.5 + 4.5) = 13; params 1200 + 1600 bytes
    sync = 4 * 1 * 2800 / (1e9 * 2) * 1e3
    comm = max(2 * 3e6 / (1e9 * 2) * 1e3, 2 * 5e6 / (1e9 * 2) * 1e3)  # in cut 3 MB, out cut 5 MB
    assert table[1, 1] == pytest.approx(max((13.0 + sync) / 2, comm), rel=1e-12)
    assert table[0, 0] == pytest.approx(1 + 2.5 + 2 + 3.5 + 3 + 4.5, rel=1e-12)  # the first stage: no transfer


def test_optimizer_bytes_table():
    assert static_split(numerics("adamw", "bf16-mixed")) == (4.0, 4.0, 8.0)  # fp32 master weights, grads, 2 moments
    assert bytes_per_param(numerics("adamw", "fp32")) == 16.0
    assert bytes_per_param(numerics("adamw", "bf16")) == 8.0
    assert bytes_per_param(numerics("sgd", "bf16")) == 6.0
    assert bytes_per_param(numerics("sgd-nomomentum", "fp16-mixed")) == 8.0
    assert static_split(numerics(6.5, "bf16-mixed")) == (0.0, 0.0, 6.5)
    assert sharded_bytes_per_param((4.0, 4.0, 8.0), 4) == 4 + 4 + 8 / 4  # the optimizer state split 4 ways
    assert sharded_bytes_per_param((2.0, 2.0, 4.0), [1, 2]).tolist() == [8.0, 6.0]
    with pytest.raises(ConfigError, match="--optimizer"):
        bytes_per_param(numerics("lion", "bf16-mixed"))


def test_static_memory_by_hand():
    assert static_bytes(1000, 16.0) == 16000.0
    assert static_bytes(np.array([1, 2]), 6.0).tolist() == [6.0, 12.0]
    assert spread_static_bytes(1000, 16.0, 4) == 4000.0
    # device 0 holds stages 0 and 2 (a V shape), device 1 stage 1
    assert device_static_bytes([10, 20, 30], [(0, 2), (1,)], 2.0) == (80.0, 40.0)


def test_replica_share_and_stage_memory_by_hand():
    assert replica_share(5, 2) == 3.0 and replica_share(4, 2) == 2.0
    assert replica_share(np.array([7, 1]), np.array([3, 3])).tolist() == [3.0, 1.0]
    arrays, config = _arrays(), PartitionConfig(num_microbatches=4, numerics=numerics(2.0, "bf16-mixed"))
    # stage [1..2] on 2 replicas, (in flight 5, before I 3) -> per replica (3, 2):
    # static 2 B x (300 + 400) + 3 x (saved 5000 - freed 1200) + 2 x 1200
    assert stage_memory_bytes(arrays, config, 1, 2, 2, (5, 3)) == 1400 + 3 * 3800 + 2 * 1200
    firsts = np.array([0, 1, 2])
    vector = stage_memory_bytes(arrays, config, firsts, 2, 2, (5, 3))
    assert vector.tolist() == [stage_memory_bytes(arrays, config, a, 2, 2, (5, 3)) for a in firsts]


def test_device_sums():
    held = stages_per_device([(0, 2), (1, 2)])  # stage 0 on devices 0 and 2, stage 1 on 1 and 2
    assert held == [[0], [1], [0, 1]]
    assert device_totals([1.5, 2.0], held) == [1.5, 2.0, 3.5]
    assert busiest_device_ms([1.5, 2.0], held) == 3.5
    assert busiest_device_ms([], []) == 0.0
