"""The memory model: from op order, cached, consistent with the simulator."""

from __future__ import annotations

import pytest

from pipeplan.schedules import SCHEDULE_NAMES, generate, inflight_per_device, inflight_per_stage, memory_model, simulate


def test_1f1b_inflight():
    assert inflight_per_stage(generate("1f1b", num_devices=4, num_microbatches=8)) == (4, 3, 2, 1)
    assert inflight_per_stage(generate("1f1b", num_devices=4, num_microbatches=2)) == (2, 2, 2, 1)


def test_memory_model_cached_and_consistent():
    memory_model.cache_clear()
    a = memory_model("zb-h2", 4, 8)
    b = memory_model("zb-h2", 4, 8)
    assert a == b == inflight_per_stage(generate("zb-h2", num_devices=4, num_microbatches=8))
    assert memory_model.cache_info().hits >= 1
    assert memory_model("zbv", 2, 4) == inflight_per_stage(generate("zbv", num_devices=2, num_microbatches=4))
    assert len(memory_model("interleaved", 2, 4, 3)) == 6
    # zb-auto's limit counts bytes (I frees half in unit mode), not microbatches in flight from F to W
    assert max(memory_model("zb-auto", 4, 8, None, 5)) > 5


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_order_based_per_device_matches_timed_peak(name):
    # a device runs its list in order, so the order-based count equals the timed peak (1 unit per activation)
    schedule = generate(name, num_devices=3, num_microbatches=6)
    assert inflight_per_device(schedule) == tuple(int(x) for x in simulate(schedule).peak_memory_bytes)
