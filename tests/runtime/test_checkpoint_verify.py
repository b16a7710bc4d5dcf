"""Tampered checkpoints and edited plans are refused before any rank starts (issue 38, Deliver 2): a stage file of
another step, a changed step field, a removed parameter, emptied or misshapen Adam state, an fp32 checkpoint under a
bf16 plan, an empty checkpoint directory; plan.json whose "schedule" or "chunks" no longer describe its op lists.
One 2-rank launch writes the checkpoint; every refusal below happens in the launcher (a launch would fail the test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.runtime import TINY_GPT, make_plan
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.cli import app
from pipeplan.errors import FormatError, RunError
from pipeplan.runtime.launch import local
from pipeplan.runtime.launch.local import launch_local
from pipeplan.runtime.train.config import RunConfig

STEP = "step_00000002"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify")
    path, _ = make_plan(folder, "fp32", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2)
    bf16, _ = make_plan(folder, "bf16", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2, precision="bf16")
    ckpt = folder / "ckpt"
    config = RunConfig(steps=2, checkpoint_dir=str(ckpt), checkpoint_every=1, quiet=True, heartbeat_timeout_s=60.0)
    launch_local(path, config, threads=1)
    return {"plan": path, "bf16": bf16, "ckpt": ckpt}


def _edit_stage(stage: int, edit):
    def apply(folder: Path) -> None:
        path = folder / STEP / f"stage_{stage:03d}.pt"
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)

    return apply


def _first(mapping: dict) -> str:
    return sorted(mapping)[0]


TAMPERED = {
    "stage file of another step": (
        lambda d: shutil.copy(d / "step_00000001" / "stage_001.pt", d / STEP / "stage_001.pt"),
        "holds stage 1 of step 1, not stage 1 of step 2",
    ),
    "changed step field": (_edit_stage(0, lambda s: s.update(step=3)), "holds stage 0 of step 3"),
    "removed parameter": (_edit_stage(0, lambda s: s["params"].pop(_first(s["params"]))), "lacks parameter"),
    "emptied Adam state": (
        _edit_stage(1, lambda s: s.update(optimizer={name: {} for name in s["optimizer"]})),
        "holds no optimizer state for",
    ),
    "misshapen Adam state": (
        _edit_stage(1, lambda s: s["optimizer"][_first(s["optimizer"])].update(exp_avg=torch.zeros(3))),
        "optimizer state 'exp_avg' is \\(3,\\)",
    ),
    "Adam state of another optimizer": (
        _edit_stage(1, lambda s: s.update(optimizer={n: {"momentum_buffer": p} for n, p in s["params"].items()})),
        "this run's optimizer keeps",
    ),
    "parameter of another shape": (
        _edit_stage(0, lambda s: s["params"].update({_first(s["params"]): torch.zeros(2, 2)})),
        "the model's is",
    ),
    "stage file missing": (lambda d: (d / STEP / "stage_001.pt").unlink(), "holds 1 stage file"),
    "empty directory": (lambda d: [shutil.rmtree(d), d.mkdir()], "no complete checkpoint"),
}


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started; the check belongs before the launch")

    monkeypatch.setattr(local, "elastic_launch", refuse)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_checkpoints_are_refused_before_ranks_start(written, tmp_path, no_launch, case):
    edit, message = TAMPERED[case]
    copy = tmp_path / "ckpt"
    shutil.copytree(written["ckpt"], copy)
    edit(copy)
    config = RunConfig(steps=3, checkpoint_dir=str(copy), resume=True, quiet=True)
    with pytest.raises(RunError, match=message):
        launch_local(written["plan"], config, threads=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_fp32_checkpoint_under_a_bf16_plan_is_refused(written, tmp_path, no_launch):
    config = RunConfig(steps=3, checkpoint_dir=str(written["ckpt"]), resume=True, quiet=True)
    with pytest.raises(RunError, match="in torch.float32 but this run keeps parameters in torch.bfloat16"):
        launch_local(written["bf16"], config, threads=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cli_says_it_in_one_line(written, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(written["ckpt"], copy)
    TAMPERED["changed step field"][0](copy)
    argv = ["run", written["plan"], "--steps", "3", "--checkpoint-dir", str(copy), "--resume"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1 and result.output.count("error:") == 1, result.output
    assert "Traceback" not in result.output


EDITS = [
    ({"schedule": "dualpipev"}, "cannot run 1 chunk"),
    ({"chunks": 2}, "cannot run 2 chunk"),
    ({"schedule": "gpipe"}, "not schedule gpipe's"),
    ({"schedule": "zb-h1"}, "not schedule zb-h1's"),
    ({"schedule": "pipedream-2bw"}, "not schedule pipedream-2bw's"),
    ({"schedule": "interleaved", "chunks": 2}, "has 4 stages, but the plan has 2"),
]


@pytest.mark.parametrize(("edit", "message"), EDITS, ids=[json.dumps(e) for e, _ in EDITS])
def test_edited_schedule_or_chunks_are_refused(tmp_path, edit, message):
    path, plan = make_plan(tmp_path, "p", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2)
    data = {**plan.to_dict(), **edit}
    with pytest.raises(FormatError, match=message):
        Plan.from_dict(data)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    for argv in (["show", str(edited)], ["run", str(edited), "--steps", "1"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 1 and result.output.count("error:") == 1, result.output


def test_other_schedules_load_as_generated(tmp_path):
    """Every fixed-order and cost-driven schedule's own plan passes the check (and a pair split into halves)."""
    for schedule in ("gpipe", "interleaved", "zb-h2", "zb-auto", "zbv", "dualpipev", "pipedream"):
        _, plan = make_plan(
            tmp_path, schedule, "mlp", {"layers": 8, "hidden": 8}, schedule=schedule, pipeline_devices=2
        )
        Plan.from_dict(plan.to_dict())


def test_a_full_disk_while_checkpointing_is_said_as_one(tmp_path, monkeypatch):
    """torch.save on a full disk raises `RuntimeError: [enforce fail at inline_container.cc] . unexpected pos`:
    the rank's line said `RuntimeError:` and nothing after it."""
    from pipeplan.errors import OutputError
    from pipeplan.runtime.launch.worker import _short
    from pipeplan.runtime.weights import checkpoint

    def full(state, path):
        with open(path, "wb") as handle:
            handle.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 0))
    param = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(OutputError, match="No space left on device \\(0 bytes free, the stage needs"):
        checkpoint.save_stage(
            tmp_path,
            step=1,
            stage=0,
            names=("w",),
            params={"w": param},
            buffers={},
            optimizer_states={},
            fingerprint="f",
            partition="p",
            num_stages=1,
        )
    assert not list(tmp_path.rglob("*.tmp"))  # the partial file is gone
    assert (
        _short("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") == "unexpected pos 576 vs 534"
    )


def test_export_weights_blames_a_missing_plan_not_the_checkpoint(tmp_path):
    (tmp_path / "ckpt" / STEP).mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text(STEP + "\n")
    argv = ["export-weights", str(tmp_path / "ckpt"), "-o", str(tmp_path / "w.safetensors"), "--plan", "missing.json"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1 and "--plan 'missing.json' does not exist" in result.output, result.output


def test_the_log_folder_is_made_like_every_outputs(tmp_path):
    from pipeplan.runtime.train.metrics import MetricsLog

    log = MetricsLog(str(tmp_path / "a" / "b" / "train.jsonl"), None, start=0)
    log.close()
    assert (tmp_path / "a" / "b" / "train.jsonl").is_file()
