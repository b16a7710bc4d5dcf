"""Planner benchmarks; prints two tables and writes results/planner.json.

1. Speed (target < 10 s): `pipeplan plan --profile` for a 48-layer GPT (gpt2-1.5b shapes, profiled analytically
   for h100) on 64 devices (8 nodes x 8), end to end as a subprocess (wall time, including Python and torch
   start-up; also its CPU time, steadier on a shared machine) and the search alone in this process; medians.
2. Quality: for gpt (gpt2-1.5b shapes, microbatch 4) and resnet (16 blocks, 128 channels, 128x128 images,
   microbatch 128), analytic a100-40gb profiles — neither fits one 40 GB device with its optimizer state and
   activations — on 4 and 8 devices: the chosen plan's predicted throughput vs a uniform split (equal layer
   counts, one stage per device, no data parallelism) run with 1f1b, and vs the best plan of the single schedule
   that is best over all cases (one fixed schedule for everything). Predictions are deterministic; ratios > 1
   favour the planner.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from arguments import parse_args

if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    parse_args(__doc__)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from timing import median_seconds  # noqa: E402

from pipeplan.costs import LayerArrays  # noqa: E402
from pipeplan.hardware import cluster_for  # noqa: E402
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.models import load_model  # noqa: E402
from pipeplan.partition import single  # noqa: E402
from pipeplan.partition.partitioner import build_partition, one_level  # noqa: E402
from pipeplan.profiling.analytic import profile_analytic  # noqa: E402
from pipeplan.profiling.profile import Profile  # noqa: E402
from pipeplan.schedules.registry import SCHEDULE_NAMES  # noqa: E402
from pipeplan.search.candidate import Layout, evaluate_partition, partition_config, pipeline_cluster  # noqa: E402
from pipeplan.search.config import SearchConfig  # noqa: E402
from pipeplan.search.search import search_plans  # noqa: E402

REPEATS = 3
SPEED_TARGET_S = 10.0
HARDWARE = "h100"  # speed case
QUALITY_HARDWARE = "a100-40gb"  # models that do not fit one device, so the pipeline layout matters
MODELS = {
    "gpt": ("gpt2-1.5b", {}, 4),  # (model, options, microbatch size)
    "resnet": ("resnet", {"blocks": "16", "channels": "128", "image": "128"}, 128),
}
DEVICES = (4, 8)
MICROBATCHES_PER_DEVICE = 4  # global batch = microbatch size x 4 x devices


def _run(command: list[str]) -> float:
    """Run `command`; return the CPU seconds (user + system) it used — steadier than wall time on a busy machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def speed(workdir: Path) -> dict:
    profile = profile_analytic(load_model("gpt2-1.5b"), batch_size=1, hardware=HARDWARE, precision="bf16-mixed")
    path = workdir / "gpt48.json"
    profile.save(path)
    cluster = cluster_for(HARDWARE, 64, 8)
    config = SearchConfig(global_batch_size=256, precision="bf16-mixed")
    search_s, result = median_seconds(lambda: search_plans(profile, cluster, config), REPEATS)
    command = [
        sys.executable,
        "-m",
        "pipeplan",
        "plan",
        "--profile",
        str(path),
        "--hardware",
        HARDWARE,
        "--devices",
        "64",
        "--devices-per-node",
        "8",
        "--global-batch-size",
        "256",
        "-o",
        str(workdir / "plan64"),
        "--json",
    ]
    cpu_times: list[float] = []
    cli_s, _ = median_seconds(lambda: cpu_times.append(_run(command)), REPEATS)
    return {
        "load_average_1min": os.getloadavg()[0],  # wall times stretch on a shared machine; CPU time does not
        "cpu_count": os.cpu_count(),
        "layers": profile.num_layers,
        "devices": 64,
        "global_batch_size": 256,
        "search_s": search_s,
        "cli_s": cli_s,
        "cli_cpu_s": statistics.median(cpu_times),
        "target_s": SPEED_TARGET_S,
        "ok": cli_s < SPEED_TARGET_S,
        "chosen": result.best.layout.label,
        "candidates_evaluated": len(result.ranked),
        "candidates_rejected": len(result.rejected),
    }


def _uniform_1f1b(profile: Profile, devices: int, global_batch: int, microbatch: int) -> float | None:
    """Samples/s of equal-layer-count stages on every device (d = 1) with 1f1b; None if it does not fit."""
    cluster = cluster_for(QUALITY_HARDWARE, devices, 8)
    layout = Layout(
        schedule="1f1b",
        microbatch_size=microbatch,
        data_parallel=1,
        pipeline_devices=devices,
        num_microbatches=global_batch // microbatch,
        mode="straight",
    )
    bounds = [round(profile.num_layers * s / devices) for s in range(devices + 1)]
    part = fixed_cut_partition(
        profile,
        pipeline_cluster(cluster, devices),
        partition_config(layout, "adamw-bf16", precision="bf16-mixed"),
        bounds,
    )
    if part is None or max(part.device_memory_bytes) > cluster.memory_per_device:
        return None
    result = evaluate_partition(
        layout, part, profile, cluster, optimizer="adamw-bf16", global_batch_size=global_batch, precision="bf16-mixed"
    )
    return getattr(result, "samples_per_s", None)


