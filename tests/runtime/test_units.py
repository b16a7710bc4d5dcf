"""Single-process runtime pieces: materialization, routing read off the op lists, plan/model checks, config,
checkpoints."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.runtime import TINY_GPT_TIED, TINY_RESNET, build_reference_model, make_plan

from pipeplan.errors import ConfigError, FormatError, RunError
from pipeplan.models import load_model
from pipeplan.runtime.launch.local import launch_local
from pipeplan.runtime.step.grads import parameter_holders
from pipeplan.runtime.step.messages import build_routing
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.config import FaultSpec, RunConfig
from pipeplan.runtime.weights import checkpoint
from pipeplan.runtime.weights.materialize import materialize


def test_rank_materializes_only_its_stages_with_reference_values(tmp_path):
    _, plan = make_plan(tmp_path, "p", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    _, reference = build_reference_model(plan)
    expected = dict(reference.named_parameters())
    for rank in (0, 1):
        model = build_pipeline_model(plan, rank, torch.device("cpu"))
        for name, param in model.params.items():
            torch.testing.assert_close(param.detach(), expected[name].detach(), rtol=0, atol=0)
        untouched = [n for n, p in model.traced.module.named_parameters() if p.is_meta]
        assert untouched and not set(untouched) & set(model.params)
    # the tied embedding lives on both ranks, one Parameter object on each
    first = build_pipeline_model(plan, 0, torch.device("cpu"))
    assert first.traced.module.head.proj.weight is first.traced.module.embed.tok.weight


def test_meta_path_materialize_is_deterministic_and_seed_dependent():
    spec = load_model("mlp", {"layers": 2, "hidden": 8})
    values = []
    for seed in (0, 0, 1):
        with torch.device("meta"):
            module = spec.build()
        materialize(module, needed=None, seed=seed, init_module=lambda m: None)
        values.append(module.layers[0].linear.weight.detach().clone())
    assert torch.equal(values[0], values[1]) and not torch.equal(values[0], values[2])


def test_resnet_long_skip_goes_straight_to_its_consumer(tmp_path):
    _, plan = make_plan(tmp_path, "r", "resnet", TINY_RESNET, schedule="gpipe", pipeline_devices=3)
    model = build_pipeline_model(plan, 0, torch.device("cpu"))
    routing = build_routing(plan, model.stage_io, model.model_inputs, model.differentiable)
    skips = [(key, stages) for key, stages in routing.consumers.items() if key[0] == 0 and 2 in stages]
    assert skips, routing.consumers  # the stem output is consumed by stage 2 directly
    acts = [m for m in routing.tags if m.kind == "act" and m.producer == 0 and m.consumer == 2]
    grads = [m for m in routing.tags if m.kind == "grad" and m.producer == 0 and m.consumer == 2]
    assert {(m.src, m.dst) for m in acts} == {(0, 2)} and {(m.src, m.dst) for m in grads} == {(2, 0)}
    for src, dst in {(m.src, m.dst) for m in routing.tags}:
        tags = sorted(t for m, t in routing.tags.items() if (m.src, m.dst) == (src, dst))
        assert tags == list(range(len(tags)))  # one sequence per ordered pair, in send order


def test_chunks_on_one_rank_hand_over_locally(tmp_path):
    _, plan = make_plan(tmp_path, "v", "gpt", TINY_GPT_TIED, schedule="zbv", pipeline_devices=2)
    model = build_pipeline_model(plan, 0, torch.device("cpu"))
    routing = build_routing(plan, model.stage_io, model.model_inputs, model.differentiable)
    # zbv: stages 1 and 2 share device 1, so nothing crosses between them over the wire
    assert not [m for m in routing.tags if {m.producer, m.consumer} == {1, 2}]
    holders = parameter_holders(plan, model.stage_params)
    assert holders["embed.tok.weight"] == (0,)  # the tie is within rank 0 (stages 0 and 3)
    assert holders["blocks.0.ln1.weight"] == (0,)


def test_tied_weight_held_by_first_and_last_rank(tmp_path):
    _, plan = make_plan(tmp_path, "t", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2, replicas=(1, 2))
    model = build_pipeline_model(plan, 0, torch.device("cpu"))
    holders = parameter_holders(plan, model.stage_params)
    assert holders["embed.tok.weight"] == (0, 1, 2)
    assert holders["head.norm.weight"] == (1, 2)


def test_fingerprint_mismatch_is_one_run_error(tmp_path):
    _, plan = make_plan(tmp_path, "f", "gpt", TINY_GPT_TIED, schedule="gpipe", pipeline_devices=2)
    other = dataclasses.replace(plan, model=dataclasses.replace(plan.model, fingerprint="0123456789abcdef"))
    with pytest.raises(RunError, match="fingerprint") as info:
        build_pipeline_model(other, 0, torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_plan_without_fx_nodes_is_refused_before_launch(tmp_path):
    _, plan = make_plan(tmp_path, "n", "gpt", TINY_GPT_TIED, schedule="gpipe", pipeline_devices=2)
    stages = tuple(dataclasses.replace(stage, node_names=()) for stage in plan.stages)
    path = tmp_path / "profile-only.json"
    dataclasses.replace(plan, stages=stages).save(path)
    with pytest.raises(RunError, match="no FX nodes"):
        launch_local(path, RunConfig(steps=1))


def test_op_list_that_moves_a_backward_is_refused(tmp_path):
    _, plan = make_plan(tmp_path, "o", "gpt", TINY_GPT_TIED, schedule="gpipe", pipeline_devices=2, replicas=(2, 1))
    model = build_pipeline_model(plan, 0, torch.device("cpu"))
    ops = [list(row) for row in plan.rank_ops]
    b0 = next(o for o in ops[0] if o.endswith("B0"))  # replica 0's backward of microbatch 0 moves to replica 1
    ops[0].remove(b0)
    ops[1].append(b0)
    with pytest.raises(FormatError, match="do not match schedule gpipe"):  # refused when a plan file loads
        dataclasses.replace(plan, rank_ops=tuple(tuple(r) for r in ops))
    broken = copy.copy(plan)  # and by the routing, should one reach a rank
    object.__setattr__(broken, "rank_ops", tuple(tuple(r) for r in ops))
    with pytest.raises(RunError, match="forward ran on another rank"):
        build_routing(broken, model.stage_io, model.model_inputs, model.differentiable)


def test_run_config_and_fault_spec_validation(monkeypatch, console_warnings):
    with pytest.raises(ConfigError, match="--resume needs --checkpoint-dir"):
        RunConfig(resume=True)
    with pytest.raises(ConfigError, match="--steps"):
        RunConfig(steps=0)
    assert not console_warnings()
    RunConfig(checkpoint_every=2)
    assert any("--checkpoint-every is ignored" in line for line in console_warnings())
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=1,step=2,mode=hang")
    assert FaultSpec.from_env() == FaultSpec(rank=1, step=2, mode="hang")
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=1,when=2")
    with pytest.raises(ConfigError, match="rank=1,step=2"):
        FaultSpec.from_env()


def test_checkpoint_round_trip_and_missing_marker(tmp_path):
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.step()
    params, running = {"w": param}, torch.randn(2)
    common = dict(step=5, stage=0, fingerprint="f", partition="p1")
    checkpoint.save_stage(
        tmp_path,
        names=("w",),
        params=params,
        buffers={"bn.mean": running},
        optimizer_states={"w": optimizer.state[param]},
        num_stages=1,
        **common,
    )
    with pytest.raises(RunError, match="no complete checkpoint"):
        checkpoint.latest_step(tmp_path)  # the marker comes last
    checkpoint.mark_latest(tmp_path, 5)
    assert checkpoint.latest_step(tmp_path) == 5
    checkpoint.check_complete(tmp_path, 5, 1)
    with pytest.raises(RunError, match="holds 1 stage file"):
        checkpoint.check_complete(tmp_path, 5, 2)
    fresh, fresh_buffer = torch.nn.Parameter(torch.zeros(3)), torch.zeros(2)
    restore = dict(params={"w": fresh}, buffers={"bn.mean": fresh_buffer})
    expected = checkpoint.StageExpectation(
        step=5,
        num_stages=1,
        fingerprint="f",
        partition="p1",
        params={"w": ((3,), torch.float32)},
        buffers={"bn.mean": (2,)},
        optimizer_keys=frozenset({"step", "exp_avg", "exp_avg_sq"}),
    )
    saved = checkpoint.load_stage(tmp_path, stage=0, expected=expected, **restore)
    assert torch.equal(fresh.detach(), param.detach()) and torch.equal(fresh_buffer, running)
    torch.testing.assert_close(saved["w"]["exp_avg"], optimizer.state[param]["exp_avg"])
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(RunError, match="another model graph"):
        checkpoint.load_stage(tmp_path, stage=0, expected=dataclasses.replace(expected, fingerprint="g"), **restore)
    with pytest.raises(RunError, match="another partition"):
        checkpoint.load_stage(tmp_path, stage=0, expected=dataclasses.replace(expected, partition="p2"), **restore)


def test_failure_summary_names_the_rank_that_caused_it(tmp_path):
    from types import SimpleNamespace

    from pipeplan.runtime.launch.local import _failure_line

    failure = SimpleNamespace(failures={0: SimpleNamespace(exitcode=1, timestamp=1)})
    (tmp_path / "rank_0.txt").write_text("RuntimeError: Read error [127.0.0.1]:5: Connection reset by peer\n")
    assert _failure_line(failure, tmp_path, 2).startswith("rank 1 died without an error message")
    (tmp_path / "rank_2.txt").write_text("plan stage 3 names FX nodes the model does not have; re-plan\n")
    assert (
        _failure_line(failure, tmp_path, 3)
        == "rank 2 failed: plan stage 3 names FX nodes the model does not have; re-plan"
    )


@pytest.mark.parametrize(("local_world", "expected"), [(None, 8), ("2", 4), ("3", 2), ("16", 1)])
def test_default_cpu_threads_share_the_cores_among_local_ranks(monkeypatch, local_world, expected):
    from pipeplan.runtime.launch import worker

    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    assert worker.default_cpu_threads() == expected
