"""`run --overlap-pairs`: how a rank runs dualpipev's F&B pairs, and auto's probe (overlap.PairRunner)."""

from __future__ import annotations

import threading

import pytest

from pipeplan.errors import ConfigError
from pipeplan.runtime.step.pair_runner import PROBE_STEPS, WARMUP_STEPS, PairRunner
from pipeplan.runtime.train.config import RunConfig


def _threads(runner: PairRunner) -> tuple[str, str]:
    """The thread names each half ran on, and the order both results come back in."""
    first, second = runner.run(lambda: threading.current_thread().name, lambda: threading.current_thread().name)
    return first, second


def test_on_runs_the_second_half_on_the_worker_and_off_on_the_caller():
    here = threading.current_thread().name
    assert _threads(PairRunner("on")) == (here, _threads(PairRunner("on"))[1])
    assert _threads(PairRunner("on"))[1].startswith("pipeplan-pair")
    assert _threads(PairRunner("off")) == (here, here)


def test_an_error_of_either_half_is_raised_after_both_stopped():
    ran = []

    def fails():
        raise ValueError("half")

    with pytest.raises(ValueError, match="half"):
        PairRunner("on").run(fails, lambda: ran.append("second"))
    assert ran == ["second"]


def _probe(runner: PairRunner, seconds: dict[bool, float]) -> list[bool]:
    """Feed the probe a step time per way; the way each step ran."""
    ways = []
    for _ in range(WARMUP_STEPS + PROBE_STEPS + 2):
        ways.append(runner.overlapped)
        runner.step_done(seconds[runner.overlapped])
    return ways


@pytest.mark.parametrize(("overlapped_s", "keeps"), [(0.8, True), (1.2, False), (1.0, False), (0.98, False)])
def test_auto_times_both_ways_then_keeps_the_faster(overlapped_s, keeps):
    runner = PairRunner("auto")
    ways = _probe(runner, {True: overlapped_s, False: 1.0})
    assert ways[:WARMUP_STEPS] == [True, False]  # (not timed)
    assert ways[WARMUP_STEPS : WARMUP_STEPS + PROBE_STEPS] == [True, False] * (PROBE_STEPS // 2)
    assert runner.decided and ways[WARMUP_STEPS + PROBE_STEPS :] == [keeps, keeps]
    assert runner.describe().startswith("overlapped" if keeps else "in order")
    assert f"overlapped {1000 * overlapped_s:.1f} ms" in runner.describe()


def test_auto_on_cuda_overlaps_without_probing_and_fixed_modes_never_change():
    for runner, way in (
        (PairRunner("auto", device_type="cuda"), True),
        (PairRunner("on"), True),
        (PairRunner("off"), False),
    ):
        assert _probe(runner, {True: 5.0, False: 1.0}) == [way] * (WARMUP_STEPS + PROBE_STEPS + 2)
    assert PairRunner("auto", device_type="cuda").describe() == "overlapped (auto: CUDA, not probed)"
    assert PairRunner("off").describe() == "in order (--overlap-pairs off)"


def test_a_short_run_says_its_probe_is_unfinished():
    runner = PairRunner("auto")
    runner.step_done(1.0)
    assert runner.describe() == "overlapped (auto: too few steps to probe)"
    runner.step_done(1.0)
    assert runner.describe() == "overlapped, then in order (auto: too few steps to probe)"
    runner.step_done(2.0)
    assert runner.describe() == (
        "in order and overlapped by turns (auto: passes per step overlapped 2000.0 ms, probe unfinished)"
    )


def test_an_unknown_mode_is_one_config_error():
    with pytest.raises(ConfigError, match="--overlap-pairs must be auto, on or off"):
        RunConfig(overlap_pairs="maybe")
