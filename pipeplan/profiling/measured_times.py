"""A measured profile from the samples of its timing rounds (`profiling.rounds.Pools`): each layer's medians and
spreads, the whole-model references (forward, fused backward, split backward), how the samples were taken; and
which units to time again when the checks (`profiling.consistency`) find a part out of bounds. No torch.

Units are named by their layer, WHOLE_UNIT (the whole model's forward + loss and backward) and SPLIT_UNIT (every
layer but the first as one stage: its I and W with the first layer's are the whole model's split backward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.profiling.consistency import WHOLE, check
from pipeplan.profiling.profile import Measurement, PassSpread, Profile
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


@dataclass(frozen=True)
class TimedProfile:
    """`base` (every field but the times) timed by the pools of `repeats` rounds after `warmup`, read by `clock`."""

    base: Profile
    warmup: int
    repeats: int
    clock: str

    def profile(self, pools: Pools) -> Profile:
        layers = tuple(
            replace(
                layer,
                **{TIME_FIELDS[key]: value for key, value in pools.medians(layer.name).items()},
                spread=PassSpread(samples=pools.count(layer.name), **pools.spreads(layer.name)),
            )
            for layer in self.base.layers
        )
        whole = pools.medians(WHOLE_UNIT)
        return replace(
            self.base,
            layers=layers,
            whole_forward_ms=whole["forward"],
            whole_backward_ms=whole["backward"],
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

    def suspects(self, pools: Pools) -> set[str]:
        """The units to time again for what `check` finds out of bounds: a layer for its spread or peers; a
        reference for its spread; for a sum, every layer and the pass's reference (either side may be off)."""
        profile = self.profile(pools)
        every = {layer.name for layer in profile.layers}
        names: set[str] = set()
        for finding in check(profile):
            reference = SPLIT_UNIT if finding.pass_label in ("I", "W", "I+W") else WHOLE_UNIT
            if finding.layer is None:
                names |= every | {reference}
            else:
                names.add(reference if finding.layer == WHOLE else finding.layer)
        return {name for name in names if name in pools.samples}


def _split_backward_ms(first, pools: Pools) -> float | None:
    if SPLIT_UNIT not in pools.samples:
        return None
    rest = pools.medians(SPLIT_UNIT)
    return first.input_grad_ms + first.weight_grad_ms + sum(rest[key] for key in SPLIT_PASSES)


def _whole_spread(pools: Pools) -> PassSpread:
    whole = pools.spreads(WHOLE_UNIT)
    split = pools.spreads(SPLIT_UNIT) if SPLIT_UNIT in pools.samples else {}
    counts = [pools.count(WHOLE_UNIT)] + ([pools.count(SPLIT_UNIT)] if split else [])
    return PassSpread(
        samples=min(counts),
        forward=whole["forward"],
        backward=whole["backward"],
        **{key: split[key] for key in SPLIT_PASSES if key in split},
    )
