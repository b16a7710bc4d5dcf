"""The Zero Bubble paper's automatic-scheduling heuristic (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024, section 3.1 "Heuristic algorithm"; ZB-1p / ZB-2p), one stage per device, under a per-device limit on live
activation bytes (F allocates, I frees part, W the rest: `simulate.activation_deltas`).

One run, for options (warm-up variant, prioritize I, greedy W fill):
  round 0:  every stage runs F0; then each stage j adds warm-up forwards while they end before the estimated
            return of the first input gradient (last stage's I0, then I0 back up the pipeline), within memory;
            the counts are made strictly decreasing along the pipeline; then I0 from the last stage up;
  round i:  each stage runs one F (a stage does an F only if the next stage does), then from the last stage up
            one I (microbatch i). Before an op that has to wait for its input, pending Ws fill the wait: while a
            W ends before the input arrives; one more W if the remaining wait exceeds this stage's idle budget
            (the largest accumulated idle of any stage minus this stage's), or within it with greedy W fill.
            Ws also run when memory forces them (before an F), and stage 0 drains its Ws once its forwards are
            done. "Prioritize I": a stage two or more forwards ahead of the next skips its F when the F would
            delay the next I returning from downstream and waiting for that I fits its idle budget;
  end:      every stage drains its pending Ws.
Times are those `simulate()` gives the same op lists (as soon as the device and the inputs are ready).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ScheduleError
from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.simulate import PerStageCosts


@dataclass(frozen=True)
class Options:
    """The three binary options the paper's heuristic is run with (best of the 8 runs is kept)."""

    bubble_before_first_i: bool  # warm-up: allow a forward to overrun the first I's return
    prioritize_i: bool  # skip an F that would delay a returning I
    greedy_w: bool  # fill a wait within the idle budget with a W


ALL_OPTIONS = tuple(Options(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False))


