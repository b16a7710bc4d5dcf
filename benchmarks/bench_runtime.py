"""`pipeplan run` speed. Prints a table of medians and ratios and writes results/runtime.json.

(a) 8 x (Linear(1024) + ReLU) (`mlp -a layers=8 -a hidden=1024`), batch 64 in 8 microbatches, 2 ranks with one
    thread each (gloo): median step time of pipeplan's executor vs torch.distributed.pipelining's Schedule1F1B and
    ScheduleZBVZeroBubble on the same split, in one process tree (target: pipeplan / torch <= 1.0).
(b) The demo gpt (default `gpt` options) on 2 ranks, 8 microbatches: measured median step time of every schedule
    vs the prediction of schedules.simulate on per-stage costs from the measured profiler
    (profiling.measure.profile_model, one thread) (target: within 15%).
Both sides of each comparison run the same full step: pipeline ops, gradient sync, AdamW step, loss all-reduce.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402

from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.models import load_model  # noqa: E402
from pipeplan.partition.cluster import Cluster  # noqa: E402
from pipeplan.planner.plan import Plan  # noqa: E402
from pipeplan.profiling.measure import profile_model  # noqa: E402
from pipeplan.runtime.config import RunConfig  # noqa: E402
from pipeplan.runtime.manual_plan import manual_plan  # noqa: E402
from pipeplan.runtime.train import Trainer  # noqa: E402
from pipeplan.schedules import SCHEDULE_NAMES, Op, StageCosts, generate, simulate  # noqa: E402

WARMUP, STEPS = 3, 12
MLP = {"layers": 8, "hidden": 1024}
MLP_BATCH, MLP_MICROBATCHES = 64, 8
GPT_MICROBATCHES, GPT_MICROBATCH_SIZE = 8, 2
RATIO_TARGET, PREDICTION_TOLERANCE = 1.0, 0.15


def _round_robin_ms(steps: dict[str, object], warmup: int = WARMUP, rounds: int = STEPS) -> dict[str, float]:
    """Median step ms of each runner, timed in alternation so that load from other processes hits all alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            dist.barrier()
            began = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - began) * 1000.0)
    return {name: statistics.median(values) for name, values in times.items()}


def _pipeplan_step(plan_path: str, rank: int, sink: list | None = None):
    """One full training step of the plan; its op times go to `sink` when given."""
    plan = Plan.load(plan_path)
    trainer = Trainer(plan, RunConfig(steps=1, quiet=True), rank=rank, device=torch.device("cpu"))
    batch = next(trainer.model.spec.batches(plan.training.global_batch_size, plan.training.seed))

    def step():
        _, op_times = trainer.one_step(batch)
        if sink is not None:
            sink.append(op_times)

    return step


def _replayed_ms(plan: Plan, per_rank_steps: list[list[list[tuple[str, float, float]]]]) -> float:
    """simulate() on this run's own mean op times per (stage, kind): what the step would take with no overhead
    beyond the ops themselves (separates per-op cost errors from executor overhead and waiting)."""
    durations: dict[tuple[int, str], list[float]] = {}
    for steps in per_rank_steps:
        for op_times in steps[WARMUP:]:
            for text, start, end in op_times:
                o = Op.parse(text)
                durations.setdefault((o.stage, o.kind), []).append((end - start) * 1000.0)
    num_stages = len(plan.stages)

    def med(stage: int, kind: str) -> float | None:
        values = durations.get((stage, kind))
        return statistics.fmean(values) if values else None  # mean: slow outliers are on the critical path too

    forward = [med(s, "F") for s in range(num_stages)]
    igrad = [med(s, "I") if med(s, "I") is not None else med(s, "B") / 2 for s in range(num_stages)]
    wgrad = [med(s, "W") if med(s, "W") is not None else med(s, "B") / 2 for s in range(num_stages)]
    fused = [med(s, "B") if med(s, "B") is not None else i + w for s, i, w in zip(range(num_stages), igrad, wgrad)]
    costs = StageCosts(forward_ms=forward, input_grad_ms=igrad, weight_grad_ms=wgrad, backward_ms=fused, comm_ms=0.0)
    schedule = generate(plan.schedule, num_devices=2, num_microbatches=plan.training.num_microbatches, costs=costs)
    return simulate(schedule, costs).makespan


