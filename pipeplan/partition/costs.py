"""Stage cost models over prefix sums: the time one stage (a contiguous range of layers, r replicas) takes.

Both models return milliseconds per microbatch (the profile's batch), so the DP objective is the steady-state time
between successive microbatches leaving the pipeline (its inverse is the throughput).

`pipeplan` (default), stage [a..b] with r replicas, M microbatches per step:
    compute = F + B (F + I + W for schedules that split the backward), summed over the layers
    time    = max(compute / r + allreduce(params, r) / M,  (transfer(in cut) + transfer(out cut)) / r)
where transfer = latency + bytes / bandwidth of the link the cut crosses (inside or across nodes), counted once per
direction (activations forward, gradients backward on a full-duplex link), and the ring all-reduce of the stage's
parameter gradients over its r replicas runs once per step (amortized over the M microbatches). The cut before the
first layer and after the last carry nothing.

`pipedream`: PipeDream's optimizer (optimizer_graph_hierarchical.py, one level, activation_compression_ratio=1):
    time = max((compute + 4 (r-1) params / (bandwidth r)) / r,  2 in_cut / (bandwidth r),  2 out_cut / (bandwidth r))
with compute = F + B and no latency; as in PipeDream, the first stage is charged no communication at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.cluster import Cluster
from pipeplan.partition.config import PartitionConfig
from pipeplan.profiling.profile import Profile


@dataclass(frozen=True, eq=False)
class LayerArrays:
    """Prefix sums over layers (index k = sum of the first k layers) and cut bytes per boundary.

    `cut[k]` = bytes live across the boundary before layer k; cut[0] = cut[n] = 0."""

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

    @classmethod
    def from_profile(cls, profile: Profile) -> LayerArrays:
        layers = profile.layers

        def prefix(values: list[float]) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])

        cut = np.zeros(len(layers) + 1)
        cut[1:-1] = np.asarray(profile.cut_bytes, dtype=np.float64)
        return cls(
            forward=prefix([la.forward_ms for la in layers]),
            input_grad=prefix([la.input_grad_ms for la in layers]),
            weight_grad=prefix([la.weight_grad_ms for la in layers]),
            backward=prefix([la.backward_ms for la in layers]),
            activation=prefix([la.activation_bytes for la in layers]),
            freed=prefix([la.activation_freed_by_input_grad_bytes for la in layers]),
            param_bytes=prefix([la.param_bytes for la in layers]),
            param_count=prefix([la.param_count for la in layers]),
            cut=cut,
            bounds=np.arange(len(layers) + 1),
        )

    @property
    def num_items(self) -> int:
        return len(self.bounds) - 1

    def grouped(self, bounds: np.ndarray) -> LayerArrays:
        """Items = groups of consecutive current items starting at `bounds` (first 0, last num_items)."""
        b = np.asarray(bounds)
        assert b[0] == 0 and b[-1] == self.num_items and np.all(np.diff(b) > 0)
        pick = {name: getattr(self, name)[b] for name in self._SUMS}
        return LayerArrays(**pick, cut=self.cut[b], bounds=self.bounds[b])

    def reversed(self) -> LayerArrays:
        """The same items in reverse order (prefix sums rebuilt, cuts mirrored)."""
        sums = {name: getattr(self, name)[-1] - getattr(self, name)[::-1] for name in self._SUMS}
        return LayerArrays(**sums, cut=self.cut[::-1].copy(), bounds=self.bounds[-1] - self.bounds[::-1])

    _SUMS = (
        "forward", "input_grad", "weight_grad", "backward", "activation", "freed", "param_bytes", "param_count"
    )  # fmt: skip

    def span(self, name: str, first: np.ndarray | int, last: int) -> np.ndarray:
        """Sum of `name` over items first..last (inclusive), vectorized over `first`."""
        values = getattr(self, name)
        return values[last + 1] - values[first]


def balanced_bounds(arrays: LayerArrays, max_groups: int, weights: np.ndarray) -> np.ndarray:
    """At most `max_groups` groups of consecutive items with about equal total weight (prefix-sum quantiles)."""
    n = arrays.num_items
    if n <= max_groups:
        return np.arange(n + 1)
    cumulative = np.concatenate([[0.0], np.cumsum(weights + 1e-12)])
    targets = np.linspace(0.0, cumulative[-1], max_groups + 1)[1:-1]
    inner = np.searchsorted(cumulative, targets, side="left")
    return np.unique(np.concatenate([[0], np.clip(inner, 1, n - 1), [n]]))


@dataclass(frozen=True, kw_only=True)
class Link:
    bandwidth: float  # bytes/s
    latency_s: float


def transfer_ms(num_bytes: np.ndarray, link: Link) -> np.ndarray:
    return np.where(num_bytes > 0, (link.latency_s + num_bytes / link.bandwidth) * 1e3, 0.0)


def allreduce_ms(num_bytes: np.ndarray, replicas: np.ndarray, link: Link) -> np.ndarray:
    """Ring all-reduce (the formula of Cluster.allreduce_s), vectorized."""
    r = np.asarray(replicas, dtype=np.float64)
    t = 2 * (r - 1) * link.latency_s + 2 * (r - 1) / r * num_bytes / link.bandwidth
    return np.where((r > 1) & (num_bytes > 0), t * 1e3, 0.0)


def intra_link(cluster: Cluster) -> Link:
    return Link(bandwidth=cluster.intra_node_bandwidth, latency_s=cluster.intra_node_latency_s)


def inter_link(cluster: Cluster) -> Link:
    return Link(bandwidth=cluster.inter_node_bandwidth, latency_s=cluster.inter_node_latency_s)


def compute_ms(arrays: LayerArrays, config: PartitionConfig, first: np.ndarray | int, last: int) -> np.ndarray:
    back = (
        arrays.span("input_grad", first, last) + arrays.span("weight_grad", first, last)
        if config.splits_backward and config.cost_model == "pipeplan"
        else arrays.span("backward", first, last)
    )
    return arrays.span("forward", first, last) + back


def static_bytes(param_count, optimizer_bytes_per_param: float):
    """Weights + gradients + optimizer state of `param_count` parameters: the one static-memory formula the
    partitioner, planner and capacity use."""
    return np.asarray(param_count, dtype=np.float64) * optimizer_bytes_per_param


def stage_memory_bytes(
    arrays: LayerArrays, config: PartitionConfig, first: np.ndarray | int, last: int, replicas, held
) -> np.ndarray:
    """The partitioner's per-device screen: static bytes + a bound on the live activations of a stage. `held` =
    (in flight, in flight before I) per stage position (`partition.single.inflight_counts`): microbatches whose F
    ran and whose W (or B) has not / whose I (or B) has not. At any moment live bytes = before-I x saved +
    after-I x (saved - freed by I) <= in-flight x (saved - freed) + before-I x freed. A replica holds a
    round-robin share, ceil(count / replicas) (the replicated schedules run microbatches in order). The planner
    checks every candidate's exact peak with the simulator (`peak_activation_per_device`)."""
    total, before_i = held
    r = np.asarray(replicas, dtype=np.float64)
    total_r = np.ceil(np.asarray(total, dtype=np.float64) / r)
    before_r = np.ceil(np.asarray(before_i, dtype=np.float64) / r)
    saved, freed = arrays.span("activation", first, last), arrays.span("freed", first, last)
    params = static_bytes(arrays.span("param_count", first, last), config.optimizer_bytes_per_param)
    return params + total_r * (saved - freed) + before_r * freed


