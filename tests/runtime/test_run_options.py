"""`pipeplan run` and the per-rank worker (what launch.sh and job.sbatch start) parse the same option definitions
(RunOptions, whose flags are RunConfig's fields): the same arguments give the same RunConfig and threads, and every
flag reaches the config the ranks get."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

import pipeplan.runtime.launch.local as launch
from pipeplan.cli import app
from pipeplan.errors import ConfigError
from pipeplan.runtime.launch import worker
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.metrics import tensorboard_available


def _through_run(monkeypatch, argv: list[str]):
    captured = {}

    def fake_launch(plan, config, threads=None):
        captured.update(plan=str(plan), config=config, threads=threads)
        return [SimpleNamespace(first_step=0, losses=[1.0])]

    monkeypatch.setattr(launch, "launch_local", fake_launch)
    result = CliRunner().invoke(app, ["run", *argv])
    assert result.exit_code == 0, result.output
    return captured["plan"], captured["config"], captured["threads"]


def _argvs(tmp_path) -> list[list[str]]:
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"")
    every = [
        "plan.json",
        "--steps",
        "3",
        "--trace",
        str(tmp_path / "t.json"),
        "--trace-steps",
        "4",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--checkpoint-every",
        "2",
        "--lr",
        "0.01",
        "--weight-decay",
        "0.1",
        "--heartbeat-timeout",
        "9",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--threads",
        "2",
        "--check-every",
        "4",
        "--quiet",
        "--clip-grad-norm",
        "1.5",
        "--post-validate",
        "--overlap-pairs",
        "off",
        "--optimizer",
        "sgd",
        "--momentum",
        "0.5",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "1",
        "--decay-steps",
        "8",
        "--seed",
        "5",
        "--log",
        str(tmp_path / "log.jsonl"),
        *(["--tensorboard", str(tmp_path / "tb")] if tensorboard_available() else []),
    ]
    resumed = ["plan.json", "--checkpoint-dir", str(tmp_path / "ck"), "--resume"]
    initialized = ["plan.json", "--init-from", str(weights)]
    return [every, resumed, initialized]


def test_run_and_worker_parse_every_option_alike(tmp_path, monkeypatch):
    argvs = _argvs(tmp_path)
    flags = {arg for argv in argvs for arg in argv if arg.startswith("--")}
    run = typer.main.get_command(app).commands["run"]
    declared = {flag for parameter in run.params for flag in parameter.opts if flag.startswith("--")}
    if not tensorboard_available():  # --tensorboard is refused without it (test_tensorboard_without_the_package)
        declared.discard("--tensorboard")
    assert flags == declared  # the arguments below exercise every run option
    for argv in argvs:
        assert _through_run(monkeypatch, argv) == worker.parse_args(argv)


def test_every_flag_reaches_the_ranks_config(tmp_path):
    """Each flag but --threads (a process setting) changes a field of the RunConfig every rank gets."""
    every = _argvs(tmp_path)[0]
    _, config, threads = worker.parse_args(every)
    assert isinstance(config, RunConfig) and threads == 2
    default = RunConfig()
    changed = {f.name for f in dataclasses.fields(RunConfig) if getattr(config, f.name) != getattr(default, f.name)}
    assert changed == {
        "steps",
        "trace_path",
        "trace_steps",
        "checkpoint_dir",
        "checkpoint_every",
        "lr",
        "weight_decay",
        "heartbeat_timeout_s",
        "device",
        "precision",
        "check_every",
        "quiet",
        "clip_grad_norm",
        "post_validate",
        "overlap_pairs",
        "optimizer",
        "momentum",
        "lr_schedule",
        "warmup_steps",
        "decay_steps",
        "seed",
        "log_path",
        *(["tensorboard_dir"] if tensorboard_available() else []),
    }
    resumed = worker.parse_args(_argvs(tmp_path)[1])[1]
    assert resumed.resume and resumed.checkpoint_dir == str(tmp_path / "ck")
    initialized = worker.parse_args(_argvs(tmp_path)[2])[1]
    assert initialized.init_from == str((tmp_path / "w.pt").resolve())


def test_worker_refuses_what_run_refuses(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        worker.main(["plan.json", "--steps", "0"])
    assert stopped.value.code == 2
    with pytest.raises(SystemExit) as stopped:
        worker.main(["plan.json", "--no-such-option"])
    assert stopped.value.code == 2


@pytest.mark.skipif(tensorboard_available(), reason="tensorboard is installed here")
def test_tensorboard_without_the_package_is_refused_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="--tensorboard needs the tensorboard package"):
        RunConfig(tensorboard_dir=str(tmp_path / "tb"))
