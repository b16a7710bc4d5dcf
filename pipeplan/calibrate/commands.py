"""`pipeplan calibrate`: measure this machine and write a hardware file (parse -> calibrate -> render)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from pipeplan.console import out, print_json, progress_task

if TYPE_CHECKING:
    from pipeplan.calibrate.spec import Calibration


def _table(name: str, entry: dict, cal: Calibration) -> Table:
    table = Table(title=f"calibrated {name}: {cal.device_name}", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for sample in cal.matmul:
        shape = "x".join(map(str, sample.shape))
        table.add_row(f"matmul {sample.dtype} {shape}", f"{sample.flops_per_s / 1e12:.3f} TFLOP/s")
    for dtype in dict.fromkeys(s.dtype for s in cal.matmul):
        median = cal.matmul_flops_per_s(dtype)
        assert median is not None, "a dtype with samples has a median"
        table.add_row(f"matmul {dtype} (median)", f"{median / 1e12:.3f} TFLOP/s")
    for mem in cal.memory:
        copy, add = mem.copy_bytes_per_s / 1e9, mem.add_bytes_per_s / 1e9
        table.add_row(f"memory copy / add {mem.num_bytes >> 20} MiB", f"{copy:.1f} / {add:.1f} GB/s")
    table.add_row("memory (median)", f"{cal.memory_bytes_per_s / 1e9:.1f} GB/s")
    table.add_row("kernel launch", f"{cal.launch_s * 1e6:.2f} us")
    if cal.links is not None:
        link = cal.links
        table.add_row(f"p2p ({link.backend}, {link.ranks} ranks)", f"{link.p2p_bytes_per_s / 1e9:.2f} GB/s")
        table.add_row("all-reduce bus bandwidth", f"{link.allreduce_bus_bytes_per_s / 1e9:.2f} GB/s")
        table.add_row("small-message latency", f"{link.latency_s * 1e6:.1f} us")
    table.add_row("matmul / memory efficiency", f"{entry['matmul_efficiency']:.3f} / {entry['memory_efficiency']:.3f}")
    return table


def calibrate(
    device: str = typer.Option(..., "--device", help="cuda (or cuda:N) or cpu: the device to measure."),
    output: Path = typer.Option(None, "--output", "-o", help="Hardware file to write (an existing one gains NAME)."),
    name: str = typer.Option(None, "--name", help="Entry name (default: the GPU's name slugged, or 'cpu')."),
    dtypes: list[str] = typer.Option(
        None, "--dtype", help="bf16, fp16, tf32, fp32; repeat or comma-list (default: all; cpu: fp32,bf16)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Tiny sizes and few repeats (a smoke test, not a calibration)."),
    as_json: bool = typer.Option(False, "--json", help="Print only the hardware file JSON on stdout."),
) -> None:
    """Measure this machine's matmul FLOP/s per dtype, memory bandwidth, kernel launch overhead and (2+ GPUs, or
    two CPU processes) link bandwidth and latency; write them as a --hardware-file entry that analytic profiles,
    plan and capacity use in place of datasheet peaks.

    Then: pipeplan plan gpt --device meta --hardware hw.json:NAME (NAME as printed; profile and capacity too).

    Example: pipeplan calibrate --device cuda -o hw.json
    """
    from pipeplan.calibrate.hardware_file import check_entry_target, entry_name, hardware_entry, write_hardware_file
    from pipeplan.calibrate.measure import calibrate as run_calibration
    from pipeplan.calibrate.measure import dtype_list, num_steps
    from pipeplan.calibrate.spec import CalibrateConfig  # torch: imported when the command runs

    config = CalibrateConfig(device=device, dtypes=dtype_list(dtypes), quick=quick)
    check_entry_target(name, output)
    with progress_task(f"calibrate {device}", total=num_steps(config), quiet=as_json) as update:
        cal = run_calibration(config, advance=lambda what: update(advance=1, description=what))
    key, entry = entry_name(name, cal), hardware_entry(cal)
    if output is not None:
        write_hardware_file(output, key, entry)
    if as_json:
        print_json({"schema_version": 1, "hardware": {key: entry}})
        return
    _render(key, entry, cal, output)


def _render(key: str, entry: dict, cal: Calibration, output: Path | None) -> None:
    out.print(_table(key, entry, cal))
    for note in entry["sources"].removeprefix("pipeplan calibrate: ").split("; "):
        out.print(f"  {note}", highlight=False)
    if output is not None:
        out.print(f"wrote {output} (use: --hardware {output}:{key})", highlight=False)
    else:
        out.print("nothing written: add -o FILE to save this as a hardware file", highlight=False)
