"""Every generator over p in 1..8, m in 1..32, v in 1..4: a valid schedule or one clear ScheduleError."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeplan.errors import ScheduleError
from pipeplan.schedules import SCHEDULE_NAMES, default_chunks, generate, stage_device, validate
from pipeplan.schedules.placement import MIRRORED, V_SHAPED
from pipeplan.schedules.registry import clear_schedule_cache, schedule_info


def _supported(name: str, p: int, m: int, v: int) -> bool:
    if schedule_info(name).placement == V_SHAPED:
        return v == 2 and (name != "dualpipev" or m >= 2 * p)
    if schedule_info(name).placement == MIRRORED:
        return v == 1 and p % 2 == 0 and m % 2 == 0 and m >= 2 * p
    if name == "interleaved":
        return m % p == 0
    return v == 1


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@given(p=st.integers(1, 8), m=st.integers(1, 32), v=st.integers(1, 4))
def test_generator_valid_or_clear_error(name, p, m, v):
    if not _supported(name, p, m, v):
        with pytest.raises(ScheduleError) as info:
            generate(name, num_devices=p, num_microbatches=m, chunks=v)
        message = str(info.value)
        assert "\n" not in message and "--" in message  # one line naming the option to change
        return
    schedule = generate(name, num_devices=p, num_microbatches=m, chunks=v)
    validate(schedule)
    assert schedule.num_devices == p and schedule.num_microbatches == m
    assert schedule.num_stages == p * v
    assert schedule.stage_device == stage_device(name, p, v)
    split = sum(1 for ops in schedule.device_ops for o in ops for h in o.parts if h.kind == "I")
    full = sum(1 for ops in schedule.device_ops for o in ops for h in o.parts if h.kind == "B")
    assert split + full == p * v * m
    assert sum(len(o.parts) for ops in schedule.device_ops for o in ops) == p * v * m * 2 + split


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_default_chunks(name):
    schedule = generate(name, num_devices=2, num_microbatches=4)
    assert schedule.num_chunks == default_chunks(name)


def test_placements():
    assert stage_device("interleaved", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert stage_device("zbv", 3) == (0, 1, 2, 2, 1, 0)
    assert stage_device("dualpipev", 2) == (0, 1, 1, 0)
    assert stage_device("dualpipe", 4) == (0, 1, 2, 3)  # direction 0; the odd microbatches run on 3 - device
    assert stage_device("1f1b", 4) == (0, 1, 2, 3)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ScheduleError) as info:
        generate("chimera", num_devices=2, num_microbatches=2)
    for name in SCHEDULE_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_devices": 0, "num_microbatches": 2}, "--stages"),
        ({"num_devices": 2, "num_microbatches": 0}, "--microbatches"),
        ({"num_devices": 2, "num_microbatches": 2, "memory_limit": 0}, "--memory-limit"),
        ({"num_devices": 4, "num_microbatches": 8, "memory_limit": 2}, "--memory-limit"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        generate("1f1b", **kwargs)


def test_memory_limit_checked_for_fixed_schedules():
    generate("zb-h2", num_devices=4, num_microbatches=8, memory_limit=7)
    with pytest.raises(ScheduleError, match="zb-auto"):
        generate("zb-h2", num_devices=4, num_microbatches=8, memory_limit=6)


def test_generators_are_pure_and_deterministic():
    """Generated twice from nothing, another size in between: the same op lists. `generate` caches fixed orders,
    so the cache is emptied before each generation; `a is not b` shows two generations are compared."""
    for name in SCHEDULE_NAMES:
        clear_schedule_cache()
        a = generate(name, num_devices=4, num_microbatches=8)
        generate(name, num_devices=2, num_microbatches=4)
        clear_schedule_cache()
        b = generate(name, num_devices=4, num_microbatches=8)
        assert a is not b and a == b, name


def test_schedules_package_does_not_import_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, pipeplan.schedules, pipeplan.schedules.commands; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
