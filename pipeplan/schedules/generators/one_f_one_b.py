"""1F1B (PipeDream-Flush; Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021): after a
warm-up of p-1-d forwards, device d alternates one forward and one full backward, so at most p-d microbatches are
in flight on it. Makespan with uniform costs: (m + p - 1)(F + B)."""

from __future__ import annotations

from pipeplan.schedules.ops import Op, Schedule, make_schedule


def one_f_one_b(num_devices: int, num_microbatches: int) -> Schedule:
    device_ops: list[list[Op]] = []
    for stage in range(num_devices):
        warmup = min(num_devices - 1 - stage, num_microbatches)
        ops = [Op("F", stage, mb) for mb in range(warmup)]  # warm-up: p-1-d forwards
        for mb in range(num_microbatches - warmup):  # steady: 1F1B
            ops.append(Op("F", stage, warmup + mb))
            ops.append(Op("B", stage, mb))
        ops += [Op("B", stage, mb) for mb in range(num_microbatches - warmup, num_microbatches)]  # cool-down
        device_ops.append(ops)
    return make_schedule("1f1b", num_microbatches, tuple(range(num_devices)), device_ops)
