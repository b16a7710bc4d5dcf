"""`pipeplan capacity`: analytic profile of a model for a hardware preset -> best plan per device count -> table,
JSON or plot, and how many devices a token budget needs."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from pipeplan.capacity.sweep import (
    CapacityConfig,
    CapacityReport,
    CapacityRow,
    capacity_sweep,
    default_global_batch,
)
from pipeplan.console import out, print_json, progress, warn
from pipeplan.errors import ConfigError, ModelError
from pipeplan.paths import check_output_file
from pipeplan.planner.inputs import microbatch_candidates
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info, schedule_names
from pipeplan.units import format_bytes, format_count, format_gib, format_ms, parse_count, parse_int_list


def parse_device_counts(text: str) -> tuple[int, ...]:
    """`"8,64,512"` -> (8, 64, 512)."""
    return parse_int_list(text, option="--devices", example="8,64,512")


def parse_schedules(text: str) -> tuple[str, ...]:
    """`auto` (the registry's capacity_default schedules: all but zb-auto), `all`, or names like 1f1b,zbv."""
    if text == "auto":
        return schedule_names(capacity_default=True)
    if text == "all":
        return SCHEDULE_NAMES
    return tuple(part.strip() for part in text.split(",") if part.strip())


def capacity_profile(
    model: str,
    options: dict[str, str],
    *,
    seq: int | None,
    hardware,
    batch_size: int,
    quiet: bool,
    batch_given: bool = True,
) -> Profile:
    """The analytic profile (meta device, bf16, flash attention); `seq` replaces the model's (a preset's too).
    Without `batch_given` the default global batch counts tokens, so the model must say its tokens per sample."""
    from pipeplan.models import load_model
    from pipeplan.models.registry import BUILTINS, call_factory
    from pipeplan.profiling.analytic import profile_analytic

    if seq is not None:
        if seq < 1:
            raise ConfigError(f"--seq must be >= 1, got {seq}")
        if "seq" in options:
            warn(f"-a seq={options['seq']} ignored: --seq {seq} given")
        options = {**options, "seq": str(seq)}
    builtin = BUILTINS.get(model)
    if seq is not None and builtin is not None and builtin.preset and "seq" in builtin.preset:
        fixed = sorted((set(options) - {"seq"}) & set(builtin.preset))
        if fixed:
            raise ModelError(f"preset {model!r} fixes {', '.join(fixed)}; use the base model to change them")
        spec = call_factory(builtin.factory, {**builtin.preset, **options}, ref=model)
    else:
        spec = load_model(model, options)
    if spec.tokens_per_sample is None:
        if not batch_given:
            raise ConfigError(f"model {model!r} does not say its tokens per sample; give --global-batch-size")
        warn(f"model {model!r} does not say its tokens per sample; counting one token per sample")
    return profile_analytic(spec, batch_size=batch_size, hardware=hardware, precision="bf16-mixed", progress=not quiet)


def capacity(
    model: str = typer.Argument(..., help="Built-in model name, path/to/file.py:factory or package.module:factory."),
    assignments: list[str] = typer.Option(None, "--arg", "-a", help="Model option key=value (repeatable)."),
    hardware: str = typer.Option(..., "--hardware", help="Hardware preset (h100, h200, a100-80gb, b200, ...)."),
    hardware_file: Path = typer.Option(None, "--hardware-file", help="JSON file adding or overriding presets."),
    devices: str = typer.Option(..., "--devices", "-n", help="Device counts to plan for, e.g. 8,64,512."),
    devices_per_node: int = typer.Option(8, "--devices-per-node", help="Devices per node."),
    global_batch_size: int = typer.Option(None, "--global-batch-size", "-B", help="Samples per step (~1M tokens)."),
    microbatch_size: str = typer.Option("1", "--microbatch-size", "-b", help="b, or candidates like 1,2."),
    seq: int = typer.Option(None, "--seq", help="Sequence length (replaces the model's seq option)."),
    target_tokens: str = typer.Option(None, "--target-tokens", help="Tokens to train on, e.g. 1T (with --days)."),
    days: float = typer.Option(None, "--days", help="Days the training may take (with --target-tokens)."),
    schedule: str = typer.Option("auto", "--schedule", "-s", help="auto (all but zb-auto), all, or names a,b."),
    optimizer: str = typer.Option(
        "adamw", "--optimizer", help="adamw (16 B/param under bf16-mixed, which capacity assumes), sgd, sgd-nomomentum."
    ),
    replication: bool = typer.Option(False, "--replication", help="Also try replicated stages (slow)."),
    plot: str = typer.Option(None, "--plot", help="Write throughput and memory vs devices per schedule (PNG)."),
    memory_reserve: str = typer.Option(
        None, "--memory-reserve", help="Device memory kept free, e.g. 2GiB (default: max(1GiB, 5%)), as in plan."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print only JSON (rows and the answer)."),
) -> None:
    """Best pipeline plan for a model on each of several cluster sizes: step time, tokens/s, MFU, bubble,
    per-device memory (weights / gradients / optimizer / activations) and what binds; with --target-tokens and
    --days, how many devices reach the target.

    Example: pipeplan capacity llama-7b --hardware h100 --devices 8,64,512 --target-tokens 1T --days 30
    """
    from pipeplan.models import parse_assignments
    from pipeplan.planner.commands import memory_reserve_bytes
    from pipeplan.profiling.hardware import load_hardware

    counts = parse_device_counts(devices)
    if global_batch_size is not None and global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be >= 1, got {global_batch_size}")
    if days is not None and not (math.isfinite(days) and days > 0):
        raise ConfigError(f"--days must be a finite number > 0, got {days}")
    if target_tokens is not None and not parse_count(target_tokens, option="--target-tokens") > 0:
        raise ConfigError(f"--target-tokens must be > 0, got {target_tokens!r}")
    spec_hardware = load_hardware(hardware, hardware_file=hardware_file)
    sizes = microbatch_candidates(microbatch_size, global_batch_size or 1)
    target = parse_count(target_tokens, option="--target-tokens") if target_tokens is not None else None
    plot = check_output_file(plot, "--plot") if plot is not None else None
    if plot is not None and plot.suffix.lower() != ".png":
        raise ConfigError(f"--plot {str(plot)!r} must name a .png file")
    config = CapacityConfig(  # validated before the (slow) profiling; the default batch needs the profile
        hardware=spec_hardware, device_counts=counts, global_batch_size=global_batch_size or math.lcm(*sizes),
        devices_per_node=devices_per_node, microbatch_sizes=sizes, schedules=parse_schedules(schedule),
        optimizer=optimizer, replication=replication, per_schedule=plot is not None, target_tokens=target, days=days,
        memory_reserve_bytes=memory_reserve_bytes(memory_reserve, spec_hardware.memory_bytes),
    )  # fmt: skip
    if replication and not any(schedule_info(name).replicable for name in config.schedules):
        warn(f"--replication ignored: none of {', '.join(config.schedules)} can replicate stages")
    profile = capacity_profile(
        model, parse_assignments(assignments), seq=seq, hardware=spec_hardware, batch_size=min(sizes),
        quiet=json_output, batch_given=global_batch_size is not None,
    )  # fmt: skip
    if global_batch_size is None:
        batch = default_global_batch(profile.provenance.tokens_per_sample or 1, sizes)
        config = replace(config, global_batch_size=batch)
    with progress(quiet=json_output) as bar:
        task = bar.add_task("planning", total=len(config.device_counts))
        report = capacity_sweep(
            profile, config, model=model,
            progress=lambda done, total, what: bar.update(task, completed=done, total=total, description=what),
        )  # fmt: skip
    if plot is not None:
        from pipeplan.capacity.plot import plot_capacity

        plot_capacity(report, plot)
    if json_output:
        print_json(report.to_dict())
        return
    render_report(report)
    if plot is not None:
        out.print(f"wrote {plot}")


def _row_cells(row: CapacityRow) -> list[str]:
    count = f"{row.num_devices}{'*' if row.extended else ''}"
    if not row.fits:
        need = f"needs >= {format_bytes(row.needed_memory_bytes)}/device" if row.needed_memory_bytes else ""
        more = f"fits on {row.needed_devices}" if row.needed_devices else "no swept count fits"
        return [count, "[red]does not fit[/]", *[""] * 8, "; ".join(p for p in (need, more) if p)]
    mem = row.memory
    assert mem is not None and row.tokens_per_s is not None and row.mfu is not None
    return [
        count,
        f"{row.schedule} {row.pipeline_devices}x{row.data_parallel} m={row.num_microbatches} b={row.microbatch_size}",
        format_ms(row.step_ms),
        format_count(row.tokens_per_s),
        f"{row.mfu:.1%}",
        f"{row.bubble_rate:.0%}",
        format_gib(mem.weights, digits=1),
        format_gib(mem.gradients, digits=1),
        format_gib(mem.optimizer, digits=1),
        format_gib(mem.activations, digits=1),
        row.binding,
    ]


def render_report(report: CapacityReport) -> None:
    usable = report.memory_per_device - report.memory_reserve_bytes
    out.print(
        f"[bold]{report.model}[/] on {report.hardware}: {format_count(report.param_count)} parameters, "
        f"{report.flops_per_token / 1e9:.2f} GFLOP/token, global batch {report.global_batch_size} x "
        f"{report.tokens_per_sample} tokens; plans fit in {format_bytes(usable)} of "
        f"{format_bytes(report.memory_per_device)} per device ({format_bytes(report.memory_reserve_bytes)} reserve)",
        highlight=False,
    )
    table = Table(show_lines=False, pad_edge=False)
    headers = ["N", "plan PxDP", "step ms", "tok/s", "MFU", "bubble", "W", "G", "O", "A", "binds"]
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i in (1, 10) else "right", no_wrap=i != 10, min_width=4)
    for row in report.rows:
        table.add_row(*_row_cells(row))
    wide = out if out.is_terminal else Console(file=out.file, width=max(out.width, 160))  # pipes: the whole table
    wide.print(table)
    out.print(
        "W/G/O/A: weights, gradients, optimizer state, activations (GiB) on the busiest device; "
        "* = a count added by doubling",
        highlight=False,
    )
    for row in report.rows:
        if row.reason:
            out.print(f"  {row.num_devices} devices: {row.reason}", highlight=False, soft_wrap=True)
    if report.answer is not None:
        out.print(f"[bold]answer:[/] {report.answer.message}", highlight=False, soft_wrap=True)
