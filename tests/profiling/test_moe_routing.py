"""Measured profiles of mixture-of-experts models say how the sample batch was routed: the model's own routers on the
sample batch, counted per expert, checked against the router logits the models return; the summary prints it."""

from __future__ import annotations

import pytest
import torch
from helpers.moe import HF_MOE, USER_MOE
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.models import load_model
from pipeplan.profiling.profile import ExpertRouting, Profile
from pipeplan.profiling.routing import measure_routing

QUICK = ["--warmup", "0", "--repeats", "1", "--threads", "1", "--timer", "cpu"]


def _off():
    return torch.autocast("cpu", enabled=False)


def _expected(router_logits, top_k: int, experts: int) -> list[tuple[int, ...]]:
    """Tokens per expert of plain top-k routing, from each layer's router logits."""
    return [
        tuple(torch.bincount(x.topk(top_k, -1).indices.flatten(), minlength=experts).tolist()) for x in router_logits
    ]


@pytest.mark.parametrize(("model", "options"), [(USER_MOE, {"dispatch": "nonzero"}), ("hf:mixtral", HF_MOE["mixtral"])])
def test_routing_counts_what_the_routers_chose(model, options):
    spec = load_model(model, options)
    torch.manual_seed(0)
    module = spec.build()
    (ids,), _ = spec.sample_batch(3, generator=torch.Generator().manual_seed(0))
    routing = measure_routing(module, (ids,), _off)
    output = module(ids)
    logits = output["router_logits"] if isinstance(output, dict) else output.router_logits
    assert len(routing) == len(logits) and all(r.experts == 4 and r.top_k == 2 for r in routing)
    assert [r.tokens_per_expert for r in routing] == _expected(logits, 2, 4)
    assert all(r.tokens == ids.numel() and sum(r.tokens_per_expert) == 2 * ids.numel() for r in routing)


def test_dense_model_records_no_routing():
    spec = load_model("gpt", {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64})
    (ids,), _ = spec.sample_batch(1)
    assert measure_routing(spec.build(), (ids,), _off) == ()


def test_imbalance_is_the_busiest_expert_over_the_mean():
    routed = ExpertRouting(module="m", experts=4, top_k=2, tokens=8, tokens_per_expert=(8, 4, 4, 0))
    assert routed.imbalance == 2.0


def test_profile_of_a_user_moe_records_and_prints_routing_and_eager_layers(tmp_path):
    target = tmp_path / "moe.json"
    result = CliRunner().invoke(app, ["profile", USER_MOE, "-a", "layers=2", "-b", "2", "-o", str(target), *QUICK])
    assert result.exit_code == 0, result.output
    profile = Profile.load(target)
    source = profile.provenance
    assert source.eager_modules == ("blocks.0.moe", "blocks.1.moe")
    assert [r.module for r in source.expert_routing] == ["blocks.0.moe", "blocks.1.moe"]
    assert all(r.tokens == 12 and sum(r.tokens_per_expert) == 24 for r in source.expert_routing)
    output = " ".join(result.output.split())
    assert "run eagerly inside their layers" in output and "blocks.1.moe: 4 experts top-2, 12 tokens" in output
    assert "per expert min/mean/max" in output


def test_builtin_moe_routing_counts_every_assignment_of_its_own_router():
    """The built-in `moe` calls its stacked experts with a list of tokens per expert: each MoE layer reports
    tokens x top_k assignments, as its router's top-k chose them (never a silent all-zero count)."""
    spec = load_model("moe", {})
    torch.manual_seed(0)
    module = spec.build()
    (ids,), _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    routing = measure_routing(module, (ids,), _off)
    layers = [m for m in module.modules() if hasattr(m, "route")]
    assert routing and len(routing) == len(layers)
    for found, layer in zip(routing, layers, strict=True):
        hidden = {}
        handle = layer.register_forward_pre_hook(lambda mod, args, seen=hidden: seen.setdefault("x", args[0]))
        with torch.no_grad():
            module(ids)
        handle.remove()
        _, chosen = layer.route(hidden["x"].reshape(-1, hidden["x"].shape[-1]))
        assert found.tokens_per_expert == tuple(torch.bincount(chosen.flatten(), minlength=found.experts).tolist())


def test_analytic_profiles_count_transformers_grouped_experts():
    """transformers' experts run as grouped matmuls (tokens sorted by expert x stacked weights): on meta each
    becomes one grouped expert kernel with balanced rows; FLOPs and expert weights as counted by hand."""
    from pipeplan.profiling.analytic import profile_analytic

    options = HF_MOE["mixtral"]
    hidden, ffn, experts, top_k = (
        int(options[k]) for k in ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok")
    )
    profile = profile_analytic(load_model("hf:mixtral", options), batch_size=2, hardware="h100", precision="bf16-mixed")
    blocks = [layer for layer in profile.layers if layer.expert_param_count]
    assert len(blocks) == int(options["num_hidden_layers"])
    tokens = 2 * int(options["seq_len"])
    for layer in blocks:
        assert layer.expert_param_count == experts * 3 * hidden * ffn
        grouped = [k for k in layer.work.kernels if k.experts]
        assert [(k.batch, k.m) for k in grouped] == [(experts, tokens * top_k // experts)] * 2
        routed = 2 * tokens * top_k * 3 * hidden * ffn  # gate, up and down projections of top_k experts per token
        dense = [k for k in layer.work.kernels if not k.experts and not k.core]
        assert layer.flops >= routed + sum(2 * k.m * k.n * k.k * k.batch for k in dense)
        assert layer.flops < 1.2 * (routed + sum(2 * k.m * k.n * k.k * k.batch for k in dense))


def test_a_moe_layer_whose_experts_were_not_counted_is_refused():
    """The guard behind every analytic profile: an MoE layer found in the model whose profiled layer holds no
    expert weights (its experts never ran on meta) is one line, not a profile of attention and router alone."""
    from dataclasses import replace

    from pipeplan.errors import ConfigError
    from pipeplan.graph.trace import Layer
    from pipeplan.profiling.experts import check_experts_counted

    spec = load_model("hf:mixtral", HF_MOE["mixtral"])
    module = spec.build()
    layers = [Layer(name=f"model.layers.{i}", module_path=f"model.layers.{i}", nodes=()) for i in range(2)]
    counted = [_layer_profile(1)] * 2
    check_experts_counted(module, layers, counted)  # counted: fine
    with pytest.raises(ConfigError, match="cannot count the experts of 'model.layers.1.mlp'"):
        check_experts_counted(module, layers, [counted[0], replace(counted[1], expert_param_count=0)])


def _layer_profile(expert_params: int):
    from pipeplan.profiling.profile import LayerProfile

    return LayerProfile(
        name="x",
        forward_ms=1.0,
        input_grad_ms=1.0,
        weight_grad_ms=1.0,
        backward_ms=2.0,
        activation_bytes=0,
        activation_freed_by_input_grad_bytes=0,
        param_count=1,
        param_bytes=4,
        output_bytes=0,
        expert_param_count=expert_params,
    )
