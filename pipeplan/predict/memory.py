"""What a step holds, as the simulator counts it, one rule each for the search's candidates and a plan's
re-simulation: static bytes per parameter of each stage and per device (weights, gradients, optimizer state; ZeRO-1
splits a stage's state over its holders, its routed experts' over 1/ep of them; `run --post-validate`'s undo copy),
the per-stage activation costs (recomputation's kept and re-created bytes, what I frees), asynchronous schedules'
stashed weight copies, and the activation budget zb-auto generates its schedule under."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeplan.costs import (
    LayerArrays,
    Numerics,
    bytes_per_param,
    device_static_bytes,
    stage_freed_bytes,
    stage_kept_bytes,
    stage_recompute_bytes,
    stage_static_per_param,
    static_bytes,
    static_split,
)
from pipeplan.costs.optimizer import undo_copy_bytes
from pipeplan.partition.result import Partition
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import MemoryCosts


@dataclass(frozen=True, kw_only=True)
class StaticRule:
    """How a pipeline's stages hold their parameters: `numerics`, the ZeRO stage, the ranks holding a stage replica's
    parameters (`holders`: pipelines x context-parallel ranks) and the expert parallelism `ep` its routed experts
    split over."""

    numerics: Numerics
    zero: int = 0
    holders: int = 1
    ep: int = 1

    def per_param(
        self, param_counts: Sequence[int], expert_counts: Sequence[int], replicas: Sequence[int]
    ) -> float | tuple[float, ...]:
        """Static bytes per parameter: one figure, or with ZeRO-1 one per stage (its optimizer state split over its
        replicas x `holders`; its routed experts' over 1/ep of them: `costs.stage_static_per_param`)."""
        per_param = bytes_per_param(self.numerics, zero=self.zero)  # checks the optimizer (ZeRO-1 needs a name)
        if not self.zero:
            return per_param
        split = static_split(self.numerics)
        return tuple(
            stage_static_per_param(split, count, experts, r * self.holders, self.zero, self.ep)
            for count, experts, r in zip(param_counts, expert_counts, replicas, strict=True)
        )

    def device_bytes(
        self,
        param_counts: Sequence[int],
        expert_counts: Sequence[int],
        replicas: Sequence[int],
        device_stages: Sequence[Sequence[int]],
    ) -> tuple[float, ...]:
        """Per pipeline device, the static bytes of the stages it holds."""
        per_param = self.per_param(param_counts, expert_counts, replicas)
        return device_static_bytes(param_counts, device_stages, per_param)


def stage_expert_counts(part: Partition, profile: Profile) -> tuple[int, ...]:
    """Per stage, its routed-expert parameters."""
    return tuple(
        sum(la.expert_param_count for la in profile.layers[s.first_layer : s.last_layer + 1]) for s in part.stages
    )


def with_undo_copy(
    memory: MemoryCosts, param_counts: Sequence[int], device_stages: Sequence[Sequence[int]], numerics: Numerics
) -> MemoryCosts:
    """`memory` with the undo copy `run --post-validate` keeps (`costs.optimizer.undo_copy_bytes`) in the static
    bytes of each device."""
    undo = undo_copy_bytes(param_counts, device_stages, numerics)
    static = memory.static_bytes
    assert isinstance(static, tuple), "static bytes per device"
    return replace(memory, static_bytes=tuple(b + u for b, u in zip(static, undo)))


def with_weight_versions(
    memory: MemoryCosts, name: str, param_counts: Sequence[int], numerics: Numerics
) -> MemoryCosts:
    """`memory` with each stage's bytes per stashed weight copy when `name` is asynchronous: its parameters in the
    precision's parameter dtype (what `run` stashes)."""
    if not schedule_info(name).asynchronous:
        return memory
    size = numerics.precision.param_bytes
    return replace(memory, weight_version_bytes=tuple(float(count * size) for count in param_counts))


def with_recompute_bytes(
    memory: MemoryCosts,
    arrays: LayerArrays,
    ranges: Sequence[tuple[int, int]],
    modes: Sequence[str],
    *,
    per_layer: bool = False,
) -> MemoryCosts:
    """`memory` with each stage's kept, re-created and I-freed bytes under its mode (`costs.recompute`; `per_layer`:
    full recomputation layer by layer)."""
    pairs = list(zip(ranges, modes, strict=True))
    return replace(
        memory,
        kept_bytes=tuple(float(stage_kept_bytes(arrays, m, a, b, per_layer=per_layer)) for (a, b), m in pairs),
        recompute_bytes=tuple(
            float(stage_recompute_bytes(arrays, m, a, b, per_layer=per_layer)) for (a, b), m in pairs
        ),
        input_grad_freed_bytes=tuple(float(stage_freed_bytes(arrays, m, a, b)) for (a, b), m in pairs),
    )


def memory_costs(part: Partition, profile: Profile, *, per_layer: bool = False) -> MemoryCosts:
    """Per stage: one microbatch's saved activation bytes and the part of them I frees (none on the model's first
    stage, `costs.stage_freed_bytes`), and under recomputation what each stage keeps until its backward and
    re-creates while it runs (`costs.recompute`; static bytes per device are added once the layout is known:
    `StaticRule.device_bytes`)."""
    arrays = LayerArrays.from_profile(profile)
    ranges = part.stage_ranges
    memory = MemoryCosts(
        activation_bytes=tuple(float(arrays.span("activation", a, b)) for a, b in ranges),
        input_grad_freed_bytes=tuple(float(stage_freed_bytes(arrays, "none", a, b)) for a, b in ranges),
    )
    if all(s.recompute == "none" for s in part.stages):
        return memory
    return with_recompute_bytes(memory, arrays, ranges, [s.recompute for s in part.stages], per_layer=per_layer)


def activation_budget(part: Partition, per_param: float | tuple[float, ...], limit: float) -> float:
    """Live activation bytes zb-auto (one stage per device) may use per device: the memory `limit` less the largest
    stage's static bytes."""
    each = [per_param] * part.num_stages if isinstance(per_param, float) else per_param
    largest = max(float(static_bytes(s.param_count, each[s.index])) for s in part.stages)
    return max(limit - largest, 1e-9)
