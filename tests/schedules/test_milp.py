"""The exact MILP (the paper's ILP) on tiny cases: its schedule is valid, within memory, simulates to its value,
and zb-auto is never below the proven optimum."""

from __future__ import annotations

import pytest
from helpers.milp import solve_milp

from pipeplan.schedules import StageCosts, generate, peak_activation_per_device, simulate, validate


@pytest.mark.parametrize(
    ("p", "m", "costs", "limit"),
    [
        (2, 3, StageCosts(), 2),
        (3, 3, StageCosts(forward_ms=3, input_grad_ms=3, weight_grad_ms=2, comm_ms=1), 3),
        (2, 4, StageCosts(forward_ms=1, input_grad_ms=2, weight_grad_ms=0.5, comm_ms=0.5), 1.5),
    ],
)
def test_milp_optimum_bounds_zb_auto(p, m, costs, limit):
    result = solve_milp(p, m, costs=costs, memory_limit=limit, time_limit=30)
    assert result is not None and result.proven
    validate(result.schedule)
    assert max(peak_activation_per_device(result.schedule)) <= limit + 1e-9
    assert simulate(result.schedule, costs).makespan == pytest.approx(result.value)
    auto = simulate(generate("zb-auto", num_devices=p, num_microbatches=m, costs=costs, memory_limit=limit), costs)
    assert auto.makespan >= result.value - 1e-6


def test_milp_infeasible_limit_gives_none():
    assert solve_milp(2, 2, memory_limit=0.5, time_limit=10) is None
