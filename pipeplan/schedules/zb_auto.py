"""zb-auto: a memory-bounded zero-bubble schedule adapted to measured costs (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 3.2 "automatic scheduling": ZB-1p / ZB-2p).

Inputs: per-stage F/I/W times, comm time and a limit on in-flight microbatches per stage (1F1B's memory is p).
Candidates, each simulated under the given costs, fastest (makespan, then max span) wins:
  - the greedy list scheduler (`list_scheduler.py`) run on the real costs with four tie-break policies
    (I before F or F before I; fill any gap with W or only gaps W fits in);
  - the handcrafted zb-h1 and zb-h2 whenever their in-flight peak fits the limit.
So with limit p it is ZB-1p (never slower than zb-h1) and with 2p-1 or more ZB-2p (never slower than zb-h2).
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.list_scheduler import Policy, list_schedule
from pipeplan.schedules.memory import inflight_per_stage
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.simulate import StageCosts, simulate
from pipeplan.schedules.zb_h1 import zb_h1
from pipeplan.schedules.zb_h2 import zb_h2

_POLICIES = (
    Policy(),
    Policy(forward_first=True),
    Policy(fit_w=True),
    Policy(forward_first=True, fit_w=True),
)


def zb_auto(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: StageCosts | None = None,
    memory_limit: int | None = None,
) -> Schedule:
    """Fastest candidate under `costs` (unit by default) with at most `memory_limit` (default p) microbatches
    in flight on any stage."""
    p, m = num_devices, num_microbatches
    limit = p if memory_limit is None else memory_limit
    if limit < 1:
        raise ScheduleError(f"zb-auto needs --memory-limit >= 1 (microbatches in flight per stage), got {limit}")
    costs = costs or StageCosts()
    candidates = [
        list_schedule(
            "zb-auto",
            num_devices=p,
            num_microbatches=m,
            stage_device=tuple(range(p)),
            costs=costs,
            limit=(limit,) * p,
            policy=policy,
        )
        for policy in _POLICIES
    ]
    for handcrafted in (zb_h1(p, m), zb_h2(p, m)):
        if max(inflight_per_stage(handcrafted)) <= limit:
            candidates.append(handcrafted)
    best, best_key = candidates[0], None
    for candidate in candidates:
        timeline = simulate(candidate, costs)
        key = (timeline.makespan, timeline.max_span)
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    return Schedule(
        name="zb-auto",
        num_devices=best.num_devices,
        num_stages=best.num_stages,
        num_microbatches=best.num_microbatches,
        stage_device=best.stage_device,
        device_ops=best.device_ops,
    )
