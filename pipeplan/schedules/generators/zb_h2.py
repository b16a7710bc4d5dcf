"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1, handcrafted schedule 2): more
forwards in the warm-up (up to 2p-1 microbatches in flight on every device) fill the start-up bubble and Ws fill the
tail, so with F = I = W every device is busy from its first op to its last: bubble (p-1)(F+I-2W) = 0.

The paper's rules, on unit costs: run an I as soon as it arrives, else an F while fewer than 2p-1 microbatches are
in flight, else the oldest pending W. The Is come down the pipeline one slot per device: every other slot while the
last device alternates I and F (microbatches 0 .. 2p-3), every third slot once it too is at 2p-1 in flight and runs
I, W, F. Phase structure per device d (p devices, m microbatches; with m < 3p-2 the later phases are shorter):
  1. warm-up:   2(p-1-d)+1 forwards (device 0: 2p-1), until the first I arrives
  2. steady 1:  2d x (I, F): one F between Is, until 2p-1 microbatches are in flight
  3. steady 2:  p-1-d x (I, W, I, F): at the limit a W frees the activation the next F takes
  4. steady 3:  m-3p+2+d x (I, W, F): Is every third slot, one of each per microbatch
  5. cool-down: no forwards left: each remaining I, then the oldest Ws fill the wait for the next I (1 slot before
                microbatch 2p-2, 2 after); the last Ws drain.
"""

from __future__ import annotations

from pipeplan.schedules.ops import Op, Schedule, make_schedule


class _Device:
    """Counters of one device while emitting its ops: next forward, next I, next W (Ws run in microbatch order)."""

    def __init__(self, device: int) -> None:
        self.stage = device
        self.fwd = self.inp = self.wgt = 0
        self.ops: list[Op] = []

    def forward(self) -> None:
        self.ops.append(Op("F", self.stage, self.fwd))
        self.fwd += 1

    def input_grad(self) -> None:
        self.ops.append(Op("I", self.stage, self.inp))
        self.inp += 1

    def weight(self) -> None:
        self.ops.append(Op("W", self.stage, self.wgt))
        self.wgt += 1


def _device_ops(p: int, device: int, m: int) -> list[Op]:
    dev = _Device(device)
    for _ in range(min(m, 2 * (p - 1 - device) + 1)):  # 1: warm-up forwards
        dev.forward()
    for _ in range(min(2 * device, m - dev.fwd)):  # 2: I, F -- up to 2p-1 in flight
        dev.input_grad()
        dev.forward()
    for _ in range(min(p - 1 - device, m - dev.fwd)):  # 3: I, W, I, F -- at the limit
        dev.input_grad()
        dev.weight()
        dev.input_grad()
        dev.forward()
    for _ in range(m - dev.fwd):  # 4: I, W, F -- every device at the limit
        dev.input_grad()
        dev.weight()
        dev.forward()
    while dev.inp < m:  # 5: cool-down: I, then the oldest pending Ws until the next I arrives
        gap = 1 if dev.inp < 2 * p - 2 else 2
        dev.input_grad()
        for _ in range(gap if dev.inp < m else 0):
            if dev.wgt < dev.inp:
                dev.weight()
    while dev.wgt < m:  # the last Ws drain
        dev.weight()
    assert dev.fwd == dev.inp == m, (dev.fwd, dev.inp, m)
    return dev.ops


def zb_h2(num_devices: int, num_microbatches: int) -> Schedule:
    p, m = num_devices, num_microbatches
    device_ops = [_device_ops(p, d, m) for d in range(p)]
    return make_schedule("zb-h2", m, tuple(range(p)), device_ops)
