"""End to end: `pipeplan plan` from a measured profile of a small gpt, with --memory-per-device too tight for any
2-stage plan without recomputation, picks stages that recompute; `run` executes it on 2 gloo ranks, and its
losses and gradients equal those of the same plan with every stage's recomputation turned off."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.models import load_model
from pipeplan.plan.plan import Plan
from pipeplan.profiling.measure import profile_model
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.train.config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # multi-process runs

runner = CliRunner()
OPTIONS = dict(layers=4, hidden=32, heads=2, seq=16, vocab=64, dropout=0.3)  # dropout: math-path attention
TWO_STEPS = RunConfig(steps=2, quiet=True, heartbeat_timeout_s=30.0)


def _plan(tmp_path, profile_path, memory: int, *extra: str):
    out = tmp_path / f"plan-{memory}-{'-'.join(extra) or 'auto'}"
    assignments = [part for key, value in OPTIONS.items() for part in ("-a", f"{key}={value}")]
    args = ["plan", "gpt", *assignments, "--profile", str(profile_path)]
    args += ["--devices", "2", "-p", "2", "--no-replication", "-s", "1f1b", "-B", "8", "-b", "2"]
    args += ["--memory-per-device", str(memory), "--memory-reserve", "0", "-o", str(out), *extra]
    return out, runner.invoke(app, args)


def _tight_memory(tmp_path, profile_path) -> int:
    """A memory per device that no plan without recomputation fits: below the roomy plan's peak until the
    search without recomputation gives up."""
    out, result = _plan(tmp_path, profile_path, 2**30)
    assert result.exit_code == 0, result.output
    memory = max(Plan.load(out / "plan.json").predicted.peak_memory_bytes)
    for _ in range(12):
        memory = int(memory * 0.93)
        _, plain = _plan(tmp_path, profile_path, memory, "--recompute", "none")
        if plain.exit_code == 1:
            assert "memory" in plain.output
            return memory
    raise AssertionError("the search without recomputation kept fitting")


def test_a_plan_that_must_recompute_runs_like_the_same_plan_without(tmp_path):
    profile_path = tmp_path / "profile.json"
    profile_model(load_model("gpt", OPTIONS), batch_size=2, warmup=0, repeats=1, progress=False, precision="fp32").save(
        profile_path
    )
    memory = _tight_memory(tmp_path, profile_path)
    out, result = _plan(tmp_path, profile_path, memory)
    assert result.exit_code == 0, result.output
    plan = Plan.load(out / "plan.json")
    assert any(s.recompute != "none" for s in plan.stages)
    assert max(plan.predicted.peak_memory_bytes) <= memory
    assert plan.memory_choices and "recomputes" in plan.memory_choices[0]
    data = json.loads((out / "plan.json").read_text())
    for stage in data["stages"]:  # the same cuts, schedule and ranks, every stage keeping all its activations
        stage.update(recompute="none", recompute_ms=0.0, kept_bytes=None, recompute_bytes=0)
    plain_path = tmp_path / "plain.json"
    plain_path.write_text(json.dumps(data))
    results = launch_many([(out / "plan.json", TWO_STEPS), (plain_path, TWO_STEPS)], capture_grads=True, threads=1)
    for rank in results:
        recomputed, plain = rank
        assert recomputed.losses == plain.losses and len(plain.losses) == 2
        assert (recomputed.grads or {}).keys() == (plain.grads or {}).keys()
        for name, grad in (recomputed.grads or {}).items():
            assert torch.equal(grad, plain.grads[name]), name
