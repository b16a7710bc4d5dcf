"""Runs that must stop, refuse or repeat exactly: a non-finite loss stops every rank at that step with nothing saved;
resume needs the same partition; launch scripts run side by side from any environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from rt_helpers import make_plan

from pipeplan.errors import RunError
from pipeplan.runtime import checkpoint
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.launch import launch_local

pytestmark = pytest.mark.timeout(240)
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
    from pipeplan.planner.build import plan_timeline, timeline_rows
    from pipeplan.planner.scripts import write_plan_dir

    _, plan = make_plan(tmp_path, "p", "mlp", {"layers": 2, "hidden": 8}, schedule="1f1b", pipeline_devices=2)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for folder in dirs:
        write_plan_dir(plan, timeline_rows(plan, plan_timeline(plan)), folder)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "VIRTUAL_ENV")}
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1")
    runs = [
        subprocess.Popen(["bash", str(d / "launch.sh"), "--steps", "2", "--threads", "1", "--quiet"], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for d in dirs
    ]  # fmt: skip
    for run in runs:
        _, stderr = run.communicate(timeout=200)
        assert run.returncode == 0, stderr[-2000:]
