"""Stage replication inside one pipeline (PipeDream's non-uniform replication; Narayanan et al., "PipeDream:
Generalized Pipeline Parallelism for DNN Training", SOSP 2019): a stage with `r` replicas runs on `r` devices, and
replica `j` handles the microbatches with `mb % r == j` (PipeDream's round-robin).

`replicate(schedule, replicas)` expands a one-stage-per-device schedule (gpipe, 1f1b, zb-h1, ...) into per-device op
lists: the lists of stage `s`'s replicas are that stage's list filtered to their microbatches. Each list is a
subsequence of the original, so any execution order of the original restricted to the new lists is still valid —
the expansion is deadlock-free whenever the original is. But it starves replicas: stage s of 1F1B keeps S - s
microbatches in flight, so each of its r replicas keeps about (S - s) / r — too few to cover the round trip through
the later stages, whose replicas run every op at full time.

`replicate_paced(schedule, replicas)` (what the planner uses) paces each replica like a device of a pipeline of
P = sum(replicas) devices: replica j of stage s runs, on its own microbatches j, j + r, j + 2r, ..., the op pattern
of the first device of schedule `name` on k_s = max(1, round(D_s / r_s)) devices, D_s being the number of devices
from stage s to the end: the round trip from stage s spans about D_s / r_s of its op times when stages are balanced
per device, and the first of k devices keeps the in-flight work that covers a round trip through k (1F1B: k
microbatches). Rounding, not ceil: a replica's own microbatches arrive r_s apart, so one more warm-up forward
makes it wait for a late arrival before its first backward (measured: 4.9x the bubble-free step for replicas
16,2,2,2,2,35,5 with ceil, 1.13x with rounding). Without
replication it is the schedule itself. If the paced lists could deadlock they are not used:
`replicate` of the original is returned instead.

Timing: `simulate_expanded` times the expanded per-replica lists themselves (what `run` executes), every op at its
full single-device time; a transfer is charged on every cross-stage dependency (replicas of different stages are
different devices). Only fixed-order schedules are replicated, so the original is regenerated from its name alone.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.errors import ScheduleError
from pipeplan.schedules.engine import execute
from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.registry import generate
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline, build_timeline, op_durations
from pipeplan.schedules.validate import check_complete


@dataclass(kw_only=True, frozen=True)
class ReplicatedSchedule:
    """`device_ops[d]` runs on pipeline device `d`, which holds replica `device_replica[d]` of `device_stage[d]`."""

    name: str
    num_microbatches: int
    replicas: tuple[int, ...]  # per stage
    device_stage: tuple[int, ...]
    device_replica: tuple[int, ...]
    device_ops: tuple[tuple[Op, ...], ...]

    @property
    def num_devices(self) -> int:
        return len(self.device_ops)

    def op_strings(self) -> list[list[str]]:
        return [[str(o) for o in ops] for ops in self.device_ops]


def replicate(schedule: Schedule, replicas: Sequence[int]) -> ReplicatedSchedule:
    """Expand `schedule` (one stage per device) so stage `s` runs on `replicas[s]` consecutive devices."""
    replicas = tuple(int(r) for r in replicas)
    if schedule.asynchronous and any(r > 1 for r in replicas):
        raise ScheduleError(
            f"{schedule.name} is asynchronous: its stages run without replicas (use data-parallel pipelines)"
        )
    if schedule.num_stages != schedule.num_devices:
        raise ScheduleError(f"replicated stages need one stage per device; {schedule.name} has chunks > 1")
    if any(o.halves is not None for ops in schedule.device_ops for o in ops):
        raise ScheduleError(f"{schedule.name} overlaps F&B pairs of two stages in one op: it runs without replicas")
    if len(replicas) != schedule.num_stages or any(r < 1 for r in replicas):
        raise ScheduleError(f"replicas {list(replicas)} must give >= 1 replica to each of {schedule.num_stages} stages")
    if any(r > schedule.num_microbatches for r in replicas):
        raise ScheduleError(
            f"a stage with {max(replicas)} replicas needs at least that many microbatches; "
            f"got {schedule.num_microbatches} (raise the global batch size or lower the replicas)"
        )
    device_stage: list[int] = []
    device_replica: list[int] = []
    device_ops: list[tuple[Op, ...]] = []
    for stage, count in enumerate(replicas):
        ops = schedule.device_ops[schedule.stage_device[stage]]
        for replica in range(count):
            device_stage.append(stage)
            device_replica.append(replica)
            device_ops.append(tuple(o for o in ops if o.microbatch % count == replica))
    expanded = ReplicatedSchedule(
        name=schedule.name,
        num_microbatches=schedule.num_microbatches,
        replicas=replicas,
        device_stage=tuple(device_stage),
        device_replica=tuple(device_replica),
        device_ops=tuple(device_ops),
    )
    check_deadlock_free(expanded)
    return expanded


def replicate_paced(schedule: Schedule, replicas: Sequence[int]) -> ReplicatedSchedule:
    """Per-replica op lists paced for the pipeline's device count (module docstring); `schedule` is the fixed-order
    one-stage-per-device schedule (named by its generator) the replicas come from."""
    plain = replicate(schedule, replicas)
    replicas, name, num_microbatches = plain.replicas, schedule.name, schedule.num_microbatches
    if all(r == 1 for r in replicas):
        return plain
    device_ops: list[tuple[Op, ...]] = []
    for stage, count in enumerate(replicas):
        depth = max(1, (2 * sum(replicas[stage:]) + count) // (2 * count))  # round(D_s / r_s), halves up
        for replica in range(count):
            mine = range(replica, num_microbatches, count)
            pattern = _pattern(name, depth, len(mine))
            device_ops.append(tuple(Op(o.kind, stage, mine[o.microbatch]) for o in pattern))
    paced = ReplicatedSchedule(
        name=name,
        num_microbatches=num_microbatches,
        replicas=replicas,
        device_stage=plain.device_stage,
        device_replica=plain.device_replica,
        device_ops=tuple(device_ops),
    )
    try:
        check_deadlock_free(paced)
    except ScheduleError:
        return plain
    return paced


@functools.lru_cache(maxsize=256)
def _pattern(name: str, num_devices: int, num_microbatches: int) -> tuple[Op, ...]:
    """The first device's op list of `name` on `num_devices` devices (stage 0, microbatches 0..m-1)."""
    return generate(name, num_devices=num_devices, num_microbatches=num_microbatches).device_ops[0]


