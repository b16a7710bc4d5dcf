"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1, handcrafted schedule 1): 1F1B
with the backward split into I (input gradient) and W (weight gradient). Device d defers its first d Ws, so the
cool-down runs on the I chain while deferred Ws fill the gaps, and no device holds more than p microbatches
(1F1B's peak). Bubble with F = I = W: (p-1)(F+I-W), a third of 1F1B's."""

from __future__ import annotations

from pipeplan.schedules.ops import Op, Schedule, make_schedule


def split_1f1b_ops(stage: int, num_microbatches: int, *, warmup: int, deferred_w: int) -> list[Op]:
    """1F1B order on one stage with B split into I and W; the first `deferred_w` Ws are postponed."""
    m = num_microbatches
    warmup = min(warmup, m)
    ops = [Op("F", stage, mb) for mb in range(warmup)]  # warm-up forwards
    next_w = 0
    for mb in range(m - warmup):  # steady: F, I, and (after the deferral) the oldest W
        ops += [Op("F", stage, warmup + mb), Op("I", stage, mb)]
        if mb >= deferred_w:
            ops.append(Op("W", stage, next_w))
            next_w += 1
    for mb in range(m - warmup, m):  # cool-down: I, then the oldest W fills the wait for the next I
        ops += [Op("I", stage, mb), Op("W", stage, next_w)]
        next_w += 1
    ops += [Op("W", stage, mb) for mb in range(next_w, m)]  # drain: the deferred Ws
    return ops


def zb_h1(num_devices: int, num_microbatches: int) -> Schedule:
    p = num_devices
    device_ops = [
        split_1f1b_ops(d, num_microbatches, warmup=p - 1 - d, deferred_w=d)  # device d defers d Ws
        for d in range(p)
    ]
    return make_schedule("zb-h1", num_microbatches, tuple(range(p)), device_ops)
