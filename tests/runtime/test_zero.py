"""ZeRO-1 (training.zero = 1, runtime/step/zero.py) on gloo: the same plan run with zero=1 gives the losses, gradients,
parameters and (gathered) AdamW state of zero=0 after several steps, for data-parallel pipelines, tied weights across
stages and replicated stages (groups of 2, 3 and 4 ranks); its checkpoints resume exactly, also from a zero=0
checkpoint; each rank holds 1/d of the shared parameters' optimizer state.

One 2-rank launch runs every 2-rank case and one 4-rank launch the rest (start-up dominates)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from helpers.runtime import (
    TINY_GPT,
    TINY_GPT_TIED,
    TINY_MLP,
    assert_matches_reference,
    build_reference_model,
    make_plan,
)

from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # multi-process runs

STEPS, HALF = 4, 2
TOL = dict(rtol=1e-6, atol=1e-6)
BASE = RunConfig(steps=STEPS, quiet=True, lr=3e-3, heartbeat_timeout_s=30.0, check_every=2)


class Launch:
    """Runs collected for one launch_many call; `result(label)` gives the per-rank results of one."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.runs, self.index, self.plans = folder, [], {}, {}
        self.results = None

    def add(self, label: str, model: str, options: dict, config: RunConfig = BASE, **layout) -> str:
        """Add a run of a fresh plan; returns its checkpoint directory (written after the last step)."""
        path, plan = make_plan(self.folder, label, model, options, **layout)
        return self.add_plan(label, path, plan, config)

    def add_plan(self, label: str, path: str, plan, config: RunConfig) -> str:
        ckpt = config.checkpoint_dir or str(self.folder / f"ckpt-{label}")
        self.index[label], self.plans[label] = len(self.runs), (path, plan)
        self.runs.append((path, dataclasses.replace(config, checkpoint_dir=ckpt)))
        return ckpt

    def launch(self) -> Launch:
        self.results = launch_many(self.runs, capture_grads=True, threads=1)
        return self

    def result(self, label: str) -> list:
        return [per_rank[self.index[label]] for per_rank in self.results]

    def checkpoint_dir(self, label: str) -> str:
        return self.runs[self.index[label]][1].checkpoint_dir


def _stage_files(root: str) -> dict[str, dict]:
    step = checkpoint.latest_step(root)
    return {p.name: torch.load(p, weights_only=True) for p in sorted(checkpoint.step_dir(root, step).glob("*.pt"))}


def assert_same_training(launch: Launch, zero0: str, zero1: str) -> None:
    """Equal losses on every rank, and equal final parameters and per-parameter AdamW state in the checkpoints."""
    for a, b in zip(launch.result(zero0), launch.result(zero1), strict=True):
        assert len(b.losses) == STEPS
        torch.testing.assert_close(b.losses, a.losses, **TOL, msg=lambda m: f"{zero1} losses: {m}")
    files0, files1 = _stage_files(launch.checkpoint_dir(zero0)), _stage_files(launch.checkpoint_dir(zero1))
    assert files0.keys() == files1.keys()
    for name, saved0 in files0.items():
        saved1 = files1[name]
        assert saved0["params"].keys() == saved1["params"].keys() == saved1["optimizer"].keys()
        for param, value in saved0["params"].items():
            torch.testing.assert_close(saved1["params"][param], value, **TOL, msg=lambda m, p=param: f"{p}: {m}")
            state0, state1 = saved0["optimizer"][param], saved1["optimizer"][param]
            assert state0.keys() == state1.keys() == {"step", "exp_avg", "exp_avg_sq"}, (param, state1.keys())
            for key in state0:
                where = f"{param} {key}"
                torch.testing.assert_close(state1[key], state0[key], **TOL, msg=lambda m, w=where: f"{w}: {m}")


def _param_count(plan) -> int:
    return sum(p.numel() for p in build_reference_model(plan)[1].parameters())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    launch = Launch(tmp_path_factory.mktemp("zero-2"))
    dp = dict(schedule="1f1b", pipeline_devices=1, data_parallel=2)
    for zero in (0, 1):
        launch.add(f"dp zero{zero}", "gpt", TINY_GPT, zero=zero, **dp)
        # a tied embedding shared by the two stages of one pipeline; zb-h1 splits the backward into I and W
        launch.add(f"tied zero{zero}", "gpt", TINY_GPT_TIED, zero=zero, schedule="zb-h1", pipeline_devices=2)
        for precision in ("bf16", "bf16-mixed"):
            launch.add(f"{precision} zero{zero}", "gpt", TINY_GPT, zero=zero, precision=precision, **dp)
    for zero in (0, 1):  # the first half writes a checkpoint at step 2; a zero=1 run resumes from it
        ckpt = launch.add(f"half zero{zero}", "gpt", TINY_GPT, dataclasses.replace(BASE, steps=HALF), zero=zero, **dp)
        path, plan = launch.plans["dp zero1"]
        launch.add_plan(
            f"resumed from zero{zero}", path, plan, dataclasses.replace(BASE, checkpoint_dir=ckpt, resume=True)
        )
    return launch.launch()


