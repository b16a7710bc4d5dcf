"""The cut-in-half argument with pipeplan's own numbers: DualPipe on 2N ranks vs DualPipeV on N ranks (DeepSeek's
DualPipe README and the DualPipeV note), same model, same stages, same microbatches.

Both schedules cut the gpt `-a hidden=128 -a seq=64 -a layers=8` into the same 2N stages (even cuts): DualPipe holds
each stage twice (rank d: stages d and 2N-1-d, one per direction), DualPipeV once (rank d: stages d and 2N-1-d of
one V). For each: the bubble rate, per-rank activation memory (peak bytes held for the backward) and parameter
memory (fp32 weights), and the communication volume per step (activations and gradients between ranks, plus
DualPipe's all-reduce of each stage's gradients over its two copies) — predicted (the simulator with a measured CPU
profile of the model: `pipeplan.api.profile`, process CPU time, the stages' summed layer costs and bytes; transfers
untimed on one host) and measured on CPU (one gloo launch per schedule, STEPS steps, the first WARMUP dropped: the
bubble from the `--trace` of each step's ops, 1 - busy / (ranks x span); activations as the executor's peak of held
bytes; weights as each rank's tensors; the volume as every message and gradient bucket the run's routing holds).
The ranks share this host's cores (4 + 2 processes, one thread each): on fewer cores than ranks the measured bubble
counts waiting for a core. Writes results/dualpipe.json; docs/schedules.md quotes it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--half", type=int, default=2, help="N: DualPipeV's ranks; DualPipe runs on 2N (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (even, >= 4N; default 8)")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeplan.api import profile as profile_model  # noqa: E402
from pipeplan.artifact.manual import manual_plan  # noqa: E402
from pipeplan.artifact.timing import plan_schedule  # noqa: E402
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.runtime.launch.local import launch_many  # noqa: E402
from pipeplan.runtime.step.grads import parameter_holders  # noqa: E402
from pipeplan.runtime.step.messages import build_routing  # noqa: E402
from pipeplan.runtime.step.stages import build_pipeline_model  # noqa: E402
from pipeplan.runtime.train.config import RunConfig  # noqa: E402
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, peak_activation_per_device, simulate  # noqa: E402

GPT = {"hidden": 128, "seq": 64, "layers": 8}
MICROBATCH_SIZE, STEPS, WARMUP = 1, 6, 2
GRAD_BYTES = 4  # fp32


def _stage_sums(profile, plan) -> dict[str, tuple[float, ...]]:
    """Per plan stage, its layers' profiled costs and bytes summed."""
    keys = ("forward_ms", "input_grad_ms", "weight_grad_ms", "activation_bytes")
    keys += ("activation_freed_by_input_grad_bytes", "param_count")
    layers = profile.layers
    return {
        k: tuple(sum(getattr(la, k) for la in layers[s.first_layer : s.last_layer + 1]) for s in plan.stages)
        for k in keys
    }


def predicted(plan, profile) -> dict:
    schedule = plan_schedule(plan)
    sums = _stage_sums(profile, plan)
    costs = StageCosts(
        forward_ms=sums["forward_ms"], input_grad_ms=sums["input_grad_ms"], weight_grad_ms=sums["weight_grad_ms"]
    )
    memory = MemoryCosts(
        activation_bytes=sums["activation_bytes"], input_grad_freed_bytes=sums["activation_freed_by_input_grad_bytes"]
    )
    timeline = simulate(schedule, costs, memory)
    cut = [profile.cut_bytes[s.last_layer] for s in plan.stages[:-1]]
    sent = [0.0] * schedule.num_devices
    for device, ops in enumerate(schedule.device_ops):
        for o in (h for op in ops for h in op.parts):
            after = o.stage + (1 if o.kind == "F" else -1)  # activations forward, input gradients back
            if o.kind != "W" and 0 <= after < schedule.num_stages and schedule.op_device(after, o.microbatch) != device:
                sent[device] += cut[min(o.stage, after)]
    params = [sum(sums["param_count"][s] for s in info.stages) for info in plan.ranks]
    for info in plan.ranks:  # a stage's copies all-reduce its gradients (2 ranks: each sends its whole bucket)
        shared = [s for s in info.stages if sum(s in other.stages for other in plan.ranks) > 1]
        sent[info.rank] += sum(sums["param_count"][s] for s in shared) * GRAD_BYTES
    return {
        "bubble_rate": timeline.bubble_rate,
        "activation_bytes": list(peak_activation_per_device(schedule, memory)),
        "param_bytes": [4 * p for p in params],
        "sent_bytes": sent,
    }


