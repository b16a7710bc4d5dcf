"""Convergence of the asynchronous schedules (a benchmark, not a test): the built-in gpt (4 layers, hidden 64) on a
fixed small token dataset (benchmarks/byte_gpt.py: a bigram language whose loss floor is ~1.11 nats), trained for a
few hundred steps with synchronous 1f1b, pipedream-2bw and pipedream on the same pipeline split, the same batches
and the same AdamW settings, 2 (default) or 4 gloo ranks with one thread each.

Prints a table (final loss: the mean of the last 20 steps; mean and median step time) and writes
results/async_convergence.json (every step's loss and time per schedule) and results/async_convergence.png (loss
against step and against wall time). What to expect: 2BW follows 1f1b closely (one step of staleness); pipedream
takes an optimizer step per microbatch (m per step, each on one microbatch's gradient), so per step it moves
further, with each stage's weights p-1-d updates stale. Every schedule runs with one gloo process group per
transfer direction (the asynchronous ones always do: a stream sends both ways at once, and one shared pair cost
them 1.7x). The throughput gain of dropping the flush is (m + p - 1) / m for balanced stages; on a shared CPU the
step times are noisy.

    python benchmarks/bench_async.py [--steps 300] [--ranks 2|4] [--lr 2e-3]
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="training steps per schedule")
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2, help="gloo ranks (one thread each)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.plan.manual import manual_plan  # noqa: E402
from pipeplan.runtime.launch.local import launch_many  # noqa: E402
from pipeplan.runtime.train.config import RunConfig  # noqa: E402
from pipeplan.schedules.registry import schedule_info  # noqa: E402

MODEL = str(ROOT / "benchmarks" / "byte_gpt.py") + ":byte_gpt"
SCHEDULES = ("1f1b", "pipedream-2bw", "pipedream")
MICROBATCHES, MICROBATCH_SIZE = 4, 4  # global batch 16 windows of 32 tokens
FINAL_WINDOW = 20
RESULTS = ROOT / "benchmarks" / "results"


def run(steps: int, ranks: int, lr: float) -> dict[str, dict]:
    folder = Path(tempfile.mkdtemp(prefix="pipeplan-bench-async-"))
    runs = []
    for name in SCHEDULES:
        plan = manual_plan(
            MODEL,
            {},
            schedule=name,
            pipeline_devices=ranks,
            num_microbatches=MICROBATCHES,
            microbatch_size=MICROBATCH_SIZE,
            lr=lr,
        )
        path = folder / f"{name}.json"
        plan.save(path)
        config = RunConfig(  # one gloo group per direction for every schedule, as the asynchronous ones always use
            steps=steps, quiet=True, lr=lr, check_every=0, heartbeat_timeout_s=300.0, direction_groups=True
        )
        runs.append((str(path), config))
    began = time.perf_counter()
    per_rank = launch_many(runs, threads=1)
    print(f"ran {len(SCHEDULES)} x {steps} steps on {ranks} ranks in {time.perf_counter() - began:.0f} s")
    found = {}
    for index, name in enumerate(SCHEDULES):
        first = per_rank[0][index]  # losses are all-reduced: every rank has them; rank 0 runs the first stage
        timed = first.step_ms[1:]  # the first step includes warm-up
        found[name] = {
            "staleness": schedule_info(name).describe_staleness(ranks) or "none (flush, synchronized step)",
            "losses": first.losses,
            "step_ms": first.step_ms,
            "final_loss": statistics.fmean(first.losses[-FINAL_WINDOW:]),
            "mean_step_ms": statistics.fmean(timed),
            "median_step_ms": statistics.median(timed),
        }
    return found


def plot(found: dict[str, dict], path: Path, floor: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, row in found.items():
        losses = row["losses"]
        smooth, value = [], losses[0]
        for loss in losses:  # exponential moving average, for readability; the raw curve is drawn faintly
            value = 0.9 * value + 0.1 * loss
            smooth.append(value)
        elapsed = [sum(row["step_ms"][: i + 1]) / 1000.0 for i in range(len(losses))]
        (line,) = by_step.plot(smooth, label=name)
        by_step.plot(losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
        by_time.plot(elapsed, smooth, color=line.get_color(), label=name)
    for axis, label in ((by_step, "step"), (by_time, "wall time on rank 0 (s)")):
        axis.axhline(floor, color="black", linestyle="--", linewidth=1, label="loss floor (bigram entropy)")
        axis.set_xlabel(label)
        axis.set_ylabel("training loss (nats)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    by_step.set_title("gpt on a fixed bigram dataset: loss per step")
    by_time.set_title("loss against wall time")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def main(args) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from byte_gpt import entropy_floor

    found = run(args.steps, args.ranks, args.lr)
    table = Table(title=f"gpt (4 layers, hidden 64) on {args.ranks} gloo ranks, {args.steps} steps, lr {args.lr}")
    for column in ("schedule", "final loss", "mean step ms", "median step ms", "vs 1f1b", "staleness"):
        table.add_column(column, justify="left" if column in ("schedule", "staleness") else "right")
    base = found["1f1b"]["median_step_ms"]
    for name, row in found.items():
        table.add_row(
            name,
            f"{row['final_loss']:.4f}",
            f"{row['mean_step_ms']:.1f}",
            f"{row['median_step_ms']:.1f}",
            f"{row['median_step_ms'] / base:.2f}x",
            row["staleness"],
        )
    Console(width=160).print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(found, RESULTS / "async_convergence.png", entropy_floor())
    write_json(
        RESULTS / "async_convergence.json",
        {
            "benchmark": "async_convergence",
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "model": MODEL.split("/")[-1],
            "ranks": args.ranks,
            "steps": args.steps,
            "lr": args.lr,
            "microbatches": MICROBATCHES,
            "microbatch_size": MICROBATCH_SIZE,
            "loss_floor": entropy_floor(),
            "schedules": found,
        },
    )
    print(f"wrote {RESULTS / 'async_convergence.png'} and {RESULTS / 'async_convergence.json'}")


if __name__ == "__main__":
    main(ARGS)
