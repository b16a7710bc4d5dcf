"""The global step checks and post-validation's pieces, in one process: the global norm from per-rank rows and the
clip coefficient are torch.nn.utils.clip_grad_norm_'s; the verdict follows the synchronized step's rules; a step
undone by StepUndo is bit for bit the state before it; the chain ends at the rank holding stage 0; the options are
checked with one line."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers.runtime import TINY_MLP, make_plan
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.errors import ConfigError, RunError
from pipeplan.runtime.launch import worker
from pipeplan.runtime.step.precision_run import LossScaler
from pipeplan.runtime.train import post_validate
from pipeplan.runtime.train.config import FaultSpec, RunConfig
from pipeplan.runtime.train.post_validate import StepUndo, check_post_validate
from pipeplan.runtime.train.step_checks import GlobalState, Verdict, apply_verdict, clip_coefficient, judge, local_row

CPU = torch.device("cpu")


def _grads(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((7, 5), (5,), (3, 3, 2), (11,))]


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_rows_give_clip_grad_norms_norm_and_coefficient(max_norm):
    grads = _grads()
    owned = [[grads[0], grads[3]], [], [grads[1], grads[2]]]  # three ranks, each gradient counted once
    table = torch.stack([local_row(torch.tensor(0.5, dtype=torch.float64), part, CPU) for part in owned])
    state = GlobalState.from_table(table)
    assert state.loss == 1.5
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    assert state.grad_norm == pytest.approx(float(norm), rel=1e-6)
    coefficient = clip_coefficient(state.grad_norm, max_norm)
    assert (coefficient < 1.0) == (max_norm < float(norm))
    for param, grad in zip(params, grads, strict=True):
        torch.testing.assert_close(grad * coefficient, param.grad, rtol=1e-6, atol=0.0)


def test_the_table_sum_does_not_depend_on_row_order():
    rows = torch.tensor([[0.0, 1e16], [0.0, 1.0], [0.0, -1e16 + 3.0]], dtype=torch.float64).abs()
    forward, backward = GlobalState.from_table(rows), GlobalState.from_table(rows.flip(0))
    assert forward == backward


def test_verdict_follows_the_synchronized_rules():
    nan, inf = float("nan"), float("inf")
    assert judge(GlobalState(1.0, 2.0), step=0, max_norm=None, loss_scaling=False) == Verdict()
    assert judge(GlobalState(1.0, 2.0), step=0, max_norm=1.0, loss_scaling=False).coefficient == 1.0 / (2.0 + 1e-6)
    assert judge(GlobalState(1.0, 2.0), step=0, max_norm=3.0, loss_scaling=False).plain_step
    assert judge(GlobalState(1.0, nan), step=0, max_norm=1.0, loss_scaling=True) == Verdict(skip=True)
    stop = judge(GlobalState(1.0, inf), step=4, max_norm=None, loss_scaling=False).stop
    assert stop.startswith("step 5: gradients are not finite; stopped before the optimizer step")
    assert judge(GlobalState(nan, nan), step=0, max_norm=None, loss_scaling=True).stop.startswith("step 1: loss is nan")


def test_apply_verdict_clips_skips_or_stops():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 4.0)
    stepped = []
    optimizer = SimpleNamespace(grads=lambda: [param.grad], step=lambda: stepped.append(param.grad.clone()))
    scaler = LossScaler(init_scale=8.0)
    apply_verdict(Verdict(coefficient=0.25), optimizer, scaler)
    assert torch.equal(stepped[0], torch.ones(3)) and scaler.clean_steps == 1
    apply_verdict(Verdict(skip=True), optimizer, scaler)
    assert len(stepped) == 1 and scaler.scale == 4.0 and scaler.skipped_steps == 1
    with pytest.raises(RunError, match="stop here"):
        apply_verdict(Verdict(stop="stop here"), optimizer, None)


def _adamw_pair():
    params = [torch.nn.Parameter(g.clone()) for g in _grads(1)]
    return params, torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)


def _set_grads(params, seed: int) -> None:
    for param, grad in zip(params, _grads(seed), strict=True):
        param.grad = grad


def test_step_undo_restores_parameters_and_adamw_state_bit_for_bit():
    params, optimizer = _adamw_pair()
    twin, twin_optimizer = _adamw_pair()
    undo = StepUndo(optimizer, list(params))
    for seed in (2, 3, 4):  # the first step creates the state; later ones update it
        _set_grads(params, seed)
        undo.take()
        optimizer.step()
        undo.restore()
        assert all(torch.equal(p, t) for p, t in zip(params, twin, strict=True))
        assert len(optimizer.state) == len(twin_optimizer.state)
        optimizer.step()  # the redo equals a step that was never undone
        _set_grads(twin, seed)
        twin_optimizer.step()
        for param, other in zip(params, twin, strict=True):
            assert torch.equal(param, other)
            state, other_state = optimizer.state[param], twin_optimizer.state[other]
            assert all(torch.equal(state[k], other_state[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_post_validate_refuses_an_asynchronous_schedule(tmp_path, monkeypatch):
    _, plan = make_plan(tmp_path, "p", "mlp", TINY_MLP, schedule="1f1b", pipeline_devices=2)
    check_post_validate(plan, True)
    monkeypatch.setattr(post_validate, "schedule_info", lambda name: SimpleNamespace(asynchronous=True))
    check_post_validate(plan, False)
    with pytest.raises(ConfigError, match="drop --post-validate or plan a synchronous schedule"):
        check_post_validate(plan, True)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_clip_grad_norm_must_be_finite_and_positive(value):
    with pytest.raises(ConfigError, match="--clip-grad-norm must be a finite number > 0"):
        RunConfig(clip_grad_norm=value)


def test_run_options_parse_on_the_cli_and_the_worker(tmp_path, monkeypatch):
    path, _ = make_plan(tmp_path, "p", "mlp", TINY_MLP, schedule="1f1b", pipeline_devices=2)
    result = CliRunner().invoke(app, ["run", path, "--clip-grad-norm", "-2"])
    assert result.exit_code == 1 and "--clip-grad-norm must be a finite number > 0, got -2.0" in result.output
    _, config, _ = worker.parse_args([path, "--clip-grad-norm", "0.5", "--post-validate"])
    assert config.clip_grad_norm == 0.5 and config.post_validate
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=1,step=3,mode=nan")
    assert FaultSpec.from_env() == FaultSpec(rank=1, step=3, mode="nan")
