"""`pipeplan run` speed. Prints a table of medians and ratios and writes results/runtime.json.

(a) 8 x (Linear(1024) + ReLU) (`mlp -a layers=8 -a hidden=1024`), batch 64 in 8 microbatches, 2 ranks with one
    thread each (gloo): median step time of pipeplan's executor vs torch.distributed.pipelining's schedule of the
    same name (`TORCH_SCHEDULES`: every schedule both have) on the same split, in one process tree, the runners timed
    in alternation (target: pipeplan / torch <= 1.0); "next-op receives" runs pipeplan with its mailbox posting only
    the next op's receives (`post_ahead=0`, the runtime before receives were kept posted ahead per peer). dualpipev
    runs with `--overlap-pairs auto` (each rank's choice is printed) and once more with its F&B pairs overlapped
    (`on`).
(b) The demo gpt (examples/demo.sh: `gpt -a hidden=256 -a seq=128 -a layers=4`), profiled at batch 2 with one
    thread, planned by the planner itself for every schedule (the path of `pipeplan plan --devices 2
    --pipeline-depth 2 --no-replication --global-batch-size 16 --optimizer adamw-fp32 --schedule NAME`: 8
    microbatches of 2), run on 2 ranks x 1 thread: measured median step time vs the plan's `predicted.step_ms`
    (target: within 15%). "replayed" re-simulates the plan's own op lists with this run's mean op times: the gap
    between measured and replayed is executor overhead and waiting, the gap between replayed and predicted is the
    profile's per-op cost error. A schedule the planner cannot plan is skipped with its reason.
Both sides of each comparison run the same full step: pipeline ops, gradient sync, AdamW step, loss all-reduce.

`--repeat-a N` runs only (a), N times in separate launches, and writes results/runtime_repeats.json: each run's
ratios and, per schedule, their median and range (runs vary by a few % on shared cores).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--repeat-a", type=int, metavar="N", help="run only (a), N times in separate launches")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402

from pipeplan.errors import PipeplanError  # noqa: E402
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.models import load_model  # noqa: E402
from pipeplan.plan.manual import manual_plan  # noqa: E402
from pipeplan.plan.plan import Plan  # noqa: E402
from pipeplan.plan.timing import plan_costs, plan_timeline  # noqa: E402
from pipeplan.profiling.profile_job import ProfileRequest  # noqa: E402
from pipeplan.runtime.train.config import RunConfig  # noqa: E402
from pipeplan.runtime.train.trainer import Trainer  # noqa: E402
from pipeplan.schedules import SCHEDULE_NAMES, Op  # noqa: E402
from pipeplan.schedules.registry import schedule_info, schedule_names  # noqa: E402
from pipeplan.search.config import SearchConfig  # noqa: E402
from pipeplan.search.emit import build_plan  # noqa: E402
from pipeplan.search.inputs import make_cluster, profile_model_input  # noqa: E402
from pipeplan.search.search import search_plans  # noqa: E402

WARMUP, STEPS = 3, 12
MLP_STEPS = 40  # (a)'s ratios are within a few % of 1 on shared cores: more rounds steady their medians
MLP = {"layers": 8, "hidden": 1024}
MLP_BATCH, MLP_MICROBATCHES = 64, 8
GPT = {"hidden": "256", "seq": "128", "layers": "4"}  # the demo's gpt (examples/demo.sh)
GPT_GLOBAL_BATCH, GPT_MICROBATCH_SIZE, GPT_PIPELINE_DEPTH = 16, 2, 2
GPT_MEMORY = "4GiB"  # every schedule fits (gpipe, the hungriest, needs ~95 MiB); the depth is forced instead
RATIO_TARGET, PREDICTION_TOLERANCE = 1.0, 0.15
TORCH_SCHEDULES = schedule_names(torch_builtin=True)  # every schedule both runtimes have (the registry's)


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


def _pipeplan_step(
    plan_path: str, rank: int, sink: list | None = None, post_ahead: int | None = None, overlap_pairs: str = "auto"
):
    """One full training step of the plan; its op times go to `sink` when given. `post_ahead`: the mailbox's
    receives posted ahead per peer (None: the runtime's default; 0: only the next op's, as before). The step's
    `trainer` is an attribute of the returned function."""
    plan = Plan.load(plan_path)
    config = RunConfig(steps=1, quiet=True, overlap_pairs=overlap_pairs)
    trainer = Trainer(plan, config, rank=rank, device=torch.device("cpu"))
    if post_ahead is not None:
        trainer.executor.mailbox.post_ahead = post_ahead
    batch = next(trainer.model.spec.batches(plan.training.global_batch_size, plan.training.seed))

    def step():
        _, op_times = trainer.one_step(0, batch)
        if sink is not None:
            sink.append(op_times)

    step.trainer = trainer  # type: ignore[attr-defined]
    return step


def _replayed_ms(plan: Plan, per_rank_steps: list[list[list[tuple[str, float, float]]]]) -> float:
    """The plan's own op lists re-simulated (planner.build.plan_timeline, as `show` does) with this run's mean op
    times per (stage, kind) in place of the profiled ones, transfers as planned: what the step would take with no
    overhead beyond the ops themselves (separates per-op cost errors from executor overhead and waiting)."""
    durations: dict[tuple[int, str], list[float]] = {}
    for steps in per_rank_steps:
        for op_times in steps[WARMUP:]:
            for text, start, end in op_times:
                o = Op.parse(text)
                durations.setdefault((o.stage, o.kind), []).append((end - start) * 1000.0)
    planned = plan_costs(plan)

    def measured(kind: str, field: str) -> tuple[float, ...]:
        # mean: slow outliers are on the critical path too; a kind the schedule never runs keeps the plan's value
        return tuple(
            statistics.fmean(durations[(s, kind)]) if (s, kind) in durations else getattr(planned, field)[s]
            for s in range(len(plan.stages))
        )

    costs = dataclasses.replace(
        planned,
        forward_ms=measured("F", "forward_ms"),
        input_grad_ms=measured("I", "input_grad_ms"),
        weight_grad_ms=measured("W", "weight_grad_ms"),
        backward_ms=measured("B", "backward_ms"),
    )
    return plan_timeline(plan, costs).makespan


def _torch_stage_module(layers: nn.ModuleList, first: int, last: int) -> nn.Module:
    return nn.Sequential(*layers[first : last + 1])


def _torch_step(schedule_name: str, rank: int):
    """torch.distributed.pipelining on the same split (gpipe, 1f1b: 4+4 layers; interleaved: 2-layer stages 0,2 |
    1,3; zbv, dualpipev: 2-layer stages 0,3 | 1,2)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    spec = load_model("mlp", MLP)
    model = spec.build()
    device = torch.device("cpu")
    if schedule_name in ("gpipe", "1f1b"):
        stage_ids, num_stages = [rank], 2
        bounds = {0: (0, 3), 1: (4, 7)}
    else:
        stage_ids = [rank, rank + 2] if schedule_name == "interleaved" else [rank, 3 - rank]
        bounds = {s: (2 * s, 2 * s + 1) for s in range(4)}
        num_stages = 4
    stages = [PipelineStage(_torch_stage_module(model.layers, *bounds[s]), s, num_stages, device) for s in stage_ids]
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    loss_fn = spec.loss_fn
    kind = schedules.get_schedule_class(schedule_info(schedule_name).torch_name)
    schedule = kind(stages[0] if num_stages == 2 else stages, MLP_MICROBATCHES, loss_fn=loss_fn)
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
        runners = {
            f"pipeplan {name}": _pipeplan_step(path, rank),
            f"torch {name}": _torch_step(name, rank),
            f"pipeplan {name} next-op receives": _pipeplan_step(path, rank, post_ahead=0),
        }
        if name == "dualpipev":
            runners[f"pipeplan {name} overlapped pairs"] = _pipeplan_step(path, rank, overlap_pairs="on")
        out["mlp"].update(_round_robin_ms(runners, rounds=MLP_STEPS))
        pairs = runners[f"pipeplan {name}"].trainer.executor.pairs
        if pairs is not None:  # how each rank ran its F&B pairs under auto
            out[f"pairs {name}"] = [None] * dist.get_world_size()
            dist.all_gather_object(out[f"pairs {name}"], pairs.describe())
        del runners
        gc.collect()  # free them: trainers hold reference cycles, and live ones slowed later runners by up to 2x
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


