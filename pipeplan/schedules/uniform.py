"""Schedules simulated with uniform per-device costs (`pipeplan simulate`): one schedule's timeline and metrics, or
every schedule ranked by makespan. Memory is counted in full-slice microbatches (unit memory). An asynchronous
schedule (pipedream, pipedream-2bw) is simulated as a stream of several steps; its metrics add the steady state and
the weight versions each stage holds (it is left out of the ranking: a stream has no step makespan)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeplan.errors import ScheduleError
from pipeplan.jsonio import write_json
from pipeplan.schedules.ops import OVERLAP, Schedule
from pipeplan.schedules.period import simulate_steps
from pipeplan.schedules.placement import LOOPED
from pipeplan.schedules.registry import SCHEDULE_NAMES, async_stream_steps, generate, schedule_info, schedule_names
from pipeplan.schedules.render import timeline_to_chrome_trace
from pipeplan.schedules.simulate import StageCosts, Timeline, simulate, stream_step_ms, unit_memory
from pipeplan.schedules.simulate_options import SimulateOptions
from pipeplan.schedules.versions import check_versions


def simulate_uniform(
    name: str, options: SimulateOptions, *, chunks: int | None, overlap_ms: float | None
) -> tuple[Schedule, Timeline]:
    """Generate once with per-device-slice costs split evenly over the chunks each device holds; unit memory.
    `overlap_ms`: every OVERLAP_F_B op's time (refused for a schedule without one)."""
    devices = options.stages
    v = schedule_info(name).resolve_chunks(chunks)
    costs = uniform_costs(options, v, overlap_ms)
    memory = unit_memory(v, input_grad_frees=options.input_grad_frees)
    schedule = generate(
        name,
        num_devices=devices,
        num_microbatches=options.microbatches,
        chunks=chunks,
        costs=costs,
        memory=memory,
        memory_limit=options.memory_limit,
        steps=options.steps if options.steps is not None else async_stream_steps(name, devices, options.microbatches),
        post_validate=options.post_validate,
    )
    if overlap_ms is not None and not any(o.kind == OVERLAP for ops in schedule.device_ops for o in ops):
        paired = ", ".join(schedule_names(overlapped_pairs=True))
        raise ScheduleError(f"--overlap-ms applies to schedules with overlapped F&B ops ({paired}), not {name}")
    return schedule, simulate(schedule, costs, memory)


def uniform_costs(options: SimulateOptions, chunks: int, overlap_ms: float | None = None) -> StageCosts:
    """Per stage: the per-device-slice costs split evenly over the `chunks` each device holds; `overlap_ms`: every
    OVERLAP_F_B op's time."""
    v = chunks
    return StageCosts(
        forward_ms=options.f / v,
        input_grad_ms=options.b / v,
        weight_grad_ms=options.w / v,
        comm_ms=options.comm,
        overlap_ms=overlap_ms,
    )


def post_validated(schedule: Schedule, options: SimulateOptions) -> dict[str, Any]:
    """--post-validate: the period of steps each device starts at its own end (`schedules.period`), its bubble."""
    costs = uniform_costs(options, schedule.num_chunks, options.overlap_ms)
    steady = simulate_steps(schedule, costs, post_validate=True)
    return {"period_ms": steady.period_ms, "period_bubble_rate": steady.bubble_rate(), "period_steps": steady.steps}


def schedule_metrics(schedule: Schedule, timeline: Timeline, per_step: int | None = None) -> dict[str, Any]:
    data = timeline.metrics()
    data["peak_activations"] = max(timeline.peak_memory_bytes)
    data["peak_memory_bytes"] = data.pop("peak_memory_bytes")  # per device, in full-slice microbatches
    data["num_stages"] = schedule.num_stages
    data["num_microbatches"] = schedule.num_microbatches
    if schedule.asynchronous and per_step:  # a stream: its steady state, and the weight copies it stashes
        step_ms = stream_step_ms(timeline, per_step)
        data |= {"steady_step_ms": step_ms, "steady_microbatch_ms": step_ms / per_step}
        data["weight_versions_per_stage"] = list(check_versions(schedule))
    return data


def simulate_one(options: SimulateOptions) -> tuple[Schedule, Timeline]:
    """--schedule's op lists and timeline; writes the timeline as a Chrome trace when --trace is given."""
    assert options.schedule is not None  # SimulateOptions requires it without --compare
    schedule, timeline = simulate_uniform(
        options.schedule, options, chunks=options.chunks, overlap_ms=options.overlap_ms
    )
    if options.trace is not None:
        write_json(options.trace, timeline_to_chrome_trace(timeline.rows()))
    return schedule, timeline


def compare_schedules(options: SimulateOptions) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every schedule's metrics, fastest first (ties: less memory), and the schedules these options rule out."""
    results, skipped = [], []
    for name in SCHEDULE_NAMES:
        if schedule_info(name).asynchronous:  # a stream without a flush: no step makespan to rank
            skipped.append({"schedule": name, "reason": "asynchronous: simulate it with --schedule to see its stream"})
            continue
        chunks = options.chunks if schedule_info(name).placement == LOOPED else None
        overlap_ms = options.overlap_ms if schedule_info(name).overlapped_pairs else None
        try:
            schedule, timeline = simulate_uniform(name, options, chunks=chunks, overlap_ms=overlap_ms)
        except ScheduleError as exc:
            skipped.append({"schedule": name, "reason": str(exc)})
            continue
        metrics = schedule_metrics(schedule, timeline)
        results.append(metrics | post_validated(schedule, options) if options.post_validate else metrics)
    ranked_by = "period_ms" if options.post_validate else "makespan_ms"
    results.sort(key=lambda row: (row[ranked_by], row["peak_activations"]))
    if not results:
        raise ScheduleError(f"no schedule could be simulated; {skipped[0]['schedule']}: {skipped[0]['reason']}")
    return results, skipped


@dataclass(frozen=True)
class Simulation:
    """One schedule simulated (`pipeplan simulate --schedule NAME`): its op lists, timeline and metrics."""

    schedule: Schedule
    timeline: Timeline
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """What `--json` prints: the metrics, each stage's device and each device's op list."""
        return {
            **self.metrics,
            "stage_device": list(self.schedule.stage_device),
            "device_ops": self.schedule.op_strings(),
        }


@dataclass(frozen=True)
class Ranking:
    """Every schedule simulated (`--compare`): metrics fastest first, and the schedules left out with why."""

    results: list[dict[str, Any]]
    skipped: list[dict[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return {"results": self.results, "skipped": self.skipped}


def simulate_schedules(options: SimulateOptions) -> Simulation | Ranking:
    """`pipeplan simulate` (and `pipeplan.simulate`): a Ranking with --compare, else one Simulation."""
    if options.compare:
        return Ranking(*compare_schedules(options))
    schedule, timeline = simulate_one(options)
    metrics = schedule_metrics(schedule, timeline, options.microbatches)
    if options.post_validate and not schedule.asynchronous:
        metrics |= post_validated(schedule, options)
    return Simulation(schedule, timeline, metrics)
