"""Can a measured profile's times be trusted? The checks the profiler re-measures by, its summary prints and
`pipeplan plan` warns by, computed from what the profile stores (one formula; no torch):

- sums: per pass, the layers' sum over the whole model's time: F over the whole forward (with the loss), I + W
  over the whole model's split backward (`Profile.whole_split_backward_ms`: the first layer, then the rest as one
  stage, through the same split backward; a fused backward is the wrong reference, the split pays for its two
  walks), B over the whole fused backward; within SUM_BOUNDS;
- spreads: each layer's F, I, W and B samples and the whole-model references' (`PassSpread`: interquartile range
  / median) within SPREAD_BOUND; a layer's pass shorter than a typical layer's (the median layer's) of that pass
  gets the bound scaled up by typical / its median (its interquartile range within 20% of a typical layer's time:
  a small layer's spread moves a stage no more than that, and a 0.2 ms embedding's timings scatter more than a
  block's);
- peers: layers doing the same work (the same parameters, FLOPs, saved and output bytes: a model's repeated
  blocks, three or more) take their median's time within SUM_BOUNDS, per pass (the lower median of an even count:
  a disturbance only slows, so with half the blocks slowed the faster half is the reference); a pass taking under
  MINOR_SHARE of a typical layer's is not held to it.
Profiles timed in fewer than MIN_CHECKED_ROUNDS rounds (a quick look, e.g. `--repeats 1`) are not checked: one
sample has no spread; the summary says so. Profiles written before schema 4 are checked on what they hold (sums of
F and B, peers). Only measured profiles are checked.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pipeplan.cluster import cpu_threads_per_rank
from pipeplan.console import warn
from pipeplan.profiling.profile import LayerProfile, PassSpread, Profile

SUM_BOUNDS = (0.8, 1.25)
SPREAD_BOUND = 0.20
MINOR_SHARE = 0.1
MIN_CHECKED_ROUNDS = 3
MIN_PEERS = 3
WHOLE = "whole model"
PASSES = (("F", "forward"), ("I", "input_grad"), ("W", "weight_grad"), ("B", "backward"))
PASS_LABELS = tuple(label for label, _ in PASSES)
SHOWN = 3  # findings named in a warning line


@dataclass(frozen=True)
class Finding:
    """One check out of bounds: `layer` None for a sum (the whole pass), WHOLE for a reference's spread."""

    check: str  # sum | spread | peers
    pass_label: str  # F, I, W, B, I+W
    value: float
    layer: str | None = None
    bound: float = SPREAD_BOUND  # a spread's (scaled for a small layer's pass)

    @property
    def excess(self) -> float:
        """How far past its bound (1 = at the bound): what orders findings, worst first."""
        if self.check == "spread":
            return self.value / self.bound
        low, high = SUM_BOUNDS
        return max(self.value / high, low / self.value) if self.value > 0 else float("inf")

    def describe(self) -> str:
        low, high = SUM_BOUNDS
        if self.check == "sum":
            return f"layer sums / whole {self.pass_label} {self.value:.2f} (bound {low:.2f}-{high:.2f})"
        if self.check == "spread":
            return f"{self.layer} {self.pass_label} spread {self.value:.0%} (bound {self.bound:.0%})"
        return f"{self.layer} {self.pass_label} {self.value:.2f}x its peers' median (bound {low:.2f}-{high:.2f})"


def sums_over_whole(profile: Profile) -> dict[str, float | None]:
    """Per pass, the layers' sum over the whole-model reference (None: no reference recorded)."""
    layers = profile.layers
    forward = sum(layer.forward_ms for layer in layers)
    split = sum(layer.input_grad_ms + layer.weight_grad_ms for layer in layers)
    fused = sum(layer.backward_ms for layer in layers)

    def over(total: float, whole: float | None) -> float | None:
        return total / whole if whole else None

    return {
        "F": over(forward, profile.whole_forward_ms),
        "I+W": over(split, profile.whole_split_backward_ms),
        "B": over(fused, profile.whole_backward_ms),
    }


def is_checked(profile: Profile) -> bool:
    measurement = profile.measurement
    if profile.provenance.source != "measured":
        return False
    return measurement is None or measurement.rounds >= MIN_CHECKED_ROUNDS


def check(profile: Profile) -> list[Finding]:
    """Every check out of bounds, worst first (empty: all within, or not checked, see is_checked)."""
    if not is_checked(profile):
        return []
    low, high = SUM_BOUNDS
    findings = [
        Finding("sum", label, ratio)
        for label, ratio in sums_over_whole(profile).items()
        if ratio is not None and not low <= ratio <= high
    ]
    typical = _typical(profile.layers)
    for layer in profile.layers:
        findings += _spread_findings(layer.name, layer.spread, _spread_bounds(layer, typical))
    if profile.measurement is not None and profile.measurement.whole_spread is not None:
        findings += _spread_findings(WHOLE, profile.measurement.whole_spread, dict.fromkeys(PASS_LABELS, SPREAD_BOUND))
    findings += _peer_findings(profile.layers, typical)
    return sorted(findings, key=lambda finding: -finding.excess)


def _typical(layers: tuple[LayerProfile, ...]) -> dict[str, float]:
    """A typical layer's time of each pass: the (lower) median layer's (one layer off by 100x does not move it)."""
    return {label: statistics.median_low(getattr(x, f"{name}_ms") for x in layers) for label, name in PASSES}


