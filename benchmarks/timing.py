"""Shared by the bench_*.py scripts: the median wall time of repeated calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(func: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Call `func` `repeats` times; return the median wall-clock seconds and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = func()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
