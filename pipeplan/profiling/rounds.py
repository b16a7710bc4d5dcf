"""Interleaved timing rounds, for the measured profiler on CPU and on CUDA alike.

A *unit* (a layer, or a whole-model reference) times each of its passes once per call (`Unit.sample`). A round
calls every unit once, in turn, so a slow spell of a shared machine (another process taking a core for 100 ms)
spreads over many units' samples, one sample each, instead of filling all the samples of one layer; each pass's
time is the median of its samples over the rounds.

- Spread: the interquartile range over the median (inclusive quartiles; with 5 samples the 2nd and 4th smallest),
  which one stray sample on either side does not move.
- Outliers: a sample further from its median than 3 scaled median absolute deviations (3 x 1.4826 x MAD, the
  "moderately conservative" rule of Leys et al. 2013, robust while fewer than half the samples are off) and than
  10% of the median (closer than that a sample cannot matter against the 20% spread bound) is dropped and timed
  again, in extra rounds over the units that had one.
- Re-measurement: `measure` asks `assess` (the caller's consistency checks, `profiling.consistency`) which units
  are out of bounds, worst first, and times them again (`repeats` fresh rounds, replacing their samples: a layer
  slowed through all its first samples keeps none of them) up to `MAX_REMEASUREMENTS` times: first only the
  `PROBE` worst, then every unit still out of bounds, as long as the last re-measurement left fewer out of bounds
  than before it (on a machine busy throughout, the probe fixes nothing and measuring stops after a few units'
  rounds instead of timing the whole model again).

Clocks: `HostClock` reads wall-clock or process CPU time at once; `EventClock` records CUDA events on the stream
and reads them after one synchronize per round (`settle`), so timing adds no synchronization inside a round. Both
serve the same rounds; `EventClock` takes its event type and synchronize function as arguments, so its path runs
under test without a GPU. No torch import here: callers pass torch's functions in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

MAD_SCALE = 1.4826  # MAD x 1.4826 estimates the standard deviation of normal samples (Leys et al. 2013)
OUTLIER_MADS = 3.0  # Leys et al.'s "moderately conservative" threshold
OUTLIER_FLOOR = 0.10  # ... and at least this far from the median, relative to it
MAX_REMEASUREMENTS = 2  # automatic re-measurements of out-of-bounds units after the first measurement
PROBE = 3  # units the first re-measurement takes (the worst): if none comes back within bounds, it stops there


class Clock(Protocol):
    name: str

    def start(self) -> None: ...

    def stop(self) -> object: ...  # a reading, turned into ms by read() once settle() returned

    def settle(self) -> None: ...

    def read(self, reading: object) -> float: ...


class HostClock:
    """Milliseconds of wall-clock time (perf_counter) or of the process's CPU time (`cpu=True`)."""

    def __init__(self, *, cpu: bool = False) -> None:
        self.name = "cpu" if cpu else "wall"
        self._now = time.process_time if cpu else time.perf_counter
        self._began = 0.0

    def start(self) -> None:
        self._began = self._now()

    def stop(self) -> float:
        return (self._now() - self._began) * 1e3

    def settle(self) -> None:
        pass

    def read(self, reading: object) -> float:
        assert isinstance(reading, float)
        return reading


