"""Check a calibration: the whole model's measured forward+backward time against the analytic profile's F+B sum
for the same hardware entry (used by the `@pytest.mark.gpu` test and benchmarks/bench_calibrate.py; not part of the
package).

Measured: the model built on `device` with fp32 parameters, forward + loss under `torch.autocast(dtype)` (none for
float32), or with parameters and inputs in `dtype` and no autocast; then `loss.backward()`; the median of `repeats`
after `warmup` (CUDA events on CUDA). Analytic: the sum over layers of F + B (B = the fused backward) from
`profile_analytic` in that dtype.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from pipeplan.calibrate.measure import median_seconds
from pipeplan.hardware import Hardware
from pipeplan.models.spec import ModelSpec


def _move(value, device: torch.device, dtype: torch.dtype | None):
    if not isinstance(value, torch.Tensor):
        return value
    value = value.to(device)
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value


def measured_step_ms(
    spec: ModelSpec,
    batch_size: int,
    device: str,
    *,
    dtype: torch.dtype,
    autocast: bool = True,
    warmup: int = 3,
    repeats: int = 10,
) -> float:
    """Median whole-model forward+backward milliseconds: fp32 parameters under autocast to `dtype` (`autocast`),
    or parameters and inputs in `dtype` (not `autocast`); plain fp32 when `dtype` is float32."""
    target_device = torch.device(device)
    torch.manual_seed(0)
    with target_device:
        model = spec.build()
    model.train()
    cast = None if autocast or dtype == torch.float32 else dtype
    if cast is not None:
        model.to(cast)
    inputs, target = spec.sample_batch(batch_size, generator=torch.Generator().manual_seed(0))
    inputs = tuple(_move(v, target_device, cast) for v in inputs)
    target = _move(target, target_device, cast)
    mixed = autocast and dtype != torch.float32
    context = torch.autocast(device_type=target_device.type, dtype=dtype) if mixed else nullcontext()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with context:
            loss = spec.loss_fn(model(*inputs), target)
        loss.backward()

    return median_seconds(step, target_device, warmup=warmup, repeats=repeats) * 1e3


def analytic_step_ms(spec: ModelSpec, batch_size: int, hardware: Hardware, *, dtype: str = "bfloat16") -> float:
    """The analytic profile's whole-model F + B in milliseconds."""
    from pipeplan.profiling.analytic import precision_of_dtype, profile_analytic

    precision = precision_of_dtype(dtype)
    profile = profile_analytic(spec, batch_size=batch_size, hardware=hardware, precision=precision)
    return sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
