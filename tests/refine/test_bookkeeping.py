"""`pipeplan refine`'s bookkeeping on deterministic synthetic traces: op -> stage -> layers for 1f1b, zb-h1 (I/W
split, the first stage's I), zbv (V placement, chunks), interleaved (looped chunks), replicated stages and
recomputation; the refined prediction of the run's own plan is what the trace implies (the plan's op lists
simulated with the measured medians), and the refused traces."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from helpers.cli import one_error_line
from helpers.search import make_cluster, synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.measured import MeasuredRun, RunRecord, TracedOp, read_measured, run_record
from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.scripts import with_profile, write_plan_dir
from pipeplan.artifact.timing import plan_step_ms, plan_timeline, timeline_rows
from pipeplan.cli import app
from pipeplan.costs import LayerArrays, numerics, stage_op_ms
from pipeplan.costs.overlap import update_bytes_per_param
from pipeplan.errors import FormatError
from pipeplan.predict.gradient_sync import SyncGroup, updated_params
from pipeplan.profiling.profile import Profile
from pipeplan.refine.bookkeeping import measured_medians, refined_layers, retimed_plan
from pipeplan.refine.job import refined_profile
from pipeplan.refine.updates import LearnedTail, with_learned_tail
from pipeplan.runtime.train.trace_io import measured_trace
from pipeplan.schedules.ops import Op
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.scaling import scale_profile
from pipeplan.search.search import search_plans

runner = CliRunner()
FIELDS = {"F": "forward_ms", "I": "input_grad_ms", "W": "weight_grad_ms", "B": "backward_ms"}
STEPS = 5  # traced steps 0..4; step 0 (warm-up) is 10x slower and must be left out


def _plan(schedule: str, *, devices: int = 2, depth: int = 2, replication: bool = False, batch: int = 1) -> Plan:
    profile = synthetic_profile(num_layers=8, cut_bytes=1000, batch_size=batch)
    config = SearchConfig(
        global_batch_size=8 * batch,
        microbatch_sizes=(batch,),
        pipeline_depths=(depth,),
        replication=replication,
        numerics=numerics("adamw", "fp32"),
        recompute="none",
        post_validate="off",
    )
    result = search_plans(profile, make_cluster(devices, memory=2**34), config, (schedule,))
    return with_profile(build_plan(result, model=ModelRef(ref="synthetic")), profile)


def _true_ms(plan: Plan, stage: int, kind: str) -> float:
    """The synthetic run's cost of (stage, kind): the plan's, off by a different factor per stage and kind; the
    model's first stage's I under a split backward does no work (it only recomputes, and nothing is recomputed)."""
    planned = getattr(plan.stages[stage], FIELDS[kind])
    if planned == 0.0:
        return 0.0
    return planned * (1.0 + 0.25 * stage) * {"F": 1.3, "I": 1.7, "W": 0.6, "B": 1.1}[kind]


def _synthetic_run(plan: Plan, true=_true_ms) -> MeasuredRun:
    """Every rank runs its op list STEPS times; each op's duration is its (stage, kind)'s true cost, spread around
    it (x 0.9, 1, 1.1, ... : the median is the true cost), 10x in step 0; an overlapped pair takes both halves."""
    ops = []
    for rank, names in enumerate(plan.rank_ops):
        for step in range(STEPS):
            spread = 10.0 if step == 0 else (0.9, 1.0, 1.1, 1.0)[step % 4]
            for text in names:
                op = Op.parse(text)
                ops.append(TracedOp(rank, step, op, spread * sum(true(plan, p.stage, p.kind) for p in op.parts)))
    record = RunRecord(**run_record(plan, None, threads=1))
    return MeasuredRun(path="synthetic.json", record=record, ops=tuple(ops), steps=tuple(range(STEPS)))


def _implied(plan: Plan, medians) -> Plan:
    """What the trace implies: the plan's stages with their measured medians in place of the planned op times."""
    stages = []
    for stage in plan.stages:
        fields = {FIELDS[kind]: ms for (s, kind), ms in medians.items() if s == stage.index}
        stages.append(dataclasses.replace(stage, **fields))
    return dataclasses.replace(plan, stages=tuple(stages))


