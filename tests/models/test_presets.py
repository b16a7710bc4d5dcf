"""Model presets: published parameter counts (counted on the meta device) and a real tiny forward for llama."""

from __future__ import annotations

import pytest
import torch

from pipeplan.errors import ModelError
from pipeplan.models import BUILTINS, load_model
from pipeplan.models.llama import Llama, RMSNorm
from pipeplan.models.presets import PRESETS

# Published sizes: GPT-2 as counted by the Hugging Face checkpoints (the 2019 paper's 117M/345M/762M/1542M
# under-count the position/embedding tables); Llama 2 paper (Touvron et al. 2023): 6.74B, 13.0B, 69B (70B model).
PUBLISHED = {
    "gpt2-124m": 124.44e6,
    "gpt2-355m": 354.82e6,
    "gpt2-774m": 774.03e6,
    "gpt2-1.5b": 1557.6e6,
    "llama-7b": 6.74e9,
    "llama-13b": 13.0e9,
    "llama-70b": 69.0e9,
}


def _meta_param_count(name: str) -> int:
    spec = load_model(name)
    with torch.device("meta"):
        module = spec.build()
    assert all(p.device.type == "meta" for p in module.parameters())
    return sum(p.numel() for p in module.parameters())  # tied weights count once


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    count = _meta_param_count(name)
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, f"{name}: {count:,}"


def test_presets_are_registered_with_fixed_shapes():
    assert BUILTINS["gpt2-124m"].preset["tie_embeddings"] is True
    assert BUILTINS["llama-70b"].preset["kv_heads"] == 8
    assert load_model("llama-13b").options["hidden"] == 5120
    with pytest.raises(ModelError, match="fixes hidden"):
        load_model("llama-7b", {"hidden": "128"})
    spec = load_model("gpt2-124m", {"dropout": "0.1"})  # an option the preset leaves open
    assert spec.options["dropout"] == 0.1 and spec.options["layers"] == 12


def test_gpt2_ties_and_llama_unties_embeddings():
    with torch.device("meta"):
        gpt2 = load_model("gpt2-124m").build()
        llama = load_model("llama", {"vocab": "64", "hidden": "32", "heads": "4", "kv_heads": "2"}).build()
    assert gpt2.head.proj.weight is gpt2.embed.tok.weight
    assert llama.head.proj.weight is not llama.embed.tok.weight


def _tiny_llama(**overrides):
    options = dict(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, seq=16, vocab=50) | overrides
    return load_model("llama", {k: str(v) for k, v in options.items()})


def test_llama_tiny_forward_backward_on_cpu():
    spec = _tiny_llama()
    torch.manual_seed(0)
    module = spec.build()
    (tokens,), target = spec.sample_batch(3, generator=torch.Generator().manual_seed(1))
    logits = module(tokens)
    assert logits.shape == (3, 16, 50)
    loss = spec.loss_fn(logits, target)
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())


def test_llama_is_causal():
    spec = _tiny_llama()
    torch.manual_seed(0)
    module = spec.build().eval()
    tokens = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 50
    base, after = module(tokens), module(changed)
    torch.testing.assert_close(base[:, :10], after[:, :10])  # earlier positions cannot see a later token
    assert not torch.allclose(base[:, 10:], after[:, 10:])


def test_llama_rotary_is_a_relative_position_rotation():
    attn = _tiny_llama().build().blocks[0].attn
    seq, head_dim = 12, attn.head_dim
    q = torch.randn(1, 1, 1, head_dim).expand(1, 1, seq, head_dim)
    k = torch.randn(1, 1, 1, head_dim).expand(1, 1, seq, head_dim)
    rq, rk = attn._rotary(q, seq)[0, 0], attn._rotary(k, seq)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q[0, 0].norm(dim=-1))  # a rotation keeps norms
    assert not torch.allclose(rq[0], rq[5])  # the same vector at two positions differs
    torch.testing.assert_close(rq[7] @ rk[3], rq[6] @ rk[2])  # scores depend on the offset only
    assert not torch.allclose(rq[7] @ rk[3], rq[7] @ rk[5])


