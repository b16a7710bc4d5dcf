"""Weight versions of asynchronous schedules, read off the op lists (`ops.py` states the rule): which versions each
stage holds after every op, and the checks `validate` runs.

Per stage, in its device's list order: version 0 exists from the start; stage s makes version u+1 as soon as its
last backward op (B, or W when the backward is split) of update group u — microbatches [u*k, (u+1)*k), k =
`update_every` — has run and version u exists. A version is held from when it is made until it is the newest no
longer and no op still to run reads it (ops that already ran hold it through their microbatch's last backward, the
stash; ops still to come hold it too, since the runtime cannot make it again). Checks: every op carries a version
exactly when the schedule is asynchronous; an F reads a version already made; a B, I or W uses its F's version;
a stage never holds more than `weight_versions` versions. Like the activation counts, all of this follows from the
list order alone, so it holds for any op timings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import Op, Schedule, format_grid


class _Stage:
    """One stage's version state while its device's list runs."""

    def __init__(self, readers: Counter[int], num_groups: int, update_every: int) -> None:
        self.readers = readers  # version -> microbatches that read it and whose last backward has not run
        self.pending = [update_every] * num_groups  # backward ops still to run per update group
        self.made = 0  # newest version made
        self.alive = {0} if readers[0] else set()  # made versions some op still reads
        self.forward_version: dict[int, int] = {}

    @property
    def held(self) -> int:
        return len(self.alive) + (self.made not in self.alive)

    def run(self, o: Op, last_backward: bool, update_every: int) -> str | None:
        """Apply op `o`; returns what is wrong with it, or None."""
        v = o.version
        assert v is not None
        if o.kind == "F":
            if v > self.made:
                return f"reads weight version {v} of stage {o.stage}, which is not made yet (newest: {self.made})"
            self.forward_version[o.microbatch] = v
            return None
        used = self.forward_version.get(o.microbatch)
        if used != v:
            return f"uses weight version {v} but its forward {o.stage}F{o.microbatch} used version {used}"
        if last_backward:
            self.readers[v] -= 1
            if not self.readers[v]:
                self.alive.discard(v)
            self.pending[o.microbatch // update_every] -= 1
            while self.made < len(self.pending) and not self.pending[self.made]:
                self.made += 1
                if self.readers[self.made]:
                    self.alive.add(self.made)
        return None


def _last_backward_kind(schedule: Schedule) -> dict[tuple[int, int], str]:
    """(stage, microbatch) -> the kind of its last backward op: W when it is split, else B."""
    found: dict[tuple[int, int], str] = {}
    for ops in schedule.device_ops:
        for o in ops:
            if o.kind in "BW":
                found[(o.stage, o.microbatch)] = o.kind
    return found


def held_versions(schedule: Schedule) -> Iterator[tuple[int, int, Op, int]]:
    """(device, step, op, versions the op's stage holds after it) for every op, device by device; raises
    ScheduleError with a marked grid at the first op breaking the rule. `schedule` must be complete
    (`validate.check_complete`)."""
    tagged = [(d, i) for d, ops in enumerate(schedule.device_ops) for i, o in enumerate(ops) if o.version is not None]
    if not schedule.asynchronous:
        if tagged:
            _fail(schedule, tagged[0], "carries a weight version but the schedule is synchronous (update_every 0)")
        return
    untagged = [(d, i) for d, ops in enumerate(schedule.device_ops) for i, o in enumerate(ops) if o.version is None]
    if untagged:
        _fail(schedule, untagged[0], "carries no weight version but the schedule is asynchronous")
    k = schedule.update_every
    last = _last_backward_kind(schedule)
    for device, ops in enumerate(schedule.device_ops):
        readers: dict[int, Counter[int]] = {}
        for o in ops:
            if o.kind == "F":
                assert o.version is not None  # every op of an asynchronous schedule carries one (checked above)
                readers.setdefault(o.stage, Counter())[o.version] += 1
        stages = {s: _Stage(count, schedule.num_microbatches // k, k) for s, count in readers.items()}
        for step, o in enumerate(ops):
            state = stages[o.stage]
            problem = state.run(o, last[(o.stage, o.microbatch)] == o.kind, k)
            if problem is None and state.held > schedule.weight_versions:
                problem = f"leaves stage {o.stage} holding {state.held} weight versions, over the schedule's bound of "
                problem += f"{schedule.weight_versions}"
            if problem is not None:
                _fail(schedule, (device, step), problem)
            yield device, step, o, state.held


def check_versions(schedule: Schedule) -> tuple[int, ...]:
    """Raise ScheduleError unless the op lists follow the version rule; returns per stage the most weight versions
    it holds at once (1 for synchronous schedules)."""
    most = [1] * schedule.num_stages
    for _, _, o, held in held_versions(schedule):
        most[o.stage] = max(most[o.stage], held)
    return tuple(most)


def _fail(schedule: Schedule, where: tuple[int, int], problem: str) -> None:
    device, step = where
    o = schedule.device_ops[device][step]
    raise ScheduleError(
        f"schedule {schedule.name!r}: op {o} on device {device} at step {step} {problem}\n"
        + format_grid(schedule, marks={where})
    )
