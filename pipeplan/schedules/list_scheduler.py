"""Greedy list scheduling of split-backward (F, I, W) ops under per-stage costs and an in-flight memory limit: each
device, when free, runs a ready I (it unblocks upstream stages), else a ready F if the stage has fewer than `limit`
microbatches in flight, else a pending W to fill the gap. Event-driven over device free times, so it is exact for
the costs given. Used by zb-h2 (unit costs) to replay the paper's handcrafted rules; zb-auto runs the paper's own
automatic-scheduling heuristic (`zb_heuristic.py`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.simulate import StageCosts

_INF = float("inf")


@dataclass(kw_only=True, frozen=True)
class Policy:
    """`forward_first`: prefer a ready F over a ready I (deeper warm-up). `fit_w`: run a W only when no F/I
    becomes ready before it would finish (else wait for that F/I)."""

    forward_first: bool = False
    fit_w: bool = False


class _State:
    def __init__(self, num_stages: int, num_microbatches: int, placement: tuple[int, ...], costs: StageCosts):
        self.S, self.m, self.placement, self.costs = num_stages, num_microbatches, placement, costs
        self.f_end = [[_INF] * num_microbatches for _ in range(num_stages)]
        self.i_end = [[_INF] * num_microbatches for _ in range(num_stages)]
        self.f_next = [0] * num_stages
        self.i_next = [0] * num_stages
        self.pending_w: list[deque[int]] = [deque() for _ in range(num_stages)]
        self.inflight = [0] * num_stages

    def _arrival(self, end: float, src: int, dst: int) -> float:
        if end == _INF or self.placement[src] == self.placement[dst]:
            return end
        return end + self.costs.comm_ms[min(src, dst)]  # type: ignore[index]

    def i_ready(self, s: int) -> float:
        mb = self.i_next[s]
        if mb >= self.m:
            return _INF
        ready = self.f_end[s][mb]
        if s + 1 < self.S:
            ready = max(ready, self._arrival(self.i_end[s + 1][mb], s + 1, s))
        return ready

    def f_ready(self, s: int, limit: tuple[int, ...]) -> float:
        mb = self.f_next[s]
        if mb >= self.m or self.inflight[s] >= limit[s]:
            return _INF
        return 0.0 if s == 0 else self._arrival(self.f_end[s - 1][mb], s - 1, s)


def _pick(
    state: _State, stages: list[int], t: float, limit: tuple[int, ...], policy: Policy
) -> tuple[Op | None, float]:
    """The op device runs at time t (None: wait until the returned time)."""
    i_best = f_best = (_INF, 0)  # (ready time, -stage) / (ready time, stage): the least of the device's stages
    for index, s in enumerate(stages):
        i_key, f_key = (state.i_ready(s), -s), (state.f_ready(s, limit), s)
        if index == 0 or i_key < i_best:
            i_best = i_key
        if index == 0 or f_key < f_best:
            f_best = f_key
    i_op = Op("I", -i_best[1], state.i_next[-i_best[1]]) if i_best[0] <= t else None
    f_op = Op("F", f_best[1], state.f_next[f_best[1]]) if f_best[0] <= t else None
    first, second = (f_op, i_op) if policy.forward_first else (i_op, f_op)
    if first or second:
        return first or second, t
    w_stage = next((s for s in stages if state.pending_w[s]), None)
    next_ready = min(i_best[0], f_best[0])
    if w_stage is not None:
        w_op = Op("W", w_stage, state.pending_w[w_stage][0])
        if not policy.fit_w or t + state.costs.weight_grad_ms[w_stage] <= next_ready:  # type: ignore[index]
            return w_op, t
    return None, next_ready


def _run(state: _State, device: int, o: Op, t: float) -> float:
    s, mb, costs = o.stage, o.microbatch, state.costs
    if o.kind == "F":
        end = t + costs.forward_ms[s]  # type: ignore[index]
        state.f_end[s][mb] = end
        state.f_next[s] += 1
        state.inflight[s] += 1
    elif o.kind == "I":
        end = t + costs.input_grad_ms[s]  # type: ignore[index]
        state.i_end[s][mb] = end
        state.i_next[s] += 1
        state.pending_w[s].append(mb)
    else:
        end = t + costs.weight_grad_ms[s]  # type: ignore[index]
        state.pending_w[s].popleft()
        state.inflight[s] -= 1
    return end


def list_schedule(
    name: str,
    *,
    num_devices: int,
    num_microbatches: int,
    stage_device: tuple[int, ...],
    costs: StageCosts,
    limit: tuple[int, ...],
    policy: Policy = Policy(),
) -> Schedule:
    """Greedy F/I/W op lists for `stage_device` placement; `limit` >= 1 microbatches in flight per stage."""
    assert len(limit) == len(stage_device) and min(limit) >= 1
    num_stages = len(stage_device)
    costs = costs.per_stage(num_stages)
    state = _State(num_stages, num_microbatches, stage_device, costs)
    stages_of = [[s for s in range(num_stages) if stage_device[s] == d] for d in range(num_devices)]
    remaining = [3 * num_microbatches * len(stages_of[d]) for d in range(num_devices)]
    device_ops: list[list[Op]] = [[] for _ in range(num_devices)]
    heap = [(0.0, d) for d in range(num_devices) if remaining[d]]
    sleeping: list[tuple[float, int]] = []
    while heap:
        t, d = heapq.heappop(heap)
        o, when = _pick(state, stages_of[d], t, limit, policy)
        if o is None:
            if when == _INF:
                sleeping.append((t, d))  # waits for another device's op
            else:  # commit to the next known op; waking earlier lets a late F block an arriving I
                heapq.heappush(heap, (when, d))
            continue
        end = _run(state, d, o, t)
        device_ops[d].append(o)
        remaining[d] -= 1
        if remaining[d]:
            heapq.heappush(heap, (end, d))
        for _, other in sleeping:
            heapq.heappush(heap, (end, other))
        sleeping.clear()
    assert not sleeping and not any(remaining), "list scheduler stalled"
    return make_schedule(name, num_microbatches, stage_device, device_ops)
