"""Plans that learn from their runs (issue 37): the README tour's model through the CLI, per schedule,
    pipeplan profile gpt -b 2 -o gpt.json                                   (as the tour: torch's default threads)
    pipeplan plan gpt --profile gpt.json -n 2 -B 8 -s NAME -o DIR
    pipeplan run DIR/plan.json --steps S --trace DIR/measured.json         (before: measured / predicted)
    pipeplan refine DIR/measured.json -o DIR-refined                        (the run's plan timed again: refined)
    pipeplan run DIR-refined/plan.json --steps S --trace ...               (after: measured / predicted)
for 1f1b, zb-h1, zbv and interleaved, each round (`--repeats`, default 3) profiling again. The measured and
predicted steps are read from each run's trace (`run --trace` records the summary's figures). `--busy` keeps a
busy-loop process on one core for the whole benchmark (another job on a 2-core machine).

Targets (issue 37, "Done when"): measured / predicted within 0.85-1.15 before, 0.95-1.05 after one refine round
(medians over the rounds). Prints a table and writes results/refine.json (every round's figures and the medians).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from arguments import parse_args

SCHEDULES = ("1f1b", "zb-h1", "zbv", "interleaved")
BEFORE, AFTER = (0.85, 1.15), (0.95, 1.05)


def _options(parser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="rounds (profile, plan, run, refine, run); default 3")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--busy", action="store_true", help="a busy-loop process on one core throughout")
    parser.add_argument("--profile-threads", type=int, help="profile with --threads N (default: as the tour, none)")
    parser.add_argument("--keep", metavar="DIR", help="keep every profile, plan and trace under DIR")
    parser.add_argument("--output", default="results/refine.json", help="results file (default: %(default)s)")


if __name__ == "__main__":  # first of all: --help answers before anything is run
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> None:
    """One pipeplan command, as a user types it (this interpreter's pipeplan); its output passes through."""
    done = subprocess.run([sys.executable, "-m", "pipeplan", *args], cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"pipeplan {' '.join(args)} failed (exit {done.returncode})")


def _record(trace: Path) -> dict:
    return json.loads(trace.read_text())["pipeplan_measured"]["run"]


def _busy_loop() -> None:  # pragma: no cover - a child process spinning until terminated
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    while True:
        pass


def _round(folder: Path, schedules: list[str], steps: int, threads: int | None) -> dict:
    """One round: profile, then per schedule plan -> run -> refine -> run; each run's (measured, predicted)."""
    profile = folder / "gpt.json"
    _cli("profile", "gpt", "-b", "2", "-o", str(profile), *(("--threads", str(threads)) if threads else ()))
    found = {}
    for name in schedules:
        plan, refined = folder / name, folder / f"{name}-refined"
        _cli("plan", "gpt", "--profile", str(profile), "-n", "2", "-B", "8", "-s", name, "-o", str(plan))
        _cli("run", str(plan / "plan.json"), "--steps", str(steps), "--trace", str(plan / "measured.json"), "--quiet")
        refine_json = folder / f"{name}-refine.json"
        with refine_json.open("w") as sink:  # --json: the refined prediction of the run's own plan
            args = ["refine", str(plan / "measured.json"), "-o", str(refined), "--json"]
            if subprocess.run([sys.executable, "-m", "pipeplan", *args], cwd=ROOT, stdout=sink).returncode != 0:
                raise SystemExit(f"pipeplan refine for {name} failed")
        again = refined / "measured.json"
        _cli("run", str(refined / "plan.json"), "--steps", str(steps), "--trace", str(again), "--quiet")
        before, after, refine = _record(plan / "measured.json"), _record(again), json.loads(refine_json.read_text())
        found[name] = {
            "before": {"measured_ms": before["measured_ms"], "predicted_ms": before["predicted_ms"]},
            "refined_ms": refine["refined_ms"],  # the run's own plan timed with the refined profile
            "new_plan": refine["new_plan"]["description"],
            "after": {"measured_ms": after["measured_ms"], "predicted_ms": after["predicted_ms"]},
        }
    return found


def _ratio(entry: dict) -> float:
    return entry["measured_ms"] / entry["predicted_ms"]


def _summary(rounds: list[dict], schedules: list[str]) -> dict:
    medians = {}
    for name in schedules:
        before = statistics.median(_ratio(r[name]["before"]) for r in rounds)
        after = statistics.median(_ratio(r[name]["after"]) for r in rounds)
        refined = statistics.median(r[name]["before"]["measured_ms"] / r[name]["refined_ms"] for r in rounds)
        medians[name] = {
            "before": before,
            "before_within": BEFORE[0] <= before <= BEFORE[1],
            "measured_over_refined": refined,
            "after": after,
            "after_within": AFTER[0] <= after <= AFTER[1],
        }
    return medians


def main(args) -> None:
    from rich.console import Console
    from rich.table import Table

    schedules = [s for s in args.schedules.split(",") if s]
    busy = multiprocessing.Process(target=_busy_loop, daemon=True) if args.busy else None
    if busy is not None:
        busy.start()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            base = Path(args.keep or scratch)
            rounds = [
                _round(base / f"round{i}", schedules, args.steps, args.profile_threads) for i in range(args.repeats)
            ]
    finally:
        if busy is not None:
            busy.terminate()
            busy.join()
    medians = _summary(rounds, schedules)
    table = Table(
        title=f"measured / predicted, medians over {args.repeats} round(s){' (busy core)' if args.busy else ''}"
    )
    for column in ("schedule", "before", "0.85-1.15", "measured / refined", "after refine", "0.95-1.05"):
        table.add_column(column)
    for name, row in medians.items():
        table.add_row(
            name,
            f"{row['before']:.2f}",
            "yes" if row["before_within"] else "no",
            f"{row['measured_over_refined']:.2f}",
            f"{row['after']:.2f}",
            "yes" if row["after_within"] else "no",
        )
    Console().print(table)
    output = ROOT / "benchmarks" / args.output if not Path(args.output).is_absolute() else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    settings = {"repeats": args.repeats, "steps": args.steps, "busy": args.busy, "cores": os.cpu_count()}
    output.write_text(json.dumps({"settings": settings, "medians": medians, "rounds": rounds}, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main(ARGS)
