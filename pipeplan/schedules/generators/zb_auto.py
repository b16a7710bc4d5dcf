"""zb-auto: the Zero Bubble paper's automatic schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
section 3: ZB-1p at 1F1B's memory, ZB-2p at twice it) for measured per-stage costs, under a per-device limit on
live activation bytes.

Candidates, fastest wins: the shortest period (`schedules.period`: the makespan when every step waits for the
last device, the steady interval between steps when they are post-validated, then about the longest device span:
the paper's figure), then (synchronized) the shortest span, the least activation memory, the simplest (1f1b,
zb-h1, zb-h2, the runs):
  - the paper's heuristic (`zb_heuristic.py`) run with each of its 8 option combinations;
  - the handcrafted zb-h1, zb-h2 and 1f1b whenever their activation peak fits the limit, so zb-auto is never
    slower than them at the same memory.
The memory model is `simulate.activation_deltas`: F adds the stage's activation bytes, I frees the part
`input_grad_freed_bytes` says, W frees the rest. Unit mode (`memory=None`): 1 per microbatch, I frees half
(the paper's setting); the default limit is 1F1B's peak (p units: ZB-1p).
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.generators.one_f_one_b import one_f_one_b
from pipeplan.schedules.generators.zb_h1 import zb_h1
from pipeplan.schedules.generators.zb_h2 import zb_h2
from pipeplan.schedules.generators.zb_heuristic import heuristic_runs
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.period import faster, schedule_period
from pipeplan.schedules.simulate import (
    MemoryCosts,
    PerStageCosts,
    StageCosts,
    activation_deltas,
    activation_rises,
    fits_limit,
    peak_activation_per_device,
    unit_memory,
)


def default_limit(num_devices: int, num_microbatches: int, memory: MemoryCosts) -> float:
    """1F1B's activation peak under `memory` (p units in unit mode): the paper's ZB-1p. 1F1B's device d holds
    min(m, p-d) microbatches at its peak (a B frees all; with recomputation its B re-creates R on top), so this
    equals `peak_activation_per_device` of 1f1b (a test checks it) without generating it."""
    act, rise = activation_deltas(memory, num_devices)["F"], activation_rises(memory, num_devices)["B"]
    return max(min(num_microbatches, num_devices - d) * act[d] + rise[d] for d in range(num_devices))


def _handcrafted(p: int, m: int, delta: dict[str, tuple[float, ...]], limit: float) -> list[tuple]:
    """(generator, forwards device 0 runs after its first backward) for zb-h1, 1f1b and, when its warm-up of
    min(m, 2p-1) forwards on device 0 fits the limit, zb-h2 (0: not counted)."""
    after = max(0, m - p)  # zb-h1 and 1f1b: p-1 warm-up forwards and one more before the first backward
    candidates = [(zb_h1, after), (one_f_one_b, after)]
    if fits_limit(min(m, 2 * p - 1) * delta["F"][0], limit):
        candidates.insert(1, (zb_h2, 0))
    return candidates


_SIMPLICITY = {one_f_one_b: 0, zb_h1: 1, zb_h2: 2}  # then the heuristic's runs


def _device0_bound(costs: PerStageCosts, m: int, forwards_after: int, *, fused: bool) -> float:
    """A lower bound on the makespan: microbatch 0's forward and backward chain through every stage (with the
    transfers), then device 0's remaining m-1 backwards, m Ws (split) and `forwards_after` forwards."""
    f, i, w = costs.forward_ms, costs.input_grad_ms, costs.weight_grad_ms
    back = costs.backward_ms if fused else i
    chain = sum(f) + sum(back) + 2 * sum(costs.comm_ms)
    rest = (m - 1) * back[0] + (0.0 if fused else m * w[0]) + forwards_after * f[0]
    return chain + rest


def _candidates(p: int, m: int, costs: PerStageCosts, memory: MemoryCosts, limit: float) -> list[tuple]:
    """(simplicity order, makespan lower bound, Result or generator) of every candidate: 1f1b, zb-h1, zb-h2 where
    they fit, then the heuristic's runs. A heuristic run's makespan is known exactly."""
    delta, rise = activation_deltas(memory, p), activation_rises(memory, p)
    recomputes = any(r > max(d, 0.0) for r, d in zip(rise["I"], delta["I"])) or any(rise["B"])
    found = []
    for handcrafted, forwards_after in _handcrafted(p, m, delta, limit):
        bound = _device0_bound(costs, m, forwards_after, fused=handcrafted is one_f_one_b)
        found.append((_SIMPLICITY[handcrafted], bound, handcrafted))
    runs = heuristic_runs(m, costs, delta, limit, rise["I"] if recomputes else None)
    found += [(3 + index, run.makespan, run) for index, run in enumerate(runs)]
    return found


def _fastest(p: int, m: int, costs: PerStageCosts, memory: MemoryCosts, limit: float, post_validate: bool):
    """The candidate with the shortest period (`schedules.period.schedule_period`; synchronized: the makespan, then
    the shortest span), then the least activation memory, then the simplest; each checked against the limit
    (recomputation can pass it where a heuristic run had no W left to run first). Synchronized, a candidate whose
    makespan bound is over the best period found is not generated."""
    best, best_key = None, None
    for order, bound, made in sorted(_candidates(p, m, costs, memory, limit), key=lambda c: (c[1], c[0])):
        if not post_validate and best_key is not None and not faster((bound, -1.0), best_key):
            continue  # cannot have a shorter makespan: skip generating and timing it
        schedule = made(p, m) if callable(made) else made.schedule()
        period = schedule_period(schedule, costs, post_validate=post_validate)
        if best_key is not None and not faster((*period, -1.0), best_key):
            continue
        peak = max(peak_activation_per_device(schedule, memory))
        if fits_limit(peak, limit) and faster((*period, peak, order), best_key):
            best, best_key = schedule, (*period, peak, order)
    return best


def zb_auto(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
    memory_limit: float | None = None,
    post_validate: bool = False,
) -> Schedule:
    """Fastest candidate under `costs` (unit by default) whose live activations stay within `memory_limit`
    bytes per device (default: 1F1B's peak): the shortest period of steps `post_validate`d or not."""
    p, m = num_devices, num_microbatches
    memory = memory or unit_memory(1)
    limit = default_limit(p, m, memory) if memory_limit is None else memory_limit
    delta, rise = activation_deltas(memory, p), activation_rises(memory, p)
    biggest = max(f + max(i, b) for f, i, b in zip(delta["F"], rise["I"], rise["B"]))  # one microbatch's peak
    if not fits_limit(biggest, limit):
        raise ScheduleError(
            f"zb-auto: one microbatch's activations ({biggest:g}) exceed --memory-limit {limit:g}; raise the limit"
        )
    best = _fastest(p, m, (costs or StageCosts()).per_stage(p), memory, limit, post_validate)
    if best is None:
        raise ScheduleError(
            f"zb-auto: no schedule keeps the recomputed activations within --memory-limit {limit:g}; raise the limit"
        )
    return Schedule(
        name="zb-auto",
        num_devices=best.num_devices,
        num_stages=best.num_stages,
        num_microbatches=best.num_microbatches,
        stage_device=best.stage_device,
        device_ops=best.device_ops,
    )
