"""Issue 38, Deliver 4: failures whose cause is known give one line naming it (not "a pipeplan bug"), and errors
in the user's own code name the user's file and line; a factory that calls sys.exit(0) does not end the command
with exit 0."""

from __future__ import annotations

import json
import re

import pytest
from helpers.search import synthetic_profile
from typer.testing import CliRunner

from pipeplan.cli import app

MODEL = """\
import sys
import torch
from torch import nn
from pipeplan.models.spec import ModelSpec


class M(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.a, self.mode = nn.Linear(4, 4), mode

    def forward(self, x):
        if self.mode == "exit":
            sys.exit(0)
        return self.a(x)


def batch(b, generator=None):
    return (torch.randn(b, 4),), torch.randn(b, 4)


def raises():
    raise ValueError("no data today")


def exits():
    sys.exit(0)


def exits_in_forward():
    return ModelSpec(name="m", build=lambda: M("exit"), sample_batch=batch, loss_fn=nn.functional.mse_loss)


def exits_in_build():
    return ModelSpec(name="m", build=lambda: sys.exit(0), sample_batch=batch, loss_fn=nn.functional.mse_loss)


def loss_exploded(b, generator=None):
    raise RuntimeError("loss exploded")


def batch_raises():
    return ModelSpec(name="m", build=lambda: M(""), sample_batch=loss_exploded, loss_fn=nn.functional.mse_loss)
"""


def _at(text: str) -> str:
    """`my_model.py:N` of the line of MODEL holding `text`."""
    number = next(i for i, line in enumerate(MODEL.splitlines(), start=1) if text in line)
    return rf"my_model.py:{number}\b"


def _line(argv: list[str]) -> str:
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1, (argv, result.output)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "a pipeplan bug" not in result.output and "Traceback" not in result.output, (
        result.output
    )
    return errors[0]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_model.py"
    path.write_text(MODEL)
    return str(path)


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("raises", r"your factory '.*my_model.py:raises' raised ValueError: no data today at .*" + _at("no data")),
        ("exits", r"its factory called sys.exit\(0\) instead of returning"),
        ("exits_in_build", r"its ModelSpec.build called sys.exit\(0\)"),
        ("batch_raises", r"its sample_batch raised RuntimeError: loss exploded at .*" + _at('("loss exploded")')),
        ("exits_in_forward", r"your code called sys.exit\(0\) at .*" + _at("            sys.exit(0)")),
    ],
)
def test_user_code_errors_name_the_users_file_and_line(model_file, factory, expected):
    line = _line(["profile", f"{model_file}:{factory}", "--batch-size", "2"])
    assert re.search(expected, line), line


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    synthetic_profile(num_layers=4).save(path)
    return path


@pytest.mark.parametrize("cp", ["3", "1000"])
def test_context_parallel_that_cannot_divide_the_devices(profile, cp):
    assert "must divide the 2 devices" in _line(["plan", "--profile", str(profile), "--parallel", f"cp={cp}"])


def test_a_profile_whose_layers_take_no_time(profile, tmp_path):
    data = json.loads(profile.read_text())
    for layer in data["layers"]:
        for key in [k for k in layer if k.endswith("_ms")]:
            layer[key] = 0.0
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps(data))
    assert "take no time" in _line(["plan", "--profile", str(zero), "--devices", "2"])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("device", "tpu9", "provenance.device"),
        ("dtype", "int7", "provenance.dtype"),
        ("tokens_per_sample", -3, "tokens"),
    ],
)
def test_nonsense_profile_provenance_is_refused(profile, tmp_path, field, value, message):
    data = json.loads(profile.read_text())
    data["provenance"][field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert message in _line(["plan", "--profile", str(bad), "--devices", "2"])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "nosuch"}, "model_type 'nosuch' is not a type"),
        ({"n_layer": 2}, 'needs a "model_type" string'),
        ({"model_type": ["gpt2"]}, "holds ['gpt2']"),
    ],
)
def test_hf_config_directories_with_a_bad_model_type(tmp_path, config, message):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert message in _line(["profile", f"hf:{tmp_path}"])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("n_positions=0", "n_positions=0 must be >= 1"),
        ("vocab_size=0", "vocab_size=0 must be >= 1"),
        ("n_layer=-1", "n_layer=-1 must be >= 1"),
        ("seq_len=abc", "seq_len='abc' must be an integer"),
    ],
)
def test_hf_fields_that_cannot_build_a_model(option, message):
    pytest.importorskip("transformers")
    assert message in _line(["profile", "hf:gpt2", "-a", option])


