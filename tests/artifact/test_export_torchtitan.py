"""`export --format torchtitan`: torchtitan's own config loader (ConfigManager, --job.config_file) parses the job
config, the stage membership and CSV schedule it points at are the plan's, and what torchtitan cannot express is
noted. (The 2-rank run of the CSV in torch's runtime: tests/runtime/test_torch_csv_run.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import pytest
import tomllib
from typer.testing import CliRunner

from pipeplan.artifact.export_torchtitan import torchtitan_export
from pipeplan.artifact.manual import manual_plan
from pipeplan.cli import app

runner = CliRunner()


def _config_manager():
    """torchtitan.config's ConfigManager without running torchtitan/__init__.py, which imports its GPU kernels
    (triton) — the config loader itself needs neither."""
    pytest.importorskip("tyro")
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed")
    if "torchtitan" not in sys.modules:
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    from torchtitan.config import ConfigManager

    return ConfigManager


def _export(tmp_path, plan):
    plan.save(tmp_path / "plan.json")
    toml = tmp_path / "job.toml"
    result = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "-f", "torchtitan", "-o", str(toml)])
    assert result.exit_code == 0, result.output
    return toml, result


def test_torchtitan_parses_the_job_config(tmp_path):
    config_manager = _config_manager()
    layout = {"pipeline_devices": 2, "num_microbatches": 4, "microbatch_size": 2, "data_parallel": 2}
    plan = manual_plan("gpt", schedule="interleaved", precision="bf16-mixed", recompute=["full"] * 4, **layout)
    toml, result = _export(tmp_path, plan)
    config = config_manager().parse_args(["--job.config_file", str(toml)])
    parallelism = config.parallelism
    assert parallelism.module_fqns_per_model_part == [
        ["embed", "blocks.0"],
        ["blocks.1", "blocks.2"],
        ["blocks.3"],
        ["head"],
    ]
    assert (parallelism.pipeline_parallel_degree, parallelism.pipeline_parallel_schedule) == (2, "Interleaved1F1B")
    assert parallelism.pipeline_parallel_microbatch_size == 2 and parallelism.data_parallel_replicate_degree == 2
    assert (config.training.local_batch_size, config.training.global_batch_size) == (8, 16)
    assert config.training.mixed_precision_param == "bfloat16" and config.activation_checkpoint.mode == "full"
    csv = tmp_path / "job.csv"
    assert parallelism.pipeline_parallel_schedule_csv == str(csv) and str(csv) in result.stdout
    assert csv.read_text().splitlines() == [",".join(ops) for ops in plan.rank_ops[:2]]


def test_what_torchtitan_cannot_express_is_noted(tmp_path):
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4, replicas=[2, 1], zero=1)
    plan = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, recompute=r) for s, r in zip(plan.stages, ["selective", "none"]))
    )
    exported = torchtitan_export(plan, "unused.csv")
    assert not exported.needs_csv and "pipeline_parallel_schedule_csv" not in exported.config["parallelism"]
    assert exported.config["parallelism"]["data_parallel_shard_degree"] == 1  # one pipeline: FSDP over 1 rank
    notes = " | ".join(exported.notes)
    assert "one rank per stage" in notes and "ZeRO-1" in notes and "differs per stage" in notes
    assert exported.config["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    text = exported.render()
    assert tomllib.loads(text)["parallelism"]["module_fqns_per_model_part"][1] == ["blocks.2", "blocks.3", "head"]
    assert "# stage 0: embed, blocks.0-1" in text
