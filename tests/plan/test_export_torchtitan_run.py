"""The proof that torchtitan runs an exported plan as planned: for every schedule both sides have (1F1B,
interleaved, ZBV, DualPipeV), a plan of pipeplan's llama is exported as a torchtitan 0.2 job config and, on 2 gloo
ranks, torchtitan's own code reads it, builds its own llama3 model (tiny), cuts it into the exported stage FQNs
(`pipeline_module_split`) and runs the exported CSV schedule (`build_pipeline_schedule`); the losses and every
gradient equal a single-process run of the whole model (helpers.torchtitan_ranks). One launch for every case."""

from __future__ import annotations

import pytest
import torch
from helpers.torchtitan_env import DEPS, require
from helpers.torchtitan_ranks import MODEL
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.plan.manual import manual_plan

runner = CliRunner()
LLAMA = {
    "layers": MODEL["n_layers"],
    "hidden": 32,
    "heads": 2,
    "kv_heads": 2,
    "intermediate": 64,
    "vocab": 64,
    "seq": 16,
}


@pytest.mark.slow
def test_torchtitan_runs_the_exported_schedules_with_the_reference_gradients(tmp_path):
    require("0.2")
    from helpers.torchtitan_ranks import run_torchtitan_cases

    cases = []
    for schedule in ("1f1b", "interleaved", "zbv", "dualpipev"):
        plan = manual_plan("llama", LLAMA, schedule=schedule, pipeline_devices=2, num_microbatches=4)
        plan.save(tmp_path / f"{schedule}.json")
        toml = tmp_path / f"{schedule}.toml"
        result = runner.invoke(app, ["export", str(tmp_path / f"{schedule}.json"), "-f", "torchtitan", "-o", str(toml)])
        assert result.exit_code == 0, result.output
        assert (tmp_path / f"{schedule}.csv").is_file() and "cannot express" not in result.output
        cases.append((schedule, str(toml)))
    results = run_torchtitan_cases(cases, world_size=2, deps=str(DEPS))
    for label, _ in cases:
        reference = results[f"reference {label}"]
        losses = [loss for rank in results[label] for loss in rank["losses"]]
        assert len(losses) == 4, label  # one per microbatch, each / 4 (torchtitan's accumulated-loss rescale)
        torch.testing.assert_close(sum(losses), reference["loss"], rtol=1e-5, atol=1e-6)
        grads = {name: grad for rank in results[label] for name, grad in rank["grads"].items()}
        assert set(grads) == set(reference["grads"]), label  # every parameter on exactly the ranks' stages
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, reference["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m, w=f"{label} {name}": f"{w}: {m}"
            )
