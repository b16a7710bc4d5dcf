"""`pipeplan plan --memory zero=`: the setting lands in plan.json's training config (what `run` executes), `show`
names it, other ZeRO stages are refused with one line, and plan files check the field like every other."""

from __future__ import annotations

import json

import pytest
from helpers.search import synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.cli import app
from pipeplan.costs import numerics
from pipeplan.errors import ConfigError, FormatError
from pipeplan.search.config import SearchConfig

runner = CliRunner()


@pytest.fixture(scope="module")
def plan_args(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    synthetic_profile().save(path)
    return ["plan", "--profile", str(path), "--devices", "4"]


def test_plan_records_zero_and_show_names_it(plan_args, tmp_path):
    result = runner.invoke(app, [*plan_args, "--memory", "100MiB,zero=1", "-o", str(tmp_path / "z1")])
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "z1" / "plan.json")
    assert plan.training.zero == 1
    shown = runner.invoke(app, ["show", str(tmp_path / "z1" / "plan.json")])
    assert shown.exit_code == 0 and "ZeRO-1 optimizer sharding" in shown.output
    as_json = json.loads(runner.invoke(app, ["show", str(tmp_path / "z1" / "plan.json"), "--json"]).output)
    assert as_json["training"]["zero"] == 1
    default = runner.invoke(app, [*plan_args, "-o", str(tmp_path / "z0")])
    assert default.exit_code == 0 and Plan.load(tmp_path / "z0" / "plan.json").training.zero == 0
    assert "ZeRO" not in default.output


@pytest.mark.parametrize("stage", ["2", "3"])
def test_other_zero_stages_are_one_line_errors(plan_args, tmp_path, stage):
    result = runner.invoke(app, [*plan_args, "--memory", f"100MiB,zero={stage}", "-o", str(tmp_path)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"--memory zero={stage} is not supported" in lines[0] and "ZeRO-1" in lines[0]
    assert not (tmp_path / "plan.json").exists()
    with pytest.raises(ConfigError, match="use --memory zero=0 or 1"):
        SearchConfig(global_batch_size=4, zero=int(stage), numerics=numerics("adamw", "bf16-mixed"))


def test_plan_file_zero_field(plan_args, tmp_path):
    assert runner.invoke(app, [*plan_args, "--memory", "100MiB,zero=1", "-o", str(tmp_path)]).exit_code == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["training"]["zero"]  # plans written before the field: no sharding
    assert Plan.from_dict(data).training.zero == 0
    data["training"]["zero"] = 2
    with pytest.raises(FormatError, match="training.zero must be 0 or 1"):
        Plan.from_dict(data)
    data["training"]["zero"] = "1"
    with pytest.raises(FormatError, match="zero must be an integer"):
        Plan.from_dict(data)
