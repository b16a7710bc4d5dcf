"""What `pipeplan calibrate` measures (dtypes, sizes, its options) and what it found (`Calibration`): the data the
measurements (`calibrate.measure`, `calibrate.links`) fill in and `calibrate.hardware_file` writes out."""

from __future__ import annotations

import statistics
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
    sm_count: int | None = None  # streaming multiprocessors (CUDA); None on a CPU: no tile or wave quantization
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
            "sm_count": self.sm_count,
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
