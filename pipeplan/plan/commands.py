"""`pipeplan show` and `pipeplan export`: read a plan.json -> render or convert."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeplan.console import err, out, print_json
from pipeplan.errors import ConfigError
from pipeplan.jsonio import atomic_write_text
from pipeplan.paths import check_output_file
from pipeplan.plan.plan import Plan
from pipeplan.plan.summary import render_summary, summary_dict
from pipeplan.plan.timing import plan_schedule, plan_timeline
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.validate import validate

EXPORT_FORMATS = ("torch-csv",)


def show(
    plan_file: Path = typer.Argument(..., help="A plan.json written by `pipeplan plan`."),
    json_output: bool = typer.Option(False, "--json", help="Print only the summary as JSON."),
) -> None:
    """Print a plan's summary, stage table, alternatives and predicted Gantt chart again.

    Example: pipeplan show plan/plan.json
    """
    loaded = Plan.load(plan_file)
    if json_output:
        print_json(summary_dict(loaded, plan_dir=str(plan_file.parent)))
        return
    render_summary(out, loaded, timeline=plan_timeline(loaded))


def export(
    plan_file: Path = typer.Argument(..., help="A plan.json written by `pipeplan plan`."),
    fmt: str = typer.Option("torch-csv", "--format", "-f", help=f"One of: {', '.join(EXPORT_FORMATS)}."),
    output: str = typer.Option(..., "--output", "-o", help="File to write."),
) -> None:
    """Write a plan's per-rank op lists in another tool's format.

    torch-csv: the "compute_only" CSV schedule torch.distributed.pipelining's PipelineScheduleMulti._load_csv
    reads, one row per rank of one pipeline (plans with replicated stages cannot be exported: torch runs a stage
    on one rank).

    Example: pipeplan export plan/plan.json --format torch-csv -o schedule.csv
    """
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; choose from: {', '.join(EXPORT_FORMATS)}")
    output = check_output_file(output, "--output")
    loaded = Plan.load(plan_file)
    if schedule_info(loaded.schedule).asynchronous:
        raise ConfigError(
            f"torch.distributed.pipelining has no asynchronous schedules (weight versions, no flush); {loaded.schedule}"
            " plans run with `pipeplan run` only"
        )
    if any(stage.replicas > 1 for stage in loaded.stages):
        raise ConfigError(
            "torch.distributed.pipelining runs each stage on one rank, but this plan replicates stages; "
            "re-plan with --no-replication to export it"
        )
    schedule: Schedule = plan_schedule(loaded)
    validate(schedule)  # an op list that cannot run (deadlock, B before F) is not exported
    atomic_write_text(output, schedule.to_csv())
    if loaded.training.data_parallel > 1:
        err.print(
            f"wrote pipeline 0's {schedule.num_devices} ranks; "
            f"all {loaded.training.data_parallel} pipelines run the same lists"
        )
    out.print(f"wrote {output}")
