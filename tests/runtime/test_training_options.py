"""Training options without a launch: the learning-rate schedule against torch's own schedulers, the optimizer
the run steps decided against the plan and the model factory (one line before any rank starts), the data each
data-parallel pipeline reads, and the metrics log's lines."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.cli import one_error_line
from helpers.runtime import make_plan
from runtime.training_models import TEXT, TINY_TEXT, own_optimizer_lm
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.costs import numerics
from pipeplan.costs.optimizer import MAIN_STATE_BYTES, OPTIMIZER_STATES
from pipeplan.errors import ConfigError, ModelError
from pipeplan.models import load_model
from pipeplan.runtime.train.config import OPTIMIZERS, RunConfig
from pipeplan.runtime.train.metrics import MetricsLog, kept_lines, step_record
from pipeplan.runtime.train.optim import check_training, lr_factor, optimizer_factory, run_optimizer


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return make_plan(tmp_path_factory.mktemp("opt"), "p", TEXT, TINY_TEXT, schedule="1f1b", pipeline_devices=2)


def _torch_factors(schedule: str, warmup: int, decay: int, steps: int) -> list[float]:
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=1.0)
    S = torch.optim.lr_scheduler
    after = (
        S.CosineAnnealingLR(optimizer, T_max=decay - warmup)
        if schedule == "cosine"
        else S.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=decay - warmup)
    )
    if warmup:
        before = S.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=max(warmup - 1, 1))
        after = S.SequentialLR(optimizer, [before, after], milestones=[warmup])
    found = []
    for _ in range(steps):
        found.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        after.step()
    return found


@pytest.mark.parametrize(("schedule", "warmup", "decay"), [("cosine", 3, 10), ("linear", 0, 7), ("cosine", 0, 5)])
def test_schedule_factors_match_torch_schedulers(schedule, warmup, decay):
    ours = [lr_factor(s, schedule=schedule, warmup_steps=warmup, decay_steps=decay) for s in range(decay)]
    expected = _torch_factors(schedule, warmup, decay, decay)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-9)
    assert lr_factor(decay + 3, schedule=schedule, warmup_steps=warmup, decay_steps=decay) == 0.0
    assert lr_factor(4, schedule="constant", warmup_steps=warmup, decay_steps=decay) == (1.0 if warmup < 5 else 0.5)


def test_run_names_the_optimizers_the_planner_counts_with_their_state():
    assert set(OPTIMIZERS) == set(OPTIMIZER_STATES) - set(MAIN_STATE_BYTES)  # 16-bit state: engines only
    for name in OPTIMIZERS:
        param = torch.nn.Parameter(torch.ones(3))
        make = optimizer_factory(name, None, {"w": param}, lr=0.1, weight_decay=0.0, momentum=0.9)
        optimizer = make([param])
        param.grad = torch.ones(3)
        optimizer.step()
        tensors = [v for v in optimizer.state[param].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        assert len(tensors) == OPTIMIZER_STATES[name], name


def test_a_plan_with_16_bit_optimizer_state_is_refused_by_run(plan):
    """adamw-bf16state / -bf16moments are what Megatron's precision-aware optimizer keeps; the runtime keeps fp32."""
    _, base = plan
    spec = load_model(TEXT, TINY_TEXT)
    for name in MAIN_STATE_BYTES:
        sixteen = _with(base, optimizer=name, precision="bf16-main")
        with pytest.raises(ConfigError, match=f"16 bits \\({name}\\).*--format megatron"):
            run_optimizer(sixteen, spec, optimizer=None, momentum=None)


def _with(plan, **training):
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, **training))


def test_the_plan_decides_the_optimizer_and_run_may_only_confirm_it(plan):
    _, base = plan
    spec = load_model(TEXT, TINY_TEXT)
    sgd = _with(base, optimizer="sgd")
    assert run_optimizer(sgd, spec, optimizer=None, momentum=0.5) == "sgd"
    assert run_optimizer(sgd, spec, optimizer="sgd", momentum=None) == "sgd"
    with pytest.raises(ConfigError, match="--optimizer adamw but the plan counted memory for sgd"):
        run_optimizer(sgd, spec, optimizer="adamw", momentum=None)
    with pytest.raises(ConfigError, match="--momentum applies to --optimizer sgd only"):
        run_optimizer(base, spec, optimizer=None, momentum=0.5)
    in_bytes = _with(base, optimizer="12.0")
    with pytest.raises(ConfigError, match="names no optimizer; pass --optimizer"):
        run_optimizer(in_bytes, spec, optimizer=None, momentum=None)
    assert run_optimizer(in_bytes, spec, optimizer="sgd-nomomentum", momentum=None) == "sgd-nomomentum"
    tight = _with(base, optimizer="8.0", optimizer_bytes_per_param=8.0)  # fp32 weights + gradients, no state
    assert run_optimizer(tight, spec, optimizer="sgd-nomomentum", momentum=None) == "sgd-nomomentum"
    with pytest.raises(ConfigError, match="--optimizer adamw needs more than the 8.0 bytes per parameter"):
        run_optimizer(tight, spec, optimizer="adamw", momentum=None)


