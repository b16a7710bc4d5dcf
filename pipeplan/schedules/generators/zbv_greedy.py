"""The Zero Bubble paper's adaptive ZB-V schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
section 6): a greedy over the V placement (device d holds stage a = d, first down the pipeline, and stage
b = 2p-1-d, back up), for measured costs, under a per-device limit on live activation bytes.

One run, for options (fill before F, fill before I) and a per-device idle allowance from a previous run:
  warm-up 1: F of stage a on every device; then from the last device up, each device runs its stage-b F for
             microbatch 0 after as many further stage-a forwards (on itself and the devices before it) as end
             before that F's input arrives, within memory;
  warm-up 2: forwards alternate between the chunks on the later devices until every device has at least as
             many forwards as the one before it and more stage-b forwards;
  2m rounds: one I per device (the next stage-b I when it is not behind, else stage-a's once its input came
             back), then one F per device (stage b's when its input is there, else stage a's). Pending Ws run
             before an op while they end before its input arrives, and one more when the wait exceeds the
             device's idle budget (the largest idle of any device, or the allowance, minus its own);
  end:       pending Ws drain.
A run is repeated with its own per-device idle as the allowance while that lowers the largest idle. Every op
the greedy places must be ready by its rules; when a rule is not met (unusual costs, few microbatches) the run
is abandoned (`None`) and the caller keeps the fixed ZB-V order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.placement import V_SHAPED, stage_devices, v_stages
from pipeplan.schedules.simulate import PerStageCosts

_KINDS = {"F": 0, "I": 1, "W": 2}


class _Abandon(Exception):
    """The greedy's rules do not hold for these inputs; keep the fixed order."""


class _VRun:
    def __init__(
        self, p: int, m: int, costs: PerStageCosts, delta: Deltas, limit: float, allowance: list[float] | None
    ) -> None:
        self.p, self.m, self.limit = p, m, limit + 1e-9 * max(1.0, abs(limit))
        self.cost = (costs.forward_ms, costs.input_grad_ms, costs.weight_grad_ms)
        self.comm, self.delta = costs.comm_ms, (delta["F"], delta["I"], delta["W"])
        self.end = [[[-1.0] * m for _ in range(2 * p)] for _ in range(3)]  # [kind][stage][mb]
        self.count = [[0] * (2 * p) for _ in range(3)]  # [kind][stage]
        self.free, self.mem, self.idle = [0.0] * p, [0.0] * p, [0.0] * p
        self.max_idle, self.first = 0.0, [0.0] * p
        self.mattered: set[str] = set()  # options that changed a decision in this run
        self.allowance = allowance or [0.0] * p
        self.max_allowance = max(self.allowance)
        self.pending: list[deque[int]] = [deque() for _ in range(p)]
        self.ops: list[list[Op]] = [[] for _ in range(p)]
        self.stages = tuple(v_stages(d, p) for d in range(p))  # per device: (stage a, stage b)
        self.placement = stage_devices(V_SHAPED, p, 2)

    def stage(self, d: int, chunk: int) -> int:
        return self.stages[d][chunk]

    def device(self, s: int) -> int:
        return self.placement[s]

    def arrival(self, kind: int, s: int) -> float | None:
        """When the input of the next `kind` op of stage s arrives from another device (None: same device or
        none); _Abandon if its producer has not been placed."""
        mb = self.count[kind][s]
        src = s - 1 if kind == 0 else s + 1
        if mb >= self.m or kind == 2 or not 0 <= src < 2 * self.p:
            return None
        e = self.end[kind][src][mb]
        if e < 0:
            raise _Abandon
        if self.device(src) == self.device(s):
            return None
        return e + self.comm[min(s, src)]

    def put(self, kind: int, s: int) -> None:
        d, mb = self.device(s), self.count[kind][s]
        if mb >= self.m or self.mem[d] + self.delta[kind][s] > self.limit:
            raise _Abandon
        own = self.end[kind - 1][s][mb] if kind else 0.0
        if own < 0:
            raise _Abandon
        start = self.free[d]
        arrival = self.arrival(kind, s)
        if arrival is not None and arrival > start:
            if self.count[0][self.stage(d, 0)] > 0:
                self.idle[d] += arrival - start
                self.max_idle = max(self.max_idle, self.idle[d])
            start = arrival
        if not self.ops[d]:
            self.first[d] = start
        self.free[d] = self.end[kind][s][mb] = start + self.cost[kind][s]
        self.mem[d] += self.delta[kind][s]
        self.count[kind][s] += 1
        self.ops[d].append(Op("FIW"[kind], s, mb))
        if kind == 1:
            self.pending[d].append(s)

    def put_w(self, d: int) -> None:
        self.put(2, self.pending[d].popleft())

    def budget(self, d: int) -> float:
        return max(self.max_idle, self.max_allowance - self.allowance[d]) - self.idle[d]

    def fill(self, d: int, arrival: float | None, extra: bool, option: str | None = None) -> None:
        """Ws before an op whose input arrives at `arrival`."""
        if arrival is None:
            return
        while self.pending[d] and arrival >= self.free[d] + self.cost[2][self.pending[d][0]]:
            self.put_w(d)
        if self.pending[d] and arrival - self.free[d] > self.budget(d):
            if option is not None:
                self.mattered.add(option)
            if extra:
                self.put_w(d)

    def make_room(self, d: int, s: int) -> None:
        while self.mem[d] + self.delta[0][s] > self.limit:
            if not self.pending[d]:
                raise _Abandon
            self.put_w(d)


