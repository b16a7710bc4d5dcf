"""Multi-process gloo tests: every schedule, replicated stages, data parallelism, skip connections and tied
weights give the single-process loss and gradients after one step; training lowers the loss and matches a
single-process AdamW run; a resumed run continues exactly where an uninterrupted one is.

Start-up dominates (torch import per process), so one 2-rank launch runs every 2-rank case and one 4-rank launch
the rest; the tests below check different parts of those launches' results."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from helpers.runtime import (
    TINY_GPT,
    TINY_GPT_TIED,
    TINY_MLP,
    TINY_RESNET,
    assert_matches_reference,
    make_plan,
    reference_losses,
    save_plan,
)

from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.step.pair_runner import MARGIN, PROBE_STEPS, WARMUP_STEPS
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.config import RunConfig
from pipeplan.schedules.ops import OVERLAP, Op
from pipeplan.schedules.registry import schedule_names

SYNCHRONOUS = schedule_names(asynchronous=False)  # asynchronous schedules: tests/runtime/test_async_run.py

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # multi-process runs

ONE_STEP = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=30.0)
AUTO_STEPS = WARMUP_STEPS + PROBE_STEPS + 1  # the warm-up, the probe, one step the way chosen
TOY = str(Path(__file__).with_name("toy_models.py")) + ":repeated_gpt"
INPUT_SKIP = str(Path(__file__).with_name("toy_models.py")) + ":input_skip_mlp"
TRAIN_STEPS, LR = 20, 3e-3
TRAINING = dict(quiet=True, lr=LR, heartbeat_timeout_s=30.0)
DUALPIPE_STEPS = 3
FUSED_GPT = {**TINY_GPT, "dropout": 0.1}  # dropout: each half's forward draws its own seeded randomness


def as_halves(rank_ops):
    """The op lists with every overlapped F&B op written as its forward then its backward (run one after the
    other)."""
    return tuple(tuple(str(h) for text in ops for h in Op.parse(text).parts) for ops in rank_ops)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """(cases, results): results[rank][i] for the i-th run; cases[label] = (index, plan)."""
    folder = tmp_path_factory.mktemp("two-ranks")
    runs, cases = [], {}

    def add(label, path, plan, config=ONE_STEP):
        cases[label] = (len(runs), plan)
        runs.append((path, config))

    for index, schedule in enumerate(SYNCHRONOUS):
        options = TINY_GPT_TIED if index % 2 else TINY_GPT  # tied embeddings on half the schedules
        add(
            f"gpt {schedule}",
            *make_plan(folder, f"gpt-{schedule}", "gpt", options, schedule=schedule, pipeline_devices=2),
        )
    for schedule in ("1f1b", "zbv"):  # resnet's long skip jumps from the stem's stage to the last block's
        add(
            f"resnet {schedule}",
            *make_plan(folder, f"res-{schedule}", "resnet", TINY_RESNET, schedule=schedule, pipeline_devices=2),
        )
    # dualpipev's overlapped F&B ops, and the same op lists with each pair as its halves one after the other
    path, plan = make_plan(folder, "fused", "gpt", FUSED_GPT, schedule="dualpipev", pipeline_devices=2)
    add("dualpipev overlapped", path, plan, dataclasses.replace(ONE_STEP, overlap_pairs="on"))
    add("dualpipev pairs in order", path, plan, dataclasses.replace(ONE_STEP, overlap_pairs="off"))
    add("dualpipev auto", path, plan, dataclasses.replace(ONE_STEP, steps=AUTO_STEPS))
    halves = dataclasses.replace(plan, rank_ops=as_halves(plan.rank_ops))
    add("dualpipev halves", save_plan(folder, "halves", halves), halves)
    # dualpipe's two copies of each stage trained three steps, compared after every step (--check-every 1)
    path, plan = make_plan(folder, "dualpipe-train", "gpt", TINY_GPT, schedule="dualpipe", pipeline_devices=2)
    add("dualpipe train", path, plan, RunConfig(steps=DUALPIPE_STEPS, check_every=1, **TRAINING))
    path, plan = make_plan(folder, "input-skip", INPUT_SKIP, {}, schedule="zb-h1", pipeline_devices=2)
    add("model input read by the last stage", path, plan)
    path, plan = make_plan(folder, "toy", TOY, {}, schedule="zbv", pipeline_devices=2)
    common = TRAINING
    add("train", path, plan, RunConfig(steps=TRAIN_STEPS, check_every=5, **common))
    checkpoints = str(folder / "ckpt")
    add("first half", path, plan, RunConfig(steps=3, checkpoint_dir=checkpoints, checkpoint_every=2, **common))
    add("resumed", path, plan, RunConfig(steps=6, checkpoint_dir=checkpoints, resume=True, **common))
    results = launch_many(runs, capture_grads=True, threads=1)
    return cases, results, checkpoints


def _per_rank(results, index):
    return [per_rank[index] for per_rank in results]


@pytest.mark.parametrize("schedule", SYNCHRONOUS)
def test_every_schedule_matches_single_process(two_rank_runs, schedule):
    cases, results, _ = two_rank_runs
    index, plan = cases[f"gpt {schedule}"]
    assert_matches_reference(plan, _per_rank(results, index), f"gpt {schedule}")


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_skip_connections_across_stages(two_rank_runs, schedule):
    cases, results, _ = two_rank_runs
    index, plan = cases[f"resnet {schedule}"]
    assert_matches_reference(plan, _per_rank(results, index), f"resnet {schedule}")


@pytest.mark.parametrize(
    ("label", "way"), [("dualpipev overlapped", "overlapped"), ("dualpipev pairs in order", "in order")]
)
def test_overlapped_pairs_equal_their_halves_bit_for_bit(two_rank_runs, label, way):
    cases, results, _ = two_rank_runs
    fused_index, plan = cases[label]
    halves_index, halves = cases["dualpipev halves"]
    assert any(OVERLAP in text for ops in plan.rank_ops for text in ops)
    assert not any(OVERLAP in text for ops in halves.rank_ops for text in ops)
    fused, apart = _per_rank(results, fused_index), _per_rank(results, halves_index)
    for a, b in zip(fused, apart, strict=True):
        assert a.pairs.startswith(way), a.pairs
        assert b.pairs is None  # no fused op left
        assert a.losses == b.losses
        assert a.grads.keys() == b.grads.keys() and a.grads
        for name, grad in a.grads.items():
            assert torch.equal(grad, b.grads[name]), name
    # (vs the single-process reference: "gpt dualpipev" of test_every_schedule_matches_single_process, no dropout)


def test_auto_pairs_keep_the_way_their_probe_timed_faster(two_rank_runs):
    cases, results, _ = two_rank_runs
    index, _ = cases["dualpipev auto"]
    for result in _per_rank(results, index):
        probe = r"\(auto: passes per step in order ([\d.]+) ms, overlapped ([\d.]+) ms\)"
        found = re.fullmatch(r"(overlapped|in order) " + probe, result.pairs)
        assert found, result.pairs
        way, in_order, overlapped = found[1], float(found[2]), float(found[3])
        if way == "overlapped":  # (the figures are rounded to 0.1 ms)
            assert overlapped <= (1 - MARGIN) * in_order + 0.1, result.pairs
        else:
            assert overlapped >= (1 - MARGIN) * in_order - 0.1, result.pairs
        assert len(result.losses) == AUTO_STEPS
    first = _per_rank(results, cases["dualpipev overlapped"][0])
    assert [r.losses[0] for r in _per_rank(results, index)] == [r.losses[0] for r in first]


def test_dualpipe_copies_train_like_single_process_adamw(two_rank_runs):
    """Both ranks hold both stages (one copy per direction); their gradients are summed, so the mirrored copies
    take the same AdamW steps: the single-process losses, and the copies' checksums agree after every step."""
    cases, results, _ = two_rank_runs
    index, plan = cases["dualpipe train"]
    assert [info.stages for info in plan.ranks] == [(0, 1), (1, 0)]
    losses = results[0][index].losses
    assert len(losses) == DUALPIPE_STEPS and losses == results[1][index].losses
    expected = reference_losses(plan, DUALPIPE_STEPS, lr=LR, weight_decay=plan.training.weight_decay)
    torch.testing.assert_close(losses, expected, rtol=2e-4, atol=1e-5)


