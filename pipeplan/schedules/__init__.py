"""Pipeline schedules as pure data: Op type, placements, generators (gpipe, 1f1b, interleaved, zb-h1, zb-h2,
zb-auto, zbv, dualpipev, and the asynchronous pipedream and pipedream-2bw), the registry (name -> ScheduleInfo),
validate, the weight-version rule of asynchronous schedules, the timing engine, the memory model, simulate, and
rendering (terminal Gantt, Chrome trace). No torch import anywhere in this package.

Each module imports only ones below it: ops and placement at the bottom; then engine, versions, validate, simulate;
then the generators; the registry (which imports the generators); replicate and commands on top. A test checks the
import graph has no cycle."""

from pipeplan.schedules.memory import inflight_per_stage
from pipeplan.schedules.ops import Op, Schedule
from pipeplan.schedules.registry import (
    SCHEDULE_NAMES,
    ScheduleInfo,
    default_chunks,
    generate,
    schedule_info,
    schedule_names,
    stage_device,
)
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
    "ScheduleInfo",
    "StageCosts",
    "Timeline",
    "TimelineEntry",
    "default_chunks",
    "generate",
    "inflight_per_stage",
    "peak_activation_per_device",
    "schedule_info",
    "schedule_names",
    "simulate",
    "stage_device",
    "unit_memory",
    "validate",
]
