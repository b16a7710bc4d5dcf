"""zb-auto: the Zero Bubble paper's automatic schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
section 3: ZB-1p at 1F1B's memory, ZB-2p at twice it) for measured per-stage costs, under a per-device limit on
live activation bytes.

Candidates, fastest wins (makespan, then the longest device span, the paper's figure):
  - the paper's heuristic (`zb_heuristic.py`) run with each of its 8 option combinations;
  - the handcrafted zb-h1, zb-h2 and 1f1b whenever their activation peak fits the limit, so zb-auto is never
    slower than them at the same memory.
The memory model is `simulate.activation_deltas`: F adds the stage's activation bytes, I frees the part
`input_grad_freed_bytes` says, W frees the rest. Unit mode (`memory=None`): 1 per microbatch, I frees half
(the paper's setting); the default limit is 1F1B's peak (p units: ZB-1p).
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.one_f_one_b import one_f_one_b
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.simulate import (
    MemoryCosts,
    StageCosts,
    activation_deltas,
    fits_limit,
    makespan_and_span,
    peak_activation_per_device,
    unit_memory,
)
from pipeplan.schedules.zb_h1 import zb_h1
from pipeplan.schedules.zb_h2 import zb_h2
from pipeplan.schedules.zb_heuristic import heuristic_runs


def default_limit(num_devices: int, num_microbatches: int, memory: MemoryCosts) -> float:
    """1F1B's activation peak under `memory` (p units in unit mode): the paper's ZB-1p."""
    return max(peak_activation_per_device(one_f_one_b(num_devices, num_microbatches), memory))


def zb_auto(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
    memory_limit: float | None = None,
) -> Schedule:
    """Fastest candidate under `costs` (unit by default) whose live activations stay within `memory_limit`
    bytes per device (default: 1F1B's peak)."""
    p, m = num_devices, num_microbatches
    memory = memory or unit_memory(1)
    limit = default_limit(p, m, memory) if memory_limit is None else memory_limit
    delta = activation_deltas(memory, p)
    biggest = max(delta["F"])
    if not fits_limit(biggest, limit):
        raise ScheduleError(
            f"zb-auto: one microbatch's activations ({biggest:g}) exceed --memory-limit {limit:g}; raise the limit"
        )
    stage_costs = (costs or StageCosts()).per_stage(p)
    best_run, best_key = None, None
    for result in heuristic_runs(m, stage_costs, delta, limit):
        key = (result.makespan, result.max_span)
        if best_key is None or key < best_key:
            best_run, best_key = result, key
    best = best_run.schedule()
    # zb-h2 runs min(m, 2p-1) forwards on device 0 before its first I: skip generating it when they cannot fit
    h2_fits = fits_limit(min(m, 2 * p - 1) * delta["F"][0], limit)
    for handcrafted in (zb_h1, zb_h2, one_f_one_b) if h2_fits else (zb_h1, one_f_one_b):
        schedule = handcrafted(p, m)
        if fits_limit(max(peak_activation_per_device(schedule, memory)), limit):
            key = makespan_and_span(schedule, stage_costs)
            if key < best_key:  # type: ignore[operator]
                best, best_key = schedule, key
    assert best is not None
    return Schedule(
        name="zb-auto",
        num_devices=best.num_devices,
        num_stages=best.num_stages,
        num_microbatches=best.num_microbatches,
        stage_device=best.stage_device,
        device_ops=best.device_ops,
    )
