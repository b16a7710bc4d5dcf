"""`pipeplan run --post-validate` step time. Prints a table and writes results/post_validate.json.

A gpt (`-a hidden=256 -a seq=64 -a layers=4`, vocab 512) in a 1f1b pipeline of 2 and of 4 gloo ranks (one thread
each, one stage per rank), 8 microbatches of 2: the median full training step (pipeline ops, gradient reductions,
global checks, AdamW) synchronized and post-validated, timed in alternation (each step starts after a barrier; its
time is the slowest rank's), without clipping and with a --clip-grad-norm so small that every step is clipped (the
post-validated run then rolls every step back and steps again: its worst case). "copy" is the slowest rank's median
time copying its parameters and AdamW state before the eager step, part of the post-validated step. Post-validation
takes the global barrier off the path to the optimizer step; on CPU processes of one machine that barrier (an
all-gather of two numbers per rank) is cheap and the ranks share cores, so the ratio mostly shows that the copy costs
little, not the saving on a real cluster. Each step here is settled before the next (Trainer.one_step): the overlap
of consecutive steps that `run --post-validate` gets is not measured here (tests/runtime/test_period_run.py reads it
off a trace). Takes one to two minutes.
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

from arguments import parse_args

if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    parse_args(__doc__)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.plan.manual import manual_plan  # noqa: E402
from pipeplan.plan.plan import Plan  # noqa: E402
from pipeplan.runtime.train.config import RunConfig  # noqa: E402
from pipeplan.runtime.train.trainer import Trainer  # noqa: E402

MODEL = {"hidden": 256, "seq": 64, "layers": 4}
MICROBATCHES, MICROBATCH_SIZE = 8, 2
WORLD_SIZES = (2, 4)
CLIPS = {"no clipping": None, "clipped every step": 1e-3}
WARMUP, ROUNDS = 2, 14


def _entry(plan_path: str) -> dict:
    """Per rank: median ms of each (case, post-validated?) trainer, stepped in alternation."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    plan = Plan.load(plan_path)
    trainers = {
        (case, post): Trainer(
            plan,
            RunConfig(steps=1, quiet=True, clip_grad_norm=clip, post_validate=post),
            rank=rank,
            device=torch.device("cpu"),
        )
        for case, clip in CLIPS.items()
        for post in (False, True)
    }
    batch = next(next(iter(trainers.values())).model.spec.batches(plan.training.global_batch_size, plan.training.seed))
    copies = {key: _timed_copies(t) for key, t in trainers.items() if t.post_validator is not None}
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in trainers}
    keys = list(trainers)
    for round_ in range(WARMUP + ROUNDS):
        for key in keys if round_ % 2 == 0 else keys[::-1]:  # alternate who goes first
            dist.barrier()
            began = time.perf_counter()
            trainers[key].one_step(round_, batch)
            slowest = torch.tensor([(time.perf_counter() - began) * 1000.0])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if round_ >= WARMUP:
                times[key].append(float(slowest))
    rollbacks = {key: t.post_validator.rollbacks for key, t in trainers.items() if t.post_validator is not None}
    copy_ms = {}
    for key, spent in copies.items():  # the slowest rank's median time copying its state before the eager step
        slowest = torch.tensor([statistics.median(spent[WARMUP:])])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        copy_ms[key] = float(slowest)
    dist.barrier()
    dist.destroy_process_group()
    medians = {key: statistics.median(v) for key, v in times.items()}
    return {"median_ms": medians, "rollbacks": rollbacks, "copy_ms": copy_ms}


def _timed_copies(trainer: Trainer) -> list[float]:
    """Record how long each of the post-validator's pre-step copies takes (ms)."""
    undo, spent = trainer.post_validator.undo, []
    take = undo.take

    def timed_take() -> None:
        began = time.perf_counter()
        take()
        spent.append((time.perf_counter() - began) * 1000.0)

    undo.take = timed_take
    return spent


def _launch(plan_path: str, world_size: int) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pipeplan.runtime.launch.local import _free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"bench-post-validate-{world_size}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    return elastic_launch(config, _entry)(plan_path)[0]  # rank 0's view: the times are already the slowest rank's


def _rows(world_size: int, measured: dict) -> list[dict]:
    rows = []
    for case in CLIPS:
        sync, post = measured["median_ms"][(case, False)], measured["median_ms"][(case, True)]
        rows.append(
            {
                "ranks": world_size,
                "case": case,
                "clip_grad_norm": CLIPS[case],
                "synchronized_ms": sync,
                "post_validated_ms": post,
                "ratio": post / sync,
                "pre_step_copy_ms": measured["copy_ms"][(case, True)],
                "rollbacks": measured["rollbacks"][(case, True)],
                "steps": WARMUP + ROUNDS,
            }
        )
    return rows


def main() -> int:
    console = Console(width=120)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-post-validate-") as folder:
        for world_size in WORLD_SIZES:
            plan = manual_plan(
                "gpt",
                MODEL,
                schedule="1f1b",
                pipeline_devices=world_size,
                num_microbatches=MICROBATCHES,
                microbatch_size=MICROBATCH_SIZE,
            )
            path = str(Path(folder) / f"gpt-{world_size}.json")
            plan.save(path)
            rows += _rows(world_size, _launch(path, world_size))
    options = " ".join(f"{k}={v}" for k, v in MODEL.items())
    table = Table(title=f"gpt ({options}), 1f1b, {MICROBATCHES}x{MICROBATCH_SIZE}, gloo x 1 thread: median step ms")
    for column in ("ranks", "case", "synchronized", "post-validated", "post/sync", "of it: copy", "rolled back"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            str(row["ranks"]),
            row["case"],
            f"{row['synchronized_ms']:.1f}",
            f"{row['post_validated_ms']:.1f}",
            f"{row['ratio']:.3f}",
            f"{row['pre_step_copy_ms']:.1f}",
            f"{row['rollbacks']} of {row['steps']}",
        )
    console.print(table)
    write_json(
        ROOT / "benchmarks" / "results" / "post_validate.json",
        {
            "schema_version": 1,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "load_average_after": list(os.getloadavg()),  # other processes share these cores
            "model": {"name": "gpt", **MODEL},
            "schedule": "1f1b",
            "num_microbatches": MICROBATCHES,
            "microbatch_size": MICROBATCH_SIZE,
            "warmup_steps": WARMUP,
            "timed_steps": ROUNDS,
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
