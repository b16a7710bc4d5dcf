"""Asynchronous schedules on gloo (runtime/train/asynchronous.py): every microbatch's gradient equals the single-process
reference computed on the weight versions its forward used; losses and final parameters equal the reference's
version-by-version AdamW (pipedream: an update per microbatch per stage; pipedream-2bw: the one-step-stale rule);
data-parallel pipelines and tied weights sum their gradients at each update; a run resumed from a checkpoint equals
the uninterrupted one.

One 2-rank launch and one 4-rank launch run every case (start-up dominates)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers.async_reference import async_reference
from helpers.runtime import TINY_GPT, TINY_GPT_TIED, TINY_MLP, build_reference_model, make_plan

from pipeplan.plan.manual import manual_plan
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.step.messages import build_routing, parse_rank_ops
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.asynchronous import settled_by, stream_rank_ops
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import checkpoint

pytestmark = pytest.mark.timeout(300)

LR = 3e-3
BASE = RunConfig(steps=3, quiet=True, lr=LR, heartbeat_timeout_s=30.0, check_every=1)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
# AdamW divides by the root of the second moment, so a gradient that is zero but for rounding (attention's key bias:
# softmax ignores a constant shift) moves its parameter by rounding-sized steps that differ between the pipelined and
# the whole-model sums; 1e-5 is 1/300 of one step at LR.
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)


class Launch:
    def __init__(self, folder: Path) -> None:
        self.folder, self.runs, self.cases, self.paths = folder, [], {}, {}

    def add(self, label: str, model: str, options: dict, config: RunConfig = BASE, same_as=None, **layout) -> None:
        """A run of a fresh plan (or of run `same_as`'s plan), writing a checkpoint after its last step."""
        if same_as is None:
            path, plan = make_plan(self.folder, label.replace(" ", "-"), model, options, **layout)
        else:
            path, plan = self.paths[same_as], self.cases[same_as][1]
        config = dataclasses.replace(config, checkpoint_dir=config.checkpoint_dir or str(self.folder / label))
        self.cases[label], self.paths[label] = (len(self.runs), plan, config), path
        self.runs.append((path, config))

    def launch(self, capture: bool = True) -> Launch:
        self.results = launch_many(self.runs, capture_grads=capture, threads=1)
        return self

    def result(self, label: str) -> list:
        return [per_rank[self.cases[label][0]] for per_rank in self.results]


def _final_params(root: str) -> dict[str, torch.Tensor]:
    step = checkpoint.latest_step(root)
    found = {}
    for path in sorted(checkpoint.step_dir(root, step).glob("stage_*.pt")):
        found |= torch.load(path, weights_only=True)["params"]
    return found


def check_against_reference(launch: Launch, label: str, segments: list[tuple[int, int]] | None = None) -> None:
    index, plan, config = launch.cases[label]
    per_rank = launch.result(label)
    first = per_rank[0].first_step
    reference = async_reference(plan, segments or [(0, config.steps)], lr=LR, weight_decay=plan.training.weight_decay)
    for result in per_rank:
        torch.testing.assert_close(result.losses, reference.losses[first:], rtol=1e-5, atol=1e-6)
    devices = plan.world_size // plan.training.data_parallel
    summed: dict[tuple[int, int, str], torch.Tensor] = {}  # a tied weight's uses are on several ranks of a pipeline
    for rank, result in enumerate(per_rank):
        for microbatch, grads in (result.microbatch_grads or {}).items():
            for name, grad in grads.items():
                key = (rank // devices, microbatch, name)
                summed[key] = summed[key] + grad if key in summed else grad
    for (pipeline, microbatch, name), grad in summed.items():
        where = f"{label}: microbatch {microbatch} of pipeline {pipeline}, {name}"
        expected = reference.grads[(pipeline, microbatch)][name]
        torch.testing.assert_close(grad, expected, **GRAD_TOL, msg=lambda m, w=where: f"{w}: {m}")
    wanted = {(pipeline, mb) for pipeline, mb in reference.grads if mb >= first * plan.training.num_microbatches}
    assert {(pipeline, mb) for pipeline, mb, _ in summed} == wanted
    saved = _final_params(config.checkpoint_dir)
    assert saved.keys() == reference.params.keys()
    for name, value in saved.items():
        torch.testing.assert_close(
            value, reference.params[name], **PARAM_TOL, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    launch = Launch(tmp_path_factory.mktemp("async-2"))
    two = dict(pipeline_devices=2)
    launch.add("2bw", "gpt", TINY_GPT, dataclasses.replace(BASE, steps=4), schedule="pipedream-2bw", **two)
    launch.add("pipedream", "gpt", TINY_GPT, schedule="pipedream", num_microbatches=3, **two)
    launch.add("2bw tied", "gpt", TINY_GPT_TIED, schedule="pipedream-2bw", num_microbatches=2, **two)
    for name in ("pipedream", "pipedream-2bw"):  # checkpoints every 2 steps: the resumed second half
        whole = str(launch.folder / f"{name}-whole")
        every = dataclasses.replace(BASE, steps=4, checkpoint_every=2, checkpoint_dir=whole)
        launch.add(f"{name} whole", "mlp", TINY_MLP, every, schedule=name, num_microbatches=3, **two)
        half = dataclasses.replace(every, steps=2, checkpoint_dir=str(launch.folder / f"{name}-resumable"))
        launch.add(f"{name} first half", "mlp", TINY_MLP, half, same_as=f"{name} whole")
        resumed = dataclasses.replace(every, resume=True, checkpoint_dir=half.checkpoint_dir)
        launch.add(f"{name} resumed", "mlp", TINY_MLP, resumed, same_as=f"{name} whole")
    return launch.launch()


@pytest.mark.slow
@pytest.mark.parametrize("label", ["2bw", "pipedream", "2bw tied"])
def test_two_ranks_match_the_version_by_version_reference(two_ranks, label):
    check_against_reference(two_ranks, label)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_resumed_run_equals_the_uninterrupted_one(two_ranks, name):
    whole = two_ranks.result(f"{name} whole")[0]
    resumed = two_ranks.result(f"{name} resumed")[0]
    assert resumed.first_step == 2 and len(resumed.losses) == 2
    torch.testing.assert_close(resumed.losses, whole.losses[2:], rtol=1e-6, atol=1e-7)
    for key, value in _final_params(two_ranks.cases[f"{name} whole"][2].checkpoint_dir).items():
        again = _final_params(two_ranks.cases[f"{name} resumed"][2].checkpoint_dir)[key]
        torch.testing.assert_close(again, value, rtol=1e-6, atol=1e-7)
    check_against_reference(two_ranks, f"{name} whole", segments=[(0, 2), (2, 4)])  # each segment a fresh stream


@pytest.mark.slow
def test_2bw_parameters_follow_the_one_step_stale_rule(two_ranks):
    """Spelled out for 2BW: W(t+1) = AdamW(W(t), grad f_t(W(t-1))), W(-1) = W(0), summed over the step's m
    microbatches — the reference's generic version bookkeeping gives exactly this; here the rule itself."""
    _, plan, config = two_ranks.cases["2bw"]
    reference = async_reference(plan, [(0, config.steps)], lr=LR, weight_decay=plan.training.weight_decay)
    m = plan.training.num_microbatches
    spec, module = build_reference_model(plan)
    params = dict(module.named_parameters())
    optimizer = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=plan.training.weight_decay)
    previous = {n: t.detach().clone() for n, t in params.items()}  # W(t-1)
    batches = spec.batches(plan.training.global_batch_size, plan.training.seed)
    b = plan.training.microbatch_size
    for _ in range(config.steps):
        inputs, target = next(batches)
        stale = {n: t.clone().requires_grad_() for n, t in previous.items()}
        loss = sum(
            spec.loss_fn(
                torch.func.functional_call(module, stale, tuple(x[i * b : (i + 1) * b] for x in inputs)),
                target[i * b : (i + 1) * b],
            )
            / m
            for i in range(m)
        )
        grads = torch.autograd.grad(loss, list(stale.values()))
        previous = {n: t.detach().clone() for n, t in params.items()}  # W(t) becomes the next step's W(t-1)
        for param, grad in zip(params.values(), grads):
            param.grad = grad
        optimizer.step()
    final = _final_params(config.checkpoint_dir)
    for name, param in params.items():
        torch.testing.assert_close(final[name], param.detach(), **PARAM_TOL)
        torch.testing.assert_close(reference.params[name], param.detach(), **PARAM_TOL)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    launch = Launch(tmp_path_factory.mktemp("async-4"))
    dp = dict(pipeline_devices=2, data_parallel=2, num_microbatches=2)
    launch.add("2bw dp", "gpt", TINY_GPT, schedule="pipedream-2bw", **dp)
    launch.add("pipedream dp", "gpt", TINY_GPT, schedule="pipedream", **dp)
    launch.add("pipedream 4 stages", "mlp", TINY_MLP, schedule="pipedream", pipeline_devices=4, num_microbatches=2)
    launch.add("2bw 4 stages", "mlp", TINY_MLP, schedule="pipedream-2bw", pipeline_devices=4, num_microbatches=3)
    return launch.launch()


@pytest.mark.slow
@pytest.mark.parametrize("label", ["2bw dp", "pipedream dp", "pipedream 4 stages", "2bw 4 stages"])
def test_four_ranks_match_the_version_by_version_reference(four_ranks, label):
    check_against_reference(four_ranks, label)


def test_sends_are_settled_by_a_later_message_from_their_receiver():
    """A stream's sends are waited for (and their tensors dropped) when the receiver's next message arrives: each
    one the receiver consumed before sending that message, by its own op order; only the drain's last few (at
    most the p microbatches in flight) are left for the final wait."""
    plan = manual_plan("mlp", TINY_MLP, schedule="pipedream", pipeline_devices=3, num_microbatches=4)
    plan = dataclasses.replace(plan, rank_ops=stream_rank_ops(plan, 3))
    model = build_pipeline_model(plan, 0, torch.device("cpu"))
    routing = build_routing(plan, model.stage_io, model.model_inputs, model.differentiable)
    rank_ops = parse_rank_ops(plan)
    position = [{(o.kind, o.stage, o.microbatch): i for i, o in enumerate(ops)} for ops in rank_ops]
    sender_op = {m: (src, o) for (src, o), messages in routing.sends.items() for m in messages}
    for rank in range(plan.world_size):
        sent = {m for m in routing.tags if m.src == rank}
        settled = settled_by(routing, rank_ops, rank)
        for trigger, messages in settled.items():
            peer, op = sender_op[trigger]
            assert trigger.dst == rank and all(m.dst == peer and m in sent for m in messages)
            for m in messages:  # the peer's op consuming m runs before the op after which it sends the trigger
                consumer = ("F", m.consumer) if m.kind == "act" else ("B", m.producer)
                assert position[peer][(*consumer, m.microbatch)] <= position[peer][(op.kind, op.stage, op.microbatch)]
        left = sent - {m for messages in settled.values() for m in messages}
        assert len(left) <= len(plan.stages), sorted(map(str, left))  # the drain's: at most p in flight
