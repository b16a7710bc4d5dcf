"""A new user's model file, end to end: a factory or build() that raises and a wrongly shaped sample_batch are one
line each; options are checked before profiling; plan.json records the model file's absolute path and hash (run
refuses an edited file); a model file imports a module beside it; launch.sh runs from the plan's directory with
--init-from, and job.sbatch finds its plan when submitted from elsewhere."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import one_error_line
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.cli import app
from pipeplan.search import plan_job

runner = CliRunner()
pytestmark = pytest.mark.timeout(300)

MODEL = """
import torch
from torch import nn
from pipeplan.models.spec import ModelSpec
from helper_layers import Scale  # a module beside this file

class Net(nn.Module):
    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), Scale(hidden)) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

def build(layers: int = 4, hidden: int = 8, fail: str = "", pairs: bool = False):
    if fail == "factory":
        raise RuntimeError("no GPU budget for this model")

    def make():
        if fail == "build":
            raise KeyError("vocab_size")
        return Net(layers, hidden)

    def sample_batch(batch_size, generator=None):
        x = torch.randn(batch_size, hidden, generator=generator)
        y = torch.randn(batch_size, hidden, generator=generator)
        return (x, y) if pairs else ((x,), y)

    return ModelSpec(name="user-net", build=make, sample_batch=sample_batch, loss_fn=nn.functional.mse_loss)
"""
HELPER = """
import torch
from torch import nn

class Scale(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.gain = nn.Parameter(torch.full((hidden,), 0.5))

    def forward(self, x):
        return x * self.gain
"""


@pytest.fixture
def model_file(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "helper_layers.py").write_text(HELPER)
    (folder / "net.py").write_text(MODEL)
    return folder / "net.py"


def test_factory_and_build_errors_are_one_line(model_file):
    ref = f"{model_file}:build"
    line = one_error_line(runner.invoke(app, ["profile", ref, "-a", "fail=factory"]))
    assert f"your factory {ref!r} raised RuntimeError: no GPU budget for this model at {model_file}:" in line
    line = one_error_line(runner.invoke(app, ["profile", ref, "-a", "fail=build"]))
    assert "(its ModelSpec.build) raised KeyError" in line and "vocab_size" in line


def test_wrong_sample_batch_structure_is_one_line(model_file):
    line = one_error_line(runner.invoke(app, ["profile", f"{model_file}:build", "-a", "pairs=true"]))
    assert "sample_batch returned (Tensor, Tensor)" in line and "((inputs, ...), target)" in line


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--schedule", "zbx"], "unknown --schedule 'zbx'"),
        (["--precision", "fp7"], "--precision 'fp7': 'fp7' is not a precision mode"),
        (["--granularity", "0"], "--granularity must be >= 1"),
    ],
)
def test_plan_options_fail_before_profiling(monkeypatch, tmp_path, option, message):
    def no_profiling(*_args, **_kwargs):
        raise AssertionError("profiled before checking the options")

    monkeypatch.setattr(plan_job, "profile_model_input", no_profiling)
    line = one_error_line(runner.invoke(app, ["plan", "gpt", "--devices", "2", *option, "-o", str(tmp_path)]))
    assert message in line


def test_output_that_is_a_file_fails_before_profiling(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_job, "profile_model_input", None)  # calling it would be a TypeError traceback
    (tmp_path / "taken").write_text("x")
    line = one_error_line(runner.invoke(app, ["plan", "gpt", "--devices", "2", "-o", str(tmp_path / "taken")]))
    assert "--output" in line and "is a file" in line


def test_run_init_from_a_missing_file_is_one_line(tmp_path):
    from pipeplan.artifact.manual import manual_plan

    plan = manual_plan("mlp", {"layers": 2, "hidden": 8}, schedule="1f1b", pipeline_devices=2, num_microbatches=2)
    plan.save(tmp_path / "plan.json")
    line = one_error_line(runner.invoke(app, ["run", str(tmp_path / "plan.json"), "--init-from", "nope.pt"]))
    assert "--init-from 'nope.pt' does not exist" in line


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _plan_model(model_file: Path, out: Path) -> Plan:
    args = [
        "plan",
        f"{model_file.name}:build",
        "--devices",
        "2",
        "--parallel",
        "pp=2",
        "-B",
        "4",
        "-s",
        "1f1b",
        "-o",
        str(out),
    ]
    cwd = os.getcwd()
    os.chdir(model_file.parent)  # a relative reference, as a user types it
    try:
        result = runner.invoke(app, args)
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    return Plan.load(out / "plan.json")


@pytest.mark.slow
def test_plan_is_relocatable_and_refuses_an_edited_model_file(model_file, tmp_path):
    plan = _plan_model(model_file, tmp_path / "plan")
    assert plan.model.ref == f"{model_file.resolve()}:build"
    assert len(plan.model.file_sha256) == 64
    # launch.sh from inside the plan directory: every rank finds the model (and its sibling import) by path
    weights = tmp_path / "w.pt"
    torch.save({k: torch.full_like(v, 0.1) for k, v in _state(plan).items()}, weights)
    env = {
        **os.environ,
        "MASTER_PORT": str(_free_port()),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "launch.sh", "--steps", "2", "--threads", "1", "--init-from", str(weights)],
        cwd=tmp_path / "plan",
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step     2" in done.stdout
    model_file.write_text(model_file.read_text() + "\n# edited\n")
    line = one_error_line(runner.invoke(app, ["run", str(tmp_path / "plan" / "plan.json"), "--steps", "1"]))
    assert "changed since the plan was made" in line


def _state(plan: Plan) -> dict[str, torch.Tensor]:
    from helpers.runtime import build_reference_model

    return build_reference_model(plan)[1].state_dict()


def test_sbatch_finds_its_plan_when_submitted_from_elsewhere(tmp_path):
    plan_dir, elsewhere, stubs = tmp_path / "plan", tmp_path / "elsewhere", tmp_path / "bin"
    for folder in (plan_dir, elsewhere, stubs):
        folder.mkdir()
    from pipeplan.artifact.manual import manual_plan
    from pipeplan.artifact.scripts import sbatch_script

    plan = manual_plan("mlp", {"layers": 2, "hidden": 8}, schedule="1f1b", pipeline_devices=2, num_microbatches=2)
    plan.save(plan_dir / "plan.json")
    (plan_dir / "job.sbatch").write_text(sbatch_script(plan))
    spool = tmp_path / "spool-copy.sbatch"  # SLURM runs a copy of the script, not the submitted file
    spool.write_text(sbatch_script(plan))
    record = tmp_path / "torchrun-args"
    _stub(
        stubs / "scontrol",
        f'[ "$1 $2" = "show job" ] && echo "   Command={plan_dir}/job.sbatch"; '
        '[ "$2" = "hostnames" ] && echo node0; true',
    )
    _stub(stubs / "srun", 'exec "$@"')
    _stub(stubs / "python", f'echo "$@" > {record}')
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "1",
        "PIPEPLAN_PYTHON": str(stubs / "python"),
        "SLURM_JOB_NODELIST": "node0",
        "SLURM_SUBMIT_DIR": str(elsewhere),
    }
    env.pop("PLAN", None)
    done = subprocess.run(
        ["bash", str(spool), "--steps", "3", "--init-from", "w.pt"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"-m pipeplan.runtime.launch.worker {plan_dir}/plan.json --steps 3 --init-from w.pt" in record.read_text()


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
