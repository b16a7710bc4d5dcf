"""`pipeplan show` and `pipeplan export`: read a plan.json -> render or convert."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeplan.artifact.export_formats import EXPORT_FORMATS
from pipeplan.console import err, out, print_json
from pipeplan.paths import check_output_file


def show(
    plan_file: Path = typer.Argument(..., help="A plan.json written by `pipeplan plan`."),
    json_output: bool = typer.Option(False, "--json", help="Print only the summary as JSON."),
) -> None:
    """Print a plan's summary, stage table, alternatives and predicted Gantt chart again.

    Example: pipeplan show plan/plan.json
    """
    from pipeplan.artifact.plan import Plan  # the artifact room: imported when the command runs (not for --help)
    from pipeplan.artifact.summary import render_summary, summary_dict
    from pipeplan.artifact.timing import plan_steps_timeline

    loaded = Plan.load(plan_file)
    timeline = plan_steps_timeline(loaded)
    if json_output:
        print_json(summary_dict(loaded, plan_dir=str(plan_file.parent), timeline=timeline))
        return
    render_summary(out, loaded, timeline=timeline)


def export(
    plan_file: Path = typer.Argument(..., help="A plan.json written by `pipeplan plan`."),
    fmt: str = typer.Option("torch-csv", "--format", "-f", help=f"One of: {', '.join(EXPORT_FORMATS)}."),
    output: str = typer.Option(..., "--output", "-o", help="File to write."),
) -> None:
    """Write a plan in another tool's format.

    torch-csv: the "compute_only" CSV schedule torch.distributed.pipelining's PipelineScheduleMulti._load_csv
    reads, one row per rank of one pipeline (plans with replicated stages cannot be exported: torch runs a stage
    on one rank). megatron: Megatron-LM arguments, one flag per line, with a `#` comment for each plan setting
    Megatron cannot express and each stage's module FQNs, and Megatron-Core's config keyword arguments beside it
    (OUT_STEM_mcore.py). torchtitan: a torchtitan 0.2 job config (TOML); torchtitan-0.3: torchtitan 0.3's
    command-line overrides; both name the stages in torchtitan's model (llama3, deepseek_v3; an hf: causal LM:
    0.3's transformers_modeling_backend; a factory: its own modules) and point at the plan's CSV schedule written
    beside them (OUT_STEM.csv). docs/engines.md: from here to a torchrun / SLURM launch.

    Example: pipeplan export plan/plan.json --format megatron -o megatron.args

    Example: pipeplan export plan/plan.json --format torchtitan-0.3 -o job.args
    """
    from pipeplan.artifact.exports import export_plan
    from pipeplan.artifact.plan import Plan  # the artifact room: imported when the command runs (not for --help)

    lines, notes = export_plan(Plan.load(plan_file), fmt, Path(check_output_file(output, "--output")))
    for note in notes:
        err.print(note, markup=False, highlight=False)
    for line in lines:
        out.print(line, markup=False, highlight=False)
