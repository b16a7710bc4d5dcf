"""The memory model under activation recomputation (MemoryCosts.kept_bytes / recompute_bytes): F keeps K, an I or B
re-creates R on top while it runs, I leaves A - f until W — checked by replaying each device's op list with a dict of
live microbatches, for every schedule; the generators that schedule under a memory limit stay within it."""

from __future__ import annotations

import pytest
from helpers.milp import solve_milp

from pipeplan.errors import ConfigError, ScheduleError
from pipeplan.schedules import SCHEDULE_NAMES, MemoryCosts, StageCosts, generate, peak_activation_per_device, simulate
from pipeplan.schedules.generators.zb_auto import default_limit
from pipeplan.schedules.simulate import activation_deltas, activation_rises


def _memory(num_stages: int, mode: str) -> MemoryCosts:
    act = tuple(100.0 + 10 * s for s in range(num_stages))
    freed = tuple(a * 0.6 for a in act)
    if mode == "none":
        return MemoryCosts(activation_bytes=act, input_grad_freed_bytes=freed)
    if mode == "full":  # keeps the stage's input, re-creates the rest right before I or B
        kept = tuple(5.0 + s for s in range(num_stages))
        return MemoryCosts(
            activation_bytes=act,
            input_grad_freed_bytes=freed,
            kept_bytes=kept,
            recompute_bytes=tuple(a - k for a, k in zip(act, kept)),
        )
    kept = tuple(a - 30.0 for a in act)  # selective: drops 30 of attention internals, re-created 12 at a time
    return MemoryCosts(activation_bytes=act, input_grad_freed_bytes=freed, kept_bytes=kept, recompute_bytes=12.0)


def _replayed_peaks(schedule, memory: MemoryCosts) -> list[float]:
    n = schedule.num_stages
    act = memory.activation_bytes
    freed = memory.input_grad_freed_bytes
    kept = act if memory.kept_bytes is None else memory.kept_bytes
    extra = (memory.recompute_bytes,) * n if isinstance(memory.recompute_bytes, float) else memory.recompute_bytes
    peaks = []
    for ops in schedule.device_ops:
        live: dict[tuple[int, int], float] = {}
        peak = 0.0
        for o in (h for op in ops for h in op.parts):  # an overlapped F&B op: F then B (the same peak)
            key, s = (o.stage, o.microbatch), o.stage
            if o.kind == "F":
                live[key] = kept[s]
            elif o.kind in ("I", "B"):
                peak = max(peak, sum(live.values()) + extra[s])  # recomputation re-creates R while it runs
                if o.kind == "I":
                    live[key] = act[s] - freed[s]
                else:
                    del live[key]
            else:
                del live[key]
            peak = max(peak, sum(live.values()))
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_peak_matches_a_replay_of_the_op_lists(name, mode):
    schedule = generate(name, num_devices=4, num_microbatches=8)
    memory = _memory(schedule.num_stages, mode)
    expect = _replayed_peaks(schedule, memory)
    assert peak_activation_per_device(schedule, memory) == pytest.approx(expect)
    static = tuple(float(d) for d in range(schedule.num_devices))
    timed = simulate(schedule, memory=MemoryCosts(**{**memory.__dict__, "static_bytes": static}))
    assert timed.peak_memory_bytes == pytest.approx([s + p for s, p in zip(static, expect)])


def test_without_recomputation_fields_the_model_is_unchanged():
    plain = MemoryCosts(activation_bytes=(10.0, 20.0), input_grad_freed_bytes=(4.0, 5.0))
    explicit = MemoryCosts(
        activation_bytes=(10.0, 20.0), input_grad_freed_bytes=(4.0, 5.0), kept_bytes=(10.0, 20.0), recompute_bytes=0
    )
    assert (
        activation_deltas(plain, 2)
        == activation_deltas(explicit, 2)
        == {
            "F": (10.0, 20.0),
            "I": (-4.0, -5.0),
            "W": (-6.0, -15.0),
            "B": (-10.0, -20.0),
        }
    )
    assert activation_rises(plain, 2) == {"F": (10.0, 20.0), "I": (0.0, 0.0), "W": (0.0, 0.0), "B": (0.0, 0.0)}


def test_full_recomputation_can_make_input_grad_grow_the_live_bytes():
    """Keeping only the inputs (1) while W needs 6 of the 10 saved bytes: I ends with more than F left."""
    memory = MemoryCosts(activation_bytes=10.0, input_grad_freed_bytes=4.0, kept_bytes=1.0, recompute_bytes=9.0)
    assert activation_deltas(memory, 1)["I"] == (5.0,)
    assert activation_rises(memory, 1)["I"] == (9.0,)
    schedule = generate("zb-h1", num_devices=1, num_microbatches=3)  # F I W per microbatch
    assert peak_activation_per_device(schedule, memory) == (10.0,)


def test_zb_auto_default_limit_is_1f1b_peak_with_recomputation():
    for mode in ("none", "selective", "full"):
        memory = _memory(4, mode)
        one_f_one_b = generate("1f1b", num_devices=4, num_microbatches=8)
        assert default_limit(4, 8, memory) == pytest.approx(max(peak_activation_per_device(one_f_one_b, memory)))


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("name", ["zb-auto", "zbv"])
def test_memory_driven_generators_stay_within_the_limit(name, mode):
    chunks = 2 if name == "zbv" else 1
    memory = _memory(4 * chunks, mode)
    costs = StageCosts(forward_ms=1.0, input_grad_ms=1.3, weight_grad_ms=0.7, comm_ms=0.1)
    fixed = generate(name, num_devices=4, num_microbatches=8, costs=costs, memory=memory)
    loose = max(peak_activation_per_device(fixed, memory))
    met = 0
    for limit in (loose, 0.8 * loose, 0.6 * loose):
        try:
            schedule = generate(name, num_devices=4, num_microbatches=8, costs=costs, memory=memory, memory_limit=limit)
        except ScheduleError as exc:  # a limit no schedule meets is a one-line error
            assert "memory-limit" in str(exc)
            continue
        assert max(peak_activation_per_device(schedule, memory)) <= limit * (1 + 1e-9)
        met += 1
    assert met >= (3 if (name, mode) == ("zb-auto", "selective") else 1)


def test_milp_refuses_recomputation():
    with pytest.raises(ConfigError, match="models no activation recomputation"):
        solve_milp(2, 2, memory=_memory(2, "full"), memory_limit=1e9)
