"""Precision modes (pipeplan.precision): the byte table, measured profiles under each mode on the CPU (saved bytes,
cut bytes, provenance), and `profile` / `plan` / `run` honouring --precision with one-line refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers.cli import one_error_line
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.cluster import Cluster
from pipeplan.costs import Numerics, bytes_per_param, numerics, static_split
from pipeplan.errors import ConfigError
from pipeplan.models import load_model
from pipeplan.precision import PRECISIONS
from pipeplan.profiling.measure import profile_model

SMALL_GPT = dict(layers=2, hidden=64, heads=2, seq=32, vocab=128)
runner = CliRunner()


def test_bytes_per_parameter_follow_the_precision():
    assert static_split(numerics("adamw", "fp32")) == (4.0, 4.0, 8.0)
    assert static_split(numerics("adamw", "bf16-mixed")) == (4.0, 4.0, 8.0)  # fp32 parameters are the master copy
    assert static_split(numerics("adamw", "bf16")) == (2.0, 2.0, 4.0)  # AdamW's moments take the parameters' dtype
    assert static_split(numerics("sgd", "fp16-mixed")) == (4.0, 4.0, 4.0)
    assert bytes_per_param(numerics("sgd-nomomentum", "bf16")) == 4.0
    assert bytes_per_param(numerics(6.5, "bf16")) == 6.5
    assert numerics("adamw-fp32", "fp32") == numerics("adamw", "fp32")  # an alias, resolved once
    assert numerics("adamw-bf16", "bf16-mixed") == Numerics(PRECISIONS["bf16-mixed"], "adamw")
    assert numerics(6.5, "bf16").optimizer_label == "6.5" and not numerics(6.5, "bf16").named
    with pytest.raises(ConfigError, match="--optimizer adamw-fp32 means adamw under --precision fp32"):
        numerics("adamw-fp32", "bf16")
    with pytest.raises(ConfigError, match="--precision 'fp4' is not supported"):
        numerics("adamw", "fp4")


@pytest.fixture(scope="module")
def measured():
    spec = load_model("gpt", SMALL_GPT)
    return {
        name: profile_model(spec, batch_size=4, warmup=0, repeats=1, progress=False, precision=name)
        for name in ("fp32", "bf16-mixed", "bf16")
    }


def _saved(profile) -> int:
    return sum(layer.activation_bytes for layer in profile.layers[1:-1])  # the transformer blocks


def test_measured_saved_bytes_follow_the_compute_dtype(measured):
    fp32, mixed, bf16 = _saved(measured["fp32"]), _saved(measured["bf16-mixed"]), _saved(measured["bf16"])
    assert 0.45 < bf16 / fp32 < 0.55  # every saved tensor in bf16
    # autocast: matmul inputs (and the bf16 weight copies) saved in bf16, the fp32 residual stream's norms not
    assert bf16 < mixed < 0.8 * fp32
    params = sum(layer.param_count for layer in measured["fp32"].layers[1:-1])
    assert mixed - bf16 >= params  # the bf16 weight copies autocast keeps for backward are counted


def test_measured_cut_bytes_and_provenance(measured):
    hidden_state = 4 * SMALL_GPT["seq"] * SMALL_GPT["hidden"]
    assert measured["fp32"].cut_bytes == (4 * hidden_state,) * 3
    assert measured["bf16-mixed"].cut_bytes == (4 * hidden_state,) * 3  # fp32 residual + bf16 block output -> fp32
    assert measured["bf16"].cut_bytes == (2 * hidden_state,) * 3
    for name, dtype in (("fp32", "float32"), ("bf16-mixed", "bfloat16"), ("bf16", "bfloat16")):
        assert (measured[name].provenance.precision, measured[name].provenance.dtype) == (name, dtype)
    assert measured["bf16"].layers[1].param_bytes == 2 * measured["bf16"].layers[1].param_count


def test_plan_memory_changes_as_the_byte_table_says(measured):
    from pipeplan.search.config import SearchConfig
    from pipeplan.search.search import search_plans

    profile = measured["fp32"]
    cluster = Cluster(num_devices=2, devices_per_node=2, memory_per_device=1 << 34)
    peaks = {}
    for precision in ("fp32", "bf16"):
        config = SearchConfig(
            global_batch_size=16, microbatch_sizes=(4,), numerics=numerics("adamw", precision), pipeline_depths=(2,)
        )
        config = dataclasses.replace(config, replication=False)
        best = search_plans(profile, cluster, config, ["1f1b"]).fastest
        cuts = [(s.first_layer, s.last_layer) for s in best.partition.stages]
        peaks[precision] = (best.device_memory_bytes, best.memory.static_bytes, cuts)
    assert peaks["fp32"][2] == peaks["bf16"][2] and len(peaks["fp32"][2]) == 2  # same cuts: only static bytes differ
    for (
        fp32,
        bf16,
    ) in zip(peaks["fp32"][1], peaks["bf16"][1], strict=True):
        assert fp32 == pytest.approx(2 * bf16)  # 16 vs 8 B/param (adamw)
    for (fp32, bf16), static in zip(zip(peaks["fp32"][0], peaks["bf16"][0]), peaks["bf16"][1], strict=True):
        assert fp32 - bf16 == pytest.approx(static, abs=2)


def test_profile_plan_and_run_honour_the_precision(tmp_path):
    opts = [arg for key, value in SMALL_GPT.items() for arg in ("-a", f"{key}={value}")]
    path = tmp_path / "p.json"
    result = runner.invoke(app, ["profile", "gpt", *opts, "--precision", "bf16-mixed", "--repeats", "1", "-o", path])
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["provenance"]["precision"] == "bf16-mixed"
    line = one_error_line(runner.invoke(app, ["plan", "gpt", *opts, "--profile", str(path), "--precision", "fp32"]))
    assert "--precision fp32 but the profile was made for bf16-mixed" in line
    out = tmp_path / "plan"
    args = ["plan", "gpt", *opts, "--profile", str(path), "--devices", "2", "-B", "4", "-o", str(out), "--json"]
    assert runner.invoke(app, args).exit_code == 0
    training = json.loads((out / "plan.json").read_text())["training"]
    assert (training["precision"], training["dtype"], training["optimizer_bytes_per_param"]) == (
        "bf16-mixed",
        "bfloat16",
        16.0,
    )
    line = one_error_line(runner.invoke(app, ["run", str(out / "plan.json"), "--precision", "fp32"]))
    assert "--precision fp32 but the plan was made for bf16-mixed" in line
    line = one_error_line(runner.invoke(app, ["profile", "gpt", "--precision", "fp16-mixed"]))
    assert "fp16-mixed needs CUDA" in line
    line = one_error_line(runner.invoke(app, ["plan", "gpt", "--precision", "fp7", "-o", str(tmp_path / "x")]))
    assert "--precision 'fp7': 'fp7' is not a precision mode" in line
    line = one_error_line(runner.invoke(app, ["plan", "gpt", "--precision", "bf16,adamw-fp32"]))
    assert "--optimizer adamw-fp32 means adamw under --precision fp32" in line
