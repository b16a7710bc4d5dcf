"""Precision modes at run time (CPU, gloo): a bf16-mixed and a bf16 2-rank run give the single-process run's loss
and gradients under the same precision (within bf16 tolerance), one launch for both; a run refuses a --precision
other than its plan's, and fp16-mixed on the CPU, with one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.runtime import TINY_GPT_TIED, build_reference_model, gathered_grads, make_plan

from pipeplan.errors import ConfigError
from pipeplan.plan.manual import manual_plan
from pipeplan.precision import get_precision
from pipeplan.runtime.launch.local import launch_local, launch_many
from pipeplan.runtime.step.precision_run import LossScaler, memory_versus
from pipeplan.runtime.train.config import RunConfig

pytestmark = pytest.mark.timeout(300)

ONE_STEP = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=30.0)


def _reference(plan):
    """Loss and gradients of the first global batch on one process, whole model, under the plan's precision."""
    mode = get_precision(plan.training.precision)
    spec, module = build_reference_model(plan)
    module.to(mode.param_dtype)
    inputs, target = next(spec.batches(plan.training.global_batch_size, plan.training.seed))
    b, count = plan.training.microbatch_size, plan.training.num_microbatches
    total = 0.0
    for mb in range(count):
        piece = slice(mb * b, (mb + 1) * b)
        with mode.autocast("cpu"):
            loss = spec.loss_fn(module(*(x[piece] for x in inputs)), target[piece]) / count
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("precision")
    plans = [
        make_plan(folder, name, "gpt", TINY_GPT_TIED, schedule=schedule, pipeline_devices=2, precision=name)
        for name, schedule in (("bf16-mixed", "zb-h1"), ("bf16", "1f1b"))
    ]
    results = launch_many([(path, ONE_STEP) for path, _ in plans], capture_grads=True, threads=1)
    return [(plan, [per_rank[i] for per_rank in results]) for i, (_, plan) in enumerate(plans)]


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["bf16-mixed", "bf16"])
def test_two_rank_run_matches_single_process_under_its_precision(precision_runs, index):
    plan, per_rank = precision_runs[index]
    mode = get_precision(plan.training.precision)
    loss, grads = _reference(plan)
    # bf16-mixed: the same autocast ops as one process (fp32 cut values), so tight; fp32 would be ~1e-2 off.
    # bf16: bf16 gradients summed over microbatches and tied copies in another order round differently.
    tolerance = 1e-3 if mode.autocast_dtype is not None else 4e-2
    for result in per_rank:
        assert result.losses[0] == pytest.approx(loss, rel=1e-4)
    found = gathered_grads(per_rank)
    assert set(found) == set(grads)
    for name, copies in found.items():
        for grad in copies:
            assert grad.dtype == mode.param_dtype, name  # bf16: bf16 gradients; mixed: fp32 (master) gradients
            scale = float(grads[name].abs().max()) + 1e-6
            torch.testing.assert_close(grad.float() / scale, grads[name].float() / scale, rtol=0.0, atol=tolerance)


def test_run_refuses_another_precision_than_the_plans(tmp_path):
    path, _ = make_plan(tmp_path, "p", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    with pytest.raises(ConfigError, match="--precision bf16-mixed but the plan was made for fp32"):
        launch_local(path, RunConfig(steps=1, precision="bf16-mixed"))
    options = dict(schedule="1f1b", pipeline_devices=2, precision="fp16-mixed")
    path, _ = make_plan(tmp_path, "q", "gpt", TINY_GPT_TIED, **options)
    with pytest.raises(ConfigError, match="fp16-mixed needs CUDA"):
        launch_local(path, RunConfig(steps=1, device="cpu"))


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    grads = [torch.full((3,), 16.0)]
    scaler.unscale_(grads)
    assert torch.equal(grads[0], torch.full((3,), 2.0))
    scaler.overflowed()
    assert (scaler.scale, scaler.skipped_steps) == (4.0, 1)
    scaler.stepped()
    assert scaler.scale == 4.0
    scaler.stepped()
    assert scaler.scale == 8.0


def test_memory_line_shows_measured_and_predicted_per_rank():
    plan = manual_plan("gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2, num_microbatches=2)
    plan = dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, peak_memory_bytes=(2 << 30, 4 << 30))
    )
    assert memory_versus(plan, [1 << 30, 3 << 30]) == "r0 1.00/2.00 r1 3.00/4.00 (measured/predicted)"
    assert memory_versus(plan, None) == ""  # CPU: not measured
    many = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, peak_memory_bytes=(1 << 30,) * 9))
    assert memory_versus(many, [1 << 30] * 8 + [2 << 30]).startswith("worst of 9 ranks: r8 2.00/1.00")


@pytest.mark.parametrize(("precision", "per_param"), [("fp32", 16.0), ("bf16-mixed", 16.0), ("bf16", 8.0)])
def test_manual_plans_count_the_precisions_bytes_per_parameter(precision, per_param):
    """adamw holds weights, gradients and two moments in the precision's parameter dtype (costs.optimizer)."""
    plan = manual_plan("mlp", schedule="1f1b", pipeline_devices=2, num_microbatches=2, precision=precision)
    assert plan.training.optimizer_bytes_per_param == per_param
