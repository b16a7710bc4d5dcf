"""Interleaved timing rounds (profiling.rounds): statistics, order, outliers, bounded re-measurement, and the CUDA
event clock's path run with stand-in events (no GPU needed)."""

from __future__ import annotations

import pytest

from pipeplan.profiling import rounds
from pipeplan.profiling.rounds import EventClock, HostClock, Pools, measure, outliers, run_rounds, spread


class FakeClock:
    """Readings that are whatever the unit says it took (`advance`), settled once per round."""

    name = "fake"

    def __init__(self) -> None:
        self.now, self.settles = 0.0, 0

    def start(self) -> None:
        self._began = self.now

    def stop(self) -> float:
        return self.now - self._began

    def settle(self) -> None:
        self.settles += 1

    def read(self, reading: object) -> float:
        return float(reading)


class ScriptedUnit:
    """Takes `times[k]` ms on its k-th call (the last one thereafter); records the order of calls in `log`."""

    def __init__(self, name: str, times: list[float], log: list[str]) -> None:
        self.name, self.times, self.log, self.calls = name, times, log, 0

    def sample(self, clock) -> dict[str, object]:
        self.log.append(self.name)
        clock.start()
        clock.now += self.times[min(self.calls, len(self.times) - 1)]
        self.calls += 1
        return {"forward": clock.stop()}


