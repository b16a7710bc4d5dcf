"""Pipeline schedules as pure data: Op type, generators (gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-auto, zbv,
dualpipev), validate, the activation-memory model, simulate, and rendering (terminal Gantt, Chrome trace).
No torch import anywhere in this package."""

from pipeplan.schedules.memory import inflight_per_stage
from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.registry import SCHEDULE_NAMES, default_chunks, generate, stage_device
from pipeplan.schedules.simulate import (
    MemoryCosts,
    StageCosts,
    Timeline,
    TimelineEntry,
    peak_activation_per_device,
    simulate,
    unit_memory,
)
from pipeplan.schedules.validate import validate

__all__ = [
    "SCHEDULE_NAMES",
    "MemoryCosts",
    "Op",
    "Schedule",
    "StageCosts",
    "Timeline",
    "TimelineEntry",
    "default_chunks",
    "generate",
    "inflight_per_stage",
    "peak_activation_per_device",
    "simulate",
    "stage_device",
    "unit_memory",
    "validate",
]