def test_model_input_read_by_a_later_stage(two_rank_runs):
    cases, results, _ = two_rank_runs
    index, plan = cases["model input read by the last stage"]
    last = build_pipeline_model(plan, 1, torch.device("cpu")).stage_io[-1]
    assert "x" in last.inputs  # the batch feeds the last stage directly
    assert_matches_reference(plan, _per_rank(results, index), "input skip")


def test_training_lowers_loss_like_single_process_adamw(two_rank_runs):
    cases, results, _ = two_rank_runs
    index, plan = cases["train"]
    losses = results[0][index].losses
    assert len(losses) == TRAIN_STEPS and losses == results[1][index].losses
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    expected = reference_losses(plan, TRAIN_STEPS, lr=LR, weight_decay=plan.training.weight_decay)
    torch.testing.assert_close(losses, expected, rtol=2e-4, atol=1e-5)


def test_resumed_run_reaches_the_same_losses(two_rank_runs):
    cases, results, checkpoints = two_rank_runs
    uninterrupted = results[0][cases["train"][0]].losses
    resumed = results[0][cases["resumed"][0]]
    assert resumed.first_step == 3  # the first half's last checkpoint (written after its final step)
    torch.testing.assert_close(resumed.losses, uninterrupted[3:6], rtol=1e-6, atol=1e-7)
    assert (Path(checkpoints) / "latest").read_text().strip() == "step_00000006"


