"""What `pipeplan run` does per precision mode (pipeplan.precision): low-precision parameters for `bf16`, the cut
values' wire dtypes under the mode (runtime/step/comm.py allocates receive buffers with them), and fp16 loss scaling.

fp16 loss scaling is one global scale: every rank seeds its loss gradient with the same `scale`, the step's
gradient check is the global state every rank learns (runtime/train/step_checks.py: a non-finite gradient norm on any
rank is non-finite on all, synchronized or post-validated), so every rank skips an overflowing step together and
halves the scale; after `growth_interval` clean steps it doubles, as torch.amp.GradScaler does. (GradScaler's own
inf check is per process and would let ranks disagree, so the runtime keeps this small equivalent instead.)
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from pipeplan.graph.run_dtypes import value_dtype, value_dtypes
from pipeplan.precision import Precision
from pipeplan.units import format_gib


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def overflowed(self) -> None:
        """The step's gradients are not finite on some rank: skip it (every rank) and halve the scale."""
        self.scale = max(self.scale / 2.0, 1.0)
        self.clean_steps = 0
        self.skipped_steps += 1

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def stepped(self) -> None:
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0


def apply_param_dtype(model, mode: Precision) -> None:
    """`bf16`: the rank's stages hold bf16 parameters (and floating buffers), as `module.to(torch.bfloat16)`."""
    if mode.param_dtype == torch.float32:
        return
    for module in model.modules.values():
        module.to(mode.param_dtype)


def apply_wire_dtypes(model, mode: Precision, device_type: str) -> None:
    """Every cut value's dtype as the run under `mode` produces it on `device_type` (fp32: as traced)."""
    if mode.name == "fp32":
        return
    dtypes = value_dtypes(model.traced, mode.name, device_type)
    metas = {}
    for name, meta in model.value_meta.items():
        dtype = value_dtype(dtypes, name)
        metas[name] = replace(meta, dtype=dtype) if dtype is not None else meta
    model.value_meta = metas


MAX_LOGGED_RANKS = 8


def gather_peak_memory(device: torch.device) -> list[int] | None:
    """Every rank's torch.cuda.max_memory_allocated (one all_gather; every rank must call it), None on CPU."""
    if device.type != "cuda":
        return None
    mine = torch.tensor([torch.cuda.max_memory_allocated(device)], dtype=torch.int64, device=device)
    found = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(found, mine)
    return [int(t.item()) for t in found]


def memory_versus(plan, peaks: list[int] | None) -> str:
    """`r0 1.20/1.31 r1 ...`: measured / predicted GiB per rank (the worst ratio's rank beyond 8 ranks)."""
    if peaks is None:
        return ""
    predicted = plan.predicted.peak_memory_bytes
    rows = [(r, peak, predicted[r] if r < len(predicted) else 0) for r, peak in enumerate(peaks)]
    if len(rows) > MAX_LOGGED_RANKS:
        worst = max(rows, key=lambda row: row[1] / row[2] if row[2] else 0.0)
        rows = [worst]
        prefix = f"worst of {len(peaks)} ranks: "
    else:
        prefix = ""
    cells = [
        f"r{r} {format_gib(peak)}/{format_gib(expected)}" if expected else f"r{r} {format_gib(peak)}/-"
        for r, peak, expected in rows
    ]
    return prefix + " ".join(cells) + " (measured/predicted)"
