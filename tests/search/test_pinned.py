"""Pinned layouts: parsed in one line, predicted exactly as given (Megatron's even split, the interleave factor,
recomputation per stage, tensor and context parallelism), beside the planner's choice in `capacity` and `plan`."""

from __future__ import annotations

import json

import pytest
from helpers.cli import one_error_line
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.costs import numerics
from pipeplan.errors import ConfigError
from pipeplan.hardware import cluster_for, load_hardware
from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.search.config import SearchConfig
from pipeplan.search.pinned import evaluate_pinned, parse_layout

runner = CliRunner()
GPT = dict(hidden=256, layers=8, heads=8, vocab=512, seq=256)


@pytest.fixture(scope="module")
def profile():
    spec = load_model("gpt", GPT)
    return profile_analytic(spec, batch_size=1, hardware="h100", precision="bf16-main")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tp=2,pp", "must be key=value"),
        ("tp=2,np=4", "must be key=value"),
        ("tp=x", "tp='x' must be a whole number"),
        ("tp=0", "tp must be >= 1"),
        ("recompute=some", "recompute='some' is not one of"),
        ("pp=2,vp=2,recompute=none/full/none", "give one mode or 4"),
        ("pp=2,vp=2,schedule=1f1b", "vp=2 needs a looped schedule"),
        ("split=random", "split='random'"),
        ("zero=2", "zero=2 is not supported"),
        ("pp=2,blocks=4/x", "must be whole numbers joined by '/'"),
        ("pp=2,blocks=4", "blocks names 1 stages; pp x vp = 2"),
        ("pp=3,blocks=4/0/4", "only the first stage"),
        ("pp=2,blocks=4/4,split=balanced", "leave out split=balanced"),
        ("pp=4,schedule=interleaved", "schedule=interleaved loops 2 or more chunks"),  # was: "uses 2 of 4 devices"
        ("pp=4,schedule=pipedream,zero=1", "schedule=pipedream is asynchronous and runs without ZeRO-1: give zero=0"),
        ("pp=4,schedule=pipedream-2bw,recompute=full", "runs without recomputation: give recompute=none"),
    ],
)
def test_bad_layouts_are_one_line(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_layout(text)


def test_a_pinned_layout_is_predicted_as_given(profile):
    layout = parse_layout("tp=2,pp=2,vp=2,dp=2,mbs=2,recompute=full/none/none/none")
    assert layout.devices == 8 and layout.schedule_name == "interleaved"
    config = SearchConfig(global_batch_size=32, numerics=numerics("adamw", "bf16-main"), memory_reserve_bytes=0)
    found = evaluate_pinned(profile, cluster_for(load_hardware("h100"), 8, 8), config, layout)
    evaluation = found.evaluation
    assert evaluation is not None
    part = evaluation.partition
    assert part.num_stages == 4 and part.chunks == 2 and evaluation.layout.num_microbatches == 8
    assert [s.recompute for s in part.stages] == ["full", "none", "none", "none"]
    # Megatron's split: 8 blocks in runs of 2, the embedding with the first stage, the head with the last
    assert [(s.first_layer, s.last_layer) for s in part.stages] == [(0, 2), (3, 4), (5, 6), (7, 9)]
    assert evaluation.layout.tensor_parallel == 2 and found.cluster.num_devices == 8
    with pytest.raises(ConfigError, match="tp x cp x pp x dp = 8 devices, but --devices is 4"):
        evaluate_pinned(profile, cluster_for(load_hardware("h100"), 4, 8), config, layout)


def test_context_parallelism_splits_the_sequence_and_its_activations(profile):
    config = SearchConfig(global_batch_size=8, numerics=numerics("adamw", "bf16-main"), memory_reserve_bytes=0)
    cluster = cluster_for(load_hardware("h100"), 4, 8)
    whole = evaluate_pinned(profile, cluster, config, parse_layout("tp=2,cp=1,pp=1,dp=2"))
    split = evaluate_pinned(profile, cluster, config, parse_layout("tp=2,cp=2,pp=1,dp=1"))
    block = whole.profile.layers[1]
    assert split.profile.layers[1].activation_bytes == -(-block.activation_bytes // 2)
    assert split.profile.cut_bytes[1] == -(-whole.profile.cut_bytes[1] // 2)
    assert split.evaluation.layout.holders == 2  # the optimizer state shards over the context-parallel ranks too


def test_capacity_and_plan_show_the_pinned_layout_beside_the_planner(tmp_path):
    base = ["gpt", *[f"-a {k}={v}" for k, v in GPT.items()], "--hardware", "h100", "-B", "16"]
    args = [part for arg in base for part in arg.split(" ", 1)]
    result = runner.invoke(app, ["capacity", *args, "--layout", "tp=2,pp=2,dp=2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["pinned"]["fits"] and data["pinned"]["tensor_parallel"] == 2 and data["planner"]["fits"]
    assert len(data["pinned_device_memory_bytes"]) == 2  # one simulated peak per pipeline device
    assert "planner's choice" in data["comparison"] or data["comparison"].startswith("the pinned layout is")
    plan_args = ["plan", *args[:-2], "--device", "meta", "--devices", "8", "-B", "16", "-o", str(tmp_path / "p")]
    result = runner.invoke(app, [*plan_args, "--layout", "tp=2,pp=2,dp=2"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["training"]["tensor_parallel"] == 2 and plan["rationale"].startswith("Layout pinned by --layout")
    result = runner.invoke(app, [*plan_args, "--layout", "tp=2,pp=2,dp=4"])
    assert "tp x cp x pp x dp = 16 devices, but --devices is 8" in one_error_line(result)


@pytest.mark.parametrize("extra", ["replicate=off", None])
def test_plan_writes_context_parallel_and_balanced_recompute_as_pinned(tmp_path, extra):
    """cp > 1 plans pass the plan file's rank -> node check (a rank stands for t x cp devices), and split=balanced
    keeps the pinned recomputation (the partitioner picks the cuts, not the modes)."""
    model = [part for k, v in GPT.items() for part in ("-a", f"{k}={v}")]
    args = ["plan", "gpt", *model, "--device", "meta", "--hardware", "h100", "--devices", "8", "-B", "16"]
    layout = "tp=2,cp=2,pp=2,dp=1,recompute=full,split=balanced"
    parallel = ["--parallel", extra] if extra else []
    result = runner.invoke(app, [*args, *parallel, "--layout", layout, "-o", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    training = plan["training"]
    assert (training["tensor_parallel"], training["context_parallel"], training["data_parallel"]) == (2, 2, 1)
    assert [s["recompute"] for s in plan["stages"]] == ["full", "full"]
    assert [r["node"] for r in plan["ranks"]] == [0, 0]  # 2 ranks x 4 devices on one node of 8
    assert runner.invoke(app, ["show", str(tmp_path / "p" / "plan.json")]).exit_code == 0


def test_blocks_per_stage_pin_uneven_and_embedding_only_stages(profile, tmp_path):
    """blocks= gives each stage its blocks (Megatron's --pipeline-model-parallel-layout): 0 first leaves the first
    stage the embedding alone; the written plan and its Megatron export hold exactly those stages."""
    config = SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-main"), memory_reserve_bytes=0)
    cluster = cluster_for(load_hardware("h100"), 8, 8)
    found = evaluate_pinned(profile, cluster, config, parse_layout("pp=2,vp=2,dp=4,blocks=0/3/3/2"))
    part = found.evaluation.partition  # layer 0 the embedding, 1..8 the blocks, 9 the head
    assert [(s.first_layer, s.last_layer) for s in part.stages] == [(0, 0), (1, 3), (4, 6), (7, 9)]
    with pytest.raises(ConfigError, match="blocks adds up to 7 blocks, but the model has 8"):
        evaluate_pinned(profile, cluster, config, parse_layout("pp=2,vp=2,dp=4,blocks=0/3/2/2"))
    model = [part for k, v in GPT.items() for part in ("-a", f"{k}={v}")]
    args = ["plan", "gpt", *model, "--device", "meta", "--hardware", "h100", "--devices", "8", "-B", "16"]
    out = tmp_path / "p"
    result = runner.invoke(app, [*args, "--layout", "pp=4,dp=2,blocks=1/3/4/0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert [(s["first_layer"], s["last_layer"]) for s in plan["stages"]] == [(0, 1), (2, 4), (5, 8), (9, 9)]
    result = runner.invoke(app, ["export", str(out / "plan.json"), "--format", "megatron", "-o", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert "Et|ttt|tttt|L" in (tmp_path / "m").read_text()
