"""PipeDream's dynamic program (Narayanan et al., SOSP'19, Section 3.1), vectorized with numpy.

    A(j, m) = min over i < j, 1 <= r <= m of  max(A(i, m - r), T(i..j-1, r))

A(j, m) is the smallest bottleneck (slowest stage time) of a pipeline over items 0..j-1 on m units (devices, or
nodes at the upper level), T(a..b, r) the time of one stage over items a..b replicated r times; A(0, 0) = 0.
Two semantics for m:
- exact (PipeDream's, for cost_model='pipedream'): exactly m units, A(0, m > 0) = inf; each column minimizes over
  all (i, r) pairs at once. Ties: the first minimum in the order (r ascending, i ascending).
- at most (cost_model='pipeplan'): at most m units, so A is nonincreasing in m and a stage may be given r units
  while using only the best r' <= r of them (the others idle). Then, for each i, max(A(i, m - r), Tenv(r)) is the
  max of a nondecreasing and a nonincreasing function of r, minimal where they cross: a vectorized binary search
  over r replaces the scan, O(i * m * log R) per column. Ties: the smallest i.
Straight pipelines (one unit per stage) let T depend on the stage's index instead of r, which is exact for costs that
depend on the device index (node boundaries, in-flight microbatches per position). Ties: the smallest i.
All rules are deterministic: equal inputs give equal partitions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

INF = np.inf


@dataclass(frozen=True, eq=False)
class Table:
    """value[j, m]: best bottleneck over items 0..j-1 on exactly m units; first[j, m] / replicas[j, m]: the last
    stage of that optimum (its first item and its replica count, or its index for straight tables)."""

    value: np.ndarray
    first: np.ndarray
    replicas: np.ndarray
    units: np.ndarray  # units the last stage consumes (>= replicas under at-most semantics)


def _empty(num_items: int, max_units: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    value = np.full((num_items + 1, max_units + 1), INF)
    value[0, 0] = 0.0
    first = np.full((num_items + 1, max_units + 1), -1, dtype=np.int64)
    return value, first, np.zeros_like(first), np.zeros_like(first)


@functools.lru_cache(maxsize=64)
def _shift_index(max_units: int, max_replicas: int) -> np.ndarray:
    """src[m, r-1] = m - r, or max_units + 1 (a padding column of inf) where m - r < 0."""
    src = np.arange(max_units + 1)[:, None] - np.arange(1, max_replicas + 1)[None, :]
    return np.where(src >= 0, src, max_units + 1)


def relax_replicated(
    prev: np.ndarray, times: np.ndarray, shift: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One DP column: for each m, min over (r, a) of max(prev[a, m - r], times[a, r - 1]).

    prev: (last+1, U+1) rows a = prefixes ending before item a; times: (last+1, R) stage [a..last] with r replicas.
    Ties go to the smallest r, then the smallest a."""
    num_units, max_r = shift.shape
    padded = np.empty((num_units + 1, prev.shape[0]))
    padded[:-1] = prev.T
    padded[-1] = INF
    cand = np.maximum(padded[shift], times.T[None])  # (m, r, a)
    flat = cand.reshape(num_units, -1)
    pick = flat.argmin(axis=1)
    best = flat[np.arange(num_units), pick]
    num_firsts = prev.shape[0]
    return best, pick % num_firsts, pick // num_firsts + 1


def relax_at_most(prev: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, ...]:
    """At-most column: for each m, min over (a, r <= m) of max(prev[a, m - r], min_{r' <= r} times[a, r' - 1]).

    prev must be nonincreasing along m. Returns (best, first, replicas actually used, units consumed). Rows that
    cannot contribute (an infeasible prefix or stage) are dropped first; ties go to the smallest a."""
    num_units = prev.shape[1]
    keep = np.flatnonzero(np.isfinite(prev[:, -1]) & np.isfinite(times.min(axis=1)))
    if keep.size == 0:
        none = np.zeros(num_units, dtype=np.int64)
        return np.full(num_units, INF), none, none, none
    prev, times = prev[keep], times[keep]
    num_a, num_r = times.shape
    env = np.minimum.accumulate(times, axis=1)
    new_min = np.ones_like(times, dtype=bool)
    new_min[:, 1:] = times[:, 1:] < env[:, :-1]
    env_arg = np.maximum.accumulate(np.where(new_min, np.arange(num_r), 0), axis=1)
    env_flat, prev_flat = env.ravel(), prev.ravel()
    env_row = np.arange(num_a)[:, None] * num_r - 1  # + r gives env[a, r - 1]
    prev_row = np.arange(num_a)[:, None] * num_units  # + k gives prev[a, k]
    m = np.arange(num_units)[None, :]
    r_max = np.minimum(m, num_r)  # (1, U)
    lo = np.ones((num_a, num_units), dtype=np.int64)
    hi = np.broadcast_to(r_max + 1, (num_a, num_units)).copy()
    while True:  # smallest r in [1, r_max] with env(r) <= prev(m - r); r_max + 1 if none
        active = lo < hi
        if not active.any():
            break
        mid = (lo + hi) // 2
        cond = env_flat[env_row + np.minimum(mid, num_r)] <= prev_flat[prev_row + np.maximum(m - mid, 0)]
        hi = np.where(active & cond, mid, hi)
        lo = np.where(active & ~cond, mid + 1, lo)
    cross = lo
    at_cross = np.where(cross <= r_max, prev_flat[prev_row + np.maximum(m - cross, 0)], INF)
    before = np.where(cross >= 2, env_flat[env_row + np.clip(cross - 1, 1, num_r)], INF)
    use_before = before <= at_cross
    value = np.where(use_before, before, at_cross)  # (a, m)
    units = np.where(use_before, cross - 1, cross)
    pick = value.argmin(axis=0)
    cols = np.arange(num_units)
    best_units = units[pick, cols]
    replicas = env_arg[pick, np.clip(best_units - 1, 0, num_r - 1)] + 1
    return value[pick, cols], keep[pick], replicas, best_units


