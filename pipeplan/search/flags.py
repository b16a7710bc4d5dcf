"""The flags `pipeplan plan` and `pipeplan capacity` share, declared once with one default each (`SearchFlags`, the
base of both commands' options), and what their values mean (`parse_*`: one ConfigError line naming the flag).

- `--precision MODE[,OPTIMIZER]`: the precision mode and the optimizer whose state the memory counts (either may
  come alone: `bf16-main`, `sgd`, `bf16-mixed,sgd`).
- `--parallel KEY=VALUE,...`: what the search tries per parallelism degree, the keys of `--layout`: tp, cp, ep
  (auto or N), pp and vp (auto, or candidates joined by `/`: `pp=2/4`), replicate (auto, on, off).
- `--memory [SIZE,]KEY=VALUE,...`: a device's memory (SIZE) and what plans fit in it: reserve=SIZE (kept free),
  zero (auto, 0, 1: ZeRO-1), recompute (auto, none).
- `-s/--schedule WORD,...`: auto (the command's synchronous schedules), all (every schedule), async (the asynchronous
  ones: stale weights), or names.

This module imports no numpy or torch (`pipeplan --help` reads it); the parsers import what they check lazily."""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError
from pipeplan.options import option
from pipeplan.profiling.profile_options import ATTENTION_HELP, check_attention
from pipeplan.units import parse_size

AUTO = "auto"
PARALLEL_KEYS = ("tp", "cp", "ep", "pp", "vp", "replicate")
MEMORY_KEYS = ("reserve", "zero", "recompute")
REPLICATE_CHOICES = (AUTO, "on", "off")

PRECISION_HELP = (
    "MODE[,OPTIMIZER]: fp32, bf16-mixed, fp16-mixed (CUDA), bf16, or analytic bf16-main (Megatron), fp16-main, fp8; "
    "optimizer adamw (default), sgd, sgd-nomomentum. Default: the profile's mode (on the spot: fp32 on cpu, "
    "bf16-mixed on cuda, bf16-main analytic), e.g. --precision bf16-mixed,sgd."
)
PARALLEL_HELP = (
    "What the search tries: tp (devices per tensor-parallel group), cp (context-parallel groups), ep (ranks the "
    "experts split over): auto or N; pp (devices per pipeline), vp (interleaved chunks per device): auto or N/M/..; "
    "replicate: auto, on, off (PipeDream's replicated stages). Defaults tp=auto (analytic profiles: 1,2,4,8; "
    "measured: 1), cp=1, ep=auto, pp=auto (every divisor), vp=auto (plan 2, capacity 2/3/4), replicate=auto (plan on, "
    'capacity off), e.g. --parallel "tp=2,pp=2/4". t, cp, ep > 1 plan analytically.'
)
MEMORY_HELP = (
    "A device's memory and how plans fit: SIZE (default: --hardware's, else this machine's RAM per device), "
    "reserve=SIZE kept free for what the model does not count (default max(1GiB, 5%)), zero=auto|0|1 (ZeRO-1: auto "
    "tries it where stages have several holders), recompute=auto|none, e.g. --memory 80GiB,reserve=6GiB,zero=1."
)
SCHEDULE_HELP = (
    "auto (the synchronous schedules; capacity: all but zb-auto), all (every schedule), async (the asynchronous "
    "pipedream, pipedream-2bw: stale weights), or names, comma-separated, e.g. -s zbv or -s auto,async."
)
OVERLAP_HELP = (
    "Communication overlap as Megatron-Core runs it: none (its default), all, or a list of tensor, p2p, "
    "grad-reduce, param-gather, e.g. --overlap grad-reduce,p2p; sms=N: the SMs an overlapped tensor-parallel "
    "collective takes (default 8), e.g. --overlap tensor,sms=16; chunks=N: the matmuls an overlapped linear runs "
    "as (default t: Transformer Engine's ring exchange; t/2 with its aggregate option), e.g. --overlap all,chunks=4."
)
LAYOUT_HELP = (
    "Exactly this layout (plan: its plan, no search; capacity: predicted beside the search's choice), e.g. "
    '"tp=2,pp=2,vp=2,dp=1,mbs=1,recompute=none" (keys: tp cp ep pp vp dp mbs recompute zero schedule split '
    "blocks, e.g. blocks=3/4/4/3; tp x cp x pp x dp = the devices)."
)
HARDWARE_HELP = "A preset (h100, a100-80gb, ...) or FILE.json[:NAME] from `pipeplan calibrate`: links, memory, rates."


