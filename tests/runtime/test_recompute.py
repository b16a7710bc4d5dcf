"""Activation recomputation per stage (plan `StagePlan.recompute`: none, selective, full): losses and gradients
equal the same run without it, bit for bit, dropout included (each forward's RNG is replayed), under split (zb-h1,
zbv, zb-h2) and fused (1f1b, gpipe) backwards; the activations held between F and the backward drop; bad modes are
one-line errors. Single-process cases run one rank's Executor in this process (every stage on one device); the
gloo cases launch 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
from helpers.runtime import TINY_GPT, TINY_RESNET, assert_matches_reference, make_plan

from pipeplan.errors import ConfigError, FormatError, RunError
from pipeplan.models import load_model
from pipeplan.plan.manual import manual_plan
from pipeplan.plan.plan import Plan
from pipeplan.profiling.measure import profile_model
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.step.executor import Executor
from pipeplan.runtime.step.messages import build_routing
from pipeplan.runtime.step.stages import build_pipeline_model, check_plan_runs
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.trainer import microbatches_for

pytestmark = pytest.mark.timeout(400)

DROPOUT_GPT = {**TINY_GPT, "dropout": 0.3}
ONE_STEP = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=30.0)


def _one_rank_step(schedule: str, recompute, *, options=DROPOUT_GPT, device="cpu", microbatches=3):
    """One step of a whole pipeline on one rank, in this process: (executor, step record, gradients)."""
    plan = manual_plan(
        "gpt",
        options,
        schedule=schedule,
        pipeline_devices=1,
        num_microbatches=microbatches,
        microbatch_size=2,
        recompute=recompute,
    )
    device = torch.device(device)
    model = build_pipeline_model(plan, 0, device)
    executor = Executor(
        plan, 0, model, build_routing(plan, model.stage_io, model.model_inputs, model.differentiable), device
    )
    executor.track_saved = True
    batch = next(model.spec.batches(plan.training.global_batch_size, plan.training.seed))
    wanted = {o.microbatch for o in executor.ops if o.kind == "F"}
    record = executor.run_step(microbatches_for(plan, 0, batch, wanted, device), step=0)
    grads = {name: p.grad.clone() for name, p in model.params.items() if p.grad is not None}
    return executor, record, grads


@pytest.mark.parametrize(
    ("schedule", "modes"),
    [
        ("zbv", ("full", "full")),
        ("zbv", ("selective", "full")),
        ("zbv", ("none", "selective")),
        ("zb-h1", ("full",)),
        ("1f1b", ("full",)),
        ("gpipe", ("selective",)),
    ],
)
def test_recomputation_is_bit_exact_with_dropout(schedule, modes):
    _, plain, expected = _one_rank_step(schedule, None)
    _, record, grads = _one_rank_step(schedule, modes)
    assert torch.equal(record.loss_sum, plain.loss_sum)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name


def test_recomputation_drops_the_activations_the_profile_says():
    """gpipe runs every F before any B, so all microbatches' saved tensors are held at once. `selective` drops
    exactly the attention internals the measured profile finds (math-path attention: dropout is on), `full` keeps
    only the stage's input; between I and W (zbv) only what W reads stays, recomputed or not."""
    microbatches = 3
    held = {
        mode: _one_rank_step("gpipe", (mode,), microbatches=microbatches)[1].saved_peak_bytes
        for mode in ("none", "selective", "full")
    }
    profile = profile_model(
        load_model("gpt", DROPOUT_GPT), batch_size=2, warmup=0, repeats=1, progress=False, precision="fp32"
    )
    internals = sum(layer.activation_bytes - layer.selective_activation_bytes for layer in profile.layers)
    assert internals > 0 and held["none"] - held["selective"] == microbatches * internals, held
    assert held["full"] == microbatches * profile.layers[0].full_activation_bytes, held  # the token ids
    split = {mode: _one_rank_step("zbv", (mode, mode))[1].saved_peak_bytes for mode in ("none", "full")}
    assert 0 < split["full"] < split["none"], split


def test_selective_leaves_a_fused_attention_kernel_alone():
    """Without dropout the CPU takes its fused (flash) attention kernel, which keeps no s×s internals: selective
    keeps what none keeps, as the profiles count it."""
    held = {
        mode: _one_rank_step("gpipe", (mode,), options=TINY_GPT)[1].saved_peak_bytes for mode in ("none", "selective")
    }
    assert held["none"] == held["selective"] > 0, held


