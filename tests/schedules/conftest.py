"""Schedule tests import the exact MILP (`milp.py`, the paper's ILP: a yardstick for zb-auto that tests and
benchmarks/bench_schedules.py use, not the CLI) from this folder (pytest runs with --import-mode=importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
