"""`pipeplan capacity`: analytic profile of a model for a hardware preset -> best plan per device count -> table,
JSON or plot, and how many devices a token budget needs (parse -> library call -> render)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from pipeplan.capacity.options import CapacityOptions
from pipeplan.console import out, print_json, progress_task, wide
from pipeplan.options import command
from pipeplan.units import format_bytes, format_count, format_gib, format_ms

if TYPE_CHECKING:
    from pipeplan.capacity.pinned import PinnedReport
    from pipeplan.capacity.report import CapacityReport, CapacityRow


@command(CapacityOptions)
def capacity(options: CapacityOptions) -> None:
    """Best pipeline plan for a model on each of several cluster sizes: step time, tokens/s, MFU, bubble,
    per-device memory (weights / gradients / optimizer / activations) and what binds; with --target-tokens and
    --days, how many devices reach the target.

    Example: pipeplan capacity llama-7b --hardware h100 --devices 8,64,512 --target-tokens 1T --days 30
    Example: pipeplan capacity gpt2-1.5b --hardware h100 --devices 8,64 --schedule auto,async
    Example: pipeplan capacity llama-70b --hardware h100 --devices 64 -B 1024 --memory zero=1,recompute=none
    Example: pipeplan capacity llama-13b --hardware h100 --devices 64 --precision fp8 --parallel tp=8,vp=2/4
    Example: pipeplan capacity llama-70b --hardware h100 -B 128 --seq 8192 --layout "tp=4,cp=2,pp=4,vp=5,dp=2"
    Example: pipeplan capacity hf:qwen2.5-72b --hardware a100-80gb --devices 256 --attention math
    """
    from pipeplan.capacity.inputs import prepare_capacity, run_capacity_job  # the sweep: imported when it runs
    from pipeplan.capacity.pinned import PinnedReport

    job = prepare_capacity(options)
    with progress_task("planning", total=len(job.config.device_counts), quiet=options.json_output) as update:
        report = run_capacity_job(
            job, progress=lambda done, total, what: update(completed=done, total=total, description=what)
        )
    if options.json_output:
        print_json(report.to_dict())
        return
    if isinstance(report, PinnedReport):
        render_pinned(report)
        return
    render_report(report)
    if job.plot is not None:
        out.print(f"wrote {job.plot}")


HEADERS = (
    "N",
    "plan PxDP",
    "t x cp",
    "recompute",
    "ZeRO",
    "step ms",
    "tok/s",
    "MFU",
    "bubble",
    "W",
    "G",
    "O",
    "A",
    "binds",
)
LEFT = ("plan PxDP", "recompute", "binds")


def _row_cells(row: CapacityRow) -> list[str]:
    count = f"{row.num_devices}{'*' if row.extended else ''}"
    if not row.fits:
        need = f"needs >= {format_bytes(row.needed_memory_bytes)}/device" if row.needed_memory_bytes else ""
        more = f"fits on {row.needed_devices}" if row.needed_devices else "no swept count fits"
        return [count, "[red]does not fit[/]", *[""] * (len(HEADERS) - 3), "; ".join(p for p in (need, more) if p)]
    mem = row.memory
    assert mem is not None and row.step_ms is not None and row.tokens_per_s is not None and row.mfu is not None
    return [
        count,
        f"{row.schedule} {row.pipeline_devices}x{row.data_parallel} m={row.num_microbatches} b={row.microbatch_size}",
        f"{row.tensor_parallel}x{row.context_parallel}"
        if (row.context_parallel or 1) > 1
        else str(row.tensor_parallel),
        row.recompute_label,
        str(row.zero),
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


def _headers(moe: bool) -> tuple[str, ...]:
    """The table's columns: an ep column after t x cp for mixture-of-experts models."""
    return (*HEADERS[:3], "ep", *HEADERS[3:]) if moe else HEADERS