def check_deadlock_free(expanded: ReplicatedSchedule) -> None:
    """Raise ScheduleError if the expanded lists are incomplete or deadlock (they never should; this guards the
    invariant). Runs the completeness check and the timing engine directly (validate's placement check would
    reject a stage on several devices); with zero durations the `stage_device` given (each stage's first replica)
    only decides comm charges, which are unused."""
    first_device = {s: d for d, s in reversed(list(enumerate(expanded.device_stage)))}
    probe = Schedule(
        name=expanded.name,
        num_devices=expanded.num_devices,
        num_stages=len(expanded.replicas),
        num_microbatches=expanded.num_microbatches,
        stage_device=tuple(first_device[s] for s in range(len(expanded.replicas))),
        device_ops=expanded.device_ops,
    )
    execute(probe, _backward_kinds(probe))


def simulate_expanded(probe: Schedule, costs: StageCosts, memory: MemoryCosts) -> Timeline:
    """Time per-device op lists in which a stage may run on several devices (`probe.stage_device[s]`: any one of
    them, used only to tell that another stage's device is a different one). Dependencies and transfers as in
    `simulate`; `memory.static_bytes` per device."""
    starts, ends = time_expanded(probe, costs)
    return build_timeline(probe, starts, ends, memory)


def time_expanded(
    probe: Schedule, costs: StageCosts, ready: Sequence[float] | None = None
) -> tuple[list[list[float]], list[list[float]]]:
    """`simulate_expanded`'s start and end times, each device starting at `ready[d]` (default 0)."""
    cost = costs.per_stage(probe.num_stages)
    return execute(probe, _backward_kinds(probe), op_ms=op_durations(cost), comm_ms=cost.comm_ms, ready=ready)


def _backward_kinds(probe: Schedule) -> bytearray:
    ops = itertools.chain.from_iterable(probe.device_ops)
    return check_complete(ops, probe.num_stages, probe.num_microbatches)
