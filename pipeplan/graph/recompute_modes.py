"""Activation recomputation modes, the one list: what a plan's stage may run (`StagePlan.recompute`), what profiles
measure per layer and what the runtime executes (runtime/step/recompute_run.py).

- `none`: keep every saved tensor from F to the backward;
- `selective`: re-run the scaled_dot_product_attention calls during the backward (Korthikanti et al. 2022), keeping
  the rest;
- `full`: keep only the stage's inputs and re-run its whole forward during the backward.
"""

from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")  # a plan's per-stage `recompute` (what the runtime executes)


def is_attention(target: object) -> bool:
    """Whether a call target (an FX node's, or a torch function) is scaled_dot_product_attention: the calls the
    runtime's selective recomputation re-runs (runtime/step/recompute_run.py)."""
    import torch  # here: plan files are read (RECOMPUTE_MODES) by commands that do not import torch

    aten = torch.ops.aten
    if target is torch.nn.functional.scaled_dot_product_attention or target is aten.scaled_dot_product_attention:
        return True
    return getattr(target, "overloadpacket", None) is aten.scaled_dot_product_attention


def unknown_recompute(mode: object) -> str | None:
    """Why `mode` is not a recompute mode (one line), or None when it is one."""
    if mode in RECOMPUTE_MODES:
        return None
    return f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}"
