"""GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019):
every device runs all forwards, then all full backwards. Peak activations: all m microbatches on every stage."""

from __future__ import annotations

from pipeplan.schedules.ops import Op, Schedule, make_schedule


def gpipe(num_devices: int, num_microbatches: int) -> Schedule:
    device_ops: list[list[Op]] = []
    for stage in range(num_devices):
        ops = [Op("F", stage, mb) for mb in range(num_microbatches)]  # fill: all forwards
        ops += [Op("B", stage, mb) for mb in range(num_microbatches)]  # drain: all backwards
        device_ops.append(ops)
    return make_schedule("gpipe", num_microbatches, tuple(range(num_devices)), device_ops)
