"""Rendering timelines: a compact colored terminal Gantt chart (rich) and a Chrome trace (chrome://tracing,
Perfetto). The runtime writes measured traces through `timeline_to_chrome_trace` too, so predicted and measured
runs open side by side."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.text import Text

from pipeplan.schedules.ops import Op
from pipeplan.schedules.simulate import Timeline

KIND_STYLES = {
    "F": "black on bright_cyan",
    "I": "black on bright_green",
    "W": "black on yellow",
    "B": "black on bright_magenta",
    "X": "black on bright_red",
}
_LEGEND = {"F": "forward", "I": "input grad", "W": "weight grad", "B": "full backward", "X": "F&B overlapped"}


def gantt(timeline: Timeline, *, width: int = 100) -> Text:
    """One row per device; each character cell shows the op kind covering most of that time slice."""
    if not timeline.makespan > 0:
        return Text("(no Gantt chart: every op of this step takes 0 ms)", style="dim")
    label_width = len(f"dev {timeline.num_devices - 1} ")
    cells = max(10, width - label_width)
    scale = cells / timeline.makespan
    coverage = [[(0.0, "")] * cells for _ in range(timeline.num_devices)]
    for entry in timeline.entries:
        first, last = int(entry.start * scale), min(cells - 1, int(max(entry.start, entry.end - 1e-12) * scale))
        for cell in range(first, last + 1):
            lo, hi = max(entry.start, cell / scale), min(entry.end, (cell + 1) / scale)
            if hi - lo > coverage[entry.device][cell][0]:
                coverage[entry.device][cell] = (hi - lo, "X" if entry.op.halves else entry.op.kind)
    text = Text()
    for device in range(timeline.num_devices):
        text.append(f"dev {device}".ljust(label_width), style="bold")
        for _, kind in coverage[device]:
            text.append(kind or " ", style=KIND_STYLES.get(kind, "dim"))
        text.append("\n")
    for kind, label in _LEGEND.items():
        text.append(f" {kind} ", style=KIND_STYLES[kind])
        text.append(f" {label}  ")
    return text


def timeline_to_chrome_trace(entries: Iterable[tuple[int, str, float, float]]) -> dict[str, Any]:
    """Chrome trace JSON from plain (device, op string, start_ms, end_ms) rows: one complete ("X") event per op,
    pid = device, ts/dur in microseconds, name = op string, args = stage and microbatch."""
    events: list[dict[str, Any]] = []
    devices: set[int] = set()
    for device, op_text, start_ms, end_ms in entries:
        o = Op.parse(op_text)
        devices.add(int(device))
        events.append(
            {
                "name": op_text,
                "cat": o.kind,
                "ph": "X",
                "pid": int(device),
                "tid": 0,
                "ts": start_ms * 1000.0,
                "dur": (end_ms - start_ms) * 1000.0,
                "args": {"stage": o.stage, "microbatch": o.microbatch, "kind": o.kind}
                if o.halves is None
                else {"kind": o.kind, "ops": [str(h) for h in o.halves]},
            }
        )
    for device in sorted(devices):
        events.append({"name": "process_name", "ph": "M", "pid": device, "args": {"name": f"device {device}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
