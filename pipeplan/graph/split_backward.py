"""The backward passes, one implementation for the profilers and the runtime's executor: B (`backward_full`: input
and parameter gradients in one pass), and B split into I (gradients w.r.t. the inputs only) and W (gradients w.r.t.
the parameters only), for any module, without W redoing I's work. Zero-bubble schedules run I early and W later to
fill bubbles. What each pass keeps alive is `SplitAnalysis.weight_grad_nodes` (see saved_tensors): given the
forward's `SavedTensors`, I releases everything else it saved, so memory between I and W is what profiles count.

How: `split_analysis.analyze` walks the autograd graph from the outputs into an input side, a weight side and the
*frontier* between them (input-side nodes with edges into the weight side, e.g. the AddmmBackward of a Linear: it
computes dX for I and dW for W); the runtime passes one `SplitCache` per stage, so a stage's graph, the same for
every microbatch, is analysed once.
- I runs `autograd.grad(outputs, inputs)`: the engine computes only what the inputs need (for a frontier node, only
  its input-side outputs) while a pre-hook on each frontier node captures the gradient arriving at it.
- W phase 1 re-enters each frontier node (`autograd.grad(GradientEdge(node, k), its weight-side edges, captured)`),
  so it computes only its weight-side outputs (the dW matmul); phase 2 runs the weight-side subgraph once from all
  those edges (contributions to one edge summed; the backward is linear) down to the parameters.
  Outputs that do not depend on any input (a first stage fed token ids) are weight side from the start: I does
  nothing and W runs from them. Every node runs once, so W does not retain the graph.
A weight-side edge that a frontier node also reaches through another child (the bias of one Linear applied twice in
a row) is captured by I instead (I computes the cheap gradient flowing into it; W starts phase 2 from it). Only if a
weight-side node also feeds such an edge does W fall back to one backward from the outputs to the parameters
(correct, but W then repeats I's traversal; a warning says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipeplan.console import warn
from pipeplan.graph.saved_tensors import SavedTensors, storages_saved_by
from pipeplan.graph.split_analysis import SplitAnalysis, SplitCache, analyze

__all__ = ["SplitAnalysis", "SplitCache", "analyze", "backward_full", "backward_input", "backward_weight"]


@dataclass
class WeightGradState:
    """What W needs after I: gradients captured at frontier nodes. `backward_weight` consumes it."""

    params: list[torch.Tensor]
    frontier_calls: list[tuple[list, list[torch.Tensor], list]] = field(default_factory=list)  # roots, grads, edges
    weight_roots: list[tuple[object, torch.Tensor]] = field(default_factory=list)  # (GradientEdge, grad)
    fallback: tuple[list, list] | None = None  # (outputs, grads) when W must redo the traversal
    done: bool = False


def _live_outputs(outputs, grad_outputs):
    assert len(outputs) == len(grad_outputs), "one grad_output per output"
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grad_outputs)
        if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _trainable(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    unique = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


def accumulate_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """`param.grad += grad` (or set it), as AccumulateGrad does."""
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad.detach()
        else:
            param.grad.add_(grad)


def _input_grads(outputs, grads, inputs, captures=()) -> tuple[tuple[torch.Tensor | None, ...], list]:
    """Gradients of `inputs` (zeros where unused) and of the GradientEdges `captures`, the graph retained."""
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    captured: list = [None] * len(captures)
    targets = [inputs[i] for i in wanted] + list(captures)
    if targets and outputs:
        computed = torch.autograd.grad(outputs, targets, grads, retain_graph=True, allow_unused=True)
        for i, grad in zip(wanted, computed):
            result[i] = grad
        captured = list(computed[len(wanted) :])
    for i in wanted:
        if result[i] is None:
            result[i] = torch.zeros_like(inputs[i])
    return tuple(result), captured


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    saved: SavedTensors | None = None,
    cache: SplitCache | None = None,
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradState]:
    """I: gradients of `inputs` (None where an input does not require grad; zeros where unused). Outputs with no
    grad_output (None) or no grad are skipped. Returns the state `backward_weight` needs. `saved`: the recorder
    the forward ran under; once I is done it keeps only what W reads (`SplitAnalysis.weight_grad_nodes`).
    `cache`: the stage's `SplitCache` (the graph analysed once per shape, not per call)."""
    params = _trainable(params)
    outs, grads = _live_outputs(list(outputs), list(grad_outputs))
    state = WeightGradState(params=params)
    if not outs:
        if saved is not None:
            saved.release(set())
        return _input_grads([], [], list(inputs))[0], state
    info = cache.analyze(outs, inputs, params) if cache is not None else analyze(outs, inputs, params)
    kept = storages_saved_by(info.weight_grad_nodes) if saved is not None else set()
    if info.conflict:
        warn(
            "split backward: a weight-side node feeds an edge shared by several input-side paths; W recomputes "
            "the backward to the parameters",
            once=True,  # analyzed per microbatch: say it once
        )
        state.fallback = (outs, grads)
        input_grads = _input_grads(outs, grads, list(inputs))[0]
    else:
        input_grads = _split_input_pass(info, outs, grads, inputs, state)
    if saved is not None:
        saved.release(kept)
    return input_grads, state


