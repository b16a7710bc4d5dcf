"""Models nobody here wrote, run on 2 gloo ranks against single-process references: tiny Hugging Face GPT-2 and
Llama (traced by torch.export; one step's loss and gradients, and 10 AdamW steps on a fixed batch), a
torchvision-style ResNet cut right before an in-place ReLU, an MoE whose routing is data-dependent (an fx leaf
that cannot run on the meta device) and a leaf module's tuple passed whole to the next stage. One launch runs
every case (start-up dominates)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.runtime import assert_matches_reference, make_plan, reference_losses

from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.config import RunConfig

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # multi-process runs
os.environ["HF_HUB_OFFLINE"] = "1"  # the ranks inherit it: nothing is ever downloaded

USER = str(Path(__file__).with_name("user_models.py"))
TOP_LEVEL_MOE = str(Path(__file__).parents[1] / "graph" / "moe_user_models.py") + ":moe_top_level"
GPT2 = {"n_layer": "4", "n_embd": "32", "n_head": "2", "vocab_size": "96", "seq_len": "12"}
GPT2.update({"resid_pdrop": "0", "embd_pdrop": "0", "attn_pdrop": "0"})  # dropout would differ per process
LLAMA = {"num_hidden_layers": "4", "hidden_size": "32", "num_attention_heads": "4", "num_key_value_heads": "2"}
LLAMA.update({"intermediate_size": "64", "vocab_size": "96", "seq_len": "12"})
ONE_STEP = RunConfig(steps=1, quiet=True, heartbeat_timeout_s=60.0)
STEPS, LR = 10, 3e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user-models")
    cases, runs = {}, []
    train = RunConfig(steps=STEPS, quiet=True, lr=LR, heartbeat_timeout_s=60.0)
    layouts = [
        ("gpt2", "hf:gpt2", GPT2, dict(schedule="zb-h1"), ONE_STEP),
        ("llama", "hf:llama", LLAMA, dict(schedule="1f1b"), ONE_STEP),
        ("gpt2 train", "hf:gpt2", GPT2, dict(schedule="1f1b"), train),
        ("llama train", "hf:llama", LLAMA, dict(schedule="zbv"), train),
        # stage 1 starts at the stem's in-place ReLU: its input arrives as a leaf that requires grad
        ("tv_resnet", f"{USER}:tv_resnet", {}, dict(schedule="1f1b", cuts=[(0, 1), (2, 7)]), ONE_STEP),
        ("moe", f"{USER}:moe", {}, dict(schedule="zb-h1"), ONE_STEP),
        ("top-level moe", TOP_LEVEL_MOE, {}, dict(schedule="1f1b"), ONE_STEP),  # routing in the model's forward
        ("pair", f"{USER}:pair", {}, dict(schedule="zb-h1", cuts=[(0, 1), (2, 3)]), ONE_STEP),  # a tuple crosses
    ]
    for label, model, options, layout, config in layouts:
        path, plan = make_plan(folder, label.replace(" ", "-"), model, options, pipeline_devices=2, **layout)
        cases[label] = (len(runs), plan)
        runs.append((path, config))
    results = launch_many(runs, capture_grads=True, threads=1)
    return cases, results


def _per_rank(results, index):
    return [per_rank[index] for per_rank in results]


@pytest.mark.parametrize("label", ["gpt2", "llama"])
def test_hugging_face_models_match_single_process(runs, label):
    cases, results = runs
    index, plan = cases[label]
    assert plan.model.tracer == "export"
    assert_matches_reference(plan, _per_rank(results, index), label)


@pytest.mark.parametrize("label", ["gpt2 train", "llama train"])
def test_hugging_face_training_matches_single_process_adamw(runs, label):
    cases, results = runs
    index, plan = cases[label]
    losses = results[0][index].losses
    assert len(losses) == STEPS and losses == results[1][index].losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # a fixed batch: the loss falls every step
    expected = reference_losses(plan, STEPS, lr=LR, weight_decay=plan.training.weight_decay)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)


def test_in_place_relu_at_a_stage_boundary(runs):
    cases, results = runs
    index, plan = cases["tv_resnet"]
    assert plan.stages[1].layer_names[0] == "relu"
    assert_matches_reference(plan, _per_rank(results, index), "tv_resnet")


def test_data_dependent_leaf_plans_and_runs(runs):
    cases, results = runs
    index, plan = cases["moe"]
    model = build_pipeline_model(plan, 1, torch.device("cpu"))  # traced on meta: shapes from a CPU run
    assert model.value_meta[model.stage_io[1].inputs[0]].shape == (2, 5, 8)
    assert_matches_reference(plan, _per_rank(results, index), "moe")


def test_a_tuple_crossing_stages_travels_as_its_elements(runs):
    cases, results = runs
    index, plan = cases["pair"]
    assert build_pipeline_model(plan, 1, torch.device("cpu")).stage_io[1].inputs == ("split.0", "split.1")
    assert_matches_reference(plan, _per_rank(results, index), "pair")


def test_moe_routed_in_the_models_own_forward_matches_single_process(runs):
    """Issue 38: routers and experts in ModuleLists, boolean-mask dispatch in the top-level loop. The export's
    data-dependent sizes stay inside a layer (no cut carries one); two stages, gradients equal one process."""
    cases, results = runs
    index, plan = cases["top-level moe"]
    assert plan.model.tracer == "export" and len(plan.stages) == 2
    assert "routers.0" in plan.stages[0].layer_names and "routers.1" in plan.stages[1].layer_names  # a MoE each
    assert_matches_reference(plan, _per_rank(results, index), "top-level moe")
