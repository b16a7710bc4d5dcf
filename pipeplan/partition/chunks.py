"""Chunked placements: p devices run v stages each (straight; no replication).

Looped (interleaved, Narayanan et al. SC'21): chunk c of device d is stage c*p + d. V-shape (zbv, dualpipev): device
d holds stages d and 2p-1-d. The stage -> device map comes from `schedules.registry.stage_device`.

The DP balances the p*v stages (chunks) themselves: the objective is the largest chunk time, and each device's load
(the sum of its chunks) is reported in Partition.device_load_ms. Transfers between consecutive stages are charged
on the inter-node link whenever the pipeline spans more than one node (p > devices_per_node), else intra-node.
Memory is per device, the sum over its chunks of parameters + in-flight activations; the fast path checks it after
the DP, and if the optimum does not fit, a position-aware DP per p caps each chunk at memory / v (conservative;
each chunk's recomputation mode is then the one that fits memory / v).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeplan.cluster import Cluster
from pipeplan.costs import LayerArrays, stage_memory_bytes
from pipeplan.errors import ScheduleError
from pipeplan.partition import dp, single
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.level import Level
from pipeplan.partition.straight import straight_table
from pipeplan.schedules.registry import stage_device


def chunk_level(arrays, cluster: Cluster, config: PartitionConfig, memory_limit: float, *, spans_nodes: bool):
    intra, inter = cluster.intra_link, cluster.inter_link
    return Level(
        arrays=arrays,
        config=config,
        units=cluster.num_devices * config.num_chunks,
        intra=inter if spans_nodes else intra,
        inter=inter if spans_nodes else intra,
        devices_per_node=cluster.num_devices * config.num_chunks + 1,
        memory_limit=memory_limit,
    )


def _device_memory_fits(level: Level, stages: single.Stages, num_devices: int) -> bool:
    """Whether each device's chunks fit together, each in the recomputation mode the DP gave it (with one
    microbatch in flight), which must also be the mode its exact counts give it (so the DP's times stand)."""
    config = level.config
    inflight = single.inflight_counts(config, len(stages))
    if config.recompute != "none" and not single.stages_fit(level, stages):
        return False
    found = single.stage_modes(level, stages, inflight)
    modes = [mode for mode in found if mode is not None]
    if len(modes) < len(found):
        return False
    placement = stage_device(config.schedule, num_devices, config.num_chunks)
    used = np.zeros(num_devices)
    for s, (a, b, _) in enumerate(stages):
        used[placement[s]] += stage_memory_bytes(level.arrays, config, a, b, 1, inflight[s], mode=modes[s])
    return bool(np.all(used <= level.memory_limit))


def _candidates(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig) -> list[int]:
    v = config.num_chunks
    if config.num_stages is not None:
        return [config.num_stages // v]
    return list(range(1, min(cluster.num_devices, arrays.num_items // v) + 1))


def _schedule_exists(config: PartitionConfig, num_devices: int) -> bool:
    try:
        single.inflight_counts(config, num_devices * config.num_chunks)
    except ScheduleError:
        return False
    return True


def solve_chunked(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig, memory_limit: float):
    """(objective, raw stages, layer groups) or None. Candidates p are tried best objective first (ties: fewer
    devices); a p for which the schedule does not exist (e.g. interleaved needs microbatches % p == 0) is skipped."""
    v, n = config.num_chunks, arrays.num_items
    candidates = _candidates(arrays, cluster, config)
    if not candidates:
        return None
    tables = {}
    for spans in sorted({p > cluster.devices_per_node for p in candidates}):
        level = chunk_level(arrays, cluster, config, memory_limit, spans_nodes=spans)
        cols = max(candidates) * v
        table = dp.straight_dp(n, cols, straight_table(level, (1, 1), cols))
        tables[spans] = (level, table)
    ranked = sorted((float(tables[p > cluster.devices_per_node][1].value[n, p * v]), p) for p in candidates)
    p = next((q for value, q in ranked if np.isfinite(value) and _schedule_exists(config, q)), None)
    if p is None and all(not _schedule_exists(config, q) for q in candidates):
        single.inflight_counts(config, candidates[0] * v)  # no schedule at all: raise the schedule's own error
    if p is None:
        return None
    level, table = tables[p > cluster.devices_per_node]
    best = (float(table.value[n, p * v]), p, level, dp.backtrack(table, n, p * v))
    if not _device_memory_fits(level, best[3], p):
        best = _fallback(arrays, cluster, config, memory_limit, [q for q in candidates if _schedule_exists(config, q)])
    if best is None:
        return None
    value, p, level, stages = best
    raw = single.describe(level, stages)
    placement = stage_device(config.schedule, p, v)
    raw = [dataclasses.replace(st, devices=(placement[s],)) for s, st in enumerate(raw)]
    return value, raw, n


def _fallback(arrays, cluster, config, memory_limit, candidates):
    best = None
    for p in candidates:
        level = chunk_level(
            arrays, cluster, config, memory_limit / config.num_chunks, spans_nodes=p > cluster.devices_per_node
        )
        found = single.solve_fixed_stages(level, p * config.num_chunks)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], p, level, found[1])  # described at memory / v: the modes the DP counted
    return best
