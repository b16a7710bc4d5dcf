"""The memory model under recomputation against the runtime: what `Executor.held_activation_bytes` holds after
every op of a step, and the peak while a fully recomputed stage's I or B re-creates its activations, equal what
`schedules.simulate` predicts from the measured profile (`partition.costs.recompute`), for every mode, under fused
(gpipe, 1f1b) and split (zb-h1, zbv) backwards. One rank runs a whole pipeline in this process. Two losses: one
that saves nothing (the mean of the logits), and the built-in gpt's cross-entropy, whose log-softmax and target
the profile counts in the last layer (what the last stage holds per microbatch in flight). Each microbatch gets its
own input and target storage (slices of one batch would share it)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pipeplan.costs import LayerArrays, stage_freed_bytes, stage_kept_bytes, stage_recompute_bytes
from pipeplan.graph.saved_tensors import storage_bytes, storage_key
from pipeplan.models import load_model
from pipeplan.plan.manual import manual_plan
from pipeplan.profiling.measure import profile_model
from pipeplan.runtime.step.executor import Executor
from pipeplan.runtime.step.messages import build_routing
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.trainer import microbatches_for
from pipeplan.schedules.simulate import MemoryCosts, activation_deltas, activation_rises

pytestmark = pytest.mark.timeout(400)

MEAN_LOSS = f"{Path(__file__).with_name('mean_loss_model.py')}:gpt_mean_loss"
CROSS_ENTROPY = "gpt"
OPTIONS = dict(layers=4, hidden=32, heads=2, seq=16, vocab=64, dropout=0.3)  # dropout: math-path attention


@functools.cache
def _arrays(model: str) -> LayerArrays:
    profile = profile_model(
        load_model(model, OPTIONS), batch_size=2, warmup=0, repeats=1, progress=False, precision="fp32"
    )
    return LayerArrays.from_profile(profile)


def _step(schedule: str, modes: tuple[str, ...], microbatches: int = 3, model: str = MEAN_LOSS):
    """One step on one rank: (executor, record, [(op, held while its recomputation's tensors are live)])."""
    plan = manual_plan(
        model,
        OPTIONS,
        schedule=schedule,
        pipeline_devices=1,
        num_microbatches=microbatches,
        microbatch_size=2,
        recompute=modes,
    )
    device = torch.device("cpu")
    model = build_pipeline_model(plan, 0, device)
    executor = Executor(
        plan, 0, model, build_routing(plan, model.stage_io, model.model_inputs, model.differentiable), device
    )
    executor.track_saved = True
    batch = next(model.spec.batches(plan.training.global_batch_size, plan.training.seed))
    wanted = {o.microbatch for o in executor.ops if o.kind == "F"}
    own = {
        mb: (tuple(x.clone() for x in inputs), target.clone())
        for mb, (inputs, target) in microbatches_for(plan, 0, batch, wanted, device).items()
    }
    rerun_peaks = []
    run_stage = executor._run_stage

    def spy(o, args, target, tensors, *, grad=True):
        out = run_stage(o, args, target, tensors, grad=grad)
        if o.kind in ("I", "B"):  # the forward again, before the backward: everything it saved is live now
            module = executor.model.modules[o.stage]
            held = dict(tensors.storage_bytes(exclude=[*executor.stage_params[o.stage], *module.buffers()]))
            held.update({storage_key(v): storage_bytes(v) for v in args if isinstance(v, torch.Tensor)})
            rerun_peaks.append((str(o), executor.held_activation_bytes() + sum(held.values())))
        return out

    executor._run_stage = spy
    record = executor.run_step(own, step=0)
    return executor, record, rerun_peaks


def _predicted(executor: Executor, arrays: LayerArrays, modes: tuple[str, ...]):
    """(most live bytes after any op, live bytes at the top of each op) from the memory model."""
    ranges = [(s.first_layer, s.last_layer) for s in executor.plan.stages]
    memory = MemoryCosts(
        activation_bytes=[float(arrays.span("activation", a, b)) for a, b in ranges],
        input_grad_freed_bytes=[float(stage_freed_bytes(arrays, m, a, b)) for (a, b), m in zip(ranges, modes)],
        kept_bytes=[float(stage_kept_bytes(arrays, m, a, b)) for (a, b), m in zip(ranges, modes)],
        recompute_bytes=[float(stage_recompute_bytes(arrays, m, a, b)) for (a, b), m in zip(ranges, modes)],
    )
    delta, rise = activation_deltas(memory, len(ranges)), activation_rises(memory, len(ranges))
    live = after = 0.0
    tops = {}
    for o in executor.ops:
        tops[str(o)] = live + rise[o.kind][o.stage]
        live += delta[o.kind][o.stage]
        after = max(after, live)
    return after, tops


@pytest.mark.parametrize(
    ("schedule", "modes"),
    [
        ("gpipe", ("none",)),
        ("gpipe", ("selective",)),
        ("gpipe", ("full",)),
        ("1f1b", ("full",)),
        ("zb-h1", ("none",)),
        ("zb-h1", ("full",)),
        ("zbv", ("none", "none")),
        ("zbv", ("full", "full")),
        ("zbv", ("selective", "full")),
        ("zbv", ("none", "selective")),
    ],
)
def test_held_bytes_are_what_the_memory_model_predicts(schedule, modes):
    _check_held_bytes(MEAN_LOSS, schedule, modes)


@pytest.mark.parametrize(
    ("schedule", "modes"),
    [
        ("gpipe", ("none",)),
        ("1f1b", ("full",)),
        ("zb-h1", ("selective",)),
        ("zbv", ("none", "none")),
        ("zbv", ("selective", "full")),
    ],
)
def test_held_bytes_with_a_loss_that_saves_are_what_the_memory_model_predicts(schedule, modes):
    """Cross-entropy keeps b·s·V fp32 log-softmax values and the target per microbatch until the last stage's I:
    the profile's last layer counts them, so the prediction is still exact (it fell short by that before)."""
    _check_held_bytes(CROSS_ENTROPY, schedule, modes)


def _check_held_bytes(model: str, schedule: str, modes: tuple[str, ...]) -> None:
    executor, record, rerun_peaks = _step(schedule, modes, model=model)
    after, tops = _predicted(executor, _arrays(model), modes)
    assert record.saved_peak_bytes == after
    full = [(op, held) for op, held in rerun_peaks if modes[int(op[0])] == "full"]
    assert len(full) == sum(m == "full" for m in modes) * 3
    for op, held in full:
        assert held == tops[op], op  # kept bytes of the others + the stage's whole activations again
