"""A measured profile from the samples of its timing rounds (`profiling.rounds.Pools`): each layer's medians and
spreads, the whole-model references (forward, fused backward, split backward), how the samples were taken; and
which units to time again when the checks (`profiling.consistency`) find a part out of bounds. No torch.

Units are named by their layer, WHOLE_UNIT (the whole model's forward + loss and backward) and SPLIT_UNIT (every
layer but the first as one stage: its I and W with the first layer's are the whole model's split backward); pools
without the references (e.g. samples gathered another way, per layer) give a profile without them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeplan.profiling.consistency import WHOLE, check
from pipeplan.profiling.profile import LayerProfile, Measurement, PassSpread, Profile
from pipeplan.profiling.rounds import Pools

WHOLE_UNIT = WHOLE
SPLIT_UNIT = f"{WHOLE} (split)"
TIME_FIELDS = {
    "forward": "forward_ms",
    "input_grad": "input_grad_ms",
    "weight_grad": "weight_grad_ms",
    "backward": "backward_ms",
    "full_recompute": "full_recompute_ms",
    "selective_recompute": "selective_recompute_ms",
}
SPLIT_PASSES = ("input_grad", "weight_grad")


def _timed_layer(layer: LayerProfile, pools: Pools) -> LayerProfile:
    """`layer` with its pools' median times and their spread."""
    times: dict[str, Any] = {TIME_FIELDS[key]: value for key, value in pools.medians(layer.name).items()}
    return replace(layer, **times, spread=PassSpread(samples=pools.count(layer.name), **pools.spreads(layer.name)))


@dataclass(frozen=True)
class TimedProfile:
    """`base` (every field but the times) timed by the pools of `repeats` rounds after `warmup`, read by `clock`."""

    base: Profile
    warmup: int
    repeats: int
    clock: str

    def profile(self, pools: Pools) -> Profile:
        layers = tuple(_timed_layer(layer, pools) for layer in self.base.layers)
        whole = pools.medians(WHOLE_UNIT) if WHOLE_UNIT in pools.samples else {}
        return replace(
            self.base,
            layers=layers,
            whole_forward_ms=whole.get("forward"),
            whole_backward_ms=whole.get("backward"),
            whole_split_backward_ms=_split_backward_ms(layers[0], pools),
            measurement=Measurement(
                rounds=self.repeats,
                warmup=self.warmup,
                attempts=pools.attempts,
                remeasured=tuple(pools.remeasured),
                outliers_replaced=pools.outliers_replaced,
                clock=self.clock,
                whole_spread=_whole_spread(pools),
            ),
        )

    def suspects(self, pools: Pools) -> list[str]:
        """The units to time again for what `check` finds out of bounds, worst first: a layer for its spread or
        against its peers; a reference for its spread, or for its pass's sum (a layer off throughout shows in its
        spread or against its peers; a sum out of bounds with every layer steady points at the reference)."""
        names = []
        for finding in check(self.profile(pools)):
            reference = SPLIT_UNIT if finding.pass_label in ("I", "W", "I+W") else WHOLE_UNIT
            names.append(reference if finding.layer in (None, WHOLE) else finding.layer)
        return [name for name in dict.fromkeys(names) if name in pools.samples]


def _split_backward_ms(first, pools: Pools) -> float | None:
    if SPLIT_UNIT not in pools.samples:
        return None
    rest = pools.medians(SPLIT_UNIT)
    return first.input_grad_ms + first.weight_grad_ms + sum(rest[key] for key in SPLIT_PASSES)


def _whole_spread(pools: Pools) -> PassSpread | None:
    """The references' spreads: the whole model's F and B, the split reference's I and W (None: no reference)."""
    references = [unit for unit in (WHOLE_UNIT, SPLIT_UNIT) if unit in pools.samples]
    if not references:
        return None
    whole = pools.spreads(WHOLE_UNIT) if WHOLE_UNIT in pools.samples else {}
    split = pools.spreads(SPLIT_UNIT) if SPLIT_UNIT in pools.samples else {}
    return PassSpread(
        samples=min(pools.count(unit) for unit in references),
        **{key: whole[key] for key in ("forward", "backward") if key in whole},
        **{key: split[key] for key in SPLIT_PASSES if key in split},
    )