def _torch_stage_module(layers: nn.ModuleList, first: int, last: int) -> nn.Module:
    return nn.Sequential(*layers[first : last + 1])


def _torch_step(schedule_name: str, rank: int):
    """torch.distributed.pipelining on the same split (1f1b: 4+4 layers; zbv: 2-layer stages 0,3 | 1,2)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    spec = load_model("mlp", MLP)
    model = spec.build()
    device = torch.device("cpu")
    if schedule_name == "1f1b":
        stage_ids = [rank]
        bounds = {0: (0, 3), 1: (4, 7)}
        num_stages = 2
    else:
        stage_ids = [rank, 3 - rank]
        bounds = {s: (2 * s, 2 * s + 1) for s in range(4)}
        num_stages = 4
    stages = [PipelineStage(_torch_stage_module(model.layers, *bounds[s]), s, num_stages, device) for s in stage_ids]
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    loss_fn = spec.loss_fn
    if schedule_name == "1f1b":
        schedule = Schedule1F1B(stages[0], MLP_MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = ScheduleZBVZeroBubble(stages, MLP_MICROBATCHES, loss_fn=loss_fn)
    x, target = next(spec.batches(MLP_BATCH, 0))
    holds_first = 0 in stage_ids
    holds_last = (num_stages - 1) in stage_ids

    def step():
        optimizer.zero_grad()
        losses: list = []
        args = (x[0],) if holds_first else ()
        schedule.step(*args, target=target if holds_last else None, losses=losses if holds_last else None)
        optimizer.step()
        total = torch.tensor([sum(float(v.detach()) for v in losses) / MLP_MICROBATCHES if losses else 0.0])
        dist.all_reduce(total)

    return step


def _bench_entry(mlp_plans: dict[str, str], gpt_plans: dict[str, str]) -> dict:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    out: dict = {"mlp": {}, "gpt": {}}
    for name, path in mlp_plans.items():
        runners = {f"pipeplan {name}": _pipeplan_step(path, rank), f"torch {name}": _torch_step(name, rank)}
        out["mlp"].update(_round_robin_ms(runners))
    sinks: dict[str, list] = {name: [] for name in gpt_plans}
    out["gpt"] = _round_robin_ms({name: _pipeplan_step(path, rank, sinks[name]) for name, path in gpt_plans.items()})
    out["gpt_replayed"] = {}
    for name, path in gpt_plans.items():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sinks[name])
        out["gpt_replayed"][name] = _replayed_ms(Plan.load(path), gathered)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _predicted_ms(plan: Plan, profile, cluster: Cluster) -> float:
    """simulate() on per-stage sums of the measured per-layer costs (comm from the cut sizes)."""
    layers = profile.layers
    forward, igrad, wgrad, fused, comm = [], [], [], [], []
    for stage in plan.stages:
        chosen = layers[stage.first_layer : stage.last_layer + 1]
        forward.append(sum(layer.forward_ms for layer in chosen))
        igrad.append(sum(layer.input_grad_ms for layer in chosen))
        wgrad.append(sum(layer.weight_grad_ms for layer in chosen))
        fused.append(sum(layer.backward_ms for layer in chosen))
        comm.append(cluster.transfer_s(chosen[-1].output_bytes, same_node=True) * 1000.0)
    costs = StageCosts(
        forward_ms=tuple(forward),
        input_grad_ms=tuple(igrad),
        weight_grad_ms=tuple(wgrad),
        backward_ms=tuple(fused),
        comm_ms=tuple(comm[:-1]),
    )
    schedule = generate(plan.schedule, num_devices=2, num_microbatches=plan.training.num_microbatches, costs=costs)
    return simulate(schedule, costs).makespan


def _plans(folder: Path) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    mlp_plans = {}
    for name in ("1f1b", "zbv"):
        plan = manual_plan(
            "mlp",
            MLP,
            schedule=name,
            pipeline_devices=2,
            num_microbatches=MLP_MICROBATCHES,
            microbatch_size=MLP_BATCH // MLP_MICROBATCHES,
        )
        mlp_plans[name] = str(folder / f"mlp-{name}.json")
        plan.save(mlp_plans[name])
    torch.set_num_threads(1)
    spec = load_model("gpt", {})
    profile = profile_model(spec, batch_size=GPT_MICROBATCH_SIZE, progress=False)
    cluster = Cluster(num_devices=2, devices_per_node=2, memory_per_device=1 << 34)
    gpt_plans, predicted = {}, {}
    for name in SCHEDULE_NAMES:
        plan = manual_plan(
            "gpt",
            {},
            schedule=name,
            pipeline_devices=2,
            num_microbatches=GPT_MICROBATCHES,
            microbatch_size=GPT_MICROBATCH_SIZE,
        )
        predicted[name] = _predicted_ms(plan, profile, cluster)
        gpt_plans[name] = str(folder / f"gpt-{name}.json")
        plan.save(gpt_plans[name])
    return mlp_plans, gpt_plans, predicted


def _launch(mlp_plans: dict[str, str], gpt_plans: dict[str, str]) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pipeplan.runtime.launch import _free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id="bench-runtime",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    return elastic_launch(config, _bench_entry)(mlp_plans, gpt_plans)[0]  # rank 0's view (after barriers)


def main() -> int:
    console = Console(width=140)
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as folder:
        mlp_plans, gpt_plans, predicted = _plans(Path(folder))
        measured = _launch(mlp_plans, gpt_plans)
    rows_a = []
    table = Table(title="(a) mlp 8x1024, batch 64, 8 microbatches, 2 ranks x 1 thread: median step ms")
    for column in ("schedule", "pipeplan", "torch.pipelining", "ratio", "target"):
        table.add_column(column)
    for name in ("1f1b", "zbv"):
        ours, theirs = measured["mlp"][f"pipeplan {name}"], measured["mlp"][f"torch {name}"]
        ratio = ours / theirs
        rows_a.append({"schedule": name, "pipeplan_ms": ours, "torch_ms": theirs, "ratio": ratio})
        table.add_row(name, f"{ours:.1f}", f"{theirs:.1f}", f"{ratio:.2f}", "ok" if ratio <= RATIO_TARGET else "MISS")
    console.print(table)
    rows_b = []
    table = Table(
        title=f"(b) demo gpt, {GPT_MICROBATCHES} microbatches of {GPT_MICROBATCH_SIZE}, 2 ranks: measured vs predicted"
    )
    for column in (
        "schedule",
        "measured ms",
        "predicted ms",
        "ratio",
        "within 15%",
        "replayed ms",
        "meas/replay",
    ):
        table.add_column(column)
    for name in SCHEDULE_NAMES:
        ours, guess, replay = measured["gpt"][name], predicted[name], measured["gpt_replayed"][name]
        ratio = ours / guess
        rows_b.append(
            {"schedule": name, "measured_ms": ours, "predicted_ms": guess, "ratio": ratio, "replayed_ms": replay}
        )
        table.add_row(
            name,
            f"{ours:.1f}",
            f"{guess:.1f}",
            f"{ratio:.2f}",
            "yes" if abs(ratio - 1) <= PREDICTION_TOLERANCE else "no",
            f"{replay:.1f}",
            f"{ours / replay:.2f}",
        )
    console.print(table)
    write_json(
        ROOT / "benchmarks" / "results" / "runtime.json",
        {
            "schema_version": 1,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "load_average_after": list(os.getloadavg()),  # other processes share these cores
            "warmup_steps": WARMUP,
            "timed_steps": STEPS,
            "vs_torch_pipelining": rows_a,
            "measured_vs_predicted": rows_b,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
