"""Two gloo ranks train the byte-level text model (examples/text_model.py: real text, a new batch every step) with
the training options, each against a single-process loop written here with torch's own optimizers and LambdaLR:
SGD with momentum under a warm-up + cosine schedule and --seed; AdamW under ZeRO-1 with two data-parallel pipelines
each reading its own shard, under a linear schedule; a factory's own optimizer (parameter groups) and lr_lambda.
Losses, the global gradient norms and learning rates in the --log file, and the final parameters (from the
checkpoints) match; a run resumed half way reaches the same losses and log. One launch runs every case."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.runtime import build_reference_model, checkpoint_files, global_batch_backward, make_plan, save_plan
from runtime.training_models import TEXT, TINY_TEXT, decay_groups, halving

from pipeplan.errors import RunError
from pipeplan.runtime.launch.local import launch_local, launch_many
from pipeplan.runtime.train.config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # multi-process runs

OWN = f"{Path(__file__).with_name('training_models.py')}:own_optimizer_lm"
STEPS = 6


def _cosine(step: int) -> float:  # warm-up 2, cosine to 0 at step 6
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 4))


def _linear(step: int) -> float:  # warm-up 1, linear to 0 at step 6
    return 1.0 if step < 1 else 1 - (step - 1) / 5


CASES = {  # label: (model, layout, plan's optimizer, run options, the reference's optimizer, its factor)
    "sgd cosine": (
        TEXT,
        dict(schedule="1f1b", pipeline_devices=2),
        "sgd",
        dict(lr=0.05, momentum=0.8, weight_decay=0.01, lr_schedule="cosine", warmup_steps=2, seed=11),
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.8, weight_decay=0.01),
        _cosine,
    ),
    "adamw zero1 dp2 linear": (
        TEXT,
        dict(schedule="1f1b", pipeline_devices=1, data_parallel=2, zero=1),
        "adamw",
        dict(lr=3e-3, lr_schedule="linear", warmup_steps=1),
        lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        _linear,
    ),
    "factory optimizer": (
        OWN,
        dict(schedule="zb-h1", pipeline_devices=2),
        "adamw",
        dict(lr=3e-3, weight_decay=0.1),
        None,  # decay_groups over named parameters
        halving,
    ),
}


def _reference(plan, optimizer, factor):
    """Single-process training on the plan's global batches: losses, gradient norms, final parameters."""
    spec, module = build_reference_model(plan)
    named = list(module.named_parameters())
    opt = optimizer([p for _, p in named]) if optimizer else decay_groups(named, 3e-3, 0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    batches = spec.batches(plan.training.global_batch_size, plan.training.seed)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        total = global_batch_backward(spec, module, next(batches), plan)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for _, p in named if p.grad is not None])))
        opt.step()
        schedule.step()
        losses.append(total)
    return losses, norms, {n: p.detach() for n, p in named}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("training")
    runs, plans = [], {}
    common = dict(quiet=True, heartbeat_timeout_s=30.0)
    for index, (label, (model, layout, optimizer, options, _, _)) in enumerate(CASES.items()):
        _, plan = make_plan(folder, f"c{index}", model, TINY_TEXT, **layout)
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer=optimizer))
        path = save_plan(folder, f"c{index}", plan)
        config = RunConfig(steps=STEPS, log_path=str(folder / f"{index}.jsonl"), **options, **common)
        runs.append((path, dataclasses.replace(config, checkpoint_dir=str(folder / f"ck{index}"))))
        plans[label] = (index, plan, config)
    path, config = runs[0][0], dict(CASES["sgd cosine"][3], log_path=str(folder / "resumed.jsonl"), **common)
    checkpoints = str(folder / "halves")
    runs.append((path, RunConfig(steps=3, decay_steps=STEPS, checkpoint_dir=checkpoints, **config)))
    runs.append((path, RunConfig(steps=STEPS, checkpoint_dir=checkpoints, resume=True, **config)))
    with _stdout_to(folder / "stdout.txt"):  # what rank 0 prints
        results = launch_many(runs, threads=1)
    return plans, results, folder


@contextlib.contextmanager
def _stdout_to(path: Path):
    sys.stdout.flush()
    saved = os.dup(1)
    with path.open("w") as handle:
        os.dup2(handle.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _log(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("label", list(CASES))
def test_training_options_match_a_single_process_loop(launched, label):
    plans, results, folder = launched
    index, plan, config = plans[label]
    *_, optimizer, factor = CASES[label]
    run_plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, seed=config.seed or 0))
    losses, norms, params = _reference(run_plan, optimizer, factor)
    found = results[0][index].losses
    assert found == results[1][index].losses and len(found) == STEPS
    torch.testing.assert_close(found, losses, rtol=1e-5, atol=1e-6)
    log = _log(config.log_path)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in log] == found  # full precision
    torch.testing.assert_close([r["grad_norm"] for r in log], norms, rtol=1e-5, atol=1e-7)
    base_lr = config.lr
    torch.testing.assert_close([r["lr"] for r in log], [base_lr * factor(s) for s in range(STEPS)])
    saved = {
        n: t for state in checkpoint_files(str(folder / f"ck{index}")).values() for n, t in state["params"].items()
    }
    assert set(saved) == set(params)
    for name, value in params.items():
        # (AdamW moves a parameter by about lr per step whatever its gradient's size: allow 1e-5 absolute)
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_resumed_run_continues_the_data_schedule_and_log(launched):
    plans, results, _ = launched
    index, _, config = plans["sgd cosine"]
    straight = results[0][index].losses
    first, resumed = results[0][-2], results[0][-1]
    assert resumed.first_step == 3
    assert first.losses + resumed.losses == straight  # the same batches, learning rates and weights
    log = _log(Path(config.log_path).with_name("resumed.jsonl"))
    assert [(r["step"], r["loss"], r["lr"]) for r in log] == [
        (r["step"], r["loss"], r["lr"]) for r in _log(config.log_path)
    ]


def test_quiet_runs_print_no_step_lines_but_their_summaries(launched):
    plans, results, folder = launched
    printed = (folder / "stdout.txt").read_text().splitlines()
    assert not [line for line in printed if line.startswith("step ")]
    assert len([line for line in printed if line.startswith("summary: median step")]) == len(results[0])


def test_an_error_inside_the_ranks_is_one_line_with_tracebacks_under_debug(tmp_path, monkeypatch, capfd):
    poisoned = f"{Path(__file__).with_name('toy_models.py')}:poisoned_mlp"  # infinite inputs at step 3
    path, _ = make_plan(tmp_path, "poisoned", poisoned, {}, schedule="1f1b", pipeline_devices=2)
    monkeypatch.setenv("PIPEPLAN_DEBUG", "1")
    with pytest.raises(RunError, match=r"^rank [01] failed: step 3: loss is nan") as failed:
        launch_local(path, RunConfig(steps=4, quiet=True, heartbeat_timeout_s=30.0), threads=1)
    printed = capfd.readouterr().err
    assert str(failed.value).count("loss is nan") == 1 and "pipeplan rank" not in printed
    assert "rank 0: Traceback" in printed and "in apply_verdict" in printed, printed[-2000:]
