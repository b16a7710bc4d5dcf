"""`pipeplan plan`, `pipeplan show` and `pipeplan export`: parse -> library call -> render."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeplan.console import err, out, print_json, progress, warn
from pipeplan.errors import ConfigError
from pipeplan.jsonio import atomic_write_text
from pipeplan.models import parse_assignments
from pipeplan.paths import check_output_file
from pipeplan.planner.build import build_plan, plan_schedule, plan_timeline, timeline_rows
from pipeplan.planner.inputs import (
    PlanInput,
    ProfileRequest,
    attach_model,
    check_plan_options,
    check_profile_precision,
    graph_at_microbatch,
    load_profile_input,
    make_cluster,
    microbatch_candidates,
    pipeline_depth_candidates,
    profile_model_input,
)
from pipeplan.planner.plan import Plan
from pipeplan.planner.scripts import write_plan_dir
from pipeplan.planner.search import SearchConfig, default_memory_reserve, search_plans
from pipeplan.planner.summary import render_summary, summary_dict
from pipeplan.precision import default_precision
from pipeplan.profiling.hardware import load_hardware
from pipeplan.profiling.trace import check_tracer
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.registry import SCHEDULE_NAMES
from pipeplan.schedules.simulate import Timeline
from pipeplan.schedules.validate import validate
from pipeplan.units import parse_size

DEFAULT_OUTPUT = "plan"
EXPORT_FORMATS = ("torch-csv",)


def _check_source(
    model: str | None, profile: Path | None, assignments: list[str] | None, device: str, granularity: int | None
) -> None:
    if model is None and profile is None:
        raise ConfigError("give MODEL (e.g. gpt), --profile FILE, or both (the model's graph, the file's costs)")
    if profile is not None:
        unused = (("-a", assignments and model is None), ("--granularity", granularity and model is None))
        ignored = [flag for flag, given in (*unused, ("--device", device != "cpu")) if given]
        if ignored:
            warn(f"{', '.join(ignored)} ignored: --profile plans with the file's costs")


def plan(
    model: str = typer.Argument(None, help="Built-in model, path/to/file.py:factory or package.module:factory."),
    assignments: list[str] = typer.Option(None, "--arg", "-a", help="Model option key=value (repeatable)."),
    profile: Path = typer.Option(None, "--profile", help="Plan from a profile file instead of a model."),
    profile_format: str = typer.Option("pipeplan", "--profile-format", help="pipeplan or pipedream (graph.txt)."),
    devices: int = typer.Option(None, "--devices", "-n", help="Devices in all (default: local GPUs, or 2 on CPU)."),
    devices_per_node: int = typer.Option(None, "--devices-per-node", help="Devices per node (default: min(N, 8))."),
    memory_per_device: str = typer.Option(None, "--memory-per-device", help="e.g. 80GiB (default: hardware/RAM)."),
    memory_reserve: str = typer.Option(
        None,
        "--memory-reserve",
        help="Device memory kept free for what the model does not count (CUDA context, NCCL buffers, "
        "fragmentation), e.g. 2GiB or 0 (default: max(1GiB, 5% of device memory)).",
    ),
    hardware: str = typer.Option(None, "--hardware", help="Preset for links and memory (h100, a100-80gb, ...)."),
    hardware_file: Path = typer.Option(None, "--hardware-file", help="JSON file adding presets (pipeplan calibrate)."),
    device: str = typer.Option("cpu", "--device", help="Profile on cpu or cuda (measured) or meta (analytic)."),
    global_batch_size: int = typer.Option(None, "--global-batch-size", "-B", help="Samples per step (default 4 x N)."),
    microbatch_size: str = typer.Option(
        None, "--microbatch-size", "-b", help="b, or candidates like 1,2,4 (default: the profile's batch size, or 1)."
    ),
    pipeline_depth: str = typer.Option(
        None,
        "--pipeline-depth",
        "-p",
        help="Devices per pipeline, or candidates like 2,4 (default: all divisors of N).",
    ),
    optimizer: str = typer.Option(
        "adamw", "--optimizer", help="adamw, sgd or sgd-nomomentum: its state, in --precision's dtype (memory)."
    ),
    precision: str = typer.Option(
        None,
        "--precision",
        help="fp32, bf16-mixed, fp16-mixed (CUDA) or bf16 (default: the profile's; on the spot bf16-mixed on "
        "cuda/meta, fp32 on cpu), e.g. --precision bf16-mixed.",
    ),
    zero: int = typer.Option(
        0,
        "--zero",
        help="1: `run` shards the optimizer state over the ranks holding the same parameters (ZeRO-1); 0: off. "
        "The search's memory and time do not count it yet.",
    ),
    schedule: str = typer.Option("auto", "--schedule", "-s", help=f"auto or one of: {', '.join(SCHEDULE_NAMES)}."),
    no_replication: bool = typer.Option(False, "--no-replication", help="Do not try replicated stages."),
    granularity: int = typer.Option(None, "--granularity", help="Layer grouping depth when tracing the model."),
    tracer: str = typer.Option(
        "auto", "--tracer", help="fx, export (torch.export) or auto: fx, else export (e.g. --tracer export)."
    ),
    output: str = typer.Option(DEFAULT_OUTPUT, "--output", "-o", help="Directory for plan.json and scripts."),
    json_output: bool = typer.Option(False, "--json", help="Print only the summary as JSON."),
) -> None:
    """Choose pipeline depth, replication, microbatches and schedule, and write a runnable plan.

    Writes DIR/plan.json, launch.sh, job.sbatch and timeline.json (DIR defaults to ./plan). MODEL is profiled on
    the spot (measured on cpu/cuda, analytic with --device meta --hardware NAME); --profile FILE plans from a saved
    profile (not runnable alone: give MODEL too so the plan names each stage's FX nodes). Profile costs are
    scaled linearly to the microbatch size.

    Example: pipeplan plan gpt --devices 2 --global-batch-size 8 -o demo-out
    Example: pipeplan plan gpt --precision bf16-mixed --devices 2 -B 8 -o demo-bf16
    Example: pipeplan plan --profile llama.json --hardware h100 --devices 64 -B 1024 --memory-reserve 6GiB
    """
    if hardware_file is not None:  # e.g. a `pipeplan calibrate` entry: links, memory and analytic rates
        hardware = load_hardware(hardware or "", hardware_file=hardware_file)
    cluster = make_cluster(
        devices=devices, devices_per_node=devices_per_node, memory_per_device=memory_per_device, hardware=hardware
    )
    batch = global_batch_size if global_batch_size is not None else 4 * cluster.num_devices
    check_plan_options(schedule=schedule, precision=precision, output=output, granularity=granularity)
    output = Path(output)
    _check_source(model, profile, assignments, device, granularity)
    check_tracer(tracer)
    source = load_profile_input(str(profile), profile_format) if profile is not None else None
    if source is not None and model is not None:
        source = attach_model(source, model, parse_assignments(assignments), granularity, tracer)
    if source is not None:
        precision = check_profile_precision(source.profile, precision)
    precision = precision or default_precision(device)
    default_size = source.profile.provenance.batch_size if source is not None else 1
    sizes = microbatch_candidates(microbatch_size, default_size)
    config = SearchConfig(  # validated before the (slow) profiling
        global_batch_size=batch, microbatch_sizes=sizes, optimizer=optimizer, precision=precision,
        replication=not no_replication,
        pipeline_depths=pipeline_depth_candidates(pipeline_depth),
        memory_reserve_bytes=memory_reserve_bytes(memory_reserve, cluster.memory_per_device), zero=zero,
    )  # fmt: skip
    config.check_devices(cluster.num_devices)
    if source is None:
        request = ProfileRequest(
            model=model, options=parse_assignments(assignments), batch_size=min(sizes), device=device,
            hardware=hardware, granularity=granularity, precision=precision, quiet=json_output, tracer=tracer,
        )  # fmt: skip
        source = profile_model_input(request)
    schedules = None if schedule == "auto" else (schedule,)
    chosen, timeline = _search_and_write(source, cluster, config, schedules, output, quiet=json_output)
    if json_output:
        print_json(summary_dict(chosen, plan_dir=str(output)))
        return
    render_summary(out, chosen, timeline=timeline)
    out.print(f"wrote {output}/plan.json, launch.sh, job.sbatch, timeline.json")


def memory_reserve_bytes(text: str | None, memory_per_device: int) -> int:
    """--memory-reserve as bytes; the documented default when not given."""
    if text is None:
        return default_memory_reserve(memory_per_device)
    return parse_size(text, option="--memory-reserve") if text.strip() not in ("0", "0B") else 0


def _search_and_write(
    source: PlanInput, cluster, config: SearchConfig, schedules, output: Path, *, quiet: bool
) -> tuple[Plan, Timeline]:
    with progress(quiet=quiet) as bar:
        task = bar.add_task("searching plans", total=None)
        result = search_plans(
            source.profile, cluster, config, schedules,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
    source = graph_at_microbatch(source, result.best.layout.microbatch_size)
    chosen = build_plan(result, model=source.model, layer_graph=source.layer_graph)
    timeline = result.best.timeline  # what plan_timeline(chosen) re-simulates; `show` does that
    write_plan_dir(chosen, timeline_rows(chosen, timeline), output)
    return chosen, timeline


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
