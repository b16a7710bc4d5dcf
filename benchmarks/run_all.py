"""Run every benchmark script in this folder (`make bench`); each prints its table and writes results/*.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from arguments import parse_args

HERE = Path(__file__).resolve().parent


def _options(parser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="only these benchmarks (e.g. bench_cli)")


def main(names: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    unknown = sorted(set(names) - {script.stem for script in scripts})
    if unknown:
        print(f"no benchmark named {', '.join(unknown)}; the benchmarks: {', '.join(s.stem for s in scripts)}")
        return 2
    failed = []
    for script in (s for s in scripts if not names or s.stem in names):
        print(f"\n=== {script.name} ===", flush=True)
        if subprocess.run([sys.executable, str(script)], cwd=HERE.parent).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(parse_args(__doc__, _options).names))
