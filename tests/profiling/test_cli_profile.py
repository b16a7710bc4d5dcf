"""`pipeplan profile` through typer's CliRunner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.profiling.profile import PROFILE_SCHEMA_VERSION, Profile

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user_model.py"
QUICK = ["--warmup", "0", "--repeats", "1", "--threads", "1", "--timer", "cpu"]


def _run(*args):
    return CliRunner().invoke(app, list(args))


def test_profile_gpt_writes_one_entry_per_layer(tmp_path):
    target = tmp_path / "p.json"
    result = _run("profile", "gpt", "-a", "layers=4", "-a", "hidden=64", "--batch-size", "2", "-o", str(target), *QUICK)
    assert result.exit_code == 0, result.output
    assert "blocks.3" in result.output and "I ms" in result.output
    assert "split backward (I+W)" in result.output and "timings not checked: 1 timed round(s)" in result.output
    profile = Profile.load(target)
    assert [layer.name for layer in profile.layers] == ["embed"] + [f"blocks.{i}" for i in range(4)] + ["head"]
    assert profile.provenance.model_options == {"layers": 4, "hidden": 64}


def test_json_prints_only_the_profile(tmp_path):
    target = tmp_path / "p.json"
    result = _run("profile", "mlp", "-a", "layers=3", "-a", "hidden=8", "--json", "-o", str(target), *QUICK)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    saved = json.loads(target.read_text())
    assert data["schema_version"] == PROFILE_SCHEMA_VERSION and len(data["layers"]) == 3
    assert [layer["name"] for layer in data["layers"]] == [layer["name"] for layer in saved["layers"]]
    assert data["cut_bytes"] == saved["cut_bytes"]


def test_user_model_file_and_granularity():
    ref = f"{EXAMPLE}:build"
    result = _run("profile", ref, "-a", "depth=2", "-a", "width=16", "--json", *QUICK)
    assert result.exit_code == 0, result.output
    names = [layer["name"] for layer in json.loads(result.stdout)["layers"]]
    assert names == ["patch", "blocks.0", "blocks.1", "head"]
    result = _run("profile", ref, "-a", "depth=2", "-a", "width=16", "--granularity", "1", "--json", *QUICK)
    assert [layer["name"] for layer in json.loads(result.stdout)["layers"]] == ["patch", "blocks", "head"]


def test_package_module_factory_reference(tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(EXAMPLE.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _run("profile", "mypkg.models:build", "-a", "depth=1", "-a", "width=8", "--json", *QUICK)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["provenance"]["model"] == "mypkg.models:build"
    sys.modules.pop("mypkg.models", None)
    sys.modules.pop("mypkg", None)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["profile", "gpt", "-a", "layers=x"], "layers"),
        (["profile", "gpt", "-a", "nope=1"], "no option 'nope'"),
        (["profile", "gpt", "-a", "layers"], "key=value"),
        (["profile", "nosuchmodel"], "unknown model"),
        (["profile", "gpt", "--device", "meta"], "--hardware"),
        (["profile", "gpt", "--device", "tpu"], "--device"),
        (["profile", "gpt", "--batch-size", "0"], "--batch-size"),
        (["profile", "gpt", "--repeats", "0"], "--repeats"),
        (["profile", "gpt", "--granularity", "0"], "--granularity"),
        (["profile", "gpt", "--timer", "sundial"], "--timer"),
        (["profile", "gpt", "--threads", "0"], "--threads"),
    ],
)
def test_known_errors_are_one_line_exit_1(args, needle):
    result = _run(*args)
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert message.startswith("error:") and needle in message
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_clear_error():
    result = _run("profile", "gpt", "--device", "cuda")
    assert result.exit_code == 1 and "CUDA is not available" in result.stderr


def test_usage_errors_exit_2():
    assert _run("profile").exit_code == 2
    assert _run("profile", "gpt", "--no-such-flag").exit_code == 2
    assert _run("profile", "gpt", "--batch-size", "many").exit_code == 2


def test_hardware_is_ignored_with_a_warning_on_cpu():
    result = _run("profile", "mlp", "-a", "layers=2", "-a", "hidden=8", "--hardware", "h100", *QUICK)
    assert result.exit_code == 0, result.output
    assert "ignored" in result.stderr


def test_meta_device_uses_the_analytic_profiler():
    result = _run("profile", "gpt", "-a", "layers=2", "--device", "meta", "--hardware", "h100", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["provenance"]["source"] == "analytic" and len(data["layers"]) == 4
    assert data["provenance"]["model"] == "gpt" and data["provenance"]["model_options"] == {"layers": 2}


def test_help_ends_with_an_example():
    result = _run("profile", "--help")
    assert result.exit_code == 0 and "Example: pipeplan profile gpt" in result.output
