"""Refuse, before anything is allocated, a measured profile whose model or batch cannot fit this machine: the
weights (and their gradients) counted on the meta device, the inputs from one sample. One line names what to change,
instead of an allocation failure, swapping or the kernel's OOM killer."""

from __future__ import annotations

import os

import torch

from pipeplan.errors import ConfigError
from pipeplan.models.spec import ModelSpec
from pipeplan.units import format_bytes

HOST_MEMORY_ENV = "PIPEPLAN_HOST_MEMORY"  # bytes of host memory to assume available (tests set it)


def host_memory_available() -> int:
    """Host memory available now: MemAvailable, else physical memory (or HOST_MEMORY_ENV when set)."""
    raw = os.environ.get(HOST_MEMORY_ENV)
    if raw:
        return int(float(raw))
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes(device: str) -> int | None:
    """Free memory of `device` (cpu: host_memory_available; cuda: free device memory; None without CUDA)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0]) if torch.cuda.is_available() else None
    return host_memory_available()


def _sample_bytes(spec: ModelSpec) -> int:
    (inputs, target) = spec.sample_batch(1)
    tensors = [*inputs, target] if isinstance(target, torch.Tensor) else list(inputs)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def check_fits_host(spec: ModelSpec, *, batch_size: int, device: str, processes: int = 1) -> None:
    """Weights + gradients + the batch's inputs, in each of `processes` processes (`profile --concurrent N`: the
    profile's and its siblings'), must fit the device's free memory (a lower bound of what measuring needs:
    activations come on top)."""
    free = available_bytes(device)
    if free is None:
        return
    with torch.device("meta"):
        module = spec.build()
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    needed = processes * (2 * weights + batch_size * _sample_bytes(spec))
    if needed > free:
        each = f" in each of --concurrent {processes} processes" if processes > 1 else ""
        raise ConfigError(
            f"measuring {spec.name} at --batch-size {batch_size} needs at least {format_bytes(needed)} (weights, "
            f"gradients, inputs{each}) but {device} has {format_bytes(free)} free; use smaller options or batch, or "
            "estimate it with --device meta --hardware NAME"
        )
