"""Per-layer profile data as prefix sums, the form every cost formula of the partitioner reads a stage from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.profiling.profile import Profile


@dataclass(frozen=True, eq=False)
class LayerArrays:
    """Prefix sums over layers (index k = sum of the first k layers) and cut bytes per boundary.

    `cut[k]` = bytes live across the boundary before layer k; cut[0] = cut[n] = 0. Recomputation data
    (`costs.recompute`): prefix sums of the bytes kept under selective recomputation and of the two recompute times;
    per item, `entering[k]` the bytes entering item k from before it (the model's inputs for the first: what a stage
    starting there keeps under full recomputation) and `internals[k]` the largest attention internals one of its
    layers saves (what selective recomputation re-creates at once); for full recomputation layer by layer, prefix
    sums of every layer's entering bytes (`inputs`) and per item the most one layer re-creates (`regrowth`).
    `reversed_order`: the items run last to first (`reversed()`), so a stage's first layer in model order is its
    last item."""

    forward: np.ndarray
    input_grad: np.ndarray
    weight_grad: np.ndarray
    backward: np.ndarray
    activation: np.ndarray
    freed: np.ndarray  # activation bytes freed by the input-gradient pass (I)
    param_bytes: np.ndarray
    param_count: np.ndarray
    cut: np.ndarray
    bounds: np.ndarray  # layer index where each item starts, plus num_layers (items may group layers)
    selective: np.ndarray  # bytes kept under selective recomputation
    selective_recompute: np.ndarray  # ms
    full_recompute: np.ndarray  # ms
    entering: np.ndarray  # per item
    internals: np.ndarray  # per item
    inputs: np.ndarray  # prefix sums of each layer's `entering`
    regrowth: np.ndarray  # per item: the most one of its layers re-creates when re-run
    expert_param_count: np.ndarray  # of param_count: routed-expert weights
    reversed_order: bool = False
    op_ms: float = 0.0  # what every op costs beyond its layers' work (`Provenance.op_overhead_ms`; costs.stage)

    @classmethod
    def from_profile(cls, profile: Profile) -> LayerArrays:
        layers = profile.layers

        def prefix(values: list[float]) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])

        cut = np.zeros(len(layers) + 1)
        cut[1:-1] = np.asarray(profile.cut_bytes, dtype=np.float64)
        entering = np.asarray([layers[0].kept_bytes("full"), *profile.cut_bytes], dtype=np.float64)
        return cls(
            forward=prefix([la.forward_ms for la in layers]),
            input_grad=prefix([la.input_grad_ms for la in layers]),
            weight_grad=prefix([la.weight_grad_ms for la in layers]),
            backward=prefix([la.backward_ms for la in layers]),
            activation=prefix([la.activation_bytes for la in layers]),
            freed=prefix([la.activation_freed_by_input_grad_bytes for la in layers]),
            param_bytes=prefix([la.param_bytes for la in layers]),
            param_count=prefix([la.param_count for la in layers]),
            expert_param_count=prefix([la.expert_param_count for la in layers]),
            cut=cut,
            bounds=np.arange(len(layers) + 1),
            selective=prefix([la.kept_bytes("selective") for la in layers]),
            selective_recompute=prefix([la.selective_recompute_ms for la in layers]),
            full_recompute=prefix([la.recompute_ms("full") for la in layers]),
            entering=entering,
            internals=np.asarray([la.activation_bytes - la.kept_bytes("selective") for la in layers], dtype=float),
            inputs=prefix(list(entering)),
            regrowth=np.maximum(np.asarray([la.activation_bytes for la in layers], dtype=float) - entering, 0.0),
            op_ms=profile.provenance.op_overhead_ms or 0.0,
        )

    @property
    def num_items(self) -> int:
        return len(self.bounds) - 1

    def grouped(self, bounds: np.ndarray) -> LayerArrays:
        """Items = groups of consecutive current items starting at `bounds` (first 0, last num_items)."""
        b = np.asarray(bounds)
        assert b[0] == 0 and b[-1] == self.num_items and np.all(np.diff(b) > 0)
        assert not self.reversed_order, "group items in model order"
        pick = {name: getattr(self, name)[b] for name in self._SUMS}
        return LayerArrays(
            **pick,
            cut=self.cut[b],
            bounds=self.bounds[b],
            entering=self.entering[b[:-1]],
            internals=np.maximum.reduceat(self.internals, b[:-1]),
            regrowth=np.maximum.reduceat(self.regrowth, b[:-1]),
            op_ms=self.op_ms,
        )

    def reversed(self) -> LayerArrays:
        """The same items in reverse order (prefix sums rebuilt, cuts mirrored)."""
        sums = {name: getattr(self, name)[-1] - getattr(self, name)[::-1] for name in self._SUMS}
        return LayerArrays(
            **sums,
            cut=self.cut[::-1].copy(),
            bounds=self.bounds[-1] - self.bounds[::-1],
            entering=self.entering[::-1].copy(),
            internals=self.internals[::-1].copy(),
            regrowth=self.regrowth[::-1].copy(),
            reversed_order=not self.reversed_order,
            op_ms=self.op_ms,
        )

    _SUMS = (
        "forward",
        "input_grad",
        "weight_grad",
        "backward",
        "activation",
        "freed",
        "param_bytes",
        "param_count",
        "expert_param_count",
        "selective",
        "selective_recompute",
        "full_recompute",
        "inputs",
    )

    def span(self, name: str, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
        """Sum of `name` over items first..last (inclusive), vectorized over `first`."""
        values = getattr(self, name)
        return values[last + 1] - values[first]

    def span_max(self, name: str, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
        """Largest per-item `name` over items first..last (inclusive), vectorized over `first` (and `last`)."""
        values = getattr(self, name)
        if np.ndim(last) == 0:
            suffix = np.maximum.accumulate(values[last::-1])[::-1]  # suffix[a] = max over a..last
            return suffix[np.asarray(first)]
        items = np.arange(len(values))
        upper = np.where(items[None, :] >= items[:, None], values[None, :], -np.inf)
        return np.maximum.accumulate(upper, axis=1)[np.asarray(first), np.asarray(last)]  # [a, b]: max over a..b

    def stage_freed(self, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
        """Bytes a stage's I frees: its layers' `freed`, except for the model's first stage, whose inputs are the
        model's own (never differentiable): its I has no input gradient to compute, so W does all the backward
        and everything saved lives until W (runtime/step/executor.py)."""
        return np.where(self.first_in_model(first, last), 0.0, self.span("freed", first, last))

    def first_in_model(self, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
        """Whether the stage of items first..last holds the model's first layer (its inputs are the model's own,
        never differentiable), vectorized over `first`."""
        if self.reversed_order:
            return np.full(np.shape(first), last == self.num_items - 1)
        return np.asarray(first) == 0

    def stage_start(self, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
        """Per-item `entering` of a stage's first layer in model order (its last item when reversed)."""
        return self.entering[last] if self.reversed_order else self.entering[np.asarray(first)]


def balanced_bounds(arrays: LayerArrays, max_groups: int, weights: np.ndarray) -> np.ndarray:
    """At most `max_groups` groups of consecutive items with about equal total weight (prefix-sum quantiles)."""
    n = arrays.num_items
    if n <= max_groups:
        return np.arange(n + 1)
    cumulative = np.concatenate([[0.0], np.cumsum(weights + 1e-12)])
    targets = np.linspace(0.0, cumulative[-1], max_groups + 1)[1:-1]
    inner = np.searchsorted(cumulative, targets, side="left")
    return np.unique(np.concatenate([[0], np.clip(inner, 1, n - 1), [n]]))
