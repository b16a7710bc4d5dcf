"""Expert-parallel plans: `plan --parallel ep=` and `--layout ep=` store ep (and each stage's routed-expert
parameters) in plan.json, `show` / timeline.json re-simulate the plan's step and per-rank peaks with the same ep
(ZeRO-1 shards routed experts' state over 1/ep of the holders), `run` refuses such plans in one line, plans written
before ep load as ep=1, and layouts ep cannot split are refused in one line."""

from __future__ import annotations

import json

import pytest
from helpers.cli import one_error_line
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.timing import plan_step_ms, plan_timeline
from pipeplan.cli import app

runner = CliRunner()
PLAN = ["plan", "moe", "--device", "meta", "--hardware", "h100", "--devices", "4", "-B", "8", "--memory", "zero=1"]


def _plan(tmp_path, name: str, *extra: str) -> Plan:
    out = tmp_path / name
    result = runner.invoke(app, [*PLAN, "-s", "1f1b", "-o", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return Plan.load(out / "plan.json")


def _reproduced(plan: Plan, plan_dir) -> None:
    """show's and timeline.json's re-simulation give the plan's step and per-rank peaks."""
    timeline = plan_timeline(plan)
    assert plan_step_ms(plan) == pytest.approx(plan.predicted.step_ms, rel=1e-12)
    pipeline0 = plan.predicted.peak_memory_bytes[: timeline.num_devices]
    assert pipeline0 == tuple(round(b) for b in timeline.peak_memory_bytes)
    trace = json.loads((plan_dir / "timeline.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]  # several steps, the first one the plan's
    ends = [(e["ts"] + e["dur"]) / 1000.0 for e in events if e["args"]["step"] == 0]
    assert max(ends) == pytest.approx(timeline.makespan, rel=1e-9)


def test_an_expert_parallel_plan_is_stored_reproduced_shown_and_refused_by_run(tmp_path):
    plan = _plan(tmp_path, "ep", "--parallel", "pp=2,ep=2,replicate=off")
    assert plan.training.expert_parallel == 2 and plan.training.data_parallel == 2 and plan.training.zero == 1
    assert all(0 < s.expert_param_count < s.param_count for s in plan.stages)  # both stages hold MoE blocks
    _reproduced(plan, tmp_path / "ep")
    shown = runner.invoke(app, ["show", str(tmp_path / "ep" / "plan.json")])
    text = " ".join(shown.output.split())
    assert shown.exit_code == 0 and "Not runnable: uses expert parallelism (ep=2)" in text
    assert "expert parallel ep=2" in text
    ran = runner.invoke(app, ["run", str(tmp_path / "ep" / "plan.json"), "--steps", "1"])
    assert "expert parallelism (ep=2)" in one_error_line(ran) and "--parallel ep=1" in one_error_line(ran)


def test_a_pinned_ep_layout_is_the_plan_and_reproduced(tmp_path):
    plan = _plan(tmp_path, "pinned", "--layout", "pp=2,dp=2,ep=2,zero=1")
    assert plan.training.expert_parallel == 2 and plan.rationale.startswith("Layout pinned by --layout")
    assert "ep=2" in plan.rationale
    _reproduced(plan, tmp_path / "pinned")


def test_plans_written_before_expert_parallelism_load_as_ep_1(tmp_path):
    plan = _plan(tmp_path, "dense", "--parallel", "pp=2,ep=1,replicate=off")
    data = json.loads((tmp_path / "dense" / "plan.json").read_text())
    del data["training"]["expert_parallel"]
    for stage in data["stages"]:
        del stage["expert_param_count"]
    old = Plan.from_dict(data)
    assert old.training.expert_parallel == 1 and plan.training.expert_parallel == 1
    assert plan_step_ms(old) == pytest.approx(plan.predicted.step_ms, rel=1e-12)
    assert plan_timeline(old).peak_memory_bytes == plan_timeline(plan).peak_memory_bytes


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--layout", "pp=2,dp=2,ep=4"], "--layout ep=4 must divide dp x cp = 2"),
        (["--layout", "pp=1,dp=4,ep=4", "-a", "experts=2"], "--layout ep=4: ep=4 must divide the model's 2 routed"),
        (["--parallel", "ep=3,replicate=off"], "--parallel ep=3: ep=3 must divide the model's 4 routed experts"),
    ],
)
def test_expert_parallel_sizes_that_cannot_split_are_one_line(args, needle, tmp_path):
    base = PLAN[:-2] if "--layout" in args else PLAN  # --layout pins zero (--memory zero= would warn: ignored)
    result = runner.invoke(app, [*base, *args, "-o", str(tmp_path / "p"), "--json"])
    assert needle in one_error_line(result)


def test_ep_on_a_dense_model_is_refused_naming_the_option(tmp_path):
    args = ["plan", "llama", "-a", "layers=2", "--device", "meta", "--hardware", "h100", "--devices", "4", "-B", "8"]
    result = runner.invoke(app, [*args, "--layout", "pp=2,dp=2,ep=2", "-o", str(tmp_path / "p"), "--json"])
    assert "--layout ep=2: ep=2 needs an analytic profile of a mixture-of-experts model" in one_error_line(result)
