"""I + W must give exactly the gradients of one plain backward, for many module shapes."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipeplan.graph.saved_tensors import SavedTensors, saved_split
from pipeplan.graph.split_backward import SplitCache, analyze, backward_full, backward_input, backward_weight
from pipeplan.models.gpt import Block, Embedding
from pipeplan.models.mlp import LinearAct
from pipeplan.models.resnet import ResidualBlock


class TwiceLinear(nn.Module):
    """The same Linear applied twice: its weight and bias are reached along two input-side paths."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class SharedScale(nn.Module):
    """One parameter used in two places of different kinds (elementwise scale and a weight-only branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x * self.scale) + self.scale.exp().sum()


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h, self.b(torch.relu(h))


def _reference(module, inputs, grad_outputs):
    module.zero_grad(set_to_none=True)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = module(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_outputs)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return [t.grad for t in leaves], grads


def _split(module, inputs, grad_outputs):
    module.zero_grad(set_to_none=True)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with SavedTensors() as saved:  # as the runtime runs it: I releases what W does not read
        outs = module(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    params = list(module.parameters())
    input_grads, state = backward_input(outs, grad_outputs, leaves, params, saved=saved)
    assert all(p.grad is None for p in params), "I must not touch parameter gradients"
    backward_weight(state)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return list(input_grads), grads


def _check(module, inputs, *, out_shapes=None):
    torch.manual_seed(0)
    with torch.no_grad():
        probe = module(*inputs)
    probe = probe if isinstance(probe, tuple) else (probe,)
    grad_outputs = [torch.randn_like(p) for p in probe]
    ref_inputs, ref_params = _reference(module, inputs, grad_outputs)
    got_inputs, got_params = _split(module, inputs, grad_outputs)
    for ref, got in zip(ref_inputs, got_inputs):
        if ref is None:  # an unused input: I returns zeros (a pipeline must send something)
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert set(got_params) == set(ref_params)
    for name in ref_params:
        torch.testing.assert_close(got_params[name], ref_params[name], rtol=1e-5, atol=1e-6)


def test_gpt_block():
    _check(Block(32, 4, 0.0), [torch.randn(2, 16, 32)])


def test_resnet_block():
    _check(ResidualBlock(8), [torch.randn(2, 8, 6, 6)])


def test_mlp_layer():
    _check(LinearAct(16, "gelu"), [torch.randn(4, 16)])


def test_parameter_used_in_two_places(console_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(SharedScale(), [torch.randn(4, 8)])
    assert not console_warnings()  # no fallback: the weight-side branches meet only below the frontier


def test_same_linear_in_parallel_branches(console_warnings):
    """One Linear on two inputs (tied weights within a stage): both uses are frontier nodes, W sums them."""

    class Parallel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, a, b):
            return self.lin(a) * self.lin(b)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(Parallel(), [torch.randn(4, 8), torch.randn(4, 8)])
    assert not console_warnings()  # no fallback


def test_module_applied_twice_in_a_row(console_warnings):
    """The bias node is reached from both uses, one behind the other: I captures it, W does the rest."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(TwiceLinear(), [torch.randn(4, 8)])
    assert not console_warnings()  # no fallback
    module, x = TwiceLinear(), torch.randn(4, 8, requires_grad=True)
    info = analyze([module(x)], [x], list(module.parameters()))
    assert not info.conflict and len(info.input_captures) == 1
    assert {type(n).__name__ for n, _ in info.input_captures} == {"AccumulateGrad"}
    assert len(info.frontier) == 2, "both addmm nodes still leave their weight matmul to W"


