"""Per-device memory for capacity reports: the split of a chosen plan's peak device into weights, gradients,
optimizer state and activations, and a cheap lower bound on what a layout needs (to skip hopeless searches).

Bytes per parameter follow `pipeplan.costs.static_split(optimizer, precision)`: under bf16-mixed
(torch.autocast) `adamw` = fp32 weights 4 (the master copy) + fp32 gradients 4 + Adam moments 4 + 4 = 16 B/param.
Activations are the rest of the simulator's byte peak for that device (the planner's one memory
figure: F adds a stage's saved bytes, I frees its share, W the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeplan.cluster import Cluster
from pipeplan.costs import spread_static_bytes, stage_optimizer_state_bytes, static_bytes
from pipeplan.errors import ScheduleError
from pipeplan.partition.single import held_counts
from pipeplan.profiling.profile import Profile
from pipeplan.search.candidate import REPLICATED, Evaluation, Layout, Rejection
from pipeplan.search.config import SearchConfig
from pipeplan.search.scaling import scale_profile
from pipeplan.search.search import enumerate_layouts
from pipeplan.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class MemorySplit:
    """One device's predicted peak, in bytes."""

    device: int  # pipeline device index (every pipeline has the same layout)
    param_count: int  # parameters of the stages (chunks) this device holds
    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict[str, int]:
        names = ("device", "param_count", "weights", "gradients", "optimizer", "activations", "total")
        return {name: getattr(self, name) for name in names}


def device_memory_split(evaluation: Evaluation, profile: Profile, split: tuple[float, float, float]) -> MemorySplit:
    """The split of the pipeline device with the highest simulated peak (`evaluation.device_memory_bytes`);
    `profile` is scaled to the layout's microbatch size (the search's `profiles[b]`); `split`: bytes per parameter
    of (weights, gradients, optimizer state), `SearchConfig.split`."""
    part = evaluation.partition
    device = max(range(len(evaluation.device_memory_bytes)), key=lambda d: evaluation.device_memory_bytes[d])
    stages = [part.stages[s] for s in evaluation.pipeline.device_stages[device]]
    params = sum(s.param_count for s in stages)
    weights, gradients = (round(float(static_bytes(params, b))) for b in split[:2])
    layout = evaluation.layout
    state = 0.0
    for s in stages:  # ZeRO-1 splits the state over the stage's holders; routed experts' over 1/ep of them
        experts = sum(layer.expert_param_count for layer in profile.layers[s.first_layer : s.last_layer + 1])
        group = s.replicas * layout.holders
        ep = layout.expert_parallel
        state += float(stage_optimizer_state_bytes(s.param_count, experts, split[2], group, evaluation.zero, ep))
    state = round(state)
    return MemorySplit(
        device=device,
        param_count=params,
        weights=weights,
        gradients=gradients,
        optimizer=state,
        activations=evaluation.device_memory_bytes[device] - weights - gradients - state,
    )


def memory_floor_bytes(layout: Layout, profile: Profile, per_param: float, *, recompute: bool = False) -> float:
    """A lower bound on the memory per device any partition of `layout` needs under the partitioner's model
    (`profile` scaled to the layout's microbatch size); 0 for replicated layouts (not bounded here). `per_param`:
    the fewest static bytes per parameter a device can hold (`SearchConfig.least_per_param`, e.g. with ZeRO-1).
    With `recompute` a stage may recompute, so it is only bounded by one microbatch of what selective
    recomputation keeps (every mode holds at least that while a backward runs: full re-creates all of a stage's
    saved bytes).

    Straight pipelines cut the layers into exactly S = P x chunks non-empty contiguous stages; stage s holds c_s
    microbatches in flight (the schedule's memory model) and its parameters x bytes/param. A device holds at least
    one whole stage, so the least X for which such a cut has every stage within X bounds the need from below
    (c_s here counts microbatches before their I: they hold all their saved bytes, so the simulated peak is at
    least that)
    (decided exactly for each X by `_cuttable`, X by bisection). With chunks, a device holds `chunks` stages, so
    the X must also admit such a cut whose stages sum to at most P x X (the devices' mean is at most their max).
    """
    if layout.mode == REPLICATED:
        return 0.0
    chunks = layout.num_chunks
    held = held_counts(layout.schedule, layout.pipeline_devices, layout.num_microbatches, chunks)
    inflight = np.asarray([before_i for _, before_i in held])
    static = np.concatenate([[0.0], np.cumsum(static_bytes([la.param_count for la in profile.layers], per_param))])
    if recompute:
        inflight = np.ones_like(inflight)
    kept = [float(la.kept_bytes("selective" if recompute else "none")) for la in profile.layers]
    active = np.concatenate([[0.0], np.cumsum(kept)])
    if len(inflight) > profile.num_layers:
        return math.inf
    devices = layout.pipeline_devices

    def fits(limit: float) -> bool:
        if not _cuttable(static, active, inflight, limit):
            return False
        return chunks == 1 or _least_total(static, active, inflight, limit) <= devices * limit

    low = float(np.max(np.diff(static) + inflight.min() * np.diff(active)))
    high = float(static[-1] + inflight.max() * active[-1])
    while high - low > max(1e-4 * high, 1.0):
        middle = (low + high) / 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return low


