"""Fuzz tests import their helpers (`fuzz_cases`) from this folder (pytest uses --import-mode=importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
