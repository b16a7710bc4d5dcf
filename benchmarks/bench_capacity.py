"""Capacity benchmark (target < 60 s); prints a table and writes results/capacity.json.

`pipeplan capacity llama-70b --hardware h100 --devices 64,256,1024` end to end as a subprocess (wall time, with
Python and torch start-up, and its CPU time, steadier on a shared machine), median of 3; then once in this process
the two parts: the analytic profile (meta device, 82 layers) and the sweep (memory screen + search per count).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="CLI runs (median kept)")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pipeplan.capacity.inputs import capacity_profile  # noqa: E402
from pipeplan.capacity.options import CAPACITY_PRECISION  # noqa: E402
from pipeplan.capacity.sweep import CapacityConfig, capacity_sweep, default_global_batch  # noqa: E402
from pipeplan.hardware import load_hardware  # noqa: E402
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.search.config import SearchConfig, default_memory_reserve  # noqa: E402

TARGET_S = 60.0
MODEL, HARDWARE, DEVICES = "llama-70b", "h100", (64, 256, 1024)
COMMAND = [
    sys.executable,
    "-m",
    "pipeplan",
    "capacity",
    MODEL,
    "--hardware",
    HARDWARE,
    "--devices",
    ",".join(map(str, DEVICES)),
    "--json",
]


def _run_cli() -> tuple[float, float, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(COMMAND, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def _parts() -> dict[str, float]:
    hardware = load_hardware(HARDWARE)
    start = time.perf_counter()
    profile = capacity_profile(MODEL, {}, seq=None, hardware=hardware, batch_size=1, quiet=True)
    profiled = time.perf_counter()
    batch = default_global_batch(profile.provenance.tokens_per_sample or 1, (1,))
    search = SearchConfig(
        global_batch_size=batch,
        precision=CAPACITY_PRECISION,
        replication=False,
        memory_reserve_bytes=default_memory_reserve(hardware.memory_bytes),
    )
    capacity_sweep(profile, CapacityConfig(hardware=hardware, device_counts=DEVICES, search=search))
    return {"profile_s": profiled - start, "sweep_s": time.perf_counter() - profiled}


def main(repeats: int) -> None:
    runs = [_run_cli() for _ in range(repeats)]
    walls, cpus, report = [r[0] for r in runs], [r[1] for r in runs], runs[-1][2]
    parts = _parts()
    console = Console(width=140)
    table = Table(title=f"pipeplan capacity {MODEL} --hardware {HARDWARE} --devices {','.join(map(str, DEVICES))}")
    for column in ("what", "median s", "runs s", "target s", "ratio to target"):
        table.add_column(column, justify="left" if column == "what" else "right")
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    table.add_row(
        "CLI wall", f"{wall:.1f}", " ".join(f"{w:.1f}" for w in walls), f"{TARGET_S:.0f}", f"{wall / TARGET_S:.2f}"
    )
    table.add_row("CLI CPU", f"{cpu:.1f}", " ".join(f"{c:.1f}" for c in cpus), "", f"{cpu / TARGET_S:.2f}")
    table.add_row("  analytic profile", f"{parts['profile_s']:.1f}", "(1 run)", "", "")
    table.add_row("  sweep (screen + search)", f"{parts['sweep_s']:.1f}", "(1 run)", "", "")
    console.print(table)
    rows = Table(title="rows")
    for column in ("devices", "plan", "tokens/s", "MFU", "binds"):
        rows.add_column(column)
    for row in report["rows"]:
        plan = (
            f"{row['schedule']} {row['pipeline_devices']}x{row['data_parallel']} m={row['num_microbatches']}"
            if row["fits"]
            else "does not fit"
        )
        speed = f"{row['tokens_per_s']:,.0f}" if row["fits"] else ""
        mfu = f"{row['mfu']:.1%}" if row["fits"] else ""
        rows.add_row(str(row["num_devices"]), plan, speed, mfu, row["binding"])
    console.print(rows)
    write_json(
        ROOT / "benchmarks" / "results" / "capacity.json",
        {
            "schema_version": 1,
            "command": " ".join(COMMAND[1:]),
            "target_s": TARGET_S,
            "wall_s": walls,
            "cpu_s": cpus,
            "median_wall_s": wall,
            "median_cpu_s": cpu,
            "parts_s": parts,
            "rows": report["rows"],
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        },
    )


if __name__ == "__main__":
    main(ARGS.repeats)
