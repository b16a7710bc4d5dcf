"""`pipeplan run --clip-grad-norm` and `--post-validate` on gloo (2 and 4 ranks, CPU).

- Clipping is torch.nn.utils.clip_grad_norm_ over the whole model: a clipped 2-rank run follows a single-process
  AdamW run that clips with it (losses and global norms of every step, every rank's clipped first-step gradients).
- A post-validated run equals the synchronized run of the same options exactly (torch.equal): losses, global norms,
  parameters and full per-parameter AdamW state, when nothing triggers, when clipping triggers on some or all steps
  (then exactly those steps were rolled back, and the step each one's verdict found already started was discarded
  and run again), with a NaN put into one rank's gradient at one step (fp32: both stop
  at that step with the weights of the step before; fp16-style loss scaling: both skip that step and halve the scale),
  with ZeRO-1, tied weights across stages, data-parallel pipelines and replicated stages.
The production path (launch_many, checkpoints, PIPEPLAN_FAULT mode=nan, the CLI flags) and direct `Trainer` runs
(post_validate_ranks.py: NaN at a given step, loss scaling on the CPU, state after a stop) share one launch per
world size each."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.post_validate_ranks import Case, run_cases
from helpers.runtime import (
    TINY_GPT,
    TINY_GPT_TIED,
    TINY_MLP,
    checkpoint_files,
    gathered_grads,
    make_plan,
    reference_training,
)

from pipeplan.errors import RunError
from pipeplan.runtime.launch.local import launch_local, launch_many
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.step_checks import clip_coefficient
from pipeplan.runtime.weights import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # multi-process runs

STEPS, LR = 4, 3e-3
CLIP_ALL, CLIP_SOME = 1e-2, 0.8  # the tiny gpt's global norms are ~0.6-1.2 over these steps
BASE = RunConfig(steps=STEPS, quiet=True, lr=LR, heartbeat_timeout_s=30.0)
LAYOUTS_2 = {
    "1f1b": ("gpt", TINY_GPT, dict(schedule="1f1b", pipeline_devices=2)),
    "tied zb-h1 zero1": ("gpt", TINY_GPT_TIED, dict(schedule="zb-h1", pipeline_devices=2, zero=1)),
    "dp zero1": ("gpt", TINY_GPT, dict(schedule="1f1b", pipeline_devices=1, data_parallel=2, zero=1)),
}
LAUNCHED_2 = [
    ("1f1b", None),
    ("1f1b", CLIP_ALL),
    ("1f1b", CLIP_SOME),
    ("tied zb-h1 zero1", CLIP_SOME),
    ("dp zero1", CLIP_SOME),
]


def _label(layout: str, clip: float | None, post: bool) -> str:
    return f"{layout} clip={clip} {'post' if post else 'sync'}"


def _clipped_steps(grad_norms: list[float], clip: float | None) -> int:
    return sum(clip_coefficient(norm, clip) < 1.0 for norm in grad_norms)


def _assert_equal_states(sync: dict, post: dict, label: str) -> None:
    """name -> {key: tensor or number}: identical keys and bitwise-equal values."""
    assert sync.keys() == post.keys(), label
    for name, state in sync.items():
        assert state.keys() == post[name].keys(), (label, name)
        for key, value in state.items():
            other = post[name][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{label}: {name} {key} differs"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The production path: one 2-rank launch of every (layout, clip) pair, synchronized and post-validated."""
    folder = tmp_path_factory.mktemp("post-validate")
    runs, labels, plans = [], [], {}
    for layout, clip in LAUNCHED_2:
        model, options, shape = LAYOUTS_2[layout]
        path, plans[layout] = make_plan(folder, layout.replace(" ", "-"), model, options, **shape)
        for post in (False, True):
            labels.append(_label(layout, clip, post))
            ckpt = str(folder / labels[-1].replace(" ", "_"))
            runs.append((path, dataclasses.replace(BASE, clip_grad_norm=clip, post_validate=post, checkpoint_dir=ckpt)))
    results = launch_many(runs, capture_grads=True, threads=1)
    by_label = {
        label: ([per_rank[index] for per_rank in results], runs[index][1]) for index, label in enumerate(labels)
    }
    return by_label, plans


