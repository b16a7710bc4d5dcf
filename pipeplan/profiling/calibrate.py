"""`pipeplan calibrate`: measure what this machine achieves, for the analytic model to use instead of datasheet peaks.

Measured, each as the median of `repeats` timed samples after `warmup` untimed runs (CUDA: CUDA events around the
work, then a synchronize; CPU: `time.perf_counter`):

- dense matmul FLOP/s per dtype (`torch.matmul(a, b, out=c)`, 2·m·n·k FLOPs) at a few shapes; the figure kept per
  dtype is the median over the shapes (they are transformer-like: tokens x hidden x 4·hidden and squares), since
  the analytic model applies one rate to every matmul. `tf32` is a float32 matmul with TF32 allowed
  (`torch.set_float32_matmul_precision("high")`), `fp32` one without; on a CPU `fp32` is the float32 figure.
- memory bandwidth: `copy_` (reads + writes 2·size bytes) and `add` (3·size bytes) at a few sizes, from
  activation-sized tensors to ones far beyond the caches; the figure kept is the median over sizes of the mean of
  copy and add (mid-sized kernels reach less than a huge copy, and a model's elementwise ops are mid-sized).
- kernel launch overhead: the time per op of many back-to-back `x.add_(1)` on a one-element tensor (what a tiny op
  costs when the host's dispatch and launch, not the device, is the limit).
- links (`calibrate_links`): point-to-point and all-reduce bandwidth and the small-message latency between local
  processes: nccl across the GPUs with 2+ GPUs, gloo between two CPU processes with `--device cpu`.

`calibrate_file.hardware_entry` turns a `Calibration` into a `--hardware-file` entry.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeplan.errors import ConfigError

DTYPES: dict[str, tuple[torch.dtype, str | None]] = {  # name -> (tensor dtype, float32 matmul precision)
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "tf32": (torch.float32, "high"),
    "fp32": (torch.float32, "highest"),
}
DEFAULT_DTYPES = {"cuda": ("bf16", "fp16", "tf32", "fp32"), "cpu": ("fp32", "bf16")}


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does (`quick` shrinks everything to test sizes)."""

    matmul_shapes: tuple[tuple[int, int, int], ...]  # (m, n, k)
    memory_sizes: tuple[int, ...]  # bytes per tensor
    launch_ops: int  # tiny ops per timed sample
    link_bytes: int
    warmup: int
    repeats: int
    matmul_inner: int  # matmuls per timed sample