@dataclass(frozen=True, kw_only=True)
class StageCostModel:
    """Stage times for one DP level. `compute_override` (level 2) replaces compute by a sub-pipeline time."""

    arrays: LayerArrays
    config: PartitionConfig
    link: Link  # for replica all-reduce
    num_microbatches: int

    def times(
        self,
        last: int,
        replicas: np.ndarray,
        *,
        in_link: Link | np.ndarray,
        out_link: Link | None,
        compute: np.ndarray | None = None,
        allreduce_bytes_scale: float = 1.0,
    ) -> np.ndarray:
        """Times of stages [a..last] for every a in 0..last (rows) and replica count in `replicas` (columns).

        `in_link`: the link the input cut crosses (a Link, or per-row transfer ms already computed);
        `out_link`: None when the output cut is not charged at this level."""
        firsts = np.arange(last + 1)
        r = np.asarray(replicas, dtype=np.float64)[None, :]
        comp = compute_ms(self.arrays, self.config, firsts, last) if compute is None else compute
        comp = comp[:, None]
        params = self.arrays.span("param_bytes", firsts, last)[:, None] * allreduce_bytes_scale
        t_in = in_link if isinstance(in_link, np.ndarray) else transfer_ms(self.arrays.cut[firsts], in_link)
        t_out = transfer_ms(self.arrays.cut[last + 1], out_link) if out_link is not None else 0.0
        if self.config.cost_model == "pipedream":
            return self._pipedream(comp, params, r, firsts)
        work = comp / r + allreduce_ms(params, r, self.link) / self.num_microbatches
        return np.maximum(work, (t_in[:, None] + t_out) / r)

    def _pipedream(self, comp: np.ndarray, params: np.ndarray, r: np.ndarray, firsts: np.ndarray) -> np.ndarray:
        bw = self.link.bandwidth
        last_cut = self.arrays.cut[firsts[-1] + 1]  # cut after `last` (0 after the final layer)
        work = (comp + 4 * (r - 1) * params / (bw * r) * 1e3) / r
        t_in = 2 * self.arrays.cut[firsts][:, None] / (bw * r) * 1e3
        t_out = 2 * last_cut / (bw * r) * 1e3
        comm = np.maximum(t_in, t_out)
        comm[0, :] = 0.0  # PipeDream's base case: the stage that starts the pipeline carries no transfer
        return np.maximum(work, comm)
