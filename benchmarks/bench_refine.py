"""Plans that learn from their runs (issue 37): the README tour's model through the CLI, per schedule,
    pipeplan profile gpt -b 2 --concurrent 2 -o gpt.json                   (as the tour: beside a sibling rank)
    [pipeplan calibrate --device cpu -o hw.json]                           (--calibrate: this machine's gloo links)
    pipeplan plan gpt --profile gpt.json -n 2 -B 8 -s NAME -o DIR [--hardware hw.json:cpu]
    pipeplan run DIR/plan.json --steps S --trace DIR/measured-0.json       (before: measured / predicted; x3)
    pipeplan refine DIR/measured-0.json --with DIR/measured-1.json -o DIR-refined   (the runs pooled)
    pipeplan run DIR-refined/plan.json --steps S --trace ...               (after: measured / predicted)
for 1f1b, zb-h1, zbv and interleaved, each round (`--repeats`, default 3) profiling again. The plan runs
`--learn-from` times (default 3) and refine pools those runs; then the refined plan runs `--alternations` times
(default 3), alternating with more runs of the plan (after, before, after, before, after), each `--steps` long
(default 64; the trace keeps every step, `--trace-steps`, so refine learns from the steps the measured median is
taken over): the machine's load drifts over minutes, and alternating gives both plans the same drift. Before and
after are medians over every run of the plan and of the refined plan. The measured and predicted steps are read from
each run's trace (`run --trace` records the summary's figures). The noise floor is the same-plan run-to-run spread:
per plan, (largest - smallest) / median of its runs' measured steps.
`--busy` keeps a busy-loop process on one core for the whole benchmark (another job on a 2-core machine).

Targets (issue 37, "Done when"): measured / predicted within 0.85-1.15 before, 0.95-1.05 after one refine round
(medians over the rounds' runs). Prints a table and writes results/refine.json (every run's figures, the load
average at each round's start, and the medians).
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
    parser.add_argument("--steps", type=int, default=64, help="training steps per run (default 64)")
    parser.add_argument("--learn-from", type=int, default=3, help="runs refine pools (--with); default 3")
    parser.add_argument("--alternations", type=int, default=3, help="runs of the refined plan (default 3)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--busy", action="store_true", help="a busy-loop process on one core throughout")
    parser.add_argument("--concurrent", type=int, default=2, help="profile --concurrent N (default 2: the tour's)")
    parser.add_argument("--profile-threads", type=int, help="profile with --threads N (default: the tour's, none)")
    parser.add_argument("--calibrate", action="store_true", help="plan with this machine's calibrated links")
    parser.add_argument("--keep", metavar="DIR", help="keep every profile, plan and trace under DIR")
    parser.add_argument("--output", default="results/refine.json", help="results file (default: %(default)s)")


if __name__ == "__main__":  # first of all: --help answers before anything is run
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, stdout=None) -> None:
    """One pipeplan command, as a user types it (this interpreter's pipeplan); its output passes through."""
    done = subprocess.run([sys.executable, "-m", "pipeplan", *args], cwd=ROOT, stdout=stdout)
    if done.returncode != 0:
        raise SystemExit(f"pipeplan {' '.join(args)} failed (exit {done.returncode})")


def _record(trace: Path) -> dict:
    run = json.loads(trace.read_text())["pipeplan_measured"]["run"]
    return {"measured_ms": run["measured_ms"], "predicted_ms": run["predicted_ms"]}


def _busy_loop() -> None:  # pragma: no cover - a child process spinning until terminated
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    while True:
        pass


def _run(plan_dir: Path, steps: int, index: int) -> dict:
    trace = plan_dir / f"measured-{index}.json"
    _cli(
        "run",
        str(plan_dir / "plan.json"),
        "--steps",
        str(steps),
        "--trace",
        str(trace),
        "--trace-steps",
        str(steps),
        "--quiet",
    )
    return _record(trace)


def _schedule(folder: Path, name: str, profile: Path, hardware: tuple[str, ...], args) -> dict:
    """plan -> `--learn-from` runs -> refine from them pooled, then the refined plan and the plan run alternately
    (after, before, after, ...: `--alternations` runs of the refined plan); every run's figures."""
    plan, refined = folder / name, folder / f"{name}-refined"
    _cli("plan", "gpt", "--profile", str(profile), "-n", "2", "-B", "8", "-s", name, "-o", str(plan), *hardware)
    before = [_run(plan, args.steps, index) for index in range(args.learn_from)]
    refine_json = folder / f"{name}-refine.json"
    pooled = [arg for index in range(1, args.learn_from) for arg in ("--with", str(plan / f"measured-{index}.json"))]
    with refine_json.open("w") as sink:  # --json: the refined prediction of the run's own plan
        _cli("refine", str(plan / "measured-0.json"), *pooled, "-o", str(refined), "--json", stdout=sink)
    refine = json.loads(refine_json.read_text())
    learned = json.loads((refined / "profile.json").read_text())["provenance"]
    ops = refine["ops"]
    after = []
    for index in range(args.alternations):
        after.append(_run(refined, args.steps, index))
        if index + 1 < args.alternations:
            before.append(_run(plan, args.steps, args.learn_from + index))
    return {
        "before": before,
        "learned_from": args.learn_from,  # the first runs of "before", pooled by refine (--with)
        "refined_ms": refine["refined_ms"],  # the run's own plan timed with the refined profile
        "refine_measured_ms": refine["measured_ms"],  # the median of the pooled runs' measured steps
        "new_plan": refine["new_plan"]["description"],
        # what the pooled runs showed beside the plan: every op's median over its planned time (summed over the
        # (stage, kind) ops), the per-op term refine learned, each rank's step tail measured vs planned
        "ops_measured_over_planned": sum(o["measured_ms"] for o in ops) / sum(o["planned_ms"] for o in ops),
        "op_overhead_ms": learned.get("op_overhead_ms"),
        # the tail's parts refine learned (refine/updates.py; absent: not learned, e.g. a post-validated run)
        "exchange_efficiency": learned.get("exchange_efficiency"),
        "step_checks_ms": learned.get("step_checks_ms"),
        "step_tail_ms": {key: refine["step_tail_ms"][key] for key in ("measured", "planned", "refined", "parts")},
        "after": after,
    }


def _round(folder: Path, schedules: list[str], args) -> dict:
    """One round: profile (and calibrate), then every schedule."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    profile = folder / "gpt.json"
    threads = ("--threads", str(args.profile_threads)) if args.profile_threads else ()
    _cli("profile", "gpt", "-b", "2", "-o", str(profile), "--concurrent", str(args.concurrent), *threads)
    hardware: tuple[str, ...] = ()
    if args.calibrate:
        _cli("calibrate", "--device", "cpu", "-o", str(folder / "hw.json"))
        hardware = ("--hardware", f"{folder / 'hw.json'}:cpu")
    found: dict = {"load_average_1min": load}
    for name in schedules:
        found[name] = _schedule(folder, name, profile, hardware, args)
    return found


def _ratio(entry: dict) -> float:
    return entry["measured_ms"] / entry["predicted_ms"]


def _spread(runs: list[dict]) -> float:
    steps = [run["measured_ms"] for run in runs]
    return (max(steps) - min(steps)) / statistics.median(steps) if len(steps) > 1 else 0.0


def _summary(rounds: list[dict], schedules: list[str]) -> dict:
    medians = {}
    for name in schedules:
        entries = [r[name] for r in rounds]
        before = statistics.median(_ratio(run) for e in entries for run in e["before"])
        after = statistics.median(_ratio(run) for e in entries for run in e["after"])
        refined = statistics.median(e["refine_measured_ms"] / e["refined_ms"] for e in entries)
        noise = statistics.median(_spread(e[kind]) for e in entries for kind in ("before", "after"))
        tails = [sum(e["step_tail_ms"]["measured"]) / sum(e["step_tail_ms"]["planned"]) for e in entries]
        medians[name] = {
            "before": before,
            "before_within": BEFORE[0] <= before <= BEFORE[1],
            "measured_over_refined": refined,
            "after": after,
            "after_within": AFTER[0] <= after <= AFTER[1],
            "same_plan_spread": noise,
            "ops_measured_over_planned": statistics.median(e["ops_measured_over_planned"] for e in entries),
            "op_overhead_ms": statistics.median(e["op_overhead_ms"] or 0.0 for e in entries),
            "tail_measured_over_planned": statistics.median(tails),
            "exchange_efficiency": _median_of(e.get("exchange_efficiency") for e in entries),
            "step_checks_ms": _median_of(e.get("step_checks_ms") for e in entries),
        }
    return medians


def _median_of(values) -> float | None:
    """The median of the rounds' learned figures (None where a round learned none: no marks)."""
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _table(medians: dict, args):
    from rich.table import Table

    busy = " (busy core)" if args.busy else ""
    title = f"measured / predicted, medians over {args.repeats} round(s) of every run{busy}"
    table = Table(title=title)
    columns = ("schedule", "before", "0.85-1.15", "measured / refined", "after refine", "0.95-1.05", "noise")
    for column in (*columns, "ops m/p", "tails m/p", "per-op ms", "exchange eff", "checks ms"):
        table.add_column(column)
    for name, row in medians.items():
        table.add_row(
            name,
            f"{row['before']:.2f}",
            "yes" if row["before_within"] else "no",
            f"{row['measured_over_refined']:.2f}",
            f"{row['after']:.2f}",
            "yes" if row["after_within"] else "no",
            f"{row['same_plan_spread']:.0%}",
            f"{row['ops_measured_over_planned']:.2f}",
            f"{row['tail_measured_over_planned']:.2f}",
            f"{row['op_overhead_ms']:.2f}",
            "-" if row["exchange_efficiency"] is None else f"{row['exchange_efficiency']:.2f}",
            "-" if row["step_checks_ms"] is None else f"{row['step_checks_ms']:.2f}",
        )
    return table


def main(args) -> None:
    from rich.console import Console

    schedules = [s for s in args.schedules.split(",") if s]
    busy = multiprocessing.Process(target=_busy_loop, daemon=True) if args.busy else None
    if busy is not None:
        busy.start()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            base = Path(args.keep or scratch)
            rounds = [_round(base / f"round{i}", schedules, args) for i in range(args.repeats)]
    finally:
        if busy is not None:
            busy.terminate()
            busy.join()
    medians = _summary(rounds, schedules)
    Console().print(_table(medians, args))
    output = ROOT / "benchmarks" / args.output if not Path(args.output).is_absolute() else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        key: getattr(args, key)
        for key in (
            "repeats",
            "steps",
            "learn_from",
            "alternations",
            "busy",
            "concurrent",
            "profile_threads",
            "calibrate",
        )
    }
    settings["cores"] = os.cpu_count()
    output.write_text(json.dumps({"settings": settings, "medians": medians, "rounds": rounds}, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main(ARGS)
