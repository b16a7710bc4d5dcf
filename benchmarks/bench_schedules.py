"""Schedule generation and simulation speed (targets: simulate any schedule at p=64, m=512 in < 2 s; generate
zb-auto at p=32, m=128 in < 5 s). Prints a table of medians over repeats and writes results/schedules.json."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from timing import median_seconds  # noqa: E402

from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.schedules import SCHEDULE_NAMES, StageCosts, generate, simulate  # noqa: E402

REPEATS = 3
SIMULATE_TARGET_S = 2.0
ZB_AUTO_TARGET_S = 5.0


def _case(name: str, p: int, m: int, costs: StageCosts, target: float | None, *, timed: str = "simulate_s") -> dict:
    gen_s, schedule = median_seconds(lambda: generate(name, num_devices=p, num_microbatches=m, costs=costs), REPEATS)
    v = schedule.num_chunks
    stage_costs = StageCosts(forward_ms=1.0 / v, input_grad_ms=1.0 / v, weight_grad_ms=1.0 / v, comm_ms=0.05)
    sim_s, timeline = median_seconds(lambda: simulate(schedule, stage_costs), REPEATS)
    ops = sum(map(len, schedule.device_ops))
    row = {
        "schedule": name, "devices": p, "microbatches": m, "ops": ops,
        "generate_s": gen_s, "simulate_s": sim_s, "target_s": target, "target_of": timed,
        "makespan_ms": timeline.makespan,
    }  # fmt: skip
    row["ok"] = target is None or row[timed] <= target
    return row


def main() -> int:
    rows = [_case(name, 64, 512, StageCosts(), SIMULATE_TARGET_S) for name in SCHEDULE_NAMES if name != "zb-auto"]
    skewed = StageCosts(forward_ms=(1.0,) * 31 + (1.5,), comm_ms=0.05)
    rows.append(_case("zb-auto", 32, 128, skewed, ZB_AUTO_TARGET_S, timed="generate_s"))
    rows.append(_case("zb-auto", 64, 512, StageCosts(), SIMULATE_TARGET_S))  # generation here has no target
    table = Table(title=f"schedules: median of {REPEATS} runs (seconds)", title_justify="left")
    for column in ("schedule", "p", "m", "ops", "generate", "simulate", "target", "ok"):  # target: of the timed column
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for row in rows:
        target = "-" if row["target_s"] is None else f"{row['target_of'][:-2]} < {row['target_s']:.0f}"
        table.add_row(
            row["schedule"], str(row["devices"]), str(row["microbatches"]), str(row["ops"]),
            f"{row['generate_s']:.3f}", f"{row['simulate_s']:.3f}", target, "yes" if row["ok"] else "NO",
        )  # fmt: skip
    Console().print(table)
    write_json(
        ROOT / "benchmarks" / "results" / "schedules.json",
        {"schema_version": 1, "python": platform.python_version(), "machine": platform.machine(), "rows": rows},
    )
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
