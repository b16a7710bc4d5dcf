"""Tensor parallelism for any traced transformer (issue 35): each layer's role is found by structure — embedding
lookups and helpers before the blocks, a final norm after them, the head — and each linear's by following split
activations, whatever the model names them: Hugging Face types (GPT-2's three leading layers, Llama's separate
final norm) and a user's own factory split like the built-ins; MLA's down-projections and a router, whose outputs
are reduced over before any split could be kept, are duplicated as Megatron runs them. Repeated blocks are counted
once (profiling/repeats.py) without changing any profile."""

from __future__ import annotations

import pytest

from pipeplan.cluster import Link
from pipeplan.errors import ConfigError
from pipeplan.models import load_model
from pipeplan.profiling import analytic
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.search.sharding import Links, split_profile
from pipeplan.search.stack import stack_problem, transformer_layers

LINKS = Links(tensor=Link(bandwidth=400e9, latency_s=5e-6), context=Link(bandwidth=400e9, latency_s=5e-6))
DECODER = "examples/decoder_model.py:build"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _profile(ref: str, **options):
    spec = load_model(ref, {key: str(value) for key, value in options.items()})
    return profile_analytic(spec, batch_size=1, hardware="h100", precision="bf16-main")


@pytest.mark.usefixtures("offline")
def test_hugging_face_stacks_have_their_roles_by_structure():
    pytest.importorskip("transformers")
    gpt2 = _profile("hf:gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=128, seq_len=16)
    roles = transformer_layers(gpt2)
    names = [layer.name for layer in gpt2.layers]
    assert names[: roles.first_block] == ["transformer.wte", "transformer.wpe", "transformer.drop"]
    assert names[roles.end_block :] == ["transformer.ln_f", "lm_head"] and roles.embedding == 0
    llama = _profile(
        "hf:llama",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        seq_len=16,
    )
    roles = transformer_layers(llama)
    assert [llama.layers[i].name for i in roles.blocks] == ["model.layers.0", "model.layers.1"]
    split = split_profile(llama, 2, 1, LINKS)  # t = 2: each block's linears column / row, its collectives
    for whole, half in zip(llama.layers, split.layers, strict=True):
        assert half.param_count == -(-whole.param_count // 2)
        assert half.activation_bytes == -(-whole.activation_bytes // 2)
    assert split.layers[roles.head].forward_ms > llama.layers[roles.head].forward_ms / 2  # its all-gather


def test_a_user_factory_splits_like_the_builtin_of_the_same_shape():
    shape = dict(layers=2, hidden=256, heads=8, kv_heads=4, vocab=512, seq=64)
    factory = _profile(DECODER, **shape, ffn=704)
    builtin = _profile("llama", **shape, intermediate=704, rope_theta=500000.0)
    assert stack_problem(factory) is None
    roles = [[(k.kind, k.tp) for k in layer.work.kernels] for layer in (factory.layers[1], builtin.layers[1])]
    assert (
        roles[0]
        == roles[1]
        == [("gemm", "n")] * 3 + [("attention", "b"), ("gemm", "k")] + [("gemm", "n")] * 2 + [("gemm", "k")]
    )
    for t in (2, 4):
        ours, theirs = split_profile(factory, t, 1, LINKS), split_profile(builtin, t, 1, LINKS)
        block, other = ours.layers[1], theirs.layers[1]
        assert block.param_count == other.param_count
        assert block.forward_ms == pytest.approx(other.forward_ms, rel=0.02)


@pytest.mark.usefixtures("offline")
def test_mla_down_projections_and_the_router_are_duplicated():
    pytest.importorskip("transformers")
    options = dict(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        vocab_size=128,
        seq_len=16,
    )
    profile = _profile("hf:deepseek_v3", **options)
    dense, moe = profile.layers[1], profile.layers[2]
    weights = [(k.n, k.tp) for k in dense.work.kernels if k.weight]
    # q down (duplicated: rows split by sequence parallelism), q up (column), kv down (duplicated), kv up, o (row)
    assert weights[:5] == [(32, "m"), (4 * 16, "n"), (16 + 8, "m"), (4 * 16, "n"), (64, "k")]
    assert [k.tp for k in dense.work.kernels if k.kind == "attention"] == ["b"]  # heads, after the up-projections
    assert dense.replicated_param_count == 64 * 32 + 64 * 24  # the down-projections' weights
    router = [k for k in moe.work.kernels if k.weight and k.n == 8 and not k.experts]
    assert [k.tp for k in router] == ["m"] and moe.replicated_param_count >= 64 * 8
    half = split_profile(profile, 2, 1, LINKS).layers[1]
    whole = dense.replicated_param_count
    assert half.param_count == -(-(dense.param_count - whole) // 2) + whole


def test_a_stack_that_is_not_one_is_refused_naming_the_layer():
    profile = _profile("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, seq=16)
    odd = profile.layers[2]
    broken = type(profile)(
        layers=(
            *profile.layers[:2],
            type(odd)(**{**odd.__dict__, "param_count": odd.param_count + 1}),
            *profile.layers[3:],
        ),
        cut_bytes=profile.cut_bytes,
        provenance=profile.provenance,
    )
    with pytest.raises(ConfigError, match="layer 'blocks.1' differs from 'blocks.0'"):
        transformer_layers(broken)


def test_repeated_layers_counted_once_give_the_same_profile(monkeypatch):
    options = dict(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, seq=16)
    reused = _profile("llama", **options)
    monkeypatch.setattr(analytic, "layer_key", lambda *args: None)
    assert _profile("llama", **options) == reused