def _accumulate(value, first, reps, units, row: int) -> None:
    """At-most semantics: carry a better answer with fewer units to larger unit counts."""
    line = value[row]
    running = np.minimum.accumulate(line)
    improves = np.ones(line.shape, dtype=bool)
    improves[1:] = line[1:] < running[:-1]
    source = np.maximum.accumulate(np.where(improves, np.arange(line.size), 0))
    value[row] = running
    first[row], reps[row], units[row] = first[row][source], reps[row][source], units[row][source]


def _column(prev, times, max_units: int, at_most: bool):
    if at_most:
        return relax_at_most(prev, times)
    best, first, reps = relax_replicated(prev, times, _shift_index(max_units, times.shape[1]))
    return best, first, reps, reps


def replicated_dp(
    num_items: int, max_units: int, stage_times: Callable[[int], np.ndarray], *, at_most: bool = False
) -> Table:
    """Fast path: no per-position costs. stage_times(last) -> (last+1, R) with R <= max_units."""
    value, first, reps, units = _empty(num_items, max_units)
    if at_most:
        value[0, :] = 0.0
    for last in range(num_items):
        k = last + 1
        value[k], first[k], reps[k], units[k] = _column(value[:k], stage_times(last), max_units, at_most)
        if at_most:
            _accumulate(value, first, reps, units, k)
    return Table(value=value, first=first, replicas=reps, units=units)


def replicated_dp_by_stage(
    num_items: int,
    max_units: int,
    num_stages: int,
    stage_times: Callable[[int, int], np.ndarray],
    *,
    at_most: bool = False,
) -> list[Table]:
    """Exactly `num_stages` stages; stage_times(last, stage_idx) may depend on the stage's position.
    Returns one table per stage count 0..num_stages (table s: pipelines of exactly s stages)."""
    value, first, reps, units = _empty(num_items, max_units)
    if at_most:
        value[0, :] = 0.0
    tables = [Table(value=value, first=first, replicas=reps, units=units)]
    for stage_idx in range(num_stages):
        value, first, reps, units = _empty(num_items, max_units)
        value[0, 0] = INF
        prev = tables[-1].value
        reachable = np.isfinite(prev).any(axis=1)
        for last in range(stage_idx, num_items):
            k = last + 1
            if not reachable[:k].any():
                continue
            value[k], first[k], reps[k], units[k] = _column(prev[:k], stage_times(last, stage_idx), max_units, at_most)
            if at_most:
                _accumulate(value, first, reps, units, k)
        tables.append(Table(value=value, first=first, replicas=reps, units=units))
    return tables


def straight_dp(num_items: int, max_stages: int, stage_times: Callable[[int], np.ndarray]) -> Table:
    """One unit per stage. stage_times(last) -> (last+1, max_stages): stage [a..last] as stage index d (column)."""
    value, first, reps, units = _empty(num_items, max_stages)
    for last in range(num_items):
        times = stage_times(last)
        cand = np.maximum(value[: last + 1, :-1], times)  # (a, d): stage d after d earlier stages
        pick = cand.argmin(axis=0)
        value[last + 1, 1:] = cand[pick, np.arange(max_stages)]
        first[last + 1, 1:] = pick
        reps[last + 1, 1:] = 1
        units[last + 1, 1:] = 1
    return Table(value=value, first=first, replicas=reps, units=units)


def backtrack(table: Table, num_items: int, units: int) -> list[tuple[int, int, int]]:
    """Stages (first item, last item, replicas) of the optimum stored at (num_items, units), in pipeline order."""
    stages = []
    j, m = num_items, units
    while j > 0:
        a, r, u = int(table.first[j, m]), int(table.replicas[j, m]), int(table.units[j, m])
        assert a >= 0 and 1 <= r <= u, "backtracking an infeasible DP cell"
        stages.append((a, j - 1, r))
        j, m = a, m - u
    assert m >= 0
    return stages[::-1]


def backtrack_by_stage(tables: list[Table], num_items: int, units: int) -> list[tuple[int, int, int]]:
    stages = []
    j, m = num_items, units
    for s in range(len(tables) - 1, 0, -1):
        table = tables[s]
        a, r, u = int(table.first[j, m]), int(table.replicas[j, m]), int(table.units[j, m])
        assert a >= 0 and 1 <= r <= u, "backtracking an infeasible DP cell"
        stages.append((a, j - 1, r))
        j, m = a, m - u
    assert j == 0 and m >= 0
    return stages[::-1]


def best_units(table_value: np.ndarray, num_items: int, max_units: int, *, exact: bool) -> int | None:
    """The unit count to read the answer at: exactly max_units, or the fewest units reaching the minimum."""
    row = table_value[num_items, : max_units + 1]
    if exact:
        return max_units if np.isfinite(row[max_units]) else None
    if not np.isfinite(row.min()):
        return None
    return int(np.argmin(row))