class SharedAndTransformed(nn.Module):
    """A bias used directly by two stacked Linears and also through a weight-side op: the fallback case."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.tanh(nn.functional.linear(x, self.weight, self.bias))
        return nn.functional.linear(h, self.weight, self.bias) * self.bias.exp()


def test_fallback_is_correct_and_warns(console_warnings):
    _check(SharedAndTransformed(), [torch.randn(4, 8)])
    assert any("recomputes" in line for line in console_warnings())


def test_first_stage_with_integer_inputs():
    module = Embedding(50, 16, 10, 0.0)
    _check(module, [torch.randint(0, 50, (3, 10))])
    leaves = [torch.randint(0, 50, (3, 10))]
    outs = (module(*leaves),)
    info = analyze(outs, leaves, list(module.parameters()))
    assert not info.input_side and info.weight_roots == [0], "without float inputs everything is W"


def test_multiple_outputs_and_unused_grad_output():
    module = TwoOutputs()
    _check(module, [torch.randn(4, 8)])
    x = torch.randn(4, 8, requires_grad=True)
    h, y = module(x)
    input_grads, state = backward_input((h, y), (None, torch.ones_like(y)), (x,), list(module.parameters()))
    backward_weight(state)
    assert input_grads[0].shape == x.shape


def test_weight_grad_is_not_recomputed_by_input_grad():
    """On a Linear chain the frontier is the matmul nodes: I does not produce any weight gradient."""
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    out = module(x)
    info = analyze([out], [x], list(module.parameters()))
    assert len(info.frontier) == 2 and not info.conflict
    names = {type(n).__name__ for n in info.weight_side}
    assert names <= {"AccumulateGrad", "TBackward0"}, names


def test_backward_full_matches_reference():
    module = Block(32, 4, 0.0)
    inputs = [torch.randn(2, 8, 32)]
    grad_out = [torch.randn(2, 8, 32)]
    ref_inputs, ref_params = _reference(module, inputs, grad_out)
    module.zero_grad(set_to_none=True)
    x = inputs[0].clone().requires_grad_()
    (dx,) = backward_full([module(x)], grad_out, [x], list(module.parameters()))
    torch.testing.assert_close(dx, ref_inputs[0])
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name])


def test_backward_full_returns_input_grads_and_leaves_their_grad_alone():
    module = LinearAct(8, "relu")
    x = torch.randn(4, 8, requires_grad=True)
    x.grad = torch.full_like(x, 7.0)
    (dx,) = backward_full([module(x)], [torch.ones(4, 8)], [x], list(module.parameters()))
    expected = torch.autograd.grad(module(x), x, torch.ones(4, 8))[0]
    torch.testing.assert_close(dx, expected)
    assert torch.equal(x.grad, torch.full_like(x, 7.0))


def test_input_grad_keeps_only_what_the_weight_grad_reads():
    """After I, the recorder holds exactly the kept-until-W bytes the profiles count: a Linear chain keeps each
    Linear's input (dW = x^T g) and drops the GELU input and Tanh output that only I reads; W is still exact."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh())
    params = list(module.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors() as saved:
        out = module(x)
    split = saved_split(saved, analyze([out], [x], params).weight_grad_nodes, exclude=params)
    tensor = 4 * 8 * 4
    assert (split.total_bytes, split.kept_until_weight_grad_bytes) == (4 * tensor, 2 * tensor)
    _, state = backward_input([out], [torch.ones_like(out)], [x], params, saved=saved)
    assert sum(saved.storage_bytes(exclude=params).values()) == split.kept_until_weight_grad_bytes
    backward_weight(state)
    got = [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)
    module(x).backward(torch.ones(4, 8))
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad)


def test_grads_accumulate_across_microbatches():
    module = LinearAct(8, "relu")
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    g = torch.randn(4, 8)
    module.zero_grad(set_to_none=True)
    (module(x1).mul(g).sum() + module(x2).mul(g).sum()).backward()
    expected = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    for x in (x1, x2):
        xx = x.clone().requires_grad_()
        _, state = backward_input([module(xx)], [g], [xx], list(module.parameters()))
        backward_weight(state)
    for p, e in zip(module.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xx = x1.clone().requires_grad_()
        _, state = backward_input([module(xx)], [g], [xx], list(module.parameters()))
        backward_weight(state)
        with pytest.raises(AssertionError):
            backward_weight(state)


def test_weight_pass_releases_the_buffers_it_used():
    """W runs each node once without retaining the graph: a frontier node's saved input is released after W."""
    module = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    out = module(x)
    info = analyze([out], [x], list(module.parameters()))
    frontier = next(iter(info.frontier))
    saved = [name for name in dir(frontier) if name.startswith("_saved_mat1")]
    assert saved, "expected an addmm-like frontier node saving mat1"
    _, state = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    getattr(frontier, saved[0])  # still there after I: W needs it
    backward_weight(state)
    with pytest.raises(RuntimeError):
        getattr(frontier, saved[0])


class RandomProgram(nn.Module):
    """A random DAG over two inputs and a few parameters reused in several places (hypothesis drives it)."""

    def __init__(self, steps: list[tuple[int, int, int, int]]) -> None:
        super().__init__()
        self.steps = steps
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(8, 8) / 3) for _ in range(2))
        self.vectors = nn.ParameterList(nn.Parameter(torch.randn(8) / 3) for _ in range(2))

    def forward(self, x, y):
        values = [x, y]
        for op, a, b, c in self.steps:
            src, other = values[a % len(values)], values[b % len(values)]
            weight, vector = self.weights[c % 2], self.vectors[c % 2]
            if op == 0:
                values.append(nn.functional.linear(src, weight, vector))
            elif op == 1:
                values.append(src * vector)
            elif op == 2:
                values.append(src + other)
            elif op == 3:
                values.append(torch.tanh(src) + vector.exp())
            else:
                values.append(src @ (weight * vector))
        return values[-1] + values[-2]


@settings(max_examples=40)
@given(st.lists(st.tuples(*(st.integers(0, 4),) + (st.integers(0, 9),) * 3), min_size=1, max_size=7))
def test_random_programs_split_exactly(steps):
    torch.manual_seed(0)
    _check(RandomProgram(steps), [torch.randn(4, 8), torch.randn(4, 8)])  # a fallback (warned) is allowed here


# ---- SplitCache: the analysis remembered per stage, by graph shape