def test_four_ranks_replicas_data_parallel_and_ties(tmp_path):
    cases = []
    layouts = [
        ("mlp stage 0 x2", "mlp", TINY_MLP, dict(schedule="1f1b", pipeline_devices=3, replicas=(2, 1, 1))),
        ("gpt tied, last stage x3", "gpt", TINY_GPT_TIED, dict(schedule="zb-h1", pipeline_devices=2, replicas=(1, 3))),
        (
            "gpt tied dualpipev dp2",
            "gpt",
            TINY_GPT_TIED,
            dict(schedule="dualpipev", pipeline_devices=2, data_parallel=2),
        ),
        (
            "gpt dualpipe 4 stages",  # each rank holds stages d and 3-d; microbatches enter at ranks 0 and 3
            "gpt",
            TINY_GPT_TIED,
            dict(schedule="dualpipe", pipeline_devices=4, num_microbatches=8),
        ),
        (
            "resnet interleaved dp2",
            "resnet",
            TINY_RESNET,
            dict(schedule="interleaved", pipeline_devices=2, data_parallel=2),
        ),
        (
            "gpt zb-h2 4 stages",
            "gpt",
            TINY_GPT,
            dict(schedule="zb-h2", pipeline_devices=4, num_microbatches=8, microbatch_size=1),
        ),
        (
            "mlp 1 stage x2, dp2",
            "mlp",
            TINY_MLP,
            dict(schedule="1f1b", pipeline_devices=1, replicas=(2,), data_parallel=2),
        ),
    ]
    for index, (label, model, options, layout) in enumerate(layouts):
        path, plan = make_plan(tmp_path, f"case{index}", model, options, **layout)
        cases.append((label, path, plan))
    # the dualpipev case sends over one process group per direction (the default, the transport NCCL needs); the
    # others over one group for both directions, so both transports stay exact
    configs = [dataclasses.replace(ONE_STEP, direction_groups="dualpipev" in label) for label, _, _ in cases]
    results = launch_many([(path, c) for (_, path, _), c in zip(cases, configs)], capture_grads=True, threads=1)
    for index, (label, _, plan) in enumerate(cases):
        assert_matches_reference(plan, _per_rank(results, index), label)
