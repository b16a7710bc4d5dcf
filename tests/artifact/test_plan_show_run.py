"""Plan = show = run: the step the search predicted is the step `show` re-simulates, timeline.json draws and `run`
compares against, with 4+ stages and non-zero transfers; per-rank peak bytes in plan.json are the simulator's."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers.search import make_cluster, plan_step_ms, synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.summary import summary_dict
from pipeplan.artifact.timing import plan_memory, plan_steps, plan_steps_timeline, plan_timeline
from pipeplan.cli import app
from pipeplan.costs import numerics
from pipeplan.costs.overlap import Overlap
from pipeplan.runtime.train import loop as train
from pipeplan.schedules.memory import inflight_per_stage
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans

runner = CliRunner()
CUT = 50_000_000  # 50 MB per cut: 5 ms per transfer on the helpers' 10 GB/s links


def _search(schedules, **profile_kwargs):
    profile = synthetic_profile(num_layers=8, cut_bytes=CUT, **profile_kwargs)
    config = SearchConfig(
        global_batch_size=16, pipeline_depths=(4,), replication=False, numerics=numerics("adamw", "bf16-mixed")
    )
    return profile, search_plans(profile, make_cluster(4, memory=2**32), config, schedules)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "zbv", "dualpipe"])
def test_search_prediction_is_what_the_plan_resimulates(schedule):
    _, result = _search((schedule,))
    chosen = result.best
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    assert len(plan.stages) >= 4 and min(s.comm_ms for s in plan.stages[:-1]) > 1.0
    assert [s.comm_ms for s in plan.stages[:-1]] == list(chosen.costs.comm_ms)  # per boundary, as simulated
    timeline = plan_timeline(plan)
    assert timeline.entries == chosen.timeline.entries
    assert plan_step_ms(plan) == pytest.approx(chosen.step_ms, rel=1e-12)
    assert plan.predicted.step_ms == chosen.step_ms
    # per-rank peak bytes: the simulator's, for the plan's own op lists and byte costs
    pipeline0 = plan.predicted.peak_memory_bytes[: timeline.num_devices]
    assert pipeline0 == tuple(round(b) for b in timeline.peak_memory_bytes)
    assert plan_memory(plan).activation_bytes == chosen.memory.activation_bytes


def test_plan_show_timeline_json_and_run_agree(tmp_path, capsys):
    profile, _ = _search(("1f1b",))
    path = tmp_path / "profile.json"
    profile.save(path)
    out = tmp_path / "plan"
    args = ["plan", "--profile", str(path), "--devices", "4", "--memory", "4GiB"]
    result = runner.invoke(
        app, [*args, "-B", "16", "-s", "1f1b", "--parallel", "pp=4,replicate=off", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)["predicted"]
    shown = json.loads(runner.invoke(app, ["show", str(out / "plan.json"), "--json"]).output)
    assert shown["predicted"] == planned
    assert shown["makespan_ms"] == json.loads(result.output)["makespan_ms"] > 0
    plan = Plan.load(out / "plan.json")
    timeline = plan_timeline(plan)
    assert plan_step_ms(plan) == pytest.approx(planned["step_ms"], rel=1e-12)
    # timeline.json: the steps show draws, the first of them the plan's step, the next one a period later
    steps = plan_steps_timeline(plan)
    trace = json.loads((out / "timeline.json").read_text())
    m = plan.training.num_microbatches  # each op named as in its step (as `run --trace` names it), its step in args
    events = sorted((e["pid"], e["args"]["step"], e["name"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "X")
    k = [e.op.microbatch // m for e in steps.entries]
    assert events == sorted(
        (e.device, k, str(e.op.shifted(-k * m)), e.start * 1000.0) for e, k in zip(steps.entries, k)
    )
    assert [e for e in steps.entries if e.op.microbatch < m] == list(timeline.entries)
    second = min(e.start for e in steps.entries if e.op.microbatch >= m)
    assert second == pytest.approx(planned["step_ms"], rel=1e-9)  # synchronized: one step after the first
    assert f"(the period of synchronized steps; one step's makespan {shown['makespan_ms']:.2f} ms)" in " ".join(
        runner.invoke(app, ["show", str(out / "plan.json")]).output.split()
    )
    assert shown["makespan_ms"] == pytest.approx(max(e.end for e in timeline.entries), rel=1e-12)
    predicted = train.predicted_ms(plan, plan.training.post_validate)  # what `run` prints after training
    train._log_summary(plan, predicted, [100.0, 100.0], [100.0, 100.0])
    assert f"vs predicted {planned['step_ms']:.1f} ms" in capsys.readouterr().out


def test_post_validated_plan_says_so_and_its_steps_overlap(tmp_path):
    # zb-auto on 4 stages: post-validation (auto) shortens the period; plan, show and timeline.json say so
    profile, result = _search(("zb-auto",))
    assert result.best.post_validate
    path = tmp_path / "profile.json"
    profile.save(path)
    out = tmp_path / "plan"
    args = ["plan", "--profile", str(path), "--devices", "4", "--memory", "4GiB", "-B", "16"]
    planned = runner.invoke(app, [*args, "-s", "zb-auto", "--parallel", "pp=4,replicate=off", "-o", str(out), "--json"])
    summary = json.loads(planned.output)
    assert summary["training"]["post_validate"] is True
    plan = Plan.load(out / "plan.json")
    synced = plan_step_ms(plan, post_validate=False)
    period = summary["predicted"]["step_ms"]
    assert period < synced
    assert period < summary["makespan_ms"]  # post-validated: the next step starts within this one's span
    assert (
        f"Post-validation on (it shortens the period; `run` follows it): period {period:.1f} ms vs {synced:.1f} ms"
        in summary["rationale"]
    )
    shown = runner.invoke(app, ["show", str(out / "plan.json")]).output
    assert "the period of post-validated steps; one step's makespan" in " ".join(shown.split())
    steps = plan_steps(plan)
    assert steps.period_ms == pytest.approx(period, rel=1e-12) and steps.steps >= 2
    trace = json.loads((out / "timeline.json").read_text())
    events = [
        (e["pid"], e["args"]["step"], e["ts"] / 1000.0, (e["ts"] + e["dur"]) / 1000.0)
        for e in trace["traceEvents"]
        if e["ph"] == "X"
    ]
    assert len(events) == steps.steps * sum(len(ops) for ops in plan.rank_ops[:4])
    # the overlap: rank 0 starts its second step before the last rank has finished its first
    rank0_next = min(start for pid, step, start, _ in events if pid == 0 and step == 1)
    last_first = max(end for pid, step, _, end in events if pid == 3 and step == 0)
    assert rank0_next < last_first


def test_replicated_stages_are_simulated_as_the_lists_run_executes():
    """A replicated stage's replicas each run their own op list at full op time: the search's timeline is exactly
    `simulate` of those lists (stage s on its replicas), not the stage at 1/replicas of its time."""
    profile = synthetic_profile(num_layers=4, heavy_last=6.0, activation_bytes=1_000_000, cut_bytes=CUT)
    # with ZeRO-1 plain data parallelism fits; transfers beside compute: an op takes its stage's time
    config = SearchConfig(
        global_batch_size=12, zero=0, numerics=numerics("adamw", "bf16-mixed"), overlap=Overlap(p2p=True)
    )
    result = search_plans(profile, make_cluster(3, memory=60 * 2**20), config, ("1f1b",))
    chosen = result.best
    assert max(chosen.partition.replicas) > 1
    ops = list(chosen.timeline.entries)
    per_device = {}
    for e in ops:
        per_device.setdefault(e.device, []).append(str(e.op))
    assert tuple(tuple(v) for _, v in sorted(per_device.items())) == chosen.pipeline.device_ops
    stage_ms = {s.index: s.forward_ms for s in chosen.partition.stages}
    for e in ops:
        if e.op.kind == "F":
            assert e.end - e.start == pytest.approx(stage_ms[e.op.stage])  # full time, not / replicas
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    assert plan_timeline(plan).entries == chosen.timeline.entries


def test_every_schedule_reports_its_best_candidate_or_why_none_fits():
    """The balanced-stage estimate prunes most schedules here; each still gets its best-estimated candidate
    simulated, so the summary lists every schedule with figures or a real reason (not "pruned")."""
    profile = synthetic_profile(num_layers=8, cut_bytes=CUT)
    config = SearchConfig(
        global_batch_size=16,
        allow_async=True,
        numerics=numerics("adamw", "bf16-mixed"),
    )  # every schedule, the asynchronous ones too
    result = search_plans(profile, make_cluster(4, memory=2**32), config)
    assert any(r.kind in ("estimate", "bound") for r in result.rejected)  # pruning did happen
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    rows = {row["schedule"]: row for row in summary_dict(plan)["per_schedule"]}
    assert set(rows) == {name for name in SCHEDULE_NAMES if not schedule_info(name).named_only}  # (dualpipe: by name)
    for name, row in rows.items():
        if "reason" in row:
            assert "pruned" not in row["reason"]
            continue
        best = min((e for e in result.ranked if e.layout.schedule == name), key=lambda e: e.step_ms)
        assert row["step_ms"] == pytest.approx(best.step_ms) or row.get("chosen")
        assert row["peak_memory_bytes"] > 0 and 0 <= row["bubble_rate"] < 1


def test_what_input_grad_frees_lets_a_zero_bubble_plan_fit():
    """zb-h1 on 4 devices: device d peaks at (4, 3.5, 3, 2.5) microbatches of activations when I frees half
    (in flight: 4 each). With the heaviest weights on the last stage, memory between the byte peak and the
    count-based one (in flight x saved bytes) fits — an in-flight count would have refused the plan."""
    act = 8_000_000
    base = synthetic_profile(num_layers=4, params=100_000, activation_bytes=act)  # I frees half
    layers = (*base.layers[:3], dataclasses.replace(base.layers[3], param_count=2_000_000, param_bytes=8_000_000))
    profile = dataclasses.replace(base, layers=layers)
    config = SearchConfig(
        global_batch_size=8, pipeline_depths=(4,), replication=False, numerics=numerics("adamw", "bf16-mixed")
    )
    roomy = search_plans(profile, make_cluster(4, memory=2**32), config, ("zb-h1",)).best
    static = roomy.memory.static_bytes
    assert [b - s for b, s in zip(roomy.device_memory_bytes, static)] == [4 * act, 3.5 * act, 3 * act, 2.5 * act]
    counted = max(s + n * act for s, n in zip(static, inflight_per_stage(roomy.schedule)))
    memory = (roomy.peak_memory_bytes + counted) // 2
    assert roomy.peak_memory_bytes < memory < counted
    tight = search_plans(profile, make_cluster(4, memory=memory), config, ("zb-h1",)).best
    assert tight.partition.stage_ranges == roomy.partition.stage_ranges and tight.peak_memory_bytes <= memory