def _warmup(run: _VRun) -> None:
    p, m, a, b = run.p, run.m, (lambda d: run.stages[d][0]), (lambda d: run.stages[d][1])
    for d in range(p):
        run.put(0, a(d))
    for d in range(p - 1, -1, -1):
        if d < p - 1:
            back = run.end[0][b(d + 1)][0] + run.comm[b(d + 1)]
            while (
                run.mem[d] + run.delta[0][a(d)] * (2 + 2 * d) <= run.limit
                and run.free[d] + run.cost[0][a(d)] <= back
                and run.count[0][a(d)] < m - d
            ):
                for j in range(d + 1):
                    run.put(0, a(j))
        run.put(0, b(d))
    chunk = 0
    for d in range(1, p):
        fa, fb = run.count[0][a(d)], run.count[0][b(d)]
        pa, pb = run.count[0][a(d - 1)], run.count[0][b(d - 1)]
        while fa + fb < pa + pb or fb <= pb < m:
            for j in range(p - 1, d - 1, -1):
                if run.count[0][run.stage(j, chunk)] < m:
                    run.put(0, run.stage(j, chunk))
            chunk = 1 - chunk
            fa, fb = run.count[0][a(d)], run.count[0][b(d)]
            pa, pb = run.count[0][a(d - 1)], run.count[0][b(d - 1)]


def _backward_round(run: _VRun, fill_i: bool) -> None:
    p, first, second = run.p, [], []
    for d in range(p):  # `first`: stage-b I (its input comes from the device before); `second`: stage a's
        a, b = run.stages[d]
        if run.count[1][a] >= run.count[1][b]:
            first.append(d)
        elif d == p - 1 or run.end[1][a + 1][run.count[1][a]] >= 0 or run.count[1][b] >= run.m:
            second.append(d)
        else:
            first.append(d)
    for d, chunk in [(d, 0) for d in reversed(second)] + [(d, 1) for d in first]:
        s = run.stage(d, chunk)
        run.fill(d, run.arrival(1, s), extra=chunk == 0 or fill_i, option=None if chunk == 0 else "fill_i")
        run.put(1, s)


def _forward_round(run: _VRun, fill_f: bool) -> None:
    p, m = run.p, run.m
    for d in range(p):
        a, b = run.stages[d]
        fa, fb = run.count[0][a], run.count[0][b]
        if fb >= m:
            continue
        if fb >= fa or d == p - 1 or run.end[0][b - 1][fb] >= 0:
            s = a if fb >= fa else b
        elif fa < m and (d == 0 or run.end[0][a - 1][fa] >= 0):
            s = a
        else:
            continue
        run.make_room(d, s)
        run.fill(d, run.arrival(0, s), extra=fill_f, option="fill_f")
        run.put(0, s)


Deltas = dict[str, tuple[float, ...]]
Candidate = tuple[Schedule, tuple[float, float]]  # op lists, (makespan, max span)


@dataclass(frozen=True)
class Outcome:
    """One run: op lists (None: abandoned), per-device idle, (makespan, max span), options that mattered."""

    schedule: Schedule | None
    idle: list[float]
    key: tuple[float, float]
    mattered: frozenset[str]


def greedy_run(
    p: int,
    m: int,
    costs: PerStageCosts,
    delta: Deltas,
    limit: float,
    fill_f: bool,
    fill_i: bool,
    allowance: list[float] | None = None,
) -> Outcome:
    """One run (`costs` per stage, tuples). Its times are those `simulate()` gives the op lists."""
    run = _VRun(p, m, costs, delta, limit, allowance)
    try:
        _warmup(run)
        for _ in range(2 * m):
            _backward_round(run, fill_i)
            _forward_round(run, fill_f)
        for d in range(p):
            while run.pending[d]:
                run.put_w(d)
    except _Abandon:
        return Outcome(None, run.idle, (0.0, 0.0), frozenset(run.mattered))
    key = (max(run.free), max(f - s for f, s in zip(run.free, run.first)))
    return Outcome(make_schedule("zbv", m, run.placement, run.ops), run.idle, key, frozenset(run.mattered))


def _chain(
    p: int, m: int, costs: PerStageCosts, delta: Deltas, limit: float, fill_f: bool, fill_i: bool
) -> tuple[list[Candidate], set[str]]:
    """A run, then repeats with its own idle as the allowance while that lowers the largest idle (at most 8):
    the completed runs, and every option any run of the chain consulted."""
    found: list[Candidate] = []
    mattered: set[str] = set()
    best = None
    for _ in range(8):
        outcome = greedy_run(p, m, costs, delta, limit, fill_f, fill_i, allowance=best.idle if best else None)
        mattered |= outcome.mattered
        if outcome.schedule is None or (best is not None and max(outcome.idle) >= max(best.idle)):
            break
        best = outcome
        found.append((outcome.schedule, outcome.key))
    return found, mattered


def greedy_candidates(p: int, m: int, costs: PerStageCosts, delta: Deltas, limit: float) -> list[Candidate]:
    """Every completed run over the options (fill before F, fill before I), each with its repeats; a combination
    is skipped when an earlier one's runs never consulted the option they differ in (it would repeat them)."""
    found: list[Candidate] = []
    done: list[tuple[dict[str, bool], set[str]]] = []
    for fill_i in (True, False):
        for fill_f in (True, False):
            opts = {"fill_f": fill_f, "fill_i": fill_i}
            if any(all(other[n] == opts[n] for n in mattered) for other, mattered in done):
                continue
            runs, mattered = _chain(p, m, costs, delta, limit, fill_f, fill_i)
            done.append((opts, mattered))
            found += runs
    return found
