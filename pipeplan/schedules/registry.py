"""Schedule name -> ScheduleInfo: the generator and every fact other modules ask about (placement, chunks, split
backward, replication, capacity default, memory behaviour, weight updates, what the search estimates it with, and
its names in torch.distributed.pipelining, torchtitan and Megatron-LM). Every generator is a pure function of
(devices, microbatches, ...) in `generators/`. The registry imports the generators; nothing they import imports
the registry.

Adding a schedule: its generator file in `generators/` and one `ScheduleInfo` below (the engine names have no
default, so each is decided). tests/schedules/test_schedule_coverage.py runs every registered schedule through every
consumer (simulate, show, the exports, the run's checks) and tests/schedules/test_registry.py checks each fact
against the generated op lists."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from pipeplan.errors import ScheduleError, UnknownScheduleError
from pipeplan.schedules.generators.dualpipe import dualpipe
from pipeplan.schedules.generators.dualpipev import dualpipev
from pipeplan.schedules.generators.gpipe import gpipe
from pipeplan.schedules.generators.interleaved import interleaved
from pipeplan.schedules.generators.one_f_one_b import one_f_one_b
from pipeplan.schedules.generators.pipedream import pipedream, pipedream_2bw
from pipeplan.schedules.generators.zb_auto import zb_auto
from pipeplan.schedules.generators.zb_h1 import zb_h1
from pipeplan.schedules.generators.zb_h2 import zb_h2
from pipeplan.schedules.generators.zbv import zbv, zbv_fixed
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.placement import (
    LOOPED,
    MIRRORED,
    ONE_PER_DEVICE,
    PLACEMENTS,
    V_SHAPED,
    check_chunks,
    fixed_chunks,
    stage_devices,
)
from pipeplan.schedules.simulate import (
    MemoryCosts,
    StageCosts,
    fits_limit,
    peak_activation_per_device,
    stream_steps,
    unit_memory,
)


@dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    """What the rest of pipeplan knows about one schedule.

    generator: (p, m) -> Schedule; looped ones take (p, m, chunks); cost-driven ones take (p, m, costs=, memory=,
    memory_limit=). placement: `placement.PLACEMENTS` (it fixes the allowed chunks: one-per-device and mirrored
    1, V-shaped 2, looped any >= 1; mirrored holds each stage twice, `placement.stage_copies`).
    split_backward: runs I and W as separate ops (compute F + I + W, else F + B).
    replicable: PipeDream replicated stages allowed (one stage per device and a fixed order, regenerated from the
    name alone). capacity_default: swept by `capacity` when --schedule is auto. named_only: searched by `plan` only
    when --schedule names it (left out of auto there too). cost_driven: the op order depends
    on the stage costs and memory (else fixed by p, m and chunks). within_memory_limit: generated under
    --memory-limit (default 1F1B's peak); other schedules are checked against it after generation.
    asynchronous: weight updates without a pipeline flush (PipeDream-style): the generator takes (p, m, steps) and
    emits one stream of steps x m microbatches whose ops carry weight versions; `staleness` says, for `describe`,
    how stale the weights are and how many versions a stage keeps ({p}: the pipeline devices). `update`: when a
    stage makes a new weight version, after every microbatch's backward ("microbatch") or once per step of m
    ("step"): `update_every(m)`; `max_versions`: the most versions a stage holds (0: one per pipeline device, p):
    `weight_versions(p)`. The op lists carry the same two numbers (`Schedule.update_every`, `weight_versions`).
    estimate_with: the schedule the search's balanced-stage estimate simulates in its place ("" itself).
    overlapped_pairs: its op lists pair a forward with a backward in one op (`Op.overlap`; `simulate --overlap-ms`).
    torch_name: the torch.distributed.pipelining schedule with this stage placement (`get_schedule_class` name,
    torchtitan's `pipeline_parallel_schedule`); torch_builtin: torch has this schedule itself under that name.
    megatron: how Megatron-LM runs it, completing "schedule NAME ..." ("" when it is Megatron-Core's own schedule;
    {runs_as}: 1F1B, or interleaved 1F1B over the same stages when they are looped).
    not_exportable: why neither torch.distributed.pipelining, torchtitan nor Megatron-LM can express it ("": they
    can, as torch_name / megatron say); `pipeplan export` refuses it with this reason.
    """

    name: str
    generator: Callable[..., Schedule]
    placement: str
    split_backward: bool
    default_chunks: int = 1
    replicable: bool = False
    capacity_default: bool = True
    named_only: bool = False
    cost_driven: bool = False
    within_memory_limit: bool = False
    asynchronous: bool = False
    staleness: str = ""
    update: str = ""
    max_versions: int = 1
    estimate_with: str = ""
    overlapped_pairs: bool = False
    torch_name: str
    torch_builtin: bool
    megatron: str
    not_exportable: str = ""

    def __post_init__(self) -> None:
        assert self.placement in PLACEMENTS, self.placement
        assert self.placement != MIRRORED or (self.not_exportable and not self.torch_name), self.name
        assert self.asynchronous == bool(self.staleness) == bool(self.update), self.name
        assert self.update in ("", "microbatch", "step") and self.max_versions >= 0, self.name
        assert self.asynchronous or self.max_versions == 1, self.name
        assert not self.asynchronous or (
            self.placement == ONE_PER_DEVICE and not (self.replicable or self.split_backward or self.cost_driven)
        ), self.name
        assert self.default_chunks >= 1 and fixed_chunks(self.placement) in (None, self.default_chunks), self.name
        assert not self.replicable or (self.placement == ONE_PER_DEVICE and not self.cost_driven), self.name
        assert not self.within_memory_limit or self.cost_driven, self.name

    def resolve_chunks(self, chunks: int | None) -> int:
        """`chunks` (None: the default) checked against the placement."""
        if chunks is None:
            return self.default_chunks
        check_chunks(self.placement, self.name, chunks)
        return chunks

    def stage_device(self, num_devices: int, chunks: int | None = None) -> tuple[int, ...]:
        """Global stage id -> device on `num_devices` devices."""
        return stage_devices(self.placement, num_devices, self.resolve_chunks(chunks))

    def update_every(self, num_microbatches: int) -> int:
        """Microbatches per new weight version (0: synchronous, the weights change only between steps)."""
        return {"": 0, "microbatch": 1, "step": num_microbatches}[self.update]

    def weight_versions(self, num_devices: int) -> int:
        """The most weight versions a stage holds at once on a pipeline of `num_devices` devices."""
        return self.max_versions or num_devices

    def megatron_note(self, chunks: int) -> str:
        """How Megatron-LM runs a plan of this schedule with `chunks` stages per device ("" when natively)."""
        if not self.megatron:
            return ""
        looped = "interleaved 1F1B over the same stages (looped, not V-shaped)"
        return f"schedule {self.name} {self.megatron.format(runs_as=looped if chunks > 1 else '1F1B')}"

    def describe_staleness(self, num_devices: int) -> str:
        """e.g. `pipedream-2bw: weights 1 step stale; 2 weight versions per stage` ("" when synchronous)."""
        return f"{self.name}: {self.staleness.format(p=num_devices, p1=num_devices - 1)}" if self.staleness else ""


_ZERO_BUBBLE = "(split backward / zero bubble) is not in Megatron-Core; it runs as {runs_as}"
_INFOS = (
    ScheduleInfo(
        name="gpipe",
        generator=gpipe,
        placement=ONE_PER_DEVICE,
        split_backward=False,
        replicable=True,
        torch_name="GPipe",
        torch_builtin=True,
        megatron="runs as Megatron's 1F1B (same gradients, less activation memory)",
    ),
    ScheduleInfo(
        name="1f1b",
        generator=one_f_one_b,
        placement=ONE_PER_DEVICE,
        split_backward=False,
        replicable=True,
        torch_name="1F1B",
        torch_builtin=True,
        megatron="",
    ),
    ScheduleInfo(
        name="interleaved",
        generator=interleaved,
        placement=LOOPED,
        split_backward=False,
        default_chunks=2,
        torch_name="Interleaved1F1B",
        torch_builtin=True,
        megatron="",
    ),
    ScheduleInfo(
        name="zb-h1",
        generator=zb_h1,
        placement=ONE_PER_DEVICE,
        split_backward=True,
        replicable=True,
        torch_name="1F1B",
        torch_builtin=False,
        megatron=_ZERO_BUBBLE,
    ),
    ScheduleInfo(
        name="zb-h2",
        generator=zb_h2,
        placement=ONE_PER_DEVICE,
        split_backward=True,
        replicable=True,
        torch_name="1F1B",
        torch_builtin=False,
        megatron=_ZERO_BUBBLE,
    ),
    ScheduleInfo(
        name="zb-auto",
        generator=zb_auto,
        placement=ONE_PER_DEVICE,
        split_backward=True,
        capacity_default=False,
        cost_driven=True,
        within_memory_limit=True,
        # ZB-1p is never slower than zb-h1 under the same costs and, with balanced stages, no faster in practice:
        # the search's estimate skips its (slow) list scheduling
        estimate_with="zb-h1",
        torch_name="1F1B",
        torch_builtin=False,
        megatron=_ZERO_BUBBLE,
    ),
    ScheduleInfo(
        name="zbv",
        generator=zbv,
        placement=V_SHAPED,
        split_backward=True,
        default_chunks=2,
        cost_driven=True,
        torch_name="ZBVZeroBubble",
        torch_builtin=True,
        megatron=_ZERO_BUBBLE,
    ),
    ScheduleInfo(
        name="dualpipev",
        generator=dualpipev,
        placement=V_SHAPED,
        split_backward=True,
        default_chunks=2,
        overlapped_pairs=True,
        torch_name="DualPipeV",
        torch_builtin=True,
        megatron=_ZERO_BUBBLE,
    ),
    ScheduleInfo(
        name="dualpipe",
        generator=dualpipe,
        placement=MIRRORED,
        split_backward=True,
        overlapped_pairs=True,
        capacity_default=False,  # twice the parameters of dualpipev for the same bubble: asked for by name only
        named_only=True,  # and no engine runs it: `plan` picking it by itself would leave a plan nothing exports
        torch_name="",
        torch_builtin=False,
        megatron="is bidirectional (two copies of every stage); Megatron-LM has no such schedule",
        not_exportable="it holds every stage twice, one copy per direction, and these engines place a stage on one "
        "rank; export a dualpipev plan (DualPipe cut in half: the same bubble with one copy)",
    ),
    ScheduleInfo(
        name="pipedream",
        generator=pipedream,
        placement=ONE_PER_DEVICE,
        split_backward=False,
        asynchronous=True,
        staleness="weights updated after every microbatch, stage d's {p1}-d updates stale (weight stashing); up to "
        "{p} weight versions on the first stage",
        update="microbatch",
        max_versions=0,
        torch_name="1F1B",
        torch_builtin=False,
        megatron="updates weights without a flush; Megatron flushes every step (1F1B)",
    ),
    ScheduleInfo(
        name="pipedream-2bw",
        generator=pipedream_2bw,
        placement=ONE_PER_DEVICE,
        split_backward=False,
        asynchronous=True,
        staleness="weights 1 step stale; 2 weight versions per stage",
        update="step",
        max_versions=2,
        torch_name="1F1B",
        torch_builtin=False,
        megatron="updates weights without a flush; Megatron flushes every step (1F1B)",
    ),
)
_BY_NAME = {info.name: info for info in _INFOS}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def schedule_info(name: str, *, also_accepted: Sequence[str] = ()) -> ScheduleInfo:
    """The info of schedule `name`; anything else raises the one unknown-schedule error, which lists the valid
    names (after `also_accepted`: other words the caller takes in their place, e.g. "auto")."""
    info = _BY_NAME.get(name)
    if info is None:
        choices = ", ".join((*also_accepted, *SCHEDULE_NAMES))
        raise UnknownScheduleError(f"unknown --schedule {name!r}; choose from: {choices}")
    return info


def schedule_names(**properties: object) -> tuple[str, ...]:
    """Schedule names in registry order, only those whose info has each given value, e.g. `replicable=True`."""
    known = {f.name for f in fields(ScheduleInfo)}
    assert set(properties) <= known, set(properties) - known
    return tuple(info.name for info in _INFOS if all(getattr(info, k) == v for k, v in properties.items()))


def default_chunks(name: str) -> int:
    """Stages per device when --chunks is not given."""
    return schedule_info(name).default_chunks


def stage_device(name: str, num_devices: int, chunks: int | None = None) -> tuple[int, ...]:
    """Global stage id -> device for schedule `name` (looped, V-shaped or one stage per device)."""
    return schedule_info(name).stage_device(num_devices, chunks)


def async_stream_steps(name: str, num_devices: int, num_microbatches: int) -> int | None:
    """Steps to generate schedule `name` for when simulating its steady state: `stream_steps` for an asynchronous
    schedule, None (one step) for a synchronous one."""
    return stream_steps(num_devices, num_microbatches) if schedule_info(name).asynchronous else None


MAX_SCHEDULE_OPS = 1_000_000  # every op is held (and simulated) in memory: ~1 GB and tens of seconds at this size


def check_schedule_size(num_devices: int, num_microbatches: int, chunks: int = 1) -> None:
    """Refuse a schedule too large to hold: devices x chunks x microbatches x 3 (F, I, W) ops."""
    ops = num_devices * chunks * num_microbatches * 3
    if ops > MAX_SCHEDULE_OPS:
        raise ScheduleError(
            f"{num_devices} devices x {chunks} chunk(s) x {num_microbatches} microbatches is {ops:,} ops; schedules "
            f"are held in memory, at most {MAX_SCHEDULE_OPS:,}: use fewer devices or microbatches (larger microbatches)"
        )


@functools.lru_cache(maxsize=128)
def _fixed_order(name: str, p: int, m: int, chunks: int, steps: int) -> Schedule:
    """The op lists of a schedule whose order p, m, chunks (and an asynchronous stream's steps) fix: cached, as a
    search times the same ones for every partition of a layout (a Schedule is immutable, so sharing it is safe)."""
    info = _BY_NAME[name]
    if info.asynchronous:
        return info.generator(p, m, steps)
    if info.placement == LOOPED:
        return info.generator(p, m, chunks)
    return info.generator(p, m)


def clear_schedule_cache() -> None:
    """Forget the cached fixed-order schedules and ZB-V start orders (benchmarks time generation cold)."""
    _fixed_order.cache_clear()
    zbv_fixed.cache_clear()


def generate(
    name: str,
    *,
    num_devices: int,
    num_microbatches: int,
    chunks: int | None = None,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
    memory_limit: float | None = None,
    steps: int | None = None,
    post_validate: bool = False,
) -> Schedule:
    """Op lists of schedule `name`. `costs` steer the cost-driven ones (zb-auto, zbv; the others are fixed orders).
    `memory_limit` caps the live activation bytes per device, in the units of `memory` (static bytes not included;
    `memory=None`: unit mode, one microbatch of a device's slice = 1, I frees half): zb-auto is generated under it
    (default: 1F1B's peak), the other schedules are checked against it. `steps`: the length of an asynchronous
    schedule's stream in steps of `num_microbatches` (default 1; `stream_steps` gives enough for its steady state);
    synchronous schedules are one step. `post_validate`: the cost-driven ones rank their candidates by the period of
    steps post-validated (`schedules.period`), else by the makespan."""
    info = schedule_info(name)
    if steps is not None and steps != 1 and not info.asynchronous:
        raise ScheduleError(f"{name} is synchronous: one step per op list (--steps applies to pipedream schedules)")
    v = info.resolve_chunks(chunks)
    if num_devices < 1:
        raise ScheduleError(f"--stages (pipeline devices) must be >= 1, got {num_devices}")
    if num_microbatches < 1:
        raise ScheduleError(f"--microbatches must be >= 1, got {num_microbatches}")
    if memory_limit is not None and not memory_limit > 0:
        raise ScheduleError(f"--memory-limit must be > 0 (live activations per device), got {memory_limit}")
    check_schedule_size(num_devices, num_microbatches * (steps or 1), v)
    p, m = num_devices, num_microbatches
    if info.cost_driven:
        limits = dict(memory=memory, memory_limit=memory_limit, post_validate=post_validate)
        schedule = info.generator(p, m, costs=costs, **limits)
    else:
        schedule = _fixed_order(name, p, m, v, steps or 1)
    if memory_limit is not None and not info.within_memory_limit:
        peak = max(peak_activation_per_device(schedule, memory or unit_memory(v)))
        if not fits_limit(peak, memory_limit):
            raise ScheduleError(
                f"{name} holds up to {peak:g} of live activations on a device, over --memory-limit {memory_limit:g}"
                f"; raise the limit or use --schedule zb-auto"
            )
    return schedule
