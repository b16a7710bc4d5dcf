"""Stage times of straight pipelines (one device per stage, or per chunk): stage [a..last] run as stage index d,
with that position's in-flight counts (memory screen and recomputation mode, `costs.screened_recompute`) and the
links its cuts cross. `straight_times` gives one DP column's (a, d) grid; `straight_table` gives the DP all of them
from one vectorized pass over the cells it can use (the same elementwise formulas, `StageCostModel.cell_times`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeplan.costs import screened_recompute, transfer_ms
from pipeplan.partition.level import Level


def recompute_grid(level: Level, last: int, replicas, inflight) -> np.ndarray:
    """(first, replicas) grid of what recomputation adds to the stage's I or B, inf where no mode fits memory
    (`costs.screened_recompute`)."""
    firsts = np.arange(last + 1)[:, None]
    return screened_recompute(level.arrays, level.config, firsts, last, replicas, inflight, level.memory_limit)[0]


def _link_variants(level: Level, last: int, num_cols: int):
    """(columns, input transfer ms per first item, output link) for each combination of the stage's input and output
    cut crossing a node boundary that some device column has."""
    in_inter, out_inter = level.crosses_node(np.arange(num_cols))
    firsts = np.arange(last + 1)
    for in_is_inter in (False, True):
        t_in = transfer_ms(level.arrays.cut[firsts], level.inter if in_is_inter else level.intra)
        for out_is_inter in (False, True):
            cols = (in_inter == in_is_inter) & (out_inter == out_is_inter)
            if cols.any():
                yield cols, t_in, level.inter if out_is_inter else level.intra


def straight_times(level: Level, last: int, inflight, num_cols: int) -> np.ndarray:
    """(a, d): stage [a..last] run by device d; its cuts use the inter-node link where d starts/ends a node.
    `inflight`: one (in flight, before I) pair for every position (returns a broadcast view), or a pair of
    per-position arrays."""
    if level.config.recompute != "none":
        return _straight_recompute_times(level, last, inflight, num_cols)
    one = np.ones(1)
    variants = [
        (cols, level.model.times(last, one, in_link=t_in, out_link=out_link))
        for cols, t_in, out_link in _link_variants(level, last, num_cols)
    ]
    if np.ndim(inflight[0]) == 0:
        mask = _memory_mask_straight(level, last, (np.full(1, inflight[0]), np.full(1, inflight[1])))
        if len(variants) == 1:
            return np.broadcast_to(np.where(mask, np.inf, variants[0][1]), (last + 1, num_cols))
    counts = _column_counts(inflight, num_cols)
    out = np.empty((last + 1, num_cols))
    for cols, col in variants:
        out[:, cols] = col
    out[_memory_mask_straight(level, last, counts)] = np.inf
    return out


def _column_counts(inflight, num_cols: int) -> tuple[np.ndarray, np.ndarray]:
    if np.ndim(inflight[0]) == 0:
        return np.full(num_cols, float(inflight[0])), np.full(num_cols, float(inflight[1]))
    return np.asarray(inflight[0], dtype=np.float64), np.asarray(inflight[1], dtype=np.float64)


def _straight_recompute_times(level: Level, last: int, inflight, num_cols: int) -> np.ndarray:
    """`straight_times` when stages may recompute: each cell's mode from its column's in-flight counts."""
    counts = _column_counts(inflight, num_cols)
    added = recompute_grid(level, last, 1, (counts[0][None, :], counts[1][None, :]))
    out = np.empty((last + 1, num_cols))
    for cols, t_in, out_link in _link_variants(level, last, num_cols):
        out[:, cols] = level.model.times(last, np.ones(1), in_link=t_in, out_link=out_link, recompute_ms=added[:, cols])
    return out


def _memory_mask_straight(level: Level, last: int, counts: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    return ~np.isfinite(recompute_grid(level, last, 1, (counts[0][None, :], counts[1][None, :])))


def straight_table(level: Level, inflight, num_cols: int, *, stages: int | None = None) -> Callable[[int], np.ndarray]:
    """`straight_times(level, last, inflight, num_cols)` for every `last`, as `dp.straight_dp` reads them, computed
    at once for the cells a straight DP can use: stage index d starts at item a >= d (d stages before it) and, with
    `stages` fixed (the answer read at exactly that many), ends early enough to leave an item to each later stage.
    The other cells are inf: no chain of stages to an answer runs through them, so the DP's values and choices on
    every such chain are those of the full grids. Columns with the same counts and links are computed once."""
    if level.config.cost_model == "pipedream":
        return lambda last: straight_times(level, last, inflight, num_cols)
    n = level.arrays.num_items
    counts = _column_counts(inflight, num_cols)
    in_inter, out_inter = level.crosses_node(np.arange(num_cols))
    keys, column_group = np.unique(
        np.stack([counts[0], counts[1], in_inter, out_inter], axis=1), axis=0, return_inverse=True
    )
    column_group = column_group.reshape(-1)
    a, b = np.triu_indices(n)  # every stage [a..b]
    cells = []
    for group in range(len(keys)):
        cols = np.flatnonzero(column_group == group)
        keep = a >= cols[0]
        if stages is not None:
            keep &= b <= n - stages + cols[-1]
        cells.append(np.stack([a[keep], b[keep], np.full(int(keep.sum()), group)]))
    first, last, group = np.concatenate(cells, axis=1)
    table = np.full((n, n, len(keys)), np.inf)
    table[first, last, group] = _cell_times(level, first, last, keys[group])
    return lambda end: table[: end + 1, end][:, column_group]


def _cell_times(level: Level, first: np.ndarray, last: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Elementwise: stage [first..last] on one device whose (in flight, before I, input cut crosses a node, output
    cut does) are `keys`' columns; inf where no recomputation mode fits memory."""
    total, before_i, in_inter, out_inter = keys.T
    added = screened_recompute(level.arrays, level.config, first, last, 1, (total, before_i), level.memory_limit)[0]
    cut_in, cut_out = level.arrays.cut[first], level.arrays.cut[last + 1]
    t_in = np.where(in_inter > 0, transfer_ms(cut_in, level.inter), transfer_ms(cut_in, level.intra))
    t_out = np.where(out_inter > 0, transfer_ms(cut_out, level.inter), transfer_ms(cut_out, level.intra))
    return level.model.cell_times(first, last, np.float64(1.0), t_in=t_in, t_out=t_out, recompute_ms=added)
