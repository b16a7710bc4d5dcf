"""Search tests import their helpers (`planner_helpers`) from this folder (pytest uses --import-mode=importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
