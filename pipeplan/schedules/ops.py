"""Ops and schedules as plain data: `Op(kind, stage, microbatch)` with the text form `{stage}{kind}{mb}` used by
torch.distributed.pipelining (`2F0`, `1I3`, `0W2`), and `Schedule`, one ordered op list per device.

Kinds: F forward, B full backward (input + weight gradients), I input-gradient backward, W weight-gradient backward.
(The zero-bubble papers call I "B".) One composite kind, `OVERLAP_F_B` (torch.distributed.pipelining's name): a
forward of one stage and a full backward of another on the same device, run overlapped as one op (DualPipe's
F&B pair; `Op.overlap(f, b)`, text `(0F3;3B1)OVERLAP_F_B` as torch writes it). `Op.parts` is (F, B) for it and
(the op,) otherwise: completeness, dependencies, memory and routing read the parts; the op's time is the one
`engine.overlapped_ms`. A schedule's CSV form has one row per device, one op string per cell — the
"compute_only" format torch's `PipelineScheduleMulti._load_csv` reads.

Weight versions (asynchronous schedules, PipeDream-style). A synchronous schedule (`update_every == 0`) changes the
weights only between steps, after its flush; its ops carry no version. An asynchronous one (`update_every = k >= 1`)
is a stream of microbatches without flushes and carries the versions explicitly, on every op: `Op.version` is the
version of its stage's weights the op computes with (text `{stage}{kind}{mb}v{version}`, e.g. `0F5v2`; a B, I or W
uses the version its F used — the forward's weights are stashed until then). Where the versions change is a rule,
not an op: stage s makes version u+1 (from version u and the summed gradients of update group u, the microbatches
[u*k, (u+1)*k)) as soon as its last backward op (B, or W) of that group has run. So version 0 is the initial
weights, PipeDream (k = 1) updates after every microbatch and PipeDream-2BW (k = m) once per step.
`weight_versions` bounds how many versions a stage may hold at once (the current one, and every older one an op
still reads); `schedules.versions` checks the rule and the bound, and the memory model charges each held version
beyond the first.
"""

from __future__ import annotations

import csv
import functools
import io
import re
from dataclasses import dataclass
from typing import Any

from pipeplan.errors import FormatError, ScheduleError
from pipeplan.schedules.placement import mirrored_device

KINDS = ("F", "B", "I", "W")
KIND_INDEX = {kind: index for index, kind in enumerate(KINDS)}
OVERLAP = "OVERLAP_F_B"  # torch's _ComputationType.OVERLAP_F_B: an F and a B run overlapped, one op
SCHEMA_VERSION = 1
_OP_RE = re.compile(r"^(\d+)([FBIW])(\d+)(?:v(\d+))?$")
_OVERLAP_RE = re.compile(r"^\(([^;()]+);([^;()]+)\)" + OVERLAP + "$")
_GRID_ROWS = 12  # rows format_grid shows either side of the first marked step


