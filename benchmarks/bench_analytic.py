"""Analytic (meta-device) profiling speed and memory (target: the 32-layer, hidden-4096, seq-2048 GPT, 6.7B
parameters, in < 30 s and < 2 GiB peak RSS). Each case runs in a fresh process so its peak RSS is its own. Prints
a table (median of repeats for time, max RSS) and writes results/analytic.json; also reports how far the profile's
per-block saved bytes and FLOPs are from the 34·s·b·h and 24·b·s·h² + 4·b·s²·h formulas."""

from __future__ import annotations

import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from arguments import parse_args

REPEATS = 3
TIME_TARGET_S = 30.0
RSS_TARGET_BYTES = 2 * 2**30
CASES: dict[str, tuple[str, dict]] = {
    "gpt-6.7b": ("gpt", dict(layers=32, hidden=4096, heads=32, seq=2048, vocab=50257, dropout=0.1)),
    "llama-7b": ("llama-7b", {}),
    "llama-70b": ("llama-70b", {}),
}


def _options(parser) -> None:
    parser.add_argument("--repeats", type=int, default=REPEATS, help="fresh processes per case (median time kept)")
    parser.add_argument("--case", choices=tuple(CASES), help="profile this one case here and print its JSON")


if __name__ == "__main__":  # before anything runs: --help answers at once
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the closed-form references (a test oracle): helpers/transformer_reference.py


def run_case(case: str) -> dict:
    """Profile one case in this process; returns timings, peak RSS and formula agreement."""
    start = time.perf_counter()
    from pipeplan.models import load_model
    from pipeplan.profiling.analytic import profile_analytic

    import_s = time.perf_counter() - start
    from helpers.transformer_reference import activation_bytes_per_layer, forward_flops_per_layer

    ref, options = CASES[case]
    spec = load_model(ref, {k: str(v) for k, v in options.items()})
    start = time.perf_counter()
    profile = profile_analytic(spec, batch_size=1, hardware="h100", attention="auto", precision="bf16-mixed")
    profile_s = time.perf_counter() - start
    opts = spec.options
    block = next(layer for layer in profile.layers if layer.name.startswith("blocks."))
    shape = dict(seq=opts["seq"], batch=1, hidden=opts["hidden"])
    result = dict(
        case=case,
        layers=profile.num_layers,
        params=sum(layer.param_count for layer in profile.layers),
        profile_s=profile_s,
        import_s=import_s,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        block_forward_ms=block.forward_ms,
        block_backward_ms=block.backward_ms,
    )
    if ref == "gpt":  # the formulas describe GPT blocks (4h GELU MLP, LayerNorm, dropout)
        saved_ref = activation_bytes_per_layer(**shape, heads=opts["heads"], flash_attention=True)
        result["saved_bytes_vs_34sbh_pct"] = 100 * (block.activation_bytes / saved_ref - 1)
        result["flops_vs_formula_pct"] = 100 * (block.flops / forward_flops_per_layer(**shape) - 1)
    return result


def main(repeats: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from pipeplan.jsonio import write_json

    rows = []
    for case in CASES:
        runs = []
        for _ in range(repeats):
            out = subprocess.run(
                [sys.executable, __file__, "--case", case], check=True, capture_output=True, text=True
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        row = dict(runs[0])
        row["profile_s"] = statistics.median(r["profile_s"] for r in runs)
        row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
        rows.append(row)
    table = Table(title=f"analytic profile (h100, batch 1, flash), median of {repeats} fresh processes")
    for column in ("case", "layers", "params", "profile s", "peak RSS MiB", "saved vs 34sbh", "FLOPs vs formula"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["case"],
            str(row["layers"]),
            f"{row['params'] / 1e9:.2f}B",
            f"{row['profile_s']:.2f}",
            f"{row['peak_rss_bytes'] / 2**20:.0f}",
            f"{row['saved_bytes_vs_34sbh_pct']:+.2f}%" if "saved_bytes_vs_34sbh_pct" in row else "-",
            f"{row['flops_vs_formula_pct']:+.2f}%" if "flops_vs_formula_pct" in row else "-",
        )
    Console().print(table)
    target = rows[0]
    ok = target["profile_s"] < TIME_TARGET_S and target["peak_rss_bytes"] < RSS_TARGET_BYTES
    print(f"target gpt-6.7b < {TIME_TARGET_S:.0f} s and < 2 GiB: {'met' if ok else 'MISSED'}")
    write_json(
        ROOT / "benchmarks" / "results" / "analytic.json",
        dict(
            schema_version=1,
            machine=platform.platform(),
            python=platform.python_version(),
            repeats=repeats,
            targets=dict(profile_s=TIME_TARGET_S, peak_rss_bytes=RSS_TARGET_BYTES),
            target_met=ok,
            results=rows,
        ),
    )


if __name__ == "__main__":
    if ARGS.case is not None:
        print(json.dumps(run_case(ARGS.case)))
    else:
        main(ARGS.repeats)
