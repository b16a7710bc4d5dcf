"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1, handcrafted schedule 2): more
forwards in the warm-up (up to 2p-1 microbatches in flight on device 0) fill the start-up bubble and Ws fill the
tail, so with F = I = W every device is busy from its first op to its last: bubble (p-1)(F+I-2W) = 0.

The op order is produced by replaying the paper's rules on unit costs with the list scheduler
(`list_scheduler.py`, memory limit 2p-1 per stage): run an I as soon as it arrives, else an F while memory
allows, else the oldest pending W. The resulting phases on device d:
  warm-up:   2(p-1-d)+1 forwards (device 0: 2p-1), until the first I arrives;
  steady 1:  I and F alternate (one in, one out) while fewer than 2p-1 microbatches are in flight;
  steady 2:  at the limit, a W (freeing one activation) replaces every other F: I W I F ...;
  cool-down: no forwards left: I, then Ws fill the wait for the next I; the last Ws drain.
With m < 2p-1 the warm-up is shorter (still valid, with some bubble).
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
