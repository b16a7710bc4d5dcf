"""The measured timeline of a step as a Chrome trace, in the same format as the planner's predicted timeline.json
(schedules.render.timeline_to_chrome_trace: one event per op, pid = device), so the two overlay in Perfetto."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from pipeplan.jsonio import atomic_write_text
from pipeplan.schedules.render import timeline_to_chrome_trace


def measured_rows(per_rank: list[list[tuple[str, float, float]]]) -> list[tuple[int, str, float, float]]:
    """(device, op, start_ms, end_ms) rows from each rank's (op, start_s, end_s) times (relative to its step start)."""
    return [(rank, op, start * 1000.0, end * 1000.0) for rank, times in enumerate(per_rank) for op, start, end in times]


def write_trace(path: str | os.PathLike, rank: int, times: list[tuple[str, float, float]], *, world_size: int) -> None:
    """Collective: gather every rank's op times; rank 0 writes one merged trace file."""
    gathered: list[list[tuple[str, float, float]] | None] = [None] * world_size
    dist.all_gather_object(gathered, times)
    if rank == 0:
        rows = measured_rows([g or [] for g in gathered])
        atomic_write_text(path, json.dumps(timeline_to_chrome_trace(rows)) + "\n")
