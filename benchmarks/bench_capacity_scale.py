"""Pre-training scale capacity benchmark: `pipeplan capacity` for llama-7b, llama-13b, llama-70b and gpt2-1.5b (the
built-in presets at their own sequence lengths) on 8..4096 H100s, global batch 1024 sequences, every layout
family (tensor parallel t x pipeline P x data parallel D); prints the chosen layouts with MFU and the busiest
device's memory, and the time each sweep takes (wall, and this process's CPU time, steadier on a shared machine).
Target: the llama-70b sweep over its 5 device counts in under 60 s. Writes results/capacity_scale.json.

`python benchmarks/bench_capacity_scale.py [MODEL ...]` runs only the models named.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("models", nargs="*", metavar="MODEL", help="only these models (default: all four)")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pipeplan.capacity.inputs import capacity_profile  # noqa: E402
from pipeplan.capacity.options import CAPACITY_PRECISION  # noqa: E402
from pipeplan.capacity.report import CapacityReport, CapacityRow  # noqa: E402
from pipeplan.capacity.sweep import CapacityConfig, capacity_sweep  # noqa: E402
from pipeplan.hardware import load_hardware  # noqa: E402
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.search.config import SearchConfig, default_memory_reserve  # noqa: E402
from pipeplan.units import format_gib  # noqa: E402

MODELS = ("gpt2-1.5b", "llama-7b", "llama-13b", "llama-70b")
DEVICES = (8, 64, 256, 1024, 4096)
GLOBAL_BATCH = 1024  # sequences per step
HARDWARE = "h100"
TARGET_MODEL, TARGET_S = "llama-70b", 60.0


def _timed(func):
    wall, cpu = time.perf_counter(), time.process_time()
    result = func()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def bench_model(model: str) -> dict:
    hardware = load_hardware(HARDWARE)
    profile, profile_wall, profile_cpu = _timed(
        lambda: capacity_profile(model, {}, seq=None, hardware=hardware, batch_size=1, quiet=True)
    )
    search = SearchConfig(
        global_batch_size=GLOBAL_BATCH,
        precision=CAPACITY_PRECISION,
        replication=False,
        memory_reserve_bytes=default_memory_reserve(hardware.memory_bytes),
    )
    config = CapacityConfig(hardware=hardware, device_counts=DEVICES, search=search)
    report, sweep_wall, sweep_cpu = _timed(lambda: capacity_sweep(profile, config, model=model))
    return {
        "model": model,
        "seq": profile.provenance.tokens_per_sample,
        "profile_s": {"wall": profile_wall, "cpu": profile_cpu},
        "sweep_s": {"wall": sweep_wall, "cpu": sweep_cpu},
        "report": report,
    }


def _layout(row: CapacityRow) -> str:
    if not row.fits:
        return "does not fit"
    return (
        f"{row.schedule} t={row.tensor_parallel} {row.pipeline_devices}x{row.data_parallel} m={row.num_microbatches} "
        f"recompute={row.recompute_label} zero={row.zero}"
    )


def _rows_table(results: list[dict]) -> Table:
    table = Table(title=f"chosen layouts on {HARDWARE} (global batch {GLOBAL_BATCH} sequences)")
    for column in ("model", "N", "layout (t x P x D)", "MFU", "memory GiB", "binds", "why this t"):
        table.add_column(column, justify="right" if column in ("N", "MFU", "memory GiB") else "left")
    for result in results:
        report: CapacityReport = result["report"]
        for row in report.rows:
            table.add_row(
                result["model"],
                str(row.num_devices),
                _layout(row),
                f"{row.mfu:.1%}" if row.fits else "",
                format_gib(row.memory.total, digits=1) if row.fits else "",
                row.binding,
                row.tensor_parallel_reason or row.reason,
            )
    return table


def _times_table(results: list[dict]) -> Table:
    table = Table(title=f"sweep times over {len(DEVICES)} device counts (target: {TARGET_MODEL} < {TARGET_S:.0f} s)")
    for column in ("model", "seq", "profile wall s", "sweep wall s", "sweep CPU s", "CPU / target"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for result in results:
        sweep = result["sweep_s"]
        ratio = f"{sweep['cpu'] / TARGET_S:.2f}" if result["model"] == TARGET_MODEL else ""
        table.add_row(
            result["model"],
            str(result["seq"]),
            f"{result['profile_s']['wall']:.1f}",
            f"{sweep['wall']:.1f}",
            f"{sweep['cpu']:.1f}",
            ratio,
        )
    return table


def main(models: tuple[str, ...]) -> None:
    results = [bench_model(model) for model in models]
    console = Console(width=200)
    console.print(_rows_table(results))
    console.print(_times_table(results))
    write_json(
        ROOT / "benchmarks" / "results" / "capacity_scale.json",
        {
            "schema_version": 1,
            "hardware": HARDWARE,
            "device_counts": list(DEVICES),
            "global_batch_size": GLOBAL_BATCH,
            "target": {"model": TARGET_MODEL, "sweep_s": TARGET_S},
            "models": [
                {
                    "model": r["model"],
                    "seq": r["seq"],
                    "profile_s": r["profile_s"],
                    "sweep_s": r["sweep_s"],
                    "report": r["report"].to_dict(),
                }
                for r in results
            ],
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        },
    )


if __name__ == "__main__":
    main(tuple(ARGS.models) or MODELS)
