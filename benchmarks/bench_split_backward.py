"""The split backward as the runtime runs it: (I+W)/B per block width, and the host time per op with and without
the per-stage graph analysis cache (`graph.split_analysis.SplitCache`).

A stage of `--blocks` GPT blocks (head dim 64) runs its forward under SavedTensors as the executor does (under
bf16 autocast with --precision bf16-mixed, as bf16-mixed runs do), then either B (`backward_full`) or I
(`backward_input`, with or without the stage's SplitCache) followed by W (`backward_weight`). Per op:

- host ms: time of the call (on CUDA wall time, not synchronized: the time the host spends issuing it; on the CPU
  the op's whole time, as process CPU time by default (`--timer cpu`: steady on a busy machine; one thread));
- device ms: CUDA events around the op (on the CPU, the host time);
- (I+W)/B: device I + W over device B, cached (1.00: splitting costs nothing; above: W redoes work, or the host's
  issuing shows between kernels);
- analysis ms: `analyze` of one microbatch's graph against `SplitCache.analyze` of it (a warm cache), and their ratio.

The variants run interleaved round by round (machine noise hits all alike); figures are medians over `--rounds`.
Defaults: CUDA widths 1024, 2048, 4096 at seq 1024, bf16-mixed; CPU widths 32, 128, 512 at seq 16, fp32, one
thread (at the small widths the op is mostly host work, as small blocks on a GPU are). Writes
results/split_backward.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from arguments import parse_args  # noqa: E402


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--widths", default=None, help="comma list (default: cuda 1024,2048,4096; cpu 32,128,512)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="default: cuda 1024, cpu 16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--precision", default=None, help="fp32 or bf16-mixed (default: cuda bf16-mixed, cpu fp32)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--timer", default=None, help="wall or cpu (default: cuda wall, cpu cpu)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split_backward.json"))


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipeplan.graph.saved_tensors import SavedTensors  # noqa: E402
from pipeplan.graph.split_backward import (  # noqa: E402
    SplitCache,
    analyze,
    backward_full,
    backward_input,
    backward_weight,
)
from pipeplan.jsonio import write_json  # noqa: E402
from pipeplan.models.gpt import Block  # noqa: E402

VARIANTS = ("B", "I+W", "I+W cached")


class Clock:
    """Host and device milliseconds of one op: `timer` (wall: perf_counter, cpu: process_time) around the call;
    CUDA events on CUDA."""

    def __init__(self, device: torch.device, timer: str) -> None:
        self.cuda = device.type == "cuda"
        self.now = time.process_time if timer == "cpu" else time.perf_counter

    def time(self, call) -> tuple[float, float, object]:
        start_event = end_event = None
        if self.cuda:
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = self.now()
        result = call()
        host = (self.now() - start) * 1e3
        if not self.cuda:
            return host, host, result
        end_event.record()
        end_event.synchronize()
        return host, start_event.elapsed_time(end_event), result


def _stage(width: int, blocks: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, max(1, width // 64), 0.0) for _ in range(blocks))).to(device)


def _round(stage, params, x0, grad, clock, autocast, cache) -> dict[str, dict[str, float]]:
    """One microbatch per variant: {variant: {op: (host ms, device ms)}} and the analysis times."""
    found: dict = {}
    for variant in VARIANTS:
        x = x0.detach().requires_grad_()
        with SavedTensors(hold=False) as saved, autocast():
            out = stage(x)
        times = {}
        if variant == "B":
            times["B"] = clock.time(lambda: backward_full([out], [grad], [x], params))[:2]  # noqa: B023
        else:
            use = cache if variant.endswith("cached") else None
            host, device, (_, state) = clock.time(
                lambda: backward_input([out], [grad], [x], params, saved=saved, cache=use)  # noqa: B023
            )
            times["I"] = (host, device)
            times["W"] = clock.time(lambda: backward_weight(state))[:2]  # noqa: B023
        found[variant] = times
        stage.zero_grad(set_to_none=True)
    x = x0.detach().requires_grad_()
    with autocast():
        out = stage(x)
    found["analysis"] = {
        "analyze": clock.time(lambda: analyze([out], [x], params))[:2],
        "cached": clock.time(lambda: cache.analyze([out], [x], params))[:2],
    }
    return found


def measure_width(width: int, args, device: torch.device) -> dict:
    stage = _stage(width, args.blocks, device)
    params = list(stage.parameters())
    x0 = torch.randn(args.batch, args.seq, width, device=device)
    grad = torch.randn(args.batch, args.seq, width, device=device)
    mixed = args.precision == "bf16-mixed"
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if mixed else contextlib.nullcontext
    clock, cache = Clock(device, args.timer), SplitCache()
    rounds = [_round(stage, params, x0, grad, clock, autocast, cache) for _ in range(args.warmup + args.rounds)]
    rounds = rounds[args.warmup :]

    def median(variant: str, op: str, which: int) -> float:
        return statistics.median(r[variant][op][which] for r in rounds)

    row = dict(width=width, blocks=args.blocks, seq=args.seq, batch=args.batch)
    row["B_ms"] = median("B", "B", 1)
    for variant, key in (("I+W", "uncached"), ("I+W cached", "cached")):
        row[f"I_ms_{key}"], row[f"W_ms_{key}"] = median(variant, "I", 1), median(variant, "W", 1)
        row[f"I_host_ms_{key}"], row[f"W_host_ms_{key}"] = median(variant, "I", 0), median(variant, "W", 0)
    row["B_host_ms"] = median("B", "B", 0)
    row["iw_over_b"] = (row["I_ms_cached"] + row["W_ms_cached"]) / row["B_ms"]
    row["iw_over_b_uncached"] = (row["I_ms_uncached"] + row["W_ms_uncached"]) / row["B_ms"]
    row["I_host_cached_over_uncached"] = row["I_host_ms_cached"] / row["I_host_ms_uncached"]
    row["analyze_ms"] = median("analysis", "analyze", 0)
    row["analyze_cached_ms"] = median("analysis", "cached", 0)
    row["analysis_cached_over_uncached"] = row["analyze_cached_ms"] / row["analyze_ms"]
    row["cache_hits"], row["cache_misses"] = cache.hits, cache.misses
    return row


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """The device-dependent defaults, once torch can say whether CUDA is there."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if cuda else "cpu"
    args.widths = [int(w) for w in (args.widths or ("1024,2048,4096" if cuda else "32,128,512")).split(",")]
    args.seq = args.seq or (1024 if cuda else 16)
    args.timer = args.timer or ("wall" if cuda else "cpu")
    args.precision = args.precision or ("bf16-mixed" if cuda else "fp32")
    return args