@dataclass(frozen=True)
class Result:
    """One run: its options, the options that changed a decision, op codes per stage, and its timing."""

    options: Options
    mattered: frozenset[str]
    codes: list[list[int]]
    makespan: float
    max_span: float

    def schedule(self) -> Schedule:
        m = len(self.codes[0]) // 3
        ops = [[Op("FIW"[c // m], j, c % m) for c in row] for j, row in enumerate(self.codes)]
        return make_schedule("zb-auto", m, tuple(range(len(self.codes))), ops)


class _Run:
    """State of one heuristic run: per stage the next F / I / W microbatch, device free time, live bytes,
    accumulated idle time and op end times."""

    def __init__(
        self, m: int, costs: PerStageCosts, delta: dict[str, tuple[float, ...]], limit: float, rise_i: tuple | None
    ) -> None:
        p = len(delta["F"])
        self.p, self.m, self.limit = p, m, limit + 1e-9 * max(1.0, abs(limit))
        self.cf, self.ci, self.cw = costs.forward_ms, costs.input_grad_ms, costs.weight_grad_ms
        self.comm = costs.comm_ms
        self.df, self.di, self.dw = delta["F"], delta["I"], delta["W"]
        self.rise_i = rise_i or (0.0,) * p  # what an I holds above the level before it (recomputation)
        self.f, self.i, self.w = [0] * p, [0] * p, [0] * p
        self.free, self.mem, self.idle = [0.0] * p, [0.0] * p, [0.0] * p
        self.max_idle = 0.0
        self.tf = [[0.0] * m for _ in range(p)]
        self.ti = [[0.0] * m for _ in range(p)]
        self.first_start, self.last_end = [0.0] * p, [0.0] * p
        self.codes: list[list[int]] = [[] for _ in range(p)]  # per stage: mb (F), m + mb (I), 2m + mb (W)
        self.mattered: set[str] = set()  # options whose value changed a decision in this run

    def _start(self, j: int, ready: float) -> float:
        free = self.free[j]
        if ready <= free:
            return free
        if self.f[j] > 0:
            self.idle[j] += ready - free
            if self.idle[j] > self.max_idle:
                self.max_idle = self.idle[j]
        return ready

    def put_f(self, j: int) -> None:
        mb = self.f[j]
        ready = self.tf[j - 1][mb] + self.comm[j - 1] if j else 0.0
        start = self._start(j, ready)
        if mb == 0:
            self.first_start[j] = start
        self.free[j] = self.tf[j][mb] = start + self.cf[j]
        self.mem[j] += self.df[j]
        self.f[j] += 1
        self.codes[j].append(mb)

    def put_i(self, j: int) -> None:
        while self.mem[j] + self.rise_i[j] > self.limit and self.w[j] < self.i[j]:
            self.put_w(j)  # room for what recomputation re-creates while the I runs
        mb = self.i[j]
        ready = self.ti[j + 1][mb] + self.comm[j] if j + 1 < self.p else 0.0
        self.free[j] = self.ti[j][mb] = self._start(j, ready) + self.ci[j]
        self.mem[j] += self.di[j]
        self.i[j] += 1
        self.codes[j].append(self.m + mb)

    def put_w(self, j: int) -> None:
        self.free[j] += self.cw[j]
        self.mem[j] += self.dw[j]
        self.codes[j].append(2 * self.m + self.w[j])
        self.w[j] += 1

    def free_memory_for_f(self, j: int) -> None:
        while self.mem[j] + self.df[j] > self.limit:
            if self.w[j] >= self.i[j]:
                raise ScheduleError(f"zb-auto cannot fit a forward of stage {j} under --memory-limit; raise the limit")
            self.put_w(j)

    def fill_wait(self, j: int, arrival: float, greedy: bool) -> None:
        """Run pending Ws while they end before `arrival`; then maybe one more (see the module docstring)."""
        cw = self.cw[j]
        while self.w[j] < self.i[j] and self.free[j] + cw <= arrival:
            self.put_w(j)
        if self.w[j] < self.i[j] and self.free[j] < arrival:
            within_budget = arrival - self.free[j] <= self.max_idle - self.idle[j]
            if within_budget:
                self.mattered.add("greedy_w")
            if greedy or not within_budget:
                self.put_w(j)

    def warmup(self, bubble_before_first_i: bool) -> list[int]:
        """Extra forwards per stage before its first I, strictly decreasing along the pipeline."""
        p, last = self.p, self.p - 1
        extra = [0] * p
        returned = self.tf[last][0] + self.ci[last]
        for j in range(p - 2, -1, -1):
            mem, t, back = self.mem[j], self.free[j], returned + self.comm[j]
            while self.f[j] + extra[j] < self.m and mem + self.df[j] <= self.limit:
                if (t + self.cf[j] > back) if bubble_before_first_i else (t >= back):
                    break
                mem += self.df[j]
                t += self.cf[j]
                extra[j] += 1
            returned = max(t, back) + self.ci[j]
        for j in range(1, p):
            while 0 < extra[j] >= extra[j - 1] and self.f[j] + extra[j] < self.m:
                extra[j] -= 1
        return extra

    def wants_f(self, j: int, prioritize_i: bool) -> bool:
        if self.f[j] >= self.m:
            return False
        if j + 1 >= self.p or self.f[j] < self.f[j + 1] + 2 or self._keeps_f(j):
            return True
        self.mattered.add("prioritize_i")
        return not prioritize_i

    def _keeps_f(self, j: int) -> bool:
        """Whether "prioritize I" keeps this stage's F (it is two or more forwards ahead of the next stage)."""
        k = j + 1
        next_back = self.free[k] + self.cf[k] + self.ci[k] + self.comm[j]
        if self.free[j] >= next_back:
            return False
        forced_w, mem, w = 0.0, self.mem[j] + self.df[j], self.w[j]
        while mem > self.limit and w < self.i[j]:
            forced_w += self.cw[j]
            mem += self.dw[j]
            w += 1
        if self.free[j] + self.cf[j] + forced_w <= next_back:
            return True
        return next_back - self.free[j] > self.max_idle - self.idle[j]


def _round(run: _Run, i: int, opts: Options) -> None:
    p = run.p
    wants = [run.wants_f(j, opts.prioritize_i) for j in range(p)]
    for j in range(p - 2, -1, -1):
        wants[j] = wants[j] and wants[j + 1]
    for j in range(p):
        if wants[j]:
            run.free_memory_for_f(j)
            if j:
                run.fill_wait(j, run.tf[j - 1][run.f[j]] + run.comm[j - 1], opts.greedy_w)
            run.put_f(j)
    for j in range(p - 1, -1, -1):
        if j + 1 < p:
            run.fill_wait(j, run.ti[j + 1][i] + run.comm[j], opts.greedy_w)
        if j == 0 and run.f[0] == run.m:
            while run.w[0] < run.i[0]:
                run.put_w(0)
        run.put_i(j)


def heuristic_run(
    m: int,
    costs: PerStageCosts,
    delta: dict[str, tuple[float, ...]],
    limit: float,
    opts: Options,
    rise_i: tuple | None = None,
) -> Result:
    """One run of the heuristic. `costs` per stage (tuples), `delta` from `activation_deltas`, `rise_i` the I rises
    of `activation_rises` (None: I only frees). An I runs pending Ws first while its rise would pass the limit."""
    run = _Run(m, costs, delta, limit, rise_i)
    p = run.p
    for j in range(p):
        run.free_memory_for_f(j)
        run.put_f(j)
    with_bubble, without = run.warmup(True), run.warmup(False)
    if with_bubble != without:
        run.mattered.add("bubble_before_first_i")
    for j, extra in enumerate(with_bubble if opts.bubble_before_first_i else without):
        for _ in range(extra):
            run.put_f(j)
    for j in range(p - 1, -1, -1):
        run.put_i(j)
    for i in range(1, m):
        _round(run, i, opts)
    for j in range(p):
        while run.w[j] < m:
            run.put_w(j)
    spans = [run.free[j] - run.first_start[j] for j in range(p)]
    return Result(
        options=opts, mattered=frozenset(run.mattered), codes=run.codes, makespan=max(run.free), max_span=max(spans)
    )


def heuristic_runs(
    m: int, costs: PerStageCosts, delta: dict[str, tuple[float, ...]], limit: float, rise_i: tuple | None = None
) -> list[Result]:
    """The distinct runs over the 8 option combinations: a combination is skipped when an earlier run never
    consulted the options it differs in (it would repeat that run op for op)."""
    results: list[Result] = []
    for opts in ALL_OPTIONS:
        if any(all(getattr(r.options, n) == getattr(opts, n) for n in r.mattered) for r in results):
            continue
        results.append(heuristic_run(m, costs, delta, limit, opts, rise_i))
    return results
