"""DualPipeV (DeepSeek, github.com/deepseek-ai/DualPipe, `DualPipeV`; the "cut-in-half" V-shaped variant of
DualPipe from the DeepSeek-V3 technical report, 2024): device d holds stages d and 2p-1-d (a V, like ZB-V).
Forward of one chunk overlaps the backward of the other in the steady state: such a pair is one op,
`Op.overlap(F, B)` (torch's OVERLAP_F_B), timed once by the engine (`engine.overlapped_ms`) and run overlapped by
`pipeplan run` (runtime/step/pair_runner.py). Part of the backwards split into I + W with W deferred (FIFO) to
fill bubbles. Needs m >= 2p.

Phase structure per device d (p devices, m microbatches), following DualPipeV's eight steps:
  1. 2(p-1-d) chunk-0 forwards                   5. p-1-d x (B1, F1&B0)
  2. d+1 x (F0, F1)                              6. d+1 x (B1, B0), the second half split (I, W deferred)
  3. p-1-d x (I1 + deferred W, F1)               7. p-1-d x (W, I0 + deferred W)
  4. m-2p+d+1 x (F0&B1, F1&B0)                   8. the remaining d+1 deferred W
(X&Y: one overlapped F&B op.)
"""

from __future__ import annotations

from collections import deque

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.placement import V_SHAPED, stage_devices, v_stages


class PairedDevice:
    """One device's counters while it emits a DualPipe-family op list (dualpipev here, dualpipe's mirrored one):
    per phase (a V's chunk, or a direction) its stage and the microbatch of its k-th forward / backward,
    `stride` x k + `offsets[phase]`; the deferred Ws."""

    def __init__(self, stages: tuple[int, int], stride: int = 1, offsets: tuple[int, int] = (0, 0)) -> None:
        self.stage, self.stride, self.offsets = stages, stride, offsets
        self.fwd = [0, 0]
        self.bwd = [0, 0]
        self.deferred_w: deque[Op] = deque()
        self.ops: list[Op] = []

    def _microbatch(self, phase: int, count: list[int]) -> int:
        index = count[phase]
        count[phase] += 1
        return self.stride * index + self.offsets[phase]

    def forward(self, phase: int) -> None:
        self.ops.append(Op("F", self.stage[phase], self._microbatch(phase, self.fwd)))

    def overlapped(self, forward_phase: int) -> None:
        """One fused op: the forward of `forward_phase` and the full backward of the other phase, overlapped."""
        self.forward(forward_phase)
        self.backward(1 - forward_phase)
        backward = self.ops.pop()
        self.ops.append(Op.overlap(self.ops.pop(), backward))

    def backward(self, phase: int, *, split: bool = False) -> None:
        stage, mb = self.stage[phase], self._microbatch(phase, self.bwd)
        if split:
            self.ops.append(Op("I", stage, mb))
            self.deferred_w.append(Op("W", stage, mb))
        else:
            self.ops.append(Op("B", stage, mb))

    def weight(self) -> None:
        self.ops.append(self.deferred_w.popleft())

    def cooldown(self, rank: int, rest: int) -> None:
        """Phases 6-8: rank + 1 rounds of B1 B0, the second half split into I + deferred W (an odd rank starts the
        split one B1 earlier); `rest` rounds of W, I0 (W deferred); then the deferred Ws drained."""
        steps, split = rank + 1, False
        for i in range(steps):  # 6
            if i == steps // 2 and rank % 2 == 1:
                split = True
            self.backward(1, split=split)
            if i == steps // 2 and rank % 2 == 0:
                split = True
            self.backward(0, split=split)
        for _ in range(rest):  # 7
            self.weight()
            self.backward(0, split=True)
        while self.deferred_w:  # 8
            self.weight()


def _device_ops(p: int, device: int, m: int) -> list[Op]:
    dev = PairedDevice(v_stages(device, p))
    for _ in range(2 * (p - 1 - device)):  # 1: chunk-0 forwards
        dev.forward(0)
    for _ in range(device + 1):  # 2: F0 F1
        dev.forward(0)
        dev.forward(1)
    for _ in range(p - 1 - device):  # 3: I1 (W deferred), W, F1 -- zero bubble
        dev.backward(1, split=True)
        dev.weight()
        dev.forward(1)
    for _ in range(m - 2 * p + device + 1):  # 4 (main): F0&B1 overlapped, F1&B0 overlapped
        dev.overlapped(0)
        dev.overlapped(1)
    for _ in range(p - 1 - device):  # 5: B1, F1&B0
        dev.backward(1)
        dev.overlapped(1)
    dev.cooldown(device, p - 1 - device)  # 6-8: B1 B0 (second half split), W I0, drain the Ws
    assert dev.fwd == [m, m] and dev.bwd == [m, m], (dev.fwd, dev.bwd, m)
    return dev.ops


def dualpipev(num_devices: int, num_microbatches: int) -> Schedule:
    p, m = num_devices, num_microbatches
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs --microbatches >= 2 x --stages ({2 * p}); got {m}")
    device_ops = [_device_ops(p, d, m) for d in range(p)]
    return make_schedule("dualpipev", m, stage_devices(V_SHAPED, p, 2), device_ops)
