"""Where one pipeline's stages and ops land: its devices (from a schedule, expanded for replicated stages), the op
lists each runs, and their timing — one step (`simulate_layout`), or steps from each device's ready time
(`layout_steps`), transfers blocking their senders unless overlapped (`transfer_costs`). A plan tiles this layout
`data_parallel` times over its ranks (`artifact.ranks.rank_infos`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeplan.costs.overlap import Overlap, blocking_transfers
from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.period import LayoutSteps, step_timer
from pipeplan.schedules.placement import MIRRORED
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.replicate import replicate_paced, simulate_expanded, time_expanded
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline, simulate


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """One pipeline: per pipeline device, the stages it holds (chunk order), its replica index and its op list."""

    device_stages: tuple[tuple[int, ...], ...]
    device_replica: tuple[int, ...]
    device_ops: tuple[tuple[str, ...], ...]
    # made from a schedule: `device_ops` as Ops, and the schedule itself when no stage is replicated (the lists are
    # its own), so timing it again reuses its checks (`Schedule.checked_backward_kinds`)
    ops: tuple[tuple[Op, ...], ...] | None = field(default=None, compare=False, repr=False)
    schedule: Schedule | None = field(default=None, compare=False, repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.device_stages)

    def op_lists(self) -> tuple[tuple[Op, ...], ...]:
        """`device_ops` as Ops."""
        if self.ops is not None:
            return self.ops
        return tuple(tuple(Op.parse(text) for text in ops) for ops in self.device_ops)

    def stage_devices(self, stage: int) -> tuple[int, ...]:
        """Pipeline devices holding `stage` (one per replica; a mirrored schedule's two copies)."""
        return tuple(d for d, stages in enumerate(self.device_stages) if stage in stages)

    def placed_as_partitioned(self, stage: int, devices: tuple[int, ...]) -> bool:
        """Whether `stage` is held where a partition put it on `devices` (a mirrored schedule's: there first,
        for direction 0, and on the mirror device)."""
        held = self.stage_devices(stage)
        mirrored = len(devices) == 1 and len(held) == 2 and self.device_stages[devices[0]][0] == stage
        return held == devices or mirrored


def pipeline_layout(
    schedule: Schedule, replicas: tuple[int, ...], stage_devices: tuple[tuple[int, ...], ...] | None = None
) -> PipelineLayout:
    """Layout of `schedule`; stages with more than one replica are expanded (pipeplan.schedules.replicate's
    `replicate_paced`: each replica paced like a device of a pipeline as long as this one).
    `stage_devices[s]` (default: consecutive devices in stage order) names the pipeline devices of stage s's
    replicas, replica j on `stage_devices[s][j]` — e.g. the partitioner's placement across nodes."""
    if any(r > 1 for r in replicas):
        expanded = replicate_paced(schedule, replicas)
        slots = stage_devices or _consecutive(replicas)
        assert [len(devices) for devices in slots] == list(replicas), "one device per replica"
        order = sorted(
            range(expanded.num_devices), key=lambda i: slots[expanded.device_stage[i]][expanded.device_replica[i]]
        )
        assert [slots[expanded.device_stage[i]][expanded.device_replica[i]] for i in order] == list(range(len(order)))
        rows = expanded.op_strings()
        return PipelineLayout(
            device_stages=tuple((expanded.device_stage[i],) for i in order),
            device_replica=tuple(expanded.device_replica[i] for i in order),
            device_ops=tuple(tuple(rows[i]) for i in order),
            ops=tuple(tuple(expanded.device_ops[i]) for i in order),
        )
    return PipelineLayout(
        device_stages=tuple(schedule.device_stages(d) for d in range(schedule.num_devices)),
        device_replica=(0,) * schedule.num_devices,
        device_ops=tuple(tuple(row) for row in schedule.op_strings()),
        ops=schedule.device_ops,
        schedule=schedule,
    )


def _consecutive(replicas: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    starts = [sum(replicas[:s]) for s in range(len(replicas))]
    return tuple(tuple(range(start, start + r)) for start, r in zip(starts, replicas))


def simulate_layout(
    layout: PipelineLayout, name: str, num_stages: int, num_microbatches: int, costs: StageCosts, memory: MemoryCosts
) -> Timeline:
    """Time the op lists one pipeline runs (`layout.device_ops`, device = pipeline device): the step the search
    predicts, `show` draws and `run` is compared with — for an asynchronous schedule the stream it steps through
    (`schedules.simulate.stream_step_ms`). `costs`: one op's time on one device per stage and the transfer per
    boundary; `memory.static_bytes` per pipeline device."""
    schedule = layout_schedule(layout, name, num_stages, num_microbatches)
    if schedule.mirrored or all(len(layout.stage_devices(s)) == 1 for s in range(num_stages)):
        return simulate(schedule, costs, memory)
    return simulate_expanded(schedule, costs, memory)


def layout_steps(
    layout: PipelineLayout, name: str, num_stages: int, num_microbatches: int, costs: StageCosts
) -> LayoutSteps:
    """One step of `layout`'s op lists timed from each device's ready time (`schedules.period`), by the engine
    `simulate_layout` uses."""
    schedule = layout_schedule(layout, name, num_stages, num_microbatches)
    if schedule.mirrored or all(len(layout.stage_devices(s)) == 1 for s in range(num_stages)):
        return LayoutSteps(schedule, step_timer(schedule, costs))
    return LayoutSteps(schedule, lambda ready: time_expanded(schedule, costs, ready))


def layout_schedule(layout: PipelineLayout, name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """`layout`'s op lists as a Schedule (an asynchronous one's stream with its version rule); a stage on several
    devices is placed on its first (`replicate.simulate_expanded` reads placements only to tell devices apart),
    a mirrored schedule's on its direction-0 device (each device's first stage)."""
    device_ops = layout.op_lists()
    mirrored = schedule_info(name).placement == MIRRORED
    first_device = {}
    for device, stages in reversed(list(enumerate(layout.device_stages))):
        for stage in stages[:1] if mirrored else stages:
            first_device[stage] = device
    stream: dict[str, int] = {"num_microbatches": num_microbatches}
    info = schedule_info(name)
    if info.asynchronous:  # the version rule of `name` over the stream
        total = 1 + max(o.microbatch for ops in device_ops for o in ops)
        every, versions = info.update_every(num_microbatches), info.weight_versions(layout.num_devices)
        stream = dict(num_microbatches=total, update_every=every, weight_versions=versions)
    schedule = Schedule(
        name=name,
        num_devices=layout.num_devices,
        num_stages=num_stages,
        stage_device=tuple(first_device[s] for s in range(num_stages)),
        device_ops=device_ops,
        mirrored=mirrored,
        **stream,
    )
    return layout.schedule if schedule == layout.schedule else schedule  # the same op lists: its checks are done


def transfer_costs(costs: StageCosts, pipe: PipelineLayout, overlap: Overlap) -> StageCosts:
    """`costs` as a step runs them on `pipe`: without `overlap.p2p` pipeline transfers block their senders where the
    two stages' devices differ (`costs.overlap.blocking_transfers`); the search and a plan's timing both call it."""
    if overlap.p2p:
        return costs
    num_stages = 1 + max(s for stages in pipe.device_stages for s in stages)
    return blocking_transfers(
        costs, [pipe.stage_devices(s) != pipe.stage_devices(s + 1) for s in range(num_stages - 1)]
    )
