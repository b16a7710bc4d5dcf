"""zb-auto: respects the memory limit, adapts to costs, never slower than zb-h1 / zb-h2 where they fit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeplan.schedules import StageCosts, generate, inflight_per_stage, simulate, validate

_TOL = 1e-9


@given(
    p=st.integers(1, 6),
    m=st.integers(1, 24),
    extra=st.integers(0, 8),
    f=st.floats(0.2, 3.0),
    i=st.floats(0.2, 3.0),
    w=st.floats(0.0, 3.0),
    comm=st.floats(0.0, 1.0),
    skew=st.floats(0.5, 2.0),
)
def test_zb_auto_never_worse_and_within_limit(p, m, extra, f, i, w, comm, skew):
    limit = p + extra
    costs = StageCosts(forward_ms=tuple(f * skew**s for s in range(p)), input_grad_ms=i, weight_grad_ms=w, comm_ms=comm)
    auto = generate("zb-auto", num_devices=p, num_microbatches=m, costs=costs, memory_limit=limit)
    validate(auto)
    assert max(inflight_per_stage(auto)) <= limit
    makespan = simulate(auto, costs).makespan
    for name in ("zb-h1", "zb-h2", "1f1b"):
        other = generate(name, num_devices=p, num_microbatches=m)
        if max(inflight_per_stage(other)) <= limit:
            assert makespan <= simulate(other, costs).makespan + _TOL


@given(p=st.integers(1, 6), m=st.integers(1, 24), limit=st.integers(1, 4))
def test_zb_auto_tight_limits(p, m, limit):
    auto = generate("zb-auto", num_devices=p, num_microbatches=m, memory_limit=limit)
    validate(auto)
    assert max(inflight_per_stage(auto)) <= limit


def test_limit_p_matches_zb_1p_and_2p_matches_zb_2p():
    for p in (2, 4, 8):
        m = 3 * p
        h1 = simulate(generate("zb-h1", num_devices=p, num_microbatches=m))
        h2 = simulate(generate("zb-h2", num_devices=p, num_microbatches=m))
        one_p = simulate(generate("zb-auto", num_devices=p, num_microbatches=m, memory_limit=p))
        two_p = simulate(generate("zb-auto", num_devices=p, num_microbatches=m, memory_limit=2 * p))
        assert one_p.makespan <= h1.makespan and one_p.zb_bubble_ms <= p - 1
        assert two_p.makespan <= h2.makespan and two_p.zb_bubble_ms == 0


def test_adapts_to_costs():
    # slow links and a cheap W: the cost-aware greedy beats the fixed orders under the same limits
    p, m = 4, 12
    costs = StageCosts(forward_ms=1, input_grad_ms=1, weight_grad_ms=0.3, comm_ms=1.0)
    auto_1p = simulate(generate("zb-auto", num_devices=p, num_microbatches=m, costs=costs, memory_limit=p), costs)
    assert auto_1p.makespan < simulate(generate("zb-h1", num_devices=p, num_microbatches=m), costs).makespan
    auto = simulate(generate("zb-auto", num_devices=p, num_microbatches=m, costs=costs, memory_limit=2 * p - 1), costs)
    h2 = simulate(generate("zb-h2", num_devices=p, num_microbatches=m), costs)
    assert auto.makespan < h2.makespan
    assert generate("zb-auto", num_devices=p, num_microbatches=m).name == "zb-auto"