def test_llama_grouped_query_attention_shapes_and_fx_trace():
    spec = _tiny_llama(kv_heads=1)
    module = spec.build()
    attn = module.blocks[0].attn
    assert attn.k.weight.shape == (8, 32) and attn.q.weight.shape == (32, 32)  # 1 kv head of size 8
    (tokens,), _ = spec.sample_batch(2)
    traced = torch.fx.symbolic_trace(module)
    torch.testing.assert_close(traced(tokens), module(tokens))
    assert {name.split(".")[0] for name, _ in module.named_children()} == {"embed", "blocks", "head"}


def test_llama_init_module_initializes_a_meta_build():
    spec = _tiny_llama()
    with torch.device("meta"):
        lazy = spec.build()
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    for sub in lazy.modules():
        spec.init_module(sub)
    assert isinstance(lazy, Llama) and isinstance(lazy.blocks[0].attn_norm, RMSNorm)
    assert torch.equal(lazy.blocks[1].mlp_norm.weight, torch.ones(32))
    weight = lazy.blocks[0].mlp.gate.weight
    assert 0.015 < weight.std().item() < 0.025 and abs(weight.mean().item()) < 0.005
    (tokens,), _ = spec.sample_batch(2)
    assert torch.isfinite(lazy(tokens)).all()


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(heads=3), "divisible by heads"),
        (dict(kv_heads=3), "multiple of kv_heads"),
        (dict(layers=0), "must be positive"),
    ],
)
def test_llama_bad_options_are_model_errors(options, match):
    with pytest.raises(ModelError, match=match):
        _tiny_llama(**options)


# The shapes of models people plan now (pipeplan/models/presets.py): each preset, as a built-in and as an hf: shape,
# holds its authors' published parameter count within 1% (the sources are in the preset).
@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_model_presets_match_published_parameter_counts(name, kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    count = _meta_param_count(name if kind == "builtin" else f"hf:{name}")
    published = PRESETS[name].published_params
    assert abs(count - published) / published < 0.01, f"{kind} {name}: {count:,}"


def test_an_hf_preset_is_the_config_json_of_its_source(tmp_path):
    """`hf:<preset>` builds the preset's fields over the type's defaults; `hf:DIR` of a config.json saved from it
    (as downloaded) builds the same model; -a fields replace the preset's, and its seq is the default seq_len."""
    transformers = pytest.importorskip("transformers")
    spec = load_model("hf:mistral-7b", {"num_hidden_layers": "2"})
    assert spec.tokens_per_sample == PRESETS["mistral-7b"].options["seq"]
    assert spec.options["num_hidden_layers"] == 2 and spec.options["num_key_value_heads"] == 8
    config = transformers.AutoConfig.for_model("mistral", **PRESETS["mistral-7b"].fields)
    config.save_pretrained(tmp_path)
    from_dir = load_model(f"hf:{tmp_path}", {"num_hidden_layers": "2", "seq_len": "8192"})
    shape = {k: v for k, v in spec.options.items() if k not in ("seq_len", "data", "task")}
    assert {k: from_dir.options[k] for k in shape} == shape
    with torch.device("meta"):
        assert sum(p.numel() for p in spec.build().parameters()) == sum(
            p.numel() for p in from_dir.build().parameters()
        )


def test_llama_family_options_build_gemma_and_qwen_shapes():
    with torch.device("meta"):
        gemma = _tiny_llama(head_dim=16, activation="gelu_tanh", tie_embeddings=True).build()
        qwen = _tiny_llama(qkv_bias=True).build()
    assert gemma.blocks[0].attn.q.weight.shape == (4 * 16, 32) and gemma.head.proj.weight is gemma.embed.tok.weight
    assert qwen.blocks[0].attn.q.bias is not None and qwen.blocks[0].attn.o.bias is None
    with pytest.raises(ModelError, match="activation"):
        _tiny_llama(activation="relu")
