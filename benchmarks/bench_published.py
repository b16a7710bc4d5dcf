"""Predicted against measured step times of published training runs, through the commands a user types: each row is
one `pipeplan capacity MODEL ... --layout ... --json` subprocess, its pinned layout's predicted step against the
run's measured one. Prints a table per source, writes results/published.json (per row: the command, measured and
predicted seconds, their ratio, MFU, the compute breakdown, or why the layout is refused; per source: mean and
worst absolute error, rows refused).

Sources (each row's layout, batch, precision and overlap are the run's own; what a row approximates is in its note):

- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, Table 5:
  A100 80 GB on Selene, fp16 with fp32 main weights (Megatron-LM of 2022: `fp16-main`, no distributed optimizer:
  zero=0), GPT-3-style models (tied embeddings, dropout 0.1), sequence 2048, vocabulary 51,200, one data-parallel
  pipeline, measured seconds per iteration with full recomputation (plain tensor parallelism) and with sequence
  parallelism + selective recomputation; no communication overlap (Megatron-LM 2022 had none of Megatron-Core's).
  Those runs used Megatron's math attention (no FlashAttention): their commands pass `--attention math`
  (`Row.attention`, set in one place: `korthikanti_rows`).
- NVIDIA DGX Cloud benchmarking recipes v25.01.1 (github.com/NVIDIA/dgxc-benchmarking, tag v25.01.1: llama3.1/,
  nemo_megatron/, nemotron/ READMEs and their YAML configs), H100 80 GB, NeMo with Transformer Engine, measured
  step seconds. Every recipe: distributed_fused_adam with bf16 gradient reduction (`-bf16grads` precisions,
  ZeRO-1), overlapped gradient reduce-scatter and parameter all-gather; tensor-parallel overlap where the recipe
  sets ub_tp_comm_overlap, p2p overlap where it sets overlap_p2p_comm. Nemotron-4's layernorm1p and partial rotary
  are approximated by the built-in llama's RMSNorm and full rotary (`-a mlp=relu2`: its squared-ReLU MLP).

Run: .venv/bin/python benchmarks/bench_published.py [--source korthikanti|nemo] [--rows NAME,...]
(7 s to 2 minutes per row on a 2-core machine, about 10 minutes in all; --rows runs a subset and writes nothing).
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--source", choices=("korthikanti", "nemo"), help="one source only (writes nothing)")
    parser.add_argument("--rows", help="comma-separated row names to run (writes nothing)")


if __name__ == "__main__":  # first of all: --help answers before anything heavy is imported
    ARGS = parse_args(__doc__, _options)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "published.json"
PIPEPLAN = shutil.which("pipeplan", path=str(Path(sys.executable).parent)) or "pipeplan"
TARGET_MEAN, TARGET_WORST = 0.05, 0.10  # issue 34's "Done when", per source


@dataclass(frozen=True)
class Row:
    source: str
    name: str
    model: str
    options: dict
    hardware: str
    layout: str
    batch: int
    precision: str
    overlap: str
    measured_s: float
    note: str = ""
    attention: str = "auto"  # --attention (auto: what the model and GPU run, FlashAttention here)
    optimizer: str = "adamw"  # --precision MODE,OPTIMIZER: the optimizer-state precision the run's config states


GPT = dict(vocab=51200, seq=2048, tie_embeddings="true", dropout=0.1)  # GPT-3-style (Korthikanti; NeMo's GPT-3)
K_MODELS = {"22B": (6144, 48, 64), "175B": (12288, 96, 96), "530B": (20480, 105, 128), "1T": (25600, 128, 160)}
# name: tensor x pipeline (x interleave) layout, global batch, measured seconds full / selective (Table 5)
K_RUNS = {
    "22B": ("tp=8,pp=1,dp=1,mbs=4,zero=0", 4, 1.42, 1.10),
    "175B": ("tp=8,pp=8,vp=3,dp=1,mbs=1,zero=0", 64, 18.13, 13.75),
    "530B": ("tp=8,pp=35,vp=3,dp=1,mbs=1,zero=0", 280, 49.05, 37.83),
    "1T": ("tp=8,pp=64,vp=1,dp=1,mbs=1,zero=0", 512, 94.42, 71.49),
}
LLAMA3 = dict(vocab=128256, seq=8192)
L8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, **LLAMA3)
L70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, **LLAMA3)
# 405B as the recipe ran it (NeMo Framework Launcher conf/training/llama/llama3_1_405b.yaml, the config its launch
# script reads: num_query_groups 16, where the released model has 8; the recipe README: "Llama3.1 405B uses the
# GPT2BPETokenizer as a proxy" on mock data, so 50,257 tokens padded to a multiple of 128 x TP 8: 51,200)
L405B = dict(layers=126, hidden=16384, heads=128, kv_heads=16, intermediate=53248, vocab=51200, seq=8192)
# NeMo's GPT-3 175B as the recipe ran it (nemo_megatron/gpt3_175b_hydra.yaml): dropout 0.1, tied embeddings, the
# GPT2BPETokenizer's 50,257 tokens padded to a multiple of 128 x TP 4: 50,688
GPT3 = dict(layers=96, hidden=12288, heads=96, **{**GPT, "vocab": 50688})
N15B = dict(layers=32, hidden=6144, heads=48, kv_heads=8, intermediate=24576, vocab=256000, seq=4096, mlp="relu2")
N340B = dict(layers=96, hidden=18432, heads=96, kv_heads=8, intermediate=73728, vocab=256000, seq=4096, mlp="relu2")
# Optimizer-state precision where a recipe's YAML states it: nemotron/nemotron4-340b-synth.yaml sets
# `optim: {name: distributed_fused_adam, dtype: bf16}` (apex DistributedFusedAdam: the state, main copy included, in
# bf16); the other recipes keep the fp32 default (nemotron4-15b: mcore_distributed_optim).
NEMO_OPTIMIZER_STATE = {"Nemotron4-340B@128": "adamw-bf16state"}
# Attention kernels where a recipe's launch script chooses them: the GPT-3 175B script (DGX Cloud benchmarking
# recipes, NeMo 24.05 container, the one these GPT-3 rows ran; GSW 24.11's llm/nemo-megatron launch.sh) exports
# NVTE_FUSED_ATTN=0, which turns Transformer Engine's cuDNN attention off: it runs flash-attn's FlashAttention-2
# (`--attention flash2`); the Llama and Nemotron recipes keep Transformer Engine's default (cuDNN on Hopper).
NEMO_ATTENTION = {"GPT3-175B@128": "flash2", "GPT3-175B@2048": "flash2"}
ALL, NO_P2P, NO_TP = "all", "tensor,grad-reduce,param-gather", "grad-reduce,param-gather"
# Llama 3.1 405B's userbuffers config (the launcher's llama3_1_405b.yaml defaults to tp_overlap
# ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192; its fp8 twin differs in fc2_dgrad and fp8_buf): the ring
# exchanges `aggregate: 1` (Transformer Engine's split_overlap_ag then runs t / 2 = 4 matmuls of two chunks each)
# and the reduce-scatters `method: pipeline, num_splits: 4`: each overlapped linear runs as 4 matmuls, not t = 8
ALL4 = "all,chunks=4"


def korthikanti_rows() -> list[Row]:
    rows = []
    for name, (hidden, layers, heads) in K_MODELS.items():
        layout, batch, full_s, selective_s = K_RUNS[name]
        options = dict(layers=layers, hidden=hidden, heads=heads, **GPT)
        for mode, measured in (("full", full_s), ("selective", selective_s)):
            layout_mode = f"{layout},recompute={mode}"
            rows.append(
                Row(
                    "korthikanti",
                    f"{name} {mode}",
                    "gpt",
                    options,
                    "a100-80gb",
                    layout_mode,
                    batch,
                    "fp16-main",
                    "none",
                    measured,
                    attention="math",  # Megatron-LM of 2022: no FlashAttention
                )
            )
    return rows


def nemo_rows() -> list[Row]:
    """DGXC v25.01.1 (H100): the smallest published scale of each recipe, GPT-3 at its largest too (11 rows)."""
    runs = [
        ("Llama3.1-8B@8", "llama", L8B, "tp=1,cp=2,pp=1,dp=4,mbs=1,zero=1", 128, ALL, 12.91, 9.67, ""),
        ("Llama3.1-70B@64", "llama", L70B, "tp=4,cp=2,pp=4,vp=5,dp=2,mbs=1,zero=1", 128, ALL, 14.72, 11.01, ""),
        ("Llama3.1-405B@576", "llama", L405B, "tp=8,cp=2,pp=9,vp=7,dp=4,mbs=1,zero=1", 252, ALL4, 17.20, 11.24, ""),
        ("GPT3-175B@128", "gpt", GPT3, "tp=4,pp=8,vp=12,dp=4,mbs=1,zero=1", 256, ALL, 8.91, 5.92, ""),
        ("GPT3-175B@2048", "gpt", GPT3, "tp=4,pp=8,vp=12,dp=64,mbs=1,zero=1", 4096, ALL, 9.02, None, ""),
        ("Nemotron4-15B@16", "llama", N15B, "tp=4,pp=1,dp=4,mbs=4,zero=1", 64, NO_P2P, 2.83, None, "approx"),
        (
            "Nemotron4-340B@128",
            "llama",
            N340B,
            "tp=8,pp=8,vp=12,dp=2,mbs=1,zero=1,recompute=selective",
            32,
            NO_TP,
            4.61,
            None,
            "approx",
        ),
    ]
    rows = []
    for name, model, options, layout, batch, overlap, bf16_s, fp8_s, note in runs:
        for precision, measured in (("bf16-main-bf16grads", bf16_s), ("fp8-bf16grads", fp8_s)):
            if measured is not None:
                label = f"{name} {precision.split('-')[0]}"
                row = Row("nemo", label, model, options, "h100", layout, batch, precision, overlap, measured, note)
                optimizer = NEMO_OPTIMIZER_STATE.get(name, row.optimizer)
                rows.append(replace(row, optimizer=optimizer, attention=NEMO_ATTENTION.get(name, row.attention)))
    return rows


def command(row: Row) -> list[str]:
    precision = row.precision if row.optimizer == "adamw" else f"{row.precision},{row.optimizer}"
    options = [part for key, value in row.options.items() for part in ("-a", f"{key}={value}")]
    return [
        *(PIPEPLAN, "capacity", row.model, *options, "--hardware", row.hardware, "-B", str(row.batch)),
        *("--precision", precision, "--overlap", row.overlap, "--layout", row.layout),
        *(("--attention", row.attention) if row.attention != "auto" else ()),
        "--json",
    ]


def run_row(row: Row) -> dict:
    args = command(row)
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = dict(
        source=row.source,
        name=row.name,
        command=" ".join(["pipeplan", *args[1:]]),
        measured_s=row.measured_s,
        note=row.note,
        attention=row.attention,
        wall_s=wall,
    )
    if done.returncode:
        return {**found, "predicted_s": None, "reason": done.stderr.strip().splitlines()[-1] if done.stderr else "?"}
    report = json.loads(done.stdout)
    pinned, planner = report["pinned"], report.get("planner") or {}
    step = pinned.get("step_ms")
    predicted = step / 1e3 if step else None
    return {
        **found,
        "predicted_s": predicted,
        "ratio": predicted / row.measured_s if predicted else None,
        "mfu": pinned.get("mfu"),
        "reason": pinned.get("reason", "") if not predicted else "",
        "compute_breakdown": pinned.get("compute_breakdown"),
        "time": pinned.get("time"),
        "planner_s": planner["step_ms"] / 1e3 if planner.get("step_ms") else None,
    }


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["ratio"] - 1.0) for r in rows if r.get("ratio")]
    refused = [r["name"] for r in rows if not r.get("ratio")]
    return dict(
        rows=len(rows),
        predicted=len(errors),
        refused=refused,
        mean_abs_error=statistics.mean(errors) if errors else None,
        worst_abs_error=max(errors) if errors else None,
        met=bool(errors) and not refused and statistics.mean(errors) <= TARGET_MEAN and max(errors) <= TARGET_WORST,
    )


def gpt3_mfu(rows: list[dict]) -> dict | None:
    """GPT-3 175B on 128 H100 (BF16): pipeplan's predicted MFU against the measured run's, both in pipeplan's FLOP
    count (the measured MFU is the predicted one x predicted / measured step), and NVIDIA's published 49.93%."""
    row = next((r for r in rows if r["name"] == "GPT3-175B@128 bf16" and r.get("ratio")), None)
    if row is None:
        return None
    measured = row["mfu"] * row["ratio"]
    return dict(predicted=row["mfu"], measured=measured, points=100 * (row["mfu"] - measured), published=0.4993)