SIZES: dict[tuple[str, bool], Sizes] = {
    ("cuda", False): Sizes(
        ((8192, 1024, 1024), (8192, 4096, 1024), (8192, 1024, 4096), (4096, 4096, 4096), (8192, 8192, 8192)),
        memory_sizes=(16 << 20, 64 << 20, 256 << 20, 1 << 30),
        launch_ops=500,
        link_bytes=256 << 20,
        warmup=3,
        repeats=10,
        matmul_inner=5,
    ),
    ("cuda", True): Sizes(
        ((4096, 1024, 1024), (2048, 2048, 2048)),
        memory_sizes=(16 << 20, 128 << 20),
        launch_ops=200,
        link_bytes=32 << 20,
        warmup=2,
        repeats=5,
        matmul_inner=3,
    ),
    ("cpu", False): Sizes(
        ((512, 512, 512), (1024, 1024, 1024), (1024, 2048, 512)),
        memory_sizes=(32 << 20, 128 << 20),
        launch_ops=1000,
        link_bytes=32 << 20,
        warmup=1,
        repeats=5,
        matmul_inner=1,
    ),
    ("cpu", True): Sizes(
        ((64, 64, 64), (128, 128, 128)),
        memory_sizes=(1 << 20, 4 << 20),
        launch_ops=100,
        link_bytes=1 << 20,
        warmup=2,
        repeats=3,
        matmul_inner=1,
    ),
}


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    device: str  # "cpu" or "cuda" / "cuda:N"
    dtypes: tuple[str, ...] = ()  # empty: DEFAULT_DTYPES for the device
    quick: bool = False
    links: bool = True

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but CUDA is not available here; use --device cpu")
        if kind == "cuda" and self.device != "cuda":
            index = self.device.partition(":")[2]
            if not index.isdigit() or int(index) >= torch.cuda.device_count():
                raise ConfigError(f"--device {self.device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        dtypes = tuple(dict.fromkeys(d.strip().lower() for d in self.dtypes if d.strip())) or DEFAULT_DTYPES[kind]
        for name in dtypes:
            if name not in DTYPES:
                raise ConfigError(f"--dtype {name!r} is not supported; choose from: {', '.join(DTYPES)}")
            if kind == "cpu" and name == "tf32":
                raise ConfigError("--dtype tf32 needs --device cuda (a CPU has no TF32; use fp32)")
        object.__setattr__(self, "dtypes", dtypes)

    @property
    def kind(self) -> str:
        return self.device.partition(":")[0]

    @property
    def sizes(self) -> Sizes:
        return SIZES[(self.kind, self.quick)]


@dataclass(frozen=True)
class MatmulSample:
    dtype: str
    shape: tuple[int, int, int]
    seconds: float  # median per matmul

    @property
    def flops_per_s(self) -> float:
        m, n, k = self.shape
        return 2.0 * m * n * k / self.seconds


@dataclass(frozen=True)
class MemorySample:
    num_bytes: int  # per tensor
    copy_bytes_per_s: float  # 2 x size per copy
    add_bytes_per_s: float  # 3 x size per add


@dataclass(frozen=True)
class LinkResult:
    backend: str
    ranks: int
    p2p_bytes_per_s: float  # one direction, between ranks 0 and 1
    allreduce_bus_bytes_per_s: float  # nccl-tests convention: 2·(n-1)/n · size / time
    latency_s: float  # one small message, one way
    message_bytes: int


@dataclass(kw_only=True)
class Calibration:
    device: str  # "cpu" or "cuda"
    device_name: str
    memory_bytes: int  # device memory (CUDA) or physical RAM (CPU)
    matmul: list[MatmulSample] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    launch_s: float = 0.0
    links: LinkResult | None = None
    notes: list[str] = field(default_factory=list)
    torch_version: str = torch.__version__

    def matmul_flops_per_s(self, dtype: str) -> float | None:
        """The median over the measured shapes of `dtype`'s FLOP/s (None when not measured)."""
        rates = [s.flops_per_s for s in self.matmul if s.dtype == dtype]
        return statistics.median(rates) if rates else None

    @property
    def memory_bytes_per_s(self) -> float:
        """The median over the measured sizes of the mean of copy and add bandwidth."""
        return statistics.median((s.copy_bytes_per_s + s.add_bytes_per_s) / 2 for s in self.memory)

    def to_dict(self) -> dict[str, Any]:
        """The raw measurements (what the hardware file's `calibration` object holds)."""
        matmul: dict[str, Any] = {}
        for sample in self.matmul:
            matmul.setdefault(sample.dtype, []).append(
                {"shape_mnk": list(sample.shape), "ms": sample.seconds * 1e3, "tflops": sample.flops_per_s / 1e12}
            )
        links = None
        if self.links is not None:
            link = self.links
            links = {
                "backend": link.backend,
                "ranks": link.ranks,
                "message_bytes": link.message_bytes,
                "p2p_gb_per_s": link.p2p_bytes_per_s / 1e9,
                "allreduce_bus_gb_per_s": link.allreduce_bus_bytes_per_s / 1e9,
                "latency_us": link.latency_s * 1e6,
            }
        return {
            "device": self.device,
            "device_name": self.device_name,
            "torch_version": self.torch_version,
            "matmul": matmul,
            "memory": [_memory_dict(m) for m in self.memory],
            "kernel_launch_us": self.launch_s * 1e6,
            "links": links,
            "notes": list(self.notes),
        }


def _memory_dict(sample: MemorySample) -> dict[str, float]:
    return {
        "bytes": sample.num_bytes,
        "copy_gb_per_s": sample.copy_bytes_per_s / 1e9,
        "add_gb_per_s": sample.add_bytes_per_s / 1e9,
    }


def median_seconds(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median time of one `fn()` over `repeats` samples of `inner` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            for _ in range(repeats):
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / inner)
    else:
        for _ in range(repeats):
            began = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - began) / inner)
    return statistics.median(samples)


