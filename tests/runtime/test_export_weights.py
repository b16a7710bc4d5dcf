"""`pipeplan export-weights`: a checkpoint of `pipeplan run` comes back as the whole model's state_dict. Round trips:
--init-from -> 2 steps of 1f1b on 2 stages (an embedding tied across them) -> export -> load_state_dict(strict) holds
the ranks' tensors bit for bit and a single-process AdamW run's; ZeRO-1 with 2 data-parallel pipelines likewise;
PipeDream-2BW (weight stashing) the ranks' tensors. A tiny Hugging Face GPT-2 exported as a sharded directory loads
with from_pretrained and its loss on the fixed batch is the loss the pipeline measured with those weights.
Incomplete, mixed or disagreeing checkpoints and outputs in the way are refused in one line. One 2-rank launch runs
the four trainings."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import one_error_line
from helpers.runtime import TINY_GPT, TINY_GPT_TIED, build_reference_model, make_plan, reference_training
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import checkpoint

safetensors = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # multi-process runs
os.environ["HF_HUB_OFFLINE"] = "1"

LR, STEPS = 3e-3, 2
BASE = RunConfig(steps=STEPS, quiet=True, lr=LR, heartbeat_timeout_s=60.0)
GPT2 = {"n_layer": "2", "n_embd": "32", "n_head": "2", "vocab_size": "96", "seq_len": "12"}
GPT2.update({"resid_pdrop": "0", "embd_pdrop": "0", "attn_pdrop": "0"})


def _init_file(folder: Path, plan) -> str:
    """Weights unlike the plan-seed build, the tied embedding saved once (as save_pretrained does)."""
    _, whole = build_reference_model(plan)
    state = {k: v.detach() + 0.25 if v.is_floating_point() else v.clone() for k, v in whole.state_dict().items()}
    state.pop("head.proj.weight", None)
    path = str(folder / "init.safetensors")
    safetensors.save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export-weights")
    cases, runs = {}, []
    _, tied = make_plan(folder, "tied", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    layouts = [
        (
            "tied",
            "gpt",
            TINY_GPT_TIED,
            dict(schedule="1f1b", pipeline_devices=2),
            {"init_from": _init_file(folder, tied)},
        ),
        ("zero1", "gpt", TINY_GPT, dict(schedule="1f1b", pipeline_devices=1, data_parallel=2, zero=1), {}),
        # checkpoints after steps 2 and 3: the loss of step 3 is measured with the weights of checkpoint 2
        ("async", "gpt", TINY_GPT, dict(schedule="pipedream-2bw", pipeline_devices=2), {}),  # weight stashing
        ("gpt2", "hf:gpt2", GPT2, dict(schedule="1f1b", pipeline_devices=2), {"steps": 3, "checkpoint_every": 2}),
    ]
    for label, model, options, layout, extra in layouts:
        path, plan = make_plan(folder, label, model, options, **layout)
        config = dataclasses.replace(BASE, checkpoint_dir=str(folder / f"ckpt-{label}"), **extra)
        cases[label] = (len(runs), plan, config)
        runs.append((path, config))
    results = launch_many(runs, threads=1)
    return {label: (plan, config, [r[index] for r in results]) for label, (index, plan, config) in cases.items()}


def _export(*args: str):
    return CliRunner().invoke(app, ["export-weights", *args])


@pytest.mark.parametrize("label", ["tied", "zero1", "async"])
def test_round_trip_holds_the_ranks_tensors_bit_for_bit(runs, tmp_path, label):
    plan, config, _ = runs[label]
    result = _export(config.checkpoint_dir, "-o", str(tmp_path / "model.safetensors"))
    assert result.exit_code == 0, result.output
    exported = safetensors.load_file(str(tmp_path / "model.safetensors"))
    _, model = build_reference_model(plan)
    assert sorted(exported) == sorted(model.state_dict())  # every key, tied names included
    model.load_state_dict(exported, strict=True)
    saved = checkpoint_params(config.checkpoint_dir)
    canonical: dict[int, str] = {}  # a tied parameter is saved under its first name
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param, saved[canonical.setdefault(id(param), name)]), name  # the ranks' tensors
    if label == "async":  # stale weights in the gradients: no single-process AdamW run to compare with
        return
    trained = reference_training(
        plan, STEPS, lr=LR, weight_decay=plan.training.weight_decay, init_from=config.init_from
    )
    for name, value in trained.module.state_dict().items():  # and what one process trains from the same start
        torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if config.init_from:
        assert not torch.equal(
            exported["head.proj.weight"], build_reference_model(plan)[1].state_dict()["embed.tok.weight"]
        )


def checkpoint_params(root: str) -> dict[str, torch.Tensor]:
    step = checkpoint.latest_step(root)
    found = {}
    for path in sorted(checkpoint.step_dir(root, step).glob("stage_*.pt")):
        found |= torch.load(path, weights_only=True)["params"]
    return found


def test_hf_gpt2_comes_back_with_from_pretrained(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    plan, config, per_rank = runs["gpt2"]
    target = tmp_path / "gpt2"
    result = _export(config.checkpoint_dir, "-o", str(target), "--step", "2", "--shard-gb", "0.00005")
    assert result.exit_code == 0, result.output
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as transformers writes large models
    loaded = AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True)
    spec, _ = build_reference_model(plan)
    inputs, target_ids = next(spec.batches(plan.training.global_batch_size, plan.training.seed))
    with torch.no_grad():
        loss = spec.loss_fn(loaded.eval()(*inputs), target_ids)
    measured = per_rank[-1].losses[2]  # step 3 ran on checkpoint 2's weights (the batch is fixed)
    assert abs(float(loss) - measured) < 1e-5 * abs(measured), (float(loss), measured)
    assert not torch.equal(loaded.lm_head.weight, build_reference_model(plan)[1].lm_head.weight)  # trained


def _copy(root: str, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    return copy


def test_incomplete_mixed_and_disagreeing_checkpoints_are_one_line(runs, tmp_path):
    root = _copy(runs["gpt2"][1].checkpoint_dir, tmp_path)
    shutil.copy(root / "step_00000003" / "stage_001.pt", root / "step_00000002" / "stage_001.pt")
    assert "mixes steps" in one_error_line(_export(str(root), "-o", str(tmp_path / "a.safetensors"), "--step", "2"))
    (root / "step_00000003" / "stage_001.pt").unlink()
    assert "not complete: it misses stage_001.pt" in one_error_line(_export(str(root), "-o", str(tmp_path / "b")))
    tied = _copy(runs["tied"][1].checkpoint_dir, tmp_path / "t")
    last = checkpoint.step_dir(tied, checkpoint.latest_step(tied)) / "stage_001.pt"
    state = torch.load(last, weights_only=True)
    state["params"]["embed.tok.weight"] = state["params"]["embed.tok.weight"] + 1
    torch.save(state, last)
    assert "hold different values" in one_error_line(_export(str(tied), "-o", str(tmp_path / "c.safetensors")))
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / "b").exists()  # nothing half-written


def test_outputs_in_the_way_are_refused_and_force_replaces_an_export(runs, tmp_path):
    root = runs["zero1"][1].checkpoint_dir
    (tmp_path / "w.safetensors").write_text("old")
    assert "add --force" in one_error_line(_export(root, "-o", str(tmp_path / "w.safetensors")))
    assert _export(root, "-o", str(tmp_path / "w.safetensors"), "--force").exit_code == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    assert "holds other files" in one_error_line(_export(root, "-o", str(tmp_path / "other"), "--force"))
    assert _export(root, "-o", str(tmp_path / "d")).exit_code == 0
    assert _export(root, "-o", str(tmp_path / "d"), "--force").exit_code == 0  # an earlier export is replaced
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]  # not an hf: model, so no config.json
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint" in one_error_line(_export(str(tmp_path / "empty"), "-o", str(tmp_path / "e")))
    assert "does not exist" in one_error_line(_export(str(tmp_path / "none"), "-o", str(tmp_path / "e")))
