"""Communication overlap, as the engines do it: which transfers and collectives hide behind compute, and what a
step then costs after its last op.

`Overlap` holds Megatron-Core's options; its defaults are Megatron-Core's own (its dataclasses `ModelParallelConfig`
and `DistributedDataParallelConfig`: every overlap off; NeMo and Megatron-LM's benchmark recipes turn them on):

- `tensor`: tensor-parallel collectives pipelined with the linears they feed (`tp_comm_overlap`); used by
  `search.sharding`;
- `p2p`: pipeline sends and receives run beside compute (`overlap_p2p_comm`); off, a stage's device is busy for
  each transfer it sends (`blocking_transfers`);
- `grad_reduce`: each stage's gradient reduction (all-reduce, or the distributed optimizer's reduce-scatter)
  starts during its last microbatch's backward (`overlap_grad_reduce`);
- `param_gather`: the distributed optimizer's all-gather of updated parameters runs during the next step's first
  forward (`overlap_param_gather`).

The step (`step_end_ms`): every device ends its op list, then reduces the gradients of the stages it holds (the
exposed part only, with `grad_reduce`: what exceeds its last microbatch's backward) and applies the optimizer
(`optimizer_step_ms`); the step ends when the last device is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeplan.schedules.simulate import StageCosts

OVERLAP_OPTIONS = ("tensor", "p2p", "grad_reduce", "param_gather")


@dataclass(frozen=True, kw_only=True)
class Overlap:
    tensor: bool = False
    p2p: bool = False
    grad_reduce: bool = False
    param_gather: bool = False

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """`none`, `all`, or names from OVERLAP_OPTIONS joined by commas (the --overlap option)."""
        from pipeplan.errors import ConfigError

        text = text.strip().lower()
        if text in ("none", ""):
            return cls()
        if text == "all":
            return cls(**{name: True for name in OVERLAP_OPTIONS})
        names = [part.strip().replace("-", "_") for part in text.split(",") if part.strip()]
        bad = [name for name in names if name not in OVERLAP_OPTIONS]
        if bad:
            choices = ", ".join(name.replace("_", "-") for name in OVERLAP_OPTIONS)
            raise ConfigError(f"--overlap {bad[0]!r} is not one of none, all, {choices}")
        return cls(**{name: True for name in names})

    @property
    def label(self) -> str:
        names = [name.replace("_", "-") for name in OVERLAP_OPTIONS if getattr(self, name)]
        return ",".join(names) if names else "none"


def blocking_transfers(costs: StageCosts, crosses: Sequence[bool]) -> StageCosts:
    """`costs` with pipeline transfers that block their sender (`Overlap.p2p` off): boundary s's transfer joins
    stage s's forward (it sends the activations) and stage s + 1's input-gradient and fused backward (they send
    the gradient), where the boundary `crosses` devices; the transfers themselves then cost nothing more."""
    num = len(crosses) + 1
    full = costs.per_stage(num)
    send = [c if crossing else 0.0 for c, crossing in zip(full.comm_ms, crosses, strict=True)]
    forward = [f + (send[s] if s < num - 1 else 0.0) for s, f in enumerate(full.forward_ms)]
    back = [send[s - 1] if s > 0 else 0.0 for s in range(num)]
    return replace(
        full,
        forward_ms=tuple(forward),
        input_grad_ms=tuple(i + b for i, b in zip(full.input_grad_ms, back)),
        backward_ms=tuple(b + extra for b, extra in zip(full.backward_ms, back)),
        comm_ms=tuple(0.0 for _ in full.comm_ms),
    )


def optimizer_bytes_per_param(split: tuple[float, float, float], weights_are_master: bool) -> float:
    """Bytes an AdamW-style update moves per parameter it owns (a memory-bound kernel): its optimizer state (main
    copy and moments, `split[2]`) read and written, the gradient read, the weights written (read and written too
    when they are the master copy themselves: no separate main copy)."""
    weights, gradients, state = split
    return 2.0 * state + gradients + (2.0 if weights_are_master else 1.0) * weights


def optimizer_step_ms(param_count: float, bytes_per_param: float, bytes_per_s: float | None) -> float:
    """The update of `param_count` parameters at the device's memory rate (0 when it is not known)."""
    if not bytes_per_s:
        return 0.0
    return param_count * bytes_per_param / bytes_per_s * 1e3


@dataclass(frozen=True, kw_only=True)
class DeviceStep:
    """One device's end of step: its last op's end, its gradient exchange (ms), the window its last microbatch's
    backward gives an overlapped reduction, and its optimizer update."""

    ops_end_ms: float
    sync_ms: float
    overlap_window_ms: float = 0.0
    optimizer_ms: float = 0.0


def step_end_ms(devices: Sequence[DeviceStep], overlap: Overlap) -> float:
    """When the last device has reduced its gradients and updated its parameters (module docstring)."""
    ends = []
    for device in devices:
        sync = device.sync_ms
        if overlap.grad_reduce:
            sync = max(sync - device.overlap_window_ms, 0.0)
        ends.append(device.ops_end_ms + sync + device.optimizer_ms)
    return max(ends, default=0.0)