def _spread_bounds(layer: LayerProfile, typical: dict[str, float]) -> dict[str, float]:
    """Per pass, the spread `layer` is held to: SPREAD_BOUND, scaled up for a pass shorter than a typical layer's
    (none for a pass that takes no time)."""
    bounds = {}
    for label, name in PASSES:
        median = getattr(layer, f"{name}_ms")
        if median > 0:
            bounds[label] = SPREAD_BOUND * max(1.0, typical[label] / median)
    return bounds


def _spread_findings(name: str, spread: PassSpread | None, bounds: dict[str, float]) -> list[Finding]:
    if spread is None:
        return []
    return [
        Finding("spread", label, getattr(spread, field), layer=name, bound=bounds[label])
        for label, field in PASSES
        if label in bounds and getattr(spread, field) > bounds[label]
    ]


def _peer_findings(layers: tuple[LayerProfile, ...], typical: dict[str, float]) -> list[Finding]:
    groups: dict[tuple, list[LayerProfile]] = {}
    for layer in layers:
        key = (layer.param_count, layer.flops, layer.activation_bytes, layer.output_bytes)
        groups.setdefault(key, []).append(layer)
    findings = []
    low, high = SUM_BOUNDS
    for group in groups.values():
        if len(group) < MIN_PEERS:
            continue
        for label, name in PASSES:
            middle = statistics.median_low(getattr(x, f"{name}_ms") for x in group)
            if middle <= 0 or middle < MINOR_SHARE * typical[label]:
                continue
            for layer in group:
                ratio = getattr(layer, f"{name}_ms") / middle
                if not low <= ratio <= high:
                    findings.append(Finding("peers", label, ratio, layer=layer.name))
    return findings


def findings_text(findings: list[Finding]) -> str:
    shown = ", ".join(finding.describe() for finding in findings[:SHOWN])
    return shown + (f" (+{len(findings) - SHOWN} more)" if len(findings) > SHOWN else "")


def remedy(profile: Profile) -> str:
    if profile.provenance.device.startswith("cuda"):
        return "is another process using the GPU? profile again on an idle one"
    return (
        "on a busy CPU profile again with --threads 1 --timer cpu (process CPU time: waiting for a core is not "
        "counted) or on an idle machine"
    )


def consistency_line(profile: Profile) -> str:
    """The summary's line: the sums per pass, the largest spread, and what is out of bounds."""
    if profile.provenance.source != "measured":
        return ""
    if not is_checked(profile):
        rounds = profile.measurement.rounds if profile.measurement else 0
        return f"timings not checked: {rounds} timed round(s) (--repeats {MIN_CHECKED_ROUNDS} or more checks them)"
    sums = ", ".join(f"{label} {ratio:.2f}" for label, ratio in sums_over_whole(profile).items() if ratio)
    parts = [f"layer sums / whole: {sums or 'no whole-model reference'}"]
    widest = _widest_spread(profile)
    if widest is not None:
        spread, bound, which = widest
        parts.append(f"widest spread (IQR/median) {which} {spread:.0%} (bound {bound:.0%})")
    measurement = profile.measurement
    if measurement is not None:
        parts.append(f"{measurement.rounds} rounds, {measurement.attempts} measurement(s)")
    findings = check(profile)
    parts.append(f"out of bounds: {findings_text(findings)}" if findings else "all within bounds")
    return "; ".join(parts)


def _widest_spread(profile: Profile) -> tuple[float, float, str] | None:
    """The layer pass whose spread comes closest to (or goes furthest past) its bound: (spread, bound, which)."""
    typical = _typical(profile.layers)
    spreads = [
        (getattr(layer.spread, field) / bound, getattr(layer.spread, field), bound, f"{layer.name} {label}")
        for layer in profile.layers
        if layer.spread is not None
        for label, field in PASSES
        if (bound := _spread_bounds(layer, typical).get(label)) is not None
    ]
    widest = max(spreads, default=None)
    return None if widest is None else widest[1:]


def out_of_bounds_message(profile: Profile) -> str | None:
    """The one-line warning for a profile whose checks are out of bounds (None: within, or not checked)."""
    findings = check(profile)
    if not findings:
        return None
    measurement = profile.measurement
    after = f" after {measurement.attempts} measurements" if measurement and measurement.attempts > 1 else ""
    return f"profile timings out of bounds{after}: {findings_text(findings)}; {remedy(profile)}"


def warn_if_out_of_bounds(profile: Profile, where: str) -> None:
    """What `pipeplan plan` says of a profile file out of bounds: the profiler's warning again."""
    message = out_of_bounds_message(profile)
    if message:
        warn(f"{where}: {message} (plans from it predict with these times)")


def warn_if_other_threads(profile: Profile, ranks: int) -> None:
    """One warning when a CPU profile was measured with another thread count than each of `ranks` ranks on this
    machine will run with (cluster.cpu_threads_per_rank): its op costs are then not the run's."""
    threads, share = profile.provenance.threads, cpu_threads_per_rank(ranks)
    if profile.provenance.device == "cpu" and threads is not None and threads != share:
        warn(
            f"the profile was measured with {threads} CPU thread(s); each of this plan's {ranks} rank(s) on this "
            f"machine will run with {share}, so its op costs are not the run's: profile again with --threads "
            f"{share}, or refine the plan from its first run (pipeplan refine)"
        )
