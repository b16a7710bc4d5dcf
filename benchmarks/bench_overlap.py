"""dualpipev's overlapped F&B ops vs the same op lists with each pair run as its halves, one after the other.

The gpt `-a hidden=256 -a seq=128 -a layers=8` on 2 ranks (gloo, CPU), dualpipev (4 stages in a V), 8 microbatches
of 2. Both plans run in one launch, alternating (ROUNDS runs of each, WARMUP first steps of each run dropped):
the median step time of each and their ratio (overlapped / halves; < 1 is faster), and whether every run's losses
are equal bit for bit. The overlapped op runs its backward on a second thread while the forward runs
(`--overlap-pairs on`, runtime/step/pair_runner.py), so it gains where a rank has spare cores for it: pass the
threads per rank as the first argument (default 1). Writes results/overlap.json.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("threads", type=int, nargs="?", default=1, help="torch CPU threads per rank (default 1)")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.plan.manual import manual_plan  # noqa: E402
from pipeplan.runtime.launch.local import launch_many  # noqa: E402
from pipeplan.runtime.train.config import RunConfig  # noqa: E402
from pipeplan.schedules.ops import Op  # noqa: E402

GPT = {"hidden": 256, "seq": 128, "layers": 8}
MICROBATCHES, MICROBATCH_SIZE = 8, 2
ROUNDS, WARMUP, STEPS = 3, 1, 5


def as_halves(rank_ops: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
    """Every overlapped F&B op written as its forward then its backward."""
    return tuple(tuple(str(h) for text in ops for h in Op.parse(text).parts) for ops in rank_ops)


def main(threads: int) -> None:
    plan = manual_plan(
        "gpt",
        GPT,
        schedule="dualpipev",
        pipeline_devices=2,
        num_microbatches=MICROBATCHES,
        microbatch_size=MICROBATCH_SIZE,
    )
    halves = dataclasses.replace(plan, rank_ops=as_halves(plan.rank_ops))
    config = RunConfig(steps=WARMUP + STEPS, quiet=True, heartbeat_timeout_s=120.0)
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for name, p in (("overlapped", plan), ("halves", halves)):
            paths[name] = os.path.join(folder, f"{name}.json")
            p.save(paths[name])
        order = [name for _ in range(ROUNDS) for name in ("overlapped", "halves")]
        configs = {"overlapped": dataclasses.replace(config, overlap_pairs="on"), "halves": config}  # (no pairs left)
        results = launch_many([(paths[name], configs[name]) for name in order], threads=threads)
    steps: dict[str, list[float]] = {"overlapped": [], "halves": []}
    for index, name in enumerate(order):  # a step lasts as long as its slowest rank
        per_step = zip(*(per_rank[index].step_ms for per_rank in results))
        steps[name] += [max(times) for times in per_step][WARMUP:]
    losses = {tuple(tuple(per_rank[index].losses) for per_rank in results) for index in range(len(order))}
    medians = {name: statistics.median(times) for name, times in steps.items()}
    ratio = medians["overlapped"] / medians["halves"]
    print(f"dualpipev, 2 ranks x {threads} thread(s), gpt {GPT}, {MICROBATCHES} microbatches of {MICROBATCH_SIZE}")
    for name, times in steps.items():
        print(f"  {name:>10}: median step {medians[name]:8.1f} ms over {len(times)} steps")
    print(f"  overlapped / halves: {ratio:.3f}; losses of every run equal bit for bit: {len(losses) == 1}")
    write_json(
        ROOT / "benchmarks" / "results" / "overlap.json",
        {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "threads_per_rank": threads,
            "median_step_ms": medians,
            "steps": {name: len(times) for name, times in steps.items()},
            "ratio_overlapped_over_halves": ratio,
            "losses_equal": len(losses) == 1,
        },
    )


if __name__ == "__main__":
    main(ARGS.threads)
