"""Held-out check of the mixture-of-experts cost model against DeepSeek-V3's published training run (DeepSeek-AI,
"DeepSeek-V3 Technical Report", 2024, §3): 2048 H800 GPUs, PP16, EP64, ZeRO-1 data parallelism (dp 128), no tensor
parallelism, FP8, global batch 15360 sequences of 4096 tokens, 180K H800 GPU-hours per trillion tokens (1e12 /
(180e3 x 3600) = 1543 tokens/s per GPU).

pipeplan predicts the pinned layout `tp=1,pp=16,dp=128,ep=64,zero=1` on 2048 devices of the `h800` preset with
`pipeplan capacity deepseek-v3 --hardware h800 --precision fp8 -B 15360 --layout ...`, beside the planner's own
choice (ep auto), with full recomputation under 1F1B (pipeplan's selective recomputation, the attention core, does not
fit: DeepSeek recomputes RMSNorm and the MLA up-projections and keeps DualPipe's fewer microbatches in flight). Not
modelled: DualPipe's overlap of the all-to-all with compute (here exposed), FlashAttention-3's MLA kernel (MLA
runs as the memory-efficient kernel PyTorch's SDPA takes for its two head sizes), node-limited routing (at most
4 nodes per token) and the multi-token-prediction module. Prints the predicted tokens/s/GPU and its ratio to 1543
and writes them to results/moe_published.json; not a test.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from arguments import parse_args

if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    parse_args(__doc__)

RESULTS = Path(__file__).resolve().parent / "results" / "moe_published.json"
PUBLISHED_TOKENS_PER_S_PER_GPU = 1e12 / (180e3 * 3600)
DEVICES = 2048
LAYOUT = "tp=1,cp=1,pp=16,dp=128,ep=64,mbs=1,zero=1,recompute=full"
COMMAND = [
    *(sys.executable, "-m", "pipeplan", "capacity", "deepseek-v3", "--hardware", "h800", "--precision", "fp8"),
    *("-t", "1", "--context-parallel", "1", "-B", "15360", "--layout", LAYOUT, "--json"),
]


def _line(name: str, row: dict) -> str:
    if row.get("tokens_per_s") is None:
        return f"{name}: does not fit ({row.get('reason', '')})"
    per_gpu = row["tokens_per_s"] / DEVICES
    return (
        f"{name}: {row['schedule']} {row['pipeline_devices']}x{row['data_parallel']} ep={row['expert_parallel']} "
        f"m={row['num_microbatches']}: {row['step_ms'] / 1e3:,.1f} s/step, {per_gpu:,.0f} tokens/s/GPU "
        f"({per_gpu / PUBLISHED_TOKENS_PER_S_PER_GPU:.2f} of the published {PUBLISHED_TOKENS_PER_S_PER_GPU:,.0f})"
    )


def main() -> None:
    start = time.perf_counter()
    done = subprocess.run(COMMAND, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    report = json.loads(done.stdout)
    print(_line(f"pinned {LAYOUT}", report["pinned"]))
    print(_line("planner (ep auto)", report["planner"]))
    print(f"CLI wall {wall:.1f} s")
    rows = {"pinned": report["pinned"], "planner": report["planner"]}
    payload = dict(
        schema_version=1,
        machine=platform.node(),
        command=" ".join(COMMAND[1:]),
        published_tokens_per_s_per_gpu=PUBLISHED_TOKENS_PER_S_PER_GPU,
        predicted_tokens_per_s_per_gpu={
            name: (row["tokens_per_s"] / DEVICES if row.get("tokens_per_s") is not None else None)
            for name, row in rows.items()
        },
        rows=rows,
        cli_wall_s=wall,
    )
    RESULTS.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(RESULTS.parents[2])}")


if __name__ == "__main__":
    main()
