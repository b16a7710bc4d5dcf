"""Replicated-stage expansion: replica j of a stage runs that stage's ops for microbatches mb % r == j (round-robin
filtering, or paced like a device of a pipeline as long as the expanded one)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.errors import ScheduleError
from pipeplan.predict.layout import pipeline_layout
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.registry import generate
from pipeplan.schedules.replicate import check_deadlock_free, replicate, replicate_paced, simulate_expanded
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, simulate


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("replicas", [(1, 2, 1), (3, 1, 2), (2, 2, 2)])
def test_replicas_split_each_stage_round_robin(name, replicas):
    schedule = generate(name, num_devices=3, num_microbatches=6)
    expanded = replicate(schedule, replicas)
    assert expanded.num_devices == sum(replicas)
    for device, ops in enumerate(expanded.device_ops):
        stage, replica = expanded.device_stage[device], expanded.device_replica[device]
        original = schedule.device_ops[schedule.stage_device[stage]]
        assert ops == tuple(o for o in original if o.microbatch % replicas[stage] == replica)
    every = sorted(str(o) for ops in expanded.device_ops for o in ops)
    assert every == sorted(str(o) for ops in schedule.device_ops for o in ops)


def test_replication_needs_one_stage_per_device_and_enough_microbatches():
    with pytest.raises(ScheduleError, match="chunks"):
        replicate(generate("zbv", num_devices=2, num_microbatches=4), (1, 1, 1, 1))
    with pytest.raises(ScheduleError, match="microbatches"):
        replicate(generate("1f1b", num_devices=2, num_microbatches=2), (1, 3))
    with pytest.raises(ScheduleError, match="replica"):
        replicate(generate("1f1b", num_devices=2, num_microbatches=2), (1,))


def test_layout_places_replicas_on_the_given_devices():
    schedule = generate("1f1b", num_devices=2, num_microbatches=4)
    layout = pipeline_layout(schedule, (2, 1), ((0, 2), (1,)))
    assert layout.device_stages == ((0,), (1,), (0,))
    assert layout.device_replica == (0, 0, 1)
    assert layout.stage_devices(0) == (0, 2)
    assert all(int(op[2:]) % 2 == 1 for op in layout.device_ops[2])


def _probe(expanded):
    first = {}
    for device, stage in reversed(list(enumerate(expanded.device_stage))):
        first[stage] = device
    return Schedule(
        name=expanded.name,
        num_devices=expanded.num_devices,
        num_stages=len(expanded.replicas),
        num_microbatches=expanded.num_microbatches,
        stage_device=tuple(first[s] for s in range(len(expanded.replicas))),
        device_ops=expanded.device_ops,
    )


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2"]),
    replicas=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    extra=st.integers(0, 12),
)
def test_paced_replicas_run_every_op_once_without_deadlock(name, replicas, extra):
    m = max(replicas) + extra
    schedule = generate(name, num_devices=len(replicas), num_microbatches=m)
    paced = replicate_paced(schedule, replicas)
    plain = replicate(schedule, replicas)
    assert paced.device_stage == plain.device_stage and paced.device_replica == plain.device_replica
    for ops, stage, replica in zip(paced.device_ops, paced.device_stage, paced.device_replica):
        assert {o.stage for o in ops} <= {stage} and all(o.microbatch % replicas[stage] == replica for o in ops)
    every = sorted(str(o) for ops in paced.device_ops for o in ops)
    assert every == sorted(str(o) for ops in schedule.device_ops for o in ops)
    check_deadlock_free(paced)  # raises if it could not run
    if all(r == 1 for r in replicas):
        assert paced.device_ops == schedule.device_ops


def test_paced_1f1b_keeps_a_round_trip_of_microbatches_in_flight_per_replica():
    """1F1B replica of stage s keeps round(D_s / r_s) microbatches in flight (D_s: devices from s to the end), not
    the round-robin share ceil((S - s) / r_s) that starves it."""
    replicas = (4, 1, 2)
    schedule = generate("1f1b", num_devices=3, num_microbatches=24)
    paced = replicate_paced(schedule, replicas)
    for ops, stage in zip(paced.device_ops, paced.device_stage):
        live = peak = 0
        for o in ops:
            live += 1 if o.kind == "F" else -1
            peak = max(peak, live)
        assert peak == max(1, round(sum(replicas[stage:]) / replicas[stage] + 1e-9))


def test_paced_replicas_are_faster_than_round_robin_filtering():
    """Balanced per device (a stage's op time is proportional to its replicas): the paced lists beat the filtered
    ones, which stall on the round trip; with equal replicas they match a straight pipeline of as many devices."""
    for replicas, m in (((4, 1, 2, 1), 32), ((2, 2), 32), ((3, 3, 3), 36)):
        schedule = generate("1f1b", num_devices=len(replicas), num_microbatches=m)
        costs = StageCosts(forward_ms=replicas, backward_ms=tuple(2 * r for r in replicas))
        paced = simulate_expanded(_probe(replicate_paced(schedule, replicas)), costs, MemoryCosts())
        plain = simulate_expanded(_probe(replicate(schedule, replicas)), costs, MemoryCosts())
        assert paced.makespan < plain.makespan
        if len(set(replicas)) == 1:
            straight = generate("1f1b", num_devices=sum(replicas), num_microbatches=m)
            reference = simulate(straight, StageCosts(forward_ms=1.0, backward_ms=2.0)).makespan
            assert paced.makespan <= reference


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_heavily_replicated_pipeline_stays_near_a_straight_one(name):
    """Replicas 16,2,2,2,2,35,5 (64 devices), balanced per device: within 20% of a straight 64-device pipeline
    (round-robin filtering is about 8x slower here)."""
    replicas, m = (16, 2, 2, 2, 2, 35, 5), 280
    schedule = generate(name, num_devices=len(replicas), num_microbatches=m)
    costs = StageCosts(
        forward_ms=replicas, input_grad_ms=replicas, weight_grad_ms=replicas, backward_ms=tuple(2 * r for r in replicas)
    )
    paced = simulate_expanded(_probe(replicate_paced(schedule, replicas)), costs, MemoryCosts())
    unit = StageCosts(forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0, backward_ms=2.0)
    reference = simulate(generate(name, num_devices=sum(replicas), num_microbatches=m), unit).makespan
    assert paced.makespan <= 1.2 * reference
