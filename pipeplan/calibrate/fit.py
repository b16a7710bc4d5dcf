"""Fit the kernel model's `matmul_efficiency` to measured matmuls (`pipeplan calibrate` on a GPU).

`profiling.kernels` times a matmul on a GPU with S streaming multiprocessors as ceil(tiles / S) waves of one output
tile's FLOPs at the SM's share of peak x `matmul_efficiency` (tile and wave quantization; the best of its tile
shapes). A measured matmul rate already contains that quantization at the shape it was measured at, so what a
calibration writes for the model is the efficiency that makes the model reproduce the measurement, not the
measured rate itself (that would count the quantization twice):

- for each measured shape (m, n, k): efficiency = measured FLOP/s / the rate the kernel model gives for that shape at
  efficiency 1 (its FLOPs / its time with gemm_flops_per_s = peak), i.e. t_model(peak) / t_measured;
- the efficiency kept is the median over the measured shapes of one dtype (robust to a shape that cuBLAS tiles
  better or worse than the model's three tile shapes; `pipeplan calibrate` measures five on a GPU);
- only the model's compute time counts: no memory roofline and no launch floor. Calibrate's GPU shapes (8192 x 1024
  x 1024 and larger) are compute-bound on every preset GPU, so neither binds there; a memory-bound shape would
  measure bandwidth, not matmul throughput.

Because the model's time is proportional to 1 / rate, the fit is exact: a sample made by the model at efficiency e
fits back to e. On a GPU that matches a preset, the fit runs through the model with that preset's per-kernel terms
(`KernelTerms`: the per-matmul overhead, the exposed epilogue, the tiles' operand reuse, stream-K) and the measured
memory rate, as the profiles the entry makes will time matmuls; the time is then no longer proportional to 1 /
rate (the overhead does not scale), so each shape's efficiency is found by bisection, and a sample made by the
model with those terms fits back the same way. The full wave's rate (`full_wave_flops_per_s`) is peak x that
efficiency, and is what a device without a datasheet peak takes as its peak. Without an SM count (a CPU) the model
has no quantization and this is measured / peak.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.calibrate.spec import MatmulSample
from pipeplan.profiling.kernels import Kernel, KernelRates, kernel_seconds


@dataclass(frozen=True, kw_only=True)
class KernelTerms:
    """The kernel model's per-kernel terms a fit runs with (a preset's; `Hardware` names them the same)."""

    bytes_per_s: float
    gemm_overhead_s: float = 0.0
    epilogue_exposed: float = 0.0
    tile_reuse_half: float = 0.0
    stream_k: bool = False


def model_seconds(
    shape: tuple[int, int, int], flops_per_s: float, sm_count: int | None, terms: KernelTerms | None = None
) -> float:
    """The kernel model's time of one m x k times k x n matmul at `flops_per_s` for a full wave: its compute alone
    without `terms`, else with them (and their memory rate's roofline)."""
    m, n, k = shape
    extra = terms.__dict__ if terms is not None else dict(bytes_per_s=math.inf)
    rates = KernelRates(gemm_flops_per_s=flops_per_s, attention_flops_per_s=flops_per_s, sm_count=sm_count, **extra)
    return kernel_seconds(Kernel(kind="gemm", m=m, n=n, k=k), rates)


def shape_efficiency(
    sample: MatmulSample, peak_flops: float, sm_count: int | None, terms: KernelTerms | None = None
) -> float:
    """What fraction of `peak_flops` a full wave must reach for the model to take `sample.seconds` at its shape."""
    if terms is None:
        return model_seconds(sample.shape, peak_flops, sm_count) / sample.seconds
    low, high = 1e-6, 16.0  # the model's time falls as the rate rises: bisect on the efficiency
    for _ in range(100):
        middle = math.sqrt(low * high)
        if model_seconds(sample.shape, middle * peak_flops, sm_count, terms) > sample.seconds:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def fit_matmul_efficiency(
    samples: Sequence[MatmulSample], peak_flops: float, sm_count: int | None, terms: KernelTerms | None = None
) -> float:
    """The median over `samples` of their `shape_efficiency` (see the module docstring)."""
    if not samples:
        raise ValueError("no matmul samples to fit")
    return statistics.median(shape_efficiency(sample, peak_flops, sm_count, terms) for sample in samples)


def full_wave_flops_per_s(
    samples: Sequence[MatmulSample], sm_count: int | None, terms: KernelTerms | None = None, peak_flops: float = 1.0
) -> float:
    """The rate of a full wave of large tiles that the samples imply: the fit against a peak of 1 FLOP/s (with
    `terms`, whose overheads do not scale with the rate, against the datasheet peak `peak_flops`)."""
    return fit_matmul_efficiency(samples, peak_flops, sm_count, terms) * peak_flops
