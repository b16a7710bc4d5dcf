"""Expert parallelism: the all-to-all formula by hand, a MoE profile split over ep ranks (expert weights / ep, the
all-to-alls added to each MoE block), routed-expert bytes per parameter under ZeRO-1, and refusals."""

from __future__ import annotations

import pytest

from pipeplan.cluster import Cluster, Link
from pipeplan.costs import bytes_per_param, expert_bytes_per_param, numerics
from pipeplan.errors import ConfigError
from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.search.sharding import Links, expert_comms, split_inputs
from pipeplan.search.tensor_search import (
    chosen_try,
    compute_floor_ms,
    search_tensor_parallel,
    tensor_parallel_sizes,
)

BATCH, SEQ, HIDDEN, TOP_K = 2, 32, 64, 2


@pytest.fixture(scope="module")
def moe_profile():
    spec = load_model("moe", {"experts": "8", "top_k": str(TOP_K), "layers": "3"})
    return profile_analytic(spec, batch_size=BATCH, hardware="h100", precision="bf16")


def test_all_to_all_sends_n_minus_1_of_n_parts_in_n_minus_1_steps():
    link = Link(bandwidth=100e9, latency_s=5e-6)
    assert link.all_to_all_s(8e6, 4) == pytest.approx(3 * 5e-6 + 0.75 * 8e6 / 100e9)
    assert link.all_to_all_s(8e6, 1) == 0.0


def test_moe_blocks_add_two_all_to_alls_each_way_of_tokens_times_top_k(moe_profile):
    link = Link(bandwidth=50e9, latency_s=10e-6)
    links = Links(tensor=link, context=link, expert=link)
    comms = expert_comms(moe_profile, 1, 1, 4, links, _zero_comms(moe_profile))
    slots_bytes = BATCH * SEQ * TOP_K * HIDDEN * 2  # bf16 hidden states of every token slot
    a2a = (3 * 10e-6 + 0.75 * slots_bytes / 50e9) * 1e3
    moe_blocks = [i for i, layer in enumerate(moe_profile.layers) if layer.expert_param_count]
    assert moe_blocks == [2, 3]  # blocks.1, blocks.2 (blocks.0 is dense)
    for i, comm in enumerate(comms):
        expected = 2 * a2a if i in moe_blocks else 0.0
        assert comm.forward_ms == pytest.approx(expected) and comm.backward_ms == pytest.approx(expected)


def _zero_comms(profile):
    from pipeplan.search.sharding import LayerComm

    return [LayerComm()] * profile.num_layers


