"""Every pinned layout plans, writes, shows and exports (issue 34): a grid of `--layout`s at GPT-3 175B, Llama-2 70B
and Llama 3.1 405B widths on meta (depth trimmed to 32 / 16 / 16 blocks: each stage's shapes are the real ones,
only the number of blocks is smaller) through plan -> plan.json -> show -> export. The written plan holds exactly
what was pinned (t, cp, ep, pp, vp, dp, microbatch size, recompute per stage, ZeRO, schedule, blocks per stage),
`show` re-predicts the same step, and each export either writes or refuses in one ConfigError line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers.cli import one_error_line
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.timing import plan_prediction
from pipeplan.cli import app
from pipeplan.models.builtins import BUILTINS
from pipeplan.search.pinned import parse_layout
from pipeplan.search.plan_job import prepare_plan, write_plan
from pipeplan.search.plan_options import PlanOptions
from pipeplan.search.planner import plan as plan_layouts

runner = CliRunner()
GPT3 = dict(layers=32, hidden=12288, heads=96, vocab=51200, tie_embeddings="true", seq=2048)  # GPT-3 175B widths
MODELS = {  # name: (factory, options, devices, global batch)
    "gpt3-175b": ("gpt", GPT3, 128, 256),
    "llama-2-70b": ("llama", {**BUILTINS["llama-70b"].preset, "layers": 16}, 64, 128),
    "llama-3.1-405b": ("llama", {**BUILTINS["llama-3.1-405b"].preset, "layers": 16}, 256, 256),
}
EXPORTS = ("megatron", "torchtitan", "torch-csv")
GRID = [  # (model, --layout)
    ("gpt3-175b", "tp=4,pp=8,vp=4,dp=4,mbs=1,recompute=none,zero=1"),
    ("gpt3-175b", "tp=8,pp=4,dp=4,mbs=2,recompute=selective,zero=0"),
    ("gpt3-175b", "tp=4,pp=8,dp=4,recompute=full,split=balanced"),
    ("gpt3-175b", "tp=4,cp=2,pp=4,vp=2,dp=4,recompute=selective,zero=1"),
    ("gpt3-175b", "tp=8,pp=4,vp=2,dp=4,schedule=zbv,recompute=full"),
    ("gpt3-175b", "tp=8,pp=4,dp=4,schedule=zb-h1,recompute=full/none/selective/none"),
    ("gpt3-175b", "tp=8,pp=4,dp=4,zero=1,blocks=7/9/9/7"),
    ("gpt3-175b", "tp=4,pp=4,vp=2,dp=8,zero=1,blocks=0/5/5/5/5/5/5/2"),
    ("llama-2-70b", "tp=4,cp=2,pp=4,vp=4,dp=2,zero=1"),
    ("llama-2-70b", "tp=8,pp=4,dp=2,recompute=full,zero=1,split=balanced"),
    ("llama-2-70b", "tp=8,pp=2,vp=2,dp=4,schedule=zbv,zero=0,recompute=selective"),
    ("llama-2-70b", "tp=4,pp=4,dp=4,mbs=2,schedule=zb-h1,recompute=selective"),
    ("llama-2-70b", "tp=8,pp=4,dp=2,blocks=3/5/5/3"),
    ("llama-2-70b", "tp=2,cp=4,pp=2,vp=2,dp=4,split=balanced,recompute=selective,zero=1"),
    ("llama-2-70b", "tp=8,pp=4,vp=3,dp=2,recompute=selective"),  # 16 blocks over 12 stages: 2,2,2,2,1,...
    ("llama-2-70b", "tp=8,pp=4,dp=2,schedule=gpipe,recompute=full"),
    ("llama-2-70b", "tp=8,pp=4,dp=2,schedule=zb-h2,zero=1"),
    ("llama-2-70b", "tp=8,pp=4,vp=2,dp=2,schedule=dualpipev,recompute=selective"),
    ("llama-2-70b", "tp=8,pp=4,dp=2,schedule=pipedream,mbs=2"),
    ("llama-2-70b", "tp=8,pp=4,vp=2,dp=2,blocks=0/3/3/3/3/3/1/0"),
    ("llama-2-70b", "tp=8,pp=4,dp=2,schedule=dualpipe,recompute=full"),  # megatron refuses it in one line
    ("llama-2-70b", "tp=8,pp=4,dp=2,schedule=zb-auto,recompute=selective,zero=1"),
    ("llama-2-70b", "tp=8,pp=4,vp=4,dp=2,recompute=" + "/".join(["none"] * 4 + ["full"] * 4 + ["selective"] * 8)),
    ("llama-3.1-405b", "tp=8,pp=8,vp=2,dp=4,zero=1,recompute=none"),
    ("llama-3.1-405b", "tp=8,cp=2,pp=8,dp=2,recompute=full,zero=1"),
    ("llama-3.1-405b", "tp=8,pp=16,dp=2,recompute=selective,zero=1"),
    ("llama-3.1-405b", "tp=8,pp=8,dp=4,recompute=full,zero=1,split=balanced"),
    ("llama-3.1-405b", "tp=8,pp=8,vp=2,dp=4,schedule=zbv,recompute=full,zero=0"),
]


@pytest.fixture(scope="module")
def jobs():
    """One profile per model (the slow part), every layout planned from it with the same library call `plan` makes."""
    made = {}
    for name, (factory, options, devices, batch) in MODELS.items():
        made[name] = prepare_plan(
            PlanOptions(
                model=factory,
                assignments=[f"{key}={value}" for key, value in options.items()],
                device="meta",
                hardware="h100",
                devices=str(devices),
                global_batch_size=batch,
                overlap="all",
                output=None,
                json_output=True,
            )
        )
    return made


def _blocks(stage: dict, num_layers: int) -> int:
    """Transformer blocks in a stage: its layers less the embedding (layer 0) and the head (the last layer)."""
    first, last = stage["first_layer"], stage["last_layer"]
    return last - first + 1 - (first == 0) - (last == num_layers - 1)


def _even_blocks(total: int, stages: int) -> list[int]:
    """Megatron's equal runs; a remainder goes one block each to the first stages."""
    return [total // stages + (s < total % stages) for s in range(stages)]


@pytest.mark.parametrize(("model", "text"), GRID, ids=[f"{m}:{t}" for m, t in GRID])
def test_a_pinned_layout_plans_writes_shows_and_exports_as_pinned(jobs, model, text, tmp_path):
    job = jobs[model]
    pinned = parse_layout(text)
    chosen = plan_layouts(job.source, job.cluster, replace(job.config, layout=pinned))
    write_plan(chosen, tmp_path, job.source.profile)
    written = json.loads((tmp_path / "plan.json").read_text())
    training, stages = written["training"], written["stages"]
    dims = ("tensor_parallel", "context_parallel", "expert_parallel", "data_parallel", "microbatch_size", "zero")
    assert [training[key] for key in dims] == [pinned.tp, pinned.cp, pinned.ep, pinned.dp, pinned.mbs, pinned.zero]
    assert written["schedule"] == pinned.schedule_name and written["chunks"] == pinned.vp
    assert len(stages) == pinned.pp * pinned.vp and len(written["ranks"]) == pinned.pp * pinned.dp
    modes = pinned.recompute * len(stages) if len(pinned.recompute) == 1 else list(pinned.recompute)
    assert [s["recompute"] for s in stages] == list(modes)
    num_layers = len(job.source.profile.layers)
    blocks = [_blocks(s, num_layers) for s in stages]
    assert (
        sum(blocks) == num_layers - 2 and stages[0]["first_layer"] == 0 and stages[-1]["last_layer"] == num_layers - 1
    )
    if pinned.blocks is not None:
        assert blocks == list(pinned.blocks)
    elif pinned.split == "even":
        assert blocks == _even_blocks(num_layers - 2, len(stages))
    assert training["global_batch_size"] == pinned.mbs * pinned.dp * training["num_microbatches"]
    # show re-predicts the step and each device's peak from plan.json alone
    loaded = Plan.load(tmp_path / "plan.json")
    again = plan_prediction(loaded)
    assert again.step_ms == pytest.approx(written["predicted"]["step_ms"], rel=1e-9)
    peaks = written["predicted"]["peak_memory_bytes"][: len(again.device_memory_bytes)]
    assert peaks == pytest.approx(list(again.device_memory_bytes), rel=1e-9)
    shown = runner.invoke(app, ["show", str(tmp_path / "plan.json"), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["predicted"]["step_ms"] == pytest.approx(written["predicted"]["step_ms"], rel=1e-9)
    for fmt in EXPORTS:
        result = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "--format", fmt, "-o", str(tmp_path / fmt)])
        if result.exit_code != 0:
            one_error_line(result)  # a refusal: one line, no traceback
            assert "pipeplan bug" not in result.output


def test_replication_does_not_change_a_pinned_plan(jobs):
    """A pinned layout is planned alone: the search's replication switch (`--parallel replicate=`) leaves it as is."""
    job = jobs["gpt3-175b"]
    pinned = parse_layout("tp=8,pp=4,dp=4,recompute=selective,zero=1")
    plans = []
    for replication in (True, False):
        config = replace(job.config, layout=pinned, search=replace(job.config.search, replication=replication))
        plans.append(plan_layouts(job.source, job.cluster, config))
    assert plans[0].to_dict() == plans[1].to_dict()
    assert all(stage.replicas == 1 for stage in plans[0].stages)


# the production layouts through the CLI, at trimmed depth: each plans (or is refused in one line)
CLI_GPT3 = ["gpt", *[part for k, v in GPT3.items() for part in ("-a", f"{k}={v}")], "--devices", "128", "-B", "256"]
CLI_L70 = ["llama", *[p for k, v in MODELS["llama-2-70b"][1].items() for p in ("-a", f"{k}={v}")], "--devices", "64"]


@pytest.mark.parametrize(
    ("args", "layout", "extra"),
    [
        (CLI_GPT3, "tp=4,pp=8,vp=4,dp=4,mbs=1,recompute=none,zero=1", []),
        (CLI_L70 + ["-B", "128"], "tp=4,cp=2,pp=4,vp=4,dp=2", ["--parallel", "replicate=off"]),
        (CLI_L70 + ["-B", "128"], "tp=8,pp=4,dp=2,split=balanced,recompute=full", ["-b", "2", "--memory", "zero=1"]),
    ],
)
def test_production_layouts_plan_from_the_cli(args, layout, extra, tmp_path):
    base = ["plan", *args, "--device", "meta", "--hardware", "h100", "--precision", "bf16-main", "--overlap", "all"]
    result = runner.invoke(app, [*base, *extra, "--layout", layout, "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert ("ignored: --layout plans exactly its layout" in result.output) == bool(extra)
    written = json.loads((tmp_path / "plan.json").read_text())
    pinned = parse_layout(layout)
    assert written["training"]["microbatch_size"] == pinned.mbs and written["training"]["zero"] == pinned.zero
    assert [s["recompute"] for s in written["stages"]] == list(pinned.recompute) * len(written["stages"])
    assert written["rationale"].startswith(f"Layout pinned by --layout ({pinned.label}); the search's own choice")
    assert "no plan without it fits" not in written["rationale"]


def test_a_layout_that_cannot_plan_is_one_line_naming_the_key(tmp_path):
    base = ["plan", *CLI_L70, "-B", "128", "--device", "meta", "--hardware", "h100", "--json", "-o", str(tmp_path)]
    for layout, key in [
        ("tp=8,pp=4,dp=2,schedule=interleaved", "give vp=2"),
        ("tp=8,pp=4,dp=2,schedule=pipedream,zero=1", "give zero=0"),
        ("tp=8,pp=4,dp=2,schedule=pipedream-2bw,recompute=full", "give recompute=none"),
        ("tp=8,pp=4,dp=2,ep=2", "--layout ep=2"),
        ("tp=8,pp=4,vp=8,dp=2", "--layout pp x vp = 32 stages"),
        ("tp=1,pp=1,dp=64", "out of memory on pipeline device 0"),
    ]:
        line = one_error_line(runner.invoke(app, [*base, "--layout", layout]))
        assert key in line and "pipeplan bug" not in line
    assert not (tmp_path / "plan.json").exists()
