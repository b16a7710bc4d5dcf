"""Device choice for `pipeplan run`: the plan's device by default, --device to override, and a CPU plan stays on the
CPU where CUDA is visible (the suite must pass on a 1-GPU machine). CUDA is faked where the test needs it."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.errors import ConfigError, RunError
from pipeplan.plan.manual import manual_plan
from pipeplan.plan.plan import Plan, run_device_for
from pipeplan.runtime.launch import local as launch
from pipeplan.runtime.launch import worker
from pipeplan.runtime.train.config import RunConfig

TINY = dict(layers=2, hidden=16, heads=2, seq=8, vocab=32)


@pytest.fixture()
def fake_cuda(monkeypatch):
    """Make one GPU look present (nothing may actually use it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture()
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _plan(device: str = "cpu") -> Plan:
    plan = manual_plan("gpt", TINY, schedule="1f1b", pipeline_devices=2, num_microbatches=2, microbatch_size=1)
    data = plan.to_dict()
    data["training"]["device"] = device
    return Plan.from_dict(data)


def test_profile_device_decides_the_plan_device():
    assert run_device_for("cpu") == "cpu"
    assert run_device_for("cuda:NVIDIA H100 80GB HBM3") == "cuda"
    assert run_device_for("meta") == "cuda"  # analytic profiles describe a GPU preset


def test_a_cpu_plan_stays_on_the_cpu_when_cuda_is_visible(fake_cuda):
    assert RunConfig().run_device(_plan().training.device) == "cpu"
    assert worker._device("cpu") == ("gloo", torch.device("cpu"))


def test_plan_device_round_trips(tmp_path):
    path = tmp_path / "plan.json"
    _plan("cuda").save(path)
    assert Plan.load(path).training.device == "cuda"


def test_a_gpu_plan_on_a_cpu_machine_names_the_override(no_cuda):
    with pytest.raises(ConfigError, match="--device cpu"):
        RunConfig().run_device("cuda")
    assert RunConfig(device="cpu").run_device("cuda") == "cpu"
    with pytest.raises(ConfigError, match="CUDA is not available"):
        RunConfig(device="cuda").run_device("cpu")


def test_more_ranks_than_gpus_is_refused_before_starting(fake_cuda, tmp_path):
    path = tmp_path / "plan.json"
    _plan("cuda").save(path)
    with pytest.raises(RunError, match="--device cpu"):
        launch.launch_local(path, RunConfig())


def test_a_rank_without_its_gpu_is_one_line(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RunError, match="no GPU"):
        worker._device("cuda")


def test_bad_device_is_one_line(tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    result = CliRunner().invoke(app, ["run", str(path), "--device", "tpu"])
    assert result.exit_code == 1 and "--device must be cpu or cuda" in result.output


def test_worker_flag_parses():
    _, config, _ = worker.parse_args(["plan.json", "--device", "cpu"])
    assert config.device == "cpu"
