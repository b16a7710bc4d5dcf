"""`pipeplan plan`'s options, declared once and checked before anything slow (profiling may take minutes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.console import warn
from pipeplan.errors import ConfigError
from pipeplan.graph.tracers import check_tracer
from pipeplan.options import argument, option
from pipeplan.profiling.profile_options import ATTENTION_HELP, check_attention
from pipeplan.schedules.registry import SCHEDULE_NAMES

DEFAULT_OUTPUT = "plan"
MODEL_HELP = "Built-in model, path/to/file.py:factory or package.module:factory."
RESERVE_HELP = (
    "Device memory kept free for what the model does not count (CUDA context, NCCL buffers, fragmentation), "
    "e.g. 2GiB or 0 (default: max(1GiB, 5% of device memory))."
)
PRECISION_HELP = (
    "fp32, bf16-mixed, fp16-mixed (CUDA) or bf16 (default: the profile's; on the spot bf16-mixed on cuda/meta, "
    "fp32 on cpu), e.g. --precision bf16-mixed."
)
ZERO_HELP = (
    "auto: the search tries ZeRO-1 beside 0 where stages have several holders and keeps it when it fits where 0 does "
    "not or is >2% faster; 1: shard the optimizer state over the ranks holding the same parameters; 0: off."
)
RECOMPUTE_HELP = (
    "auto: stages recompute activations (selective or full, the cheapest that fits) where memory needs it; none: never."
)
CONTEXT_HELP = (
    "Context-parallel ranks per tensor-parallel group (ring attention over the sequence): 1, N, or auto (analytic "
    "profiles: try 1,2,4,8). Plans with N > 1 are analytic."
)
EXPERT_HELP = (
    "Ranks the routed experts of a mixture-of-experts model are split over (of the DP x cp ranks): N, or auto "
    "(analytic MoE profiles: try 1,2,4,... dividing the experts; otherwise 1). Plans with N > 1 are analytic."
)
POST_VALIDATE_HELP = (
    "auto, on or off: predict steps whose optimizer step is post-validated (`run --post-validate`: each rank starts "
    "its next step at its own end) — auto where that shortens the period (synchronous schedules, ZeRO 0, the undo "
    "copy within memory)."
)
OVERLAP_HELP = (
    "Communication overlap as Megatron-Core runs it: none (its default), all, or a list of tensor, p2p, "
    "grad-reduce, param-gather, e.g. --overlap grad-reduce,p2p; sms=N: the SMs an overlapped tensor-parallel "
    "collective takes (default 8)."
)
LAYOUT_HELP = (
    'Plan exactly this layout (compared with the search\'s choice), e.g. "tp=2,pp=2,vp=2,dp=1,mbs=1,recompute=none" '
    "(keys: tp cp ep pp vp dp mbs recompute zero schedule split blocks; tp x cp x pp x dp = --devices)."
)
TRACER_HELP = "fx, export (torch.export) or auto: fx, else export (e.g. --tracer export)."
ASYNC_HELP = (
    "Also consider the asynchronous schedules pipedream and pipedream-2bw: no flush, but stale weights (they change "
    "what training computes; the summary says how stale)."
)
TENSOR_HELP = (
    "Devices per tensor-parallel group: auto (analytic profiles: try 1,2,4,8 dividing the devices per node; "
    "measured: 1) or N. Plans with N > 1 are analytic: `run` does not execute them."
)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    model: str | None = argument(None, help=MODEL_HELP)
    assignments: list[str] | None = option(None, "--arg", "-a", help="Model option key=value (repeatable).")
    profile: Path | None = option(None, "--profile", help="Plan from a profile file instead of a model.")
    profile_format: str = option("pipeplan", "--profile-format", help="pipeplan or pipedream (graph.txt).")
    devices: int | None = option(None, "--devices", "-n", help="Devices in all (default: local GPUs, or 2 on CPU).")
    devices_per_node: int | None = option(None, "--devices-per-node", help="Devices per node (default: min(N, 8)).")
    memory_per_device: str | None = option(None, "--memory-per-device", help="e.g. 80GiB (default: hardware/RAM).")
    memory_reserve: str | None = option(None, "--memory-reserve", help=RESERVE_HELP)
    hardware: str | None = option(None, "--hardware", help="Preset for links and memory (h100, a100-80gb, ...).")
    hardware_file: Path | None = option(None, "--hardware-file", help="JSON file adding presets (pipeplan calibrate).")
    device: str = option("cpu", "--device", help="Profile on cpu or cuda (measured) or meta (analytic).")
    global_batch_size: int | None = option(None, "--global-batch-size", "-B", help="Samples per step (default 4 x N).")
    microbatch_size: str | None = option(
        None, "--microbatch-size", "-b", help="b, or candidates like 1,2,4 (default: the profile's batch size, or 1)."
    )
    pipeline_depth: str | None = option(
        None, "--pipeline-depth", "-p", help="Devices per pipeline, or candidates like 2,4 (default: divisors of N)."
    )
    optimizer: str = option(
        "adamw", "--optimizer", help="adamw, sgd or sgd-nomomentum: its state, in --precision's dtype (memory)."
    )
    precision: str | None = option(None, "--precision", help=PRECISION_HELP)
    zero: str = option("auto", "--zero", help=ZERO_HELP)
    recompute: str = option("auto", "--recompute", help=RECOMPUTE_HELP)
    tensor_parallel: str = option("auto", "--tensor-parallel", "-t", help=TENSOR_HELP)
    context_parallel: str = option("1", "--context-parallel", help=CONTEXT_HELP)
    expert_parallel: str = option("auto", "--expert-parallel", help=EXPERT_HELP)
    overlap: str = option("none", "--overlap", help=OVERLAP_HELP)
    post_validate: str = option("auto", "--post-validate", help=POST_VALIDATE_HELP)
    layout: str | None = option(None, "--layout", help=LAYOUT_HELP)
    schedule: str = option("auto", "--schedule", "-s", help=f"auto or one of: {', '.join(SCHEDULE_NAMES)}.")
    allow_async: bool = option(False, "--allow-async", help=ASYNC_HELP)
    no_replication: bool = option(False, "--no-replication", help="Do not try replicated stages.")
    granularity: int | None = option(None, "--granularity", help="Layer grouping depth when tracing the model.")
    tracer: str = option("auto", "--tracer", help=TRACER_HELP)
    attention: str = option("auto", "--attention", help=ATTENTION_HELP)
    output: str | None = option(DEFAULT_OUTPUT, "--output", "-o", help="Directory for plan.json and scripts.")
    json_output: bool = option(False, "--json", help="Print only the summary as JSON.")

    def __post_init__(self) -> None:
        # here, not at the top: `pipeplan --help` imports this file, and these import the search (numpy)
        from pipeplan.costs.overlap import Overlap
        from pipeplan.plan.asynchronous import searched_schedules
        from pipeplan.search.inputs import check_plan_options
        from pipeplan.search.pinned import parse_layout
        from pipeplan.search.tensor_search import AUTO, parse_tensor_parallel

        check_plan_options(
            schedule=self.schedule, precision=self.precision, output=self.output, granularity=self.granularity
        )
        if self.model is None and self.profile is None:
            raise ConfigError("give MODEL (e.g. gpt), --profile FILE, or both (the model's graph, the file's costs)")
        if self.profile is not None:
            without_model = self.model is None
            flags = ("-a", self.assignments), ("--granularity", self.granularity), ("--device", self.device != "cpu")
            flags += (("--attention", self.attention != "auto"),)
            ignored = [
                flag for flag, given in flags if given and (without_model or flag in ("--device", "--attention"))
            ]
            if ignored:
                warn(f"{', '.join(ignored)} ignored: --profile plans with the file's costs")
        check_tracer(self.tracer)
        check_attention(self.attention, self.device if self.profile is None else "meta")  # ('' is no mode either)
        if self.schedule != "auto":  # an asynchronous one without --allow-async (or with --zero 1): refused here
            searched_schedules((self.schedule,), allow_async=self.allow_async, zero=self.zero)
        Overlap.parse(self.overlap)
        if self.layout is not None:
            pinned = parse_layout(self.layout)  # its schedule, like --schedule's: asynchronous only with --allow-async
            searched_schedules((pinned.schedule_name,), allow_async=self.allow_async, zero=self.zero)
        for flag, text in (
            ("--tensor-parallel", self.tensor_parallel),
            ("--context-parallel", self.context_parallel),
            ("--expert-parallel", self.expert_parallel),
        ):
            size = parse_tensor_parallel(text, option=flag)
            if size != AUTO and size > 1 and self.profile is None and self.device != "meta":
                raise ConfigError(
                    f"{flag} {size} plans analytically: profile with --device meta --hardware NAME (or give an "
                    "analytic --profile)"
                )
