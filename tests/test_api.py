"""The Python API (pipeplan.api): each function on a tiny model, against what the CLI computes for the same
options; the README's example is examples/api_example.py verbatim and runs (the run on 2 gloo ranks: slow)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import pipeplan
from pipeplan.cli import app
from pipeplan.errors import ConfigError, RunError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "api_example.py"
TINY = {"layers": 2, "hidden": 8}


def test_import_names_the_api_without_importing_torch():
    code = (
        "import sys, pipeplan; assert 'torch' not in sys.modules and 'numpy' not in sys.modules; "
        "print(sorted(pipeplan.__all__)); print(callable(pipeplan.plan), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == str(sorted(pipeplan.__all__))
    assert out[1] == "True False"
    for name in pipeplan.__all__:
        assert getattr(pipeplan, name) is not None, name
    assert pipeplan.Plan.__module__ == "pipeplan.artifact.plan" and pipeplan.artifact.plan.Plan is pipeplan.Plan


def test_profile_plan_save_load_equal_the_cli(tmp_path):
    profile = pipeplan.profile("mlp", assignments=TINY, batch_size=2, repeats=1, warmup=1)
    assert len(profile.layers) >= 2 and profile.provenance.batch_size == 2
    profile.save(tmp_path / "p.json")
    options = dict(devices=2, global_batch_size=4, memory="4GiB", parallel="pp=2")
    chosen = pipeplan.plan("mlp", assignments=TINY, profile=profile, output=tmp_path / "api", **options)
    assert chosen.runnable and chosen.world_size == 2
    chosen.save(tmp_path / "saved.json")
    assert pipeplan.Plan.load(tmp_path / "saved.json") == chosen == pipeplan.Plan.load(tmp_path / "api" / "plan.json")
    argv = ["plan", "mlp", "-a", "layers=2", "-a", "hidden=8", "--profile", str(tmp_path / "p.json"), "-n", "2"]
    argv += ["-B", "4", "--memory", "4GiB", "--parallel", "pp=2", "-o", str(tmp_path / "cli"), "--json"]
    assert CliRunner().invoke(app, argv).exit_code == 0
    cli_plan = pipeplan.Plan.load(tmp_path / "cli" / "plan.json")
    assert cli_plan.stages == chosen.stages and cli_plan.rank_ops == chosen.rank_ops
    assert cli_plan.predicted == chosen.predicted
    assert pipeplan.plan("mlp", assignments=TINY, profile=tmp_path / "p.json", **options).stages == chosen.stages


def test_simulate_is_what_the_cli_prints():
    for kwargs, argv in (
        (dict(schedule="zb-h1", stages=4, microbatches=8, w=0.5), ["-s", "zb-h1", "-p", "4", "-m", "8", "--w", "0.5"]),
        (dict(compare=True, stages=4, microbatches=8), ["--compare", "-p", "4", "-m", "8"]),
    ):
        result = CliRunner().invoke(app, ["simulate", *argv, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(json.dumps(pipeplan.simulate(**kwargs).to_dict())) == json.loads(result.output)


def test_module_objects_plan_here_and_are_refused_by_run(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    batch = ((torch.randn(3, 4),), torch.randn(3, 2))
    profile = pipeplan.profile(module, example_batch=batch, loss_fn=torch.nn.functional.mse_loss, batch_size=2)
    assert profile.provenance.batch_size == 2 and len(profile.layers) >= 2
    chosen = pipeplan.plan(
        module,
        example_batch=batch,
        loss_fn=torch.nn.functional.mse_loss,
        devices=2,
        global_batch_size=4,
        memory="4GiB",
    )
    assert chosen.model.ref == "object:Sequential"
    with pytest.raises(RunError, match="object of this process"):
        pipeplan.run(chosen, steps=1)


def test_errors_are_one_line_pipeplan_errors():
    with pytest.raises(ConfigError, match="unknown option.*nosuch"):
        pipeplan.simulate(schedule="1f1b", stages=2, microbatches=2, nosuch=1)
    with pytest.raises(ConfigError, match="example_batch"):
        pipeplan.profile(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="--global-batch-size"):
        pipeplan.plan("mlp", assignments=TINY, devices=2, global_batch_size=3, microbatch_size="2")


WRONG_TYPES = [  # (function, keyword arguments, the keyword the one line names)
    ("plan", dict(devices=2.5), "devices=2.5"),
    ("plan", dict(global_batch_size="x"), "global_batch_size='x'"),
    ("plan", dict(global_batch_size=True), "global_batch_size=True"),
    ("plan", dict(assignments=[1, 2]), "assignments=[1, 2]"),
    ("plan", dict(profile=3), "profile="),
    ("plan", dict(device=["cpu", 1.5]), "device="),
    ("simulate", dict(schedule="1f1b", stages="4", microbatches=8), "stages='4'"),
    ("simulate", dict(schedule="1f1b", stages=4, microbatches=8.5), "microbatches=8.5"),
    ("profile", dict(batch_size="two"), "batch_size='two'"),
]


@pytest.mark.parametrize(("function", "kwargs", "named"), WRONG_TYPES)
def test_wrong_argument_types_are_one_line_naming_the_keyword(function, kwargs, named):
    """The API's argument types checked before the options' own checks (issue 38: no TypeError from inside)."""
    args = () if function == "simulate" else ("mlp",)
    with pytest.raises(ConfigError) as caught:
        getattr(pipeplan, function)(*args, **kwargs)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_lists_and_counts_are_taken_as_the_cli_writes_them():
    """A comma-list option takes a list, a text option a whole number: the same plan as the CLI's spelling."""
    measured = pipeplan.profile("mlp", assignments=TINY)  # once: both plans read the same costs
    listed = pipeplan.plan(profile=measured, devices=2, global_batch_size=4, schedule=["1f1b", "zb-h1"])
    written = pipeplan.plan(profile=measured, devices="2", global_batch_size=4, schedule="1f1b,zb-h1")
    assert listed.schedule == written.schedule and listed.predicted.step_ms == written.predicted.step_ms


def test_readme_shows_the_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert EXAMPLE.read_text() in blocks


@pytest.mark.slow
def test_the_example_runs_the_chain_on_two_gloo_ranks(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    losses = re.search(r"losses: \[(.*)\]", done.stdout)
    assert losses is not None, done.stdout
    values = [float(x) for x in losses.group(1).split(",")]
    assert len(values) == 2 and all(v == v and v > 0 for v in values)
    assert pipeplan.Plan.load(tmp_path / "out" / "plan.json").world_size == 2