class TimingEvent(Protocol):
    """What EventClock uses of a torch.cuda.Event."""

    def record(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class EventClock:
    """CUDA events: start() and stop() record one each on the current stream; read() after settle() (one
    synchronize) gives the milliseconds between a pair. `event` is torch.cuda.Event, `synchronize`
    torch.cuda.synchronize (tests pass stand-ins)."""

    def __init__(self, event: Callable[..., TimingEvent], synchronize: Callable[[], None]) -> None:
        self.name = "cuda-events"
        self._event, self._synchronize = event, synchronize
        self._began: TimingEvent | None = None
        self._pending = 0

    def _record(self) -> TimingEvent:
        mark = self._event(enable_timing=True)
        mark.record()
        return mark

    def start(self) -> None:
        self._began = self._record()

    def stop(self) -> tuple[object, object]:
        self._pending += 1
        return (self._began, self._record())

    def settle(self) -> None:
        if self._pending:
            self._synchronize()
            self._pending = 0

    def read(self, reading: object) -> float:
        assert self._pending == 0, "read a CUDA event pair after settle()"
        assert isinstance(reading, tuple), "a reading of this clock's stop()"
        began, ended = reading
        return float(began.elapsed_time(ended))


class Unit(Protocol):
    name: str

    def sample(self, clock: Clock) -> dict[str, object]:
        """Run each pass once, timed by `clock`: pass name -> reading."""
        ...


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def spread(samples: Sequence[float]) -> float:
    """Interquartile range / median (0 for fewer than 2 samples or a zero median)."""
    middle = median(samples) if samples else 0.0
    if len(samples) < 2 or middle <= 0:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    return (high - low) / middle


def outliers(samples: Sequence[float]) -> list[int]:
    """Indices of the samples `measure` times again (see the module docstring); none among fewer than 3."""
    if len(samples) < 3:
        return []
    middle = median(samples)
    deviation = [abs(x - middle) for x in samples]
    limit = max(OUTLIER_MADS * MAD_SCALE * median(deviation), OUTLIER_FLOOR * middle)
    return [i for i, d in enumerate(deviation) if d > limit]


@dataclass
class Pools:
    """Every unit's samples, per pass (ms), and what re-measuring did."""

    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    attempts: int = 1
    remeasured: list[str] = field(default_factory=list)
    outliers_replaced: int = 0

    def add(self, unit: str, timings: dict[str, float]) -> None:
        passes = self.samples.setdefault(unit, {})
        for name, value in timings.items():
            passes.setdefault(name, []).append(value)

    def medians(self, unit: str) -> dict[str, float]:
        return {name: median(values) for name, values in self.samples[unit].items()}

    def spreads(self, unit: str) -> dict[str, float]:
        return {name: spread(values) for name, values in self.samples[unit].items()}

    def count(self, unit: str) -> int:
        return min(len(values) for values in self.samples[unit].values())

    def drop_outliers(self) -> dict[str, int]:
        """Drop every pass's outliers; per unit, the most samples one of its passes lost."""
        dropped = {}
        for unit, passes in self.samples.items():
            most = 0
            for name, values in passes.items():
                bad = set(outliers(values))
                passes[name] = [x for i, x in enumerate(values) if i not in bad]
                most = max(most, len(bad))
            if most:
                dropped[unit] = most
        self.outliers_replaced += sum(dropped.values())
        return dropped


def run_rounds(
    units: Sequence[Unit], clock: Clock, counts: dict[str, int], *, on_sample: Callable[[], None] | None = None
) -> Pools:
    """Round j calls every unit with counts[name] > j once, in order; the clock settles after each round."""
    pools = Pools()
    for j in range(max(counts.values(), default=0)):
        taken = []
        for unit in units:
            if counts.get(unit.name, 0) > j:
                taken.append((unit.name, unit.sample(clock)))
                if on_sample is not None:
                    on_sample()
        clock.settle()
        for name, readings in taken:
            pools.add(name, {key: clock.read(reading) for key, reading in readings.items()})
    return pools


def _merge(into: Pools, more: Pools) -> None:
    for unit, passes in more.samples.items():
        for name, values in passes.items():
            into.samples.setdefault(unit, {}).setdefault(name, []).extend(values)


def measure(
    units: Sequence[Unit],
    clock: Clock,
    *,
    warmup: int,
    repeats: int,
    assess: Callable[[Pools], Sequence[str]],
    on_sample: Callable[[], None] | None = None,
) -> Pools:
    """Time `units` in `warmup` untimed and `repeats` timed rounds, re-time outliers, and re-measure the units
    `assess(pools)` names (their checks out of bounds, worst first): first the PROBE worst, then all still out of
    bounds, while each re-measurement leaves fewer out of bounds; the pools to keep."""
    run_rounds(units, clock, {unit.name: warmup for unit in units}, on_sample=on_sample)
    pools = run_rounds(units, clock, {unit.name: repeats for unit in units}, on_sample=on_sample)
    before: list[str] | None = None  # out of bounds before the last re-measurement
    while True:
        _replace_outliers(units, clock, pools, on_sample)
        suspects = list(dict.fromkeys(assess(pools)))
        if not suspects or pools.attempts > MAX_REMEASUREMENTS:
            return pools
        if before is not None and len(suspects) >= len(before):
            return pools  # the last re-measurement fixed nothing: a machine busy throughout
        before = suspects
        chosen = suspects[:PROBE] if pools.attempts == 1 else suspects
        pools.attempts += 1
        pools.remeasured.extend(name for name in chosen if name not in pools.remeasured)
        pools.samples.update(run_rounds(units, clock, dict.fromkeys(chosen, repeats), on_sample=on_sample).samples)


def _replace_outliers(units: Sequence[Unit], clock: Clock, pools: Pools, on_sample) -> None:
    """Drop outliers and time their units again, once (a sample taken again may be off too; the median copes)."""
    dropped = pools.drop_outliers()
    if dropped:
        _merge(pools, run_rounds(units, clock, dropped, on_sample=on_sample))
