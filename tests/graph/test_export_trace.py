"""Export tracing, pytree outputs, in-place ops at layer boundaries and data-dependent leaves (models in
tests/runtime/user_models.py, written the way users write them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeplan.errors import ConfigError, TraceError
from pipeplan.graph.stage import build_stage_module
from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model
from pipeplan.models.spec import ModelSpec
from pipeplan.profiling.measure import profile_model

USER = str(Path(__file__).parents[1] / "runtime" / "user_models.py")


def _spec(name: str):
    return load_model(f"{USER}:{name}", {})


def _chain(traced, inputs):
    """Run the model layer by layer, each layer's inputs made leaves that require grad (as the profiler and the
    runtime do); return the rebuilt output and the leaves."""
    env = dict(zip(traced.layer_graph.input_names, inputs))
    leaves = []
    for layer in traced.layer_graph.layers:
        stage = build_stage_module(traced, layer.nodes)
        args = []
        for name in stage.inputs:
            value = env[name]
            if value.is_floating_point() and name not in traced.layer_graph.input_names:
                value = value.detach().requires_grad_(True)
                leaves.append(value)
            args.append(value)
        env.update(zip(stage.outputs, stage(*args)))
    return traced.build_output(env), env


def _grads_through_chain(traced, inputs, target):
    """Parameter gradients of the loss computed layer by layer, backpropagating cut by cut like a pipeline."""
    env = dict(zip(traced.layer_graph.input_names, inputs))
    records = []
    for layer in traced.layer_graph.layers:
        stage = build_stage_module(traced, layer.nodes)
        args = [
            env[n].detach().requires_grad_(True) if n not in traced.layer_graph.input_names else env[n]
            for n in stage.inputs
        ]
        outs = dict(zip(stage.outputs, stage(*args)))
        records.append((stage, args, outs))
        env.update(outs)
    loss = traced.spec.loss_fn(traced.build_output(env), target)
    loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for index, (stage, args, outs) in enumerate(reversed(records)):
        pairs = [(v, grads[n]) for n, v in outs.items() if n in grads and v.requires_grad]
        if index and pairs:
            torch.autograd.backward([v for v, _ in pairs], [g for _, g in pairs])
        for name, arg in zip(stage.inputs, args):
            if arg.requires_grad and arg.grad is not None:
                grads[name] = grads.get(name, 0) + arg.grad
    return loss


def test_fx_failure_falls_back_to_export_and_the_output_dict_is_rebuilt():
    spec = _spec("shape_branch")
    traced = trace_model(spec, batch_size=3)
    assert traced.tracer == "export" and traced.layer_graph.tracer == "export"
    assert [layer.name for layer in traced.layer_graph.layers] == ["layers.0", "layers.1", "layers.2", "out"]
    inputs, _ = spec.sample_batch(3, generator=torch.Generator().manual_seed(0))
    output, _ = _chain(traced, inputs)
    expected = traced.module(*inputs)
    assert set(output) == {"logits", "features"}
    for key in expected:
        torch.testing.assert_close(output[key], expected[key])
    with pytest.raises(TraceError, match="torch.fx cannot trace"):
        trace_model(spec, tracer="fx")
    with pytest.raises(ConfigError, match="--tracer"):
        trace_model(spec, tracer="dynamo")


def test_export_graph_is_the_same_on_meta_and_cpu():
    spec = _spec("shape_branch")
    meta, cpu = trace_model(spec, batch_size=2, device="meta"), trace_model(spec, batch_size=2, device="cpu")
    assert meta.layer_graph == cpu.layer_graph


@pytest.mark.parametrize(("name", "granularity"), [("tv_resnet", None), ("vgg", 2)])
def test_in_place_ops_at_layer_boundaries_keep_gradients_exact(name, granularity):
    spec = _spec(name)
    torch.manual_seed(0)
    traced = trace_model(spec, batch_size=2, granularity=granularity)
    traced.module.eval()  # batch-norm statistics stay fixed: the two passes below must compute the same function
    inputs, target = spec.sample_batch(2, generator=torch.Generator().manual_seed(1))
    loss = _grads_through_chain(traced, inputs, target)
    chained = {n: p.grad.clone() for n, p in traced.module.named_parameters()}
    traced.module.zero_grad()
    whole = spec.loss_fn(traced.module(*inputs), target)
    whole.backward()
    torch.testing.assert_close(loss, whole)
    for n, p in traced.module.named_parameters():
        torch.testing.assert_close(chained[n], p.grad, msg=lambda m, n=n: f"{n}: {m}")
    relu = traced.layer_graph.layers[2 if name == "tv_resnet" else 1]
    clones = [n for n in build_stage_module(traced, relu.nodes).graph.nodes if n.target == "clone"]
    assert len(clones) == 1  # the in-place ReLU's input is copied, not written


def test_in_place_models_profile_at_finer_granularity():
    profile = profile_model(
        _spec("vgg"), batch_size=2, granularity=2, warmup=0, repeats=1, progress=False, precision="fp32"
    )
    assert [layer.name for layer in profile.layers][:2] == ["features.0", "features.1"]
    assert profile.provenance.tracer == "fx"


def test_data_dependent_leaf_traces_on_meta_with_shapes_from_a_cpu_run():
    spec = _spec("moe")
    meta, cpu = trace_model(spec, batch_size=2, device="meta"), trace_model(spec, batch_size=2, device="cpu")
    assert meta.layer_graph == cpu.layer_graph
    assert next(meta.module.parameters()).is_meta  # the traced module itself stays on meta
    assert meta.layer_graph.cuts[0][0].shape == (2, 5, 8)


def test_model_that_fails_everywhere_is_one_trace_error():
    spec = _spec("moe")
    bad = type(spec)(
        name="bad",
        build=spec.build,
        loss_fn=spec.loss_fn,
        leaf_modules=spec.leaf_modules,
        sample_batch=lambda b, generator=None: ((torch.randn(b, 5, 7),), torch.zeros(b, dtype=torch.long)),
    )
    with pytest.raises(TraceError, match="sample_batch") as info:
        trace_model(bad, device="meta")
    assert "\n" not in str(info.value)


def test_in_place_change_read_by_a_later_layer_is_refused():
    class Aliased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.act = torch.nn.ReLU(inplace=True)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            y = self.act(h)  # modifies h as well
            return self.b(y) + h  # eager reads the modified h here

    spec = ModelSpec(
        name="aliased",
        build=Aliased,
        loss_fn=lambda out, target: out.sum(),
        sample_batch=lambda b, generator=None: ((torch.randn(b, 4, generator=generator),), torch.zeros(b)),
    )
    with pytest.raises(TraceError, match="modified in place by 'act' and read afterwards by 'add'"):
        trace_model(spec)
    # torch.export reads the modified value from the in-place op's own output: layer by layer equals eager
    traced = trace_model(spec, tracer="export", batch_size=2)
    inputs, _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    output, _ = _chain(traced, inputs)
    torch.testing.assert_close(output, traced.module(*inputs))


def test_a_tuple_crossing_a_cut_travels_as_its_elements():
    spec = _spec("pair")
    traced = trace_model(spec, batch_size=2)
    names = [layer.name for layer in traced.layer_graph.layers]
    assert names == ["embed", "split", "merge", "head"]
    (info,) = traced.layer_graph.cuts[1]
    assert info.producer == "split" and info.dtype == "tuple" and info.bytes == 2 * 2 * 8 * 4
    producer = build_stage_module(traced, traced.layer_graph.layers[1].nodes)
    consumer = build_stage_module(traced, traced.layer_graph.layers[2].nodes)
    assert producer.outputs == ("split.0", "split.1") and consumer.inputs == ("split.0", "split.1")
    inputs, _ = spec.sample_batch(2, generator=torch.Generator().manual_seed(0))
    output, env = _chain(traced, inputs)
    torch.testing.assert_close(output, traced.module(*inputs))
    assert all(isinstance(env[f"split.{i}"], torch.Tensor) for i in range(2))