def counted_volume(plan) -> list[float]:
    """Bytes each rank sends per step by the run's own routing (every message of a step, the same tables on every
    rank) and gradient groups (a ring all-reduce over each parameter's holders)."""
    sent = [0.0] * plan.world_size
    model = build_pipeline_model(plan, 0, torch.device("cpu"))
    routing = build_routing(plan, model.stage_io, model.model_inputs, model.differentiable)
    for message in routing.tags:
        meta = model.value_meta[message.value]
        sent[message.src] += meta.dtype.itemsize * torch.Size(meta.shape).numel()
    numel = {name: p.numel() for name, p in model.traced.module.named_parameters(remove_duplicate=False)}
    for name, ranks in parameter_holders(plan, model.stage_params).items():
        for rank in ranks if len(ranks) > 1 else ():
            sent[rank] += 2 * (len(ranks) - 1) / len(ranks) * numel[name] * GRAD_BYTES
    return sent


def measured(plan, result_index: int, results, trace_path: str) -> dict:
    trace = json.loads(Path(trace_path).read_text())["pipeplan_measured"]["ranks"]
    bubbles = []
    for step in range(WARMUP, STEPS):
        ops = [op for rank in trace for s in rank["steps"] if s["step"] == step for op in s["ops"]]
        if not ops:
            continue
        span = max(op[2] for op in ops) - min(op[1] for op in ops)
        bubbles.append(1.0 - sum(op[2] - op[1] for op in ops) / (plan.world_size * span))
    params = []
    for rank in range(plan.world_size):
        model = build_pipeline_model(plan, rank, torch.device("cpu"))
        params.append(sum(p.numel() * p.element_size() for p in model.params.values()))
    per_rank = [r[result_index] for r in results]
    return {
        "bubble_rate": statistics.median(bubbles),
        "activation_bytes": [r.saved_peak_bytes for r in per_rank],
        "param_bytes": params,
        "sent_bytes": counted_volume(plan),
        "median_step_ms": statistics.median(max(t) for t in zip(*(r.step_ms[WARMUP:] for r in per_rank))),
    }


def main(half: int, microbatches: int) -> None:
    plans = {
        "dualpipe": manual_plan(
            "gpt",
            GPT,
            schedule="dualpipe",
            pipeline_devices=2 * half,
            num_microbatches=microbatches,
            microbatch_size=MICROBATCH_SIZE,
        ),
        "dualpipev": manual_plan(
            "gpt",
            GPT,
            schedule="dualpipev",
            pipeline_devices=half,
            num_microbatches=microbatches,
            microbatch_size=MICROBATCH_SIZE,
        ),
    }
    assert [s.layer_names for s in plans["dualpipe"].stages] == [s.layer_names for s in plans["dualpipev"].stages]
    profile = profile_model(
        "gpt", assignments=[f"{k}={v}" for k, v in GPT.items()], batch_size=MICROBATCH_SIZE, threads=1, timer="cpu"
    )
    assert len(profile.layers) == plans["dualpipe"].stages[-1].last_layer + 1
    out: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": GPT,
        "microbatches": microbatches,
        "microbatch_size": MICROBATCH_SIZE,
        "steps": STEPS,
        "warmup": WARMUP,
    }
    with tempfile.TemporaryDirectory() as folder:
        runs = []
        for name, plan in plans.items():
            path = os.path.join(folder, f"{name}.json")
            plan.save(path)
            config = RunConfig(
                steps=STEPS,
                quiet=True,
                heartbeat_timeout_s=300.0,
                check_every=1,
                trace_path=os.path.join(folder, f"{name}.trace.json"),
                overlap_pairs="off",  # F&B pairs in order: the simulator's F + B (a CPU has no spare compute)
                track_saved=True,
            )
            runs.append((path, config))
        for (name, plan), run in zip(plans.items(), runs):  # one launch each: a launch has one world size
            results = launch_many([run], threads=1)
            out[name] = {
                "ranks": plan.world_size,
                "stages": len(plan.stages),
                "predicted": predicted(plan, profile),
                "measured": measured(plan, 0, results, run[1].trace_path),
            }
    write_json(ROOT / "benchmarks" / "results" / "dualpipe.json", out)
    _print(out)


def _print(out: dict) -> None:
    print(f"gpt {out['model']}, {out['microbatches']} microbatches of {out['microbatch_size']} ({out['machine']})")
    for name in ("dualpipe", "dualpipev"):
        row = out[name]
        for kind in ("predicted", "measured"):
            r = row[kind]
            print(
                f"  {name:>9} {row['ranks']} ranks {kind:>9}: bubble {r['bubble_rate']:.1%}, activations max "
                f"{max(r['activation_bytes']) / 2**20:.2f} MiB, weights max {max(r['param_bytes']) / 2**20:.2f} MiB, "
                f"sent max {max(r['sent_bytes']) / 2**20:.2f} MiB/step"
            )


if __name__ == "__main__":
    main(ARGS.half, ARGS.microbatches)