def _same_analysis(got, want) -> None:
    """Equal node sets; frontier edges and captures compared as sets (`analyze` orders them by object id)."""
    assert (got.input_side, got.weight_side, got.param_paths) == (want.input_side, want.weight_side, want.param_paths)
    assert {n: set(edges) for n, edges in got.frontier.items()} == {n: set(e) for n, e in want.frontier.items()}
    assert list(got.frontier) == list(want.frontier)  # W's order of frontier calls (the sums' order)
    assert (got.weight_roots, got.conflict) == (want.weight_roots, want.conflict)
    assert set(got.input_captures) == set(want.input_captures)
    assert got.weight_grad_nodes == want.weight_grad_nodes


def _fresh_graph(module, inputs):
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = module(*leaves)
    return list(outs if isinstance(outs, tuple) else (outs,)), leaves


CACHED_MODULES = [
    (lambda: Block(32, 4, 0.0), lambda: [torch.randn(2, 8, 32)]),
    (lambda: ResidualBlock(8), lambda: [torch.randn(2, 8, 6, 6)]),
    (TwiceLinear, lambda: [torch.randn(4, 8)]),  # a captured shared edge
    (SharedAndTransformed, lambda: [torch.randn(4, 8)]),  # the fallback (conflict)
    (lambda: Embedding(50, 16, 10, 0.0), lambda: [torch.randint(0, 50, (3, 10))]),  # weight roots only
    (TwoOutputs, lambda: [torch.randn(4, 8)]),
]


@pytest.mark.parametrize("make, batch", CACHED_MODULES)
def test_cached_analysis_is_the_analysis_of_each_new_graph(make, batch):
    torch.manual_seed(0)
    module, cache = make(), SplitCache()
    params = list(module.parameters())
    for _ in range(3):
        outs, leaves = _fresh_graph(module, batch())
        _same_analysis(cache.analyze(outs, leaves, params), analyze(outs, leaves, params))
    assert (cache.misses, cache.hits) == (1, 2)


def test_cached_split_gives_the_same_gradients_bit_for_bit(console_warnings):
    """Three microbatches of I then W through one cache accumulate exactly what the uncached passes do."""
    torch.manual_seed(0)
    module = nn.Sequential(Block(32, 4, 0.0), Block(32, 4, 0.0))
    params = list(module.parameters())
    batches = [torch.randn(2, 8, 32) for _ in range(3)]
    results = []
    for cache in (None, SplitCache()):
        module.zero_grad(set_to_none=True)
        input_grads = []
        for x in batches:
            with SavedTensors() as saved:
                outs, leaves = _fresh_graph(module, [x])
            grads, state = backward_input(outs, [torch.ones_like(outs[0])], leaves, params, saved=saved, cache=cache)
            backward_weight(state)
            input_grads.append(grads[0])
        results.append((input_grads, [p.grad.clone() for p in params]))
    for plain, cached in zip(*(r[0] + r[1] for r in results), strict=True):
        assert torch.equal(plain, cached)
    assert not console_warnings()


def test_a_graph_of_another_shape_is_analysed_afresh():
    """Data-dependent code builds another graph: the cache must not map the old answer onto it."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            return self.b(torch.tanh(h)) if bool(x.sum() > 0) else h * self.b.bias

    module, cache = Branchy(), SplitCache(shapes=1)
    params = list(module.parameters())
    for x in (torch.ones(4, 8), -torch.ones(4, 8), torch.ones(4, 8), torch.ones(4, 8)):
        outs, leaves = _fresh_graph(module, [x])
        _same_analysis(cache.analyze(outs, leaves, params), analyze(outs, leaves, params))
    assert (cache.misses, cache.hits) == (3, 1)  # one shape remembered: the first is forgotten by the third call


def test_cached_analysis_follows_other_parameter_tensors():
    """Asynchronous schedules run a stage on stashed weight versions: same shape, other parameter tensors."""
    torch.manual_seed(0)
    module, cache = LinearAct(8, "relu"), SplitCache()
    versions = [list(module.parameters()), [nn.Parameter(p.detach().clone()) for p in module.parameters()]]
    for params in versions:
        x = torch.randn(4, 8, requires_grad=True)
        out = torch.relu(nn.functional.linear(x, params[0], params[1]))
        info = cache.analyze([out], [x], params)
        _same_analysis(info, analyze([out], [x], params))
        leaves = {id(n.variable) for n in info.weight_side if type(n).__name__ == "AccumulateGrad"}
        assert leaves == {id(p) for p in params}
    assert cache.hits == 1


@settings(max_examples=25)
@given(st.lists(st.tuples(*(st.integers(0, 4),) + (st.integers(0, 9),) * 3), min_size=1, max_size=7))
def test_random_programs_cached_analysis(steps):
    torch.manual_seed(0)
    module, cache = RandomProgram(steps), SplitCache()
    params = list(module.parameters())
    for _ in range(2):
        outs, leaves = _fresh_graph(module, [torch.randn(4, 8), torch.randn(4, 8)])
        _same_analysis(cache.analyze(outs, leaves, params), analyze(outs, leaves, params))
    assert cache.hits == 1
