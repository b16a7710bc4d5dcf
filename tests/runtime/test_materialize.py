"""Exact materialization: every rank's stage parameters and buffers equal, bit for bit, the whole model the
factory builds with the plan's seed (`torch.manual_seed(seed)` then `spec.build()`), for the built-in models, the
example factory and models with each kind of tensor per-submodule re-initialization got wrong; the meta path is
taken only for a too-large model with a declared initializer, and refused without one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers.runtime import TINY_GPT_TIED, TINY_MLP, TINY_RESNET, build_reference_model, make_plan

from pipeplan.errors import RunError
from pipeplan.graph.host_memory import HOST_MEMORY_ENV
from pipeplan.graph.trace import trace_module
from pipeplan.models import load_model
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.weights import materialize as mat

HERE = Path(__file__).parent
QUIRKY = f"{HERE / 'exact_models.py'}:quirky_lm"
EXAMPLE = f"{HERE.parent.parent / 'examples' / 'user_model.py'}:build"
TINY_LLAMA = dict(layers=3, hidden=32, heads=4, kv_heads=2, intermediate=48, seq=8, vocab=64)

CASES = {
    "gpt-tied": ("gpt", TINY_GPT_TIED, "1f1b", 2),
    "mlp": ("mlp", TINY_MLP, "gpipe", 2),
    "resnet": ("resnet", TINY_RESNET, "1f1b", 3),
    "llama": ("llama", TINY_LLAMA, "interleaved", 2),
    "example": (EXAMPLE, dict(depth=3, width=16), "1f1b", 2),
    "quirky": (QUIRKY, {}, "1f1b", 3),
    "quirky-tied": (QUIRKY, dict(tie=True), "zbv", 2),
}


def _factory_build(ref: str, options: dict, seed: int) -> torch.nn.Module:
    """The whole model exactly as a user would build it (written out here, not through pipeplan's helper)."""
    spec = load_model(ref, options)
    torch.manual_seed(seed)
    return spec.build()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_holds_the_whole_model_build(tmp_path, case):
    ref, options, schedule, devices = CASES[case]
    _, plan = make_plan(tmp_path, case, ref, options, schedule=schedule, pipeline_devices=devices, seed=5)
    whole = _factory_build(ref, options, seed=5)
    # torch.fx folds ops on buffers alone into trace-time constants (`_tensor_constant0`): they must be what
    # tracing the real whole model computes (the 2-rank run test checks them against eager single-process losses)
    constants = trace_module(whole, load_model(ref, options)).graph_module
    covered: set[str] = set()
    for rank in range(plan.world_size):
        model = build_pipeline_model(plan, rank, torch.device("cpu"))
        for module in model.modules.values():
            for name, tensor in mat.named_tensors(module):
                expected = mat.lookup(whole, constants, name=name)
                assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), f"{case} rank {rank} {name}"
                covered.add(name)
        assert not any(t.is_meta for m in model.modules.values() for t in m.parameters())
    graph_names = {name for name, _ in mat.named_tensors(model.traced.graph_module)}
    assert covered == graph_names  # every tensor the graph uses lives on some rank
    _, reference = build_reference_model(plan)
    for name, tensor in mat.named_tensors(reference):
        assert torch.equal(tensor, mat.lookup(whole, name=name)), name


def test_quirky_tensors_are_the_factorys_not_reinitialized(tmp_path):
    _, plan = make_plan(tmp_path, "q", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    first = build_pipeline_model(plan, 0, torch.device("cpu")).modules[0]
    whole = _factory_build(QUIRKY, {}, seed=0)
    assert torch.equal(first.get_parameter("blocks.0.norm.weight"), torch.ones(16))
    assert torch.equal(first.get_parameter("blocks.0.gain"), whole.blocks[0].gain)
    # the inverted causal mask, folded by torch.fx into a constant, holds the real mask's values
    masks = [t for name, t in mat.named_tensors(first) if t.dtype == torch.bool]
    assert masks and all(torch.equal(m, ~whole.blocks[0].mask) for m in masks)


def test_ties_stay_one_tensor_on_the_rank(tmp_path):
    _, plan = make_plan(tmp_path, "t", QUIRKY, dict(tie=True), schedule="zbv", pipeline_devices=2)
    model = build_pipeline_model(plan, 0, torch.device("cpu"))  # zbv: rank 0 holds the first and last stage
    embed, head = model.modules[0], model.modules[3]
    assert head.get_parameter("head.proj.weight") is embed.get_parameter("embed.tok.weight")
    assert model.params["embed.tok.weight"] is embed.get_parameter("embed.tok.weight")


def test_seed_changes_the_weights(tmp_path):
    _, plan = make_plan(tmp_path, "s", "mlp", TINY_MLP, schedule="gpipe", pipeline_devices=2)
    other = dataclasses.replace(plan, training=dataclasses.replace(plan.training, seed=1))
    a = build_pipeline_model(plan, 0, torch.device("cpu")).params["layers.0.linear.weight"]
    b = build_pipeline_model(other, 0, torch.device("cpu")).params["layers.0.linear.weight"]
    assert not torch.equal(a, b)


def test_too_large_model_without_initializer_is_refused(tmp_path, monkeypatch):
    _, plan = make_plan(tmp_path, "big", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
    with pytest.raises(RunError, match="too large to build whole on this host.*init_module"):
        build_pipeline_model(plan, 0, torch.device("cpu"))


def test_too_large_model_with_initializer_takes_the_meta_path(tmp_path, monkeypatch, capfd):
    _, plan = make_plan(tmp_path, "big", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
    first = build_pipeline_model(plan, 0, torch.device("cpu"))
    second = build_pipeline_model(plan, 1, torch.device("cpu"))
    assert "initializes its part from the meta device" in capfd.readouterr().err
    shared = first.params["embed.tok.weight"]
    assert torch.equal(shared, second.params["embed.tok.weight"])  # ranks agree with each other
    assert torch.equal(first.params["blocks.0.ln1.weight"], torch.ones(32))
    assert not any(t.is_meta for m in first.modules.values() for _, t in mat.named_tensors(m))


def test_a_constant_made_in_forward_is_refused_not_guessed():
    whole = torch.nn.Linear(2, 2)
    with pytest.raises(RunError, match="no tensor '_tensor_constant0'.*register_buffer"):
        mat.lookup(whole, name="_tensor_constant0")