@pytest.mark.parametrize("case", ["dp", "tied", "bf16", "bf16-mixed"])
def test_zero1_trains_like_zero0(two_ranks, case):
    assert_same_training(two_ranks, f"{case} zero0", f"{case} zero1")


@pytest.mark.parametrize("case", ["dp", "tied"])
def test_zero1_first_step_gradients_match_single_process(two_ranks, case):
    _, plan = two_ranks.plans[f"{case} zero1"]
    assert plan.training.zero == 1
    assert_matches_reference(plan, two_ranks.result(f"{case} zero1"), f"{case} zero1")


def test_zero1_holds_half_the_optimizer_state(two_ranks):
    _, plan = two_ranks.plans["dp zero1"]
    count = _param_count(plan)  # every rank holds the whole model (one stage, two pipelines)
    for full, sharded in zip(two_ranks.result("dp zero0"), two_ranks.result("dp zero1"), strict=True):
        assert full.optimizer_state_numel == 2 * count  # exp_avg + exp_avg_sq
        assert sharded.optimizer_state_numel == 2 * math.ceil(count / 2)


def test_zero1_shards_a_tied_weight_across_stages(two_ranks):
    _, plan = two_ranks.plans["tied zero1"]
    tied = TINY_GPT_TIED["vocab"] * TINY_GPT_TIED["hidden"]  # the embedding that is the LM head
    full = [r.optimizer_state_numel for r in two_ranks.result("tied zero0")]
    sharded = [r.optimizer_state_numel for r in two_ranks.result("tied zero1")]
    assert sum(full) == 2 * (_param_count(plan) + tied)  # both ranks keep the tied weight's state
    assert [f - s for f, s in zip(full, sharded, strict=True)] == [2 * (tied - math.ceil(tied / 2))] * 2


@pytest.mark.parametrize("source", [0, 1])
def test_resume_into_zero1_is_exact(two_ranks, source):
    resumed = two_ranks.result(f"resumed from zero{source}")
    uninterrupted = two_ranks.result("dp zero1")
    assert resumed[0].first_step == HALF
    for a, b in zip(uninterrupted, resumed, strict=True):
        torch.testing.assert_close(b.losses, a.losses[HALF:], **TOL)
    final = _stage_files(two_ranks.checkpoint_dir("dp zero1"))
    for name, saved in _stage_files(two_ranks.checkpoint_dir(f"resumed from zero{source}")).items():
        for param, value in saved["params"].items():
            torch.testing.assert_close(value, final[name]["params"][param], **TOL)
            for key, state in saved["optimizer"][param].items():
                torch.testing.assert_close(state, final[name]["optimizer"][param][key], **TOL)


def test_four_ranks_replicated_stages_and_data_parallel(tmp_path):
    launch = Launch(tmp_path)
    layouts = {
        "mlp stage 0 x2": ("mlp", TINY_MLP, dict(schedule="1f1b", pipeline_devices=3, replicas=(2, 1, 1))),
        # stage 1 on 3 ranks (a padded buffer); the tied embedding on all 4
        "gpt tied, last stage x3": ("gpt", TINY_GPT_TIED, dict(schedule="zb-h1", pipeline_devices=2, replicas=(1, 3))),
        "mlp 1 stage x2, dp2": (
            "mlp",
            TINY_MLP,
            dict(schedule="1f1b", pipeline_devices=1, replicas=(2,), data_parallel=2),
        ),
    }
    for label, (model, options, layout) in layouts.items():
        for zero in (0, 1):
            launch.add(f"{label} zero{zero}", model, options, zero=zero, **layout)
    launch.launch()
    for label in layouts:
        assert_same_training(launch, f"{label} zero0", f"{label} zero1")
        assert_matches_reference(launch.plans[f"{label} zero1"][1], launch.result(f"{label} zero1"), label)
    _, plan = launch.plans["mlp 1 stage x2, dp2 zero1"]
    count = _param_count(plan)
    assert [r.optimizer_state_numel for r in launch.result("mlp 1 stage x2, dp2 zero1")] == [
        2 * math.ceil(count / 4)
    ] * 4
