"""`refine` learns a step tail's parts on their own (refine/updates.py): synthetic runs with known gradient-exchange,
global-check and update parts give those figures back; the refined profile's exchange efficiency scales a re-plan's
exchange by its own bytes and group; its checks are counted once per synchronized step; older profiles and plans
are unchanged. Bookkeeping, not timings."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.search import make_cluster, synthetic_profile

from pipeplan.artifact.measured import MeasuredRun, RunRecord, TracedOp, run_record
from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.scripts import with_profile
from pipeplan.artifact.timing import plan_step_ms
from pipeplan.costs import numerics
from pipeplan.costs.comm import gradient_sync_ms
from pipeplan.costs.overlap import eager_update_ms, update_bytes_per_param
from pipeplan.profiling.profile import Profile
from pipeplan.refine.bookkeeping import measured_medians, retimed_plan
from pipeplan.refine.job import learned, refined_profile
from pipeplan.refine.updates import with_learned_tail
from pipeplan.schedules.ops import Op
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans

EFFICIENCY = 0.4  # the run's exchanges ran at 0.4x the link model's speed
CHECKS = (3.0, 5.0)  # per rank: the rank that arrived last waited 3 ms (the checks), the other 2 ms more
UPDATE = (6.0, 6.5)


def _config(depth: int, **fields) -> SearchConfig:
    return SearchConfig(
        global_batch_size=8,
        microbatch_sizes=(1,),
        pipeline_depths=(depth,),
        replication=False,
        numerics=numerics("adamw", "fp32"),
        recompute="none",
        post_validate="off",
        **fields,
    )


def _profile(**provenance) -> Profile:
    profile = synthetic_profile(num_layers=4, cut_bytes=1000)
    return dataclasses.replace(profile, provenance=dataclasses.replace(profile.provenance, **provenance))


def _plan(profile: Profile, devices: int, depth: int, schedule: str = "1f1b") -> Plan:
    result = search_plans(profile, make_cluster(devices, memory=2**34), _config(depth), (schedule,))
    return with_profile(build_plan(result, model=ModelRef(ref="synthetic")), profile)


def _exchange(plan: Plan) -> list[float]:
    return [sum(plan.stages[s].allreduce_ms for s in info.stages) for info in plan.ranks]


def _run(plan: Plan, *, marked: bool = True, efficiency: float = EFFICIENCY, post_validate: bool = False):
    """Three steps of the plan's op lists (1 ms each op; step 0 the warm-up) and each rank's tail: the plan's
    exchange at `efficiency` (its planned time over it), CHECKS, UPDATE; without marks only the tails' sums."""
    ops = [
        TracedOp(rank, step, Op.parse(text), 1.0)
        for rank, names in enumerate(plan.rank_ops)
        for step in range(3)
        for text in names
    ]
    parts = tuple((x / efficiency, c, u) for x, c, u in zip(_exchange(plan), CHECKS, UPDATE))
    record = RunRecord(**run_record(plan, None, threads=1, post_validate=post_validate))
    return MeasuredRun(
        path="synthetic.json",
        record=record,
        ops=tuple(ops),
        steps=(0, 1, 2),
        tail_ms=tuple(sum(p) for p in parts),
        tail_parts_ms=parts if marked else (),
    )


def _refined(plan: Plan, run: MeasuredRun, profile: Profile) -> tuple[Profile, Plan]:
    refined = refined_profile(plan, profile, measured_medians(plan, run), run)
    prior = profile.provenance.exchange_efficiency
    return refined, with_learned_tail(retimed_plan(plan, refined), learned(refined), prior)


def test_known_parts_give_their_figures_back():
    profile = _profile()
    plan = _plan(profile, devices=2, depth=1)  # one stage x 2 pipelines: each rank exchanges its gradients
    assert plan.training.data_parallel == 2 and all(ms > 0 for ms in _exchange(plan))
    run = _run(plan)
    refined, retimed = _refined(plan, run, profile)
    prov = refined.provenance
    assert prov.exchange_efficiency == pytest.approx(EFFICIENCY)
    assert prov.step_checks_ms == CHECKS[0]  # the smallest: the others' excess is the wait for that rank
    moved = update_bytes_per_param(plan.training.numerics)
    params = plan.stages[0].param_count
    assert prov.update_bytes_per_s == pytest.approx(params * moved / (max(UPDATE) / 1e3))  # the slowest rank's
    # the run's own plan with what was learned: its exchanges the measured ones, the checks, the slowest update
    assert _exchange(retimed) == pytest.approx([x / EFFICIENCY for x in _exchange(plan)])
    assert retimed.training.step_checks_ms == CHECKS[0]
    assert sum(s.optimizer_ms for s in retimed.stages) == pytest.approx(max(UPDATE))
    # the checks are counted once per synchronized step, not under post-validation
    unchecked = dataclasses.replace(retimed, training=dataclasses.replace(retimed.training, step_checks_ms=0.0))
    synced = plan_step_ms(retimed, post_validate=False) - plan_step_ms(unchecked, post_validate=False)
    assert synced == pytest.approx(CHECKS[0])
    assert plan_step_ms(retimed, post_validate=True) == pytest.approx(plan_step_ms(unchecked, post_validate=True))
    # written and read back
    again = Profile.from_dict(refined.to_dict()).provenance
    assert (again.exchange_efficiency, again.step_checks_ms) == (prov.exchange_efficiency, prov.step_checks_ms)


