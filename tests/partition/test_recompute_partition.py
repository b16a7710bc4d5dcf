"""Recomputation and ZeRO-1 in the partitioner: the per-stage formulas (costs.recompute), the memory screen bounding
the simulator's exact peak in every mode, the DP choosing cuts and modes together (against brute force), selective
only where a stage has attention internals, and the optimizer state sharded over a stage's group."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from pipeplan.costs import (
    LayerArrays,
    numerics,
    stage_kept_bytes,
    stage_memory_bytes,
    stage_recompute_bytes,
    stage_recompute_ms,
)
from pipeplan.errors import ConfigError
from pipeplan.partition import Cluster, PartitionConfig, partition
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance
from pipeplan.schedules.memory import held_per_stage
from pipeplan.schedules.registry import generate
from pipeplan.schedules.simulate import MemoryCosts, peak_activation_per_device

MB = 1_000_000


def recompute_profile(num_layers: int = 6, *, attention: bool = True, params: int = 0) -> Profile:
    """Layers of 1 ms forward with 40 MB saved (half freed by I), 12 MB of which attention internals (re-run in
    0.2 ms); full recomputation keeps the 2 MB entering a layer."""
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward_ms=1.0,
            input_grad_ms=1.0,
            weight_grad_ms=1.0,
            backward_ms=2.0,
            activation_bytes=40 * MB + i * MB,
            activation_freed_by_input_grad_bytes=20 * MB,
            param_count=params,
            param_bytes=4 * params,
            selective_activation_bytes=(28 + i) * MB if attention else None,
            selective_recompute_ms=0.2 if attention else 0.0,
            full_activation_bytes=2 * MB,
            full_recompute_ms=1.0,
        )
        for i in range(num_layers)
    )
    return Profile(
        layers=layers, cut_bytes=(2 * MB,) * (num_layers - 1), provenance=Provenance(source="analytic"), input_bytes=MB
    )


def test_stage_formulas_per_mode():
    profile = recompute_profile()
    arrays = LayerArrays.from_profile(profile)
    a, b = 1, 3
    layers = profile.layers[a : b + 1]
    saved = sum(la.activation_bytes for la in layers)
    expect = {
        "none": (saved, 0.0, 0.0),
        "selective": (sum(la.selective_activation_bytes for la in layers), 12 * MB, 0.6),
        "full": (2 * MB, saved - 2 * MB, 3.0),  # the cut before layer 1; the whole stage re-created
    }
    rev = arrays.reversed()
    n = profile.num_layers
    for mode, (kept, rise, ms) in expect.items():
        assert stage_kept_bytes(arrays, mode, a, b) == kept
        assert stage_recompute_bytes(arrays, mode, a, b) == rise
        assert stage_recompute_ms(arrays, mode, a, b) == pytest.approx(ms)
        # the same stage seen from the end (the layered DP runs on reversed arrays)
        assert stage_kept_bytes(rev, mode, n - 1 - b, n - 1 - a) == kept
        assert stage_recompute_bytes(rev, mode, n - 1 - b, n - 1 - a) == rise
    assert stage_kept_bytes(arrays, "full", 0, 2) == profile.layers[0].full_activation_bytes  # the model's inputs
    grouped = arrays.grouped(np.array([0, 1, 4, 6]))  # items: l0 | l1..l3 | l4..l5
    for mode, (kept, rise, _) in expect.items():
        assert stage_kept_bytes(grouped, mode, 1, 1) == kept
        assert stage_recompute_bytes(grouped, mode, 1, 1) == rise


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_screen_bounds_the_exact_peak(schedule, mode):
    profile = recompute_profile(8)
    arrays = LayerArrays.from_profile(profile)
    config = PartitionConfig(
        num_microbatches=8,
        schedule=schedule,
        mode="straight",
        recompute="auto",
        numerics=numerics("adamw", "bf16-mixed"),
    )
    ranges = [(0, 1), (2, 3), (4, 5), (6, 7)]
    sched = generate(schedule, num_devices=4, num_microbatches=8)
    memory = MemoryCosts(
        activation_bytes=[float(arrays.span("activation", a, b)) for a, b in ranges],
        input_grad_freed_bytes=[float(arrays.span("freed", a, b)) for a, b in ranges],
        kept_bytes=[float(stage_kept_bytes(arrays, mode, a, b)) for a, b in ranges],
        recompute_bytes=[float(stage_recompute_bytes(arrays, mode, a, b)) for a, b in ranges],
    )
    exact = peak_activation_per_device(sched, memory)
    for (a, b), held, peak in zip(ranges, held_per_stage(sched), exact):
        screen = stage_memory_bytes(arrays, config, a, b, 1, held, mode=mode)
        assert screen >= peak - 1e-6, (a, b, screen, peak)


def _brute_force(profile: Profile, config: PartitionConfig, num_stages: int, limit: float) -> float:
    """min over cuts of the largest stage time, each stage in its cheapest fitting mode (no transfers, no params)."""
    arrays = LayerArrays.from_profile(profile)
    held = held_per_stage(generate(config.schedule, num_devices=num_stages, num_microbatches=config.num_microbatches))
    n, best = profile.num_layers, np.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        worst = 0.0
        for s in range(num_stages):
            a, b = bounds[s], bounds[s + 1] - 1
            options = [
                float(arrays.span("forward", a, b) + arrays.span("backward", a, b))
                + float(stage_recompute_ms(arrays, m, a, b))
                for m in config.recompute_modes
                if stage_memory_bytes(arrays, config, a, b, 1, held[s], mode=m) <= limit
                and (m != "selective" or arrays.span("selective", a, b) < arrays.span("activation", a, b))
            ]
            worst = max(worst, min(options, default=np.inf))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("limit_mb", [400, 200, 130, 90])
def test_cuts_and_modes_chosen_together_match_brute_force(limit_mb):
    profile = recompute_profile(6)
    cluster = Cluster(
        num_devices=3,
        devices_per_node=3,
        memory_per_device=limit_mb * MB,
        intra_node_bandwidth=1e30,
        intra_node_latency_s=0.0,
    )
    config = PartitionConfig(
        num_microbatches=6,
        mode="straight",
        num_stages=3,
        recompute="auto",
        numerics=numerics("adamw", "bf16-mixed"),
    )
    result = partition(profile, cluster, config)
    assert result.objective_ms == pytest.approx(_brute_force(profile, config, 3, limit_mb * MB))
    arrays = LayerArrays.from_profile(profile)
    for s in result.stages:
        expect = float(stage_recompute_ms(arrays, s.recompute, s.first_layer, s.last_layer))
        assert s.recompute_ms == pytest.approx(expect)
        assert s.backward_ms == pytest.approx(2.0 * s.num_layers + s.recompute_ms)
        assert s.memory_bytes <= limit_mb * MB
    plain = dataclasses.replace(config, recompute="none")
    if limit_mb == 400:  # fits without recomputation: the same partition either way
        assert partition(profile, cluster, plain) == result
        assert {s.recompute for s in result.stages} == {"none"}
    if limit_mb <= 130:
        assert {s.recompute for s in result.stages} != {"none"}


def test_the_cheapest_mode_that_fits_is_chosen():
    """One stage of 2 layers, 4 microbatches in flight (gpipe): selective (0.4 ms) fits at 200 MB, full (2 ms)
    is needed below."""
    profile = recompute_profile(2)
    config = PartitionConfig(
        num_microbatches=4,
        schedule="gpipe",
        mode="straight",
        recompute="auto",
        numerics=numerics("adamw", "bf16-mixed"),
    )
    picked = {}
    for limit in (400, 250, 200, 90):
        cluster = Cluster(num_devices=1, devices_per_node=1, memory_per_device=limit * MB)
        picked[limit] = partition(profile, cluster, config).stages[0].recompute
    assert picked == {400: "none", 250: "selective", 200: "full", 90: "full"}


def test_selective_only_where_the_stage_has_attention_internals():
    profile = recompute_profile(2, attention=False)
    config = PartitionConfig(
        num_microbatches=4,
        schedule="gpipe",
        mode="straight",
        recompute="auto",
        numerics=numerics("adamw", "bf16-mixed"),
    )
    cluster = Cluster(num_devices=1, devices_per_node=1, memory_per_device=250 * MB)
    assert partition(profile, cluster, config).stages[0].recompute == "full"


def test_zero_shards_optimizer_state_over_the_group():
    profile = recompute_profile(4, params=1_000_000)
    arrays = LayerArrays.from_profile(profile)
    held = (0, 0)
    plain = PartitionConfig(num_microbatches=4, numerics=numerics("adamw", "fp32"))
    sharded = dataclasses.replace(plain, zero=1, data_parallel=4)
    assert stage_memory_bytes(arrays, plain, 0, 1, 1, held) == 2_000_000 * 16
    assert stage_memory_bytes(arrays, sharded, 0, 1, 1, held) == 2_000_000 * (8 + 8 / 4)
    assert stage_memory_bytes(arrays, sharded, 0, 1, 2, held) == 2_000_000 * (8 + 8 / 8)  # 2 replicas x 4 pipelines
    with pytest.raises(ConfigError, match="needs a named optimizer"):
        PartitionConfig(num_microbatches=4, zero=1, numerics=numerics(12.0, "bf16-mixed"))
    with pytest.raises(ConfigError, match="recompute must be one of none, auto"):
        PartitionConfig(num_microbatches=4, recompute="full", numerics=numerics("adamw", "bf16-mixed"))
    with pytest.raises(ConfigError, match="pipedream"):
        PartitionConfig(
            num_microbatches=4, cost_model="pipedream", recompute="auto", numerics=numerics("adamw", "bf16-mixed")
        )
