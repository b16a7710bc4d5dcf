"""`pipeplan simulate`: generate a schedule, simulate it and show metrics, a Gantt chart or a ranking."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from pipeplan.console import out, print_json, warn
from pipeplan.errors import ConfigError, ScheduleError
from pipeplan.jsonio import write_json
from pipeplan.paths import check_output_file
from pipeplan.schedules.dualpipev import fused_pairs
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.placement import LOOPED
from pipeplan.schedules.registry import SCHEDULE_NAMES, generate, schedule_info
from pipeplan.schedules.render import gantt, timeline_to_chrome_trace
from pipeplan.schedules.simulate import PAPER_INPUT_GRAD_FREES, StageCosts, Timeline, unit_memory
from pipeplan.schedules.simulate import simulate as simulate_schedule


def _run(
    name: str,
    *,
    devices: int,
    microbatches: int,
    chunks: int | None,
    f: float,
    b: float,
    w: float,
    comm: float,
    memory_limit: float | None,
    input_grad_frees: float,
    overlap_ms: float | None,
) -> tuple[Schedule, Timeline]:
    """Generate once with per-device-slice costs split evenly over the chunks each device holds; unit memory."""
    if f + b + w <= 0:
        raise ConfigError("--f, --b and --w are all 0: give at least one op a time > 0")
    v = schedule_info(name).resolve_chunks(chunks)
    costs = StageCosts(forward_ms=f / v, input_grad_ms=b / v, weight_grad_ms=w / v, comm_ms=comm)
    memory = unit_memory(v, input_grad_frees=input_grad_frees)
    schedule = generate(
        name,
        num_devices=devices,
        num_microbatches=microbatches,
        chunks=chunks,
        costs=costs,
        memory=memory,
        memory_limit=memory_limit,
    )
    fused = None if overlap_ms is None else fused_pairs(schedule, overlap_ms)
    return schedule, simulate_schedule(schedule, costs, memory, fused=fused)


def _metrics(schedule: Schedule, timeline: Timeline) -> dict[str, Any]:
    data = timeline.metrics()
    data["peak_activations"] = max(timeline.peak_memory_bytes)
    data["peak_memory_bytes"] = data.pop("peak_memory_bytes")  # per device, in full-slice microbatches
    data["num_stages"] = schedule.num_stages
    data["num_microbatches"] = schedule.num_microbatches
    return data


def _metrics_table(rows: list[dict[str, Any]], *, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("schedule", "stages", "makespan", "max span", "bubble rate", "ZB bubble", "peak act."):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for row in rows:
        table.add_row(
            row["schedule"],
            str(row["num_stages"]),
            f"{row['makespan_ms']:.3f}",
            f"{row['max_span_ms']:.3f}",
            f"{row['bubble_rate']:.1%}",
            f"{row['zb_bubble_ms']:.3f} ({row['zb_bubble_rate']:.1%})",
            f"{row['peak_activations']:.2f}",
        )
    return table


def simulate(
    schedule: str = typer.Option(None, "--schedule", "-s", help=f"One of: {', '.join(SCHEDULE_NAMES)}."),
    stages: int = typer.Option(..., "--stages", "-p", help="Pipeline devices P."),
    microbatches: int = typer.Option(..., "--microbatches", "-m", help="Microbatches per step M."),
    chunks: int = typer.Option(None, "--chunks", "-v", help="Stages per device (interleaved; default per schedule)."),
    f: float = typer.Option(1.0, "--f", help="Forward ms of one device's model slice."),
    b: float = typer.Option(1.0, "--b", help="Input-gradient (I) ms of one device's slice; full B = I + W."),
    w: float = typer.Option(1.0, "--w", help="Weight-gradient (W) ms of one device's slice."),
    comm: float = typer.Option(0.0, "--comm", help="Transfer ms across each device boundary."),
    memory_limit: float = typer.Option(
        None,
        "--memory-limit",
        help="Max live activations per device, in microbatches of a device's full slice (zb-auto is generated "
        "under it, default p = 1F1B's; other schedules are checked against it). E.g. --memory-limit 8.",
    ),
    input_grad_frees: float = typer.Option(
        PAPER_INPUT_GRAD_FREES,
        "--input-grad-frees",
        help="Fraction of a microbatch's activations the input-gradient pass I frees (W frees the rest); "
        "0.5 is the Zero Bubble paper's setting. E.g. --input-grad-frees 0.4.",
    ),
    overlap_ms: float = typer.Option(
        None,
        "--overlap-ms",
        help="dualpipev: time each overlapped F&B pair as one unit of this many ms, as DualPipe's runtime runs it "
        "(default: the two halves one after the other, as `pipeplan run` executes them). E.g. --overlap-ms 2.5.",
    ),
    compare: bool = typer.Option(False, "--compare", help="Simulate every schedule and rank by makespan."),
    json_output: bool = typer.Option(False, "--json", help="Print only JSON (metrics + op lists)."),
    trace: str = typer.Option(None, "--trace", help="Write a Chrome trace (chrome://tracing, Perfetto)."),
) -> None:
    """Simulate a pipeline schedule: makespan, bubbles, peak activations and a Gantt chart.

    Times are per device: with v chunks per device each stage gets T/v. Peak activations count full-slice microbatches
    (F allocates one, I frees --input-grad-frees of it, W the rest).

    Example: pipeplan simulate --schedule zb-h1 --stages 4 --microbatches 8 --f 1 --b 1 --w 1
    """
    trace = check_output_file(trace, "--trace") if trace is not None else None
    options = dict(
        devices=stages, microbatches=microbatches, chunks=chunks, f=f, b=b, w=w, comm=comm,
        memory_limit=memory_limit, input_grad_frees=input_grad_frees, overlap_ms=overlap_ms,
    )  # fmt: skip
    if compare:
        if trace is not None:
            warn("--trace is ignored with --compare (trace one --schedule at a time)")
        _compare(options, json_output=json_output, highlight=schedule)
        return
    if schedule is None:
        raise typer.BadParameter("pass --schedule NAME (or --compare)", param_hint="--schedule")
    plan, timeline = _run(schedule, **options)
    if trace is not None:
        write_json(trace, timeline_to_chrome_trace(timeline.rows()))
    metrics = _metrics(plan, timeline)
    if json_output:
        print_json({**metrics, "stage_device": list(plan.stage_device), "device_ops": plan.op_strings()})
        return
    out.print(_metrics_table([metrics], title=f"{schedule}: {stages} devices, {microbatches} microbatches"))
    out.print(gantt(timeline, width=out.width))
    if trace is not None:
        out.print(f"wrote Chrome trace {trace}")


def _compare(options: dict[str, Any], *, json_output: bool, highlight: str | None) -> None:
    results, skipped = [], []
    for name in SCHEDULE_NAMES:
        try:
            per_name = {"chunks": options["chunks"] if schedule_info(name).placement == LOOPED else None}
            if name != "dualpipev":
                per_name["overlap_ms"] = None
            plan, timeline = _run(name, **{**options, **per_name})
        except ScheduleError as exc:
            skipped.append({"schedule": name, "reason": str(exc)})
            continue
        results.append(_metrics(plan, timeline))
    results.sort(key=lambda row: (row["makespan_ms"], row["peak_activations"]))
    if not results:
        raise ScheduleError(f"no schedule could be simulated; {skipped[0]['schedule']}: {skipped[0]['reason']}")
    if json_output:
        print_json({"results": results, "skipped": skipped})
        return
    title = f"{options['devices']} devices, {options['microbatches']} microbatches, ranked by makespan"
    out.print(_metrics_table(results, title=title))
    for row in skipped:
        out.print(f"[dim]skipped {row['schedule']}: {row['reason']}[/]", highlight=False)
    if highlight:
        schedule_info(highlight)  # every known schedule is in `results` or `skipped`; an unknown one raises
