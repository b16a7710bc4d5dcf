"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1, handcrafted schedule 2): more
forwards in the warm-up (up to 2p-1 microbatches in flight on device 0) fill the start-up bubble and Ws fill the
tail, so with F = I = W every device is busy from its first op to its last: bubble (p-1)(F+I-2W) = 0.

The op order is the paper's construction replayed on unit costs: warm-up as many forwards as the 2p-1 memory
limit allows, then run I as soon as it arrives (it unblocks the stage before), else F, else the oldest pending W —
the greedy list scheduler of `list_scheduler.py`. With m < 2p-1 the warm-up is shorter (still valid, some bubble).
"""

from __future__ import annotations

from pipeplan.schedules.list_scheduler import list_schedule
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.simulate import StageCosts


def zb_h2(num_devices: int, num_microbatches: int) -> Schedule:
    p = num_devices
    return list_schedule(
        "zb-h2",
        num_devices=p,
        num_microbatches=num_microbatches,
        stage_device=tuple(range(p)),
        costs=StageCosts(),  # the handcrafted order assumes F = I = W
        limit=(2 * p - 1,) * p,
    )
