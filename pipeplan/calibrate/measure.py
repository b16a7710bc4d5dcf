"""`pipeplan calibrate`: measure what this machine achieves, for the analytic model to use instead of datasheet peaks.

Measured, each as the median of `repeats` timed samples after `warmup` untimed runs (CUDA: CUDA events around the
work, then a synchronize; CPU: `time.perf_counter`):

- dense matmul FLOP/s per dtype (`torch.matmul(a, b, out=c)`, 2·m·n·k FLOPs) at a few shapes (transformer-like:
  tokens x hidden x 4·hidden, and squares); every sample is kept. On a CPU the figure used is the median over the
  shapes (the model applies one rate to every matmul there); on a GPU, the fit of `calibrate.fit`. `tf32` is a
  float32 matmul with TF32 allowed (`torch.set_float32_matmul_precision("high")`), `fp32` one without; on a CPU
  `fp32` is the float32 figure.
- memory bandwidth: `copy_` (reads + writes 2·size bytes) and `add` (3·size bytes) at a few sizes, from
  activation-sized tensors to ones far beyond the caches; the figure kept is the median over sizes of the mean of
  copy and add (mid-sized kernels reach less than a huge copy, and a model's elementwise ops are mid-sized).
- the SM count (CUDA: `multi_processor_count`), which the kernel model's tile and wave quantization needs: with
  it `calibrate.fit` turns the matmul samples into the full-wave `matmul_efficiency` the model uses (not the median
  measured rate, which already contains the quantization of the measured shapes).
- kernel launch overhead: the time per op of many back-to-back `x.add_(1)` on a one-element tensor (what a tiny op
  costs when the host's dispatch and launch, not the device, is the limit).
- links (`calibrate.links`): point-to-point and all-reduce bandwidth and the small-message latency between local
  processes: nccl across the GPUs with 2+ GPUs, gloo between two CPU processes with `--device cpu`.

`calibrate.hardware_file.hardware_entry` turns a `Calibration` into a `--hardware-file` entry.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pipeplan.calibrate.spec import (
    DTYPES,
    CalibrateConfig,
    Calibration,
    MatmulSample,
    MemorySample,
    Sizes,
)
from pipeplan.errors import ConfigError


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


def describe_device(config: CalibrateConfig) -> tuple[torch.device, Calibration]:
    """(torch device, an empty Calibration naming it: its name, memory in bytes and, on CUDA, its SM count)."""
    if config.kind == "cuda":
        device = torch.device(config.device if ":" in config.device else f"cuda:{torch.cuda.current_device()}")
        props = torch.cuda.get_device_properties(device)
        memory, sms = int(props.total_memory), int(props.multi_processor_count)
        return device, Calibration(device="cuda", device_name=props.name, memory_bytes=memory, sm_count=sms)
    return torch.device("cpu"), Calibration(
        device="cpu", device_name=_cpu_name(), memory_bytes=_physical_memory_bytes()
    )


def calibrate(config: CalibrateConfig, *, advance: Callable[[str], None] | None = None) -> Calibration:
    """Run every measurement of `config` on this machine; `advance(description)` is called after each step."""
    step = advance or (lambda _description: None)
    device, result = describe_device(config)
    sizes = config.sizes
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
        from pipeplan.calibrate.links import measure_links

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
