"""benchmarks/gpu_check.sh dry-runs on the CPU (issue 39): every step runs its CPU part at small sizes (or says why
it did not), the summary and the JSON are written, and their figures are there, so the script the next session
with a GPU runs cannot rot. GPU_CHECK_DEVICE=cpu keeps it a dry run where CUDA is visible too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1000)]  # ~15 pipeplan processes, and pytest: 1-2 minutes

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    "setup",
    "profile-gpt",
    "profile-llama",
    "run-gpt",
    "run-llama",
    "calibrate",
    "analytic",
    "split-backward",
    "tests-gpu",
    "tests-suite",
]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("gpu_check")
    out, work = base / "out", base / "work"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}
    env["GPU_CHECK_DEVICE"] = "cpu"
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=950
    )
    return out, work, done


def _steps(out: Path) -> dict[str, dict]:
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-dry-run" and report["device"] == "cpu (no CUDA)"
    return {step["name"]: step for step in report["steps"]}


def test_every_step_runs_its_cpu_part_and_the_summary_is_written(dry_run):
    out, _, done = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["artifacts.tar.gz", "gpu_check.json", "logs.txt", "summary.txt"]
    steps = _steps(out)
    assert list(steps) == STEPS
    have_transformers = steps["setup"]["figures"]["packages"]["transformers"] is not None
    for name, step in steps.items():
        if name == "tests-suite":
            assert step["status"] == "skipped" and "no CUDA" in step["note"]
        elif name.endswith("llama") and not have_transformers:
            assert step["status"] == "skipped" and "transformers" in step["note"]
        else:
            assert (step["status"], step["rc"]) == ("ok", 0), (name, step)
    summary = (out / "summary.txt").read_text()
    assert f"{len(STEPS) - 1} of {len(STEPS)} steps ran" in summary or not have_transformers
    for name in STEPS:
        assert f"\n{name} " in summary
    assert summary in done.stdout  # printed last, where the device tool's output tail shows it
    with tarfile.open(out / "artifacts.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"gpt-measured.json", "plan-gpt/plan.json", "hw.json", "status.tsv", "logs/run-gpt.log"} <= names


def test_the_figures_of_each_step(dry_run):
    out, _, done = dry_run
    assert done.returncode == 0
    steps = {name: step["figures"] for name, step in _steps(out).items()}
    assert steps["setup"]["cuda"] is False and steps["setup"]["preset"] == "h100"
    profile = steps["profile-gpt"]
    assert [row["name"] for row in profile["layers"]] == ["embed", "blocks.0", "head"]
    assert profile["precision"] == "bf16-mixed" and profile["forward_sum_over_whole"] > 0
    run = steps["run-gpt"]
    assert run["predicted_step_ms"] > 0 and run["measured_step_ms"] > 0 and run["measured_over_predicted"] > 0
    assert run["between_ops"]["ops_per_step"] == 2 * run["microbatches"]  # F and B per microbatch, 1 stage
    assert "measured_peak_gib" not in run  # peak memory is measured on CUDA only
    calibrate = steps["calibrate"]
    assert "pipeplan calibrate" in calibrate["description"] and calibrate["achieved_bf16_tflops"] > 0
    for which in ("preset", "calibrated"):
        row = steps["analytic"]["gpt"][which]
        assert row["measured_over_analytic_fb"] > 0 and row["measured_over_analytic_activation_bytes"] > 0
        assert row["cut_bytes_equal"]  # the fp32 residual stream: CPU and CUDA autocast agree on a GPT's cuts
    assert steps["analytic"]["gpt"]["preset"]["hardware"] == "h100"
    rows = steps["split-backward"]["results"]
    assert [r["width"] for r in rows] == [32, 64] and all(r["iw_over_b"] > 0 for r in rows)
    assert all(r["cache_hits"] > 0 and r["cache_misses"] == 1 for r in rows)
    gpu_tests = steps["tests-gpu"]
    assert gpu_tests["tests"] >= 8 and gpu_tests["skipped"] == gpu_tests["tests"] and not gpu_tests["failed_tests"]
    assert "skipped" in gpu_tests["pytest_line"]
