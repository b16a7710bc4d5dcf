"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6 / "ZB-V"): two chunks per device in
a V: device d holds stages d and 2p-1-d, so the first and last stage share device 0. With F = I = W the schedule
has no bubble in the paper's sense (each device's span is its work) at the memory of 1F1B: 2p half-size chunk
activations. Built for max(m, 2p-1) microbatches; with fewer the extra ops are dropped (still valid, with bubbles).
"""

from __future__ import annotations

import functools

from pipeplan.schedules.generators.zbv_greedy import greedy_candidates
from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.period import faster, schedule_period
from pipeplan.schedules.placement import V_SHAPED, stage_devices, v_stages
from pipeplan.schedules.simulate import (
    MemoryCosts,
    PerStageCosts,
    StageCosts,
    activation_deltas,
    fits_limit,
    makespan_and_span,
    peak_activation_per_device,
    unit_memory,
)


def _device_ops(p: int, device: int, n: int) -> list[Op]:
    s0, s1 = v_stages(device, p)  # chunk 0 (down the V) and chunk 1 (back up)
    f0 = f1 = b0 = b1 = 0
    ops: list[Op] = []
    for _ in range(2 * (p - device) - 1):  # warm-up 1: forwards of chunk 0
        ops.append(Op("F", s0, f0))
        f0 += 1
    for _ in range(device):  # warm-up 2: alternate chunk 1 and chunk 0 forwards
        ops += [Op("F", s1, f1), Op("F", s0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - device):  # warm-up 3: chunk 1 forward + its backward (I, W)
        ops += [Op("F", s1, f1), Op("I", s1, b1), Op("W", s1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:  # steady: F0 I0 W0 F1 I1 W1
        if f0 < n:
            ops.append(Op("F", s0, f0))
            f0 += 1
        ops += [Op("I", s0, b0), Op("W", s0, b0), Op("F", s1, f1), Op("I", s1, b1), Op("W", s1, b1)]
        f1 += 1
        b0 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(device):  # cool-down 1: input gradients of both chunks, weights deferred
        ops += [Op("I", s0, b0), Op("I", s1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - device):  # cool-down 2: chunk 0 input gradient + one deferred weight gradient
        ops += [Op("I", s0, b0), Op("W", s0, w0)]
        b0 += 1
        w0 += 1
    ops += [Op("W", s1, mb) for mb in range(w1, b1)]  # drain: remaining weight gradients
    ops += [Op("W", s0, mb) for mb in range(w0, b0)]
    assert f0 == b0 == n and f1 == b1 == n, (f0, b0, f1, b1, n)
    return ops


@functools.lru_cache(maxsize=64)
def zbv_fixed(num_devices: int, num_microbatches: int) -> Schedule:
    """The fixed ZB-V order above (optimal when F = I = W and m >= 2p-1); cached: `zbv` starts from it whatever
    the costs (a Schedule is immutable)."""
    p, m = num_devices, num_microbatches
    n = max(m, 2 * p - 1)
    device_ops = [[o for o in _device_ops(p, d, n) if o.microbatch < m] for d in range(p)]
    return make_schedule("zbv", m, stage_devices(V_SHAPED, p, 2), device_ops)


def _fixed_is_optimal(costs: PerStageCosts, m: int) -> bool:
    """F = I = W on every stage, no comm and m >= 2p-1: the fixed order ends at (p-1)F + 2m(F+I+W), the earliest
    the last device can (its first input needs p-1 forwards; then it has 2m(F+I+W) of work)."""
    times = {*costs.forward_ms, *costs.input_grad_ms, *costs.weight_grad_ms}
    return len(times) == 1 and not any(costs.comm_ms) and m >= len(costs.forward_ms) - 1


def zbv(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
    memory_limit: float | None = None,
    post_validate: bool = False,
) -> Schedule:
    """The fixed order when it is optimal (F = I = W, no comm, m >= 2p-1; `costs=None` is unit costs); else the
    fastest of the fixed order and the paper's adaptive greedy (`zbv_greedy.py`) run under `memory_limit`
    (default: the fixed order's own peak, so never more memory than it): the shortest period
    (`schedules.period.schedule_period`: synchronized the makespan, then the span), then the least memory, then the
    fixed order first (the simplest).

    The paper's ZB-V figures (its Table 8: 3969.197 ms at p=16, m=48, F 28.814, B 28.760, W 19.352, comm 1.610)
    are the longest device span (first F to last W) — the period of post-validated steps, which `post_validate=True`
    ranks by and meets exactly — with each chunk op at half the listed F, B, W (listed per chunk, a device's work
    alone would be 2m(F+B+W) = 7384.9 ms), the whole comm on every cross-device transfer (none at the V's turn)
    and 1F1B's memory. Ranked by the makespan (synchronized), another greedy run with a 0.16% longer span wins
    (tests/schedules/test_period.py)."""
    p, m = num_devices, num_microbatches
    fixed = zbv_fixed(p, m)
    stage_costs = (costs or StageCosts()).per_stage(2 * p)
    memory = memory or unit_memory(2)
    peak = max(peak_activation_per_device(fixed, memory))
    limit = peak if memory_limit is None else memory_limit
    if _fixed_is_optimal(stage_costs, m) and fits_limit(peak, limit):
        return fixed
    candidates = greedy_candidates(p, m, stage_costs, activation_deltas(memory, 2 * p), limit)
    if memory.kept_bytes is not None:  # recomputation: the greedy checks ops' net changes, not what an I re-creates
        candidates = [c for c in candidates if fits_limit(max(peak_activation_per_device(c[0], memory)), limit)]
    if fits_limit(peak, limit):
        candidates.insert(0, (fixed, makespan_and_span(fixed, stage_costs)))
    best, best_key = None, None
    for order, (candidate, timed) in enumerate(candidates):
        if not post_validate and best_key is not None and not faster((timed[0], -1.0), best_key):
            continue  # synchronized the period is the makespan: not shorter
        period = schedule_period(candidate, stage_costs, post_validate=True) if post_validate else timed
        if best_key is not None and not faster((*period, -1.0), best_key):
            continue
        key = (*period, max(peak_activation_per_device(candidate, memory)), order)
        if faster(key, best_key):
            best, best_key = candidate, key
    return best or fixed  # nothing fits: the registry reports the fixed order's peak against the limit
