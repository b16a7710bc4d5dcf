"""Runs that must stop, refuse or repeat exactly: a non-finite loss stops every rank at that step with nothing saved;
resume needs the same partition; launch scripts run side by side from any environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.runtime import TINY_GPT, make_plan

from pipeplan.errors import RunError
from pipeplan.runtime.launch.local import launch_local, launch_many
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # multi-process runs
POISONED = str(Path(__file__).with_name("toy_models.py")) + ":poisoned_mlp"


def test_non_finite_loss_stops_at_that_step_and_saves_nothing_of_it(tmp_path):
    path, _ = make_plan(tmp_path, "nan", POISONED, {"bad_step": 2}, schedule="1f1b", pipeline_devices=2)
    ckpt = tmp_path / "ckpt"
    config = RunConfig(steps=5, checkpoint_dir=str(ckpt), checkpoint_every=1, quiet=True, heartbeat_timeout_s=30.0)
    with pytest.raises(RunError, match=r"step 3: (loss is (nan|inf)|gradients are not finite); stopped before"):
        launch_local(path, config, threads=1)
    assert checkpoint.latest_step(ckpt) == 2


def test_resume_refuses_a_checkpoint_of_another_partition(tmp_path):
    """A 2-stage checkpoint cannot seed a 1-stage replicated plan of the same model: its other layers would restart
    from scratch while the log claims the continued step count."""
    options = {"layers": 4, "hidden": 16}
    two, _ = make_plan(tmp_path, "two", "mlp", options, schedule="1f1b", pipeline_devices=2)
    one, _ = make_plan(tmp_path, "one", "mlp", options, schedule="1f1b", pipeline_devices=1, replicas=(2,))
    ckpt = str(tmp_path / "ckpt")
    launch_local(two, RunConfig(steps=2, checkpoint_dir=ckpt, quiet=True), threads=1)
    with pytest.raises(RunError, match="holds 2 stage file"):
        launch_local(one, RunConfig(steps=4, checkpoint_dir=ckpt, resume=True, quiet=True), threads=1)


def test_two_launch_scripts_at_once_outside_the_venv(tmp_path):
    """launch.sh runs torch's launcher under the interpreter that planned (no torchrun on PATH needed) and picks its
    own free port, so two runs on one machine do not collide."""
    from pipeplan.plan.scripts import write_plan_dir
    from pipeplan.plan.timing import plan_timeline, timeline_rows

    _, plan = make_plan(tmp_path, "p", "mlp", {"layers": 2, "hidden": 8}, schedule="1f1b", pipeline_devices=2)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for folder in dirs:
        write_plan_dir(plan, timeline_rows(plan, plan_timeline(plan)), folder)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "VIRTUAL_ENV")}
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1")
    runs = [
        subprocess.Popen(
            ["bash", str(d / "launch.sh"), "--steps", "2", "--threads", "1", "--quiet"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in dirs
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=200)
        assert run.returncode == 0, stderr[-2000:]


def test_dropout_runs_repeat_and_resume_bit_exact(tmp_path):
    """Each forward draws from a seed of (plan seed, step, pipeline, stage, microbatch): two runs with dropout give
    the same losses, and 2 steps + checkpoint + resume to 4 give the uninterrupted run's losses and weights."""
    options = {**TINY_GPT, "dropout": 0.3}
    path, _ = make_plan(tmp_path, "drop", "gpt", options, schedule="zb-h1", pipeline_devices=2)
    ckpt_a, ckpt_b = tmp_path / "a", tmp_path / "b"
    straight = RunConfig(steps=4, checkpoint_dir=str(ckpt_a), quiet=True, check_every=0)
    again = RunConfig(steps=4, quiet=True, check_every=0)
    first_half = RunConfig(steps=2, checkpoint_dir=str(ckpt_b), quiet=True, check_every=0)
    resumed = RunConfig(steps=4, checkpoint_dir=str(ckpt_b), resume=True, quiet=True, check_every=0)
    results = [launch_many([(path, c)], threads=1) for c in (straight, again, first_half, resumed)]
    losses = [[r[0].losses for r in per_rank] for per_rank in results]
    assert losses[0][0] == losses[1][0] and len(losses[0][0]) == 4
    assert losses[2][0] + losses[3][0] == losses[0][0]
    assert len(set(losses[0][0])) == 4  # dropout is on and the weights move: no two steps alike
    for stage in range(2):
        a = torch.load(checkpoint.stage_file(ckpt_a, 4, stage), weights_only=True)["params"]
        b = torch.load(checkpoint.stage_file(ckpt_b, 4, stage), weights_only=True)["params"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
