"""Capacity tests share the search tests' helpers (`planner_helpers`); pytest uses --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "search"))