def test_modes_are_checked_with_one_line():
    with pytest.raises(ConfigError, match="recompute mode 'fulll' is not one of none, selective, full"):
        manual_plan(
            "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2, num_microbatches=2, recompute=("fulll", "none")
        )
    with pytest.raises(ConfigError, match="recompute gives 1 modes for 2 stages"):
        manual_plan("gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2, num_microbatches=2, recompute=("full",))
    plan = manual_plan("gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2, num_microbatches=2)
    data = plan.to_dict()
    assert [stage["recompute"] for stage in data["stages"]] == ["none", "none"]
    del data["stages"][0]["recompute"]  # plans written before the field: none
    assert Plan.from_dict(data).stages[0].recompute == "none"
    data["stages"][1]["recompute"] = "everything"
    with pytest.raises(FormatError, match="plan stage 1: recompute mode 'everything' is not one of"):
        Plan.from_dict(data)
    data["stages"][1]["recompute"] = 3
    with pytest.raises(FormatError, match="recompute must be a string"):
        Plan.from_dict(data)


def test_selective_on_a_stage_without_attention_is_refused(tmp_path):
    _, plan = make_plan(
        tmp_path,
        "mlp",
        "mlp",
        dict(layers=4, hidden=8),
        schedule="1f1b",
        pipeline_devices=2,
        recompute=("selective", "none"),
    )
    with pytest.raises(RunError, match="stage 0 asks for selective recomputation but calls no"):
        check_plan_runs(plan)


def _same_run(got, expected, label: str) -> None:
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.losses == theirs.losses, label
        assert (mine.grads or {}).keys() == (theirs.grads or {}).keys(), label
        for name, grad in (mine.grads or {}).items():
            assert torch.equal(grad, theirs.grads[name]), f"{label} {name}"


@pytest.mark.slow
def test_two_ranks_recomputation_matches_the_run_without_it(tmp_path):
    cases = [  # label, model, options, layout, modes
        ("gpt dropout zb-h1", "gpt", DROPOUT_GPT, dict(schedule="zb-h1"), ("full", "selective")),
        ("gpt dropout 1f1b", "gpt", DROPOUT_GPT, dict(schedule="1f1b"), ("none", "full")),
        ("gpt dropout zbv", "gpt", DROPOUT_GPT, dict(schedule="zbv"), ("full", "selective", "none", "full")),
        ("resnet 1f1b", "resnet", TINY_RESNET, dict(schedule="1f1b"), ("full", "full")),
    ]
    runs, plans = [], []
    for index, (_, model, options, layout, modes) in enumerate(cases):
        for recompute in (None, modes):
            path, plan = make_plan(
                tmp_path,
                f"c{index}-{bool(recompute)}",
                model,
                options,
                pipeline_devices=2,
                recompute=recompute,
                **layout,
            )
            runs.append((path, ONE_STEP))
            plans.append(plan)
    results = launch_many(runs, capture_grads=True, threads=1)
    for index, (label, *_) in enumerate(cases):
        plain, recomputed = ([rank[2 * index + k] for rank in results] for k in (0, 1))
        _same_run(recomputed, plain, label)
    assert_matches_reference(plans[-1], [rank[len(runs) - 1] for rank in results], "resnet 1f1b full")


@pytest.mark.slow
def test_four_ranks_recomputation_matches_single_process(tmp_path):
    cases = [
        (
            "gpt zb-h2 4 stages",
            dict(schedule="zb-h2", pipeline_devices=4, num_microbatches=8, microbatch_size=1),
            ("full", "selective", "none", "full"),
        ),
        ("gpt 1f1b dp2", dict(schedule="1f1b", pipeline_devices=2, data_parallel=2), ("selective", "full")),
    ]
    plans = [
        make_plan(tmp_path, f"c{i}", "gpt", TINY_GPT, recompute=modes, **layout)
        for i, (_, layout, modes) in enumerate(cases)
    ]
    results = launch_many([(path, ONE_STEP) for path, _ in plans], capture_grads=True, threads=1)
    for index, ((label, *_), (_, plan)) in enumerate(zip(cases, plans, strict=True)):
        assert_matches_reference(plan, [rank[index] for rank in results], label)


@pytest.mark.gpu
def test_recomputation_lowers_the_measured_cuda_peak():
    """On CUDA, gpipe over 8 microbatches: full recomputation keeps only stage inputs, so the allocator's peak falls
    (by about the saved activations of 7 microbatches), and selective sits between."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    options = dict(layers=4, hidden=256, heads=8, seq=256, vocab=512, dropout=0.1)
    peaks = {}
    for mode in ("none", "selective", "full"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        executor, record, _ = _one_rank_step("gpipe", (mode,), options=options, device="cuda", microbatches=8)
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        del executor, record
    assert peaks["full"] < 0.5 * peaks["none"], peaks
    assert peaks["selective"] <= peaks["none"], peaks
