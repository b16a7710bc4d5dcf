"""Mixture-of-experts models trace without the user declaring anything: transformers' MoE types through
torch.export (their grouped-matmul experts, routing included), a hand-written MoE layer with data-dependent
dispatch as an automatic eager leaf inside its block; one layer per block, one graph on meta and on the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers.moe import HF_MOE, USER_MOE
from torch import nn

from pipeplan.errors import TraceError
from pipeplan.graph.moe import moe_modules
from pipeplan.graph.run_dtypes import value_dtypes
from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model
from pipeplan.models.hf import MOE_TYPES, causal_lm_loss
from pipeplan.models.spec import ModelSpec

pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_hugging_face_moe_traces_to_one_layer_per_decoder_layer_and_runs_on_cpu(model_type):
    spec = load_model(f"hf:{model_type}", HF_MOE[model_type])
    meta = trace_model(spec, batch_size=2, device="meta")
    torch.manual_seed(0)
    cpu = trace_model(spec, batch_size=2, device="cpu")
    assert meta.layer_graph.fingerprint == cpu.layer_graph.fingerprint  # a meta-profiled plan runs on the CPU
    assert cpu.tracer == "export" and cpu.layer_graph.eager_modules == ()
    layers = int(HF_MOE[model_type]["num_hidden_layers"])
    names = [layer.name for layer in cpu.layer_graph.layers]
    assert [name for name in names if name.startswith("model.layers.")] == [f"model.layers.{i}" for i in range(layers)]
    moe = moe_modules(cpu.module)
    dense = 1 if model_type == "deepseek_v3" else 0  # first_k_dense_replace
    assert [m.path for m in moe] == [f"model.layers.{i}.mlp" for i in range(dense, layers)]
    assert {(m.num_experts, m.top_k) for m in moe} == {(4, 2)}
    (ids,), target = spec.sample_batch(2, generator=torch.Generator().manual_seed(1))
    expected, got = cpu.module(ids), cpu.graph_module(ids)  # the graph exported on meta, run on the CPU
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(spec.loss_fn(got, target), spec.loss_fn(expected, target))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_router_aux_loss_is_added_as_transformers_adds_it_with_labels(model_type):
    spec = load_model(f"hf:{model_type}", HF_MOE[model_type])
    torch.manual_seed(0)
    model = spec.build()
    (ids,), target = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    output = model(ids)
    assert output.aux_loss is not None and float(output.aux_loss.detach()) > 0
    torch.testing.assert_close(spec.loss_fn(output, target), model(ids, labels=ids).loss)
    assert spec.loss_fn(output, target).item() > causal_lm_loss(output, target).item()


@pytest.mark.parametrize("dispatch", ["mask", "nonzero"])
def test_user_moe_with_data_dependent_dispatch_runs_its_moe_layers_eagerly(dispatch):
    spec = load_model(USER_MOE, {"dispatch": dispatch})
    meta = trace_model(spec, batch_size=2, device="meta")  # shapes from one CPU run of the model
    cpu = trace_model(spec, batch_size=2, device="cpu")
    assert meta.layer_graph == cpu.layer_graph and cpu.tracer == "fx"
    assert [layer.name for layer in cpu.layer_graph.layers] == [
        "embed",
        *[f"blocks.{i}" for i in range(4)],
        "norm",
        "head",
    ]
    assert cpu.layer_graph.eager_modules == tuple(f"blocks.{i}.moe" for i in range(4))
    assert [m.path for m in moe_modules(cpu.module)] == list(cpu.layer_graph.eager_modules)
    # the router logits of every block reach the model's output (and so the last stage's loss)
    assert len(cpu.layer_graph.output_names) == 5
    assert cpu.layer_graph.cuts[0][0].shape == (2, 6, 32)


class _Flat(nn.Module):
    """MoE layers as plain attributes (no block list), declared leaves: each stays a layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        spec = load_model(USER_MOE, {"layers": 2, "width": 16})
        blocks = spec.build().blocks
        self.embed = nn.Embedding(48, 16)
        self.moe1, self.moe2 = blocks[0].moe, blocks[1].moe
        self.head = nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.moe1(h)[0]
        return self.head(h + self.moe2(h)[0])


@pytest.mark.parametrize("declared", [True, False])
def test_a_leaf_holding_an_expert_list_is_one_layer_not_merged_into_its_neighbour(declared):
    moe_type = type(_Flat().moe1)
    spec = ModelSpec(
        name="flat",
        build=_Flat,
        sample_batch=lambda b, generator=None: ((torch.randint(0, 48, (b, 6), generator=generator),), torch.zeros(b)),
        loss_fn=lambda output, target: output.sum(),
        leaf_modules=(moe_type,) if declared else (),
    )
    traced = trace_model(spec, batch_size=2)
    assert [layer.name for layer in traced.layer_graph.layers] == ["embed", "moe1", "moe2", "head"]
    assert traced.layer_graph.eager_modules == ("moe1", "moe2")


def test_dense_models_have_no_moe_modules():
    assert moe_modules(load_model("gpt", {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64}).build()) == []


def test_eager_moe_layers_have_their_real_dtypes_under_a_mixed_precision():
    spec = load_model(USER_MOE, {"layers": 2})
    traced = trace_model(spec, batch_size=2)
    dtypes = value_dtypes(traced, "bf16-mixed", "cpu")  # the eager layers cannot run on fake tensors: run for real
    (ids,), _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = traced.module(ids)
    expected = [output["logits"].dtype, *(logits.dtype for logits in output["router_logits"])]
    assert [dtypes[name] for name in traced.layer_graph.output_names] == expected
    assert expected[1] == torch.bfloat16  # the router's linear runs in bf16 under autocast


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if x.sum() > 0 else -layer(x)  # data-dependent, in the container's own code
        return x


class _WithEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.encoder, self.head = nn.Linear(8, 8), _Encoder(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.stem(x)))


def test_untraceable_container_of_blocks_is_refused_not_made_one_layer():
    spec = ModelSpec(
        name="encoder",
        build=_WithEncoder,
        sample_batch=lambda b, generator=None: ((torch.randn(b, 8, generator=generator),), torch.zeros(b)),
        loss_fn=lambda output, target: output.sum(),
    )
    with pytest.raises(TraceError, match=r"module 'encoder' \(_Encoder\)"):
        trace_model(spec)


def test_routing_in_the_models_own_forward_keeps_data_dependent_sizes_inside_layers():
    """Issue 38: routers and experts in ModuleLists, boolean-mask dispatch in the top-level loop. fx cannot trace
    it; the export can, with data-dependent (unbacked) sizes: those values never cross a cut (the layers they run
    across are merged), every cut has a size, and the meta graph run on the CPU gives the model's output."""
    from pathlib import Path

    spec = load_model(str(Path(__file__).with_name("moe_user_models.py")) + ":moe_top_level", {})
    meta = trace_model(spec, batch_size=2, device="meta")
    torch.manual_seed(0)
    cpu = trace_model(spec, batch_size=2, device="cpu")
    assert meta.layer_graph.fingerprint == cpu.layer_graph.fingerprint and cpu.tracer == "export"
    names = [layer.name for layer in cpu.layer_graph.layers]
    assert names == ["embed", "norms.0", "routers.0", "norms.1", "routers.1", "norm", "head"]
    assert all(isinstance(d, int) for cut in cpu.layer_graph.cuts for info in cut for d in info.shape)
    (ids,), _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(cpu.graph_module(ids), cpu.module(ids))
