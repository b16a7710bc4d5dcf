"""CLI start-up (issue 23): wall seconds of commands that need no torch, against `python -c "import torch"` measured
in the same run (the time every command paid before). Targets: `pipeplan --help` < 0.5 s, `simulate -p 4 -m 8`
< 1 s. Medians of --repeats fresh interpreters each (7); writes results/cli.json."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--repeats", type=int, default=7, help="fresh interpreters per command (median kept)")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

HERE = Path(__file__).resolve().parent
CASES = {
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    'python -c "import pipeplan"': [sys.executable, "-c", "import pipeplan"],
    "pipeplan --help": [sys.executable, "-m", "pipeplan", "--help"],
    "pipeplan simulate -s 1f1b -p 4 -m 8": [
        sys.executable,
        "-m",
        "pipeplan",
        "simulate",
        "-s",
        "1f1b",
        "-p",
        "4",
        "-m",
        "8",
    ],
    "pipeplan simulate --compare -p 4 -m 8": [
        sys.executable,
        "-m",
        "pipeplan",
        "simulate",
        "--compare",
        "-p",
        "4",
        "-m",
        "8",
    ],
}
TARGETS = {"pipeplan --help": 0.5, "pipeplan simulate -s 1f1b -p 4 -m 8": 1.0}


def wall_s(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - started


def main(repeats: int) -> None:
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(repeats):  # interleaved, so a busy spell of the machine touches every command alike
        for name, argv in CASES.items():
            samples[name].append(wall_s(argv))
    baseline = statistics.median(samples['python -c "import torch"'])
    rows = []
    print(f"{'command':<40} {'median s':>9} {'/ import torch':>15} {'target':>7}")
    for name, values in samples.items():
        median = statistics.median(values)
        target = TARGETS.get(name)
        rows.append({"command": name, "median_s": median, "runs_s": values, "vs_import_torch": median / baseline})
        if target is not None:
            rows[-1] |= {"target_s": target, "meets_target": median < target}
        print(f"{name:<40} {median:9.3f} {median / baseline:15.2f} {target if target else '':>7}")
    result = {"machine": platform.node(), "python": platform.python_version(), "repeats": repeats, "rows": rows}
    out = HERE / "results" / "cli.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(ARGS.repeats)
