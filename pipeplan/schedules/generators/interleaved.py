"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21): each device holds v model chunks placed in a loop (stage s on device s % p), so the warm-up
and cool-down bubble shrinks to (p-1)(F+B)/v. Microbatches advance in groups of p per chunk, as in Megatron-LM;
this needs m to be a multiple of p."""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.placement import LOOPED, chunk_stage, stage_devices


def _virtual(k: int, num_devices: int, chunks: int, *, backward: bool) -> tuple[int, int]:
    """The k-th forward (or backward) of a device -> (chunk, microbatch)."""
    chunk = (k // num_devices) % chunks
    if backward:
        chunk = chunks - 1 - chunk
    microbatch = (k // (num_devices * chunks)) * num_devices + k % num_devices
    return chunk, microbatch


def interleaved(num_devices: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    p, v, m = num_devices, chunks, num_microbatches
    if v < 1:
        raise ScheduleError(f"interleaved needs --chunks >= 1, got {v}")
    if m % p != 0:
        raise ScheduleError(f"interleaved needs --microbatches to be a multiple of --stages ({p}); got {m}")
    total = m * v
    device_ops: list[list[Op]] = []
    for device in range(p):
        warmup = p - device - 1 if v == 1 else (p - device - 1) * 2 + (v - 1) * p
        warmup = min(warmup, total)

        def fwd(k: int, device: int = device) -> Op:
            chunk, mb = _virtual(k, p, v, backward=False)
            return Op("F", chunk_stage(LOOPED, device, chunk, p), mb)

        def bwd(k: int, device: int = device) -> Op:
            chunk, mb = _virtual(k, p, v, backward=True)
            return Op("B", chunk_stage(LOOPED, device, chunk, p), mb)

        ops = [fwd(k) for k in range(warmup)]  # warm-up: 2(p-1-d) + (v-1)p forwards
        for k in range(total - warmup):  # steady: one forward, one backward
            ops += [fwd(warmup + k), bwd(k)]
        ops += [bwd(k) for k in range(total - warmup, total)]  # cool-down: the remaining backwards
        device_ops.append(ops)
    return make_schedule("interleaved", m, stage_devices(LOOPED, p, v), device_ops)