def fixed_cut_partition(profile: Profile, cluster, config, bounds: list[int]):
    """A Partition with the given stage boundaries, costed by the partitioner's own bookkeeping (no search); None
    when a stage does not fit the device's memory."""
    arrays = LayerArrays.from_profile(profile)
    level = one_level(arrays, cluster, config, float(cluster.memory_per_device))
    stages = [(a, b - 1, 1) for a, b in zip(bounds, bounds[1:])]
    if None in single.stage_modes(level, stages, single.inflight_counts(config, len(stages))):
        return None
    raw = single.describe(level, stages)
    objective = max(stage.time_ms for stage in raw)
    return build_partition(arrays, cluster, config, raw, objective=objective, layer_groups=arrays.num_items)


def quality() -> list[dict]:
    rows = []
    for name, (ref, options, microbatch) in MODELS.items():
        profile = profile_analytic(
            load_model(ref, options), batch_size=microbatch, hardware=QUALITY_HARDWARE, precision="bf16-mixed"
        )
        for devices in DEVICES:
            global_batch = microbatch * MICROBATCHES_PER_DEVICE * devices
            cluster = cluster_for(QUALITY_HARDWARE, devices, 8)
            config = SearchConfig(
                global_batch_size=global_batch, microbatch_sizes=(microbatch,), precision="bf16-mixed"
            )
            best = search_plans(profile, cluster, config).best
            per_schedule = {}
            for schedule in SCHEDULE_NAMES:
                try:
                    per_schedule[schedule] = search_plans(profile, cluster, config, [schedule]).best.samples_per_s
                except Exception as exc:  # noqa: BLE001  (a schedule with no feasible layout scores 0)
                    per_schedule[schedule] = 0.0 if "no plan" in str(exc) else float("nan")
            rows.append(
                {
                    "model": name,
                    "devices": devices,
                    "global_batch_size": global_batch,
                    "microbatch_size": microbatch,
                    "chosen": best.layout.label,
                    "chosen_samples_per_s": best.samples_per_s,
                    "uniform_1f1b_samples_per_s": _uniform_1f1b(profile, devices, global_batch, microbatch),
                    "per_schedule_samples_per_s": per_schedule,
                }
            )
    fixed = max(
        SCHEDULE_NAMES,
        key=lambda s: statistics.geometric_mean(
            [max(r["per_schedule_samples_per_s"][s], 1e-9) / r["chosen_samples_per_s"] for r in rows]
        ),
    )
    for row in rows:
        row["best_fixed_schedule"] = fixed
        row["best_fixed_samples_per_s"] = row["per_schedule_samples_per_s"][fixed]
        uniform = row["uniform_1f1b_samples_per_s"]
        row["vs_uniform_1f1b"] = row["chosen_samples_per_s"] / uniform if uniform else None
        row["vs_best_fixed"] = row["chosen_samples_per_s"] / row["best_fixed_samples_per_s"]
    return rows


def _print(speed_row: dict, rows: list[dict]) -> None:
    console = Console()
    title = (
        f"planner speed: median of {REPEATS} runs (s), {platform.node()}, {speed_row['cpu_count']} CPUs, "
        f"load average {speed_row['load_average_1min']:.1f}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("layers", "devices", "search", "CLI end to end", "CLI CPU time", "target", "ok", "chosen"):
        table.add_column(column, justify="left" if column == "chosen" else "right")
    r = speed_row
    cells = [f"{r['search_s']:.2f}", f"{r['cli_s']:.2f}", f"{r['cli_cpu_s']:.2f}", f"< {r['target_s']:.0f}"]
    table.add_row(str(r["layers"]), str(r["devices"]), *cells, "yes" if r["ok"] else "NO", r["chosen"])
    console.print(table)
    title = f"planner quality: predicted samples/s ({QUALITY_HARDWARE} analytic profiles)"
    table = Table(title=title, title_justify="left")
    for column in ("model", "devices", "chosen plan", "samples/s", "uniform 1f1b", "x", "fixed schedule", "x"):
        table.add_column(column, justify="left" if column in ("model", "chosen plan", "fixed schedule") else "right")
    for row in rows:
        uniform = row["uniform_1f1b_samples_per_s"]
        table.add_row(
            row["model"],
            str(row["devices"]),
            row["chosen"],
            f"{row['chosen_samples_per_s']:.1f}",
            f"{uniform:.1f}" if uniform else "OOM",
            f"{row['vs_uniform_1f1b']:.2f}" if uniform else "-",
            f"{row['best_fixed_schedule']} {row['best_fixed_samples_per_s']:.1f}",
            f"{row['vs_best_fixed']:.2f}",
        )
    console.print(table)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pipeplan-bench-") as tmp:
        speed_row = speed(Path(tmp))
    rows = quality()
    _print(speed_row, rows)
    write_json(
        ROOT / "benchmarks" / "results" / "planner.json",
        {
            "schema_version": 1,
            "machine": platform.node(),
            "python": platform.python_version(),
            "speed": speed_row,
            "quality": rows,
        },
    )
    return 0 if speed_row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
