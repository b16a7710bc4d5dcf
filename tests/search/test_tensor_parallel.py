"""Tensor parallelism in the analytic planner (planner.tensor_parallel): kept bytes against Korthikanti et al.'s
Table 2 with sequence parallelism (a GPT-3-shaped stack, and a real analytic profile of the built-in gpt), the
collectives against hand-computed ring times, the layer roles and every refusal, and the groups-as-devices
cluster."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.search import stack_profile
from helpers.transformer_reference import activation_bytes_per_layer

from pipeplan.cluster import Cluster, DeviceGroups, Link
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import ConfigError
from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.profile import Profile
from pipeplan.search.sharding import Links, split_inputs, split_profile
from pipeplan.search.stack import check_split, stack_problem, tensor_parallel_problem, transformer_layers

GPT3 = dict(seq=2048, batch=1, hidden=12288, heads=96)  # Korthikanti et al. Table 3
LINK = Link(bandwidth=100e9, latency_s=5e-6)


def _ring_ms(num_bytes: float, t: int, link: Link) -> float:
    """One ring pass by hand: (t-1) steps of latency + bytes/t each."""
    return ((t - 1) * link.latency_s + (t - 1) / t * num_bytes / link.bandwidth) * 1e3


def _gpt3_block(recompute_bytes: dict[str, int]) -> dict:
    return dict(
        activation_bytes=recompute_bytes["none"],
        selective_activation_bytes=recompute_bytes["selective"],
        full_activation_bytes=recompute_bytes["full"],
        activation_freed_by_input_grad_bytes=recompute_bytes["none"] // 2,
    )


@pytest.mark.parametrize("t", [2, 4, 8])
def test_block_bytes_follow_korthikanti_table_2_with_sequence_parallelism(t):
    """A block keeping exactly Table 2's bytes without parallelism keeps the tensor + sequence parallel rows."""
    kept = {
        mode: activation_bytes_per_layer(**GPT3, flash_attention=False, recompute=mode)
        for mode in ("none", "selective", "full")
    }
    sbh = GPT3["seq"] * GPT3["batch"] * GPT3["hidden"]
    profile = stack_profile(hidden_bytes=2 * sbh, block=_gpt3_block(kept), options={"heads": 96, "hidden": 12288})
    block = split_profile(profile, t, 1, Links(tensor=LINK, context=LINK)).layers[1]
    for mode in ("none", "selective", "full"):
        expected = activation_bytes_per_layer(
            **GPT3, flash_attention=False, tensor_parallel=t, sequence_parallel=True, recompute=mode
        )
        assert block.kept_bytes(mode) == expected, mode
    assert block.activation_freed_by_input_grad_bytes == kept["none"] // 2 // t


@pytest.fixture(scope="module")
def gpt_math() -> Profile:
    options = dict(layers=2, hidden=32, heads=4, seq=16, vocab=64, dropout=0.1)
    spec = load_model("gpt", {k: str(v) for k, v in options.items()})
    return profile_analytic(spec, batch_size=2, hardware="h100", precision="bf16", attention="math")


@pytest.mark.parametrize("t", [2, 4])
def test_analytic_gpt_blocks_keep_table_2_over_t(gpt_math, t):
    """The real profiler's block (bf16, math attention, dropout) is the paper's layer plus torch's float32
    LayerNorm statistics and the s×s causal mask (test_recompute_profile); under t-way tensor + sequence
    parallelism it keeps the paper's row for t plus those extras over t."""
    seq, batch, hidden, heads = 16, 2, 32, 4
    extras = 16 * seq * batch + seq**2
    shape = dict(seq=seq, batch=batch, hidden=hidden, heads=heads, flash_attention=False)
    sharded = split_profile(gpt_math, t, 1, Links(tensor=LINK, context=LINK))
    for block in sharded.layers[1:-1]:
        assert (
            block.activation_bytes
            == activation_bytes_per_layer(**shape, tensor_parallel=t, sequence_parallel=True) + extras // t
        )
        assert block.full_activation_bytes == activation_bytes_per_layer(
            **shape, tensor_parallel=t, sequence_parallel=True, recompute="full"
        )
    assert transformer_layers(gpt_math).hidden_bytes == 2 * seq * batch * hidden


