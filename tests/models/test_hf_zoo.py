"""Every dense `hf:` type the adapter lists (pipeplan.models.hf_types.DENSE; its MoE types run in
tests/runtime/test_moe_run.py) goes profile -> plan -> a 2-rank run from a tiny config, and the run's loss and
gradients equal a single process's. The profiles and plans are made through the CLI in this process; one 2-rank
launch runs every plan in sequence (start-up dominates)."""

from __future__ import annotations

import os

import pytest
from helpers.hf_zoo import cli_args, tiny_options
from helpers.runtime import assert_matches_reference
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.models.hf_types import DENSE
from pipeplan.plan.plan import Plan
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.train.config import RunConfig

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one multi-process launch for all types
os.environ["HF_HUB_OFFLINE"] = "1"  # the ranks inherit it: nothing is ever downloaded
runner = CliRunner()


def _profile_and_plan(folder, model_type: str) -> str:
    args, profile, out = cli_args(tiny_options(model_type)), folder / f"{model_type}.json", folder / model_type
    result = runner.invoke(
        app, ["profile", f"hf:{model_type}", *args, "-b", "2", "--warmup", "0", "--repeats", "1", "-o", str(profile)]
    )
    assert result.exit_code == 0, f"profile hf:{model_type}: {result.output}"
    plan = ["plan", f"hf:{model_type}", *args, "--profile", str(profile), "-n", "2", "-B", "4"]
    plan += ["--layout", "pp=2,dp=1,mbs=2"]  # two stages (the search may prefer replicating one on tiny models)
    result = runner.invoke(app, [*plan, "-o", str(out)])
    assert result.exit_code == 0, f"plan hf:{model_type}: {result.output}"
    return str(out / "plan.json")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-zoo")
    paths = {model_type: _profile_and_plan(folder, model_type) for model_type in DENSE}
    config = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=120.0)
    results = launch_many([(path, config) for path in paths.values()], capture_grads=True, threads=1)
    return {model_type: (index, Plan.load(path)) for index, (model_type, path) in enumerate(paths.items())}, results


@pytest.mark.parametrize("model_type", DENSE)
def test_each_listed_type_runs_exactly_on_two_ranks(zoo, model_type):
    cases, results = zoo
    index, plan = cases[model_type]
    assert plan.world_size == 2 and len(plan.stages) == 2 and plan.model.tracer == "export"
    assert_matches_reference(plan, [per_rank[index] for per_rank in results], f"hf:{model_type}")
