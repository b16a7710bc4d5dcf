"""Split one backward pass into I (gradients w.r.t. the inputs only) and W (gradients w.r.t. the parameters only),
for any module, without W redoing I's work. Zero-bubble schedules run I early and W later to fill bubbles.

How: walk the autograd graph from the outputs. `input side` = nodes with a path to an input that needs a gradient;
`weight side` = nodes with a path to a parameter but none to an input. A *frontier* node is an input-side node with
an edge into the weight side (e.g. the AddmmBackward of a Linear: it computes dX for I and dW for W).
- I runs `autograd.grad(outputs, inputs)`: the engine computes only what the inputs need (for a frontier node, only
  its input-side outputs) while a pre-hook on each frontier node captures the gradient arriving at it.
- W runs, per frontier node, `autograd.grad(GradientEdge(node, k), params_below_it, captured)`: the engine
  re-enters the node computing only its weight-side outputs, then the weight-side subgraph. By linearity the
  per-node parameter gradients sum to the full ones. Outputs that do not depend on any input (a first stage fed
  token ids) are weight side from the start: I does nothing and W runs from them.
If a parameter is reachable from a frontier node both directly and through another input-side node (the same
module applied twice in a row), the per-node W calls would double count, so W falls back to one full backward
to the parameters (correct, but W then repeats I's traversal; a warning says so once).

The graph is retained between I and W; W drops every reference it holds, so the saved activations are freed as
soon as the caller drops the outputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class SplitAnalysis:
    """Which autograd nodes belong to I and W for one (outputs, inputs, params) triple."""

    input_side: set  # nodes with a path to an input needing a gradient
    weight_side: set  # nodes with a path to a parameter and none to an input
    frontier: dict  # input-side node -> bitmask of parameter indices below its weight-side edges
    weight_roots: list[int]  # indices of outputs whose grad_fn is weight side
    root_masks: int  # parameters below the weight-side roots
    conflict: bool  # a per-node W call would double count (see the module docstring)

    @property
    def weight_grad_nodes(self) -> set:
        """Nodes W runs (frontier + weight side): their saved tensors live until W."""
        return set(self.frontier) | self.weight_side


@dataclass
class WeightGradState:
    """What W needs after I: captured gradients at frontier nodes. `backward_weight` consumes it."""

    params: list[torch.Tensor]
    calls: list[tuple[list, list[torch.Tensor], list[int]]] = field(default_factory=list)  # roots, grads, params
    done: bool = False


def _node_of(tensor: torch.Tensor):
    return get_gradient_edge(tensor).node


def analyze(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
    """Classify the autograd graph below `outputs` (see SplitAnalysis)."""
    input_nodes = {_node_of(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad}
    param_bits = {_node_of(p): 1 << i for i, p in enumerate(params)}
    roots = [t.grad_fn for t in outputs]
    reaches_input: dict = {}
    mask: dict = {}
    children: dict = {}
    for root in roots:
        if root is None or root in mask:
            continue
        stack = [(root, False)]
        while stack:  # iterative post-order DFS: autograd graphs can be thousands of nodes deep
            node, expanded = stack.pop()
            if expanded:
                kids = children[node]
                reaches_input[node] = node in input_nodes or any(reaches_input[k] for k in kids)
                bits = param_bits.get(node, 0)
                for kid in kids:
                    bits |= mask[kid]
                mask[node] = bits
                continue
            if node in mask or node in children:
                continue
            kids = [] if node in input_nodes else [n for n, _ in node.next_functions if n is not None]
            children[node] = kids
            stack.append((node, True))
            stack.extend((k, False) for k in kids if k not in children)
    input_side = {n for n, hit in reaches_input.items() if hit}
    weight_side = {n for n, hit in reaches_input.items() if not hit and mask[n]}
    frontier: dict = {}
    conflict = False
    for node in input_side:
        below_weight = below_input = 0
        for kid in children[node]:
            if kid in weight_side:
                below_weight |= mask[kid]
            elif kid in input_side:
                below_input |= mask[kid]
        if below_weight:
            frontier[node] = below_weight
            conflict |= bool(below_weight & below_input)
    weight_roots = [i for i, root in enumerate(roots) if root is not None and root in weight_side]
    root_masks = 0
    for i in weight_roots:
        root_masks |= mask[roots[i]]
    return SplitAnalysis(input_side, weight_side, frontier, weight_roots, root_masks, conflict)


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


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def accumulate_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """`param.grad += grad` (or set it), as AccumulateGrad does."""
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad.detach()
        else:
            param.grad.add_(grad)


def _input_grads(outputs, grads, inputs, *, retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if wanted and outputs:
        computed = torch.autograd.grad(
            outputs,
            [inputs[i] for i in wanted],
            grads,
            retain_graph=retain_graph,
            allow_unused=True,
            materialize_grads=True,
        )
        for i, grad in zip(wanted, computed):
            result[i] = grad
    elif wanted:
        for i in wanted:
            result[i] = torch.zeros_like(inputs[i])
    return tuple(result)


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradState]:
    """I: gradients of `inputs` (None where an input does not require grad; zeros where unused). Outputs with no
    grad_output (None) or no grad are skipped. Returns the state `backward_weight` needs."""
    params = _trainable(params)
    outs, grads = _live_outputs(list(outputs), list(grad_outputs))
    state = WeightGradState(params=params)
    if not outs:
        return _input_grads([], [], list(inputs), retain_graph=False), state
    info = analyze(outs, inputs, params)
    if info.conflict:
        warnings.warn(
            "split backward: a parameter is reached through several input-side paths (a module applied twice); "
            "W recomputes the backward to the parameters",
            RuntimeWarning,
            stacklevel=2,
        )
        input_grads = _input_grads(outs, grads, list(inputs), retain_graph=True)
        state.calls.append((outs, grads, list(range(len(params)))))
        return input_grads, state
    captured: dict = {}
    handles = [node.register_prehook(_capture(captured, node)) for node in info.frontier]
    try:
        input_grads = _input_grads(outs, grads, list(inputs), retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    for node, below in info.frontier.items():
        slots = [(k, g) for k, g in enumerate(captured.get(node, ())) if g is not None]
        if slots:
            state.calls.append(([GradientEdge(node, k) for k, _ in slots], [g for _, g in slots], _bits(below)))
    if info.weight_roots:
        roots = [outs[i] for i in info.weight_roots]
        state.calls.append((roots, [grads[i] for i in info.weight_roots], _bits(info.root_masks)))
    return input_grads, state


def _capture(captured: dict, node):
    def hook(grad_outputs):
        captured[node] = tuple(grad_outputs)

    return hook


def backward_weight(state: WeightGradState) -> None:
    """W: accumulate the parameter gradients into `param.grad`, then drop the captured state and graph refs."""
    assert not state.done, "backward_weight called twice for one backward_input"
    params = state.params
    for roots, grads, indices in state.calls:
        targets = [params[i] for i in indices]
        computed = torch.autograd.grad(roots, targets, grads, retain_graph=True, allow_unused=True)
        accumulate_grads(targets, computed)
    state.calls.clear()
    state.done = True


def backward_full(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """B: input gradients (returned) and parameter gradients (accumulated into .grad) in one pass."""
    params = _trainable(params)
    outs, grads = _live_outputs(list(outputs), list(grad_outputs))
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if not outs:
        for i in wanted:
            result[i] = torch.zeros_like(inputs[i])
        return tuple(result)
    targets = [inputs[i] for i in wanted] + params
    computed = torch.autograd.grad(outs, targets, grads, allow_unused=True)
    for i, grad in zip(wanted, computed[: len(wanted)]):
        result[i] = grad if grad is not None else torch.zeros_like(inputs[i])
    accumulate_grads(params, computed[len(wanted) :])
    return tuple(result)
