"""Measured-profiler benchmarks.

1. Split backward: on a gpt block (hidden 512, seq 256, batch 8, CPU), median I+W time over median fused B time;
   target <= 1.15 (W must not redo I's work).
2. Fidelity: sum of per-layer times over whole-model times (`profiling.consistency.sums_over_whole`: F over the
   whole forward, I+W over the whole model's split backward, B over its fused backward), median over several
   profiler runs, for gpt / mlp / resnet; targets: forward within 15%, I+W within 25%.
3. With `--busy-runs N`: the README tour's `pipeplan profile gpt -b 2` (torch's default threads, wall clock) N
   times while another process keeps one core busy (`python -c "while True: pass"`, ended after each run): per run
   the wall time, the layer sums / whole per pass, the repeated blocks' slowest / fastest forward, the
   measurements taken and whether it warned (a profile out of bounds must warn, naming the layer; issue 37).
Prints a table and writes results/profiler.json. Defaults: 1 torch thread and process CPU time (`--timer cpu`),
which other jobs on a shared machine do not disturb; `--timer wall --threads N` measures wall-clock time.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    parser.add_argument("--timer", choices=("cpu", "wall"), default="cpu", help="profiler clock on CPU")
    parser.add_argument("--runs", type=int, default=3, help="profiler runs per model (median kept)")
    parser.add_argument("--repeats", type=int, default=15, help="split-backward timing repeats")
    parser.add_argument("--busy-runs", type=int, default=0, help="runs of part 3 (default 0: not run), e.g. 3")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pipeplan.graph.split_backward import backward_full, backward_input, backward_weight  # noqa: E402
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.models import load_model  # noqa: E402
from pipeplan.models.gpt import Block  # noqa: E402
from pipeplan.profiling.consistency import sums_over_whole  # noqa: E402
from pipeplan.profiling.measure import profile_model  # noqa: E402
from pipeplan.profiling.profile import Profile  # noqa: E402

SPLIT_TARGET = 1.15
FORWARD_TOLERANCE = 0.15
BACKWARD_TOLERANCE = 0.25
FIDELITY_CASES = [
    ("gpt", dict(layers=4, hidden=256), 4),
    ("mlp", dict(layers=8, hidden=1024), 128),
    ("resnet", dict(blocks=4, channels=32, image=32), 16),
]


def split_backward_ratio(repeats: int, timer: str) -> dict:
    torch.manual_seed(0)
    block = Block(512, 8, 0.0)
    params = list(block.parameters())
    x0, grad = torch.randn(8, 256, 512), torch.randn(8, 256, 512)

    def once(split: bool) -> float:
        x = x0.clone().requires_grad_()
        out = block(x)
        now = time.process_time if timer == "cpu" else time.perf_counter
        start = now()
        if split:
            _, state = backward_input([out], [grad], [x], params)
            backward_weight(state)
        else:
            backward_full([out], [grad], [x], params)
        elapsed = now() - start
        block.zero_grad(set_to_none=True)
        return elapsed * 1e3

    for _ in range(2):
        once(True), once(False)
    split, fused = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        split.append(once(True))
        fused.append(once(False))
    split_ms, fused_ms = statistics.median(split), statistics.median(fused)
    return {"split_ms": split_ms, "fused_ms": fused_ms, "ratio": split_ms / fused_ms, "target": SPLIT_TARGET}


def fidelity_case(ref: str, options: dict, batch_size: int, runs: int, timer: str) -> dict:
    spec = load_model(ref, options)
    forward, split, fused = [], [], []
    for _ in range(runs):
        ratios = sums_over_whole(
            profile_model(
                spec, batch_size=batch_size, warmup=2, repeats=5, progress=False, timer=timer, precision="fp32"
            )
        )
        forward.append(ratios["F"])
        split.append(ratios["I+W"])
        fused.append(ratios["B"])
    result = {
        "model": ref,
        "options": options,
        "batch_size": batch_size,
        "forward_ratio": statistics.median(forward),
        "split_backward_ratio": statistics.median(split),
        "fused_backward_ratio": statistics.median(fused),
    }
    result["forward_ok"] = abs(result["forward_ratio"] - 1) <= FORWARD_TOLERANCE
    result["backward_ok"] = abs(result["split_backward_ratio"] - 1) <= BACKWARD_TOLERANCE
    return result


def busy_core_run() -> dict:
    """`pipeplan profile gpt -b 2` in a fresh process while another one spins on a core."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "gpt.json"
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pipeplan", "profile", "gpt", "-b", "2", "-o", str(out)],
                capture_output=True,
                text=True,
                check=True,
            )
            wall = time.perf_counter() - start
            profile = Profile.load(out)
    finally:
        spinner.kill()
        spinner.wait()
    blocks = [layer.forward_ms for layer in profile.layers if layer.name.startswith("blocks.")]
    warning = next((line for line in done.stderr.splitlines() if "out of bounds" in line), None)
    return {
        "wall_s": wall,
        "sums_over_whole": sums_over_whole(profile),
        "blocks_forward_max_over_min": max(blocks) / min(blocks),
        "measurements": profile.measurement.attempts,
        "warning": warning,
        "load_average": list(os.getloadavg()),
    }


def _busy_table(runs: list[dict]) -> Table:
    table = Table(title="pipeplan profile gpt -b 2 with one core kept busy", title_justify="left")
    for column in ("wall s", "F", "I+W", "B", "blocks F max/min", "measurements", "warned"):
        table.add_column(column, justify="right")
    for run in runs:
        sums = run["sums_over_whole"]
        table.add_row(
            f"{run['wall_s']:.1f}",
            *(f"{sums[key]:.2f}" if sums[key] else "-" for key in ("F", "I+W", "B")),
            f"{run['blocks_forward_max_over_min']:.1f}",
            str(run["measurements"]),
            "yes" if run["warning"] else "no",
        )
    return table


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    split = split_backward_ratio(args.repeats, args.timer)
    table = Table(title="split backward on a gpt block (hidden 512, seq 256, batch 8)", title_justify="left")
    for column in ("I+W ms", "B ms", "ratio", "target"):
        table.add_column(column, justify="right")
    table.add_row(f"{split['split_ms']:.1f}", f"{split['fused_ms']:.1f}", f"{split['ratio']:.3f}", f"<= {SPLIT_TARGET}")
    console.print(table)
    cases = [fidelity_case(ref, options, batch, args.runs, args.timer) for ref, options, batch in FIDELITY_CASES]
    title = f"profiler fidelity: per-layer sums / whole model (median of runs, {args.timer} time)"
    table = Table(title=title, title_justify="left")
    for column in ("model", "batch", "F", "I+W", "B", "F within 15%", "I+W within 25%"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for case in cases:
        table.add_row(
            f"{case['model']} " + " ".join(f"{k}={v}" for k, v in case["options"].items()),
            str(case["batch_size"]),
            f"{case['forward_ratio']:.3f}",
            f"{case['split_backward_ratio']:.3f}",
            f"{case['fused_backward_ratio']:.3f}",
            "yes" if case["forward_ok"] else "NO",
            "yes" if case["backward_ok"] else "NO",
        )
    console.print(table)
    busy = [busy_core_run() for _ in range(args.busy_runs)]
    if busy:
        console.print(_busy_table(busy))
    write_json(
        ROOT / "benchmarks" / "results" / "profiler.json",
        {
            "benchmark": "profiler",
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "timer": args.timer,
            "load_average": list(os.getloadavg()),
            "split_backward": split,
            "fidelity": cases,
            "busy_core": busy,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
