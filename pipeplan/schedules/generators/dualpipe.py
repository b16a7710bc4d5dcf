"""DualPipe (DeepSeek, github.com/deepseek-ai/DualPipe `DualPipe`; DeepSeek-V3 technical report, 2024, section
3.2.1): a bidirectional pipeline on p devices (p even). Each stage is held twice (`placement.MIRRORED`): the even
microbatches enter at device 0 and run stage s on device s, the odd ones enter at device p-1 and run stage s on
device p-1-s, so device d holds stage d (direction 0) and stage p-1-d (direction 1) and the parameters exist twice
(the two copies reduce their gradients together before the optimizer step). m microbatches, m/2 per direction;
needs m even and m >= 2p.

Device d runs the phases of DualPipe's `step` with its half rank h = min(d, p-1-d) among n = p/2: its "phase 0"
is the direction that reaches it first (stage h: direction 0 on the first half of the devices, direction 1 on
the second), "phase 1" the other (stage p-1-h). Overlapped F&B pairs are one op (`Op.overlap`, as dualpipev's);
part of the backwards split into I + W with W deferred (FIFO) to fill bubbles:
  1. 2(n-1-h) phase-0 forwards                    5. n-1-h x (B1, F1&B0)
  2. h+1 x (F0, F1)                               6. h+1 x (B1, B0), the second half split (I, W deferred)
  3. n-1-h x (I1 + its W, F1)                     7. n-1-h x (W, I0 + deferred W)
  4. m/2-p+h+1 x (F0&B1, F1&B0); the middle       8. the remaining h+1 deferred W
     devices (h = n-1) run the first F0, B1 apart
(X&Y: one overlapped F&B op; X0 / X1: an op of phase 0 / 1.) These are DualPipeV's eight steps on n devices with
m/2 microbatches per chunk (`generators/dualpipev.py`): DualPipeV is DualPipe cut in half, device h of it running
what DualPipe's devices h and p-1-h run, one copy of the parameters instead of two. The README's bubble is
(p/2-1)(F&B+B-3W) per device, its activation memory p+1 microbatches of a stage on the first device.
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.generators.dualpipev import PairedDevice
from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.placement import DIRECTIONS, MIRRORED, stage_devices


def _device_ops(p: int, device: int, m: int) -> list[Op]:
    n, h, half = p // 2, min(device, p - 1 - device), m // 2
    first = 0 if device < n else 1  # the direction reaching this device first: its phase 0
    # phase k's j-th microbatch is DIRECTIONS x j + its direction (even ones flow down, odd ones up)
    dev = PairedDevice((h, p - 1 - h), stride=DIRECTIONS, offsets=(first, 1 - first))
    for _ in range(2 * (n - 1 - h)):  # 1: phase-0 forwards
        dev.forward(0)
    for _ in range(h + 1):  # 2: F0 F1
        dev.forward(0)
        dev.forward(1)
    for _ in range(n - 1 - h):  # 3: I1 and its W (zero bubble), F1
        dev.backward(1, split=True)
        dev.weight()
        dev.forward(1)
    for i in range(half - p + h + 1):  # 4 (main): F0&B1, F1&B0
        if i == 0 and h == n - 1:  # the middle devices: F0 need not wait for B1's gradient (DualPipe's NOTE)
            dev.forward(0)
            dev.backward(1)
        else:
            dev.overlapped(0)
        dev.overlapped(1)
    for _ in range(n - 1 - h):  # 5: B1, F1&B0
        dev.backward(1)
        dev.overlapped(1)
    dev.cooldown(h, n - 1 - h)  # 6-8: B1 B0 (second half split), W I0, drain the Ws
    assert dev.fwd == [half, half] and dev.bwd == [half, half], (dev.fwd, dev.bwd, m)
    return dev.ops


def dualpipe(num_devices: int, num_microbatches: int) -> Schedule:
    p, m = num_devices, num_microbatches
    if p % 2:
        raise ScheduleError(f"dualpipe runs two directions over an even --stages; got {p} (use dualpipev)")
    if m % 2 or m < 2 * p:
        raise ScheduleError(f"dualpipe needs an even --microbatches >= 2 x --stages ({2 * p}); got {m}")
    device_ops = [_device_ops(p, d, m) for d in range(p)]
    return make_schedule("dualpipe", m, stage_devices(MIRRORED, p, 1), device_ops, mirrored=True)
