"""Mixture-of-experts models planned into 2 stages and run on 2 gloo ranks, against a single process: loss and every
gradient equal, router auxiliary losses included (the router logits of stage 0 travel across the cut to the last
stage's loss). transformers' mixtral, qwen2_moe, qwen3_moe (aux loss on) and deepseek_v3 (MLA, shared + routed
experts), and a hand-written MoE with data-dependent dispatch run eagerly. One launch runs every case."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.moe import HF_MOE, USER_MOE
from helpers.runtime import assert_matches_reference, make_plan

from pipeplan.models.hf import MOE_TYPES
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.config import RunConfig

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # multi-process runs
os.environ["HF_HUB_OFFLINE"] = "1"  # the ranks inherit it: nothing is ever downloaded

ONE_STEP = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=60.0)
SCHEDULES = {"mixtral": "zb-h1", "qwen2_moe": "1f1b", "qwen3_moe": "zbv", "deepseek_v3": "1f1b"}
CASES = {f"hf:{t}": (f"hf:{t}", HF_MOE[t], SCHEDULES[t]) for t in MOE_TYPES}
CASES["user"] = (USER_MOE, {"dispatch": "mask"}, "zb-h1")  # nonzero dispatch: traced alike (tests/graph)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    cases, runs = {}, []
    for label, (model, options, schedule) in CASES.items():
        name = label.replace(" ", "-").replace(":", "-")
        path, plan = make_plan(folder, name, model, options, pipeline_devices=2, schedule=schedule)
        cases[label] = (len(runs), plan)
        runs.append((path, ONE_STEP))
    return cases, launch_many(runs, capture_grads=True, threads=1)


@pytest.mark.parametrize("label", list(CASES))
def test_moe_pipeline_matches_single_process(runs, label):
    cases, results = runs
    index, plan = cases[label]
    assert_matches_reference(plan, [per_rank[index] for per_rank in results], label)


@pytest.mark.parametrize("label", ["hf:mixtral", "user"])
def test_router_logits_of_the_first_stage_cross_to_the_loss(runs, label):
    cases, _ = runs
    _, plan = cases[label]
    model = build_pipeline_model(plan, 1, torch.device("cpu"))
    last = model.stage_io[-1]
    routed = [name for name in last.inputs if model.value_meta[name].shape[-1] == 4]  # (tokens, experts) logits
    assert routed, last.inputs
