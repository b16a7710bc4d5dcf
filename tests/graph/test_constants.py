"""Constant values are made again in each layer that reads them (pipeplan/graph/constants.py): a helper module that
only makes them (Hugging Face's rotary embedding) leaves no layer, and they cross no cut; an exported graph built
by hand checks the rule itself (a buffer's function read by two layers, a model input's never copied)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model
from pipeplan.models.spec import ModelSpec

TINY_LLAMA = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
    seq_len=8,
)


class _Table(nn.Module):
    """Makes a constant (from its buffer alone) that both blocks read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("base", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.base * 2).cos()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * table


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = _Table()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table(x)
        for block in self.blocks:
            x = block(x, table)
        return x


def _spec() -> ModelSpec:
    return ModelSpec(
        name="table",
        build=_Model,
        sample_batch=lambda batch_size, generator=None: (
            (torch.randn(batch_size, 4, generator=generator),),
            torch.randn(batch_size, 4, generator=generator),
        ),
        loss_fn=lambda out, target: ((out - target) ** 2).mean(),
    )


def test_a_buffers_function_is_made_again_in_each_block_and_its_module_leaves_no_layer():
    traced = trace_model(_spec(), device="meta", tracer="export")
    graph = traced.layer_graph
    assert [layer.name for layer in graph.layers] == ["blocks.0", "blocks.1"]
    assert [[info.shape for info in cut] for cut in graph.cuts] == [[(1, 4)]]  # the hidden state only
    cosines = [n for n in traced.graph_module.graph.nodes if "cos" in str(n.target)]
    assert {traced.node_layer[n.name] for n in cosines} == {0, 1}  # one copy per block
    on_cpu = trace_model(_spec(), tracer="export")  # the copies compute what the model does
    x = torch.randn(1, 4)
    out = on_cpu.graph_module(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple | list) else out, on_cpu.module(x))


def test_hf_rotary_and_causal_mask_cross_no_cut(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = load_model("hf:llama", {k: str(v) for k, v in TINY_LLAMA.items()})
    traced = trace_model(spec, device="meta")
    graph = traced.layer_graph
    names = [layer.name for layer in graph.layers]
    assert "model.rotary_emb" not in names and names[1:3] == ["model.layers.0", "model.layers.1"]
    hidden = (1, 8, 32)
    assert all([info.shape for info in cut] == [hidden] for cut in graph.cuts[:-1])
    attention = [n for n in traced.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 2  # is_causal, no mask tensor: FlashAttention's call (models/hf.eager_masks)
    assert all(n.args[3:6] in ((None, 0.0, True), ()) or n.kwargs.get("is_causal") for n in attention)