def _split_input_pass(info: SplitAnalysis, outs: list, grads: list, inputs, state: WeightGradState) -> tuple:
    """Run I, capturing at the frontier what W will need (into `state`); returns the input gradients."""
    # outputs on the weight side never reach an input: W starts from them, I leaves them out
    on_input_side = [i for i in range(len(outs)) if i not in set(info.weight_roots)]
    captured: dict = {}
    handles = [node.register_prehook(_capture(captured, node)) for node in info.frontier]
    shared = [GradientEdge(node, nr) for node, nr in info.input_captures]
    try:
        input_grads, shared_grads = _input_grads(
            [outs[i] for i in on_input_side], [grads[i] for i in on_input_side], list(inputs), shared
        )
    finally:
        for handle in handles:
            handle.remove()
    for node, edges in info.frontier.items():
        slots = [(k, g) for k, g in enumerate(captured.get(node, ())) if g is not None]
        if slots:
            roots = [GradientEdge(node, k) for k, _ in slots]
            state.frontier_calls.append((roots, [g for _, g in slots], [GradientEdge(n, nr) for n, nr in edges]))
    state.weight_roots = [(get_gradient_edge(outs[i]), grads[i]) for i in info.weight_roots]
    state.weight_roots += [(edge, grad) for edge, grad in zip(shared, shared_grads) if grad is not None]
    return input_grads


def _capture(captured: dict, node):
    def hook(grad_outputs):
        captured[node] = tuple(grad_outputs)

    return hook


def backward_weight(state: WeightGradState) -> None:
    """W: accumulate the parameter gradients into `param.grad`, then drop the captured state (and graph refs).

    Phase 1 re-enters each frontier node for its weight-side outputs only; phase 2 runs the weight-side subgraph
    once from all of them (summing what several frontier nodes send to one entry). Each node runs once, so the
    graph is not retained: weight-side buffers are freed as W goes."""
    assert not state.done, "backward_weight called twice for one backward_input"
    params = state.params
    if state.fallback is not None:
        outs, grads = state.fallback
        accumulate_grads(params, torch.autograd.grad(outs, params, grads, allow_unused=True))
    else:
        entries: dict[tuple[int, int], list] = {}  # (id(node), input_nr) -> [GradientEdge, summed grad]
        for roots, grads, edges in state.frontier_calls:
            computed = torch.autograd.grad(roots, edges, grads, allow_unused=True)
            for edge, grad in zip(edges, computed):
                _add_entry(entries, edge, grad)
        for edge, grad in state.weight_roots:
            _add_entry(entries, edge, grad)
        if entries:
            edges = [edge for edge, _ in entries.values()]
            grads = [grad for _, grad in entries.values()]
            accumulate_grads(params, torch.autograd.grad(edges, params, grads, allow_unused=True))
    state.frontier_calls.clear()
    state.weight_roots.clear()
    state.fallback = None
    state.done = True


def _add_entry(entries: dict, edge, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    key = (id(edge.node), edge.output_nr)
    if key in entries:
        entries[key][1] = entries[key][1] + grad
    else:
        entries[key] = [edge, grad]


def backward_full(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """B: input gradients (returned; None where an input needs none, zeros where unused) and parameter gradients
    (accumulated into `.grad`) in one autograd pass. It accumulates straight into `.grad`, so AccumulateGrad can
    reuse buffers (autograd.grad + add cannot); the inputs' own `.grad` is left as it was."""
    params = _trainable(params)
    outs, grads = _live_outputs(list(outputs), list(grad_outputs))
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = [inputs[i] for i in wanted]
    stashed = [leaf.grad for leaf in leaves]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    try:
        for leaf in leaves:
            leaf.grad = None
        if outs and (leaves or params):
            torch.autograd.backward(outs, grads, inputs=[*leaves, *params], retain_graph=retain_graph)
        for i, leaf in zip(wanted, leaves):
            result[i] = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
    finally:
        for leaf, grad in zip(leaves, stashed):
            leaf.grad = grad
    return tuple(result)
