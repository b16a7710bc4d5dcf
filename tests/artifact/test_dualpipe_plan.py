"""dualpipe planned: each rank holds its stage and the mirror's (the parameters twice per pipeline), the two copies'
gradient exchange in the step, `show` and timeline.json re-simulating the search's figures; the selector says why
it loses when it ranks it."""

from __future__ import annotations

import json

import pytest
from helpers.search import make_cluster, synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.plan import ModelRef
from pipeplan.artifact.timing import plan_memory, plan_steps_timeline, plan_timeline
from pipeplan.cli import app
from pipeplan.costs import bytes_per_param, gradient_sync_ms, numerics
from pipeplan.precision import get_precision
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans

runner = CliRunner()
PRECISION = "bf16-mixed"


def _plan():
    profile = synthetic_profile(num_layers=8, cut_bytes=1_000_000)
    config = SearchConfig(
        global_batch_size=16, pipeline_depths=(4,), replication=False, numerics=numerics("adamw", PRECISION)
    )
    result = search_plans(profile, make_cluster(4, memory=2**32), config, ("dualpipe",))
    return result, build_plan(result, model=ModelRef(ref="synthetic"))


def test_each_rank_holds_two_copies_and_pays_their_exchange():
    result, plan = _plan()
    assert plan.schedule == "dualpipe" and len(plan.stages) == 4
    assert [info.stages for info in plan.ranks] == [(0, 3), (1, 2), (2, 1), (3, 0)]
    per_param = bytes_per_param(numerics("adamw", PRECISION))
    static = plan_memory(plan).static_bytes
    counts = [s.param_count for s in plan.stages]
    assert static == tuple(pytest.approx((counts[d] + counts[3 - d]) * per_param) for d in range(4))
    # one pipeline, yet every stage's gradients are all-reduced: over its two copies (devices d and 3-d)
    mode = get_precision(PRECISION)
    cluster = result.cluster
    for stage in plan.stages:
        link = cluster.link_between([stage.index, 3 - stage.index])
        expected = gradient_sync_ms(
            stage.param_count * mode.grad_bytes, stage.param_count * mode.param_bytes, 2, link, 0
        )
        assert stage.allreduce_ms == pytest.approx(expected) and expected > 0


def test_show_and_timeline_reproduce_the_plan(tmp_path):
    _, plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    result = runner.invoke(app, ["show", str(path), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["predicted"]["step_ms"] == pytest.approx(plan.predicted.step_ms, rel=1e-12)
    timeline = plan_timeline(plan)
    assert tuple(round(b) for b in timeline.peak_memory_bytes) == plan.predicted.peak_memory_bytes
    steps = plan_steps_timeline(plan)  # the steps timeline.json holds: step k's microbatches from k x m
    assert {e.op.microbatch // plan.training.num_microbatches for e in steps.entries} == {0, 1}
    for entry in steps.entries:  # odd microbatches on the mirror device, in every step
        for half in entry.op.parts:
            device = half.stage if half.microbatch % 2 == 0 else 3 - half.stage
            assert entry.device == device


def test_the_selector_says_why_dualpipe_loses():
    """Tiny weights, heavy cuts: plain data parallelism wins; dualpipe on 2 devices (no bubble, (P/2-1) = 0) is
    ranked close behind, and the rationale says what it costs."""
    profile = synthetic_profile(num_layers=8, cut_bytes=50_000_000, params=1000)
    config = SearchConfig(global_batch_size=16, numerics=numerics("adamw", PRECISION))
    result = search_plans(profile, make_cluster(4, memory=2**32), config, ("dualpipe", "1f1b"))
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    assert plan.schedule == "1f1b" and any(e.layout.schedule == "dualpipe" for e in result.ranked)
    assert "dualpipe loses: its best, dualpipe 2x2 " in plan.rationale and "holds every stage twice" in plan.rationale


@pytest.mark.parametrize("fmt", ["torch-csv", "torchtitan", "torchtitan-0.3", "megatron"])
def test_every_export_refuses_it_in_one_line(tmp_path, fmt):
    """No engine places one stage on two ranks: each format refuses, naming what to export instead, and writes
    nothing."""
    _, plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    result = runner.invoke(app, ["export", str(path), "-f", fmt, "-o", str(tmp_path / "out")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: cannot export a dualpipe plan as {fmt}: ") and "dualpipev" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_plan_searches_dualpipe_only_by_name():
    """No engine runs dualpipe: `plan`'s auto set leaves it out (a plan it chose alone could not be exported)."""
    profile = synthetic_profile(num_layers=8, cut_bytes=50_000_000, params=1000)
    config = SearchConfig(global_batch_size=16, numerics=numerics("adamw", PRECISION))
    result = search_plans(profile, make_cluster(4, memory=2**32), config)
    assert result.ranked and not any(e.layout.schedule == "dualpipe" for e in result.ranked)
