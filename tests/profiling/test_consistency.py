"""Checks of a measured profile's timings (profiling.consistency) on profiles built by hand, older files, and
`pipeplan plan` warning again on a profile file out of bounds (without importing torch's work: pure)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.profiling.consistency import (
    SPREAD_BOUND,
    check,
    consistency_line,
    out_of_bounds_message,
    sums_over_whole,
)
from pipeplan.profiling.measured_times import SPLIT_UNIT, WHOLE_UNIT, TimedProfile
from pipeplan.profiling.profile import LayerProfile, Measurement, PassSpread, Profile, Provenance
from pipeplan.profiling.rounds import Pools

EVEN = PassSpread(samples=5, forward=0.05, input_grad=0.05, weight_grad=0.05, backward=0.05)


def _layer(name: str, ms: float, *, params: int = 1000, spread: PassSpread | None = EVEN) -> LayerProfile:
    return LayerProfile(
        name=name,
        forward_ms=ms,
        input_grad_ms=ms,
        weight_grad_ms=ms,
        backward_ms=1.5 * ms,
        activation_bytes=4096,
        activation_freed_by_input_grad_bytes=1024,
        param_count=params,
        param_bytes=4 * params,
        output_bytes=2048,
        flops=1e6 * params,
        spread=spread,
    )


def _gpt_like(blocks: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0), *, rounds: int = 5, **changes) -> Profile:
    """embed (small), blocks, head; whole-model references that the layer sums match exactly."""
    layers = (_layer("embed", 0.2, params=10), *(_layer(f"blocks.{i}", ms) for i, ms in enumerate(blocks)))
    layers = (*layers, _layer("head", 0.5, params=500))
    forward = sum(x.forward_ms for x in layers)
    profile = Profile(
        layers=layers,
        cut_bytes=(2048,) * (len(layers) - 1),
        provenance=Provenance(source="measured", model="gpt", loss_in_last_layer=True),
        whole_forward_ms=forward,
        whole_backward_ms=1.5 * forward,
        whole_split_backward_ms=2 * forward,
        measurement=Measurement(rounds=rounds, warmup=2, whole_spread=EVEN),
    )
    return replace(profile, **changes)


def test_a_consistent_profile_has_no_findings_and_says_so():
    profile = _gpt_like()
    assert sums_over_whole(profile) == {"F": pytest.approx(1.0), "I+W": pytest.approx(1.0), "B": pytest.approx(1.0)}
    assert check(profile) == [] and out_of_bounds_message(profile) is None
    line = consistency_line(profile)
    assert "layer sums / whole: F 1.00, I+W 1.00, B 1.00" in line and line.endswith("all within bounds")


def test_the_split_backward_is_checked_against_the_whole_models_split_not_the_fused_backward():
    profile = _gpt_like()  # I+W is 4/3 of the whole fused backward: what a split costs, not an error
    assert sum(x.input_grad_ms + x.weight_grad_ms for x in profile.layers) / profile.whole_backward_ms > 1.25
    assert check(profile) == []
    off = replace(profile, whole_split_backward_ms=profile.whole_split_backward_ms / 1.5)
    assert [f.describe() for f in check(off)] == ["layer sums / whole I+W 1.50 (bound 0.80-1.25)"]


def test_the_issues_example_names_the_block_first():
    """One block at 161 ms against ~1 ms for its neighbours, F sums / whole 6.09 (issue 37)."""
    layers = _gpt_like().layers
    slow = replace(layers[2], forward_ms=161.0)
    profile = _gpt_like(layers=(*layers[:2], slow, *layers[3:]))
    findings = check(profile)
    assert findings[0].describe() == "blocks.1 F 161.00x its peers' median (bound 0.80-1.25)"
    assert any(f.check == "sum" and f.pass_label == "F" for f in findings)
    message = out_of_bounds_message(profile)
    assert message.startswith("profile timings out of bounds: blocks.1 F 161.00x") and "\n" not in message
    assert "--threads 1" in message


def test_spreads_over_the_bound_and_the_wider_bound_of_a_small_layer():
    profile = _gpt_like()
    wide = replace(EVEN, backward=0.3)
    blocks = replace(profile.layers[1], spread=wide)
    assert [f.describe() for f in check(replace(profile, layers=(profile.layers[0], blocks, *profile.layers[2:])))] == [
        "blocks.0 B spread 30% (bound 20%)"
    ]
    # embed's F is 0.2 ms against a typical (median) layer's 1.0 ms: its bound is 20% x 1.0 / 0.2 = 100%
    embed = profile.layers[0]
    for value, found in ((0.9, False), (1.1, True)):
        scattered = replace(embed, spread=replace(EVEN, forward=value))
        findings = check(replace(profile, layers=(scattered, *profile.layers[1:])))
        assert bool(findings) == found
    assert findings[0].bound == pytest.approx(SPREAD_BOUND * 1.0 / 0.2)
    whole = replace(profile.measurement, whole_spread=replace(EVEN, weight_grad=0.4))
    assert [f.describe() for f in check(replace(profile, measurement=whole))] == [
        "whole model W spread 40% (bound 20%)"
    ]


def test_quick_analytic_and_older_profiles():
    quick = _gpt_like(blocks=(1.0, 9.0, 1.0), rounds=1)
    assert check(quick) == [] and consistency_line(quick).startswith("timings not checked: 1 timed round(s)")
    analytic = replace(quick, provenance=Provenance(source="analytic"), measurement=None)
    assert check(analytic) == [] and consistency_line(analytic) == ""
    older = _gpt_like(blocks=(1.0, 9.0, 1.0), measurement=None, whole_split_backward_ms=None, whole_forward_ms=2.0)
    older = replace(older, layers=tuple(replace(x, spread=None) for x in older.layers))
    assert {(f.check, f.pass_label, f.layer) for f in check(older)} >= {("peers", "F", "blocks.1"), ("sum", "F", None)}
    assert sums_over_whole(older)["I+W"] is None


def test_schema_3_files_load_without_the_new_fields(tmp_path):
    data = _gpt_like().to_dict()
    data["schema_version"] = 3
    for key in ("whole_split_backward_ms", "measurement"):
        del data[key]
    for layer in data["layers"]:
        del layer["spread"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = Profile.load(path)
    assert loaded.measurement is None and loaded.whole_split_backward_ms is None
    assert all(layer.spread is None for layer in loaded.layers)
    path.write_text(json.dumps(_gpt_like().to_dict()))
    assert Profile.load(path) == _gpt_like()


def test_plan_on_a_profile_out_of_bounds_warns_again(tmp_path):
    layers = _gpt_like().layers
    profile = _gpt_like(layers=(*layers[:2], replace(layers[2], forward_ms=161.0), *layers[3:]))
    path = tmp_path / "gpt.json"
    profile.save(path)
    args = ["plan", "--profile", str(path), "--devices", "2", "--memory-per-device", "1GiB", "-o", str(tmp_path / "p")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "out of bounds" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: profile file {str(path)!r}: profile timings")
    assert "blocks.1 F 161.00x its peers' median" in warnings[0]
    _gpt_like().save(path)
    quiet = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "q")])
    assert quiet.exit_code == 0 and "out of bounds" not in quiet.stderr


def test_samples_become_medians_spreads_and_the_split_reference():
    """Pools (unit -> pass -> samples) to a Profile: what the profiler does, and what samples gathered another way
    (per layer, no whole-model references) give."""
    base = _gpt_like(whole_forward_ms=None, whole_backward_ms=None, whole_split_backward_ms=None, measurement=None)
    pools = Pools()
    for layer in base.layers:
        for ms in (1.0, 2.0, 3.0, 4.0, 5.0):
            pools.add(layer.name, {"forward": ms, "input_grad": 2 * ms, "weight_grad": ms, "backward": 3 * ms})
    timed = TimedProfile(base=base, warmup=1, repeats=5, clock="wall")
    alone = timed.profile(pools)
    assert alone.whole_forward_ms is None and alone.measurement.whole_spread is None
    first = alone.layers[0]
    assert (first.forward_ms, first.input_grad_ms, first.backward_ms) == (3.0, 6.0, 9.0)
    assert first.spread == PassSpread(samples=5, forward=2 / 3, input_grad=2 / 3, weight_grad=2 / 3, backward=2 / 3)
    for _ in range(5):
        pools.add(WHOLE_UNIT, {"forward": 18.0, "backward": 54.0})
        pools.add(SPLIT_UNIT, {"input_grad": 30.0, "weight_grad": 15.0})
    full = timed.profile(pools)
    assert (full.whole_forward_ms, full.whole_backward_ms) == (18.0, 54.0)
    assert full.whole_split_backward_ms == 6.0 + 3.0 + 30.0 + 15.0  # the first layer's I + W, then the rest's
    assert full.measurement.whole_spread == PassSpread(samples=5)
    assert full.measurement.rounds == 5 and full.measurement.attempts == 1


def test_with_half_the_blocks_slowed_the_faster_half_is_the_reference():
    profile = _gpt_like(blocks=(1.0, 1.0, 160.0, 160.0))
    named = {(f.layer, f.pass_label) for f in check(profile) if f.check == "peers"}
    assert {("blocks.2", "F"), ("blocks.3", "F")} <= named and ("blocks.0", "F") not in named
