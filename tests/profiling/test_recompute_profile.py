"""Per-layer recompute data in profiles: bytes kept under none / selective / full and recompute times, from the
measured (CPU) and analytic (meta) profilers, on the built-in gpt and a tiny Hugging Face llama; checked against the
model's shapes, Korthikanti et al.'s formulas, an independent shape rule, and through JSON (old files included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.transformer_reference import activation_bytes_per_layer, attention_core_flops
from torch import nn

from pipeplan.errors import ConfigError, FormatError
from pipeplan.models import load_model
from pipeplan.profiling import analytic, recompute
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.gpu_ops import GpuSemantics
from pipeplan.profiling.layer_count import count_layer
from pipeplan.profiling.measure import profile_model
from pipeplan.profiling.opcount import Roofline
from pipeplan.profiling.pipedream import read_pipedream_graph
from pipeplan.profiling.profile import PROFILE_SCHEMA_VERSION, Profile
from pipeplan.search.scaling import scale_profile

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 32, 4  # the s×s tensors are the only saved ones whose last two dims are (16, 16)
LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64)
LLAMA_SEQ = 12
NEW_FIELDS = ("selective_activation_bytes", "full_activation_bytes", "full_recompute_ms", "selective_recompute_ms")


def _gpt(dropout: float, seq: int = SEQ, hidden: int = HIDDEN):
    options = dict(layers=2, hidden=hidden, heads=HEADS, seq=seq, vocab=64, dropout=dropout)
    return load_model("gpt", {k: str(v) for k, v in options.items()})


def _llama(implementation: str = "sdpa"):
    options = {**LLAMA, "num_hidden_layers": 2, "vocab_size": 64, "seq_len": LLAMA_SEQ, "attention_dropout": 0.1}
    options["_attn_implementation"] = implementation  # eager: transformers' softmax(QKᵀ)V by hand
    return load_model("hf:llama", {k: str(v) for k, v in options.items()})


def _square_saved_bytes(log: recompute.ForwardLog, inputs, seq: int) -> int:
    """Independent rule: distinct saved storages whose last two dims are (seq, seq), the layer's inputs excepted."""
    inputs = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
    found = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in log.saved
        if t.dim() >= 2 and tuple(t.shape[-2:]) == (seq, seq) and t.untyped_storage()._cdata not in inputs
    }
    return sum(found.values())


def _profile_with_logs(monkeypatch, make_profile, seq: int):
    """The profile, and per layer the shape rule's count on the forward the recompute pass recorded."""
    counts: list[int] = []
    original = recompute.record_forward

    def spy(module, inputs, context=None):
        log, outputs = original(module, inputs, context)
        counts.append(_square_saved_bytes(log, inputs, seq))
        return log, outputs

    monkeypatch.setattr(recompute, "record_forward", spy)
    monkeypatch.setattr(analytic, "layer_key", lambda *args: None)  # every layer counted (no repeats reused)
    profile = make_profile()
    assert len(counts) == profile.num_layers
    return profile, counts


def _measured(spec, **kwargs):
    kwargs = {"precision": "fp32", **kwargs}
    return profile_model(spec, batch_size=BATCH, warmup=0, repeats=1, progress=False, **kwargs)


def _analytic(spec, **kwargs):
    return profile_analytic(spec, **{"batch_size": BATCH, "hardware": "h100", "precision": "bf16", **kwargs})


def _check_modes(profile) -> None:
    for layer in profile.layers:
        assert layer.selective_activation_bytes <= layer.activation_bytes
        if layer.name.startswith(("blocks.", "model.layers.")):
            assert layer.full_activation_bytes <= layer.selective_activation_bytes, layer
        assert layer.kept_bytes("none") == layer.activation_bytes
        assert layer.kept_bytes("selective") == layer.selective_activation_bytes
        assert layer.kept_bytes("full") == layer.full_activation_bytes
        assert layer.recompute_ms("none") == 0.0 and layer.recompute_ms("full") == layer.full_recompute_ms


def test_measured_gpt_selective_drops_exactly_the_s_by_s_tensors(monkeypatch):
    """CPU with attention dropout takes SDPA's math path: float32 softmax output, dropout noise and dropped
    probabilities, 3 × 4 bytes × a·s²·b; the rest of the block (q, k, v included) stays."""
    profile, square = _profile_with_logs(monkeypatch, lambda: _measured(_gpt(dropout=0.1)), SEQ)
    _check_modes(profile)
    for layer, expected in zip(profile.layers, square, strict=True):
        dropped = layer.activation_bytes - layer.selective_activation_bytes
        assert dropped == expected
        if layer.name.startswith("blocks."):
            assert dropped == 12 * HEADS * SEQ**2 * BATCH
            assert layer.full_activation_bytes == 4 * BATCH * SEQ * HIDDEN  # the block's float32 input
            assert layer.selective_recompute_ms > 0 and layer.full_recompute_ms > 0
        else:
            assert dropped == 0 and layer.selective_recompute_ms == 0.0
    assert profile.layers[0].full_activation_bytes == 8 * BATCH * SEQ  # the embedding keeps its int64 token ids


