"""One saved-tensor walker and one kept-until-W rule: the measured profiler (real tensors) and the analytic one
(meta tensors) split a layer's saved bytes identically, and nodes' saved tensors are found wherever they live."""

from __future__ import annotations

import pytest
import torch

from pipeplan.graph.saved_tensors import SavedTensors, node_saved_tensors, storage_key
from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.measure import profile_model


@pytest.mark.parametrize(
    ("model", "options"),
    [("mlp", dict(layers=4, hidden=16)), ("resnet", dict(blocks=2, channels=8, image=8, classes=5))],
)
def test_measured_and_analytic_profiles_split_saved_bytes_alike(model, options):
    spec = load_model(model, options)
    measured = profile_model(spec, batch_size=4, warmup=0, repeats=1, progress=False, precision="fp32")
    analytic = profile_analytic(spec, batch_size=4, hardware="h100", precision="fp32")
    # every layer but the first: the measured profiler gives a float model input a gradient (the first layer's I;
    # the analytic one does not, as the runtime); both run loss_fn with the last layer
    assert len(measured.layers) == len(analytic.layers) > 3
    for got, expected in zip(analytic.layers[1:], measured.layers[1:], strict=True):
        assert got.activation_bytes == expected.activation_bytes > 0, got.name
        assert got.activation_freed_by_input_grad_bytes == expected.activation_freed_by_input_grad_bytes, got.name


def test_custom_function_saved_tensors_are_walked():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.randn(3, requires_grad=True)
    with SavedTensors() as saved:
        y = Square.apply(x).tanh()
    keys = {storage_key(t) for t in saved.tensors}
    tanh_saved = node_saved_tensors(y.grad_fn)
    square_saved = node_saved_tensors(y.grad_fn.next_functions[0][0])
    assert [storage_key(t) for t in square_saved] == [storage_key(x)]
    assert {storage_key(t) for t in tanh_saved + square_saved} == keys
    saved.release(set())
    with pytest.raises(AssertionError, match="released"):
        y.backward(torch.ones(3))


def test_the_recorder_is_freed_with_its_graph_without_waiting_for_gc():
    """No reference cycle: what a forward saved goes as soon as its graph does (activations must not wait for gc)."""
    import gc
    import weakref

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    gc.disable()
    try:
        with SavedTensors() as saved:
            y = module(x)
        alive = weakref.ref(saved)
        y.sum().backward()
        del saved, y
        assert alive() is None
    finally:
        gc.enable()


def test_a_following_recorder_lets_autograd_free_as_it_goes():
    """hold=False (the runtime): once autograd has run a node, what it saved is gone, though the recorder lives."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors(hold=False) as following, SavedTensors() as holding:
        y = module(x)
    assert following.tensors == [] and holding.tensors  # the innermost hooks record
    with SavedTensors() as holding, SavedTensors(hold=False) as following:
        y = module(x)
    params = list(module.parameters())
    assert len(following.storage_bytes(exclude=params)) == 2 and holding.tensors == []  # x and the tanh output
    y.sum().backward()
    assert following.tensors == []
