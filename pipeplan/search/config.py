"""`SearchConfig`: the training-side inputs of the search (batch, microbatch sizes, numerics: the precision and
optimizer, memory options, schedules' policy), checked once; the memory reserve's default and the prediction
margin."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.cluster import DeviceGroups, MemoryBudget
from pipeplan.costs import RECOMPUTE_CHOICES, Numerics, bytes_per_param, check_zero_stage, static_split
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import ConfigError
from pipeplan.schedules.registry import schedule_info

POST_VALIDATE_CHOICES = ("auto", "on", "off")  # --post-validate (search.post_validation: the policy)

# Predicted steps this close to the fastest are ties: measured steps of `pipeplan run` differ from the prediction
# by a few percent (benchmarks/bench_runtime.py), so a smaller gap cannot rank two layouts.
PREDICTION_MARGIN = 0.02
GIB = 1 << 30


def searched_schedules(
    names: Sequence[str], *, allow_async: bool, zero: int | str = 0, named: bool = True
) -> tuple[str, ...]:
    """The schedules to search among `names`: the asynchronous ones (stale weights: they change what training
    computes) only with `allow_async` and ZeRO off (`auto` evaluates them with ZeRO 0). When the user `named` them
    (not `auto`), an asynchronous one without `allow_async`, or with ZeRO-1, is refused."""
    sharded = zero not in (0, "0", "auto")
    found = [name for name in names if schedule_info(name).asynchronous]
    if found and named and not allow_async:
        raise ConfigError(
            f"schedule {found[0]} is asynchronous (stale weights, no flush: it changes what training computes); "
            "allow it (SearchConfig.allow_async; on the command line, naming it in --schedule does)"
        )
    if found and named and sharded:
        raise ConfigError(
            f"--schedule {found[0]} runs with --memory zero=0 (ZeRO-1 cannot keep stashed weight versions)"
        )
    keep = allow_async and not sharded
    return tuple(name for name in names if keep or not schedule_info(name).asynchronous)


def parse_zero(text: str) -> int | str:
    """`--memory zero=`'s value: auto, or a ZeRO stage pipeplan supports (one ConfigError line otherwise)."""
    if text == "auto":
        return text
    try:
        stage = int(text)
    except ValueError:
        raise ConfigError(f"--memory zero={text} must be auto, 0 or 1") from None
    return check_zero_stage(stage)


def default_memory_reserve(memory_per_device: int) -> int:
    """max(1 GiB, 5% of device memory), at most a quarter of it: a CUDA context with cuBLAS/cuDNN workspaces
    takes 0.5-1 GiB, NCCL's point-to-point and all-reduce buffers a few hundred MiB more, and the caching
    allocator's fragmentation is typically a few percent of what it holds. On an H100 80GB (81,559 MiB) that keeps
    4.0 GiB free; the quarter cap keeps small (test, CPU) devices usable."""
    return min(max(GIB, int(0.05 * memory_per_device)), memory_per_device // 4)


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """Training-side inputs of the search. `microbatch_sizes`: candidates (each must divide the global batch)."""

    global_batch_size: int
    microbatch_sizes: tuple[int, ...] = (1,)
    numerics: Numerics  # precision and optimizer, resolved by the command (the profile's precision; no default here)
    replication: bool = True  # also try PipeDream replicated stages (schedules whose ScheduleInfo is replicable)
    pipeline_depths: tuple[int, ...] | None = None  # devices per pipeline (P) to try; None: every divisor of N
    memory_reserve_bytes: int = 0  # device memory kept free for what the model does not count
    zero: int | str = "auto"  # ZeRO stage (0, or 1: sharded optimizer state), or auto: the search tries both
    recompute: str = "auto"  # auto: stages recompute activations where memory needs it; none: never
    allow_async: bool = False  # also consider asynchronous schedules (pipedream, pipedream-2bw: stale weights)
    tensor_parallel: int = 1  # t > 1: search one rank's profile on t-device groups (search.sharding)
    context_parallel: int = 1  # cp > 1: the groups are t x cp devices splitting the sequence too (search.sharding)
    expert_parallel: int = 1  # ep > 1: routed experts split over ep of the pipelines x cp ranks (search.sharding)
    overlap: Overlap = Overlap()  # communication overlap (costs.overlap; Megatron-Core's defaults: none)
    interleave: tuple[int, ...] = (2,)  # chunks per device the looped schedule (interleaved) is tried with
    post_validate: str = "auto"  # on / off / auto: post-validate steps where that shortens the period

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if not self.microbatch_sizes or any(b < 1 for b in self.microbatch_sizes):
            raise ConfigError(f"--microbatch-size values must be >= 1, got {list(self.microbatch_sizes)}")
        bad = [b for b in self.microbatch_sizes if self.global_batch_size % b]
        if bad:
            raise ConfigError(
                f"--global-batch-size ({self.global_batch_size}) must be divisible by --microbatch-size {bad[0]}"
            )
        if self.zero != "auto":
            check_zero_stage(self.zero)
        if self.post_validate not in POST_VALIDATE_CHOICES:
            choices = ", ".join(POST_VALIDATE_CHOICES)
            raise ConfigError(f"--post-validate must be one of {choices}, got {self.post_validate!r}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ConfigError(
                f"--memory recompute= must be one of {', '.join(RECOMPUTE_CHOICES)}, got {self.recompute!r}"
            )
        if self.memory_reserve_bytes < 0:
            raise ConfigError(f"--memory reserve= must be >= 0, got {self.memory_reserve_bytes}")
        if not self.interleave or min(self.interleave) < 1:
            raise ConfigError(f"--parallel vp values must be >= 1, got {list(self.interleave)}")
        if self.pipeline_depths is not None and (not self.pipeline_depths or min(self.pipeline_depths) < 1):
            raise ConfigError(f"--parallel pp values must be >= 1, got {list(self.pipeline_depths)}")
        if self.zero == 1:
            bytes_per_param(self.numerics, zero=1)  # a number of bytes cannot be sharded

    @property
    def groups(self) -> DeviceGroups:
        """The t x cp groups the pipelines are searched on."""
        return DeviceGroups(tensor_parallel=self.tensor_parallel, context_parallel=self.context_parallel)

    @property
    def per_param(self) -> float:
        """Bytes per parameter of weights + gradients + optimizer state under the precision."""
        return bytes_per_param(self.numerics)

    def least_per_param(self, data_parallel: int) -> float:
        """The fewest bytes per parameter a device of a layout with `data_parallel` pipelines can hold: with ZeRO-1
        allowed, the optimizer state split over at least the pipelines."""
        if self.zero == 0 or data_parallel == 1 or not self.numerics.named:
            return self.per_param
        return bytes_per_param(self.numerics, zero=1, group_size=data_parallel)

    @property
    def split(self) -> tuple[float, float, float]:
        """Bytes per parameter of (weights, gradients, optimizer state) under the precision."""
        return static_split(self.numerics)

    def budget(self, memory_per_device: int) -> MemoryBudget:
        """A device's memory as the search fills it: physical, less the reserve: what every memory check of the
        search, the plan's limit and capacity's rows compare peaks with (the one place it is computed)."""
        return MemoryBudget(physical=memory_per_device, reserve=self.memory_reserve_bytes)

    def check_devices(self, num_devices: int) -> None:
        """Every forced pipeline depth must divide the device count (the pipelines tile the devices)."""
        bad = [p for p in self.pipeline_depths or () if num_devices % p]
        if bad:
            raise ConfigError(f"--parallel pp={bad[0]} must divide --devices ({num_devices})")
