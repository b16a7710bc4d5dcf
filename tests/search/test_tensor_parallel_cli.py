"""`pipeplan plan --tensor-parallel` through typer's CliRunner: auto says why it chose t, a forced size is recorded
in plan.json and shown, `run` refuses tensor-parallel plans with one line, and sizes that cannot be planned are
refused with one line before anything slow."""

from __future__ import annotations

import json

import pytest
from planner_helpers import stack_profile
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.plan.plan import Plan

runner = CliRunner()
PLAN = ["plan", "--devices", "4", "--memory-per-device", "1GiB", "-B", "8"]


@pytest.fixture(scope="module")
def stack_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "stack.json"
    stack_profile(options={"heads": 4, "hidden": 64}).save(path)
    return path


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    return lines[0]


def test_auto_tries_every_size_and_the_rationale_says_why(stack_file, tmp_path):
    result = runner.invoke(app, [*PLAN, "--profile", str(stack_file), "-o", str(tmp_path / "p"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    t = summary["training"]["tensor_parallel"]
    assert summary["rationale"].startswith(f"Tensor parallelism t={t}: ")
    assert all(f"t={size}" in summary["rationale"] for size in (1, 2, 4) if size != t)


def test_a_forced_size_is_planned_shown_and_refused_by_run(stack_file, tmp_path):
    out = tmp_path / "p"
    result = runner.invoke(app, [*PLAN, "--profile", str(stack_file), "-o", str(out), "--tensor-parallel", "2"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps at the runner's 80 columns
    assert "tensor parallel t=2" in text and "Not runnable: tensor parallelism is planned analytically" in text
    plan = Plan.load(out / "plan.json")
    assert plan.training.tensor_parallel == 2 and plan.world_size * 2 == plan.cluster.num_devices == 4
    shown = runner.invoke(app, ["show", str(out / "plan.json"), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["runnable"] is False
    ran = runner.invoke(app, ["run", str(out / "plan.json"), "--steps", "1"])
    assert ran.exit_code == 1
    assert "tensor parallelism (t=2)" in _one_error_line(ran.output)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gpt", "--tensor-parallel", "2"], "--device meta"),
        (["gpt", "--tensor-parallel", "x"], "--tensor-parallel"),
        (["gpt", "--device", "meta", "--hardware", "h100", "--tensor-parallel", "3"], "--tensor-parallel 3"),
    ],
    ids=["measured", "not-a-number", "not-a-divisor"],
)
def test_sizes_that_cannot_be_planned_are_one_line(args, needle, tmp_path):
    result = runner.invoke(app, [*PLAN, *args, "-o", str(tmp_path / "p"), "--json"])
    assert result.exit_code == 1
    assert needle in _one_error_line(result.output)
