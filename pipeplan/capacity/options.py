"""`pipeplan capacity`'s options, declared once and checked before the (slow) analytic profile."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import ConfigError
from pipeplan.options import argument, option
from pipeplan.paths import check_output_file
from pipeplan.profiling.profile_options import ATTENTION_HELP, check_attention
from pipeplan.search.plan_options import RECOMPUTE_HELP, ZERO_HELP
from pipeplan.units import parse_count

CAPACITY_PRECISION = "bf16-main"  # capacity's default: Megatron's mixed precision, as production runs hold it
MODEL_HELP = "Built-in model name, path/to/file.py:factory or package.module:factory."
OPTIMIZER_HELP = "adamw (its bytes follow --precision: 18 B/param under bf16-main), sgd, sgd-nomomentum."
RESERVE_HELP = "Device memory kept free, e.g. 2GiB (default: max(1GiB, 5%)), as in plan."
TENSOR_HELP = "auto (try 1,2,4,8 dividing the devices per node; transformer stacks) or a size t, e.g. 1."
CONTEXT_HELP = "A size cp (default 1), or auto: try 1,2,4,8 where the sequence splits (ring attention; a slower sweep)."
EXPERT_HELP = "A size ep, or auto (default): MoE models try 1,2,...,64 dividing the experts (dense models: 1)."
INTERLEAVE_HELP = "Chunks per device the interleaved schedule is tried with, e.g. 2,3,4."
PRECISION_HELP = (
    "bf16-main (Megatron: bf16 weights, fp32 gradients and main weights: 18 B/param, the default), fp16-main, fp8 "
    "(Transformer Engine linears), bf16-mixed (autocast, as `pipeplan run`), bf16."
)
OVERLAP_HELP = (
    "none (Megatron-Core's default), all, or tensor,p2p,grad-reduce,param-gather; sms=N: the SMs an overlapped "
    "tensor-parallel collective takes (default 8)."
)
LAYOUT_HELP = (
    'Predict one layout exactly beside the planner\'s choice, e.g. "tp=8,cp=2,pp=9,vp=7,dp=4,mbs=1,recompute=none" '
    "(keys: tp cp ep pp vp dp mbs recompute zero schedule split blocks, e.g. blocks=3/4/4/3)."
)
PLOT_HELP = "Write MFU and memory vs devices per tensor-parallel size, and MFU per schedule (PNG)."


@dataclass(frozen=True, kw_only=True)
class CapacityOptions:
    model: str = argument(help=MODEL_HELP)
    assignments: list[str] | None = option(None, "--arg", "-a", help="Model option key=value (repeatable).")
    hardware: str = option(..., "--hardware", help="Hardware preset (h100, h200, a100-80gb, b200, ...).")
    hardware_file: Path | None = option(None, "--hardware-file", help="JSON file adding or overriding presets.")
    devices: str | None = option(None, "--devices", "-n", help="Device counts to plan for, e.g. 8,64,512.")
    devices_per_node: int = option(8, "--devices-per-node", help="Devices per node.")
    global_batch_size: int | None = option(None, "--global-batch-size", "-B", help="Samples per step (~1M tokens).")
    microbatch_size: str = option("1", "--microbatch-size", "-b", help="b, or candidates like 1,2.")
    seq: int | None = option(None, "--seq", help="Sequence length (replaces the model's seq option).")
    target_tokens: str | None = option(None, "--target-tokens", help="Tokens to train on, e.g. 1T (with --days).")
    days: float | None = option(None, "--days", help="Days the training may take (with --target-tokens).")
    schedule: str = option("auto", "--schedule", "-s", help="auto (all but zb-auto), all, or names a,b.")
    optimizer: str = option("adamw", "--optimizer", help=OPTIMIZER_HELP)
    replication: bool = option(False, "--replication", help="Also try replicated stages (slow).")
    allow_async: bool = option(
        False, "--allow-async", help="Also plan the asynchronous pipedream and pipedream-2bw (stale weights)."
    )
    tensor_parallel: str = option("auto", "--tensor-parallel", "-t", help=TENSOR_HELP)
    context_parallel: str = option("1", "--context-parallel", help=CONTEXT_HELP)
    expert_parallel: str = option("auto", "--expert-parallel", help=EXPERT_HELP)
    interleave: str = option("2,3,4", "--interleave", help=INTERLEAVE_HELP)
    precision: str = option(CAPACITY_PRECISION, "--precision", help=PRECISION_HELP)
    attention: str = option("auto", "--attention", help=ATTENTION_HELP)
    overlap: str = option("none", "--overlap", help=OVERLAP_HELP)
    layout: str | None = option(None, "--layout", help=LAYOUT_HELP)
    recompute: str = option("auto", "--recompute", help=RECOMPUTE_HELP)
    zero: str = option("auto", "--zero", help=ZERO_HELP)
    plot: str | None = option(None, "--plot", help=PLOT_HELP)
    memory_reserve: str | None = option(None, "--memory-reserve", help=RESERVE_HELP)
    json_output: bool = option(False, "--json", help="Print only JSON (rows and the answer).")

    def __post_init__(self) -> None:
        check_attention(self.attention, "meta")
        if self.devices is None and self.layout is None:
            raise ConfigError("give --devices (counts to plan for, e.g. 8,64) or --layout")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.days is not None and not (math.isfinite(self.days) and self.days > 0):
            raise ConfigError(f"--days must be a finite number > 0, got {self.days}")
        if self.target_tokens is not None and not parse_count(self.target_tokens, option="--target-tokens") > 0:
            raise ConfigError(f"--target-tokens must be > 0, got {self.target_tokens!r}")
        if self.plot is not None:  # checked, and the path kept as it will be written (~ expanded)
            object.__setattr__(self, "plot", str(check_output_file(self.plot, "--plot")))
            if not self.plot.lower().endswith(".png"):
                raise ConfigError(f"--plot {self.plot!r} must name a .png file")
