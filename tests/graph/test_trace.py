"""LayerGraph: layer grouping, cuts (skip connections included), granularity, fingerprint, errors, meta tracing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeplan.errors import ConfigError, TraceError
from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model
from pipeplan.models.spec import ModelSpec


def _names(ref, batch_size=2, granularity=None, **options):
    traced = trace_model(load_model(ref, options), batch_size=batch_size, granularity=granularity)
    return [layer.name for layer in traced.layer_graph.layers], traced


def test_gpt_layers_are_embed_blocks_head():
    names, traced = _names("gpt", layers=3, hidden=32, heads=2, seq=8, vocab=64)
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    graph = traced.layer_graph
    assert graph.input_names == ("idx",) and graph.output_name == "head_proj"
    assert "idx" in graph.layers[0].nodes
    assert len(graph.cuts) == len(graph.layers) - 1
    for i in range(len(graph.cuts)):  # a chain: exactly the hidden state (batch, seq, hidden) float32 crosses
        (info,) = graph.cuts[i]
        assert info.shape == (2, 8, 32) and info.dtype == "float32" and info.bytes == 2 * 8 * 32 * 4
        assert graph.cut_bytes(i) == info.bytes


def test_every_node_in_exactly_one_layer_in_graph_order():
    _, traced = _names("gpt", layers=2, hidden=32, heads=2, seq=8, vocab=64)
    order = [n.name for n in traced.graph_module.graph.nodes if n.op != "output"]
    flat = [name for layer in traced.layer_graph.layers for name in layer.nodes]
    assert flat == order


def test_mlp_and_resnet_layers():
    names, _ = _names("mlp", layers=3, hidden=8)
    assert names == ["layers.0", "layers.1", "layers.2"]
    names, _ = _names("resnet", blocks=3, channels=8, image=8)
    assert names == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_resnet_long_skip_crosses_every_cut():
    _, traced = _names("resnet", batch_size=3, blocks=3, channels=8, image=8)
    graph = traced.layer_graph
    stem_out = graph.cuts[0][0].producer
    for cut in graph.cuts[:-1]:
        assert stem_out in {info.producer for info in cut}
    assert len(graph.cuts[1]) == 2 and graph.cut_bytes(1) == 2 * 3 * 8 * 8 * 8 * 4
    # the last cut (after the long-skip add) carries one tensor only
    assert len(graph.cuts[-1]) == 1
    _, no_skip = _names("resnet", batch_size=3, blocks=3, channels=8, image=8, long_skip=False)
    assert all(len(cut) == 1 for cut in no_skip.layer_graph.cuts)


def test_model_input_consumed_later_crosses_cuts():
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + x

    spec = ModelSpec(
        name="late",
        build=Late,
        sample_batch=lambda b, generator=None: ((torch.randn(b, 4),), torch.randn(b, 4)),
        loss_fn=nn.functional.mse_loss,
    )
    graph = trace_model(spec, batch_size=5).layer_graph
    assert [layer.name for layer in graph.layers] == ["a", "b"]
    assert {info.producer for info in graph.cuts[0]} == {"x", "a"}
    assert graph.cut_bytes(0) == 2 * 5 * 4 * 4


def test_granularity_coarser_and_finer():
    options = dict(layers=2, hidden=32, heads=2, seq=8, vocab=64)
    coarse, _ = _names("gpt", granularity=1, **options)
    assert coarse == ["embed", "blocks", "head"]
    fine, traced = _names("gpt", granularity=3, **options)
    for part in ("ln1", "attn", "ln2", "mlp"):
        assert f"blocks.0.{part}" in fine and f"blocks.1.{part}" in fine
    # inside a block, the residual stream crosses the cut after attn... and the ln2 output too
    graph = traced.layer_graph
    after_ln2 = graph.cuts[fine.index("blocks.0.ln2")]
    assert len(after_ln2) == 2
    with pytest.raises(ConfigError, match="granularity"):
        trace_model(load_model("gpt", {}), granularity=0)


def test_fingerprint_stable_across_batch_sizes_and_distinct_across_models():
    spec = load_model("gpt", dict(layers=2, hidden=32, heads=2, seq=8, vocab=64))
    one = trace_model(spec, batch_size=1).layer_graph.fingerprint
    four = trace_model(spec, batch_size=4).layer_graph.fingerprint
    assert one == four
    wider = load_model("gpt", dict(layers=2, hidden=64, heads=2, seq=8, vocab=64))
    deeper = load_model("gpt", dict(layers=3, hidden=32, heads=2, seq=8, vocab=64))
    tied = load_model("gpt", dict(layers=2, hidden=32, heads=2, seq=8, vocab=64, tie_embeddings=True))
    prints = {trace_model(s).layer_graph.fingerprint for s in (wider, deeper, tied)}
    assert len(prints | {one}) == 4
    assert trace_model(load_model("mlp", {})).layer_graph.fingerprint != one


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.branchy = Branchy()

    def forward(self, x):
        return self.branchy(self.pre(x))


def _spec(build, leaf_modules=()):
    return ModelSpec(
        name="outer",
        build=build,
        sample_batch=lambda b, generator=None: ((torch.randn(b, 4),), torch.randn(b, 4)),
        loss_fn=nn.functional.mse_loss,
        leaf_modules=leaf_modules,
    )


def test_untraceable_module_becomes_an_eager_leaf_and_a_declared_one_is_kept():
    for spec in (_spec(Outer), _spec(Outer, leaf_modules=(Branchy,))):
        traced = trace_model(spec)
        assert [layer.name for layer in traced.layer_graph.layers] == ["pre", "branchy"]
        assert traced.layer_graph.eager_modules == ("branchy",)


class BranchyOuter(Outer):
    def forward(self, x):
        return self.branchy(self.pre(x)) if x.sum() > 0 else x


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = BranchyOuter()

    def forward(self, x):
        return self.inner(x)


def test_untraceable_module_holding_the_whole_model_names_the_module_and_the_fix():
    with pytest.raises(TraceError) as info:  # as a leaf it would make the model one layer: refused
        trace_model(_spec(Wrapper))
    message = str(info.value)
    assert "'inner'" in message and "leaf_modules=(BranchyOuter,)" in message and "torch.export" in message
    assert "\n" not in message


def test_untraceable_top_level_forward():
    with pytest.raises(TraceError, match="top-level forward of Branchy"):
        trace_model(_spec(Branchy))


def test_meta_tracing_allocates_nothing_and_matches_cpu():
    options = dict(layers=2, hidden=32, heads=2, seq=8, vocab=64)
    cpu = trace_model(load_model("gpt", options), batch_size=3)
    meta = trace_model(load_model("gpt", options), batch_size=3, device="meta")
    assert all(p.is_meta for p in meta.module.parameters())
    assert meta.layer_graph == cpu.layer_graph


def test_meta_tracing_of_a_huge_gpt_is_cheap():
    big = load_model("gpt", dict(layers=32, hidden=4096, heads=32, seq=2048, vocab=50304))
    traced = trace_model(big, batch_size=1, device="meta")
    assert len(traced.layer_graph.layers) == 34
    assert traced.layer_graph.cut_bytes(0) == 2048 * 4096 * 4
    assert sum(p.numel() for p in traced.module.parameters()) > 6e9


def _toy_spec(build, width=4):
    return ModelSpec(
        name="toy",
        build=build,
        loss_fn=nn.functional.mse_loss,
        sample_batch=lambda b, generator=None: ((torch.randn(b, width),), torch.randn(b, width)),
    )


def test_single_child_wrapper_is_looked_through():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

        def forward(self, x):
            return self.model(x)

    names = [layer.name for layer in trace_model(_toy_spec(Wrapper)).layer_graph.layers]
    assert names == ["model.0", "model.1", "model.2"]


def test_module_called_twice_keeps_layers_contiguous_and_unique():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(self.b(self.a(x)))

    graph = trace_model(_toy_spec(Reuse)).layer_graph
    names = [layer.name for layer in graph.layers]
    assert len(names) == len(set(names)) and names[0] == "a"
    flat = [n for layer in graph.layers for n in layer.nodes]
    assert len(flat) == len(set(flat))


def test_tuple_output_is_rebuilt_from_its_leaves():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x), x

    traced = trace_model(_toy_spec(Pair))
    assert traced.layer_graph.output_names == ("a", "x")
    first, second = torch.ones(1), torch.zeros(1)
    assert traced.build_output({"a": first, "x": second}) == (first, second)


def test_non_tensor_values_crossing_a_cut_are_listed_with_their_type():
    class SizeLater(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            rows = x.shape[0]
            return self.b(self.a(x)).reshape(rows, -1)

    graph = trace_model(_toy_spec(SizeLater), batch_size=3).layer_graph
    kinds = {info.dtype: info for info in graph.cuts[0]}
    assert set(kinds) == {"int", "float32"} and kinds["int"].bytes == 0 and graph.cut_bytes(0) == 3 * 4 * 4


def test_second_input_joins_its_first_user_and_crosses_earlier_cuts():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 4)

        def forward(self, x, mask):
            return self.c(self.b(self.a(x)) * mask)

    spec = ModelSpec(
        name="two",
        build=TwoInputs,
        loss_fn=nn.functional.mse_loss,
        sample_batch=lambda b, generator=None: ((torch.randn(b, 4), torch.ones(b, 4)), torch.randn(b, 4)),
    )
    graph = trace_model(spec, batch_size=2).layer_graph
    assert graph.input_names == ("x", "mask")
    assert [layer.name for layer in graph.layers] == ["a", "b", "c"]
    assert graph.layers[0].nodes[0] == "x" and "mask" in graph.layers[1].nodes
    assert {info.producer for info in graph.cuts[0]} == {"a"}
    assert {info.producer for info in graph.cuts[1]} == {"mul"}
