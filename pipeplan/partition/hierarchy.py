"""Two-level search for several nodes (PipeDream's hierarchical optimizer, Section 3.1 of the SOSP'19 paper).

Level 1 solves, for every block of consecutive items, the best sub-pipeline on the devices of one node
(intra-node links; the block's own input and output cuts are left to level 2). Level 2 treats nodes as units: a
block replicated over n' nodes runs one level-1 sub-pipeline per node, so its time is

    max(A1(block) / n' + allreduce_inter(block params / devices_per_node, n') / M,
        (transfer_inter(in cut) + transfer_inter(out cut)) / n')

(each device all-reduces its share of the block with its peers in the other nodes, in parallel, as PipeDream
divides by the devices in a machine). The same min-max DP runs at both levels. Profiles with more layers than
config.max_layer_groups are grouped into that many runs of consecutive layers with equal compute first, so the
search is exact over the group boundaries only. Memory: the DPs prune with parameters + one microbatch of
activations; the result is checked with exact in-flight counts, and if it fails the search is redone assuming every
stage holds the largest in-flight count of the schedule (conservative).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeplan.cluster import Cluster
from pipeplan.costs import (
    LayerArrays,
    StageCostModel,
    allreduce_ms,
    balanced_bounds,
    compute_ms,
    exposed_transfer_ms,
    stage_memory_bytes,
    stage_ms,
    transfer_ms,
)
from pipeplan.partition import dp, single
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.level import Level


@dataclasses.dataclass(frozen=True, eq=False)
class _Inner:
    """Level-1 stage times for every (first, last) pair and replica count, in four variants: whether the input cut
    and the output cut are charged (they are not at block edges)."""

    level: Level
    inflight: single.Held  # what the level-1 screen assumed in flight on every stage
    mid: list[np.ndarray]  # mid[last]: (last+1, G), both cuts charged
    no_in: list[np.ndarray]
    no_out: list[np.ndarray]
    none: list[np.ndarray]


def _inner(level: Level, inflight: single.Held) -> _Inner:
    model, g = level.model, level.units
    reps = np.arange(1, g + 1)
    variants: dict[str, list[np.ndarray]] = {"mid": [], "no_in": [], "no_out": [], "none": []}
    recomputes = level.config.recompute != "none"
    for last in range(level.arrays.num_items):
        zero_in = np.zeros(last + 1)
        added = single.recompute_grid(level, last, reps[None, :], inflight)
        for key, in_link, out_link in (
            ("mid", level.intra, level.intra),
            ("no_in", zero_in, level.intra),
            ("no_out", level.intra, None),
            ("none", zero_in, None),
        ):
            if recomputes:
                t = model.times(last, reps, in_link=in_link, out_link=out_link, recompute_ms=added)
            else:
                t = model.times(last, reps, in_link=in_link, out_link=out_link)
                t[~np.isfinite(added)] = np.inf
            variants[key].append(t)
    return _Inner(level=level, inflight=inflight, **variants)


def _block_rows(inner: _Inner, start: int, last: int, *, end: bool) -> np.ndarray:
    rows = (inner.no_out if end else inner.mid)[last][start:].copy()
    rows[0] = (inner.none if end else inner.no_in)[last][start]
    return rows


def _block_tables(inner: _Inner, start: int, stop: int):
    """Sub-DP over items start..stop-1: mid table (cells usable as prefixes) and, per last, the end column."""
    g, size = inner.level.units, stop - start
    shift = dp._shift_index(g, g)
    value = np.full((size + 1, g + 1), np.inf)
    value[0, 0] = 0.0
    first, reps = np.full_like(value, -1, dtype=np.int64), np.zeros((size + 1, g + 1), dtype=np.int64)
    units = reps
    ends = []
    for last in range(start, stop):
        k = last - start + 1
        value[k], first[k], reps[k] = dp.relax_replicated(value[:k], _block_rows(inner, start, last, end=False), shift)
        ends.append(dp.relax_replicated(value[:k], _block_rows(inner, start, last, end=True), shift))
    return dp.Table(value=value, first=first, replicas=reps, units=units), ends


def _block_costs(inner: _Inner) -> tuple[np.ndarray, np.ndarray]:
    """A1[first, last]: best sub-pipeline time of the block on one node; units used in units1.

    All block starts at once: value[s, a, m] = best over items s..a-1 on exactly m devices, for a > s (inf
    elsewhere, and in the padding column m = g+1). A single-stage block s..last (whose input cut is not charged at
    this level) is added separately."""
    n, g = inner.level.arrays.num_items, inner.level.units
    src = np.arange(g + 1)[:, None] - np.arange(1, g + 1)[None, :]  # (m, r) -> m - r, padding where < 0
    src = np.where(src >= 0, src, g + 1)
    value = np.full((n, n + 1, g + 2), np.inf)
    a1 = np.full((n, n), np.inf)
    units1 = np.zeros((n, n), dtype=np.int64)
    single_stage = np.full((n, g + 1), np.inf)
    for last in range(n):
        k = last + 1
        prev = value[:k, :k][:, :, src]  # (s, a, m, r)
        for end in (False, True):
            rows = (inner.no_out if end else inner.mid)[last]
            best = np.maximum(prev, rows[None, :, None, :]).min(axis=(1, 3))  # (s, m), a > s
            single_stage[:k, 1:] = (inner.none if end else inner.no_in)[last]
            best = np.minimum(best, single_stage[:k])
            if end:
                units1[:k, last] = best.argmin(axis=1)
                a1[:k, last] = best.min(axis=1)
            else:
                value[:k, k, : g + 1] = best
    return a1, units1


def _block_stages(inner: _Inner, start: int, last: int, units: int) -> single.Stages:
    table, ends = _block_tables(inner, start, last + 1)
    _, first, reps = ends[-1]
    a, r = int(first[units]), int(reps[units])
    head = dp.backtrack(table, a, units - r) if a > 0 else []
    return [(x + start, y + start, rr) for x, y, rr in head] + [(start + a, last, r)]


def solve_two_level(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig, memory_limit: float):
    """(objective, raw stages, layer groups) or None."""
    items = (np.diff(getattr(arrays, name)) for name in ("forward", "input_grad", "weight_grad", "backward"))
    weights = compute_ms(*items, split_backward=False)  # F + B per item: groups of equal compute
    grouped = arrays.grouped(balanced_bounds(arrays, config.max_layer_groups, weights))
    inner_level = Level(
        arrays=grouped,
        config=config,
        units=cluster.devices_per_node,
        intra=cluster.intra_link,
        inter=cluster.intra_link,
        devices_per_node=cluster.devices_per_node,
        memory_limit=memory_limit,
    )
    for inflight in ((1, 1), None):
        if inflight is None:
            upper = min(grouped.num_items, cluster.num_devices)
            counts = single.inflight_counts(config, upper)
            inflight = (max(c[0] for c in counts), max(c[1] for c in counts))
        found = _solve(grouped, cluster, config, _inner(inner_level, inflight))
        if found is None:
            return None
        raw = _with_inflight(config, found[1])
        if _fits(grouped, config, raw, memory_limit):
            return found[0], _ungroup(raw, grouped), grouped.num_items
    return None


def _solve(grouped: LayerArrays, cluster: Cluster, config: PartitionConfig, inner: _Inner):
    a1, units1 = _block_costs(inner)
    g, n = cluster.devices_per_node, grouped.num_items
    link = cluster.inter_link
    outer = StageCostModel(arrays=grouped, config=config, link=link, num_microbatches=config.num_microbatches)
    reps = np.arange(1, cluster.num_nodes + 1)

    def times(last: int) -> np.ndarray:
        return outer.times(
            last, reps, in_link=link, out_link=link, compute=a1[: last + 1, last], allreduce_bytes_scale=1 / g
        )

    table = dp.replicated_dp(n, cluster.num_nodes, times, at_most=True)
    nodes = dp.best_units(table.value, n, cluster.num_nodes, exact=False)
    if nodes is None:
        return None
    blocks = dp.backtrack(table, n, nodes)
    raw, node_offset = [], 0
    for a, b, copies in blocks:
        stages = _block_stages(inner, a, b, int(units1[a, b]))
        raw += _describe_block(inner, outer, stages, copies, node_offset, g, a, b)
        node_offset += copies
    return float(table.value[n, nodes]), raw


def _describe_block(inner, outer, stages, copies, node_offset, g, a, b) -> list[single.RawStage]:
    level, config = inner.level, inner.level.config
    cut, link = level.arrays.cut, outer.link
    params = level.arrays.span("param_bytes", a, b) / g
    reduce_inter = float(allreduce_ms(params, copies, link))
    edge_comm = float(exposed_transfer_ms(transfer_ms(cut[a], link), transfer_ms(cut[b + 1], link), copies))
    out, local = [], 0
    modes = single.stage_modes(level, stages, [inner.inflight] * len(stages))
    for i, (x, y, r) in enumerate(stages):
        rows = _block_rows(inner, a, y, end=(y == b))
        edge = edge_comm if i in (0, len(stages) - 1) else 0.0  # the block's own cuts: its first and last stage
        t1 = float(rows[x - a, r - 1])  # the level-1 stage time (with its cuts inside the block)
        time = stage_ms(t1, copies, allreduce=reduce_inter, num_microbatches=config.num_microbatches, transfers=edge)
        t_in = transfer_ms(cut[x], level.intra) if x > a else 0.0
        t_out = transfer_ms(cut[y + 1], level.intra) if y < b else 0.0
        devices = tuple((node_offset + k) * g + local + j for k in range(copies) for j in range(r))
        reduce_intra = float(allreduce_ms(level.arrays.span("param_bytes", x, y), r, level.intra))
        out.append(
            single.RawStage(
                first_item=x,
                last_item=y,
                devices=devices,
                time_ms=float(time),
                comm_ms=float(exposed_transfer_ms(t_in, t_out, r * copies)) + edge,
                allreduce_ms=reduce_intra + reduce_inter,
                output_transfer_ms=float(transfer_ms(cut[y + 1], link if y == b else level.intra)),
                inflight=(0, 0),
                recompute=modes[i] or "none",
            )
        )
        local += r
    return out


def _with_inflight(config: PartitionConfig, raw: list[single.RawStage]) -> list[single.RawStage]:
    inflight = single.inflight_counts(config, len(raw))
    return [
        dataclasses.replace(st, inflight=single.per_replica(inflight[s], len(st.devices))) for s, st in enumerate(raw)
    ]


def _fits(grouped: LayerArrays, config: PartitionConfig, raw: list[single.RawStage], memory_limit: float) -> bool:
    """Every stage fits with its exact per-replica counts in the recomputation mode level 1 gave it."""
    return all(
        stage_memory_bytes(
            grouped,
            config,
            st.first_item,
            st.last_item,
            1,
            st.inflight,
            mode=st.recompute,
            group_size=len(st.devices) * config.data_parallel,
        )
        <= memory_limit
        for st in raw
    )


def _ungroup(raw: list[single.RawStage], grouped: LayerArrays) -> list[single.RawStage]:
    bounds = grouped.bounds
    return [
        dataclasses.replace(st, first_item=int(bounds[st.first_item]), last_item=int(bounds[st.last_item + 1] - 1))
        for st in raw
    ]
