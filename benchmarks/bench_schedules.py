"""Schedules: speed (simulate any schedule at p=64, m=512 in < 2 s; generate zb-auto there in < 1 s) and quality:
zb-auto against the Zero Bubble paper's ZB-1p / ZB-2p figures and the no-bubble bound m(F+I+W), adaptive vs
fixed ZB-V over a grid of cost ratios, and zb-auto against the exact MILP optimum on small cases.
Prints tables of medians over repeats and writes results/schedules.json."""

from __future__ import annotations

import itertools
import platform
import statistics
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from arguments import parse_args

if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    parse_args(__doc__)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the exact MILP (tests/helpers/milp.py)

from helpers.milp import solve_milp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from timing import median_seconds  # noqa: E402

from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.schedules import SCHEDULE_NAMES, StageCosts, generate, simulate, unit_memory  # noqa: E402
from pipeplan.schedules.generators.zb_heuristic import heuristic_runs  # noqa: E402
from pipeplan.schedules.generators.zbv import zbv_fixed  # noqa: E402
from pipeplan.schedules.registry import clear_schedule_cache  # noqa: E402
from pipeplan.schedules.simulate import activation_deltas  # noqa: E402

REPEATS = 3
SIMULATE_TARGET_S = 2.0
ZB_AUTO_TARGET_S = 1.0
MILP_TIME_LIMIT_S = 60.0
# (p, m, F, I, W, comm, ZB-1p span, ZB-2p span) from the paper
PAPER = [
    (4, 8, 1, 1, 1, 0, 27, 24),
    (8, 24, 1, 1, 1, 0, 79, 72),
    (4, 8, 3, 3, 2, 1, 88, 74),
    (8, 32, 6, 6, 4, 1, 596, 520),
]
console = Console(width=150)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _speed_case(name: str, p: int, m: int, costs: StageCosts, target: float | None, timed: str) -> dict:
    def cold_generate():  # generate() caches fixed orders: time it as a first call
        clear_schedule_cache()
        return generate(name, num_devices=p, num_microbatches=m, costs=costs)

    gen_s, schedule = median_seconds(cold_generate, REPEATS)
    v = schedule.num_chunks
    stage_costs = StageCosts(forward_ms=1.0 / v, input_grad_ms=1.0 / v, weight_grad_ms=1.0 / v, comm_ms=0.05)
    # a copy per run: simulate checks a schedule object once and replays its order, so time the first check too
    sim_s, timeline = median_seconds(lambda: simulate(replace(schedule), stage_costs), REPEATS)
    row = {
        "schedule": name,
        "devices": p,
        "microbatches": m,
        "ops": sum(map(len, schedule.device_ops)),
        "generate_s": gen_s,
        "simulate_s": sim_s,
        "target_s": target,
        "target_of": timed,
        "makespan_ms": timeline.makespan,
    }
    row["ok"] = target is None or row[timed] <= target
    return row


def speed() -> list[dict]:
    rows = [
        _speed_case(name, 64, 512, StageCosts(), SIMULATE_TARGET_S, "simulate_s")
        for name in SCHEDULE_NAMES
        if name != "zb-auto"
    ]
    rows.append(_speed_case("zb-auto", 64, 512, StageCosts(), ZB_AUTO_TARGET_S, "generate_s"))
    skewed = StageCosts(forward_ms=(1.0,) * 31 + (1.5,), comm_ms=0.05)
    rows.append(_speed_case("zb-auto", 32, 128, skewed, None, "generate_s"))
    _table(
        f"schedule speed: median of {REPEATS} runs (seconds)",
        ["schedule", "p", "m", "ops", "generate", "simulate", "target", "ok"],
        [
            [
                r["schedule"],
                str(r["devices"]),
                str(r["microbatches"]),
                str(r["ops"]),
                f"{r['generate_s']:.3f}",
                f"{r['simulate_s']:.3f}",
                "-" if r["target_s"] is None else f"{r['target_of'][:-2]} < {r['target_s']:g}",
                "yes" if r["ok"] else "NO",
            ]
            for r in rows
        ],
    )
    return rows


def paper() -> list[dict]:
    rows = []
    for p, m, f, i, w, c, one_p, two_p in PAPER:
        costs = StageCosts(forward_ms=f, input_grad_ms=i, weight_grad_ms=w, comm_ms=c)
        for label, limit, figure in (("ZB-1p", p, one_p), ("ZB-2p", 2 * p, two_p)):
            gen_s, auto = median_seconds(
                partial(generate, "zb-auto", num_devices=p, num_microbatches=m, costs=costs, memory_limit=limit),
                REPEATS,
            )
            timeline = simulate(auto, costs)
            runs = heuristic_runs(m, costs.per_stage(p), activation_deltas(unit_memory(1), p), limit)
            best_span = min(r.max_span for r in runs)
            rows.append(
                {
                    "case": label,
                    "devices": p,
                    "microbatches": m,
                    "f": f,
                    "i": i,
                    "w": w,
                    "comm": c,
                    "limit": limit,
                    "paper_span": figure,
                    "heuristic_best_span": best_span,
                    "zb_auto_span": timeline.max_span,
                    "zb_auto_makespan": timeline.makespan,
                    "span_vs_paper": best_span / figure,
                    "zb_auto_span_vs_paper": timeline.max_span / figure,
                    "span_vs_no_bubble": timeline.max_span / (m * (f + i + w)),
                    "generate_s": gen_s,
                }
            )
    _table(
        "zb-auto vs the paper (spans; zb-auto ranks its candidates by makespan)",
        ["case", "p", "m", "F/I/W/c", "paper", "heuristic", "zb-auto span", "makespan", "span/bound", "gen s"],
        [
            [
                r["case"],
                str(r["devices"]),
                str(r["microbatches"]),
                _costs_text(r),
                f"{r['paper_span']:g}",
                f"{r['heuristic_best_span']:g}",
                f"{r['zb_auto_span']:g}",
                f"{r['zb_auto_makespan']:g}",
                f"{r['span_vs_no_bubble']:.3f}",
                f"{r['generate_s']:.4f}",
            ]
            for r in rows
        ],
    )
    return rows