def test_fused_attention_saves_no_s_by_s_tensor_so_selective_equals_none():
    """Without dropout, CPU runs flash attention: nothing s×s is saved, selective keeps all and recomputes nothing."""
    profile = _measured(_gpt(dropout=0.0))
    _check_modes(profile)
    for layer in profile.layers:
        assert layer.selective_activation_bytes == layer.activation_bytes and layer.selective_recompute_ms == 0.0


@pytest.fixture(scope="module")
def gpt_math():
    return _analytic(_gpt(dropout=0.1), attention="math")


def test_analytic_gpt_matches_korthikanti(gpt_math):
    """bf16, math attention, dropout: the paper's layer, except that torch's layer_norm also saves float32 mean and
    rstd per token (2 norms × 8 bytes × s·b) and the math path builds and saves an s×s bool causal mask (s² bytes,
    recomputed with the core)."""
    _check_modes(gpt_math)
    stats = 16 * SEQ * BATCH
    shape = dict(seq=SEQ, batch=BATCH, hidden=HIDDEN, heads=HEADS, flash_attention=False)
    blocks = [layer for layer in gpt_math.layers if layer.name.startswith("blocks.")]
    assert len(blocks) == 2
    for block in blocks:
        assert block.activation_bytes == activation_bytes_per_layer(**shape) + stats + SEQ**2
        assert block.selective_activation_bytes == activation_bytes_per_layer(**shape, recompute="selective") + stats
        assert block.full_activation_bytes == activation_bytes_per_layer(**shape, recompute="full")
        assert block.full_recompute_ms == block.forward_ms
        assert 0 < block.selective_recompute_ms < block.forward_ms


def test_analytic_attention_core_is_the_4bs2h_matmuls_plus_the_softmax_chain():
    from pipeplan.models.gpt import Block

    with torch.device("meta"):
        block = Block(HIDDEN, HEADS, 0.1).to(torch.bfloat16)
    x = torch.empty(BATCH, SEQ, HIDDEN, device="meta", dtype=torch.bfloat16)
    roofline = Roofline(flops_per_s=1e12, bytes_per_s=1e12)
    costs = recompute.analytic_recompute(
        block, [x], roofline=roofline, input_needs_grad=[True], context=lambda: GpuSemantics(attention="math")
    )
    assert costs.attention_bytes == 5 * HEADS * SEQ**2 * BATCH + SEQ**2  # + the causal mask
    assert costs.input_bytes == 2 * SEQ * BATCH * HIDDEN and costs.selective_rest_seconds > 0  # the softmax chain
    counts = count_layer(block, [x], roofline=roofline, attention="math")
    core = sum(k.flops for k in counts.kernels if k.core)  # the matmuls selective recomputation re-runs
    assert core == attention_core_flops(seq=SEQ, batch=BATCH, hidden=HIDDEN)


def test_analytic_flash_keeps_everything_under_selective():
    profile = _analytic(_gpt(dropout=0.1), attention="auto")
    _check_modes(profile)
    for layer in profile.layers:
        assert layer.selective_activation_bytes == layer.activation_bytes and layer.selective_recompute_ms == 0.0


@pytest.mark.parametrize("kind", ["measured-eager", "analytic-eager", "analytic-math"])
def test_hf_llama_modes_match_its_shapes(kind, monkeypatch):
    """Attention with s x s internals: transformers' eager (by hand) implementation, measured or analytic, or its
    SDPA calls profiled as the math path (--attention math)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    makers = {
        "measured-eager": lambda: _measured(_llama("eager")),
        "analytic-eager": lambda: _analytic(_llama("eager")),
        "analytic-math": lambda: _analytic(_llama(), attention="math"),
    }
    profile, square = _profile_with_logs(monkeypatch, makers[kind], LLAMA_SEQ)
    _check_modes(profile)
    heads, hidden, seq = LLAMA["num_attention_heads"], LLAMA["hidden_size"], LLAMA_SEQ
    layers = [layer for layer in profile.layers if layer.name.startswith("model.layers.")]
    assert len(layers) == 2
    for layer, expected in zip(profile.layers, square, strict=True):
        assert layer.activation_bytes - layer.selective_activation_bytes == expected
    for layer in layers:
        assert layer.activation_bytes - layer.selective_activation_bytes > 0 and layer.selective_recompute_ms > 0
    if kind.startswith("analytic"):
        assert profile.provenance.attention == ("math" if kind == "analytic-math" else "math (by hand)")
    if kind == "measured-eager":  # float32: softmax, noise and dropped probabilities of every head
        assert all(la.activation_bytes - la.selective_activation_bytes == 12 * heads * seq**2 * BATCH for la in layers)
        # inputs: the hidden states only (rotary cos and sin and the mask are made again in each block)
        assert all(layer.full_activation_bytes == 4 * BATCH * seq * hidden for layer in layers)


def test_hf_llama_sdpa_runs_flash_with_nothing_for_selective_to_drop(monkeypatch):
    """transformers' SDPA implementation with no padding leaves the causal mask to the kernel: FlashAttention,
    no s x s tensor saved, selective recomputation keeps what none keeps."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    profile = _analytic(_llama())
    assert profile.provenance.attention == "flash"
    for layer in profile.layers:
        assert layer.selective_activation_bytes == layer.activation_bytes and layer.selective_recompute_ms == 0.0
    with pytest.raises(ConfigError, match="--attention flash: layer 'model.layers.0' computes attention by hand"):
        _analytic(_llama("eager"), attention="flash")