@dataclass(frozen=True, kw_only=True)
class SearchFlags:
    """The flags `plan` and `capacity` share (their options dataclasses derive from it)."""

    assignments: list[str] | None = option(None, "--arg", "-a", help="Model option key=value (repeatable).")
    hardware: str | None = option(None, "--hardware", help=HARDWARE_HELP)
    global_batch_size: int | None = option(
        None, "--global-batch-size", "-B", help="Samples per step (default: plan 4 x devices, capacity ~1M tokens)."
    )
    microbatch_size: str | None = option(
        None, "--microbatch-size", "-b", help="b, or candidates like 1,2,4 (default: the profile's batch size, or 1)."
    )
    precision: str | None = option(None, "--precision", help=PRECISION_HELP)
    parallel: str | None = option(None, "--parallel", help=PARALLEL_HELP)
    memory: str | None = option(None, "--memory", help=MEMORY_HELP)
    schedule: str = option(AUTO, "--schedule", "-s", help=SCHEDULE_HELP)
    overlap: str = option("none", "--overlap", help=OVERLAP_HELP)
    attention: str = option(AUTO, "--attention", help=ATTENTION_HELP)
    layout: str | None = option(None, "--layout", help=LAYOUT_HELP)
    json_output: bool = option(False, "--json", help="Print only the summary as JSON.")

    def __post_init__(self) -> None:
        """Every shared value checked before anything slow (profiling may take minutes)."""
        from pipeplan.costs.overlap import Overlap
        from pipeplan.search.pinned import parse_layout

        parse_precision(self.precision)
        parse_parallel(self.parallel)
        parse_memory(self.memory)
        parse_schedules(self.schedule, ())
        Overlap.parse(self.overlap)
        check_attention(self.attention, "meta")  # a known mode (plan also refuses it for a measured profile)
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.layout is not None:
            parse_layout(self.layout)


def parse_precision(text: str | None) -> tuple[str | None, str]:
    """`--precision`'s (mode or None: the profile's / the device's, optimizer) — each word is a mode or an optimizer."""
    from pipeplan.costs.optimizer import OPTIMIZER_NAMES
    from pipeplan.precision import PRECISIONS

    mode, optimizer = None, "adamw"
    for word in _words(text, "--precision"):
        if word in PRECISIONS and mode is None:
            mode = word
        elif word in OPTIMIZER_NAMES and optimizer == "adamw":
            optimizer = word
        else:
            raise ConfigError(
                f"--precision {text!r}: {word!r} is not a precision mode ({', '.join(PRECISIONS)}) or an optimizer "
                f"({', '.join(OPTIMIZER_NAMES)}), or is given twice"
            )
    return mode, optimizer


@dataclass(frozen=True, kw_only=True)
class ParallelChoice:
    """`--parallel`: per degree, auto or the size(s) the search tries."""

    tensor: str | int = AUTO
    context: str | int = 1
    expert: str | int = AUTO
    pipeline: tuple[int, ...] | None = None  # None: every divisor of the devices
    interleave: tuple[int, ...] | None = None  # None: the command's
    replicate: str = AUTO

    def replication(self, auto: bool) -> bool:
        """Whether replicated stages are tried (`auto`: the command's choice)."""
        return auto if self.replicate == AUTO else self.replicate == "on"


def parse_parallel(text: str | None) -> ParallelChoice:
    values: dict[str, object] = {}
    for key, value in _pairs(text, "--parallel", PARALLEL_KEYS):
        if key == "replicate":
            if value not in REPLICATE_CHOICES:
                raise ConfigError(f"--parallel replicate={value!r} must be one of {', '.join(REPLICATE_CHOICES)}")
            values["replicate"] = value
        elif key in ("pp", "vp"):
            values[key] = None if value == AUTO else _sizes(value, f"--parallel {key}")
        else:
            values[key] = AUTO if value == AUTO else _sizes(value, f"--parallel {key}", single=True)[0]
    names = dict(tp="tensor", cp="context", ep="expert", pp="pipeline", vp="interleave", replicate="replicate")
    return ParallelChoice(**{names[key]: value for key, value in values.items()})  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class MemoryChoice:
    """`--memory`: a device's memory (None: the hardware's or this machine's), the reserve (None: the default), and
    the memory options the search may use."""

    per_device: int | None = None
    reserve: int | None = None
    zero: int | str = AUTO
    recompute: str = AUTO

    def reserve_bytes(self, memory_per_device: int) -> int:
        """The reserve kept free of `memory_per_device`: the one given, else the documented default."""
        from pipeplan.search.config import default_memory_reserve

        return default_memory_reserve(memory_per_device) if self.reserve is None else self.reserve


