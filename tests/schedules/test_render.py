"""Terminal Gantt chart and Chrome trace."""

from __future__ import annotations

import json

from rich.console import Console

from pipeplan.schedules import generate, simulate
from pipeplan.schedules.render import gantt, timeline_to_chrome_trace


def test_chrome_trace_from_plain_rows():
    trace = timeline_to_chrome_trace([(0, "0F0", 0.0, 1.5), (1, "1I3", 2.0, 2.25)])
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events[0] == {
        "name": "0F0",
        "cat": "F",
        "ph": "X",
        "pid": 0,
        "tid": 0,
        "ts": 0.0,
        "dur": 1500.0,
        "args": {"stage": 0, "microbatch": 0, "kind": "F"},
    }
    assert events[1]["pid"] == 1 and events[1]["ts"] == 2000.0 and events[1]["dur"] == 250.0
    assert events[1]["args"] == {"stage": 1, "microbatch": 3, "kind": "I"}
    json.dumps(trace)


def test_chrome_trace_of_timeline_has_every_op():
    timeline = simulate(generate("zbv", num_devices=2, num_microbatches=4))
    trace = timeline_to_chrome_trace(timeline.rows())
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(timeline.entries)


def test_gantt_rows_and_width():
    timeline = simulate(generate("zb-h1", num_devices=3, num_microbatches=6))
    text = gantt(timeline, width=60)
    lines = text.plain.splitlines()
    assert [line.split()[0:2] for line in lines[:3]] == [["dev", "0"], ["dev", "1"], ["dev", "2"]]
    assert all(len(line) == 60 for line in lines[:3])
    assert {"F", "I", "W"} <= set(lines[0])
    console = Console(record=True, width=80, force_terminal=True, color_system="truecolor")
    console.print(text)
    assert "\x1b[" in console.export_text(styles=True)
