"""launch.sh / job.sbatch: golden files (regenerate with UPDATE_GOLDEN=1), valid bash, and the plan directory."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.search import make_cluster, synthetic_profile

from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.scripts import launch_script, sbatch_script, write_plan_dir
from pipeplan.artifact.timing import plan_steps_timeline, plan_timeline, timeline_rows
from pipeplan.costs import numerics
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans

GOLDEN = Path(__file__).parent / "golden"


def _plan(devices: int, per_node: int, hardware: str) -> Plan:
    cluster = replace(make_cluster(devices, memory=100 * 2**20, devices_per_node=per_node), hardware=hardware)
    result = search_plans(
        synthetic_profile(),
        cluster,
        SearchConfig(global_batch_size=32, numerics=numerics("adamw", "bf16-mixed")),
        ["1f1b"],
    )
    return build_plan(result, model=ModelRef(ref="examples/my_model.py:build", options={"layers": "8"}))


PLANS = {"cpu-1node": (2, 2, "cpu"), "gpu-2nodes": (16, 8, "h100")}


@pytest.fixture(scope="module", params=sorted(PLANS))
def named_plan(request) -> tuple[str, Plan]:
    return request.param, _plan(*PLANS[request.param])


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed; if intended, regenerate with UPDATE_GOLDEN=1"


def test_launch_script_golden(named_plan):
    name, plan = named_plan
    _check_golden(f"{name}.launch.sh", launch_script(plan, python="/opt/venv/bin/python"))


def test_sbatch_script_golden(named_plan):
    name, plan = named_plan
    _check_golden(f"{name}.job.sbatch", sbatch_script(plan, python="/opt/venv/bin/python"))


def test_scripts_name_the_plan_and_pass_bash_n(named_plan, tmp_path):
    _, plan = named_plan
    for text in (launch_script(plan), sbatch_script(plan)):
        assert plan.model.ref in text.splitlines()[1] and plan.schedule in text.splitlines()[1]
        script = tmp_path / "script.sh"
        script.write_text(text)
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_launch_refuses_the_wrong_node_count(tmp_path):
    plan = _plan(16, 8, "h100")
    write_plan_dir(plan, timeline_rows(plan, plan_timeline(plan)), tmp_path)
    done = subprocess.run(
        ["bash", str(tmp_path / "launch.sh")], env={**os.environ, "NNODES": "1"}, capture_output=True, text=True
    )
    assert done.returncode == 1 and "set NNODES=2" in done.stderr


def test_plan_dir_files(tmp_path):
    plan = _plan(2, 2, "cpu")
    write_plan_dir(plan, timeline_rows(plan, plan_steps_timeline(plan)), tmp_path)
    assert Plan.load(tmp_path / "plan.json") == plan
    assert os.access(tmp_path / "launch.sh", os.X_OK) and os.access(tmp_path / "job.sbatch", os.X_OK)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = 1 + max(e["args"]["step"] for e in ops)
    assert steps >= 2 and len(ops) == steps * sum(len(plan.rank_ops[r.rank]) for r in plan.ranks if r.pipeline == 0)
    assert {e["pid"] for e in ops} == {r.rank for r in plan.ranks if r.pipeline == 0}
    for rank, step in itertools.product({e["pid"] for e in ops}, range(steps)):  # named as `run --trace` names them
        named = [
            e["name"] for e in sorted(ops, key=lambda e: e["ts"]) if e["pid"] == rank and e["args"]["step"] == step
        ]
        assert named == list(plan.rank_ops[rank])
