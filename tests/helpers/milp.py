"""Exact optimum for small cases: the Zero Bubble paper's ILP (Qi et al., ICLR 2024, section 3.1 and appendix)
solved with scipy.optimize.milp (HiGHS), one stage per device: the yardstick tests and benchmarks/bench_schedules.py
rate zb-auto against (not part of the package).

Variables: the end time E of every F, I, W op; one binary per pair of same-stage ops whose order is open
(F_a vs I_b, F_a vs W_b, I_a vs W_b for a > b: within a kind microbatches keep their order, as in the paper);
and the objective T. Constraints:
  - dependencies: E_op >= E_dep + comm + cost_op (F on the previous stage's F, I on the next stage's I and its
    own F, W on its own I; comm across devices);
  - one device runs one op at a time: for an open pair, E_j >= E_i + cost_j or E_i >= E_j + cost_i (big-M);
  - memory: right after each F, the stage's live activations (earlier Fs, minus what earlier I and W freed)
    stay within the limit (`simulate.activation_deltas`);
  - T >= every op's end (the makespan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.errors import ConfigError
from pipeplan.schedules.ops import Op, Schedule, make_schedule
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, activation_deltas, unit_memory

_K = {"F": 0, "I": 1, "W": 2}


@dataclass(frozen=True)
class MilpResult:
    """`value`: the objective of the best schedule found; `proven`: HiGHS proved it optimal within the time
    limit (else `bound` is the proven lower bound); `schedule`: its op lists (ordered by start time)."""

    value: float
    bound: float
    proven: bool
    schedule: Schedule


class _Model:
    def __init__(self, p: int, m: int) -> None:
        self.p, self.m = p, m
        self.n_ops = 3 * p * m
        self.pairs: list[tuple[int, int]] = []  # (i, j): binary x = 1 means i runs before j
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def op(self, kind: str, s: int, mb: int) -> int:
        return (_K[kind] * self.p + s) * self.m + mb

    @property
    def t_var(self) -> int:
        return self.n_ops + len(self.pairs)

    def add(self, coeffs: dict[int, float], lb: float, ub: float = np.inf) -> None:
        self.rows.append((coeffs, lb, ub))


def _open_pairs(model: _Model) -> None:
    p, m, op = model.p, model.m, model.op
    for s in range(p):
        for a in range(m):
            for b in range(a):
                model.pairs += [(op("F", s, a), op("I", s, b)), (op("F", s, a), op("W", s, b))]
                model.pairs.append((op("I", s, a), op("W", s, b)))


def _dependencies(model: _Model, cost: dict[str, tuple[float, ...]], comm: tuple[float, ...]) -> None:
    p, m, op = model.p, model.m, model.op
    for s in range(p):
        for mb in range(m):
            f, i, w = op("F", s, mb), op("I", s, mb), op("W", s, mb)
            model.add({f: 1.0}, cost["F"][s])
            if s:
                model.add({f: 1.0, op("F", s - 1, mb): -1.0}, cost["F"][s] + comm[s - 1])
            model.add({i: 1.0, f: -1.0}, cost["I"][s])
            if s + 1 < p:
                model.add({i: 1.0, op("I", s + 1, mb): -1.0}, cost["I"][s] + comm[s])
            model.add({w: 1.0, i: -1.0}, cost["W"][s])
            for kind in "FIW":
                if mb:
                    model.add({op(kind, s, mb): 1.0, op(kind, s, mb - 1): -1.0}, cost[kind][s])


def _disjunctions(model: _Model, dur: list[float], big: float) -> None:
    for k, (i, j) in enumerate(model.pairs):
        x = model.n_ops + k
        model.add({j: 1.0, i: -1.0, x: -big}, dur[j] - big)  # x = 1: j after i
        model.add({i: 1.0, j: -1.0, x: big}, dur[i])  # x = 0: i after j


def _memory(model: _Model, delta: dict[str, tuple[float, ...]], limit: float) -> None:
    index = {pair: model.n_ops + k for k, pair in enumerate(model.pairs)}
    p, m, op = model.p, model.m, model.op
    for s in range(p):
        for a in range(m):
            fixed = (a + 1) * delta["F"][s]  # F_0..F_a
            coeffs: dict[int, float] = {}
            for b in range(a):  # I_b / W_b (b < a) before F_a frees their part
                coeffs[index[(op("F", s, a), op("I", s, b))]] = -delta["I"][s]  # x = 1: I_b after F_a
                fixed += delta["I"][s]
                coeffs[index[(op("F", s, a), op("W", s, b))]] = -delta["W"][s]
                fixed += delta["W"][s]
            model.add(coeffs, -np.inf, limit - fixed + 1e-9 * max(1.0, abs(limit)))


def _makespan(model: _Model) -> None:
    """T >= each stage's last W end (its last op: Ws keep microbatch order)."""
    p, m, op, t = model.p, model.m, model.op, model.t_var
    for s in range(p):
        model.add({t: 1.0, op("W", s, m - 1): -1.0}, 0.0)