@dataclass(frozen=True, slots=True)
class Op:
    """One compute op: `kind` on global stage `stage` for microbatch `microbatch` (positional: `Op("F", 2, 0)`);
    `version`: the stage's weight version it computes with (asynchronous schedules only, else None). An
    OVERLAP_F_B op (`Op.overlap`) carries its two halves in `halves` and its forward's stage and microbatch."""

    kind: str
    stage: int
    microbatch: int
    version: int | None = None
    halves: tuple[Op, Op] | None = None  # OVERLAP_F_B only: (the forward, the full backward)

    def __post_init__(self) -> None:
        if self.kind == OVERLAP:
            _check_halves(self.halves)
        elif self.kind not in KINDS or self.halves is not None:
            raise ScheduleError(f"op kind {self.kind!r} is not one of {', '.join(KINDS)} or {OVERLAP}")
        if self.stage < 0 or self.microbatch < 0 or (self.version is not None and self.version < 0):
            raise ScheduleError(f"op {self.stage}{self.kind}{self.microbatch} has a negative index")

    @staticmethod
    def overlap(forward: Op, backward: Op) -> Op:
        """The fused op running `forward` (an F) and `backward` (a full B of another stage) overlapped."""
        return Op(OVERLAP, forward.stage, forward.microbatch, halves=(forward, backward))

    @property
    def parts(self) -> tuple[Op, ...]:
        """The simple ops this op runs: its two halves for OVERLAP_F_B, else itself."""
        return self.halves if self.halves is not None else (self,)

    def shifted(self, microbatches: int) -> Op:
        """This op on microbatch + `microbatches` (both halves of an OVERLAP_F_B): a later step's copy."""
        if self.halves is not None:
            return Op.overlap(*(half.shifted(microbatches) for half in self.halves))
        return Op(self.kind, self.stage, self.microbatch + microbatches, self.version)

    def __str__(self) -> str:
        if self.halves is not None:
            return f"({self.halves[0]};{self.halves[1]}){OVERLAP}"
        text = f"{self.stage}{self.kind}{self.microbatch}"
        return text if self.version is None else f"{text}v{self.version}"

    @staticmethod
    def parse(text: str) -> Op:
        """Parse `2F0` / `1I3` / `0W2`, `0F5v2` with a weight version, or `(0F3;3B1)OVERLAP_F_B` (surrounding
        whitespace ignored); cached: a search simulates the same op strings many times."""
        return _parse_op(text)


def _check_halves(halves: tuple[Op, Op] | None) -> None:
    if halves is None or len(halves) != 2:
        raise ScheduleError(f"an {OVERLAP} op needs two halves, a forward and a full backward")
    forward, backward = halves
    if forward.kind != "F" or backward.kind != "B":
        raise ScheduleError(f"an {OVERLAP} op pairs an F with a B, not {forward} with {backward}")
    if forward.stage == backward.stage:
        raise ScheduleError(f"an {OVERLAP} op pairs two different stages, not {forward} with {backward}")
    if forward.version is not None or backward.version is not None:
        raise ScheduleError(f"an {OVERLAP} op carries no weight versions (synchronous schedules only)")


@functools.lru_cache(maxsize=1 << 16)
def _parse_op(text: str) -> Op:
    text = text.strip()
    pair = _OVERLAP_RE.match(text)
    if pair is not None:
        forward, backward = (_parse_op(half) for half in pair.groups())
        return Op.overlap(forward, backward)
    match = _OP_RE.match(text)
    if match is None:
        raise FormatError(
            f"bad op {text!r}: expected {{stage}}{{F|B|I|W}}{{microbatch}}, e.g. 2F0, or (0F3;3B1){OVERLAP}"
        )
    stage, kind, microbatch, version = match.groups()
    return Op(kind, int(stage), int(microbatch), None if version is None else int(version))