def _with_ep(cells: list[str], row: CapacityRow, moe: bool) -> list[str]:
    return [*cells[:3], str(row.expert_parallel or "") if row.fits else "", *cells[3:]] if moe else cells


def _active(report: CapacityReport) -> str:
    return f" ({format_count(report.active_param_count)} active)" if report.active_param_count is not None else ""


def _attention(report: CapacityReport) -> str:
    return f" ({report.attention} attention)" if report.attention not in ("", "none") else ""


def render_report(report: CapacityReport) -> None:
    usable = report.usable_memory_bytes
    out.print(
        f"[bold]{report.model}[/] on {report.hardware}: {format_count(report.param_count)} parameters"
        f"{_active(report)}, {report.flops_per_token / 1e9:.2f} GFLOP/token{_attention(report)}, "
        f"global batch {report.global_batch_size} x "
        f"{report.tokens_per_sample} tokens; plans fit in {format_bytes(usable)} of "
        f"{format_bytes(report.memory_per_device)} per device ({format_bytes(report.memory_reserve_bytes)} reserve)",
        highlight=False,
    )
    table = Table(show_lines=False, pad_edge=False)
    moe = report.active_param_count is not None
    for header in _headers(moe):
        left = header in LEFT
        table.add_column(header, justify="left" if left else "right", no_wrap=header != "binds", min_width=4)
    for row in report.rows:
        table.add_row(*_with_ep(_row_cells(row), row, moe))
    wide(out).print(table)  # a pipe gets the whole table
    from pipeplan.schedules.registry import schedule_info

    stash = any(row.schedule and schedule_info(row.schedule).asynchronous for row in report.rows)
    out.print(
        "plan PxDP: schedule, P device groups per pipeline x DP pipelines, m microbatches of b samples; t x cp: "
        "devices per tensor-parallel group x context-parallel groups (N = t x cp x P x DP); "
        f"{'ep: ranks the routed experts are split over (of the DP x cp ranks; balanced routing); ' if moe else ''}"
        "recompute: activation "
        "recomputation per stage; ZeRO: optimizer sharding stage; W/G/O/A: weights, gradients, optimizer state, "
        "activations (GiB) on the busiest device"
        f"{' (A with pipedream stashed weight copies)' if stash else ''}; * = a count added by doubling",
        highlight=False,
    )
    for row in report.rows:
        for note in (row.reason, row.tensor_parallel_reason):
            if note:
                out.print(f"  {row.num_devices} devices: {note}", highlight=False, soft_wrap=True)
    if report.answer is not None:
        out.print(f"[bold]answer:[/] {report.answer.message}", highlight=False, soft_wrap=True)


def render_pinned(report: PinnedReport) -> None:
    """The pinned layout's row and the planner's, each pipeline device's memory, and why they differ."""
    table = Table(show_lines=False, pad_edge=False)
    moe = any((row.expert_parallel or 1) > 1 for row in (report.row, report.free))
    for header in ("", *_headers(moe)):
        table.add_column(header, justify="left" if header in LEFT or not header else "right", no_wrap=header != "binds")
    table.add_row("pinned", *_with_ep(_row_cells(report.row), report.row, moe))
    table.add_row("planner", *_with_ep(_row_cells(report.free), report.free, moe))
    wide(out).print(table)  # a pipe gets the whole table
    out.print(f"pinned: {report.layout.label}", highlight=False)
    if report.device_memory_bytes:
        peaks = ", ".join(format_gib(b, digits=1) for b in report.device_memory_bytes)
        out.print(f"memory per pipeline device (GiB, simulated peak): {peaks}", highlight=False, soft_wrap=True)
    for name, row in (("pinned", report.row), ("planner", report.free)):
        for note in (row.reason, row.tensor_parallel_reason):
            if note:
                out.print(f"  {name}: {note}", highlight=False, soft_wrap=True)
    out.print(f"[bold]comparison:[/] {report.comparison}", highlight=False, soft_wrap=True)
