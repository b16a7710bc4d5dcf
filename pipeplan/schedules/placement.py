"""Where a schedule's stages sit: the three placements (each schedule's is recorded in `registry.ScheduleInfo`).

- one-per-device (gpipe, 1f1b, zb-h1, zb-h2, zb-auto): stage s on device s, p stages.
- looped (interleaved; Narayanan et al., SC'21): v chunks per device; chunk c of device d is stage c*p + d, so
  stage s is on device s % p.
- V-shaped (zbv, dualpipev): 2 chunks per device; device d holds stage d (chunk 0, down the V) and stage 2p-1-d
  (chunk 1, back up), so the first and the last stage share device 0.

`chunk_stage` is the one formula per placement; generators and the registry's stage -> device map use it.
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError

ONE_PER_DEVICE = "one-per-device"
LOOPED = "looped"
V_SHAPED = "v-shaped"
PLACEMENTS = (ONE_PER_DEVICE, LOOPED, V_SHAPED)


def chunk_stage(placement: str, device: int, chunk: int, num_devices: int) -> int:
    """The global stage of chunk `chunk` (0-based, in the device's chunk order) on `device`."""
    if placement == V_SHAPED:
        return device if chunk == 0 else 2 * num_devices - 1 - device
    return chunk * num_devices + device  # looped; one-per-device has only chunk 0


def v_stages(device: int, num_devices: int) -> tuple[int, int]:
    """(chunk-0 stage, chunk-1 stage) of `device` in the V-shaped placement."""
    return chunk_stage(V_SHAPED, device, 0, num_devices), chunk_stage(V_SHAPED, device, 1, num_devices)


def fixed_chunks(placement: str) -> int | None:
    """The chunk count per device the placement always has (one-per-device 1, V-shaped 2); None: any >= 1."""
    return {ONE_PER_DEVICE: 1, V_SHAPED: 2}.get(placement)


def check_chunks(placement: str, name: str, chunks: int) -> None:
    """Refuse a chunk count the placement cannot have (`fixed_chunks`; looped: any >= 1)."""
    fixed = fixed_chunks(placement)
    if fixed is not None and chunks != fixed:
        what = "runs one stage per device" if fixed == 1 else f"always uses {fixed} chunks per device"
        raise ScheduleError(f"{name} {what}; drop --chunks or set --chunks {fixed}")
    if chunks < 1:
        raise ScheduleError(f"--chunks must be >= 1, got {chunks}")


def stage_devices(placement: str, num_devices: int, chunks: int) -> tuple[int, ...]:
    """Global stage -> device for `num_devices` devices holding `chunks` stages each."""
    if num_devices < 1:
        raise ScheduleError(f"--stages (pipeline devices) must be >= 1, got {num_devices}")
    placed = [0] * (num_devices * chunks)
    for device in range(num_devices):
        for chunk in range(chunks):
            placed[chunk_stage(placement, device, chunk, num_devices)] = device
    return tuple(placed)