@dataclass(kw_only=True, frozen=True)
class Schedule:
    """One ordered op list per device. `stage_device[s]` is the device global stage `s` runs on; microbatches
    flow stage 0 -> 1 -> ... -> num_stages - 1 forward and back again for the backward. `mirrored` (dualpipe's
    placement, `placement.MIRRORED`): every stage is held twice, the odd microbatches running stage s on device
    num_devices - 1 - stage_device[s] (`op_device`)."""

    name: str
    num_devices: int
    num_stages: int
    num_microbatches: int
    stage_device: tuple[int, ...]
    device_ops: tuple[tuple[Op, ...], ...]
    update_every: int = 0  # 0: synchronous; k: a stage makes a new weight version per k microbatches (module doc)
    weight_versions: int = 1  # the most weight versions a stage may hold at once
    mirrored: bool = False  # each stage also on the mirror device, for the odd microbatches (class doc)

    def op_device(self, stage: int, microbatch: int) -> int:
        """The device running `stage` for `microbatch`."""
        device = self.stage_device[stage]
        return mirrored_device(device, microbatch, self.num_devices) if self.mirrored else device

    def device_stages(self, device: int) -> tuple[int, ...]:
        """The stages `device` holds, ascending by their direction-0 order (mirrored: its own, then the mirror's)."""
        own = tuple(s for s, d in enumerate(self.stage_device) if d == device)
        if not self.mirrored:
            return own
        return own + tuple(s for s, d in enumerate(self.stage_device) if d == self.num_devices - 1 - device)

    @property
    def asynchronous(self) -> bool:
        return self.update_every > 0

    def __post_init__(self) -> None:
        if self.update_every < 0 or self.weight_versions < 1:
            raise ScheduleError(f"schedule {self.name!r}: update_every must be >= 0 and weight_versions >= 1")
        if self.update_every and self.num_microbatches % self.update_every:
            raise ScheduleError(
                f"schedule {self.name!r}: {self.num_microbatches} microbatches are not whole update groups of "
                f"{self.update_every}"
            )
        if self.num_devices < 1 or self.num_stages < 1 or self.num_microbatches < 1:
            raise ScheduleError(
                f"schedule {self.name!r} needs >= 1 device, stage and microbatch; got devices="
                f"{self.num_devices}, stages={self.num_stages}, microbatches={self.num_microbatches}"
            )
        if len(self.stage_device) != self.num_stages:
            raise ScheduleError(
                f"schedule {self.name!r}: stage_device has {len(self.stage_device)} entries for "
                f"{self.num_stages} stages"
            )
        if any(not 0 <= d < self.num_devices for d in self.stage_device):
            raise ScheduleError(f"schedule {self.name!r}: stage_device {self.stage_device} names a missing device")
        if len(self.device_ops) != self.num_devices:
            raise ScheduleError(
                f"schedule {self.name!r}: {len(self.device_ops)} op lists for {self.num_devices} devices"
            )
        if self.mirrored and (self.num_devices % 2 or self.num_stages != self.num_devices or self.update_every):
            raise ScheduleError(
                f"schedule {self.name!r}: a mirrored schedule is synchronous, with one stage per device and an even "
                f"number of devices; got {self.num_stages} stages on {self.num_devices} devices"
            )

    @property
    def num_chunks(self) -> int:
        """Stages per device (v); 1 for gpipe/1f1b/zb-h*, 2 for zbv/dualpipev."""
        return self.num_stages // self.num_devices

    def op_strings(self) -> list[list[str]]:
        return [[str(o) for o in ops] for ops in self.device_ops]

    # ---- CSV (torch.distributed.pipelining "compute_only" format) ----
    def to_csv(self) -> str:
        if self.asynchronous:
            raise ScheduleError(
                f"{self.name} is asynchronous (weight versions on every op); torch's CSV schedules have none: "
                "export a synchronous schedule"
            )
        if self.mirrored:
            raise ScheduleError(
                f"{self.name} runs each stage on two devices (one per direction); torch's CSV schedules place a stage "
                "on one rank: export a one-direction schedule (e.g. dualpipev)"
            )
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for row in self.op_strings():
            writer.writerow(row)
        return buffer.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, name: str = "csv") -> Schedule:
        """Read one row per device. Stage placement is inferred from where each stage's ops appear; the
        microbatch count is inferred (max index + 1)."""
        rows = [[cell for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
        while rows and not rows[-1]:
            rows.pop()
        if not rows:
            raise FormatError("schedule CSV is empty: expected one row of op strings per device")
        device_ops = tuple(tuple(Op.parse(cell) for cell in row) for row in rows)
        if any(o.version is not None for ops in device_ops for o in ops):
            raise FormatError("schedule CSV ops carry weight versions (e.g. 0F5v2); CSV holds synchronous schedules")
        return _from_device_ops(name, device_ops)

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        data = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "num_devices": self.num_devices,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_device": list(self.stage_device),
            "device_ops": self.op_strings(),
        }
        if self.asynchronous:
            data |= {"update_every": self.update_every, "weight_versions": self.weight_versions}
        if self.mirrored:
            data["mirrored"] = True
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        fields = ["name", "num_devices", "num_stages", "num_microbatches", "stage_device", "device_ops"]
        missing = [f for f in fields if f not in data]
        if missing:
            raise FormatError(f"schedule JSON is missing field(s): {', '.join(missing)}")
        return cls(
            name=str(data["name"]),
            num_devices=int(data["num_devices"]),
            num_stages=int(data["num_stages"]),
            num_microbatches=int(data["num_microbatches"]),
            stage_device=tuple(int(d) for d in data["stage_device"]),
            device_ops=tuple(tuple(Op.parse(s) for s in row) for row in data["device_ops"]),
            update_every=int(data.get("update_every", 0)),
            weight_versions=int(data.get("weight_versions", 1)),
            mirrored=data.get("mirrored", False) is True,
        )


def _from_device_ops(name: str, device_ops: tuple[tuple[Op, ...], ...]) -> Schedule:
    placement: dict[int, int] = {}
    max_mb = -1
    for device, ops in enumerate(device_ops):
        for o in (part for op in ops for part in op.parts):
            if placement.setdefault(o.stage, device) != device:
                raise FormatError(f"schedule CSV puts stage {o.stage} on devices {placement[o.stage]} and {device}")
            max_mb = max(max_mb, o.microbatch)
    num_stages = max(placement, default=-1) + 1
    absent = [s for s in range(num_stages) if s not in placement]
    if absent or num_stages == 0:
        raise FormatError(f"schedule CSV has no ops for stage(s) {absent or [0]}")
    return Schedule(
        name=name,
        num_devices=len(device_ops),
        num_stages=num_stages,
        num_microbatches=max_mb + 1,
        stage_device=tuple(placement[s] for s in range(num_stages)),
        device_ops=device_ops,
    )


def make_schedule(
    name: str,
    num_microbatches: int,
    stage_device: tuple[int, ...],
    device_ops: list[list[Op]],
    *,
    update_every: int = 0,
    weight_versions: int = 1,
    mirrored: bool = False,
) -> Schedule:
    """Build a Schedule from a generator's lists (num_devices/num_stages derived)."""
    return Schedule(
        name=name,
        num_devices=len(device_ops),
        num_stages=len(stage_device),
        num_microbatches=num_microbatches,
        stage_device=tuple(stage_device),
        device_ops=tuple(tuple(ops) for ops in device_ops),
        update_every=update_every,
        weight_versions=weight_versions,
        mirrored=mirrored,
    )


def format_grid(schedule: Schedule, *, marks: set[tuple[int, int]]) -> str:
    """Step (row) x device (column) grid of op strings; (device, step) pairs in `marks` print as `[1F3]!`.
    Long schedules show the rows around the first mark."""
    num_steps = max((len(ops) for ops in schedule.device_ops), default=0)
    focus = min((step for _, step in marks), default=0)
    first = max(0, focus - _GRID_ROWS)
    last = min(num_steps, focus + _GRID_ROWS + 1) if marks else min(num_steps, 2 * _GRID_ROWS)
    cells: list[list[str]] = []
    for step in range(first, last):
        row = [f"step {step}"]
        for device, ops in enumerate(schedule.device_ops):
            text = str(ops[step]) if step < len(ops) else ""
            row.append(f"[{text}]!" if (device, step) in marks else text)
        cells.append(row)
    header = ["", *(f"dev {d}" for d in range(schedule.num_devices))]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *cells]]
    if first > 0:
        lines.insert(1, f"... ({first} earlier steps)")
    if last < num_steps:
        lines.append(f"... ({num_steps - last} later steps)")
    return "\n".join(lines)
