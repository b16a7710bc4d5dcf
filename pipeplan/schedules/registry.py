"""Schedule name -> generator. Every generator is a pure function of (devices, microbatches, ...)."""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.dualpipev import dualpipev
from pipeplan.schedules.gpipe import gpipe
from pipeplan.schedules.interleaved import interleaved
from pipeplan.schedules.one_f_one_b import one_f_one_b
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, fits_limit, peak_activation_per_device, unit_memory
from pipeplan.schedules.zb_auto import zb_auto
from pipeplan.schedules.zb_h1 import zb_h1
from pipeplan.schedules.zb_h2 import zb_h2
from pipeplan.schedules.zbv import zbv

SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-auto", "zbv", "dualpipev")
_V_SHAPED = ("zbv", "dualpipev")  # device d holds stages d and 2p-1-d; always 2 chunks
_LOOPED = ("interleaved",)  # stage s on device s % p; any number of chunks


def _check_name(name: str) -> None:
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; choose --schedule from: {', '.join(SCHEDULE_NAMES)}")


def default_chunks(name: str) -> int:
    """Stages per device when --chunks is not given."""
    _check_name(name)
    return 2 if name in _V_SHAPED or name in _LOOPED else 1


def _resolve_chunks(name: str, chunks: int | None) -> int:
    _check_name(name)
    if chunks is None:
        return default_chunks(name)
    if name in _V_SHAPED and chunks != 2:
        raise ScheduleError(f"{name} always uses 2 chunks per device; drop --chunks or set --chunks 2")
    if name not in _V_SHAPED and name not in _LOOPED and chunks != 1:
        raise ScheduleError(f"{name} runs one stage per device; drop --chunks or set --chunks 1")
    if chunks < 1:
        raise ScheduleError(f"--chunks must be >= 1, got {chunks}")
    return chunks


def stage_device(name: str, num_devices: int, chunks: int | None = None) -> tuple[int, ...]:
    """Global stage id -> device for schedule `name` (looped, V-shaped or one stage per device)."""
    v = _resolve_chunks(name, chunks)
    p = num_devices
    if p < 1:
        raise ScheduleError(f"--stages (pipeline devices) must be >= 1, got {p}")
    if name in _V_SHAPED:
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * v))


MAX_SCHEDULE_OPS = 1_000_000  # every op is held (and simulated) in memory: ~1 GB and tens of seconds at this size


def check_schedule_size(num_devices: int, num_microbatches: int, chunks: int = 1) -> None:
    """Refuse a schedule too large to hold: devices x chunks x microbatches x 3 (F, I, W) ops."""
    ops = num_devices * chunks * num_microbatches * 3
    if ops > MAX_SCHEDULE_OPS:
        raise ScheduleError(
            f"{num_devices} devices x {chunks} chunk(s) x {num_microbatches} microbatches is {ops:,} ops; schedules "
            f"are held in memory, at most {MAX_SCHEDULE_OPS:,}: use fewer devices or microbatches (larger microbatches)"
        )


def generate(
    name: str,
    *,
    num_devices: int,
    num_microbatches: int,
    chunks: int | None = None,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
    memory_limit: float | None = None,
) -> Schedule:
    """Op lists of schedule `name`. `costs` steer zb-auto and zbv (the others are fixed orders). `memory_limit`
    caps the live activation bytes per device, in the units of `memory` (static bytes not included;
    `memory=None`: unit mode, one microbatch of a device's slice = 1, I frees half): zb-auto is generated under it
    (default: 1F1B's peak), the other schedules are checked against it."""
    v = _resolve_chunks(name, chunks)
    if num_devices < 1:
        raise ScheduleError(f"--stages (pipeline devices) must be >= 1, got {num_devices}")
    if num_microbatches < 1:
        raise ScheduleError(f"--microbatches must be >= 1, got {num_microbatches}")
    if memory_limit is not None and not memory_limit > 0:
        raise ScheduleError(f"--memory-limit must be > 0 (live activations per device), got {memory_limit}")
    check_schedule_size(num_devices, num_microbatches, v)
    p, m = num_devices, num_microbatches
    if name == "zb-auto":
        return zb_auto(p, m, costs=costs, memory=memory, memory_limit=memory_limit)
    if name == "interleaved":
        schedule = interleaved(p, m, v)
    elif name == "zbv":
        schedule = zbv(p, m, costs=costs, memory=memory, memory_limit=memory_limit)
    else:
        fixed = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2, "dualpipev": dualpipev}
        schedule = fixed[name](p, m)
    if memory_limit is not None:
        peak = max(peak_activation_per_device(schedule, memory or unit_memory(v)))
        if not fits_limit(peak, memory_limit):
            raise ScheduleError(
                f"{name} holds up to {peak:g} of live activations on a device, over --memory-limit {memory_limit:g}"
                f"; raise the limit or use --schedule zb-auto"
            )
    return schedule