def _profile_of(plan: Plan):
    return synthetic_profile(num_layers=8, cut_bytes=1000, batch_size=plan.training.microbatch_size)


CASES = {
    "1f1b": dict(schedule="1f1b"),
    "zb-h1": dict(schedule="zb-h1"),
    "zbv": dict(schedule="zbv"),  # V: rank 0 holds stages 0 and 3
    "interleaved": dict(schedule="interleaved"),  # looped: rank 0 holds stages 0 and 2
    "replicated": dict(schedule="1f1b", devices=3, depth=3, replication=True),
    "microbatch 2": dict(schedule="zb-h1", batch=2),
}


@pytest.mark.parametrize("case", CASES)
def test_medians_map_ops_to_stages_and_layers(case):
    plan = _plan(**CASES[case])
    if case == "zbv":
        assert plan.ranks[0].stages == (0, 3) and plan.ranks[1].stages == (1, 2)
    if case == "interleaved":
        assert plan.ranks[0].stages == (0, 2)
    if case == "replicated":
        assert max(s.replicas for s in plan.stages) > 1
    run = _synthetic_run(plan)
    medians = measured_medians(plan, run)
    kinds = {Op.parse(t).kind for ops in plan.rank_ops for t in ops}
    assert set(medians) == {(s.index, kind) for s in plan.stages for kind in kinds}
    for (stage, kind), ms in medians.items():  # every rank's ops of the stage, the warm-up step left out
        assert ms == pytest.approx(_true_ms(plan, stage, kind), rel=1e-12)
    # the layers: each stage's layers scaled by its own factor; the stage's op times are the medians
    profile = _profile_of(plan)
    layers = refined_layers(plan, profile, medians)
    scaled = scale_profile(profile, plan.training.microbatch_size)
    for stage in plan.stages:
        for i in range(stage.first_layer, stage.last_layer + 1):  # the stage's own factor, every layer alike
            assert layers[i].forward_ms == pytest.approx(scaled.layers[i].forward_ms * 1.3 * (1 + 0.25 * stage.index))
    arrays = LayerArrays.from_profile(dataclasses.replace(scaled, layers=layers))
    for stage in plan.stages:
        ops = stage_op_ms(arrays, stage.first_layer, stage.last_layer, stage.recompute)
        got = {"F": ops.forward, "I": ops.input_grad, "W": ops.weight_grad, "B": ops.backward}
        for kind in kinds:
            assert got[kind] == pytest.approx(medians[(stage.index, kind)], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_refined_prediction_of_the_run_plan_is_what_the_trace_implies(case):
    plan = _plan(**CASES[case])
    run = _synthetic_run(plan)
    medians = measured_medians(plan, run)
    refined = refined_profile(plan, _profile_of(plan), medians, run)
    retimed = retimed_plan(plan, refined)
    implied = _implied(plan, medians)
    got = plan_step_ms(retimed)
    want = plan_step_ms(implied)
    assert got == pytest.approx(want, rel=1e-9)
    assert got != pytest.approx(plan.predicted.step_ms, rel=1e-3)  # the run's costs, not the plan's
    assert refined.provenance.refined_from and refined.provenance.threads == 1
    assert refined.whole_forward_ms is None and refined.measurement is None


def test_recomputation_scales_with_the_op_it_runs_in():
    """Full recomputation: a later stage's I is its layers' I + the forward again (one factor for both); the first
    stage's I is only the recomputation, its W the layers' I + W."""
    base = _plan("zb-h1")
    full = dataclasses.replace(base, stages=tuple(dataclasses.replace(s, recompute="full") for s in base.stages))
    plan = retimed_plan(full, _profile_of(base))  # the plan's op times with the recomputation in them
    assert plan.stages[0].input_grad_ms > 0 and plan.stages[1].recompute_ms > 0

    def true(p, stage, kind):
        return getattr(p.stages[stage], FIELDS[kind]) * {"F": 1.2, "I": 2.0, "W": 0.5}[kind] * (1 + stage)

    run = _synthetic_run(plan, true)
    medians = measured_medians(plan, run)
    refined = refined_profile(plan, _profile_of(base), medians, run)
    again = retimed_plan(plan, refined)
    for stage in plan.stages:
        for kind in "FIW":
            assert getattr(again.stages[stage.index], FIELDS[kind]) == pytest.approx(true(plan, stage.index, kind))
    implied = _implied(plan, medians)
    assert plan_step_ms(again) == pytest.approx(plan_step_ms(implied))


def test_overlapped_pairs_are_left_out():
    plan = _plan("dualpipev")
    run = _synthetic_run(plan)
    pairs = [o for o in run.ops if o.op.halves is not None]
    assert pairs  # dualpipev overlaps F&B pairs in its steady state
    medians = measured_medians(plan, run)
    for (stage, kind), ms in medians.items():  # from the unpaired ops only: a pair's time is two stages'
        assert ms == pytest.approx(_true_ms(plan, stage, kind), rel=1e-12)


@pytest.mark.parametrize("case", ["1f1b", "zbv", "interleaved"])
def test_medians_are_scaled_to_the_median_step(case):
    """Time slices: in every step one op per rank (a different one each step) waits 6 ms for a core. No op's
    median shows the wait, every step pays it: the medians are scaled so that each rank's op list sums to its
    median step's op time (each stage on one rank here; replicas take the median of their ranks' factors)."""
    plan = _plan(**CASES[case])
    clean = _synthetic_run(plan, lambda p, s, k: _true_ms(p, s, k) + 1.0)  # each op at least 1 ms
    waited, index = [], {}
    for traced in clean.ops:
        at = (traced.rank, traced.step)
        index[at] = index.get(at, -1) + 1
        wait = 6.0 if traced.step > 0 and index[at] == traced.step % len(plan.rank_ops[traced.rank]) else 0.0
        waited.append(dataclasses.replace(traced, ms=traced.ms + wait))
    run = dataclasses.replace(clean, ops=tuple(waited))
    scaled = measured_medians(plan, run)
    samples: dict = {}
    for traced in run.ops:
        if traced.step > 0:
            samples.setdefault((traced.op.stage, traced.op.kind), []).append(traced.ms)
    for rank, names in enumerate(plan.rank_ops):
        keys = [(Op.parse(text).stage, Op.parse(text).kind) for text in names]
        steps = [sum(o.ms for o in run.ops if (o.rank, o.step) == (rank, step)) for step in run.steps[1:]]
        assert sum(scaled[key] for key in keys) == pytest.approx(statistics.median(steps), rel=1e-9)
        factors = {round(scaled[key] / statistics.median(samples[key]), 9) for key in keys}
        assert len(factors) == 1 and factors.pop() > 1.0  # one factor per rank: the medians' proportions kept


@pytest.mark.parametrize("case", ["replicated", "data-parallel"])
def test_a_replicated_stage_costs_its_slowest_replica(case):
    """Replicas run the same op and a synchronized step waits for the slowest: with one rank's ops 2x the others'
    (a CPU rank pinned to the core another process keeps busy), every stage it holds costs what its ops cost there,
    not the median over the replicas' samples; the other stages keep their own ranks' medians."""
    plan = _plan(**CASES["replicated"]) if case == "replicated" else _plan("1f1b", devices=4, depth=2)
    holders = {s.index: [r for r, info in enumerate(plan.ranks) if s.index in info.stages] for s in plan.stages}
    slow = next(holder[0] for holder in holders.values() if len(holder) > 1)  # a rank holding a replicated stage
    clean = _synthetic_run(plan)
    run = dataclasses.replace(
        clean, ops=tuple(dataclasses.replace(o, ms=o.ms * (2.0 if o.rank == slow else 1.0)) for o in clean.ops)
    )
    medians = measured_medians(plan, run)
    held = set(plan.ranks[slow].stages)
    assert case == "replicated" or len(held) < len(plan.stages)  # data-parallel: the other stage runs elsewhere
    for (stage, kind), ms in medians.items():
        assert ms == pytest.approx(_true_ms(plan, stage, kind) * (2.0 if stage in held else 1.0), rel=1e-12)


def test_a_trace_of_other_ops_is_refused():
    plan = _plan("1f1b")
    run = _synthetic_run(plan)
    moved = tuple(dataclasses.replace(o, rank=1 - o.rank) for o in run.ops)  # each rank ran the other's stage
    with pytest.raises(FormatError, match="puts stage"):
        measured_medians(plan, dataclasses.replace(run, ops=moved))
    other = _plan("gpipe")  # same stages and ranks, another op order
    with pytest.raises(FormatError, match="other ops than the plan's op list"):
        measured_medians(plan, _synthetic_run(other))


def _written(tmp_path, plan: Plan, run: MeasuredRun, record: dict):
    """The plan directory (with profile.json) and a trace file `run --trace` would write for `run`."""
    folder = tmp_path / "plan"
    write_plan_dir(plan, timeline_rows(plan, plan_timeline(plan)), folder, _profile_of(plan))
    per_rank = [
        [
            {
                "step": step,
                "end_ms": 0.0,
                "ops": [[str(o.op), 0.0, o.ms] for o in run.ops if (o.rank, o.step) == (r, step)],
            }
            for step in run.steps
        ]
        for r in range(plan.world_size)
    ]
    trace = tmp_path / "measured.json"
    trace.write_text(json.dumps(measured_trace(per_rank, run=record)))
    return folder, trace


def test_trace_round_trip_and_refusals(tmp_path):
    plan = _plan("zb-h1")
    run = _synthetic_run(plan)
    folder, trace = _written(tmp_path, plan, run, run_record(plan, tmp_path / "plan" / "plan.json", threads=1))
    read = read_measured(trace)
    assert read.record.plan == str((folder / "plan.json").resolve()) and read.steps == run.steps
    assert measured_medians(plan, read) == pytest.approx(measured_medians(plan, run))
    # another plan's trace: refused in one line, naming --plan
    other = _plan("1f1b")
    _, foreign = _written(tmp_path / "other", other, _synthetic_run(other), run_record(other, folder / "plan.json"))
    line = one_error_line(runner.invoke(app, ["refine", str(foreign), "-o", str(tmp_path / "out")]))
    assert "another plan" in line and "--plan" in line
    # no profile, or one that is not the plan's
    line = one_error_line(runner.invoke(app, ["refine", str(trace), "--profile", str(tmp_path / "none.json")]))
    assert "--profile" in line
    synthetic_profile(num_layers=8, cut_bytes=1000, forward_ms=2.0).save(tmp_path / "wrong.json")
    line = one_error_line(runner.invoke(app, ["refine", str(trace), "--profile", str(tmp_path / "wrong.json")]))
    assert "not the one the plan was made from" in line
    # not a measured trace at all, and a trace written before traces named their plan
    (tmp_path / "plain.json").write_text(json.dumps({"traceEvents": []}))
    assert "pipeplan_measured" in one_error_line(runner.invoke(app, ["refine", str(tmp_path / "plain.json")]))
    old = json.loads(trace.read_text())
    del old["pipeplan_measured"]["run"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "--trace" in one_error_line(runner.invoke(app, ["refine", str(tmp_path / "old.json")]))
    # the run's own plan directory as the output
    assert "plan directory" in one_error_line(runner.invoke(app, ["refine", str(trace), "-o", str(folder)]))
    # --with: another plan's trace pooled with this one's
    line = one_error_line(runner.invoke(app, ["refine", str(trace), "--with", str(foreign), "-o", str(tmp_path / "o")]))
    assert "ran another plan" in line and "--with" in line


def test_plan_and_profile_fingerprints_survive_their_files(tmp_path):
    plan = _plan("zbv")
    folder = write_plan_dir(plan, timeline_rows(plan, plan_timeline(plan)), tmp_path / "p", _profile_of(plan))

    assert Plan.load(folder / "plan.json").fingerprint == plan.fingerprint
    assert Profile.load(folder / "profile.json").fingerprint == plan.profile.fingerprint


def test_step_tails_teach_the_optimizer_update_rate():
    """A measured profile times no optimizer update; the run's step tails beyond the plan's gradient exchange do:
    the refined profile's rate, the fastest rank's (an unmarked tail holds the waits in the exchange too: the rank
    that waited least), gives that rank its tail again (and the other its bytes at that rate), and times a later
    plan's updates."""
    plan = _plan("1f1b")  # 2 stages on 2 ranks
    left = (3.0, 5.0)  # ms each rank spent after its exchange: its update, as the run measured it
    exchange = [sum(plan.stages[s].allreduce_ms for s in info.stages) for info in plan.ranks]
    run = dataclasses.replace(_synthetic_run(plan), tail_ms=tuple(e + x for e, x in zip(exchange, left)))
    refined = refined_profile(plan, _profile_of(plan), measured_medians(plan, run), run)
    rate = refined.provenance.update_bytes_per_s
    numerics = plan.training.numerics
    moved = update_bytes_per_param(numerics)
    params = [sum(plan.stages[s].param_count for s in info.stages) for info in plan.ranks]
    rates = [count * moved / (ms / 1e3) for count, ms in zip(params, left)]
    assert rate == pytest.approx(max(rates))
    retimed = with_learned_tail(retimed_plan(plan, refined), LearnedTail(update_bytes_per_s=rate))
    took = [sum(retimed.stages[s].optimizer_ms for s in info.stages) for info in plan.ranks]
    fastest = rates.index(max(rates))
    assert took[fastest] == pytest.approx(left[fastest])
    assert took == pytest.approx([count * moved / rate * 1e3 for count in params])
    assert "update_bytes_per_s" not in _profile_of(plan).to_dict()["provenance"]  # older files: the same bytes
    assert Profile.from_dict(refined.to_dict()).provenance.update_bytes_per_s == rate
    config = SearchConfig(global_batch_size=8, microbatch_sizes=(1,), numerics=numerics, post_validate="off")
    again = search_plans(refined, make_cluster(2, memory=2**34), config, ("1f1b",)).ranked[0]
    assert all(ms > 0 for ms in again.stage_optimizer_ms)
    no_tails = dataclasses.replace(run, tail_ms=tuple(exchange))  # nothing beyond the exchange: nothing learned
    unrefined = refined_profile(plan, _profile_of(plan), measured_medians(plan, run), no_tails)
    assert unrefined.provenance.update_bytes_per_s is None


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipe"])
def test_refine_times_updates_with_the_searchs_own_share(schedule):
    """One rule for the parameters a device updates (predict.gradient_sync.updated_params): under ZeRO-1 a
    stage's dense parameters over every holder (replicas, pipelines, cp ranks, dualpipe's mirrored copy), routed
    experts over the holders of the same expert; refine's learned rate times a plan's updates with it."""
    group = SyncGroup(data_parallel=2, context_parallel=1, expert_parallel=2, mirrored=True)
    assert updated_params(1000, 200, replicas=2, zero=1, group=group) == pytest.approx(800 / 8 + 200 / 4)
    assert updated_params(1000, 200, replicas=2, zero=0, group=group) == 1000.0
    plan = _plan(schedule)
    zero = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero=1))
    rate = 1e9
    retimed = with_learned_tail(zero, LearnedTail(update_bytes_per_s=rate))
    mirrored = schedule == "dualpipe"  # each stage also on device P-1-d
    moved = update_bytes_per_param(plan.training.numerics)
    for stage in retimed.stages:
        holders = stage.replicas * plan.training.data_parallel * (2 if mirrored else 1)
        assert stage.optimizer_ms == pytest.approx(stage.param_count / holders * moved / rate * 1e3)