FORWARD = """\
import torch
from torch import nn
from pipeplan.models.spec import ModelSpec


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent: neither fx nor export traces it
            raise ValueError("no data today")
        return self.a(x)


def build():
    batch = lambda b, generator=None: ((torch.randn(b, 4),), torch.randn(b, 4))  # noqa: E731
    return ModelSpec(name="m", build=M, sample_batch=batch, loss_fn=nn.functional.mse_loss)
"""


@pytest.mark.parametrize("device", [["--device", "cpu"], ["--device", "meta", "--hardware", "h100"]])
def test_a_forward_that_fails_is_reported_as_the_models_own_error(tmp_path, device):
    """Deliver 5: no tracer captures it, so the model runs once eagerly on its sample batch and that error is
    the line (on meta too, where the sum is data-dependent but the raise is not reached: the tracers' line)."""
    path = tmp_path / "fails.py"
    path.write_text(FORWARD)
    line = _line(["profile", f"{path}:build", *device])
    if device[1] == "cpu":
        assert "your model's forward fails on its own sample batch (at " in line and "fails.py:13)" in line, line
        assert "ValueError: no data today" in line
    else:
        assert "trace" in line, line


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3", "gemma", "stablelm"])
def test_grouped_query_heads_that_do_not_divide_are_named(model_type):
    pytest.importorskip("transformers")
    line = _line(["profile", f"hf:{model_type}", "-a", "num_attention_heads=4"])
    assert "(the config's default) does not divide num_attention_heads=4" in line, line
    assert "-a num_key_value_heads=4" in line


def test_a_field_left_unset_is_named():
    pytest.importorskip("transformers")
    line = _line(["profile", "hf:nemotron", "-a", "num_hidden_layers=2", "-a", "hidden_size=32"])
    assert "unset: give -a " in line, line


def test_a_rotary_models_default_position_cap_follows_the_sequence():
    """`capacity hf:llama --seq 4096` (seq_len=4096 over llama's default max_position_embeddings=2048): rotary
    positions have no table, so the cap is raised and recorded; a cap the user gave, or GPT-2's position table,
    still refuses."""
    pytest.importorskip("transformers")
    from pipeplan.errors import ModelError
    from pipeplan.models import load_model

    spec = load_model("hf:llama", {"num_hidden_layers": "1", "hidden_size": "32", "seq_len": "4096"})
    assert spec.tokens_per_sample == 4096 and spec.options["max_position_embeddings"] == 4096
    with pytest.raises(ModelError, match=r"seq_len=4096 must lie in \[2, 1024\]"):
        load_model("hf:llama", {"max_position_embeddings": "1024", "seq_len": "4096"})
    with pytest.raises(ModelError, match=r"seq_len=4096 must lie in \[2, 1024\]"):
        load_model("hf:gpt2", {"seq_len": "4096"})


@pytest.mark.parametrize("count", ["2", "2x8"])
def test_a_device_count_given_to_device_suggests_devices(count):
    """`plan --device 2` meant `--devices 2`: the one line says so (profile has no --devices: no suggestion)."""
    assert f"did you mean --devices {count}" in _line(["plan", "gpt", "--device", count])
    assert "did you mean" not in _line(["profile", "gpt", "--device", count])


def test_a_model_reference_is_printed_as_typed_not_as_an_emoji():
    """rich turns `:llama:` into an emoji; `hf:llama: ...` in an error line must read as typed."""
    argv = ["plan", "hf:llama", "-a", "num_attention_heads=4", "-a", "num_key_value_heads=3", "--devices", "2"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1 and "hf:llama: num_key_value_heads=3" in result.output, result.output
