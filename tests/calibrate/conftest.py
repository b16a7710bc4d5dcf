"""Calibrate tests import the calibration check (`calibration_check.py`: measured versus analytic whole-model step,
used by the GPU test and benchmarks/bench_calibrate.py, not the CLI) from this folder (pytest runs with
--import-mode=importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