def solve_milp(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: StageCosts | None = None,
    memory: MemoryCosts | None = None,
    memory_limit: float,
    time_limit: float = 30.0,
) -> MilpResult | None:
    """The optimal schedule under `memory_limit` (None when infeasible or no solution within `time_limit` s)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    if memory is not None and memory.kept_bytes is not None:
        raise ConfigError("the MILP scheduler models no activation recomputation; give memory without kept_bytes")
    p, m = num_devices, num_microbatches
    c = (costs or StageCosts()).per_stage(p)
    cost = {"F": c.forward_ms, "I": c.input_grad_ms, "W": c.weight_grad_ms}
    model = _Model(p, m)
    _open_pairs(model)
    dur = [cost[k][s] for k in "FIW" for s in range(p) for _ in range(m)]  # type: ignore[index]
    big = sum(dur) + 3 * p * m * sum(c.comm_ms) + 1.0  # type: ignore[arg-type]
    _dependencies(model, cost, c.comm_ms)  # type: ignore[arg-type]
    _disjunctions(model, dur, big)
    _memory(model, activation_deltas(memory or unit_memory(1), p), memory_limit)
    _makespan(model)
    n_vars = model.t_var + 1
    matrix = lil_matrix((len(model.rows), n_vars))
    for r, (coeffs, _, _) in enumerate(model.rows):
        for var, value in coeffs.items():
            matrix[r, var] = value
    lower = np.array([lb for _, lb, _ in model.rows])
    upper = np.array([ub for _, _, ub in model.rows])
    integrality = np.zeros(n_vars)
    integrality[model.n_ops : model.t_var] = 1
    bounds_lo, bounds_hi = np.zeros(n_vars), np.full(n_vars, big)
    bounds_hi[model.n_ops : model.t_var] = 1.0
    target = np.zeros(n_vars)
    target[model.t_var] = 1.0
    res = milp(
        target,
        constraints=LinearConstraint(matrix.tocsr(), lower, upper),
        integrality=integrality,
        bounds=Bounds(bounds_lo, bounds_hi),
        options={"time_limit": time_limit},
    )
    if res.x is None:
        return None
    bound = float(getattr(res, "mip_dual_bound", res.fun) or res.fun)
    return MilpResult(value=float(res.fun), bound=bound, proven=res.status == 0, schedule=_order(model, res.x, dur))


def _order(model: _Model, x: np.ndarray, dur: list[float]) -> Schedule:
    """Op lists sorted by the solution's start times (ties: the earlier end, then F before I before W)."""
    p, m = model.p, model.m
    rows: list[list[tuple[float, float, int, Op]]] = [[] for _ in range(p)]
    for k, kind in enumerate("FIW"):
        for s in range(p):
            for mb in range(m):
                i = model.op(kind, s, mb)
                end = round(float(x[i]), 6)
                rows[s].append((round(end - dur[i], 6), end, k, Op(kind, s, mb)))
    ops = [[o for *_, o in sorted(row, key=lambda r: r[:3] + (r[3].microbatch,))] for row in rows]
    return make_schedule("milp", m, tuple(range(p)), ops)
