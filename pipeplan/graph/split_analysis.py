"""Which autograd nodes the input-gradient pass (I) and the weight-gradient pass (W) run, for one backward of a
stage (`analyze`), and the same answer remembered per stage (`SplitCache`): what `split_backward` runs I and W by.

How: walk the autograd graph from the outputs. `input side` = nodes with a path to an input that needs a gradient;
`weight side` = nodes with a path to a parameter but none to an input. A *frontier* node is an input-side node with
edges into the weight side (e.g. the AddmmBackward of a Linear: it computes dX for I and dW for W). A weight-side
edge that a frontier node also reaches through another child (the bias of one Linear applied twice in a row) is
captured by I instead; only if a weight-side node also feeds such an edge does W fall back to one backward from the
outputs to the parameters (`conflict`). See split_backward for how the passes use these sets.

Every microbatch builds a new autograd graph, but a stage builds the same graph each time: `SplitCache` keeps the
analysis as positions in a depth-first order fixed by the graph's shape (each node's kind, whether it is an input
or a parameter, and its `next_functions` as positions), and for the next graph walks that order once, compares
the shape, and reads the answer off the positions. A graph of another shape (data-dependent code) is analysed
afresh; the last few shapes are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge

# a leaf's node: `.variable` is the leaf (torch's stubs leave out the autograd node classes)
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


@dataclass
class SplitAnalysis:
    """Which autograd nodes belong to I and W for one (outputs, inputs, params) triple."""

    input_side: set  # nodes with a path to an input needing a gradient
    weight_side: set  # nodes with a path to a parameter and none to an input
    frontier: dict  # input-side node -> its edges (node, input_nr) into the weight side
    weight_roots: list[int]  # indices of outputs whose grad_fn is weight side
    conflict: bool  # W must fall back to one backward from the outputs (see the module docstring)
    input_captures: list = field(default_factory=list)  # shared weight-side edges whose gradient I captures
    param_paths: set = field(default_factory=set)  # nodes with a path to a parameter (what the fallback W runs)

    @property
    def weight_grad_nodes(self) -> set:
        """Nodes W runs (frontier + weight side; every node on a path to a parameter when W falls back): their
        saved tensors live until W, everything else saved is freed once I is done."""
        if self.conflict:
            return set(self.param_paths)
        return set(self.frontier) | self.weight_side


def node_of(tensor: torch.Tensor):
    """The autograd node a gradient for `tensor` flows into (its grad_fn, or a leaf's AccumulateGrad)."""
    return get_gradient_edge(tensor).node


def _walk(roots: list, input_nodes: set, param_nodes: set) -> tuple[dict, dict, dict, list]:
    """Post-order DFS from `roots` (iterative: autograd graphs can be thousands of nodes deep).
    Returns (children, reaches_input, reaches_param, post-order list); inputs are not expanded."""
    children: dict = {}
    reaches_input: dict = {}
    reaches_param: dict = {}
    order: list = []
    for root in roots:
        if root is None or root in children:
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                kids = children[node]
                reaches_input[node] = node in input_nodes or any(reaches_input[k] for k in kids)
                reaches_param[node] = node in param_nodes or any(reaches_param[k] for k in kids)
                order.append(node)
                continue
            if node in children:
                continue
            kids = [] if node in input_nodes else [n for n, _ in node.next_functions if n is not None]
            children[node] = kids
            stack.append((node, True))
            stack.extend((k, False) for k in kids if k not in children)
    return children, reaches_input, reaches_param, order


def analyze(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
    """Classify the autograd graph below `outputs` (see SplitAnalysis)."""
    input_nodes = {node_of(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad}
    param_nodes = {node_of(p) for p in params}
    roots = [t.grad_fn for t in outputs]
    children, reaches_input, reaches_param, order = _walk(roots, input_nodes, param_nodes)
    input_side = {n for n in order if reaches_input[n]}
    weight_side = {n for n in order if not reaches_input[n] and reaches_param[n]}
    frontier: dict = {}
    for node in order:
        if node in input_side:
            edges = {(kid, nr) for kid, nr in node.next_functions if kid is not None and kid in weight_side}
            if edges:
                frontier[node] = sorted(edges, key=lambda edge: (id(edge[0]), edge[1]))
    # conflict: a frontier node's weight-side entry is also reachable through another of its children
    entry_bit = {kid: 1 << i for i, kid in enumerate({kid for edges in frontier.values() for kid, _ in edges})}
    below: dict = {}  # entries strictly below a node
    for node in order:
        bits = 0
        for kid in children[node]:
            bits |= below[kid] | entry_bit.get(kid, 0)
        below[node] = bits
    # an entry a frontier node also reaches through another child is "shared" (the bias of a Linear applied twice
    # in a row): I captures the gradient arriving at it, and phase 1 leaves it out
    shared_bits = 0
    for node, edges in frontier.items():
        own = 0
        for kid, _ in edges:
            own |= entry_bit[kid]
        for kid in children[node]:
            shared_bits |= below[kid] & own
    shared = {kid for kid, bit in entry_bit.items() if bit & shared_bits}
    # ... which is only right when no weight-side node feeds it (I would run that node too)
    conflict = any(kid in shared for node in weight_side for kid in children[node])
    input_captures = sorted(
        {(kid, nr) for edges in frontier.values() for kid, nr in edges if kid in shared},
        key=lambda edge: (id(edge[0]), edge[1]),
    )
    frontier = {node: [e for e in edges if e[0] not in shared] for node, edges in frontier.items()}
    frontier = {node: edges for node, edges in frontier.items() if edges}
    weight_roots = [i for i, root in enumerate(roots) if root is not None and root in weight_side]
    param_paths = {n for n in order if reaches_param[n]}
    return SplitAnalysis(input_side, weight_side, frontier, weight_roots, conflict, input_captures, param_paths)


def _shape(roots: list, input_nodes: set, param_ids: set[int]) -> tuple[list, tuple]:
    """(the nodes below `roots` in a depth-first order that only the graph's shape decides, that shape): the roots'
    positions, then per node None for an input (not expanded), else its kind, whether it is a parameter's leaf and
    its next_functions as (position or -1, input_nr). Two graphs of equal shape are analysed alike, position by
    position."""
    index: dict = {}
    order: list = []
    for root in roots:
        if root is None or root in index:
            continue
        stack = [root]
        while stack:
            node = stack.pop()
            if node in index:
                continue
            index[node] = len(order)
            order.append(node)
            if node not in input_nodes:
                stack.extend(n for n, _ in reversed(node.next_functions) if n is not None and n not in index)
    shape: list = [tuple(-1 if root is None else index[root] for root in roots)]
    for node in order:
        if node in input_nodes:
            shape.append(None)
            continue
        param = type(node) is _ACCUMULATE_GRAD and id(node.variable) in param_ids
        edges = tuple((-1 if n is None else index[n], nr) for n, nr in node.next_functions)
        shape.append((type(node), param, edges))
    return order, tuple(shape)


@dataclass(frozen=True)
class _Positions:
    """A SplitAnalysis with every node given as its position in `_shape`'s order."""

    input_side: tuple[int, ...]
    weight_side: tuple[int, ...]
    frontier: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # in the analysis's order
    weight_roots: tuple[int, ...]
    conflict: bool
    input_captures: tuple[tuple[int, int], ...]
    param_paths: tuple[int, ...]

    @classmethod
    def of(cls, info: SplitAnalysis, order: list) -> _Positions:
        index = {node: i for i, node in enumerate(order)}
        return cls(
            input_side=tuple(index[n] for n in info.input_side),
            weight_side=tuple(index[n] for n in info.weight_side),
            frontier=tuple((index[n], tuple((index[k], nr) for k, nr in edges)) for n, edges in info.frontier.items()),
            weight_roots=tuple(info.weight_roots),
            conflict=info.conflict,
            input_captures=tuple((index[k], nr) for k, nr in info.input_captures),
            param_paths=tuple(index[n] for n in info.param_paths),
        )

    def on(self, order: list) -> SplitAnalysis:
        """The analysis of the graph whose nodes are `order` (a graph of the same shape)."""
        return SplitAnalysis(
            input_side={order[i] for i in self.input_side},
            weight_side={order[i] for i in self.weight_side},
            frontier={order[i]: [(order[k], nr) for k, nr in edges] for i, edges in self.frontier},
            weight_roots=list(self.weight_roots),
            conflict=self.conflict,
            input_captures=[(order[k], nr) for k, nr in self.input_captures],
            param_paths={order[i] for i in self.param_paths},
        )


class SplitCache:
    """`analyze` for one stage, remembered by graph shape (see the module docstring): the runtime keeps one per
    stage, so each microbatch's I walks its graph once instead of analysing it. `hits` and `misses` count the calls
    answered from memory and afresh."""

    def __init__(self, shapes: int = 4) -> None:
        self._known: OrderedDict[tuple, _Positions] = OrderedDict()
        self._shapes = shapes
        self.hits = 0
        self.misses = 0

    def analyze(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> SplitAnalysis:
        input_nodes = {node_of(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad}
        order, shape = _shape([t.grad_fn for t in outputs], input_nodes, {id(p) for p in params})
        known = self._known.get(shape)
        if known is not None:
            self.hits += 1
            self._known.move_to_end(shape)
            return known.on(order)
        self.misses += 1
        info = analyze(outputs, inputs, params)
        self._known[shape] = _Positions.of(info, order)
        if len(self._known) > self._shapes:
            self._known.popitem(last=False)
        return info