def _cuttable(static: np.ndarray, active: np.ndarray, inflight: np.ndarray, limit: float) -> bool:
    """Can the layers (prefix sums `static`, `active`) be cut into len(inflight) non-empty contiguous stages, stage
    s costing static + inflight[s] x active, each within `limit`? Tracks every reachable stage end: a stage starting
    at layer a can end anywhere from a to the furthest layer it fits (costs grow with the range)."""
    n = len(static) - 1
    starts = np.zeros(n, dtype=bool)
    starts[0] = True
    for count in inflight:
        cost = static + count * active
        firsts = np.flatnonzero(starts)
        reach = np.searchsorted(cost, cost[firsts] + limit, side="right") - 2  # last layer within the limit
        ok = reach >= firsts
        marks = np.zeros(n + 1, dtype=np.int64)
        np.add.at(marks, firsts[ok], 1)
        np.add.at(marks, reach[ok] + 1, -1)
        ends = np.cumsum(marks[:n]) > 0
        if not ends.any():
            return False
        starts = np.zeros(n, dtype=bool)
        starts[1:] = ends[:-1]
        last_end = ends[-1]
    return bool(last_end)


def _least_total(static: np.ndarray, active: np.ndarray, inflight: np.ndarray, limit: float) -> float:
    """min over cuts into len(inflight) non-empty contiguous stages, each within `limit`, of the stages' summed
    memory (what the devices hold together); inf when there is no such cut."""
    cost = static[None, :] - static[:, None]  # [a, b]: layers a..b-1
    acts = active[None, :] - active[:, None]
    empty = np.tril(np.ones_like(cost, dtype=bool))  # b <= a
    best = np.full(len(static), np.inf)
    best[0] = 0.0
    for count in inflight:
        stage = cost + count * acts
        stage[empty | (stage > limit)] = np.inf
        best = np.min(best[:, None] + stage, axis=0)
    return float(best[-1])


@dataclass(frozen=True, kw_only=True)
class Screen:
    """`schedules`: those with a layout that may fit (searched); `rejected`: layouts over memory for sure;
    `floor_bytes`: the least lower bound over every layout (what a device would need at least)."""

    schedules: tuple[str, ...]
    rejected: tuple[Rejection, ...]
    floor_bytes: float

    def reason(self, cluster: Cluster) -> str:
        if not math.isfinite(self.floor_bytes):
            return f"no layout of the model runs on {cluster.num_devices} device(s) (too many pipeline stages)"
        return (
            f"out of memory: every layout needs at least {format_bytes(self.floor_bytes)} per device, limit "
            f"{format_bytes(cluster.memory_bytes)}"
        )


def screen_layouts(profile: Profile, cluster: Cluster, config: SearchConfig, schedules: tuple[str, ...]) -> Screen:
    """Split the search's layouts on `cluster` by `memory_floor_bytes` (weights + gradients + optimizer state over
    P devices first: it needs no schedule); a layout's need includes the search's memory reserve."""
    reserve = config.memory_reserve_bytes
    params = sum(layer.param_count for layer in profile.layers)
    scaled = {b: scale_profile(profile, b) for b in config.microbatch_sizes}
    passing: set[str] = set()
    rejected: list[Rejection] = []
    floor = math.inf
    for layout in enumerate_layouts(profile.num_layers, cluster, config, schedules):
        if isinstance(layout, Rejection):
            continue
        per_param = config.least_per_param(layout.holders)
        need = spread_static_bytes(params, per_param, layout.pipeline_devices) + reserve
        if need <= cluster.memory_bytes:
            try:
                floor_bytes = memory_floor_bytes(
                    layout, scaled[layout.microbatch_size], per_param, recompute=config.recompute != "none"
                )
                need = max(need, floor_bytes + reserve)
            except ScheduleError:
                continue  # the schedule cannot run this shape; the search rejects it too
        floor = min(floor, need)
        if need <= cluster.memory_bytes:
            passing.add(layout.schedule)
        else:
            reason = f"needs at least {format_bytes(need)} per device"
            rejected.append(Rejection(layout=layout, kind="memory", reason=reason, needed_memory_bytes=int(need)))
    return Screen(schedules=tuple(s for s in schedules if s in passing), rejected=tuple(rejected), floor_bytes=floor)