def _mlp_plans(folder: Path) -> dict[str, str]:
    mlp_plans = {}
    for name in TORCH_SCHEDULES:
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
    return mlp_plans


def _gpt_plans(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Profile the demo gpt (one thread) and plan it per schedule as `pipeplan plan` does; (plan paths, skipped
    schedules with the planner's reason)."""
    torch.set_num_threads(1)
    request = ProfileRequest(model="gpt", options=GPT, batch_size=GPT_MICROBATCH_SIZE, precision="fp32")
    source = profile_model_input(request)
    cluster = make_cluster(devices=2, devices_per_node=None, memory_per_device=GPT_MEMORY, hardware=None)
    config = SearchConfig(
        global_batch_size=GPT_GLOBAL_BATCH,
        microbatch_sizes=(GPT_MICROBATCH_SIZE,),
        optimizer="adamw-fp32",  # what the runtime trains with
        precision=source.profile.provenance.precision,
        replication=False,  # a replicated one-stage plan would be data parallelism, not the schedule
        pipeline_depths=(GPT_PIPELINE_DEPTH,),
    )
    plans, skipped = {}, {}
    for name in SCHEDULE_NAMES:
        try:
            result = search_plans(source.profile, cluster, config, [name])
        except PipeplanError as exc:
            skipped[name] = str(exc)
            continue
        plans[name] = str(folder / f"gpt-{name}.json")
        build_plan(result, model=source.model, layer_graph=source.layer_graph).save(plans[name])
    return plans, skipped


def _launch(mlp_plans: dict[str, str], gpt_plans: dict[str, str]) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pipeplan.runtime.launch.local import _free_port

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


def _table_a(console: Console, measured: dict) -> list[dict]:
    rows = []
    table = Table(title="(a) mlp 8x1024, batch 64, 8 microbatches, 2 ranks x 1 thread: median step ms")
    columns = ("schedule", "pipeplan", "torch.pipelining", "ratio", "target", "next-op receives", "its ratio")
    for column in columns:
        table.add_column(column)
    for name in TORCH_SCHEDULES:
        ours, theirs = measured["mlp"][f"pipeplan {name}"], measured["mlp"][f"torch {name}"]
        before = measured["mlp"][f"pipeplan {name} next-op receives"]
        ratio = ours / theirs
        rows.append(
            {
                "schedule": name,
                "pipeplan_ms": ours,
                "torch_ms": theirs,
                "ratio": ratio,
                "next_op_receives_ms": before,  # post_ahead=0: receives posted only for the next op
                "next_op_receives_ratio": before / theirs,
            }
        )
        if f"pairs {name}" in measured:
            overlapped = measured["mlp"][f"pipeplan {name} overlapped pairs"]
            rows[-1] |= {
                "auto_pairs": measured[f"pairs {name}"],  # per rank
                "overlapped_pairs_ms": overlapped,
                "overlapped_pairs_ratio": overlapped / theirs,
            }
        within = "ok" if ratio <= RATIO_TARGET else "MISS"
        table.add_row(
            name, f"{ours:.1f}", f"{theirs:.1f}", f"{ratio:.2f}", within, f"{before:.1f}", f"{before / theirs:.2f}"
        )
    console.print(table)
    for row in rows:
        if "auto_pairs" in row:
            ran = "; ".join(f"rank {rank} {way}" for rank, way in enumerate(row["auto_pairs"]))
            overlapped = f"{row['overlapped_pairs_ms']:.1f} ms, ratio {row['overlapped_pairs_ratio']:.2f}"
            console.print(f"{row['schedule']} --overlap-pairs auto ran: {ran}", highlight=False)
            console.print(f"{row['schedule']} with --overlap-pairs on: {overlapped}", highlight=False)
    return rows


def _table_b(console: Console, measured: dict, gpt_plans: dict[str, str], skipped: dict[str, str]) -> list[dict]:
    rows = []
    options = " ".join(f"{key}={value}" for key, value in GPT.items())
    table = Table(
        title=f"(b) demo gpt ({options}), planned per schedule: {GPT_PIPELINE_DEPTH}-device pipeline, global batch "
        f"{GPT_GLOBAL_BATCH}, microbatches of {GPT_MICROBATCH_SIZE}, 2 ranks x 1 thread: measured vs predicted"
    )
    for column in ("schedule", "stages", "measured ms", "predicted ms", "ratio", "within 15%", "replayed ms"):
        table.add_column(column)
    table.add_column("meas/replay")
    for name, path in gpt_plans.items():
        plan = Plan.load(path)
        ours, guess, replay = measured["gpt"][name], plan.predicted.step_ms, measured["gpt_replayed"][name]
        ratio = ours / guess
        layers = [f"{s.first_layer}-{s.last_layer}" for s in plan.stages]
        rows.append(
            {
                "schedule": name,
                "stage_layers": layers,
                "num_microbatches": plan.training.num_microbatches,
                "measured_ms": ours,
                "predicted_ms": guess,
                "ratio": ratio,
                "replayed_ms": replay,
            }
        )
        within = "yes" if abs(ratio - 1) <= PREDICTION_TOLERANCE else "no"
        table.add_row(
            name,
            " ".join(layers),
            f"{ours:.1f}",
            f"{guess:.1f}",
            f"{ratio:.2f}",
            within,
            f"{replay:.1f}",
            f"{ours / replay:.2f}",
        )
    console.print(table)
    for name, reason in skipped.items():
        console.print(f"skipped {name}: {reason}", highlight=False)
    return rows


def _repeat_a(console: Console, repeats: int) -> None:
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as folder:
        mlp_plans = _mlp_plans(Path(folder))
        for _ in range(repeats):
            rows = _table_a(console, _launch(mlp_plans, {}))
            runs.append({"load_average_after": list(os.getloadavg()), "vs_torch_pipelining": rows})
    ratios = {
        name: [row["ratio"] for run in runs for row in run["vs_torch_pipelining"] if row["schedule"] == name]
        for name in TORCH_SCHEDULES
    }
    summary = {name: {"median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in ratios.items()}
    for name, figures in summary.items():
        console.print(
            f"{name}: pipeplan / torch median {figures['median']:.2f} over {repeats} runs "
            f"({figures['min']:.2f}-{figures['max']:.2f})",
            highlight=False,
        )
    write_json(
        ROOT / "benchmarks" / "results" / "runtime_repeats.json",
        {
            "schema_version": 1,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "timed_steps_vs_torch": MLP_STEPS,
            "ratio_by_schedule": summary,
            "runs": runs,
        },
    )


def main(repeat_a: int | None) -> int:
    console = Console(width=140)
    if repeat_a is not None:
        _repeat_a(console, repeat_a)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as folder:
        mlp_plans = _mlp_plans(Path(folder))
        gpt_plans, skipped = _gpt_plans(Path(folder))
        measured = _launch(mlp_plans, gpt_plans)
        rows_a = _table_a(console, measured)
        rows_b = _table_b(console, measured, gpt_plans, skipped)
    write_json(
        ROOT / "benchmarks" / "results" / "runtime.json",
        {
            "schema_version": 1,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "load_average_after": list(os.getloadavg()),  # other processes share these cores
            "warmup_steps": WARMUP,
            "timed_steps": STEPS,
            "timed_steps_vs_torch": MLP_STEPS,
            "vs_torch_pipelining": rows_a,
            "gpt": {
                "model_options": GPT,
                "global_batch_size": GPT_GLOBAL_BATCH,
                "microbatch_size": GPT_MICROBATCH_SIZE,
                "pipeline_depth": GPT_PIPELINE_DEPTH,
                "memory_per_device": GPT_MEMORY,
            },
            "measured_vs_predicted": rows_b,
            "skipped": skipped,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS.repeat_a))
