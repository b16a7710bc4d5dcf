"""Multi-process gloo tests: every schedule, replicated stages, data parallelism, skip connections and tied
weights give the single-process loss and gradients after one step; training lowers the loss.

Start-up dominates (torch import per process), so each test launches once and runs many plans inside it."""

from __future__ import annotations

import pytest
from rt_helpers import TINY_GPT, TINY_GPT_TIED, TINY_MLP, TINY_RESNET, assert_matches_reference, make_plan

from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.launch import launch_many
from pipeplan.schedules.registry import SCHEDULE_NAMES

pytestmark = pytest.mark.timeout(240)

ONE_STEP = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=30.0)


def _check_all(cases, config=ONE_STEP):
    results = launch_many([(path, config) for _, path, _ in cases], capture_grads=True, threads=1)
    for index, (label, _, plan) in enumerate(cases):
        assert_matches_reference(plan, [per_rank[index] for per_rank in results], label)
    return results


def test_two_ranks_every_schedule_matches_single_process(tmp_path):
    cases = []
    for index, schedule in enumerate(SCHEDULE_NAMES):
        options = TINY_GPT_TIED if index % 2 else TINY_GPT  # tied embeddings on half the schedules
        path, plan = make_plan(tmp_path, f"gpt-{schedule}", "gpt", options, schedule=schedule, pipeline_devices=2)
        cases.append((f"gpt {schedule}", path, plan))
    for schedule in ("1f1b", "zbv"):  # resnet's long skip jumps from the stem's stage to the last block's
        path, plan = make_plan(
            tmp_path, f"resnet-{schedule}", "resnet", TINY_RESNET, schedule=schedule, pipeline_devices=2
        )
        cases.append((f"resnet {schedule}", path, plan))
    _check_all(cases)


def test_four_ranks_replicas_data_parallel_and_ties(tmp_path):
    cases = []
    path, plan = make_plan(
        tmp_path, "mlp-rep", "mlp", TINY_MLP, schedule="1f1b", pipeline_devices=3, replicas=(2, 1, 1)
    )
    cases.append(("mlp replicated stage 0", path, plan))
    path, plan = make_plan(
        tmp_path, "gpt-rep", "gpt", TINY_GPT_TIED, schedule="zb-h1", pipeline_devices=2, replicas=(1, 3)
    )
    cases.append(("gpt tied, last stage x3", path, plan))
    path, plan = make_plan(
        tmp_path, "gpt-dp", "gpt", TINY_GPT_TIED, schedule="dualpipev", pipeline_devices=2, data_parallel=2
    )
    cases.append(("gpt tied dualpipev dp2", path, plan))
    path, plan = make_plan(
        tmp_path, "resnet-dp", "resnet", TINY_RESNET, schedule="interleaved", pipeline_devices=2, data_parallel=2
    )
    cases.append(("resnet interleaved dp2", path, plan))
    path, plan = make_plan(
        tmp_path, "gpt-4", "gpt", TINY_GPT, schedule="zb-h2", pipeline_devices=4, num_microbatches=8, microbatch_size=1
    )
    cases.append(("gpt zb-h2 4 stages", path, plan))
    _check_all(cases)


def test_loss_decreases_over_twenty_steps(tmp_path):
    path, plan = make_plan(tmp_path, "gpt-train", "gpt", TINY_GPT_TIED, schedule="zbv", pipeline_devices=2)
    config = RunConfig(steps=20, quiet=True, lr=3e-3, check_every=5, heartbeat_timeout_s=30.0)
    results = launch_many([(path, config)], threads=1)
    losses = results[0][0].losses
    assert len(losses) == 20
    assert losses == results[1][0].losses  # every rank reports the all-reduced loss
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