def test_the_exchange_is_the_replica_that_arrived_last():
    """The rank that finished its ops first waits in the exchange for its replica (4 ms here): the exchange's speed
    is the one of the replica that waited for nobody, whose ops the step is costed with."""
    profile = _profile()
    plan = _plan(profile, devices=2, depth=1)
    run = _run(plan)
    waited = ((run.tail_parts_ms[0][0] + 4.0, *run.tail_parts_ms[0][1:]), *run.tail_parts_ms[1:])
    skewed = dataclasses.replace(run, tail_parts_ms=waited, tail_ms=tuple(sum(p) for p in waited))
    refined, _ = _refined(plan, skewed, profile)
    assert refined.provenance.exchange_efficiency == pytest.approx(EFFICIENCY)


def test_a_replan_scales_the_exchange_by_its_own_bytes_and_group():
    """The efficiency, not the run's milliseconds, is what a re-plan inherits: 4 pipelines' ring all-reduce moves
    2 (n - 1) / n of the gradients, and the learned speed divides the link model's time for that."""
    base, refined = _profile(), _profile(exchange_efficiency=EFFICIENCY, step_checks_ms=CHECKS[0])
    cluster = make_cluster(4, memory=2**34)
    for depth, dp in ((1, 4), (2, 2)):
        plain = search_plans(base, cluster, _config(depth), ("1f1b",)).ranked[0]
        learned_ = search_plans(refined, cluster, _config(depth), ("1f1b",)).ranked[0]
        assert learned_.layout.data_parallel == plain.layout.data_parallel == dp
        assert learned_.stage_allreduce_ms == pytest.approx([ms / EFFICIENCY for ms in plain.stage_allreduce_ms])
        stage = plain.partition.stages[0]
        count = sum(layer.param_count for layer in base.layers[stage.first_layer : stage.last_layer + 1])
        link = cluster.link_between(list(range(4)))
        model = gradient_sync_ms(count * 4, count * 4, dp, link, 0)  # fp32 gradients
        assert learned_.stage_allreduce_ms[0] == pytest.approx(model / EFFICIENCY)
    plan = _plan(refined, devices=4, depth=2)  # the plan records the checks; show and run reproduce its step
    assert plan.training.step_checks_ms == CHECKS[0]
    assert plan_step_ms(plan) == pytest.approx(plan.predicted.step_ms)
    assert Plan.from_dict(plan.to_dict()).fingerprint == plan.fingerprint


def test_a_second_round_learns_the_speed_not_its_ratio_to_the_first():
    profile = _profile(exchange_efficiency=EFFICIENCY)
    plan = _plan(profile, devices=2, depth=1)  # its exchanges already timed at EFFICIENCY
    run = _run(plan, efficiency=1.0)  # ...and they ran at that: measured = planned
    refined, retimed = _refined(plan, run, profile)
    assert refined.provenance.exchange_efficiency == pytest.approx(EFFICIENCY)
    assert _exchange(retimed) == pytest.approx(_exchange(plan))


def test_unmarked_runs_teach_the_update_alone_and_keep_what_was_learned():
    """A post-validated run has no marks: what each tail leaves after the plan's exchange is its eager update
    (with the undo copy); the exchange efficiency and checks the profile had are kept."""
    profile = _profile(exchange_efficiency=0.5, step_checks_ms=2.0)
    plan = _plan(profile, devices=2, depth=1)
    run = _run(plan, marked=False, efficiency=1.0, post_validate=True)
    refined, retimed = _refined(plan, run, profile)
    prov = refined.provenance
    assert (prov.exchange_efficiency, prov.step_checks_ms) == (0.5, 2.0)
    left = [c + u for c, u in zip(CHECKS, UPDATE)]  # the tail beyond the exchange: taken as the eager update
    eager = eager_update_ms([s.optimizer_ms for s in retimed.stages] * 2, plan.training.numerics)
    assert eager == pytest.approx([min(left)] * 2)  # the rank that waited least: the other's excess is its wait


def test_older_profiles_and_plans_are_unchanged():
    profile = _profile()
    written = profile.to_dict()["provenance"]
    assert "exchange_efficiency" not in written and "step_checks_ms" not in written
    assert Profile.from_dict(profile.to_dict()).provenance.exchange_efficiency is None
    plan = _plan(profile, devices=2, depth=1)
    assert plan.training.step_checks_ms == 0.0 and "step_checks_ms" not in plan.to_dict()["training"]
    same = _plan(_profile(exchange_efficiency=None, step_checks_ms=None), devices=2, depth=1)
    assert same.fingerprint == plan.fingerprint
