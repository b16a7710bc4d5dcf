"""The CSV schedule `export --format torch-csv` / `--format torchtitan` writes runs in torch.distributed.pipelining's
own CSV runtime (`_PipelineScheduleRuntime`, what torchtitan uses for `pipeline_parallel_schedule_csv`): a 2-stage
plan of a built-in model on 2 gloo ranks gives the losses and gradients of the single-process reference that
`pipeplan run` is tested against (tests/helpers/runtime.py). One launch for every case."""

from __future__ import annotations

import pytest
import torch
from helpers.runtime import TINY_GPT, make_plan, reference_step
from helpers.torch_csv_ranks import run_csv_cases

from pipeplan.artifact.exports import torch_csv


@pytest.mark.slow
def test_exported_csv_runs_in_torch_with_the_reference_losses(tmp_path):
    cases, plans = [], {}
    for schedule in ("1f1b", "zb-h1"):  # fused backward, and split I / W ops
        plan_path, plan = make_plan(tmp_path, schedule, "gpt", TINY_GPT, schedule=schedule, pipeline_devices=2)
        csv = tmp_path / f"{schedule}.csv"
        csv.write_text(torch_csv(plan))
        cases.append((schedule, plan_path, str(csv)))
        plans[schedule] = plan
    results = run_csv_cases(cases, world_size=2)
    for label, per_rank in results.items():
        plan = plans[label]
        loss, grads = reference_step(plan)
        losses = per_rank[1]["losses"]
        assert len(losses) == plan.training.num_microbatches
        torch.testing.assert_close(sum(losses) / len(losses), loss, rtol=1e-5, atol=1e-6)
        found = {name: grad for result in per_rank for name, grad in result["grads"].items()}
        assert set(found) == set(grads), label
        for name, grad in found.items():
            torch.testing.assert_close(
                grad, grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, w=f"{label} {name}": f"{w}: {m}"
            )
