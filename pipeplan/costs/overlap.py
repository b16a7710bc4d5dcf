"""Communication overlap, as the engines do it: which transfers and collectives hide behind compute, and what a
step then costs after its last op.

`Overlap` holds Megatron-Core's options; its defaults are Megatron-Core's own (its dataclasses `ModelParallelConfig`
and `DistributedDataParallelConfig`: every overlap off; NeMo and Megatron-LM's benchmark recipes turn them on):

- `tensor`: tensor-parallel collectives pipelined with the linears they feed (`tp_comm_overlap`: Transformer
  Engine's userbuffers); used by `search.sharding`. Not free (`overlapped_ms`): while a collective runs it
  occupies `comm_sms` SMs (userbuffers' `num_sm`), which the matmuls beside it lose, and the linear runs as
  chunks (TE splits it into t ring-exchange steps, t / 2 with `aggregate`, or num_splits pipeline steps) that
  quantize and launch on their own; `--overlap tensor,sms=N` sets the SMs (default `COMM_SMS`), `chunks=N` the
  chunks (default t: TE's ring exchange);
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

from pipeplan.costs.optimizer import Numerics, static_split
from pipeplan.schedules.ops import Op
from pipeplan.schedules.simulate import StageCosts

OVERLAP_OPTIONS = ("tensor", "p2p", "grad_reduce", "param_gather")
# SMs an overlapped tensor-parallel collective occupies: the mean num_sm over the ten overlapped collectives of
# NeMo's H100 userbuffers config for Llama 3 70B, TP 4 (nemo/collections/llm/recipes/tp_overlap_configs/
# userbuffers.py, userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192: bulk 4, 24, 2, 4; ring exchange 1, 1, 1, 1;
# pipeline 24, 16: mean 7.8)
COMM_SMS = 8


@dataclass(frozen=True, kw_only=True)
class Overlap:
    tensor: bool = False
    p2p: bool = False
    grad_reduce: bool = False
    param_gather: bool = False
    comm_sms: int = COMM_SMS  # SMs an overlapped tensor-parallel collective takes from the matmuls beside it
    chunks: int = 0  # pieces an overlapped linear runs as (0: t, TE's ring exchange without aggregation)

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """`none`, `all`, or names from OVERLAP_OPTIONS joined by commas, optionally with `sms=N` (the SMs an
        overlapped tensor-parallel collective occupies) and `chunks=N` (the pieces an overlapped linear runs as)
        (the --overlap option)."""
        from pipeplan.errors import ConfigError

        parts = [part.strip().lower() for part in text.split(",") if part.strip()]
        choices = ", ".join(name.replace("_", "-") for name in OVERLAP_OPTIONS)
        if not parts:
            raise ConfigError(f"--overlap needs a value: none, all, or a comma list of {choices}")
        settings = {key: [p for p in parts if p.startswith(f"{key}=")] for key in ("sms", "chunks")}
        parts = [part for part in parts if not part.startswith(("sms=", "chunks="))]
        found = cls(
            comm_sms=_count(settings["sms"][-1], "SMs, e.g. sms=8", least=0) if settings["sms"] else COMM_SMS,
            chunks=_count(settings["chunks"][-1], "chunks, e.g. chunks=4", least=1) if settings["chunks"] else 0,
        )
        names = {"all": list(OVERLAP_OPTIONS), "none": []}.get(",".join(parts), [p.replace("-", "_") for p in parts])
        bad = [name for name in names if name not in OVERLAP_OPTIONS]
        if bad:
            raise ConfigError(f"--overlap {bad[0]!r} is not one of none, all, {choices} (or sms=N, chunks=N)")
        given = [key for key, values in settings.items() if values]
        if given and "tensor" not in names:
            raise ConfigError(f"--overlap {given[0]}= sets how overlapped tensor-parallel collectives run: add tensor")
        return replace(found, **{name: True for name in names})

    @property
    def label(self) -> str:
        names = [name.replace("_", "-") for name in OVERLAP_OPTIONS if getattr(self, name)]
        sms = [f"sms={self.comm_sms}"] if self.tensor and self.comm_sms != COMM_SMS else []
        chunks = [f"chunks={self.chunks}"] if self.tensor and self.chunks else []
        return ",".join(names + sms + chunks) if names else "none"

    def tensor_chunks(self, t: int) -> int:
        """The pieces an overlapped linear of a t-way tensor-parallel group runs as: `chunks`, or t."""
        return self.chunks or t


def _count(text: str, what: str, *, least: int) -> int:
    from pipeplan.errors import ConfigError

    key, _, value = text.partition("=")
    if not value.isdigit() or int(value) < least:
        raise ConfigError(f"--overlap {text!r}: {key}= takes a whole number of {what} (at least {least})")
    return int(value)


def overlapped_ms(comm_ms: float, work_ms: float, *, chunks: int, sm_share: float, split_ms: float = 0.0) -> float:
    """What a collective overlapped with `work_ms` of matmuls (Megatron's tp_comm_overlap) adds to its pass: the
    part that cannot hide (the first of its `chunks`, or its excess over the work), the compute its SMs take from
    the matmuls while both run (min(comm, work) x `sm_share`: comm_sms / the GPU's SMs), and `split_ms`, what
    running the matmuls as chunks costs over running them whole (their quantization and launches)."""
    if comm_ms <= 0:
        return 0.0
    return max(comm_ms - work_ms, comm_ms / chunks) + min(comm_ms, work_ms) * sm_share + split_ms


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


def update_bytes_per_param(numerics: Numerics) -> float:
    """`optimizer_bytes_per_param` under `numerics` (its static split; the weights are the master copy unless the
    mode keeps a main copy): what an update moves per parameter it owns."""
    return optimizer_bytes_per_param(static_split(numerics), not numerics.precision.main_weights)


def eager_update_ms(update_ms: Sequence[float], numerics: Numerics) -> list[float]:
    """Per device, a post-validated step's update (`run --post-validate`: runtime/train/post_validate.StepUndo): the
    undo copy of its weights and optimizer state (read and written once, 2 x (weights + state) bytes per parameter)
    before the update itself (`optimizer_bytes_per_param` bytes), both memory-bound at the same rate: the update's
    time `update_ms` scaled by their bytes (0 stays 0: a profile that does not know the memory rate)."""
    split = static_split(numerics)
    weights, _, state = split
    moved = update_bytes_per_param(numerics)
    scale = 1.0 + 2.0 * (weights + state) / moved if moved > 0 else 1.0
    return [ms * scale for ms in update_ms]


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


def reduced_ms(ops_end_ms: float, stages: Sequence[tuple[float, float, float]], overlap: Overlap) -> float:
    """When a device's gradient exchange is done: its stages' reductions run one after another, `stages` as (when
    the stage's last microbatch's backward starts, when it ends, its exchange ms) in the order they become ready.
    With `overlap.grad_reduce` a stage's reduction starts with its last microbatch's backward and ends no sooner
    than it (buckets go out as their gradients are done: each chunk's overlaps the cool-down); without, they all
    follow the device's last op (Megatron-Core's default, and pipeplan's runtime)."""
    done = ops_end_ms
    if not overlap.grad_reduce:
        return done + sum(sync for _, _, sync in stages)
    free = float("-inf")
    for start, end, sync in sorted(stages):
        free = max(free, start) + sync
        free = max(free, end)
        done = max(done, free)
    return done


def step_end_ms(devices: Sequence[DeviceStep], overlap: Overlap) -> float:
    """When the last device has reduced its gradients and updated its parameters (module docstring): each device
    one stage whose last backward is `overlap_window_ms` long and ends with its last op."""
    ends = []
    for device in devices:
        stage = (device.ops_end_ms - device.overlap_window_ms, device.ops_end_ms, device.sync_ms)
        ends.append(reduced_ms(device.ops_end_ms, [stage], overlap) + device.optimizer_ms)
    return max(ends, default=0.0)


@dataclass(frozen=True)
class Reductions:
    """`schedules.period.StepEnd.reduced` for a pipeline: per device the stages it holds, per stage its exchange ms
    (`reduced_ms`)."""

    device_stages: Sequence[Sequence[int]]
    stage_sync_ms: Sequence[float]
    overlap: Overlap
    num_microbatches: int

    def __call__(self, device: int, ops: Sequence[Op], starts: Sequence[float], ends: Sequence[float]) -> float:
        last = self.num_microbatches - 1
        window: dict[int, list[float]] = {}
        if self.overlap.grad_reduce:
            for o, start, end in zip(ops, starts, ends):
                for h in o.parts:  # (an overlapped F&B op's B half)
                    if h.kind != "F" and h.microbatch % self.num_microbatches == last:
                        span = window.setdefault(h.stage, [start, end])
                        span[0], span[1] = min(span[0], start), max(span[1], end)
        ops_end = ends[-1] if ends else 0.0
        stages = [(*window.get(s, (ops_end, ops_end)), self.stage_sync_ms[s]) for s in self.device_stages[device]]
        return reduced_ms(ops_end, stages, self.overlap)
