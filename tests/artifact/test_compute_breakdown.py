"""The compute breakdown an analytic plan carries (plan.json per stage, `plan` / `show` and their `--json` for the
busiest rank): matmuls, attention, memory-bound kernels, launches, exposed collectives and other ops, summing to what
the plan predicts each stage and rank computes; a plan from a measured profile says why it has none."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.summary import BREAKDOWN_ABSENT
from pipeplan.cli import app
from pipeplan.costs.stage import compute_ms
from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.retime import BREAKDOWN, layer_breakdown
from pipeplan.schedules.registry import schedule_info
from tests.helpers.search import synthetic_profile

runner = CliRunner()
MODEL = ["llama", "-a", "layers=4", "-a", "hidden=512", "-a", "heads=8", "-a", "kv_heads=4", "-a", "seq=512"]


def _words(output: str) -> str:
    return " ".join(output.split())


def test_each_stage_and_the_busiest_rank_split_their_compute(tmp_path):
    """zb-h1 runs I and W as separate ops and full recomputation re-runs F before each I: each stage's parts sum to
    F + I + W as simulated (I holding the recomputation); `plan --json`, `show --json` and `show` agree."""
    out = tmp_path / "plan"
    layout = "tp=2,pp=2,dp=1,mbs=1,recompute=full,schedule=zb-h1"
    args = ["plan", *MODEL, "--device", "meta", "--hardware", "h100", "--devices", "4", "-B", "16", "-o", str(out)]
    result = runner.invoke(app, [*args, "--precision", "bf16-main", "--layout", layout, "--json"])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    plan = Plan.load(out / "plan.json")
    assert schedule_info(plan.schedule).split_backward
    for stage in plan.stages:  # one microbatch's ops as the schedule runs them, by part
        assert set(stage.compute_breakdown) == {f"{part}_ms" for part in BREAKDOWN}
        assert stage.recompute == "full" and stage.recompute_ms > 0
        simulated = compute_ms(
            stage.forward_ms, stage.input_grad_ms, stage.weight_grad_ms, stage.backward_ms, split_backward=True
        )
        assert sum(stage.compute_breakdown.values()) == pytest.approx(simulated)
        assert stage.compute_breakdown["gemm_ms"] > 0 and stage.compute_breakdown["collectives_ms"] > 0  # t = 2
    shown = json.loads(runner.invoke(app, ["show", str(out / "plan.json"), "--json"]).stdout)
    parts = shown["compute_breakdown"]
    assert planned["compute_breakdown"] == parts and shown["compute_breakdown_reason"] is None
    rank_stages = next(info.stages for info in plan.ranks if info.rank == parts["rank"])
    per_step = sum(
        sum(plan.stages[s].compute_breakdown.values()) * plan.training.num_microbatches / plan.stages[s].replicas
        for s in rank_stages
    )
    assert parts["total_ms"] == pytest.approx(per_step)
    assert sum(v for k, v in parts.items() if k not in ("rank", "total_ms")) == pytest.approx(parts["total_ms"])
    text = _words(runner.invoke(app, ["show", str(out / "plan.json")]).output)
    assert f"Compute: {parts['total_ms']:,.1f} ms per step on rank {parts['rank']} (the busiest): GEMM" in text
    assert "exposed collectives" in text


def test_a_measured_profile_has_no_breakdown_and_says_why(tmp_path):
    """Measured times hold no kernels to split: plan.json's stages carry none, `plan` and `show` print the reason
    on the Compute line, and `--json` has `compute_breakdown` null beside `compute_breakdown_reason`."""
    profile = tmp_path / "measured.json"
    synthetic = synthetic_profile(4)
    replace(synthetic, provenance=replace(synthetic.provenance, source="measured", device="cpu")).save(profile)
    out = tmp_path / "plan"
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--devices", "2", "-B", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"Compute: {BREAKDOWN_ABSENT}" in _words(result.output)
    assert all(stage.compute_breakdown == {} for stage in Plan.load(out / "plan.json").stages)
    shown = json.loads(runner.invoke(app, ["show", str(out / "plan.json"), "--json"]).stdout)
    assert shown["compute_breakdown"] is None and shown["compute_breakdown_reason"] == BREAKDOWN_ABSENT
    assert f"Compute: {BREAKDOWN_ABSENT}" in _words(runner.invoke(app, ["show", str(out / "plan.json")]).output)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_layer_splits_the_passes_its_schedule_runs(recompute):
    """Eager kernels (bf16-mixed: one per op) make I + W's rest differ from the fused B's: each layer's parts sum
    to F + B + recomputation, or F + I + W + recomputation when the backward is split; without work (measured) all
    of it is `other`."""
    spec = load_model("llama", dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, seq=128, vocab=512))
    profile = profile_analytic(spec, batch_size=2, hardware="h100", precision="bf16-mixed", attention="math")
    rates = profile.provenance.kernel_rates
    for layer in profile.layers:
        added = layer.recompute_ms(recompute)
        fused = layer_breakdown(layer, rates, recompute)
        split = layer_breakdown(layer, rates, recompute, split_backward=True)
        assert fused.total_ms == pytest.approx(layer.forward_ms + layer.backward_ms + added)
        assert split.total_ms == pytest.approx(layer.forward_ms + layer.input_grad_ms + layer.weight_grad_ms + added)
        assert fused.collectives == pytest.approx(0.0, abs=1e-9) and split.collectives == pytest.approx(0.0, abs=1e-9)
        measured = layer_breakdown(replace(layer, work=None), rates, recompute)
        assert measured.other == measured.total_ms == pytest.approx(fused.total_ms)