def test_a_factory_optimizer_and_schedule_exclude_the_flags_that_would_be_ignored(plan):
    _, base = plan
    own = own_optimizer_lm()
    assert check_training(base, own, RunConfig()) == "the model factory's"
    for config, flag in [
        (RunConfig(optimizer="adamw"), "--optimizer"),
        (RunConfig(lr_schedule="cosine"), "--lr-schedule"),
        (RunConfig(warmup_steps=2), "--warmup-steps"),
    ]:
        with pytest.raises(ConfigError, match=f"drop {flag}"):
            check_training(base, own, config)
    with pytest.raises(ConfigError, match="re-plan with --memory zero=0"):
        check_training(_with(base, zero=1), own, RunConfig())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(lr_schedule="cosine", warmup_steps=10, steps=10), "make --decay-steps larger than --warmup-steps"),
        (dict(lr_schedule="step"), "unknown --lr-schedule 'step'"),
        (dict(optimizer="lion"), "unknown --optimizer 'lion'"),
        (dict(warmup_steps=-1), "--warmup-steps must be >= 0"),
        (dict(momentum=-0.1), "--momentum must be a finite number >= 0"),
        (dict(seed=-1), "--seed must be >= 0"),
        (dict(trace_steps=0), "--trace-steps must be >= 1"),
    ],
)
def test_bad_training_options_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**options)


def test_run_refuses_an_optimizer_the_plan_did_not_count_before_any_rank_starts(plan):
    path, _ = plan
    line = one_error_line(CliRunner().invoke(app, ["run", path, "--optimizer", "sgd", "--steps", "1"]))
    assert "--optimizer sgd but the plan counted memory for adamw" in line


def test_each_pipeline_reads_its_shard_and_the_shards_make_the_global_batch():
    text = load_model(TEXT, TINY_TEXT)
    plain = dataclasses.replace(text, data=lambda batch_size, seed: text.data(batch_size, seed))  # no shard=
    for spec in (text, plain):
        whole = spec.batches(8, seed=3)
        shards = [spec.shard_batches(8, 3, (p, 2)) for p in range(2)]
        for _ in range(3):
            (inputs,), target = next(whole)
            parts = [next(s) for s in shards]
            assert all(part[0][0].shape[0] == 4 for part in parts)
            assert torch.equal(torch.cat([part[0][0] for part in parts]), inputs)
            assert torch.equal(torch.cat([part[1] for part in parts]), target)
    first, second = next(text.batches(8, seed=3)), next(text.batches(8, seed=4))
    assert not torch.equal(first[0][0], second[0][0])  # the seed orders the windows
    short = dataclasses.replace(text, data=lambda batch_size, seed, shard: text.data(batch_size - 2, seed))
    with pytest.raises(ModelError, match="gave a batch of 6 samples; the run needs 4"):
        next(short.shard_batches(8, 0, (0, 2)))


def _record(step: int) -> dict:
    kw = dict(lr=1e-3, grad_norm=0.5, step_ms=10.0, samples=8, tokens=16, predicted_ms=0.0)
    return step_record(step=step, loss=1.0 / 3.0 + step, **kw)


def test_the_log_keeps_full_precision_and_a_resume_keeps_whole_earlier_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    log = MetricsLog(str(path), None, start=0)
    for step in range(4):
        log.write(_record(step))
    log.close()
    with path.open("a") as handle:
        handle.write('{"step": 5, "loss": 0.12')  # a line a crash cut short
    first = json.loads(path.read_text().splitlines()[0])
    assert first["loss"] == 1.0 / 3.0 and first["tokens_per_s"] == 800 * 16 and first["predicted_step_ms"] is None
    assert [json.loads(line)["step"] for line in kept_lines(path, 2).splitlines()] == [1, 2]
    resumed = MetricsLog(str(path), None, start=3)  # resuming from the checkpoint at step 3
    resumed.write(_record(3))
    resumed.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    fresh = MetricsLog(str(path), None, start=0)  # a fresh run starts the file anew
    fresh.close()
    assert path.read_text() == ""


@pytest.mark.parametrize("optimizer", ["sgd-nomomentum", "adamw-bf16"])
def test_a_plan_records_the_optimizer_its_memory_was_counted_for(optimizer):
    """(sgd-nomomentum was recorded as sgd, whose momentum `show` then counted under ZeRO-1; an alias unfolds)"""
    from helpers.search import make_cluster, synthetic_profile

    from pipeplan.artifact.plan import ModelRef
    from pipeplan.artifact.timing import plan_memory
    from pipeplan.search.config import SearchConfig
    from pipeplan.search.emit import build_plan
    from pipeplan.search.search import search_plans

    profile = synthetic_profile(4, params=1_000_000, activation_bytes=1_000_000)
    config = SearchConfig(
        global_batch_size=16,
        pipeline_depths=(1,),
        zero=1,
        numerics=numerics(optimizer, "bf16-mixed"),
    )
    result = search_plans(profile, make_cluster(4, memory=1 << 30), config)
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    assert plan.training.optimizer == optimizer.split("-bf16")[0]
    assert plan_memory(plan) == result.best.memory
