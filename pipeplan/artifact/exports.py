"""`pipeplan export`: a plan in another tool's format. torch-csv: the per-rank op lists as the "compute_only" CSV
torch.distributed.pipelining's PipelineScheduleMulti._load_csv reads; megatron: Megatron-LM arguments and, beside
them, Megatron-Core's config keyword arguments (plan.export_megatron); torchtitan / torchtitan-0.3: a torchtitan
0.2 job config (TOML) or 0.3 command-line arguments, with the CSV schedule beside it (plan.export_torchtitan)."""

from __future__ import annotations

from pathlib import Path

from pipeplan.artifact.export_formats import EXPORT_FORMATS, TORCHTITAN_FORMATS
from pipeplan.artifact.export_megatron import megatron_export
from pipeplan.artifact.export_torchtitan import torchtitan_export
from pipeplan.artifact.plan import Plan
from pipeplan.artifact.timing import plan_schedule
from pipeplan.errors import ConfigError
from pipeplan.jsonio import atomic_write_text
from pipeplan.paths import check_replaceable
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.validate import validate


def torch_csv(plan: Plan) -> str:
    """Pipeline 0's op lists as torch's CSV schedule; ConfigError for what torch cannot run."""
    if schedule_info(plan.schedule).asynchronous:
        raise ConfigError(
            f"torch.distributed.pipelining has no asynchronous schedules (weight versions, no flush); {plan.schedule}"
            " plans run with `pipeplan run` only"
        )
    if any(stage.replicas > 1 for stage in plan.stages):
        raise ConfigError(
            "torch.distributed.pipelining runs each stage on one rank, but this plan replicates stages; "
            "re-plan with --parallel replicate=off to export it"
        )
    schedule: Schedule = plan_schedule(plan)
    validate(schedule)  # an op list that cannot run (deadlock, B before F) is not exported
    return schedule.to_csv()


def export_plan(plan: Plan, fmt: str, output: Path) -> tuple[list[str], list[str]]:
    """Write `plan` to `output` in `fmt`; (lines for stdout, notes for stderr)."""
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; choose from: {', '.join(EXPORT_FORMATS)}")
    refusal = schedule_info(plan.schedule).not_exportable
    if refusal:  # (dualpipe: torch, torchtitan and Megatron-LM place each stage on one rank)
        raise ConfigError(f"cannot export a {plan.schedule} plan as {fmt}: {refusal}")
    notes: list[str] = []
    if fmt == "torch-csv":
        atomic_write_text(output, torch_csv(plan))
        if plan.training.data_parallel > 1:
            notes.append(
                f"wrote pipeline 0's {len(plan.stages) // plan.chunks} ranks; "
                f"all {plan.training.data_parallel} pipelines run the same lists"
            )
        return [f"wrote {output}"], notes
    if fmt in TORCHTITAN_FORMATS:
        return _write_torchtitan(plan, output, TORCHTITAN_FORMATS[fmt])
    exported = megatron_export(plan)
    core = output.with_name(f"{output.stem}_mcore.py")  # Megatron-Core's keyword arguments, beside the flags
    core_text = exported.render_core(output.name)
    check_replaceable(core, "--output's Megatron-Core file")  # before the first file: never half the export
    atomic_write_text(output, exported.render())
    atomic_write_text(core, core_text)
    notes += [f"cannot express: {note}" for note in exported.notes]
    return [*exported.flags, f"wrote {output}", f"wrote {core}"], notes


def _write_torchtitan(plan: Plan, output: Path, version: str) -> tuple[list[str], list[str]]:
    """The config at `output` and, when it points at one, the torch CSV schedule beside it (same stem), named by
    its absolute path: torchtitan opens it from wherever it runs."""
    csv_path = output.with_suffix(".csv").resolve()
    exported = torchtitan_export(plan, str(csv_path), version)
    text, csv_text = exported.render(), torch_csv(plan) if exported.needs_csv else None
    written = []
    if csv_text is not None:
        check_replaceable(csv_path, "--output's schedule CSV")  # before the first file: never half the export
        atomic_write_text(csv_path, csv_text)
        written.append(f"wrote {csv_path}")
    atomic_write_text(output, text)
    return [*written, f"wrote {output}"], [f"cannot express: {note}" for note in exported.notes]
