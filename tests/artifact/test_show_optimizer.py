"""`show` prints the plan's optimizer and its state layout, the figures its static memory was counted with."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from pipeplan.artifact.manual import manual_plan
from pipeplan.cli import app
from pipeplan.costs.optimizer import numerics, static_split

runner = CliRunner()


@pytest.mark.parametrize(
    ("optimizer", "precision", "zero", "words"),
    [
        ("adamw-bf16state", "bf16-main", 1, "adamw-bf16state (bf16 main copy + 2 bf16 moments: 6 B/param), sharded"),
        ("adamw", "bf16-main", 0, "adamw (fp32 main copy + 2 fp32 moments: 12 B/param) Compute:"),
        ("sgd", "fp32", 0, "sgd (1 fp32 momentum, the fp32 weights as master copy: 4 B/param) Compute:"),
    ],
)
def test_show_prints_the_optimizer_state_layout(tmp_path, optimizer, precision, zero, words):
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4, zero=zero, precision=precision)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer=optimizer))
    plan.save(tmp_path / "plan.json")
    result = runner.invoke(app, ["show", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert f"Optimizer: {words}" in " ".join(result.output.split())
    # the B/param printed is the optimizer-state part of the static bytes the plan was counted with
    printed = float(words.split(" B/param")[0].rsplit(" ", 1)[1])
    assert printed == static_split(numerics(optimizer, precision))[2]