@pytest.mark.parametrize(("layout", "clip"), LAUNCHED_2)
def test_post_validated_run_equals_the_synchronized_one(launched, layout, clip):
    by_label, _ = launched
    sync, sync_config = by_label[_label(layout, clip, False)]
    post, post_config = by_label[_label(layout, clip, True)]
    for a, b in zip(sync, post, strict=True):
        assert len(a.losses) == len(b.losses) == STEPS
        assert a.losses == b.losses and a.grad_norms == b.grad_norms
        assert a.rollbacks == a.redone == 0
        assert b.rollbacks == _clipped_steps(a.grad_norms, clip)  # rolled back exactly where clipping was needed
        # each rollback found the next step started on the eager weights and ran it again, but the last step's and
        # the first's (capture_grads settles the first step before the second starts)
        assert b.redone == _clipped_steps(a.grad_norms[1:-1], clip)
    files, post_files = checkpoint_files(sync_config.checkpoint_dir), checkpoint_files(post_config.checkpoint_dir)
    assert files.keys() == post_files.keys()
    for name, saved in files.items():
        _assert_equal_states({"params": saved["params"]}, {"params": post_files[name]["params"]}, f"{layout} {name}")
        _assert_equal_states(saved["optimizer"], post_files[name]["optimizer"], f"{layout} {name}")


def test_clip_values_trigger_as_intended(launched):
    """The cases above cover no trigger (clip None), every step and some steps (what the rollback counts test)."""
    by_label, _ = launched
    (post, _) = by_label[_label("1f1b", CLIP_SOME, True)]
    assert 0 < post[0].rollbacks < STEPS
    (post, _) = by_label[_label("1f1b", CLIP_ALL, True)]
    assert post[0].rollbacks == STEPS


@pytest.mark.parametrize("layout", ["1f1b", "tied zb-h1 zero1", "dp zero1"])
def test_clipping_matches_single_process_clip_grad_norm(launched, layout):
    by_label, plans = launched
    result, _ = by_label[_label(layout, CLIP_SOME, False)]
    plan = plans[layout]
    reference = reference_training(
        plan, STEPS, lr=LR, weight_decay=plan.training.weight_decay, clip_grad_norm=CLIP_SOME
    )
    losses, norms, grads = reference.losses, reference.grad_norms, reference.first_grads
    assert clip_coefficient(norms[0], CLIP_SOME) < 1.0  # the first step is clipped
    torch.testing.assert_close(result[0].losses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result[0].grad_norms, norms, rtol=1e-5, atol=1e-7)
    found = gathered_grads(result)  # every holder's first-step gradients, after clipping
    assert found.keys() == grads.keys()
    for name, copies in found.items():
        for grad in copies:
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _direct_pair(label: str, path: str, **case) -> list[Case]:
    config = dataclasses.replace(BASE, clip_grad_norm=case.pop("clip", None))
    return [
        Case(f"{label} {kind}", path, dataclasses.replace(config, post_validate=kind == "post"), **case)
        for kind in ("sync", "post")
    ]


