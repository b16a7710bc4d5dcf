"""The compute breakdown an analytic plan carries (plan.json per stage, `show` and `show --json` for the busiest rank):
matmuls, attention, memory-bound kernels, launches, exposed collectives and other ops, summing to what the plan
predicts each stage and rank computes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.plan.plan import Plan

runner = CliRunner()
MODEL = ["llama", "-a", "layers=4", "-a", "hidden=512", "-a", "heads=8", "-a", "kv_heads=4", "-a", "seq=512"]


def test_each_stage_and_the_busiest_rank_split_their_compute(tmp_path):
    out = tmp_path / "plan"
    args = ["plan", *MODEL, "--device", "meta", "--hardware", "h100", "--devices", "4", "-B", "16", "-o", str(out)]
    result = runner.invoke(app, [*args, "--precision", "bf16-main", "--tensor-parallel", "2"])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out / "plan.json")
    for stage in plan.stages:  # one microbatch's F + B (+ recomputation), by part
        backward = stage.backward_ms if stage.backward_ms is not None else stage.input_grad_ms + stage.weight_grad_ms
        assert sum(stage.compute_breakdown.values()) == pytest.approx(stage.forward_ms + backward + stage.recompute_ms)
        assert stage.compute_breakdown["gemm_ms"] > 0 and stage.compute_breakdown["collectives_ms"] > 0  # t = 2
    shown = runner.invoke(app, ["show", str(out / "plan.json"), "--json"])
    parts = json.loads(shown.stdout)["compute_breakdown"]
    rank_stages = next(info.stages for info in plan.ranks if info.rank == parts["rank"])
    per_step = sum(
        sum(plan.stages[s].compute_breakdown.values()) * plan.training.num_microbatches / plan.stages[s].replicas
        for s in rank_stages
    )
    assert parts["total_ms"] == pytest.approx(per_step)
    text = " ".join(runner.invoke(app, ["show", str(out / "plan.json")]).output.split())
    assert f"Compute: {parts['total_ms']:,.1f} ms per step on rank {parts['rank']} (the busiest): GEMM" in text
    assert "exposed collectives" in text
