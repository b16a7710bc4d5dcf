"""The kernel-model fit of `matmul_efficiency` (calibrate/fit.py), on synthetic samples: pure functions, no GPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipeplan.calibrate.fit import (
    KernelTerms,
    fit_matmul_efficiency,
    full_wave_flops_per_s,
    model_seconds,
    shape_efficiency,
)
from pipeplan.calibrate.hardware_file import hardware_entry
from pipeplan.calibrate.spec import SIZES, Calibration, MatmulSample, MemorySample
from pipeplan.hardware import load_hardware
from pipeplan.profiling.analytic import AnalyticConfig
from pipeplan.profiling.kernels import Kernel, kernel_seconds

SHAPES = (
    *SIZES[("cuda", False)].matmul_shapes,
    *SIZES[("cuda", True)].matmul_shapes,
    (1024, 1024, 1024),  # 64 tiles of 128 x 128: half a wave on 132 SMs
    (3000, 5000, 700),  # padded tiles and a partial last wave
    (8192, 2304, 6144),  # a TP8 shard of a 22B model's fused QKV, 4 x 2048 tokens
)
PEAK = 989.4e12


def _sample(shape, efficiency: float, sm_count: int | None, peak: float = PEAK, dtype: str = "bf16") -> MatmulSample:
    """A matmul that takes as long as the kernel model says a full wave at `efficiency` x `peak` would."""
    return MatmulSample(dtype, shape, model_seconds(shape, efficiency * peak, sm_count))


@pytest.mark.parametrize("sm_count", [108, 132, 148, 304])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_sample_made_by_the_kernel_model_at_0_8_fits_back_to_0_8(shape, sm_count):
    sample = _sample(shape, 0.8, sm_count)
    assert shape_efficiency(sample, PEAK, sm_count) == pytest.approx(0.8, rel=1e-12)
    assert fit_matmul_efficiency([sample], PEAK, sm_count) == pytest.approx(0.8, rel=1e-12)
    assert full_wave_flops_per_s([sample], sm_count) == pytest.approx(0.8 * PEAK, rel=1e-12)


def test_the_fit_is_the_median_over_shapes():
    samples = [_sample(shape, e, 132) for shape, e in zip(SHAPES, (0.7, 0.8, 0.9, 0.75, 0.85, 0.5, 0.95))]
    assert fit_matmul_efficiency(samples[:3], PEAK, 132) == pytest.approx(0.8)
    assert fit_matmul_efficiency(samples, PEAK, 132) == pytest.approx(0.8)  # sorted: .5 .7 .75 [.8] .85 .9 .95
    with pytest.raises(ValueError, match="no matmul samples"):
        fit_matmul_efficiency([], PEAK, 132)


H100 = load_hardware("h100")
TERMS = KernelTerms(
    bytes_per_s=3.0e12,
    gemm_overhead_s=H100.gemm_overhead_s,
    epilogue_exposed=H100.epilogue_exposed,
    tile_reuse_half=H100.tile_reuse_half,
    stream_k=H100.stream_k,
)


def test_quantization_and_the_per_kernel_terms_are_taken_out_of_the_measured_rate():
    """With the h100 preset's per-kernel terms (what calibrate fits a matched H100 with) a small matmul measures far
    below the full wave's rate and a large one near it; the fit sees through both, the raw fraction cannot."""
    small = MatmulSample("bf16", (1024, 1024, 1024), model_seconds((1024, 1024, 1024), 0.8 * PEAK, 132, TERMS))
    large = MatmulSample("bf16", (8192, 8192, 8192), model_seconds((8192, 8192, 8192), 0.8 * PEAK, 132, TERMS))
    assert small.flops_per_s / PEAK < 0.5 < 0.7 < large.flops_per_s / PEAK < 0.8
    for sample in (small, large):
        assert shape_efficiency(sample, PEAK, 132, TERMS) == pytest.approx(0.8, rel=1e-6)
    assert full_wave_flops_per_s([small, large], 132, TERMS, PEAK) == pytest.approx(0.8 * PEAK, rel=1e-6)


def test_without_sms_the_fit_is_measured_over_peak():
    sample = MatmulSample("fp32", (512, 512, 512), 2 * 512**3 / 1.5e12)
    assert shape_efficiency(sample, 3e12, None) == pytest.approx(0.5)
    assert full_wave_flops_per_s([sample], None) == pytest.approx(1.5e12)


def test_the_calibrated_entry_makes_the_analytic_kernels_take_the_measured_times(tmp_path):
    """End to end: samples at 0.8 -> hardware entry -> the analytic model's kernel rates time each shape as measured
    (the measured rate is not applied a second time on top of the quantization)."""
    shapes = SIZES[("cuda", False)].matmul_shapes
    cal = Calibration(
        device="cuda",
        device_name="NVIDIA H100 80GB HBM3",
        memory_bytes=85_000_000_000,
        sm_count=132,
        matmul=[
            MatmulSample("bf16", shape, model_seconds(shape, 0.8 * PEAK, 132, replace(TERMS, bytes_per_s=3.0e12)))
            for shape in shapes
        ],
        memory=[MemorySample(1 << 30, 3.0e12, 3.0e12)],
        launch_s=4e-6,
    )
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"schema_version": 1, "hardware": {"gpu": hardware_entry(cal)}}))
    spec = load_hardware("gpu", hardware_file=path)
    assert spec.matmul_efficiency == pytest.approx(0.8) and spec.sm_count == 132
    rates = AnalyticConfig(batch_size=1, hardware=spec).roofline.kernel_rates
    rates = replace(rates, gemm_flops_per_s=rates.gemm_flops_per_s / spec.clock_ratio)  # the calibration's clock
    for sample in cal.matmul:
        m, n, k = sample.shape
        assert kernel_seconds(Kernel(kind="gemm", m=m, n=n, k=k), rates) == pytest.approx(sample.seconds)
