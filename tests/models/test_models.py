"""Built-in models, option conversion/validation, model references and `pipeplan models`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.errors import ModelError
from pipeplan.models import BUILTINS, load_model, parse_assignments
from pipeplan.models.commands import count_parameters

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user_model.py"


def test_parse_assignments():
    assert parse_assignments(["layers=4", " hidden = 8 "]) == {"layers": "4", "hidden": "8"}
    assert parse_assignments(None) == {}
    with pytest.raises(ModelError, match="key=value"):
        parse_assignments(["layers"])


def test_options_are_converted_with_annotations():
    spec = load_model("gpt", {"layers": "3", "dropout": "0.1", "tie_embeddings": "yes"})
    assert spec.options["layers"] == 3 and spec.options["dropout"] == 0.1 and spec.options["tie_embeddings"] is True


@pytest.mark.parametrize(
    "ref,options,needle",
    [
        ("gpt", {"layers": "four"}, "must be int"),
        ("gpt", {"tie_embeddings": "maybe"}, "must be bool"),
        ("gpt", {"hidden": "30", "heads": "4"}, "divisible"),
        ("gpt", {"depth": "3"}, "no option 'depth'"),
        ("mlp", {"activation": "swish"}, "activation"),
        ("resnet", {"blocks": "0"}, "positive"),
        ("gpt2-124m", {"layers": "2"}, "fixes layers"),
        ("transformer", {}, "unknown model"),
        ("nowhere.py:build", {}, "does not exist"),
        ("no_such_pkg_xyz.mod:build", {}, "cannot import"),
        (f"{EXAMPLE}:missing", {}, "no callable 'missing'"),
        (f"{EXAMPLE}:build", {"image": "10", "patch": "4"}, "divisible"),
    ],
)
def test_bad_references_and_options_are_model_errors(ref, options, needle):
    with pytest.raises(ModelError, match=needle) as info:
        load_model(ref, options)
    assert "\n" not in str(info.value)


def test_user_file_and_package_module_references():
    spec = load_model(f"{EXAMPLE}:build", {"depth": "2", "width": "8"})
    assert spec.options["depth"] == 2 and spec.name == "tiny-mixer"
    (inputs,), target = spec.sample_batch(3, generator=torch.Generator().manual_seed(0))
    assert spec.build()(inputs).shape == (3, 10) and target.shape == (3,)
    spec = load_model("pipeplan.models.mlp:mlp", {"layers": "2"})
    assert spec.options["layers"] == 2


@pytest.mark.parametrize("name", ["gpt", "mlp", "resnet"])
def test_builtins_run_forward_and_loss(name):
    spec = load_model(name, {})
    inputs, target = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    loss = spec.loss_fn(spec.build()(*inputs), target)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_parameter_counts_on_meta_match_a_real_build():
    for name in ("gpt", "mlp", "resnet"):
        real = sum(p.numel() for p in load_model(name, {}).build().parameters())
        assert count_parameters(name) == real
    assert 120e6 < count_parameters("gpt2-124m") < 130e6  # tied embeddings counted once


def test_models_command_lists_every_builtin():
    load_model("mlp", {})
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["name"] for row in rows] == list(BUILTINS)
    assert all(row["params"] > 0 and row["description"] for row in rows)
    table = CliRunner().invoke(app, ["models"])
    assert table.exit_code == 0 and "resnet" in table.output
    assert "pip install 'pipeplan[hf]'" in " ".join(table.output.split())  # the extra's name, not read as markup
    assert "Example: pipeplan models" in CliRunner().invoke(app, ["models", "--help"]).output
