"""Each stage's recomputation mode, settled on the simulator's exact byte peaks, and why each recomputing stage
needs it.

The partitioner chooses cuts and modes together (`partition.costs.screened_recompute`): each stage takes the
cheapest mode that passes its memory screen, a bound on the live bytes. Given the cuts, the choice is separable
but for the memory the stages of one device share, so the planner settles it per device, greedily, on the exact
peaks of the op lists it will run (`schedules.simulate.device_activation_peak`): stages in order of the time their
recomputation adds, largest first, each takes the cheapest mode (none, then selective or full by time) that keeps
every device holding it within the limit. A mode is only dropped when the peaks stay within memory, so every
stage that still recomputes needs it — `recompute_reasons` says by how much — and the step only gets faster (the
op order is unchanged; I and B get shorter). The partitioner's screen is a bound, so this keeps what it chose
unless the exact peaks leave room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipeplan.costs import (
    LayerArrays,
    device_totals,
    mode_offered,
    stage_memory_bytes,
    stage_op_ms,
    stage_recompute_ms,
    stages_per_device,
)
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.result import Partition
from pipeplan.predict.memory import with_recompute_bytes
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.ops import Op
from pipeplan.schedules.simulate import (
    MemoryCosts,
    activation_deltas,
    activation_rises,
    device_activation_peak,
    stage_value,
)
from pipeplan.units import format_bytes


class _Peaks:
    """Exact activation peaks of one pipeline's devices for a choice of modes (static bytes added)."""

    def __init__(
        self, part: Partition, arrays: LayerArrays, device_ops, static: Sequence[float], per_layer: bool
    ) -> None:
        self.arrays, self.ranges, self.static, self.per_layer = arrays, part.stage_ranges, static, per_layer
        self.ops = device_ops  # Ops, per device
        self.base = MemoryCosts(
            activation_bytes=tuple(float(arrays.span("activation", a, b)) for a, b in self.ranges),
            input_grad_freed_bytes=(0.0,) * len(self.ranges),  # each mode's own: with_recompute_bytes
        )

    def of(self, modes: Sequence[str], devices: Sequence[int]) -> list[float]:
        memory = with_recompute_bytes(self.base, self.arrays, self.ranges, modes, per_layer=self.per_layer)
        delta, rise = activation_deltas(memory, len(modes)), activation_rises(memory, len(modes))
        return [self.static[d] + device_activation_peak(self.ops[d], delta, rise) for d in devices]


def settle_recompute(
    part: Partition, profile: Profile, pipe, static: Sequence[float], limit: float, config: PartitionConfig
) -> Partition:
    """`part` with each recomputing stage lowered to the cheapest mode the exact peaks of `pipe`'s op lists
    (static bytes per device `static`) allow within `limit` (see the module docstring)."""
    modes = [s.recompute for s in part.stages]
    if all(m == "none" for m in modes):
        return part
    arrays = LayerArrays.from_profile(profile)
    peaks = _Peaks(part, arrays, pipe.op_lists(), static, config.layer_recompute)
    ms = [_mode_ms(arrays, config, a, b) for a, b in part.stage_ranges]
    for stage in sorted(range(part.num_stages), key=lambda s: -ms[s][modes[s]]):
        cheaper = sorted((t, m) for m, t in ms[stage].items() if t < ms[stage][modes[stage]])
        devices = pipe.stage_devices(stage)
        for _, mode in cheaper:
            trial = [*modes[:stage], mode, *modes[stage + 1 :]]
            if max(peaks.of(trial, devices)) <= limit:
                modes = trial
                break
    if modes == [s.recompute for s in part.stages]:
        return part
    return with_modes(part, arrays, modes, config)


def _mode_ms(arrays: LayerArrays, config: PartitionConfig, first: int, last: int) -> dict[str, float]:
    """Recompute ms of each mode stage [first..last] may take."""
    return {
        mode: float(stage_recompute_ms(arrays, mode, first, last))
        for mode in config.recompute_modes
        if mode_offered(arrays, mode, first, last)
    }