def test_spread_is_the_interquartile_range_over_the_median():
    assert spread([1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0
    assert spread([0.9, 1.0, 1.0, 1.0, 1.1]) == pytest.approx(0.0)  # 2nd and 4th of five: both 1.0
    assert spread([0.8, 0.9, 1.0, 1.1, 50.0]) == pytest.approx(0.2)  # one stray sample does not move it
    assert spread([1.0]) == 0.0 and spread([]) == 0.0


def test_outliers_are_three_scaled_mads_and_ten_percent_from_the_median():
    assert outliers([1.0, 1.01, 0.99, 20.0, 25.0]) == [3, 4]  # two of five off: the MAD still sees them
    assert outliers([1.0, 1.05, 0.95, 1.08, 0.93]) == []  # within 10% of the median: never an outlier
    assert outliers([1.0, 2.0, 3.0, 4.0, 5.0]) == []  # spread evenly: none stands out
    assert outliers([1.0, 100.0]) == []  # fewer than 3 samples: no median to stand out from


def test_rounds_interleave_the_units_and_settle_once_per_round():
    log: list[str] = []
    units = [ScriptedUnit(name, [1.0], log) for name in ("a", "b", "c")]
    clock = FakeClock()
    pools = run_rounds(units, clock, {"a": 2, "b": 3, "c": 1})
    assert log == ["a", "b", "c", "a", "b", "b"]  # round robin, not all of a's samples back to back
    assert clock.settles == 3 and pools.samples["b"]["forward"] == [1.0, 1.0, 1.0]


def test_a_burst_on_one_unit_is_timed_again_and_does_not_reach_its_median():
    log: list[str] = []
    steady = ScriptedUnit("steady", [1.0], log)
    burst = ScriptedUnit("burst", [1.0, 30.0, 30.0, 1.0], log)  # two of its five samples hit by a slow spell
    pools = measure([steady, burst], FakeClock(), warmup=0, repeats=5, assess=lambda pools: ())
    assert pools.medians("burst") == {"forward": 1.0} and pools.spreads("burst") == {"forward": 0.0}
    assert pools.outliers_replaced == 2 and pools.count("burst") == 5 and pools.attempts == 1


def test_out_of_bounds_units_are_re_measured_up_to_the_bound():
    log: list[str] = []
    units = [ScriptedUnit("a", [1.0], log), ScriptedUnit("b", [1.0], log)]
    asked = []

    def assess(pools: Pools):  # "b" stays out of bounds; each re-measurement finds fewer problems than before
        asked.append(pools.count("b"))
        return ["b"] + ["a"] * (len(asked) == 1)

    pools = measure(units, FakeClock(), warmup=1, repeats=3, assess=assess)
    assert pools.attempts == 1 + rounds.MAX_REMEASUREMENTS and pools.remeasured == ["b", "a"]  # worst first
    assert asked == [3, 3, 3]  # each re-measurement: `repeats` fresh samples of what was named, replacing them
    assert log.count("a") == 1 + 3 + 3 and log.count("b") == 1 + 3 + 3 + 3


def test_a_re_measurement_replaces_the_samples_of_a_unit_slowed_throughout():
    log: list[str] = []
    slowed = ScriptedUnit("slowed", [50.0] * 5 + [1.0], log)  # every sample of the first measurement slowed

    def assess(pools: Pools):
        return ["slowed"] if pools.medians("slowed")["forward"] > 2 else []

    pools = measure([slowed], FakeClock(), warmup=0, repeats=5, assess=assess)
    assert pools.attempts == 2 and pools.remeasured == ["slowed"]
    assert pools.samples["slowed"]["forward"] == [1.0] * 5


def test_re_measuring_probes_the_worst_units_and_stops_when_that_fixes_nothing():
    log: list[str] = []
    names = ["u0", "u1", "u2", "u3", "u4"]
    units = [ScriptedUnit(name, [1.0], log) for name in names]
    pools = measure(units, FakeClock(), warmup=0, repeats=3, assess=lambda pools: list(reversed(names)))
    assert pools.attempts == 2 and pools.remeasured == ["u4", "u3", "u2"]  # the worst PROBE, then no more
    assert [log.count(name) for name in names] == [3, 3, 6, 6, 6]


def test_after_a_probe_that_helped_every_unit_still_out_of_bounds_is_re_measured():
    log: list[str] = []
    names = ["u0", "u1", "u2", "u3", "u4"]
    units = [ScriptedUnit(name, [1.0], log) for name in names]
    calls = []

    def assess(pools: Pools):  # the probe's units come back within bounds; the two others wait their turn
        calls.append(1)
        return names if len(calls) == 1 else names[3:] if len(calls) == 2 else []

    pools = measure(units, FakeClock(), warmup=0, repeats=3, assess=assess)
    assert pools.attempts == 3 and pools.remeasured == ["u0", "u1", "u2", "u3", "u4"]
    assert [log.count(name) for name in names] == [6, 6, 6, 6, 6]


class StandInEvent:
    """torch.cuda.Event's timing API over a fake GPU timeline; elapsed_time before a synchronize fails, as CUDA
    does for an event not yet reached."""

    timeline = {"now": 0.0, "synced": False}

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.timeline["now"]
        self.timeline["synced"] = False

    def elapsed_time(self, end: StandInEvent) -> float:
        assert self.timeline["synced"], "event read before synchronize"
        return end.at - self.at


def test_the_cuda_event_clock_reads_its_pairs_after_one_synchronize_per_round():
    syncs = []

    def synchronize() -> None:
        syncs.append(1)
        StandInEvent.timeline["synced"] = True

    class GpuUnit:
        def __init__(self, name: str, ms: float) -> None:
            self.name, self.ms = name, ms

        def sample(self, clock) -> dict[str, object]:
            clock.start()
            StandInEvent.timeline["now"] += self.ms  # the kernels this pass queued
            return {"forward": clock.stop()}

    clock = EventClock(StandInEvent, synchronize)
    pools = run_rounds([GpuUnit("x", 2.0), GpuUnit("y", 5.0)], clock, {"x": 4, "y": 4})
    assert len(syncs) == 4 and clock.name == "cuda-events"
    assert pools.medians("x") == {"forward": 2.0} and pools.medians("y") == {"forward": 5.0}


def test_host_clock_names_its_timer():
    assert HostClock().name == "wall" and HostClock(cpu=True).name == "cpu"
    clock = HostClock()
    clock.start()
    assert clock.read(clock.stop()) >= 0.0