def test_compute_splits_and_collectives_ride_the_critical_path():
    t, hidden = 4, 1 << 20
    profile = stack_profile(hidden_bytes=hidden)
    sharded = split_profile(profile, t, 1, Links(tensor=LINK, context=LINK))
    ring = _ring_ms(hidden, t, LINK)
    embed, block, head = sharded.layers[0], sharded.layers[1], sharded.layers[-1]
    # a block: 2 all-gathers + 2 reduce-scatters forward, the same on the input-gradient path, and the 2 re-gathers
    # of the sequence-parallel inputs for the weight gradients (exposed: this profile has no matmuls to hide them)
    assert block.forward_ms == pytest.approx(1.0 / t + 4 * ring)
    assert block.input_grad_ms == pytest.approx(1.0 / t + 6 * ring)
    assert block.backward_ms == pytest.approx(2.0 / t + 6 * ring)
    assert block.weight_grad_ms == pytest.approx(1.0 / t)
    assert block.full_recompute_ms == pytest.approx(1.0 / t + 4 * ring)  # the forward again, collectives included
    assert block.flops == pytest.approx(1e9 / t) and block.param_count == 250
    # the embedding: reduce-scatter forward, all-gather of the output gradient on W (it has no I)
    assert embed.forward_ms == pytest.approx(1.0 / t + ring)
    assert embed.input_grad_ms == 0.0 and embed.weight_grad_ms == pytest.approx(1.0 / t + ring)
    # the head: all-gather + 3 all-reduces of one fp32 per token forward, reduce-scatter backward
    losses = 3 * 2 * _ring_ms(4 * 16, t, LINK)
    assert head.forward_ms == pytest.approx(1.0 / t + ring + losses)
    assert head.input_grad_ms == pytest.approx(1.0 / t + ring)
    assert sharded.cut_bytes == tuple(b // t for b in profile.cut_bytes)


def test_overlapping_tensor_parallel_collectives_costs_what_their_sms_and_chunks_take():
    """--overlap tensor hides a block's collectives behind its linears at the rank's shape, not for free: the SMs a
    collective occupies (`Overlap.comm_sms`) slow the matmuls beside it, and the linears run as t chunks (on a
    tiny model the chunks' launches would cost more than they hide; here, a 4096-wide block, they do not)."""
    spec = load_model("gpt", dict(layers=2, hidden=4096, heads=32, seq=2048, vocab=1024))
    profile = profile_analytic(spec, batch_size=1, hardware="h100", precision="bf16-main")
    links, t = Links(tensor=Link(bandwidth=370e9, latency_s=10e-6), context=LINK), 4
    exposed = split_profile(profile, t, 1, links).layers[1]
    times = {
        sms: split_profile(profile, t, 1, links, overlap=Overlap(tensor=True, comm_sms=sms)).layers[1]
        for sms in (0, 8, 64)
    }
    assert times[0].forward_ms < times[8].forward_ms < times[64].forward_ms  # more SMs taken, slower matmuls
    assert times[8].forward_ms < exposed.forward_ms  # still mostly hidden
    assert times[8].input_grad_ms < exposed.input_grad_ms and times[8].weight_grad_ms == exposed.weight_grad_ms
    # `chunks=N` (Transformer Engine's aggregated ring exchange, pipelined num_splits): fewer, larger matmuls
    # quantize and launch less, but more of the collective waits for its first chunk; one chunk hides nothing
    pieces = {n: split_profile(profile, t, 1, links, overlap=Overlap(tensor=True, chunks=n)).layers[1] for n in (1, 4)}
    assert pieces[4] == split_profile(profile, t, 1, links, overlap=Overlap(tensor=True)).layers[1]  # t = 4 chunks
    assert pieces[1].forward_ms > exposed.forward_ms  # as one chunk it waits for all of it, and takes SMs too


def test_one_is_the_profile_itself_and_rounding_never_undercounts():
    profile = stack_profile(block=dict(activation_bytes=801, param_count=1001))
    assert split_profile(profile, 1, 1, Links(tensor=LINK, context=LINK)) is profile
    block = split_profile(profile, 2, 1, Links(tensor=LINK, context=LINK)).layers[1]
    assert block.activation_bytes == 401 and block.param_count == 501 and block.param_bytes == round(4000 * 501 / 1001)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda p: replace(p, layers=(replace(p.layers[0], flops=5.0), *p.layers[1:])), "not an embedding"),
        (lambda p: replace(p, layers=(*p.layers[:2], replace(p.layers[2], param_count=7), *p.layers[3:])), "differs"),
        (lambda p: replace(p, layers=(*p.layers[:2], replace(p.layers[2], output_bytes=8), *p.layers[3:])), "block"),
        (lambda p: replace(p, cut_bytes=(1, *p.cut_bytes[1:])), "not a transformer block"),
        (lambda p: replace(p, layers=(*p.layers[:-1], replace(p.layers[-1], flops=0.0))), "not an LM head"),
        (lambda p: replace(p, layers=p.layers[:2], cut_bytes=p.cut_bytes[:1]), "2 layer(s)"),
    ],
)
def test_profiles_that_are_not_a_transformer_stack_are_refused(change, words):
    profile = change(stack_profile())
    assert words in stack_problem(profile)
    with pytest.raises(ConfigError, match="--parallel tp=1,cp=1"):
        split_profile(profile, 2, 1, Links(tensor=LINK, context=LINK))


