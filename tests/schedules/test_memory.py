"""The memory model: bytes from the op order (F adds, I frees its share, W the rest), consistent with the
simulator's timed peak."""

from __future__ import annotations

import pytest

from pipeplan.schedules import (
    SCHEDULE_NAMES,
    MemoryCosts,
    generate,
    inflight_per_stage,
    peak_activation_per_device,
    simulate,
)


def test_1f1b_inflight():
    assert inflight_per_stage(generate("1f1b", num_devices=4, num_microbatches=8)) == (4, 3, 2, 1)
    assert inflight_per_stage(generate("1f1b", num_devices=4, num_microbatches=2)) == (2, 2, 2, 1)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_order_based_peak_matches_timed_peak_by_replay(name):
    """Replay each device's list with a live-bytes dict; the simulator's peak is static + that maximum."""
    schedule = generate(name, num_devices=4, num_microbatches=8)
    act = tuple(10.0 + 3 * s for s in range(schedule.num_stages))
    freed = tuple(a * 0.4 for a in act)
    memory = MemoryCosts(activation_bytes=act, input_grad_freed_bytes=freed, static_bytes=(7.0, 8.0, 9.0, 10.0))
    expect = []
    for ops in schedule.device_ops:
        live, peak = {}, 0.0
        for o in (h for op in ops for h in op.parts):  # an overlapped F&B op: F then B (the same peak)
            key = (o.stage, o.microbatch)
            if o.kind == "F":
                live[key] = act[o.stage]
            elif o.kind == "I":
                live[key] = act[o.stage] - freed[o.stage]
            else:
                del live[key]
            peak = max(peak, sum(live.values()))
        expect.append(peak)
    assert peak_activation_per_device(schedule, memory) == pytest.approx(expect)
    timed = simulate(schedule, memory=memory).peak_memory_bytes
    assert timed == pytest.approx([s + p for s, p in zip((7.0, 8.0, 9.0, 10.0), expect, strict=True)])


def test_fixed_schedules_are_checked_against_a_byte_limit():
    memory = MemoryCosts(activation_bytes=10.0, input_grad_freed_bytes=5.0)
    schedule = generate("zb-h1", num_devices=4, num_microbatches=8)
    peak = max(peak_activation_per_device(schedule, memory))
    assert generate("zb-h1", num_devices=4, num_microbatches=8, memory=memory, memory_limit=peak) == schedule
    with pytest.raises(Exception, match="--memory-limit"):
        generate("zb-h1", num_devices=4, num_microbatches=8, memory=memory, memory_limit=peak - 1)