def test_router_softmax_is_not_attention_and_square_heads_are_not_scores():
    """A softmax over a Linear's output (an MoE router) has no internals; with head_dim == seq, the scaled q has the
    scores' shape but stays (the walk stops at the QKᵀ product)."""
    router = nn.Linear(8, 8)
    x = torch.randn(2, 8, 8, requires_grad=True)
    log, _ = recompute.record_forward(lambda t: torch.softmax(router(t), dim=-1) * t, [x])
    assert log.calls and recompute.find_attention_core(log, keep=[x]).saved_bytes == 0

    q, k, v = (torch.randn(2, 3, 8, 8, requires_grad=True) for _ in range(3))  # seq = head_dim = 8
    log, _ = recompute.record_forward(
        lambda a, b, c: F.dropout(torch.softmax((a * 0.5) @ b.transpose(-2, -1), dim=-1), 0.5) @ c, [q, k, v]
    )
    core = recompute.find_attention_core(log, keep=[q, k, v])
    assert core.saved_bytes == 3 * 4 * 2 * 3 * 8 * 8  # softmax output, dropout noise, dropped probabilities
    assert core.saved_bytes == _square_saved_bytes(log, [q, k, v], 8) - 4 * 2 * 3 * 8 * 8  # less the scaled q


def test_json_round_trip_and_schema_1_files_load_with_defaults(gpt_math, tmp_path):
    path = tmp_path / "p.json"
    gpt_math.save(path)
    assert json.loads(path.read_text())["schema_version"] == PROFILE_SCHEMA_VERSION == 5
    assert Profile.load(path) == gpt_math
    four = gpt_math.to_dict()  # schema 4 (and 3): the work without its traffic; its other ops keep their roofline ms
    four["schema_version"] = 4
    for layer in four["layers"]:
        for name in ("forward", "input_grad", "weight_grad", "backward", "selective"):
            del layer["work"][f"{name}_traffic"]
    path.write_text(json.dumps(four))
    assert all(layer.work.forward_traffic is None for layer in Profile.load(path).layers)
    old = gpt_math.to_dict()
    old["schema_version"] = 1
    for layer in old["layers"]:
        for name in NEW_FIELDS:
            del layer[name]
    path.write_text(json.dumps(old))
    loaded = Profile.load(path)
    entering = (gpt_math.input_bytes, *gpt_math.cut_bytes)
    for layer, before in zip(loaded.layers, entering, strict=True):
        assert layer.selective_activation_bytes == layer.activation_bytes and layer.selective_recompute_ms == 0.0
        assert layer.full_activation_bytes == before and layer.full_recompute_ms == layer.forward_ms
    path.write_text(json.dumps({**old, "schema_version": 6}))
    with pytest.raises(FormatError, match="schema_version 6") as info:
        Profile.load(path)
    assert "\n" not in str(info.value)


def test_bad_recompute_fields_are_one_format_error(gpt_math, tmp_path):
    data = gpt_math.to_dict()
    data["layers"][1]["selective_activation_bytes"] = data["layers"][1]["activation_bytes"] + 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError, match="selective_activation_bytes must lie in"):
        Profile.load(path)


def test_pipedream_imports_get_cut_bytes_for_full_and_none_for_selective():
    path = Path(__file__).parents[1] / "data" / "pipedream-profiles" / "vgg16.txt"
    profile = read_pipedream_graph(path)
    assert profile.layers[1].full_activation_bytes == profile.cut_bytes[0] > 0
    for layer, before in zip(profile.layers, (profile.input_bytes, *profile.cut_bytes), strict=True):
        assert layer.full_activation_bytes == before and layer.full_recompute_ms == layer.forward_ms
        assert layer.selective_activation_bytes == layer.activation_bytes


def test_scaling_a_profile_scales_every_mode(gpt_math):
    doubled = scale_profile(gpt_math, 2 * BATCH)
    for small, big in zip(gpt_math.layers, doubled.layers, strict=True):
        assert big.selective_activation_bytes == 2 * small.selective_activation_bytes
        assert big.full_activation_bytes == 2 * small.full_activation_bytes
        # retimed from the layer's work: twice the rows, but a matmul reads its weights once (at most 2x)
        assert big.full_recompute_ms == big.forward_ms and small.full_recompute_ms < big.full_recompute_ms
        assert big.full_recompute_ms <= 2 * small.full_recompute_ms * (1 + 1e-9)
        assert big.selective_recompute_ms <= 2 * small.selective_recompute_ms * (1 + 1e-9)
        assert (big.selective_recompute_ms > 0) == (small.selective_recompute_ms > 0)
