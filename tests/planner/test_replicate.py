"""Replicated-stage expansion: replica j of a stage runs that stage's ops for microbatches mb % r == j, in order."""

from __future__ import annotations

import pytest

from pipeplan.errors import ScheduleError
from pipeplan.planner.layout import pipeline_layout
from pipeplan.schedules.registry import generate
from pipeplan.schedules.replicate import replicate


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