@contextmanager
def _float32_precision(precision: str | None):
    if precision is None:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def measure_matmul(dtype: str, shape: tuple[int, int, int], device: torch.device, sizes: Sizes) -> MatmulSample:
    torch_dtype, precision = DTYPES[dtype]
    m, n, k = shape
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=torch_dtype, generator=generator)
    b = torch.randn(k, n, device=device, dtype=torch_dtype, generator=generator)
    c = torch.empty(m, n, device=device, dtype=torch_dtype)
    with _float32_precision(precision):
        seconds = median_seconds(
            lambda: torch.matmul(a, b, out=c),
            device,
            warmup=sizes.warmup,
            repeats=sizes.repeats,
            inner=sizes.matmul_inner,
        )
    return MatmulSample(dtype=dtype, shape=shape, seconds=seconds)


def measure_memory(num_bytes: int, device: torch.device, sizes: Sizes) -> MemorySample:
    """Achieved copy and add bytes/s on float32 tensors of `num_bytes` each."""
    numel = num_bytes // 4
    a, b, c = (torch.full((numel,), 1.0, device=device) for _ in range(3))  # filled: pages touched before timing
    inner = max(1, (64 << 20) // num_bytes) if device.type == "cuda" else 1  # small copies: several per sample
    kwargs = dict(warmup=sizes.warmup, repeats=sizes.repeats, inner=inner)
    copy = median_seconds(lambda: c.copy_(a), device, **kwargs)
    add = median_seconds(lambda: torch.add(a, b, out=c), device, **kwargs)
    return MemorySample(num_bytes=numel * 4, copy_bytes_per_s=2 * numel * 4 / copy, add_bytes_per_s=3 * numel * 4 / add)


def measure_launch(device: torch.device, sizes: Sizes) -> float:
    """Seconds per tiny op issued back to back (host dispatch + launch bound)."""
    x = torch.zeros(1, device=device)
    return median_seconds(
        lambda: x.add_(1), device, warmup=sizes.warmup * 10, repeats=sizes.repeats, inner=sizes.launch_ops
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise ConfigError("cannot read this machine's physical memory size (os.sysconf)") from None


def describe_device(config: CalibrateConfig) -> tuple[torch.device, str, int]:
    """(torch device, its name, its memory in bytes)."""
    if config.kind == "cuda":
        device = torch.device(config.device if ":" in config.device else f"cuda:{torch.cuda.current_device()}")
        props = torch.cuda.get_device_properties(device)
        return device, props.name, int(props.total_memory)
    return torch.device("cpu"), _cpu_name(), _physical_memory_bytes()


def calibrate(config: CalibrateConfig, *, advance: Callable[[str], None] | None = None) -> Calibration:
    """Run every measurement of `config` on this machine; `advance(description)` is called after each step."""
    step = advance or (lambda _description: None)
    device, name, memory = describe_device(config)
    sizes = config.sizes
    result = Calibration(device=config.kind, device_name=name, memory_bytes=memory)
    for dtype in config.dtypes:
        for shape in sizes.matmul_shapes:
            result.matmul.append(measure_matmul(dtype, shape, device, sizes))
            step(f"matmul {dtype} {'x'.join(map(str, shape))}")
    for num_bytes in sizes.memory_sizes:
        result.memory.append(measure_memory(num_bytes, device, sizes))
        step(f"memory bandwidth {num_bytes >> 20} MiB")
    result.launch_s = measure_launch(device, sizes)
    step("kernel launch")
    if config.links:
        from pipeplan.profiling.calibrate_links import measure_links

        if device.type == "cuda":
            torch.cuda.empty_cache()  # the link processes need GPU 0's memory too
        result.links, note = measure_links(config.kind, sizes)
        if note:
            result.notes.append(note)
        step("links")
    return result


def num_steps(config: CalibrateConfig) -> int:
    return len(config.dtypes) * len(config.sizes.matmul_shapes) + len(config.sizes.memory_sizes) + 1 + int(config.links)


def dtype_list(values: Sequence[str] | None) -> tuple[str, ...]:
    """`--dtype bf16 --dtype fp32` or `--dtype bf16,fp32`."""
    return tuple(part for value in values or () for part in value.split(","))