@pytest.mark.parametrize(
    ("t", "options", "devices", "words"),
    [
        (3, {}, 24, "divide the 8 devices per node"),
        (2, {"heads": 25}, 16, "25 attention heads"),
        (4, {"kv_heads": 2}, 16, "2 key/value heads"),
        (2, {"hidden_size": "33"}, 16, "33 hidden size"),
        (8, {}, 4, "divide the 4 devices"),
    ],
)
def test_sizes_the_cluster_or_model_cannot_take_are_refused(t, options, devices, words):
    profile = stack_profile(options=options)
    per_node = 8
    assert words in tensor_parallel_problem(profile, t, devices_per_node=per_node, num_devices=devices)
    with pytest.raises(ConfigError, match=f"--parallel tp={t}"):
        check_split(profile, t, 1, devices_per_node=per_node, num_devices=devices)


def test_sequence_must_split_under_sequence_parallelism():
    profile = stack_profile()
    profile = replace(profile, provenance=replace(profile.provenance, tokens_per_sample=18))
    assert "sequence length 18" in tensor_parallel_problem(profile, 4, devices_per_node=8, num_devices=8)
    assert tensor_parallel_problem(profile, 2, devices_per_node=8, num_devices=8) is None


def test_groups_as_devices():
    cluster = Cluster(num_devices=64, devices_per_node=8, memory_per_device=2**30)
    groups = DeviceGroups(tensor_parallel=4).of(cluster)
    assert (groups.num_devices, groups.devices_per_node, groups.memory_per_device) == (16, 2, 2**30)
    assert groups.intra_link == cluster.intra_link and groups.inter_link == cluster.inter_link
    assert DeviceGroups(tensor_parallel=2, context_parallel=2).of(cluster) == groups
    # group r holds devices 4r..4r+3: the node of its first device
    assert [groups.node_of(r) for r in range(16)] == [cluster.node_of(4 * r) for r in range(16)]
    profile, same = split_inputs(stack_profile(), cluster, 1)
    assert same is cluster


@pytest.mark.parametrize("t", [2, 4])
def test_the_head_keeps_a_vocab_parallel_share_of_the_loss(t):
    """The analytic head keeps cross-entropy's fp32 log-softmax (b·s·V·4, bf16-mixed: the GPU runs the loss in fp32),
    its int64 target and total weight, all freed by I; Megatron's vocab-parallel cross entropy keeps each rank's
    b·s·(V/t) fp32 softmax, so one rank's head keeps 1/t of the loss's bytes (the per-token target, ~2/V of them,
    divided too), rounded up, next to 1/t of the sequence-parallel norm's and the matmul's."""
    seq, batch, vocab = 16, 2, 64
    spec = load_model("gpt", {"layers": "2", "hidden": "32", "heads": "4", "seq": str(seq), "vocab": str(vocab)})
    profile = profile_analytic(spec, batch_size=2, hardware="h100", precision="bf16-mixed")
    loss = batch * seq * vocab * 4 + batch * seq * 8 + 4
    head = profile.layers[-1]
    assert head.activation_freed_by_input_grad_bytes == loss
    sharded = split_profile(profile, t, 1, Links(tensor=LINK, context=LINK)).layers[-1]
    assert sharded.activation_freed_by_input_grad_bytes == -(-loss // t) >= batch * seq * (vocab // t) * 4
    assert sharded.activation_bytes == -(-head.activation_bytes // t)
    assert sharded.selective_activation_bytes == -(-head.selective_activation_bytes // t)
