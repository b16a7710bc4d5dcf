"""plan.json: the built plan is consistent, round-trips through save/load, and loading rejects each kind of damage
with one clear line."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from helpers.search import make_cluster, synthetic_profile

from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.scripts import describe
from pipeplan.artifact.timing import plan_schedule, plan_timeline, timeline_rows
from pipeplan.costs import numerics
from pipeplan.errors import FormatError, RunError
from pipeplan.graph.trace import Layer, LayerGraph, TensorInfo
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.search import search_plans


def _graph(profile) -> LayerGraph:
    layers = tuple(
        Layer(name=la.name, module_path=la.name, nodes=(f"{la.name}_a", f"{la.name}_b")) for la in profile.layers
    )
    cut = (TensorInfo(producer="x", shape=(1,), dtype="float32", bytes=4),)
    return LayerGraph(
        layers=layers, cuts=(cut,) * (len(layers) - 1), input_names=("x",), output_name="y", fingerprint="f"
    )


def _plan(schedules=("1f1b",), devices=4, batch=16, memory=2**30, graph=True, zero="auto", **profile_kwargs) -> Plan:
    profile = synthetic_profile(**profile_kwargs)
    config = SearchConfig(global_batch_size=batch, zero=zero, numerics=numerics("adamw", "bf16-mixed"))
    result = search_plans(profile, make_cluster(devices, memory=memory), config, schedules)
    model = ModelRef(ref="synthetic", fingerprint="f", tokens_per_sample=16)
    return build_plan(result, model=model, layer_graph=_graph(profile) if graph else None)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan(("zb-h1",), memory=100 * 2**20)  # the model does not fit on one device: 2 stages x 2 pipelines


def test_plan_describes_the_chosen_candidate(plan):
    assert plan.schedule == "zb-h1" and plan.runnable
    assert len(plan.stages) == 2 and plan.training.data_parallel == 2
    assert plan.world_size == 4 and len(plan.predicted.peak_memory_bytes) == 4
    assert plan.stages[0].node_names == ("layer0_a", "layer0_b") + tuple(
        n for s in plan.stages[0].layer_names[1:] for n in (f"{s}_a", f"{s}_b")
    )
    assert plan.predicted.tokens_per_s == pytest.approx(plan.predicted.samples_per_s * 16)
    assert plan.predicted.samples_per_s == pytest.approx(16 / plan.predicted.step_ms * 1000)
    assert plan.rationale.startswith("Chose zb-h1")
    assert plan.pipeplan_version and plan.torch_version


def test_show_resimulates_the_same_step(plan):
    timeline = plan_timeline(plan)
    allreduce = max(s.allreduce_ms for s in plan.stages)
    assert timeline.makespan + allreduce == pytest.approx(plan.predicted.step_ms)
    rows = timeline_rows(plan, timeline)
    assert {op for _, op, _, _ in rows} == {
        op for rank in plan.ranks if rank.pipeline == 0 for op in plan.rank_ops[rank.rank]
    }


def test_replicated_plan_round_trips_and_resimulates():
    plan = _plan(  # without ZeRO-1 (plain data parallelism would fit with it)
        ("1f1b",),
        devices=3,
        batch=12,
        memory=60 * 2**20,
        num_layers=4,
        heavy_last=6.0,
        activation_bytes=1_000_000,
        zero=0,
    )
    assert any(s.replicas > 1 for s in plan.stages)
    schedule = plan_schedule(plan)
    assert schedule.num_stages == len(plan.stages)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert json.loads(path.read_text())["schema_version"] == 1


def test_plan_without_model_is_not_runnable():
    plan = _plan(graph=False)
    assert not plan.runnable
    with pytest.raises(RunError, match="re-plan with MODEL"):
        plan.require_runnable()


@pytest.mark.parametrize(
    ("training", "needle"),
    [
        (dict(context_parallel=2), "context parallelism (cp=2)"),
        (dict(overlap="grad-reduce"), "--overlap grad-reduce"),
        (dict(overlap="p2p,param-gather"), "--overlap p2p,param-gather"),
    ],
)
def test_engine_only_plans_are_refused_by_run(plan, training, needle):
    """What the runtime does not do (ring attention, collectives hidden behind the backward) is never run as if."""
    cp = training.get("context_parallel", 1)  # each rank a group of cp devices: a cluster with cp times as many
    cluster = replace(
        plan.cluster, num_devices=plan.cluster.num_devices * cp, devices_per_node=plan.cluster.devices_per_node * cp
    )
    engine = replace(plan, training=replace(plan.training, **training), cluster=cluster)
    assert not engine.runnable and needle in engine.not_runnable_reason()
    assert f" on {len(plan.ranks) * cp} device(s)" in describe(engine)  # the summary line counts cp's devices
    with pytest.raises(RunError, match=re.escape(needle)):
        engine.require_runnable()
    assert replace(plan, training=replace(plan.training, overlap="p2p")).runnable  # the runtime's sends are async


def _damaged(plan: Plan, edit) -> dict:
    data = json.loads(json.dumps(plan.to_dict()))
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["rank_ops"][0].append("9F0"), "does not hold"),
        (lambda d: d["rank_ops"][0].append("0X0"), "bad op"),
        (lambda d: d["rank_ops"][0].remove(d["rank_ops"][0][-1]), "each needs F and either B or I and W"),
        (lambda d: d["rank_ops"][0].append(d["rank_ops"][0][0]), "twice"),
        (lambda d: d["stages"][1].update(first_layer=0), "must start at layer"),
        (lambda d: d["stages"][0].update(replicas=2), "declares 2 replica"),
        (lambda d: d["ranks"][1].update(node=5), "node"),
        (lambda d: d["ranks"][0].update(pipeline=9), "data_parallel"),
        (lambda d: d["training"].update(global_batch_size=7), "global_batch_size"),
        (lambda d: d.pop("rank_ops"), "missing field"),
        (lambda d: d["stages"][0].update(colour="red"), "colour"),
    ],
)
def test_load_rejects_damage_with_one_line(plan, tmp_path, edit, match):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_damaged(plan, edit)))
    with pytest.raises(FormatError, match=match) as info:
        Plan.load(path)
    assert "\n" not in str(info.value)


def test_load_rejects_other_schema_versions(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan.to_dict(), "schema_version": 99}))
    with pytest.raises(FormatError, match="schema_version 99"):
        Plan.load(path)