def zbv_grid() -> dict:
    rows = []
    for p, mult, f, i, w, c in itertools.product(
        (2, 4, 8), (2, 3, 4), (1.0, 2.0), (1.0, 2.0), (0.5, 1.0, 2.0), (0.0, 0.2)
    ):
        m = mult * p
        costs = StageCosts(forward_ms=f, input_grad_ms=i, weight_grad_ms=w, comm_ms=c)
        fixed = simulate(zbv_fixed(p, m), costs).makespan
        gen_s, adaptive = median_seconds(partial(generate, "zbv", num_devices=p, num_microbatches=m, costs=costs), 1)
        makespan = simulate(adaptive, costs).makespan
        rows.append(
            {
                "devices": p,
                "microbatches": m,
                "f": f,
                "i": i,
                "w": w,
                "comm": c,
                "fixed_makespan": fixed,
                "adaptive_makespan": makespan,
                "ratio": makespan / fixed,
                "generate_s": gen_s,
            }
        )
    ratios = [r["ratio"] for r in rows]
    summary = {
        "cases": len(rows),
        "better_by_1pct": sum(r < 0.99 for r in ratios),
        "worse": sum(r > 1 + 1e-9 for r in ratios),
        "min_ratio": min(ratios),
        "median_ratio": statistics.median(ratios),
        "median_generate_s": statistics.median(r["generate_s"] for r in rows),
    }
    _table(
        "zbv adaptive / fixed makespan (per stage: F, I in {1,2}, W in {0.5,1,2}, comm in {0,0.2}; p in {2,4,8}, "
        "m in {2p,3p,4p}; at the fixed order's peak memory)",
        ["cases", "better by >1%", "worse", "best ratio", "median ratio", "median generate s"],
        [
            [
                str(summary["cases"]),
                str(summary["better_by_1pct"]),
                str(summary["worse"]),
                f"{summary['min_ratio']:.4f}",
                f"{summary['median_ratio']:.4f}",
                f"{summary['median_generate_s']:.3f}",
            ]
        ],
    )
    return {"summary": summary, "rows": rows}


def _costs_text(row: dict) -> str:
    parts = [row[k] for k in ("f", "i", "w", "comm")]
    return "/".join(",".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}" for v in parts)


def milp() -> list[dict]:
    heavy = StageCosts(forward_ms=3, input_grad_ms=3, weight_grad_ms=2, comm_ms=1)
    cases = [
        (2, 4, StageCosts(), 2),
        (3, 4, StageCosts(), 3),
        (3, 4, StageCosts(), 6),
        (4, 4, StageCosts(), 4),
        (3, 6, heavy, 3),
        (3, 6, heavy, 6),
        (4, 5, heavy, 4),
        (4, 5, heavy, 8),
        (4, 5, StageCosts(forward_ms=(1, 2, 1, 1), input_grad_ms=(1, 2, 1, 1), comm_ms=0.3), 4),
        (3, 5, StageCosts(forward_ms=2, input_grad_ms=1, weight_grad_ms=2), 2),
    ]
    rows = []
    for p, m, costs, limit in cases:
        auto = simulate(generate("zb-auto", num_devices=p, num_microbatches=m, costs=costs, memory_limit=limit), costs)
        solve_s, result = median_seconds(
            partial(solve_milp, p, m, costs=costs, memory_limit=limit, time_limit=MILP_TIME_LIMIT_S), 1
        )
        assert result is not None
        rows.append(
            {
                "devices": p,
                "microbatches": m,
                "f": costs.forward_ms,
                "i": costs.input_grad_ms,
                "w": costs.weight_grad_ms,
                "comm": costs.comm_ms,
                "limit": limit,
                "zb_auto_makespan": auto.makespan,
                "milp_makespan": result.value,
                "milp_bound": result.bound,
                "proven": result.proven,
                "heuristic_over_optimal": auto.makespan / result.value,
                "solve_s": solve_s,
            }
        )
    _table(
        f"zb-auto / MILP optimum (makespan; HiGHS, time limit {MILP_TIME_LIMIT_S:g} s)",
        ["p", "m", "F/I/W/c", "limit", "zb-auto", "MILP", "proven", "ratio", "solve s"],
        [
            [
                str(r["devices"]),
                str(r["microbatches"]),
                _costs_text(r),
                f"{r['limit']:g}",
                f"{r['zb_auto_makespan']:g}",
                f"{r['milp_makespan']:.4g}",
                "yes" if r["proven"] else "no",
                f"{r['heuristic_over_optimal']:.4f}",
                f"{r['solve_s']:.1f}",
            ]
            for r in rows
        ],
    )
    return rows


def main() -> int:
    rows = speed()
    results = {
        "schema_version": 2,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
        "paper": paper(),
        "zbv": zbv_grid(),
        "milp": milp(),
    }
    write_json(ROOT / "benchmarks" / "results" / "schedules.json", results)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