def main(args: argparse.Namespace) -> int:
    args = _resolved(args)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows = [measure_width(width, args, device) for width in args.widths]
    print(
        f"split backward on {args.device} ({args.precision}, {args.blocks} blocks, seq {args.seq}, batch {args.batch}, "
        f"{args.timer} host timer, medians of {args.rounds} rounds)"
    )
    header = "width   B ms   I+W ms  (I+W)/B   I host ms: plain / cached (ratio)   analysis ms: plain / cached (ratio)"
    print(header)
    for r in rows:
        host = f"{r['I_host_ms_uncached']:8.3f} / {r['I_host_ms_cached']:8.3f} ({r['I_host_cached_over_uncached']:.2f})"
        analysis = f"{r['analyze_ms']:7.3f} / {r['analyze_cached_ms']:7.3f} ({r['analysis_cached_over_uncached']:.2f})"
        iw = r["I_ms_cached"] + r["W_ms_cached"]
        print(f"{r['width']:5d} {r['B_ms']:7.3f} {iw:8.3f} {r['iw_over_b']:8.2f}   {host}          {analysis}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    write_json(
        Path(args.out),
        dict(
            schema_version=1,
            machine=platform.platform(),
            device=args.device,
            device_name=name,
            torch=torch.__version__,
            precision=args.precision,
            timer=args.timer,
            rounds=args.rounds,
            results=rows,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
