"""Where a schedule's stages sit: the three placements (each schedule's is recorded in `registry.ScheduleInfo`).

- one-per-device (gpipe, 1f1b, zb-h1, zb-h2, zb-auto): stage s on device s, p stages.
- looped (interleaved; Narayanan et al., SC'21): v chunks per device; chunk c of device d is stage c*p + d, so
  stage s is on device s % p.
- V-shaped (zbv, dualpipev): 2 chunks per device; device d holds stage d (chunk 0, down the V) and stage 2p-1-d
  (chunk 1, back up), so the first and the last stage share device 0.
- mirrored (dualpipe; DeepSeek-V3 technical report): p stages (p even), each held twice, once per direction: the
  even microbatches run stage s on device s (entering at device 0, flowing down), the odd ones on device p-1-s
  (entering at device p-1, flowing up). Device d holds stage d and stage p-1-d, so the parameters exist twice and
  the two copies of each stage reduce their gradients together (`stage_copies`).

`chunk_stage` is the one formula per placement; generators and the registry's stage -> device map use it.
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError

ONE_PER_DEVICE = "one-per-device"
LOOPED = "looped"
V_SHAPED = "v-shaped"
MIRRORED = "mirrored"
PLACEMENTS = (ONE_PER_DEVICE, LOOPED, V_SHAPED, MIRRORED)
DIRECTIONS = 2  # a mirrored placement's directions: microbatch mb runs in direction mb % 2


def microbatch_direction(microbatch: int) -> int:
    """A mirrored placement's direction of `microbatch`: 0 (even: enters at device 0) or 1 (odd: at device p-1)."""
    return microbatch % DIRECTIONS


def mirrored_device(device: int, microbatch: int, num_devices: int) -> int:
    """The device running, for `microbatch`, the stage whose direction-0 copy is on `device` (mirrored placement)."""
    return num_devices - 1 - device if microbatch_direction(microbatch) else device


def stage_copies(placement: str) -> int:
    """Copies of each stage's parameters in one pipeline (before replication): 2 mirrored, else 1."""
    return DIRECTIONS if placement == MIRRORED else 1


def device_stages(placement: str, device: int, num_devices: int, chunks: int) -> tuple[int, ...]:
    """The stages `device` holds, in chunk order (mirrored: its direction-0 stage, then its direction-1 one)."""
    if placement == MIRRORED:
        return (device, num_devices - 1 - device)
    return tuple(chunk_stage(placement, device, chunk, num_devices) for chunk in range(chunks))


def chunk_stage(placement: str, device: int, chunk: int, num_devices: int) -> int:
    """The global stage of chunk `chunk` (0-based, in the device's chunk order) on `device`."""
    if placement == V_SHAPED:
        return device if chunk == 0 else 2 * num_devices - 1 - device
    return chunk * num_devices + device  # looped; one-per-device and mirrored (direction 0) have only chunk 0


def v_stages(device: int, num_devices: int) -> tuple[int, int]:
    """(chunk-0 stage, chunk-1 stage) of `device` in the V-shaped placement."""
    return chunk_stage(V_SHAPED, device, 0, num_devices), chunk_stage(V_SHAPED, device, 1, num_devices)


def fixed_chunks(placement: str) -> int | None:
    """The chunk count per device the placement always has (one-per-device 1, V-shaped 2); None: any >= 1."""
    return {ONE_PER_DEVICE: 1, V_SHAPED: 2, MIRRORED: 1}.get(placement)


def check_chunks(placement: str, name: str, chunks: int) -> None:
    """Refuse a chunk count the placement cannot have (`fixed_chunks`; looped: any >= 1)."""
    fixed = fixed_chunks(placement)
    if fixed is not None and chunks != fixed:
        what = "runs one stage per device" if fixed == 1 else f"always uses {fixed} chunks per device"
        raise ScheduleError(f"{name} {what}; drop --chunks or set --chunks {fixed}")
    if chunks < 1:
        raise ScheduleError(f"--chunks must be >= 1, got {chunks}")


def stage_devices(placement: str, num_devices: int, chunks: int) -> tuple[int, ...]:
    """Global stage -> device for `num_devices` devices holding `chunks` stages each (mirrored: the direction-0
    copy's device; `mirrored_device` gives the other direction's)."""
    if num_devices < 1:
        raise ScheduleError(f"--stages (pipeline devices) must be >= 1, got {num_devices}")
    placed = [0] * (num_devices * chunks)
    for device in range(num_devices):
        for chunk in range(chunks):
            placed[chunk_stage(placement, device, chunk, num_devices)] = device
    return tuple(placed)
