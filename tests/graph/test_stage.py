"""Stage modules chained layer by layer (or several layers per stage) reproduce the whole model."""

from __future__ import annotations

import pytest
import torch

from pipeplan.graph.stage import build_stage_module
from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model

MODELS = [
    ("gpt", dict(layers=3, hidden=32, heads=2, seq=8, vocab=64, tie_embeddings=True)),
    ("resnet", dict(blocks=3, channels=8, image=8)),
    ("mlp", dict(layers=4, hidden=16)),
]


def _run_chain(traced, stages, inputs):
    env = dict(zip(traced.layer_graph.input_names, inputs))
    for stage in stages:
        outs = stage(*[env[name] for name in stage.inputs])
        assert isinstance(outs, tuple) and len(outs) == len(stage.outputs)
        env.update(zip(stage.outputs, outs))
    return env[traced.layer_graph.output_name]


@pytest.mark.parametrize("ref,options", MODELS)
def test_one_stage_per_layer_reproduces_the_model(ref, options):
    spec = load_model(ref, options)
    traced = trace_model(spec, batch_size=2)
    inputs, _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(3))
    expected = traced.module(*inputs)
    stages = [build_stage_module(traced, layer.nodes) for layer in traced.layer_graph.layers]
    torch.testing.assert_close(_run_chain(traced, stages, inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize("ref,options", MODELS)
def test_adjacent_stages_forward_skip_tensors(ref, options):
    """Two-layer stages that return exactly the next cut: skip tensors are passed through."""
    spec = load_model(ref, options)
    traced = trace_model(spec, batch_size=2)
    graph = traced.layer_graph
    inputs, _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(4))
    expected = traced.module(*inputs)
    bounds = list(range(0, graph.num_layers, 2)) + [graph.num_layers]
    values, previous = inputs, graph.input_names
    for start, stop in zip(bounds, bounds[1:]):
        nodes = [n for layer in graph.layers[start:stop] for n in layer.nodes]
        last = stop == graph.num_layers
        outputs = [graph.output_name] if last else [info.producer for info in graph.cuts[stop - 1]]
        stage = build_stage_module(traced, nodes, outputs=outputs)
        env = dict(zip(previous, values))
        values = stage(*[env[name] for name in stage.inputs])
        previous = outputs
    torch.testing.assert_close(values[0], expected, rtol=0, atol=0)


def test_resnet_stage_inputs_include_the_long_skip():
    traced = trace_model(load_model("resnet", dict(blocks=2, channels=8, image=8)), batch_size=1)
    last_block = build_stage_module(traced, traced.layer_graph.layers[2].nodes)
    stem_out = traced.layer_graph.cuts[0][0].producer
    assert stem_out in last_block.inputs and len(last_block.inputs) == 2


def test_stage_references_only_its_parameters_and_keeps_ties():
    spec = load_model("gpt", dict(layers=2, hidden=32, heads=2, seq=8, vocab=64, tie_embeddings=True))
    traced = trace_model(spec)
    graph = traced.layer_graph
    embed = build_stage_module(traced, graph.layers[0].nodes)
    head = build_stage_module(traced, graph.layers[-1].nodes)
    block = build_stage_module(traced, graph.layers[1].nodes)
    assert head.get_parameter("head.proj.weight") is embed.get_parameter("embed.tok.weight")
    assert head.get_parameter("head.proj.weight") is traced.module.embed.tok.weight
    assert all(name.startswith("blocks.0.") for name, _ in block.named_parameters())
    original = dict(traced.module.named_parameters())
    for name, param in block.named_parameters():
        assert param is original[name]


def test_stage_built_on_meta_materializes_only_its_part():
    spec = load_model("gpt", dict(layers=2, hidden=32, heads=2, seq=8, vocab=64))
    traced = trace_model(spec, batch_size=2, device="meta")
    stage = build_stage_module(traced, traced.layer_graph.layers[1].nodes)
    stage.to_empty(device="cpu")
    assert not any(p.is_meta for p in stage.parameters())
    assert any(p.is_meta for p in traced.module.head.parameters())
    (out,) = stage(torch.randn(2, 8, 32))
    assert out.shape == (2, 8, 32)