def parse_memory(text: str | None) -> MemoryChoice:
    from pipeplan.costs.recompute import RECOMPUTE_CHOICES
    from pipeplan.search.config import parse_zero

    values: dict[str, object] = {}
    for key, value in _pairs(text, "--memory", ("", *MEMORY_KEYS)):
        if key == "":
            values["per_device"] = parse_size(value, option="--memory")
        elif key == "reserve":
            values["reserve"] = 0 if value in ("0", "0B") else parse_size(value, option="--memory reserve")
        elif key == "zero":
            values["zero"] = parse_zero(value)
        elif value not in RECOMPUTE_CHOICES:
            raise ConfigError(f"--memory recompute={value!r} must be one of {', '.join(RECOMPUTE_CHOICES)}")
        else:
            values["recompute"] = value
    return MemoryChoice(**values)  # type: ignore[arg-type]


def parse_schedules(text: str, auto: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """`--schedule`'s schedules (registry order) and whether the user named them one by one (not auto, all or
    async: a named asynchronous schedule with ZeRO-1 is refused, not dropped). `auto`: the command's default set,
    less the asynchronous schedules and those searched only by name (`ScheduleInfo.named_only`: dualpipe)."""
    from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info

    chosen: set[str] = set()
    named = False
    for word in _words(text) or [AUTO]:
        if word == AUTO:
            chosen.update(
                name for name in auto if not (schedule_info(name).asynchronous or schedule_info(name).named_only)
            )
        elif word == "all":
            chosen.update(SCHEDULE_NAMES)
        elif word == "async":
            chosen.update(name for name in SCHEDULE_NAMES if schedule_info(name).asynchronous)
        else:
            chosen.add(schedule_info(word, also_accepted=(AUTO, "all", "async")).name)
            named = True
    return tuple(name for name in SCHEDULE_NAMES if name in chosen), named


def _words(text: str | None, flag: str = "") -> list[str]:
    """The comma-separated words of `text`; a `flag` given as an empty string (or only commas) is refused."""
    words = [word.strip().lower() for word in str(text or "").split(",") if word.strip()]
    if flag and text is not None and not words:
        raise ConfigError(f"{flag} {text!r} gives no value; give one or leave {flag} out")
    return words


def _pairs(text: str | None, flag: str, keys: tuple[str, ...]) -> list[tuple[str, str]]:
    """`key=value` parts of `text` (a bare value is key "" where "" is one of `keys`), each key once."""
    found: dict[str, str] = {}
    for part in _words(text, flag):
        key, sep, value = part.partition("=")
        key, value = (key.strip(), value.strip()) if sep else ("", key.strip())
        if key not in keys or key in found or not value:
            named = ", ".join(f"{k}=" if k else "SIZE" for k in keys)
            raise ConfigError(f"{flag} part {part!r} must be one of {named} (each once)")
        found[key] = value
    return list(found.items())


def _sizes(text: str, flag: str, *, single: bool = False) -> tuple[int, ...]:
    parts = text.split("/")
    wanted = "a whole number >= 1" if single else "sizes >= 1 like 2/4"
    try:
        values = tuple(sorted({int(part) for part in parts}))
    except ValueError:
        raise ConfigError(f"{flag}={text} must be auto or {wanted}") from None
    if min(values) < 1 or (single and len(parts) > 1):
        raise ConfigError(f"{flag}={text} must be auto or {wanted}")
    return values


def search_config(
    flags: SearchFlags,
    *,
    numerics,
    global_batch_size: int,
    microbatch_sizes: tuple[int, ...],
    memory_bytes: int,
    schedules: tuple[str, ...],
    interleave: tuple[int, ...],
    replication: bool,
    post_validate: str = AUTO,
):
    """The search's `SearchConfig` from the shared flags, with what the command decided: the numerics (the profile's
    precision), the batch, a device's memory, the schedules, and the command's interleave and replication defaults
    (`--parallel vp=auto`, `replicate=auto`)."""
    from pipeplan.costs.overlap import Overlap
    from pipeplan.schedules.registry import schedule_info
    from pipeplan.search.config import SearchConfig

    parallel, memory = parse_parallel(flags.parallel), parse_memory(flags.memory)
    return SearchConfig(
        global_batch_size=global_batch_size,
        microbatch_sizes=microbatch_sizes,
        numerics=numerics,
        replication=parallel.replication(replication),
        pipeline_depths=parallel.pipeline,
        memory_reserve_bytes=memory.reserve_bytes(memory_bytes),
        zero=memory.zero,
        recompute=memory.recompute,
        allow_async=any(schedule_info(name).asynchronous for name in schedules),
        overlap=Overlap.parse(flags.overlap),
        interleave=parallel.interleave or interleave,
        post_validate=post_validate,
    )