def _same_floats(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _assert_pair(outcomes: dict, label: str) -> None:
    sync, post = outcomes[f"{label} sync"], outcomes[f"{label} post"]
    for rank, (a, b) in enumerate(zip(sync, post, strict=True)):
        where = f"{label} rank {rank}"
        assert a.losses == b.losses and a.error == b.error, where
        assert _same_floats(a.grad_norms, b.grad_norms), where  # a skipped step's norm is nan in both
        assert (a.skipped_steps, a.final_scale) == (b.skipped_steps, b.final_scale), where
        _assert_equal_states({"params": a.params}, {"params": b.params}, where)
        _assert_equal_states(a.states, b.states, where)


def _expected_rollbacks(outcome, clip: float | None) -> int:
    """Steps a post-validated run undoes: the clipped ones, plus the step that stopped or skipped for NaN/inf."""
    finite = [n for n in outcome.grad_norms if math.isfinite(n)]
    return _clipped_steps(finite, clip) + (len(outcome.grad_norms) - len(finite)) + (outcome.error is not None)


def test_nan_at_one_step_two_ranks(tmp_path):
    gpt, _ = make_plan(tmp_path, "gpt", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2)
    tied, _ = make_plan(tmp_path, "tied", "gpt", TINY_GPT_TIED, schedule="zb-h1", pipeline_devices=2, zero=1)
    cases = [
        *_direct_pair("fp32 nan", gpt, nan_at=(1, 2)),
        *_direct_pair("scaled nan", gpt, nan_at=(0, 1), loss_scale=2.0**10, clip=CLIP_SOME),
        *_direct_pair("zero1 scaled nan", tied, nan_at=(1, 2), loss_scale=2.0**10, clip=CLIP_SOME),
    ]
    outcomes = run_cases(cases, world_size=2)
    for label in ("fp32 nan", "scaled nan", "zero1 scaled nan"):
        _assert_pair(outcomes, label)
    for stopped in outcomes["fp32 nan post"]:
        assert stopped.error.startswith("step 3: gradients are not finite; stopped before the optimizer step")
        assert len(stopped.losses) == 2 and stopped.rollbacks == 1 and stopped.redone == 0  # found during step 4
    for label in ("scaled nan", "zero1 scaled nan"):
        for skipped in outcomes[f"{label} post"]:
            assert skipped.error is None and skipped.skipped_steps == 1 and skipped.final_scale == 2.0**9
            assert skipped.rollbacks == _expected_rollbacks(skipped, CLIP_SOME) >= 2
            assert skipped.redone >= 1  # the skipped step's successor ran on the eager weights, then again


def test_four_ranks_no_trigger_clipping_and_nan(tmp_path):
    deep, _ = make_plan(tmp_path, "deep", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=4)
    dp_tied, _ = make_plan(
        tmp_path, "dp-tied", "gpt", TINY_GPT_TIED, schedule="zb-h1", pipeline_devices=2, data_parallel=2, zero=1
    )
    replicas, _ = make_plan(tmp_path, "rep", "mlp", TINY_MLP, schedule="1f1b", pipeline_devices=3, replicas=(2, 1, 1))
    cases = [
        *_direct_pair("4 stages", deep),
        *_direct_pair("4 stages scaled nan", deep, nan_at=(2, 1), loss_scale=2.0**10, clip=CLIP_SOME),
        *_direct_pair("dp tied zero1", dp_tied),
        *_direct_pair("dp tied zero1 scaled nan", dp_tied, nan_at=(3, 2), loss_scale=2.0**10, clip=CLIP_SOME),
        *_direct_pair("replicas clip", replicas, clip=CLIP_ALL),
        *_direct_pair("replicas fp32 nan", replicas, nan_at=(1, 1)),
    ]
    outcomes = run_cases(cases, world_size=4)
    for label in {case.label.rsplit(" ", 1)[0] for case in cases}:
        _assert_pair(outcomes, label)
    for label in ("4 stages", "dp tied zero1"):
        assert all(o.rollbacks == 0 and o.error is None for o in outcomes[f"{label} post"])
    assert all(o.rollbacks == STEPS and o.redone == STEPS - 1 for o in outcomes["replicas clip post"])
    for label in ("4 stages scaled nan", "dp tied zero1 scaled nan"):
        for skipped in outcomes[f"{label} post"]:
            assert skipped.skipped_steps == 1 and skipped.rollbacks == _expected_rollbacks(skipped, CLIP_SOME)
    assert all(o.error.startswith("step 2: gradients are not finite") for o in outcomes["replicas fp32 nan post"])


def test_injected_nan_stops_a_post_validated_run_and_saves_nothing_of_it(tmp_path, monkeypatch):
    path, _ = make_plan(tmp_path, "nan", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2)
    ckpt = tmp_path / "ckpt"
    config = dataclasses.replace(BASE, steps=5, checkpoint_dir=str(ckpt), checkpoint_every=1, post_validate=True)
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=0,step=2,mode=nan")
    with pytest.raises(RunError, match=r"step 3: gradients are not finite; stopped before the optimizer step"):
        launch_local(path, config, threads=1)
    assert checkpoint.latest_step(ckpt) == 2


def test_cli_flags_reach_the_ranks_and_the_summary(tmp_path):
    path, _ = make_plan(tmp_path, "cli", "gpt", TINY_GPT_TIED, schedule="zb-h1", pipeline_devices=2)
    flags = ["--steps", "2", "--threads", "1", "--clip-grad-norm", str(CLIP_ALL), "--post-validate"]
    args = [sys.executable, "-m", "pipeplan", "run", path, *flags]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=200)
    assert proc.returncode == 0, proc.stderr
    assert "clipped 2 of 2 steps (--clip-grad-norm 0.01)" in proc.stdout
    assert "post-validate: 2 of 2 eager optimizer steps rolled back and redone" in proc.stdout
