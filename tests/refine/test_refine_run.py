"""`pipeplan refine` end to end on a real 2-rank run (gloo, CPU): profile -> plan (zb-h1: I and W split) -> run
--trace -> refine -> run the refined plan. The bookkeeping is asserted (each measured op's median is what the
refined profile gives the run's own plan), not the timings."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeplan.artifact.measured import read_measured
from pipeplan.artifact.plan import Plan
from pipeplan.artifact.timing import plan_step_ms
from pipeplan.cli import app
from pipeplan.profiling.profile import Profile
from pipeplan.refine.bookkeeping import measured_medians

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = ["mlp", "-a", "layers=4", "-a", "hidden=64"]
QUICK = ["--warmup", "0", "--repeats", "3", "--threads", "1"]


def _ok(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_profile_plan_run_refine_run(tmp_path):
    profile, folder, trace = tmp_path / "p.json", tmp_path / "plan", tmp_path / "plan" / "measured.json"
    _ok("profile", *MODEL, "-b", "2", "-o", str(profile), *QUICK)
    assert Profile.load(profile).provenance.threads == 1
    plan_args = ["-n", "2", "-B", "8", "-s", "zb-h1", "--parallel", "pp=2,replicate=off", "-o", str(folder)]
    _ok("plan", *MODEL, "--profile", str(profile), *plan_args)
    plan = Plan.load(folder / "plan.json")
    assert plan.profile is not None and plan.profile.threads == 1
    assert Profile.load(folder / "profile.json").fingerprint == plan.profile.fingerprint
    synchronized = ["--no-post-validate"]  # each step checked before its update: its tail's parts are marked
    _ok(
        "run",
        str(folder / "plan.json"),
        "--steps",
        "4",
        "--trace",
        str(trace),
        "--threads",
        "1",
        "--quiet",
        *synchronized,
    )
    run = read_measured(trace)
    assert run.record.plan == str((folder / "plan.json").resolve())
    assert run.record.plan_fingerprint == plan.fingerprint and run.record.threads == 1
    synchronized_ms = plan_step_ms(plan, post_validate=False)  # the prediction for the setting run
    assert run.record.measured_ms > 0 and run.record.predicted_ms == pytest.approx(synchronized_ms)

    data = json.loads(trace.read_text())["pipeplan_measured"]["ranks"]
    for entry in data:  # each step's tail marked in order: last op's end <= exchange's end <= checks' end <= end
        for traced in entry["steps"]:
            exchanged, checked = traced["marks_ms"]
            assert max(op[2] for op in traced["ops"]) <= exchanged <= checked <= traced["end_ms"]
    assert len(run.tail_parts_ms) == 2 and all(min(parts) >= 0 for parts in run.tail_parts_ms)
    result = json.loads(_ok("refine", str(trace), "-o", str(tmp_path / "refined"), "--json"))
    assert [row["measured"] for row in result["step_tail_ms"]["parts"]] == [
        dict(zip(("exchange", "checks", "update"), parts)) for parts in run.tail_parts_ms
    ]
    medians = measured_medians(plan, run)
    assert (
        {(op["stage"], op["kind"]) for op in result["ops"]} == set(medians) == {(s, k) for s in (0, 1) for k in "FIW"}
    )
    refined = Profile.load(tmp_path / "refined" / "profile.json")
    per_op = refined.provenance.op_overhead_ms  # the intercept of the medians against the ops' planned work
    assert per_op is not None and 0.0 <= per_op <= min(medians.values())
    for op in result["ops"]:  # the run's own plan timed with the refined profile: the measured medians
        if op["stage"] != 0 or op["kind"] != "I":  # the first stage's I does no work: it costs the per-op term
            assert op["refined_ms"] == pytest.approx(op["measured_ms"], rel=1e-9)
        else:
            assert op["refined_ms"] == pytest.approx(per_op, rel=1e-9)
    assert result["predicted_ms"] == run.record.predicted_ms and result["refined_ms"] > 0
    refined_dir = tmp_path / "refined"
    new = Plan.load(refined_dir / "plan.json")
    assert new.runnable and new.schedule == "zb-h1" and new.profile.fingerprint == refined.fingerprint
    assert refined.provenance.refined_from and refined.provenance.threads == 1
    # the tail's parts learned on their own: the checks (the rank that waited least), no exchange (one pipeline)
    checks = min(parts[1] for parts in run.tail_parts_ms)
    assert refined.provenance.step_checks_ms == pytest.approx(checks) == result["learned"]["step_checks_ms"]
    assert refined.provenance.exchange_efficiency is None and result["learned"]["exchange_efficiency"] is None
    assert new.training.step_checks_ms == pytest.approx(checks)
    # a second round: the refined plan runs, and its trace names it
    again = tmp_path / "again.json"
    _ok("run", str(refined_dir / "plan.json"), "--steps", "2", "--trace", str(again), "--threads", "1", "--quiet")
    assert read_measured(again).record.plan_fingerprint == new.fingerprint
