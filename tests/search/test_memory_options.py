"""The search's memory options: activation recomputation per stage (only where a layout does not fit without it,
the cheapest mode that fits), ZeRO-1 (auto, 0, 1), the reasons the plan gives, and plan = show = run for plans
that use them (plan.json's stages and training config reproduce the search's simulation exactly)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from helpers.search import make_cluster, plan_step_ms, synthetic_profile
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.costs import allreduce_ms
from pipeplan.errors import ConfigError, InfeasibleError
from pipeplan.plan.plan import ModelRef, Plan
from pipeplan.plan.timing import plan_costs, plan_memory, plan_timeline
from pipeplan.runtime.train import loop as train
from pipeplan.search.config import SearchConfig, parse_zero
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans
from pipeplan.units import parse_size

runner = CliRunner()
MIB = 2**20


def attention_profile(**kwargs):
    """Synthetic layers whose attention internals are a quarter of their saved bytes, re-run in 0.1 ms; full
    recomputation re-runs the forward."""
    profile = synthetic_profile(**kwargs)
    layers = tuple(
        replace(la, selective_activation_bytes=la.activation_bytes * 3 // 4, selective_recompute_ms=0.1)
        for la in profile.layers
    )
    return replace(profile, layers=layers)


RECOMPUTE_PROFILE = dict(num_layers=8, activation_bytes=40_000_000, params=100_000)


def _recompute_search(memory_mib: int, **config):
    profile = attention_profile(**RECOMPUTE_PROFILE)
    config = SearchConfig(
        global_batch_size=16, pipeline_depths=(4,), replication=False, precision="bf16-mixed", **config
    )
    return search_plans(profile, make_cluster(4, memory=memory_mib * MIB), config, ["1f1b"])


def _zero_search(memory_mib: int, zero="auto"):
    profile = synthetic_profile(4, params=1_000_000, activation_bytes=1_000_000)
    config = SearchConfig(global_batch_size=16, pipeline_depths=(1,), zero=zero, precision="bf16-mixed")
    return search_plans(profile, make_cluster(4, memory=memory_mib * MIB), config)


def _needs(line: str) -> tuple[float, float]:
    found = re.search(r"without it needs ([0-9.]+ [KMG]iB) of ([0-9.]+ [KMG]iB)", line)
    assert found, line
    return parse_size(found.group(1).replace(" ", "")), parse_size(found.group(2).replace(" ", ""))


def test_recomputation_only_where_memory_needs_it():
    roomy = _recompute_search(800)
    assert roomy.best.recomputing == 0
    assert roomy.best.step_ms == _recompute_search(800, recompute="none").best.step_ms
    with pytest.raises(InfeasibleError, match="memory is the binding constraint"):
        _recompute_search(150, recompute="none")
    tight = _recompute_search(150)
    modes = [s.recompute for s in tight.best.partition.stages]
    assert "none" in modes and "full" in modes and "selective" in modes, modes
    assert tight.best.peak_memory_bytes <= 150 * MIB
    plan = build_plan(tight, model=ModelRef(ref="synthetic"))
    lines = [line for line in plan.memory_choices if line.startswith("stage ")]
    assert [int(line.split()[1]) for line in lines] == [i for i, m in enumerate(modes) if m != "none"]
    for line in lines:  # every recomputing stage needs it: without it its device is over memory
        need, limit = _needs(line)
        assert need > limit == 150 * MIB
    assert "Memory: stage 0 recomputes" in plan.rationale


def test_each_stage_takes_the_cheapest_mode_that_fits():
    """A stage that recomputes selectively (0.1 ms per layer) would not fit without recomputing, and one that
    recomputes fully (the forward again, 1 ms per layer) would not fit selectively either."""
    best = _recompute_search(150).best
    for stage in best.partition.stages:
        layers = stage.num_layers
        if stage.recompute == "selective":
            assert stage.recompute_ms == pytest.approx(0.1 * layers)
        if stage.recompute == "full":
            assert stage.recompute_ms == pytest.approx(1.0 * layers)
        # the model's first stage has no input gradient: its I only recomputes and W runs the whole backward
        first = stage.first_layer == 0
        assert stage.input_grad_ms == pytest.approx((0.0 if first else 1.0 * layers) + stage.recompute_ms)
        assert stage.weight_grad_ms == pytest.approx((2.0 if first else 1.0) * layers)
    selective = [s.index for s in best.partition.stages if s.recompute == "selective"]
    full = [s.index for s in best.partition.stages if s.recompute == "full"]
    assert selective and full
    plan = build_plan(_recompute_search(150), model=ModelRef(ref="synthetic"))
    for index in full:  # selective instead would not fit: the memory model's own peak says so
        trial = replace(plan, stages=tuple(_as_selective(s) if s.index == index else s for s in plan.stages))
        assert max(plan_timeline(trial).peak_memory_bytes) > 150 * MIB


def _as_selective(stage):
    """The stage recomputing selectively: it keeps 3/4 of its layers' bytes and re-creates one layer's quarter."""
    layers = stage.last_layer - stage.first_layer + 1
    kept = stage.activation_bytes * 3 // 4
    return replace(stage, recompute="selective", kept_bytes=kept, recompute_bytes=stage.activation_bytes // layers // 4)


def test_zero_choice():
    """Pure data parallelism over 4 devices: 4M parameters need 64 MB with whole AdamW states, 40 MB sharded."""
    assert _zero_search(80).best.zero == 0  # fits either way: the simpler plan at the same speed
    assert _zero_search(80, zero=1).best.zero == 1
    with pytest.raises(InfeasibleError):
        _zero_search(48, zero=0)
    result = _zero_search(48)
    best = result.best
    assert best.zero == 1 and best.peak_memory_bytes <= 48 * MIB
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    assert plan.training.zero == 1
    need, limit = _needs(plan.memory_choices[0])
    assert plan.memory_choices[0].startswith("ZeRO-1 shards the optimizer state over 4 devices")
    assert need > limit == 48 * MIB
    link = result.cluster.intra_link
    for stage, exchange in zip(best.partition.stages, best.stage_allreduce_ms):  # RS + AG take the all-reduce's time
        assert exchange == pytest.approx(allreduce_ms(stage.param_count * 4, 4, link))


@pytest.mark.parametrize("case", ["zero1", "recompute"])
def test_search_show_and_run_predict_the_same_step(case, tmp_path, capsys):
    result = _zero_search(48) if case == "zero1" else _recompute_search(150)
    chosen = result.best
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    memory = plan_memory(again)
    assert memory == chosen.memory
    assert plan_costs(again) == chosen.costs
    timeline = plan_timeline(again)
    assert timeline.entries == chosen.timeline.entries
    assert timeline.peak_memory_bytes == chosen.timeline.peak_memory_bytes
    assert plan_step_ms(again, timeline) == pytest.approx(chosen.step_ms, rel=1e-12)
    assert again.predicted.step_ms == chosen.step_ms
    assert again.predicted.peak_memory_bytes[: timeline.num_devices] == chosen.device_memory_bytes
    predicted = train.predicted_ms(again, again.training.post_validate)  # what `run` prints after training
    train._log_summary(again, predicted, [100.0, 100.0], [100.0, 100.0])
    assert f"vs predicted {chosen.step_ms:.1f} ms" in capsys.readouterr().out


def test_plan_and_show_cli_agree_and_json_has_the_choices(tmp_path):
    path = tmp_path / "profile.json"
    attention_profile(**RECOMPUTE_PROFILE).save(path)
    args = ["plan", "--profile", str(path), "--devices", "4", "-p", "4", "-B", "16", "--no-replication", "-s", "1f1b"]
    tight = [*args, "--memory-per-device", "150MiB", "--memory-reserve", "0", "-o", str(tmp_path / "plan")]
    result = runner.invoke(app, [*tight, "--json"])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)
    shown = json.loads(runner.invoke(app, ["show", str(tmp_path / "plan" / "plan.json"), "--json"]).output)
    assert shown["predicted"] == planned["predicted"]
    assert shown["memory_choices"] == planned["memory_choices"] and planned["memory_choices"]
    assert [s["recompute"] for s in planned["stages"]] == [s["recompute"] for s in shown["stages"]]
    assert any(s["recompute"] != "none" and s["recompute_ms"] > 0 for s in planned["stages"])
    text = runner.invoke(app, ["show", str(tmp_path / "plan" / "plan.json")]).output
    assert "recompute" in text and "without it needs" in text
    refused = runner.invoke(app, [*tight, "--recompute", "none"])
    assert refused.exit_code == 1 and "memory is the binding constraint" in refused.output
    for bad, message in (("--recompute", "--recompute must be one of none, auto"), ("--zero", "--zero must be")):
        wrong = runner.invoke(app, [*tight, bad, "sometimes"])
        lines = [line for line in wrong.output.splitlines() if line.startswith("error:")]
        assert wrong.exit_code == 1 and len(lines) == 1 and message in lines[0], wrong.output


def test_zero_option_values():
    assert parse_zero("auto") == "auto" and parse_zero("0") == 0 and parse_zero("1") == 1
    with pytest.raises(ConfigError, match="--zero 2 is not supported"):
        parse_zero("2")
    with pytest.raises(ConfigError, match="--zero 1 needs --optimizer by name"):
        SearchConfig(global_batch_size=4, optimizer=12.0, zero=1, precision="bf16-mixed")
    assert SearchConfig(global_batch_size=4, precision="bf16-mixed").zero == "auto"


def test_more_memory_never_gives_a_slower_plan():
    """Where memory fits a plan without recomputation only by unbalancing its cuts, the search also partitions
    with recomputation and keeps the faster one, saying why: the best step never grows with memory."""
    steps = [_recompute_search(mib).best.step_ms for mib in (150, 170, 200, 230, 260, 300, 400, 800)]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(steps, steps[1:])), steps
    result = _recompute_search(200)
    plain = [e for e in result.ranked if not e.recomputing and e.layout.label == result.best.layout.label]
    assert result.best.recomputing and plain and plain[0].step_ms > result.best.step_ms * 1.05
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    assert any("faster than this layout without it" in line for line in plan.memory_choices)
    assert _recompute_search(200, recompute="none").best.step_ms == plain[0].step_ms
