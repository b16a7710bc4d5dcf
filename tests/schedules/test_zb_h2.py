"""zb-h2's op lists are frozen: `tests/data/zb_h2_golden.json` holds a hash of every device's op list for p = 1..16,
m = 1..64 and a few large (p, m), as the list-scheduler replay of the paper's rules produced them before zb_h2.py
became an explicit phase generator. Plans, predictions and runs depend on these exact orders."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeplan.schedules.generators.zb_h2 import zb_h2

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "zb_h2_golden.json"


def _digest(num_devices: int, num_microbatches: int) -> str:
    schedule = zb_h2(num_devices, num_microbatches)
    assert schedule.name == "zb-h2" and schedule.stage_device == tuple(range(num_devices))
    text = "\n".join(" ".join(row) for row in schedule.op_strings())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_zb_h2_op_lists_equal_the_frozen_ones():
    golden = json.loads(GOLDEN.read_text())["hashes"]
    assert len(golden) == 16 * 64 + 6
    changed = [key for key, digest in golden.items() if _digest(*map(int, key.split(","))) != digest]
    assert not changed, f"zb-h2 op lists changed for (p, m) = {changed[:10]}"


def test_zb_h2_small_case_reads_as_the_phases():
    """p = 4, m = 12, device 1: warm-up 5 F; steady 1: 2 x (I, F); steady 2: 2 x (I, W, I, F); steady 3: 3 x
    (I, W, F); cool-down: 2 x (I, W, W), then the last I and the drained Ws."""
    ops = " ".join(f"{o.kind}{o.microbatch}" for o in zb_h2(4, 12).device_ops[1])
    assert ops == (
        "F0 F1 F2 F3 F4 "
        "I0 F5 I1 F6 "
        "I2 W0 I3 F7 I4 W1 I5 F8 "
        "I6 W2 F9 I7 W3 F10 I8 W4 F11 "
        "I9 W5 W6 I10 W7 W8 "
        "I11 W9 W10 W11"
    )
