"""What `run`'s summary adds after measured vs predicted: the exact `pipeplan refine` command when measured is more
than 15% off (with --trace: this run's trace; without: the run to trace first), and a note when the plan's profile
was measured with another CPU thread count than the ranks ran with."""

from __future__ import annotations

import dataclasses
import shlex

import torch

from pipeplan.artifact.manual import manual_plan
from pipeplan.artifact.measured import refined_dir
from pipeplan.artifact.profile_ref import ProfileRef
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.run_notes import RunSource, run_notes


def _source(tmp_path, threads=None):
    plan = manual_plan(
        "mlp", {"layers": 2, "hidden": 8}, schedule="1f1b", pipeline_devices=2, num_microbatches=2, microbatch_size=1
    )
    if threads is not None:
        plan = dataclasses.replace(plan, profile=ProfileRef(fingerprint="x", threads=threads))
    return RunSource(plan=plan, path=str(tmp_path / "plan" / "plan.json"))


def test_refine_hint_beyond_15_percent(tmp_path):
    source = _source(tmp_path)
    trace = str(tmp_path / "measured.json")
    traced = RunConfig(trace_path=trace)
    assert run_notes(source, traced, "cpu", 114.0, 100.0) == []
    assert run_notes(source, traced, "cpu", 86.0, 100.0) == []
    (line,) = run_notes(source, traced, "cpu", 130.0, 100.0)
    command = line.split("`")[1]
    assert shlex.split(command) == ["pipeplan", "refine", trace, "-o", str(refined_dir(source.path))]
    assert "30% above" in line
    (line,) = run_notes(source, RunConfig(), "cpu", 50.0, 100.0)  # no --trace: the run to trace first, then refine
    run, refine = (shlex.split(part) for part in line.split("`")[1::2])
    assert run[:3] == ["pipeplan", "run", source.path] and run[3] == "--trace" and refine[2] == run[4]
    assert "50% below" in line
    assert run_notes(source, traced, "cpu", 130.0, 0.0) == []  # no prediction: nothing to compare


def test_profile_threads_note(tmp_path):
    ran = torch.get_num_threads()
    assert run_notes(_source(tmp_path, threads=ran), RunConfig(), "cpu", 100.0, 100.0) == []
    (note,) = run_notes(_source(tmp_path, threads=ran + 3), RunConfig(), "cpu", 100.0, 100.0)
    assert f"measured with {ran + 3} CPU thread(s), each rank ran with {ran}" in note
    assert f"--threads {ran}" in note
    assert run_notes(_source(tmp_path, threads=ran + 3), RunConfig(), "cuda", 100.0, 100.0) == []
    assert run_notes(_source(tmp_path), RunConfig(), "cpu", 100.0, 100.0) == []  # the plan records no threads
