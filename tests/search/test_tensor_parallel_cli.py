"""`pipeplan plan --parallel tp=` through typer's CliRunner: auto says why it chose t, a forced size is recorded
in plan.json and shown, `run` refuses tensor-parallel plans with one line, and sizes that cannot be planned are
refused with one line before anything slow."""

from __future__ import annotations

import json

import pytest
from helpers.cli import one_error_line
from helpers.search import stack_profile
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.cli import app
from pipeplan.search.config import PREDICTION_MARGIN

runner = CliRunner()
PLAN = ["plan", "--devices", "4", "--memory", "1GiB", "-B", "8"]


@pytest.fixture(scope="module")
def stack_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "stack.json"
    stack_profile(options={"heads": 4, "hidden": 64}).save(path)
    return path


def test_auto_tries_every_size_and_the_rationale_says_why(stack_file, tmp_path):
    """auto's plan is the one forced at its t, that t is the smallest within the prediction margin of the fastest
    forced size, and the rationale gives every other size's own figure."""

    def plan(*extra: str) -> dict:
        out = tmp_path / "-".join(("p", *extra))
        result = runner.invoke(app, [*PLAN, "--profile", str(stack_file), "-o", str(out), "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    summary = plan()
    forced = {size: plan("--parallel", f"tp={size}") for size in (1, 2, 4)}
    assert all(forced[size]["training"]["tensor_parallel"] == size for size in forced)
    t = summary["training"]["tensor_parallel"]
    fastest = min(f["predicted"]["step_ms"] for f in forced.values())
    close = [size for size, f in forced.items() if f["predicted"]["step_ms"] <= fastest * (1 + PREDICTION_MARGIN)]
    assert t == min(close)
    for key in ("predicted", "schedule", "stages", "training"):
        assert summary[key] == forced[t][key], key
    assert summary["rationale"].startswith(f"Tensor parallelism t={t}: ")
    for size in (1, 2, 4):
        if size != t:
            assert f"{forced[size]['predicted']['samples_per_s']:.2f} samples/s at t={size}" in summary["rationale"]


def test_a_forced_size_is_planned_shown_and_refused_by_run(stack_file, tmp_path):
    out = tmp_path / "p"
    result = runner.invoke(app, [*PLAN, "--profile", str(stack_file), "-o", str(out), "--parallel", "tp=2"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps at the runner's 80 columns
    assert "tensor parallel t=2" in text and "Not runnable: uses tensor parallelism (t=2)" in text
    plan = Plan.load(out / "plan.json")
    assert plan.training.tensor_parallel == 2 and plan.world_size * 2 == plan.cluster.num_devices == 4
    shown = runner.invoke(app, ["show", str(out / "plan.json"), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["runnable"] is False
    ran = runner.invoke(app, ["run", str(out / "plan.json"), "--steps", "1"])
    assert "tensor parallelism (t=2)" in one_error_line(ran)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gpt", "--parallel", "tp=2"], "--device meta"),
        (["gpt", "--parallel", "tp=x"], "--parallel tp"),
        (["gpt", "--device", "meta", "--hardware", "h100", "--parallel", "tp=3"], "--parallel tp=3"),
    ],
    ids=["measured", "not-a-number", "not-a-divisor"],
)
def test_sizes_that_cannot_be_planned_are_one_line(args, needle, tmp_path):
    result = runner.invoke(app, [*PLAN, *args, "-o", str(tmp_path / "p"), "--json"])
    assert needle in one_error_line(result)
