"""`pipeplan capacity` through typer's CliRunner on gpt2-124m (analytic profile at a short --seq), and the analytic
profile's numbers as the capacity report uses them (FLOPs per token, per-layer activations)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import one_error_line
from helpers.search import capacity_config
from helpers.transformer_reference import activation_bytes_per_layer
from typer.testing import CliRunner

from pipeplan.capacity.inputs import capacity_profile
from pipeplan.capacity.sweep import capacity_sweep, model_flops_per_token
from pipeplan.cli import app
from pipeplan.hardware import load_hardware

runner = CliRunner()
SEQ = 128
GPT2 = dict(layers=12, hidden=768, heads=12, vocab=50257)
SMALL = ["gpt2-124m", "--hardware", "h100", "--devices", "8,16", "--seq", str(SEQ), "--global-batch-size", "16"]


@pytest.fixture(scope="module")
def gpt2_profile():
    hardware = load_hardware("h100")
    return capacity_profile(
        "gpt2-124m", {}, seq=SEQ, hardware=hardware, batch_size=1, quiet=True, precision="bf16-mixed"
    )


def test_seq_replaces_the_presets_and_flops_per_token_match_6n_plus_attention(gpt2_profile):
    assert gpt2_profile.provenance.tokens_per_sample == SEQ
    h, layers, vocab = GPT2["hidden"], GPT2["layers"], GPT2["vocab"]
    matmul_params = layers * 12 * h * h + h * vocab  # blocks' matmuls and the (tied) LM head; embeddings: lookups
    expected = 6 * matmul_params + 12 * layers * SEQ * h
    assert model_flops_per_token(gpt2_profile) == pytest.approx(expected, rel=0.02)


def test_activation_column_from_the_analytic_profile(gpt2_profile):
    """Blocks save about 34·s·b·h bytes each with flash attention (the profiler's own tests pin it down) plus, under
    bf16-mixed, autocast's bf16 copies of their matmul weights and biases (12h² + 9h); the capacity report's
    activations are in-flight microbatches x the profile's per-layer bytes x layers."""
    blocks = [layer for layer in gpt2_profile.layers if layer.name.startswith("blocks")]
    assert len(blocks) == GPT2["layers"]
    h = GPT2["hidden"]
    formula = activation_bytes_per_layer(seq=SEQ, batch=1, hidden=h, heads=12, flash_attention=True)
    formula += 2 * (12 * h * h + 9 * h)
    assert all(layer.activation_bytes == pytest.approx(formula, rel=0.1) for layer in blocks)
    cfg = capacity_config(hardware=load_hardware("h100"), device_counts=(8,), global_batch_size=16)
    row = capacity_sweep(gpt2_profile, cfg).rows[0]
    assert row.fits and row.memory.activations > 0
    assert row.memory.weights + row.memory.gradients + row.memory.optimizer == 16 * row.memory.param_count


def test_cli_table_with_target_tokens():
    result = runner.invoke(app, ["capacity", *SMALL, "--target-tokens", "1B", "--days", "1"])
    assert result.exit_code == 0, result.output
    for text in ("tok/s", "MFU", "bubble", "binds", "answer:", "1e+09 tokens in 1 days"):
        assert text in result.output
    assert "│   8 │" in result.output and "│  16 │" in result.output


def test_cli_json_and_plot(tmp_path):
    png = tmp_path / "capacity.png"
    result = runner.invoke(app, ["capacity", *SMALL, "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [row["num_devices"] for row in data["rows"]] == [8, 16]
    for row in data["rows"]:
        assert row["fits"] and row["binding"] in ("memory", "bubble", "communication", "compute")
        memory = row["memory"]  # capacity's default precision, bf16-main: bf16 weights, fp32 gradients, 12 B state
        assert (memory["weights"], memory["gradients"]) == (2 * memory["param_count"], 4 * memory["param_count"])
        assert memory["weights"] + memory["gradients"] + memory["optimizer"] == 18 * memory["param_count"]
    assert data["answer"] is None
    assert set(data["per_schedule"]) >= {"1f1b", "zbv"}
    for row in data["rows"]:  # the busiest device's compute per step, by part (profiling.retime)
        parts = row["compute_breakdown"]
        keys = ("gemm_ms", "attention_ms", "memory_ms", "launch_ms", "other_ms", "collectives_ms")
        assert sum(parts[key] for key in keys) == pytest.approx(parts["total_ms"])
        assert parts["gemm_ms"] > parts["attention_ms"] > 0 and parts["memory_ms"] > 0 and parts["launch_ms"] > 0
        assert parts["total_ms"] == pytest.approx(row["time"]["compute_ms"], rel=0.15)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hardware", "nope", "--devices", "8"], "--hardware"),
        (["--hardware", "h100", "--devices", "8,x"], "--devices"),
        (["--hardware", "h100", "--devices", "8", "--target-tokens", "1T"], "--days"),
        (["--hardware", "h100", "--devices", "8", "--plot", "out.svg"], "--plot"),
        (["--hardware", "h100", "--devices", "8", "--seq", "0"], "--seq"),
    ],
    ids=["bad-hardware", "bad-devices", "target-without-days", "plot-not-png", "bad-seq"],
)
def test_cli_errors_are_one_line(args, needle):
    assert needle in one_error_line(runner.invoke(app, ["capacity", "gpt2-124m", *args]))


def test_models_without_tokens_per_sample_need_a_global_batch():
    result = runner.invoke(app, ["capacity", "mlp", "--hardware", "h100", "--devices", "8"])
    assert result.exit_code == 1
    assert result.output.strip().startswith("error:") and "--global-batch-size" in result.output
