"""One-level search: stage cuts and replicas on devices joined by one kind of link, with the memory check.

Memory is screened with a per-stage bound from the schedule's op order at each stage position (`inflight_counts`:
microbatches in flight, and in flight before their I; `costs.stage_memory_bytes`), which depends on the final number
of stages; the planner checks its candidates' exact byte peaks with the simulator. The fast path runs the
position-free DP with only a necessary memory condition (parameters + one microbatch of activations fit) and then
checks the per-position screen of its optimum; when that fails, the exact search runs one position-aware DP per
number of stages P (the positions, and so the counts, are known once P is fixed) and keeps the best, ties to fewer
stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeplan.cluster import Link
from pipeplan.costs import (
    allreduce_ms,
    exposed_transfer_ms,
    least_stage_memory_bytes,
    pipedream_sync_ms,
    pipedream_transfer_ms,
    replica_share,
    screened_recompute,
    transfer_ms,
)
from pipeplan.partition import dp
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.level import Level
from pipeplan.partition.straight import recompute_grid, straight_table, straight_times
from pipeplan.schedules.memory import Held, held_per_stage
from pipeplan.schedules.registry import generate
from pipeplan.schedules.simulate import MemoryCosts

Stages = list[tuple[int, int, int]]  # (first item, last item, replicas)


def inflight_counts(config: PartitionConfig, num_stages: int) -> tuple[Held, ...]:
    """Per stage position of a straight pipeline of `num_stages` stages: the most microbatches in flight (F run,
    W or B not yet) and the most before their I (F run, I or B not yet), from the op order of the schedule."""
    return held_counts(
        config.schedule,
        num_stages // config.num_chunks,
        config.num_microbatches,
        config.num_chunks,
        config.memory_limit_microbatches,
    )


def held_counts(
    name: str, devices: int, microbatches: int, chunks: int | None = None, limit: int | None = None
) -> tuple[Held, ...]:
    """`held_per_stage` of schedule `name` generated with unit costs (cached, whichever arguments are named)."""
    return _held_counts(name, devices, microbatches, chunks, limit)


@functools.lru_cache(maxsize=1024)
def _held_counts(name: str, devices: int, microbatches: int, chunks: int | None, limit: int | None) -> tuple[Held, ...]:
    schedule = generate(  # the limit counts whole microbatches in flight (one unit each, nothing freed by I)
        name,
        num_devices=devices,
        num_microbatches=microbatches,
        chunks=chunks,
        memory=MemoryCosts(),
        memory_limit=limit,
    )
    return held_per_stage(schedule)


def stage_modes(level: Level, stages: Stages, held: Sequence[Held]) -> list[str | None]:
    """Per stage, the recomputation mode the screen gives it with `held` microbatches (None: nothing fits)."""
    modes: list[str | None] = []
    for (a, b, r), count in zip(stages, held):
        added, index = screened_recompute(level.arrays, level.config, a, b, r, count, level.memory_limit)
        modes.append(level.config.recompute_modes[int(index)] if np.isfinite(added) else None)
    return modes


def stages_fit(level: Level, stages: Stages, assumed: Held = (1, 1)) -> bool:
    """Whether the stages pass the screen with their exact in-flight counts, each with the recomputation mode the
    DP gave it under `assumed` counts (so the DP's times stand)."""
    exact = stage_modes(level, stages, inflight_counts(level.config, len(stages)))
    if level.config.recompute == "none":
        return None not in exact
    return exact == stage_modes(level, stages, [assumed] * len(stages))


def replicated_times(level: Level, last: int, inflight, cache: dict | None = None) -> np.ndarray:
    replicas = np.arange(1, level.units + 1)
    link = level.replica_link
    added = recompute_grid(level, last, replicas[None, :], inflight)
    if level.config.recompute != "none":
        return level.model.times(last, replicas, in_link=link, out_link=link, recompute_ms=added)
    if cache is not None and last in cache:
        times = cache[last].copy()
    else:
        times = level.model.times(last, replicas, in_link=link, out_link=link)
        if cache is not None:
            cache[last] = times.copy()
    times[~np.isfinite(added)] = np.inf
    return times


def solve_fixed_stages(level: Level, num_stages: int) -> tuple[float, Stages] | None:
    """Exact optimum with exactly `num_stages` stages (positions known, so in-flight memory is exact)."""
    n = level.arrays.num_items
    if num_stages > min(n, level.units):
        return None
    if level.exact_units and level.config.stage_mode == "straight" and num_stages != level.units:
        return None  # PipeDream's straight pipelines use every machine
    inflight = np.asarray(inflight_counts(level.config, num_stages), dtype=np.float64)
    if level.config.stage_mode == "straight":
        columns = (inflight[:, 0], inflight[:, 1])
        table = dp.straight_dp(n, num_stages, straight_table(level, columns, num_stages, stages=num_stages))
        value = table.value[n, num_stages]
        return (float(value), dp.backtrack(table, n, num_stages)) if np.isfinite(value) else None
    tables = dp.replicated_dp_by_stage(
        n,
        level.units,
        num_stages,
        lambda last, s: replicated_times(level, last, tuple(inflight[s])),
        at_most=not level.exact_units,
    )
    units = dp.best_units(tables[-1].value, n, level.units, exact=level.exact_units)
    if units is None:
        return None
    return float(tables[-1].value[n, units]), dp.backtrack_by_stage(tables, n, units)


def solve_fast(level: Level) -> tuple[float, Stages] | None:
    """Position-free optimum (memory: only the necessary condition); None when no cell is finite."""
    n = level.arrays.num_items
    if level.config.stage_mode == "straight":
        cols = min(n, level.units)
        table = dp.straight_dp(n, cols, straight_table(level, (1, 1), cols))
        units = dp.best_units(table.value, n, cols, exact=level.exact_units)
        if level.exact_units and cols < level.units:
            units = None
    else:
        table = dp.replicated_dp(
            n, level.units, lambda last: replicated_times(level, last, (1, 1)), at_most=not level.exact_units
        )
        units = dp.best_units(table.value, n, level.units, exact=level.exact_units)
    if units is None:
        return None
    return float(table.value[n, units]), dp.backtrack(table, n, units)


def solve_level(level: Level) -> tuple[float, Stages] | None:
    """Best (objective, stages) honouring config.num_stages and the exact per-position memory check."""
    if level.config.num_stages is not None:
        return solve_fixed_stages(level, level.config.num_stages)
    fast = solve_fast(level)
    if fast is None:
        return None
    if stages_fit(level, fast[1]):
        return fast
    from_end = _end_relative_inflight(level)
    if from_end is not None:
        return solve_from_end(level, from_end)
    best = None
    for num_stages in range(1, min(level.arrays.num_items, level.units) + 1):
        if level.exact_units and level.config.stage_mode == "straight" and num_stages != level.units:
            continue
        found = solve_fixed_stages(level, num_stages)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


def _end_relative_inflight(level: Level) -> list[Held] | None:
    """g[q] = in-flight count of the stage q positions before the last, when that holds for every pipeline depth
    (gpipe, 1f1b; not the zero-bubble schedules); None otherwise or where the trick does not apply."""
    config = level.config
    if config.stage_mode != "replicated" or config.cost_model != "pipeplan":
        return None
    depth = min(level.arrays.num_items, level.units)
    g = list(inflight_counts(config, depth))[::-1]
    for p in range(1, depth):
        if list(inflight_counts(config, p))[::-1] != g[:p]:
            return None
    return g


def solve_from_end(level: Level, g: list[Held]) -> tuple[float, Stages] | None:
    """Exact memory-aware search in one layered DP: run on the layers in reverse order, so a stage's index is its
    distance from the last stage and fixes its in-flight count without knowing the depth (the pipeplan stage cost
    is symmetric in its two cuts). Ties: fewer stages."""
    n = level.arrays.num_items
    rev = dataclasses.replace(level, arrays=level.arrays.reversed())
    cache: dict[int, np.ndarray] = {}
    tables = dp.replicated_dp_by_stage(
        n, level.units, len(g), lambda last, q: replicated_times(rev, last, g[q], cache), at_most=True
    )
    best = None
    for depth in range(1, len(g) + 1):
        units = dp.best_units(tables[depth].value, n, level.units, exact=False)
        if units is not None and (best is None or tables[depth].value[n, units] < best[0]):
            best = (float(tables[depth].value[n, units]), depth, units)
    if best is None:
        return None
    value, depth, units = best
    stages = dp.backtrack_by_stage(tables[: depth + 1], n, units)
    return value, [(n - 1 - b, n - 1 - a, r) for a, b, r in reversed(stages)]


def min_memory_from_end(level: Level) -> float | None:
    """The smallest per-device memory any partition needs (the same layered DP with memory as the stage cost), for
    replicated pipeplan searches whose in-flight counts depend on the distance from the end; None otherwise."""
    g = _end_relative_inflight(level)
    if g is None or level.config.num_stages is not None:
        return None
    n, rev = level.arrays.num_items, level.arrays.reversed()
    replicas = np.arange(1, level.units + 1)[None, :]

    def memory(last: int, q: int) -> np.ndarray:
        return least_stage_memory_bytes(rev, level.config, np.arange(last + 1)[:, None], last, replicas, g[q])

    tables = dp.replicated_dp_by_stage(n, level.units, len(g), memory, at_most=True)
    return float(min(t.value[n, level.units] for t in tables[1:]))


@dataclass(frozen=True, kw_only=True)
class RawStage:
    """A solved stage before the layer-level bookkeeping (items are layers or layer groups)."""

    first_item: int
    last_item: int
    devices: tuple[int, ...]
    time_ms: float
    comm_ms: float
    allreduce_ms: float
    output_transfer_ms: float  # one microbatch's output cut, one way (0 for the last stage)
    inflight: Held  # per replica: (in flight, before I)
    recompute: str = "none"  # the stage's recomputation mode (costs.recompute), as its time_ms counts it


def _comm_terms(level: Level, a: int, b: int, r: int, in_link: Link, out_link: Link) -> tuple[float, float, float]:
    """(transfers per microbatch / replicas, replica all-reduce per step, one-way output transfer) of a stage."""
    cut, params = level.arrays.cut, level.arrays.span("param_bytes", a, b)
    if level.config.cost_model == "pipedream":  # PipeDream's terms (no latency), first stage uncharged
        link = level.replica_link
        comm = 0.0 if a == 0 else pipedream_transfer_ms(max(cut[a], cut[b + 1]), r, link.bandwidth)
        sync = pipedream_sync_ms(params, r, link.bandwidth)
        return float(comm), float(sync), float(transfer_ms(cut[b + 1], link))
    comm = exposed_transfer_ms(transfer_ms(cut[a], in_link), transfer_ms(cut[b + 1], out_link), r)
    send = transfer_ms(cut[b + 1], out_link)
    return float(comm), float(allreduce_ms(params, r, level.replica_link)), float(send)


def describe(level: Level, stages: Stages) -> list[RawStage]:
    """Per-stage costs of a solved one-level pipeline, recomputed from the cost model (devices in stage order)
    with the stages' exact in-flight counts, which also give each stage its recomputation mode."""
    inflight = inflight_counts(level.config, len(stages))
    modes = stage_modes(level, stages, inflight)
    assert None not in modes, "describing stages that do not fit"
    straight = level.config.stage_mode == "straight"
    out, device = [], 0
    for s, (a, b, r) in enumerate(stages):
        if straight:
            row = straight_times(level, b, inflight[s], s + 1)[a, s]
            in_inter, out_inter = level.crosses_node(s)
            in_link = level.inter if in_inter else level.intra
            out_link = level.inter if out_inter else level.intra
        else:
            row = replicated_times(level, b, inflight[s])[a, r - 1]
            in_link = out_link = level.replica_link
        comm, reduce, send = _comm_terms(level, a, b, r, in_link, out_link)
        out.append(
            RawStage(
                first_item=a,
                last_item=b,
                devices=tuple(range(device, device + r)),
                time_ms=float(row),
                comm_ms=comm,
                allreduce_ms=reduce,
                output_transfer_ms=send,
                inflight=per_replica(inflight[s], r),
                recompute=modes[s] or "none",
            )
        )
        device += r
    return out


def per_replica(held: Held, replicas: int) -> Held:
    """A replica's round-robin share of a stage's counts (`costs.replica_share`)."""
    total, before_i = replica_share(held, replicas)
    return int(total), int(before_i)