def with_modes(part: Partition, arrays: LayerArrays, modes: Sequence[str], config: PartitionConfig) -> Partition:
    """`part` with the stages' recomputation `modes`: their I and B times, screened memory and stage times (the
    DP's term, shifted by the change in recompute time per replica: exact for one-level partitions, where a
    lower compute time leaves a transfer-bound stage at its transfer time)."""
    stages = []
    for stage, mode in zip(part.stages, modes, strict=True):
        if mode == stage.recompute:
            stages.append(stage)
            continue
        a, b = stage.first_layer, stage.last_layer
        ops = stage_op_ms(arrays, a, b, mode)
        held = (stage.inflight_microbatches, stage.inflight_before_input_grad)
        group = stage.replicas * config.data_parallel
        memory = stage_memory_bytes(arrays, config, a, b, 1, held, mode=mode, group_size=group)
        stages.append(
            replace(
                stage,
                recompute=mode,
                recompute_ms=ops.recompute,
                input_grad_ms=ops.input_grad,
                weight_grad_ms=ops.weight_grad,
                backward_ms=ops.backward,
                time_ms=max(stage.time_ms + (ops.recompute - stage.recompute_ms) / stage.replicas, stage.comm_ms),
                memory_bytes=int(-(-float(memory) // 1)),
            )
        )
    held_by = stages_per_device([s.devices for s in stages])
    return replace(
        part,
        stages=tuple(stages),
        objective_ms=max(s.time_ms for s in stages),
        device_load_ms=tuple(float(ms) for ms in device_totals([s.time_ms for s in stages], held_by)),
        device_memory_bytes=tuple(device_totals([s.memory_bytes for s in stages], held_by)),
    )


def recompute_reasons(memory: MemoryCosts, modes: Sequence[str], device_ops, limit: float) -> list[str]:
    """One line per recomputing stage: its mode and the peak its busiest device would reach without it (the
    others as chosen), e.g. `stage 3 recomputes (full): without it needs 81.2 GiB of 80 GiB`. `memory`: the
    candidate's MemoryCosts (static bytes per device), `device_ops`: one pipeline's op lists."""
    if memory.kept_bytes is None:
        return []
    ops = [[Op.parse(text) for text in row] for row in device_ops]
    lines = []
    for stage, mode in enumerate(modes):
        if mode == "none":
            continue
        without = _without_recompute(memory, stage, len(modes))
        delta, rises = activation_deltas(without, len(modes)), activation_rises(without, len(modes))
        holders = [d for d, row in enumerate(ops) if any(h.stage == stage for o in row for h in o.parts)]
        need = max(stage_value(memory.static_bytes, d) + device_activation_peak(ops[d], delta, rises) for d in holders)
        lines.append(
            f"stage {stage} recomputes ({mode}): without it needs {format_bytes(need)} of {format_bytes(limit)}"
        )
    return lines


def _without_recompute(memory: MemoryCosts, stage: int, num_stages: int) -> MemoryCosts:
    """`memory` with `stage` keeping all its saved bytes (mode none)."""
    held = memory.activation_bytes if memory.kept_bytes is None else memory.kept_bytes
    kept = [stage_value(held, s) for s in range(num_stages)]
    rise = list(activation_rises(memory, num_stages)["B"])  # the re-created bytes (B's rise is exactly them)
    freed = [stage_value(memory.input_grad_freed_bytes, s) for s in range(num_stages)]
    kept[stage], rise[stage] = stage_value(memory.activation_bytes, stage), 0.0
    if stage == 0:
        freed[0] = 0.0  # the model's first stage frees nothing at I without recomputation (stage_freed_bytes)
    return replace(memory, kept_bytes=tuple(kept), recompute_bytes=tuple(rise), input_grad_freed_bytes=tuple(freed))
