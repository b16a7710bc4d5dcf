"""The machine's own drift (issue 37): how far one measurement of the same work moves when nothing in it changes,
through the CLI, back to back:
    pipeplan profile gpt -b 2 --threads 1 --json        (x --profiles, each process pinned to --core)
Per profile: the whole model's forward + backward (`whole_forward_ms` + `whole_backward_ms`) and the layers'
forward summed. The spread, (largest - smallest) / median, is a floor under what bench_refine.py can show: a
prediction made from one measurement cannot land closer to a later run than the machine's own measurements of
identical work land to each other. On a virtual machine the host's other guests share the physical cores
(invisible in the guest: no steal time is reported), so CPU time itself moves.
`--busy` keeps a busy-loop process on another core (bench_refine.py's condition).

Prints a table and writes results/machine_drift.json (every profile's figures, the load average before, the
medians and spreads).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--profiles", type=int, default=20, help="profiles back to back (default 20)")
    parser.add_argument("--core", type=int, default=1, help="the core each profile is pinned to (default 1)")
    parser.add_argument("--busy", action="store_true", help="a busy-loop process on core 0 throughout")
    parser.add_argument("--output", default="results/machine_drift.json", help="results file (default: %(default)s)")


if __name__ == "__main__":  # first of all: --help answers before anything is run
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ("profile", "gpt", "-b", "2", "--threads", "1", "--json")


def _busy_loop() -> None:  # pragma: no cover - a child process spinning until terminated
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    while True:
        pass


def _profile(core: int) -> dict:
    """One `pipeplan profile` on `core`: its whole-model and layer-sum times."""
    pin = (lambda: os.sched_setaffinity(0, {core})) if hasattr(os, "sched_setaffinity") else None
    began = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "pipeplan", *COMMAND], cwd=ROOT, capture_output=True, text=True, preexec_fn=pin
    )
    if done.returncode != 0:
        raise SystemExit(f"pipeplan {' '.join(COMMAND)} failed (exit {done.returncode}): {done.stderr.strip()}")
    profile = json.loads(done.stdout)
    return {
        "at_s": began,
        "whole_ms": profile["whole_forward_ms"] + profile["whole_backward_ms"],
        "layers_forward_ms": sum(layer["forward_ms"] for layer in profile["layers"]),
    }


def _spread(values: list[float]) -> dict:
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values), "spread": (max(values) - min(values)) / median}


def main(args) -> None:
    from rich.console import Console
    from rich.table import Table

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    busy = multiprocessing.Process(target=_busy_loop, daemon=True) if args.busy else None
    if busy is not None:
        busy.start()
    try:
        profiles = [_profile(args.core) for _ in range(args.profiles)]
    finally:
        if busy is not None:
            busy.terminate()
            busy.join()
    start = profiles[0]["at_s"]
    for entry in profiles:
        entry["at_s"] = round(entry["at_s"] - start, 1)
    summary = {key: _spread([p[key] for p in profiles]) for key in ("whole_ms", "layers_forward_ms")}
    table = Table(title=f"{args.profiles} profiles of identical work, back to back on core {args.core}")
    for column in ("figure", "median ms", "min", "max", "(max - min) / median"):
        table.add_column(column, justify="right")
    for key, row in summary.items():
        table.add_row(key, f"{row['median']:.2f}", f"{row['min']:.2f}", f"{row['max']:.2f}", f"{row['spread']:.0%}")
    Console().print(table)
    output = ROOT / "benchmarks" / args.output if not Path(args.output).is_absolute() else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    settings = {"profiles": args.profiles, "core": args.core, "busy": args.busy, "cores": os.cpu_count()}
    record = {"settings": settings, "load_average_1min": load, "summary": summary, "profiles": profiles}
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main(ARGS)
