"""The numbers the papers give, with F = I = W = 1 and no comm (p devices, m microbatches)."""

from __future__ import annotations

import pytest

from pipeplan.schedules import StageCosts, generate, inflight_per_stage, simulate

PM = [(p, m) for p in range(1, 9) for m in (p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1, 32) if m >= 1]


@pytest.mark.parametrize(("p", "m"), PM)
def test_1f1b_makespan_and_peak(p, m):
    schedule = generate("1f1b", num_devices=p, num_microbatches=m)
    timeline = simulate(schedule)
    assert timeline.makespan == (m + p - 1) * 3
    assert inflight_per_stage(schedule)[0] == p == max(inflight_per_stage(schedule))


@pytest.mark.parametrize(("p", "m"), PM)
def test_zb_h1_bubble_and_peak(p, m):
    schedule = generate("zb-h1", num_devices=p, num_microbatches=m)
    timeline = simulate(schedule)
    assert timeline.zb_bubble_ms == (p - 1) * (1 + 1 - 1)
    assert timeline.max_span == 3 * m + (p - 1)
    assert max(inflight_per_stage(schedule)) == p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= 2 * p - 1])
def test_zb_h2_bubble_and_peak(p, m):
    schedule = generate("zb-h2", num_devices=p, num_microbatches=m)
    timeline = simulate(schedule)
    assert timeline.zb_bubble_ms == (p - 1) * (1 + 1 - 2 * 1) == 0
    assert timeline.max_span == 3 * m
    assert max(inflight_per_stage(schedule)) == 2 * p - 1


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= 2 * p - 1])
def test_zbv_zero_bubble_at_1f1b_memory(p, m):
    schedule = generate("zbv", num_devices=p, num_microbatches=m)
    timeline = simulate(schedule)
    assert timeline.max_span == 2 * 3 * m  # each device: two chunks x m x (F + I + W), no idle in between
    assert timeline.zb_bubble_ms == 0
    # 1F1B's peak is p full-stage activations = 2p half-size chunk activations
    assert max(timeline.peak_memory_bytes) == 2 * p


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 9) for m in (p, 2 * p, 4 * p) if m <= 32])
def test_interleaved_bubble_shrinks_by_v(p, m, v):
    # per-chunk costs 1, so a device's full slice costs v per op: bubble (p-1)(F+I+W)/v of the full slice
    timeline = simulate(generate("interleaved", num_devices=p, num_microbatches=m, chunks=v))
    assert timeline.zb_bubble_ms == (p - 1) * (3 * v) / v
    assert timeline.makespan == 3 * v * m + 3 * (p - 1)


def test_zb_h1_heterogeneous_formula():
    costs = StageCosts(forward_ms=2.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    for p in (2, 4, 8):
        timeline = simulate(generate("zb-h1", num_devices=p, num_microbatches=3 * p), costs)
        assert timeline.zb_bubble_ms == pytest.approx((p - 1) * (2.0 + 1.0 - 1.0))


def test_zb_beats_1f1b_and_gpipe_memory():
    p, m = 4, 16
    span = {n: simulate(generate(n, num_devices=p, num_microbatches=m)).max_span for n in ("1f1b", "zb-h1", "zb-h2")}
    assert span["zb-h2"] < span["zb-h1"] < span["1f1b"]
    assert max(inflight_per_stage(generate("gpipe", num_devices=p, num_microbatches=m))) == m
