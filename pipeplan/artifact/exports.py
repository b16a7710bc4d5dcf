"""`pipeplan export`: a plan in another tool's format. torch-csv: the per-rank op lists as the "compute_only" CSV
torch.distributed.pipelining's PipelineScheduleMulti._load_csv reads; megatron: Megatron-LM arguments
(plan.export_megatron); torchtitan: a torchtitan job config (plan.export_torchtitan)."""

from __future__ import annotations

from pathlib import Path

from pipeplan.artifact.export_formats import EXPORT_FORMATS
from pipeplan.artifact.export_megatron import megatron_export
from pipeplan.artifact.export_torchtitan import torchtitan_export
from pipeplan.artifact.plan import Plan
from pipeplan.artifact.timing import plan_schedule
from pipeplan.errors import ConfigError
from pipeplan.jsonio import atomic_write_text
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
    notes: list[str] = []
    if fmt == "torch-csv":
        atomic_write_text(output, torch_csv(plan))
        if plan.training.data_parallel > 1:
            notes.append(
                f"wrote pipeline 0's {len(plan.stages) // plan.chunks} ranks; "
                f"all {plan.training.data_parallel} pipelines run the same lists"
            )
        return [f"wrote {output}"], notes
    if fmt == "torchtitan":
        return _write_torchtitan(plan, output)
    exported = megatron_export(plan)
    atomic_write_text(output, exported.render())
    notes += [f"cannot express: {note}" for note in exported.notes]
    return [*exported.flags, f"wrote {output}"], notes


def _write_torchtitan(plan: Plan, output: Path) -> tuple[list[str], list[str]]:
    """The job config at `output` and, when it points at one, the torch CSV schedule beside it (same stem)."""
    csv_path = output.with_suffix(".csv")
    exported = torchtitan_export(plan, str(csv_path))
    written = []
    if exported.needs_csv:
        atomic_write_text(csv_path, torch_csv(plan))
        written.append(f"wrote {csv_path}")
    atomic_write_text(output, exported.render())
    return [*written, f"wrote {output}"], [f"cannot express: {note}" for note in exported.notes]
