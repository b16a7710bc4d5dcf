"""`pipeplan simulate`: generate a schedule, simulate it and show metrics, a Gantt chart or a ranking."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from pipeplan.console import out, print_json
from pipeplan.options import command
from pipeplan.schedules.render import gantt
from pipeplan.schedules.simulate_options import SimulateOptions
from pipeplan.schedules.uniform import Ranking, simulate_schedules


def _metrics_table(rows: list[dict[str, Any]], *, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    period = any("period_ms" in row for row in rows)  # --post-validate
    columns = ("schedule", "stages", "makespan", *(("period",) if period else ()), "max span", "bubble rate")
    for column in (*columns, "ZB bubble", "peak act."):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for row in rows:
        table.add_row(
            row["schedule"],
            str(row["num_stages"]),
            f"{row['makespan_ms']:.3f}",
            *((f"{row['period_ms']:.3f}" if "period_ms" in row else "-",) if period else ()),
            f"{row['max_span_ms']:.3f}",
            f"{row['bubble_rate']:.1%}",
            f"{row['zb_bubble_ms']:.3f} ({row['zb_bubble_rate']:.1%})",
            f"{row['peak_activations']:.2f}",
        )
    return table


@command(SimulateOptions)
def simulate(options: SimulateOptions) -> None:
    """Simulate a pipeline schedule: makespan, bubbles, peak activations and a Gantt chart.

    Times are per device: with v chunks per device each stage gets T/v. Peak activations count full-slice microbatches
    (F allocates one, I frees --input-grad-frees of it, W the rest).

    The asynchronous schedules (pipedream, pipedream-2bw) simulate a stream of several steps without flushes and
    also print the steady-state time per microbatch and the weight versions each stage holds.

    Example: pipeplan simulate --schedule zb-h1 --stages 4 --microbatches 8 --f 1 --b 1 --w 1
    """
    result = simulate_schedules(options)
    if isinstance(result, Ranking):
        _render_ranking(result, options)
        return
    schedule, timeline, metrics = result.schedule, result.timeline, result.metrics
    if options.json_output:
        print_json(result.to_dict())
        return
    title = f"{options.schedule}: {options.stages} devices, {schedule.num_microbatches} microbatches"
    out.print(_metrics_table([metrics], title=title))
    if schedule.asynchronous:
        out.print(_steady_line(metrics, options.microbatches), highlight=False)
    if "period_ms" in metrics:
        out.print(
            f"post-validated steps: period {metrics['period_ms']:.1f} ms, bubble {metrics['period_bubble_rate']:.2%} "
            f"(one step's makespan {metrics['makespan_ms']:.1f} ms)",
            highlight=False,
        )
    out.print(gantt(timeline, width=out.width))
    if options.trace is not None:
        out.print(f"wrote Chrome trace {options.trace}")


def _steady_line(metrics: dict[str, Any], per_step: int) -> str:
    versions = metrics["weight_versions_per_stage"]
    return (
        f"steady state (no flush): {metrics['steady_microbatch_ms']:.3f} ms per microbatch, "
        f"{metrics['steady_step_ms']:.3f} ms per step of {per_step}; weight versions held per stage: "
        f"{', '.join(map(str, versions))}"
    )


def _render_ranking(ranking: Ranking, options: SimulateOptions) -> None:
    if options.json_output:
        print_json(ranking.to_dict())
        return
    results, skipped = ranking.results, ranking.skipped
    ranked_by = "the period of post-validated steps" if options.post_validate else "makespan"
    title = f"{options.stages} devices, {options.microbatches} microbatches, ranked by {ranked_by}"
    out.print(_metrics_table(results, title=title))
    for row in skipped:
        out.print(f"[dim]skipped {row['schedule']}: {row['reason']}[/]", highlight=False)
