"""`pipeplan run --post-validate` overlaps consecutive steps (2 gloo ranks, CPU), read from `--trace`, and the
several-step simulation (`schedules.period`) of the plan's op lists with the run's own op times gives its period.

Under zb-h2 on two ranks the rank holding stage 0 ends its step first (stage 1 still runs the last weight-gradient
passes), so a post-validated run must start that rank's next forwards before stage 1's step ends; a synchronized run
(the global check before every optimizer step) never may. Stage 1 holds seven layers and stage 0 one, so that
stage 0's step ends well before stage 1's last weight-gradient passes do. Both runs are launched together and
traced over the same steps; the trace's per-rank, per-step op times on one clock are what the comparison reads."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from helpers.runtime import make_plan

from pipeplan.artifact.timing import plan_costs, plan_schedule
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.train.config import RunConfig
from pipeplan.schedules.ops import Op
from pipeplan.schedules.period import StepEnd, simulate_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6
MLP = dict(layers=8, hidden=512)  # weight-gradient passes of a few ms
CUTS = [(0, 0), (1, 7)]  # stage 1 seven times stage 0: its last weight-gradient passes outlast stage 0's step


def _overlaps(trace: dict) -> list[bool]:
    """For each step k after the first: does the next step's first forward on rank 0 start before the slowest
    rank's last op of step k ends (so before its step ends, which is later: its optimizer step)?"""
    ranks = trace["pipeplan_measured"]["ranks"]
    ends = [{s["step"]: max(b for _, _, b in s["ops"]) for s in rank["steps"]} for rank in ranks]
    first_forward = {s["step"]: min(a for op, a, _ in s["ops"] if "F" in op) for s in ranks[0]["steps"]}
    steps = sorted(first_forward)
    return [first_forward[k + 1] < max(e[k] for e in ends) for k in steps[1:-1]]


def _replayed_period(plan, trace: dict, *, post_validate: bool) -> tuple[float, float]:
    """(simulated, measured) period of a traced run, its first step left out: the plan's op lists simulated over
    several steps with the run's mean time per (kind, stage) and each rank's measured end of step after its last op
    (post-validated: its own; synchronized: after the slowest rank's last op, the global check included) as the
    update; measured: the mean interval between step ends, the slowest rank's."""
    ranks, durations = trace["pipeplan_measured"]["ranks"], {}
    for rank in ranks:
        for step in rank["steps"][1:]:
            for text, start, end in step["ops"]:
                o = Op.parse(text)
                durations.setdefault((o.kind, o.stage), []).append(end - start)
    planned = plan_costs(plan)
    mean = {k: [statistics.fmean(durations.get((k, s), [0.0])) for s in range(len(plan.stages))] for k in "FIWB"}
    costs = dataclasses.replace(
        planned, forward_ms=mean["F"], input_grad_ms=mean["I"], weight_grad_ms=mean["W"], backward_ms=mean["B"]
    )
    costs = dataclasses.replace(costs, comm_ms=(0.0,) * (len(plan.stages) - 1))  # a transfer's wait is in its op
    last = [{s["step"]: max(b for _, _, b in s["ops"]) for s in rank["steps"]} for rank in ranks]
    last_of_all = {k: max(own[k] for own in last) for k in last[0]}
    updates = []
    for rank, own in zip(ranks, last):
        after = [s["end_ms"] - (own if post_validate else last_of_all)[s["step"]] for s in rank["steps"][1:]]
        updates.append(statistics.fmean(after))
    measured = max((r["steps"][-1]["end_ms"] - r["steps"][1]["end_ms"]) / (len(r["steps"]) - 2) for r in ranks)
    simulated = simulate_steps(plan_schedule(plan), costs, StepEnd(update_ms=updates), post_validate=post_validate)
    return simulated.period_ms, measured


def test_post_validated_steps_overlap_and_synchronized_ones_do_not(tmp_path):
    path, plan = make_plan(
        tmp_path,
        "zb",
        "mlp",
        MLP,
        schedule="zb-h2",
        pipeline_devices=2,
        num_microbatches=4,
        microbatch_size=64,
        cuts=CUTS,
    )
    assert list(plan.rank_ops[1][-3:]) == ["1W1", "1W2", "1W3"] and list(plan.rank_ops[0][-2:]) == ["0I3", "0W3"]
    base = RunConfig(steps=STEPS, quiet=True, heartbeat_timeout_s=30.0, check_every=0)
    runs = [
        (path, dataclasses.replace(base, post_validate=post, trace_path=str(tmp_path / f"{post}.json")))
        for post in (False, True)
    ]
    results = launch_many(runs, threads=1)
    synchronized, post = (json.loads((tmp_path / f"{p}.json").read_text()) for p in (False, True))
    assert not any(_overlaps(synchronized))  # the all-gather before each step waits for the slowest rank
    overlapped = _overlaps(post)
    assert len(overlapped) == STEPS - 2 and sum(overlapped) * 2 >= len(overlapped), overlapped  # (a shared machine)
    for post_validate, trace in ((False, synchronized), (True, post)):  # the period simulated, as run
        simulated, measured = _replayed_period(plan, trace, post_validate=post_validate)
        # 15%: on a shared 2-core machine (two test workers) the ranks also wait for a core between ops, which no op's
        # time holds (10% failed under load: 129.9 measured against 117.9 simulated)
        assert measured == pytest.approx(simulated, rel=0.15), (post_validate, simulated, measured)
    for per_rank in results:  # both runs recorded every step: the intervals between step ends
        assert [len(r.step_ms) for r in per_rank] == [STEPS, STEPS] and all(t > 0 for r in per_rank for t in r.step_ms)
