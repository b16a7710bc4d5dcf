"""`pipeplan plan / show / export` through typer's CliRunner: files, --json, torch's CSV loader, one-line errors."""

from __future__ import annotations

import json

import pytest
from helpers.search import synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.timing import plan_timeline
from pipeplan.cli import app
from pipeplan.profiling.profile import Profile

runner = CliRunner()


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    synthetic_profile().save(path)
    return path


@pytest.fixture(scope="module")
def plan_dir(profile_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan"
    args = ["plan", "--profile", str(profile_file), "--devices", "4", "--memory", "100MiB", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Alternatives" in result.output and "Why:" in result.output
    return out


def test_plan_writes_the_plan_directory(plan_dir):
    files = {"plan.json", "launch.sh", "job.sbatch", "timeline.json", "profile.json"}
    assert {p.name for p in plan_dir.iterdir()} == files
    plan = Plan.load(plan_dir / "plan.json")
    assert plan.world_size == 4 and not plan.runnable
    assert plan.profile is not None  # profile.json is the profile the plan records (what `refine` starts from)
    assert Profile.load(plan_dir / "profile.json").fingerprint == plan.profile.fingerprint


def test_plan_json_prints_only_json(profile_file, tmp_path):
    args = ["plan", "--profile", str(profile_file), "--devices", "2", "-B", "8", "-s", "gpipe", "-o", str(tmp_path)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["schedule"] == "gpipe" and summary["training"]["global_batch_size"] == 8
    assert summary["stages"] and summary["predicted"]["samples_per_s"] > 0


def test_show_renders_summary_and_gantt(plan_dir):
    result = runner.invoke(app, ["show", str(plan_dir / "plan.json")])
    assert result.exit_code == 0, result.output
    assert "Predicted step" in result.output and "dev 0" in result.output
    as_json = runner.invoke(app, ["show", str(plan_dir / "plan.json"), "--json"])
    assert json.loads(as_json.stdout)["world_size"] == 4


def test_export_writes_a_csv_torch_loads(plan_dir, tmp_path):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    csv_path = tmp_path / "schedule.csv"
    result = runner.invoke(app, ["export", str(plan_dir / "plan.json"), "--format", "torch-csv", "-o", str(csv_path)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(plan_dir / "plan.json")
    pipeline_ranks = [r for r in plan.ranks if r.pipeline == 0]
    loader = PipelineScheduleMulti.__new__(PipelineScheduleMulti)  # no process group needed to parse
    loader.pipeline_order = {}
    loader.pp_group_size = len(pipeline_ranks)
    loader._num_stages = len(plan.stages)
    loader._n_microbatches = plan.training.num_microbatches
    loader._stages = []
    loader._load_csv(str(csv_path))
    assert [[str(a) for a in row] for row in loader.pipeline_order.values()] == [
        list(plan.rank_ops[r.rank]) for r in pipeline_ranks
    ]


def test_export_rejects_unknown_format(plan_dir, tmp_path):
    result = runner.invoke(app, ["export", str(plan_dir / "plan.json"), "--format", "xml", "-o", str(tmp_path / "x")])
    assert result.exit_code == 1 and "torch-csv" in result.output


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--devices", "0"], "--devices must be >= 1"),
        (["--devices", "12"], "multiple of the devices per node (8)"),
        (["--memory", "-4GiB"], "--memory"),
        (["--devices", "4", "-B", "6", "-b", "4"], "divisible by --microbatch-size"),
        (["--devices", "4", "-B", "2", "-s", "interleaved"], "no plan is possible"),
        (["--devices", "2", "--memory", "10MiB"], "smallest that fits is"),
        (["--schedule", "2f2b"], "choose from"),
        (["--parallel", "pp=2,pp=4"], "each once"),
        (["--devices", "4", "--parallel", "pp=3"], "--parallel pp=3 must divide --devices (4)"),
        (["--devices", "4", "--parallel", "pp=2/x"], "--parallel pp"),
    ],
)
def test_errors_are_one_line_exit_1(profile_file, tmp_path, args, match):
    result = runner.invoke(app, ["plan", "--profile", str(profile_file), "-o", str(tmp_path), *args])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and match in result.output.replace("\n", " ")


def test_profile_must_match_the_model(profile_file, tmp_path):
    result = runner.invoke(app, ["plan", "gpt", "--profile", str(profile_file), "-o", str(tmp_path)])
    assert result.exit_code == 1 and "another graph" in result.output
    missing = runner.invoke(app, ["plan", "-o", str(tmp_path)])
    assert missing.exit_code == 1 and "give MODEL" in missing.output


def test_plan_a_model_end_to_end(tmp_path):
    args = ["plan", "mlp", "-a", "layers=4", "-a", "hidden=32", "--devices", "2", "--memory", "1GiB"]
    result = runner.invoke(app, [*args, "-B", "4", "-o", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.runnable and plan.model.fingerprint and plan.model.options == {"layers": "4", "hidden": "32"}
    assert all(stage.node_names for stage in plan.stages)
    # measured profile, bytes model end to end: per-rank peaks are the simulator's for the plan's own lists
    timeline = plan_timeline(plan)
    assert plan.predicted.peak_memory_bytes[: timeline.num_devices] == tuple(
        round(b) for b in timeline.peak_memory_bytes
    )
    assert sum(s.activation_bytes for s in plan.stages) > 0
    # a saved profile of the same model plans the same graph without profiling again
    profile_path = tmp_path / "mlp-profile.json"
    profiled = runner.invoke(app, ["profile", "mlp", "-a", "layers=4", "-a", "hidden=32", "-o", str(profile_path)])
    assert profiled.exit_code == 0, profiled.output
    again = runner.invoke(app, [*args, "--profile", str(profile_path), "-B", "4", "-o", str(tmp_path / "p2"), "--json"])
    assert again.exit_code == 0, again.output
    replanned = Plan.load(tmp_path / "p2" / "plan.json")
    assert replanned.runnable and replanned.model.fingerprint == plan.model.fingerprint


def test_ignored_inputs_warn(profile_file, tmp_path):
    args = ["plan", "--profile", str(profile_file), "--devices", "2", "-a", "layers=2", "--granularity", "1"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: -a, --granularity ignored" in result.stderr
    json.loads(result.stdout)


def test_memory_reserve_default_override_and_summary(plan_dir, profile_file, tmp_path):
    plan = Plan.load(plan_dir / "plan.json")
    assert plan.predicted.memory_reserve_bytes == 25 * 2**20  # the default: a quarter of a 100 MiB device at most
    assert plan.predicted.memory_limit_bytes == 75 * 2**20
    assert max(plan.predicted.peak_memory_bytes) <= plan.predicted.memory_limit_bytes
    out = tmp_path / "plan"
    args = ["plan", "--profile", str(profile_file), "--devices", "4", "--memory", "100MiB"]
    result = runner.invoke(app, [*args[:-1], "100MiB,reserve=10MiB", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "less a 10.00 MiB reserve" in " ".join(result.output.split())
    assert Plan.load(out / "plan.json").predicted.memory_reserve_bytes == 10 * 2**20
    bad = runner.invoke(app, [*args[:-1], "100MiB,reserve=200MiB", "-o", str(out)])
    assert bad.exit_code == 1 and "--memory reserve=" in bad.output