def test_split_over_ep_holds_experts_over_ep_and_keeps_the_work(moe_profile):
    cluster = Cluster(num_devices=8, devices_per_node=8, memory_per_device=80 << 30, intra_node_bandwidth=450e9)
    split, _ = split_inputs(moe_profile, cluster, 1, 1, ep=4)
    for whole, rank in zip(moe_profile.layers, split.layers, strict=True):
        experts = whole.expert_param_count
        assert rank.expert_param_count == experts // 4
        assert rank.param_count == whole.param_count - experts + experts // 4
        grouped = [k for k in rank.work.kernels if k.experts] if rank.work else []
        assert all(k.batch == 2 and k.m == BATCH * SEQ * TOP_K // 8 * 4 for k in grouped)  # 2 experts, 4 ranks' rows
        assert rank.forward_ms >= whole.forward_ms  # the all-to-alls, on the same total expert FLOPs


def test_expert_bytes_per_param_shard_over_holders_divided_by_ep():
    dense = bytes_per_param(numerics("adamw", "bf16-main"), zero=1, group_size=128)
    expert = expert_bytes_per_param(numerics("adamw", "bf16-main"), zero=1, group_size=128, expert_parallel=64)
    assert dense == pytest.approx(2 + 4 + 12 / 128)
    assert expert == pytest.approx(2 + 4 + 12 / 2)  # 128 holders / ep 64: two hold each expert
    assert expert_bytes_per_param(numerics("adamw", "bf16-main"), zero=0, group_size=128, expert_parallel=64) == 18


def test_expert_parallelism_is_refused_where_it_cannot_split(moe_profile):
    cluster = Cluster(num_devices=8, devices_per_node=8, memory_per_device=80 << 30)
    with pytest.raises(ConfigError, match="--parallel ep=3: ep=3 must divide the model's 8 routed experts"):
        split_inputs(moe_profile, cluster, 1, 1, ep=3)
    dense = profile_analytic(load_model("llama", {"layers": "2"}), batch_size=1, hardware="h100", precision="bf16")
    with pytest.raises(ConfigError, match="no routed experts"):
        split_inputs(dense, cluster, 1, 1, ep=2)


def test_capacity_memory_columns_sum_to_the_searched_static_bytes_under_ep(moe_profile):
    """capacity's W + G + O equal the search's static bytes of that device (ZeRO-1, ep=2: the routed experts' state
    over half the holders), and O exceeds the dense-group figure the columns used to show."""
    from pipeplan.capacity.memory import device_memory_split
    from pipeplan.costs import optimizer_state_bytes
    from pipeplan.search.config import SearchConfig
    from pipeplan.search.search import search_plans

    cluster = Cluster(num_devices=4, devices_per_node=8, memory_per_device=80 << 30, intra_node_bandwidth=450e9)
    config = SearchConfig(
        global_batch_size=8, numerics=numerics("adamw", "bf16-main"), zero=1, expert_parallel=2, replication=False
    )
    result = search_plans(moe_profile, cluster, config, ("1f1b",))
    best = next(e for e in result.ranked if e.layout.data_parallel == 4)  # 1 stage x 4 pipelines
    profile = result.profiles[best.layout.microbatch_size]
    split = device_memory_split(best, profile, config.split)
    device = split.device
    assert split.weights + split.gradients + split.optimizer == pytest.approx(best.memory.static_bytes[device], abs=2)
    experts = sum(layer.expert_param_count for layer in profile.layers)
    assert experts > 0
    dense_group = optimizer_state_bytes(split.param_count, config.split[2], 4, 1)
    assert split.optimizer == pytest.approx(dense_group + experts * config.split[2] * (1 / 2 - 1 / 4), abs=2)


def test_an_ep_whose_compute_floor_is_over_the_fastest_is_not_searched_and_the_choice_is_the_same(
    moe_profile, monkeypatch
):
    """`dominated_reason` skips ep > 1 tries whose compute alone exceeds the fastest step found by more than the
    prediction margin (here every all-to-all's latency outweighs the tiny experts); searching them anyway chooses
    the same (t, ep) and plan, and each skipped try's true step is above its floor."""
    from pipeplan.search import tensor_search
    from pipeplan.search.config import SearchConfig

    cluster = Cluster(num_devices=4, devices_per_node=8, memory_per_device=80 << 30, intra_node_bandwidth=450e9)
    config = SearchConfig(global_batch_size=8, numerics=numerics("adamw", "bf16-main"), replication=False)
    sizes = tensor_parallel_sizes("1", moe_profile, cluster, 1, "auto")
    assert [item.expert_parallel for item in sizes] == [1, 2, 4]
    pruned = search_tensor_parallel(moe_profile, cluster, config, sizes, ("1f1b",))
    assert [item.searched for item in pruned] == [True, False, False]
    assert all(item.reason.startswith("not searched: its compute alone is at least") for item in pruned[1:])
    monkeypatch.setattr(tensor_search, "dominated_reason", lambda *args: "")
    full = search_tensor_parallel(moe_profile, cluster, config, sizes, ("1f1b",))
    assert all(item.searched for item in full)
    assert chosen_try(pruned).label == chosen_try(full).label
    assert chosen_try(pruned).result.best.step_ms == chosen_try(full).result.best.step_ms
    for item in full[1:]:
        assert item.step_ms >= compute_floor_ms(moe_profile, cluster, config, item)
