"""Held-out check of the mixture-of-experts cost model against DeepSeek-V3's published training run (DeepSeek-AI,
"DeepSeek-V3 Technical Report", 2024, §3): 2048 H800 GPUs, PP16, EP64, ZeRO-1 data parallelism, no tensor
parallelism, FP8, 180K H800 GPU-hours per trillion tokens (1e12 / (180e3 x 3600) = 1543 tokens/s per GPU).

pipeplan predicts the pinned-like layout with `pipeplan capacity deepseek-v3 --precision fp8 -t 1 --expert-parallel
64 --zero 1` on 2048 devices of the `h100` preset (H800: H100 compute, NVLink 400 GB/s instead of 900: pipeplan
has no h800 preset yet, so this is optimistic on the intra-node link). Not modelled: DualPipe's overlap of the
all-to-all with compute (here exposed), MLA (standard attention of about its parameter count), node-limited routing
and the multi-token-prediction module. Prints the predicted tokens/s/GPU and its ratio to 1543; not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

PUBLISHED_TOKENS_PER_S_PER_GPU = 1e12 / (180e3 * 3600)
DEVICES = 2048
COMMAND = [
    *(sys.executable, "-m", "pipeplan", "capacity", "deepseek-v3", "--hardware", "h100"),
    *("--devices", str(DEVICES), "--precision", "fp8", "-t", "1", "--context-parallel", "1"),
    *("--expert-parallel", "64", "--zero", "1", "-B", "15360", "--json"),
]


def main() -> None:
    start = time.perf_counter()
    done = subprocess.run(COMMAND, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    report = json.loads(done.stdout)
    row = (report.get("rows") or report["report"]["rows"])[0]
    per_gpu = row["tokens_per_s"] / DEVICES
    print(f"layout: {row['schedule']} {row['pipeline_devices']}x{row['data_parallel']} ep={row['expert_parallel']}")
    print(
        f"predicted {per_gpu:,.0f} tokens/s/GPU vs published {PUBLISHED_TOKENS_PER_S_PER_GPU:,.0f}: ratio "
        f"{per_gpu / PUBLISHED_TOKENS_PER_S_PER_GPU:.2f}; CLI wall {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
