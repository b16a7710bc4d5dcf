"""A plan's `schedule` and `chunks` fields checked against its own op lists and rank map, so an edited field cannot
make `run` execute one schedule while `show`, the exports and the run's prediction describe another: the chunks the
schedule's placement allows, each stage on the device the placement puts it, I/W ops only in a split-backward
schedule, and the op lists of a fixed-order schedule (every one but the cost-driven zb-auto and zbv) generated again
from (schedule, devices, microbatches, chunks; an asynchronous stream's steps) and compared op for op (replicated
stages: as `replicate_paced` expands the generated lists; an overlapped F&B pair and its two halves in order are
the same)"""

from __future__ import annotations

from typing import Any

from pipeplan.errors import FormatError, ScheduleError
from pipeplan.schedules.ops import Op
from pipeplan.schedules.placement import device_stages
from pipeplan.schedules.registry import ScheduleInfo, generate, schedule_info
from pipeplan.schedules.replicate import replicate_paced

_REPLAN = "re-plan (plan.json's schedule and chunks are what its op lists were generated for; do not edit them)"


def check_schedule_fields(plan: Any) -> None:
    """One FormatError where the plan's schedule or chunks disagree with its rank map or op lists."""
    info = schedule_info(plan.schedule)
    try:
        chunks = info.resolve_chunks(plan.chunks)
    except ScheduleError:
        raise FormatError(
            f"plan schedule {plan.schedule} cannot run {plan.chunks} chunk(s) per device (its placement is "
            f"{info.placement}); {_REPLAN}"
        ) from None
    pipe = [rank for rank in plan.ranks if rank.pipeline == 0]
    device_ops = [plan.rank_ops[rank.rank] for rank in pipe]
    kinds = {part.kind for ops in device_ops for text in ops for part in Op.parse(text).parts}
    if not info.split_backward and kinds & {"I", "W"}:
        raise FormatError(
            f"plan schedule {plan.schedule} has no split backward but its op lists run I and W; {_REPLAN}"
        )
    if any(stage.replicas > 1 for stage in plan.stages):
        _check_replicated(plan, info, device_ops)
        return
    num_devices = len(pipe)
    if len(plan.stages) != num_devices * chunks:
        raise FormatError(
            f"plan schedule {plan.schedule} with {chunks} chunk(s) on {num_devices} device(s) has "
            f"{num_devices * chunks} stages, but the plan has {len(plan.stages)}; {_REPLAN}"
        )
    for device, rank in enumerate(pipe):
        expected = sorted(device_stages(info.placement, device, num_devices, chunks))  # (mirrored: both copies)
        if sorted(rank.stages) != expected:
            raise FormatError(
                f"plan rank {rank.rank} holds stages {list(rank.stages)}, but schedule {plan.schedule} with {chunks} "
                f"chunk(s) places stages {list(expected)} on its device; {_REPLAN}"
            )
    if info.cost_driven:  # its order depends on the searched costs: placement and op kinds are what can be checked
        return
    m = plan.training.num_microbatches
    steps = plan.num_op_microbatches // m if info.asynchronous else None  # a stream of whole steps
    regenerated = generate(plan.schedule, num_devices=num_devices, num_microbatches=m, chunks=chunks, steps=steps)
    if [_halves(ops) for ops in regenerated.op_strings()] != [_halves(ops) for ops in device_ops]:
        raise FormatError(
            f"plan op lists are not schedule {plan.schedule}'s for {num_devices} device(s), {m} microbatches and "
            f"{chunks} chunk(s); {_REPLAN}"
        )


def _check_replicated(plan: Any, info: ScheduleInfo, device_ops: list) -> None:
    if not info.replicable:
        raise FormatError(f"plan schedule {plan.schedule} cannot replicate stages, but the plan does; {_REPLAN}")
    m = plan.training.num_microbatches
    schedule = generate(plan.schedule, num_devices=len(plan.stages), num_microbatches=m)
    expanded = replicate_paced(schedule, tuple(stage.replicas for stage in plan.stages))
    if sorted(_halves(row) for row in expanded.op_strings()) != sorted(_halves(ops) for ops in device_ops):
        raise FormatError(f"plan rank_ops do not match schedule {plan.schedule} with replicated stages; {_REPLAN}")


def _halves(ops) -> tuple[str, ...]:
    """An op list with each overlapped F&B pair as its two halves in order (the runtime runs either form)."""
    return tuple(str(part) for text in ops for part in Op.parse(text).parts)