def main(args) -> int:
    rows = [r for r in korthikanti_rows() + nemo_rows() if args.source in (None, r.source)]
    if args.rows:
        rows = [r for r in rows if r.name in args.rows.split(",")]
    found = []
    for row in rows:
        found.append(run_row(row))
        _print_row(found[-1])
    sources = sorted({r["source"] for r in found})
    summaries = {source: summary([r for r in found if r["source"] == source]) for source in sources}
    for source, result in summaries.items():
        print(f"{source}: {_summary_line(result)}")
    mfu = gpt3_mfu(found)
    if mfu:
        print(f"GPT-3 175B@128 bf16 MFU: predicted {mfu['predicted']:.1%}, measured {mfu['measured']:.1%}")
    if args.source or args.rows:
        return 0
    payload = dict(schema_version=2, machine=platform.node(), rows=found, summary=summaries, gpt3_mfu=mfu)
    RESULTS.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if all(s["met"] for s in summaries.values()) else 1


def _print_row(row: dict) -> None:
    if row.get("ratio"):
        what = f"predicted {row['predicted_s']:7.2f} s  ratio {row['ratio']:.3f}  MFU {row['mfu']:.1%}"
    else:
        what = f"refused: {row['reason'][:100]}"
    print(f"{row['source']:12s} {row['name']:28s} measured {row['measured_s']:6.2f} s  {what}  ({row['wall_s']:.0f} s)")


def _summary_line(result: dict) -> str:
    if result["mean_abs_error"] is None:
        return f"no row predicted ({len(result['refused'])} refused)"
    refused = f", refused: {', '.join(result['refused'])}" if result["refused"] else ""
    return (
        f"mean |error| {result['mean_abs_error']:.1%} (target <= {TARGET_MEAN:.0%}), worst "
        f"{result['worst_abs_error']:.1%} (<= {TARGET_WORST:.0%}), {result['predicted']} of {result['rows']} "
        f"predicted{refused}"
    )


if __name__ == "__main__":
    sys.exit(main(ARGS))
