"""Capacity sweeps on synthetic transformer profiles: the memory split (18 B/param, activations = in-flight x the
per-layer formula x layers), the memory screen's lower bound, the step's time split, what binds, and the
target-tokens answer."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers.search import capacity_config, make_cluster, synthetic_profile
from helpers.transformer_reference import activation_bytes_per_layer, forward_flops_per_layer

from pipeplan.capacity.memory import _cuttable, _least_total, device_memory_split, memory_floor_bytes
from pipeplan.capacity.sweep import (
    CapacityConfig,
    CapacityRow,
    answer_devices,
    capacity_sweep,
    default_global_batch,
    model_flops_per_token,
    time_split,
)
from pipeplan.costs import bytes_per_param, static_split
from pipeplan.errors import ConfigError
from pipeplan.hardware import Hardware, cluster_for
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance
from pipeplan.schedules.ops import Op
from pipeplan.search.candidate import Evaluation, Rejection, evaluate, min_memory_bytes
from pipeplan.search.config import SearchConfig
from pipeplan.search.scaling import scale_profile
from pipeplan.search.search import enumerate_layouts, search_plans

SEQ, HIDDEN, HEADS = 512, 1024, 16
LAYER_PARAMS = 12 * HIDDEN**2


def transformer_profile(num_layers: int = 8, *, flash_attention: bool = True, cut_scale: float = 1.0) -> Profile:
    """Identical blocks at microbatch size 1: Megatron activations and FLOPs, 1 ms forward, I = W = F."""
    activation = activation_bytes_per_layer(
        seq=SEQ, batch=1, hidden=HIDDEN, heads=HEADS, flash_attention=flash_attention
    )
    flops = float(forward_flops_per_layer(seq=SEQ, batch=1, hidden=HIDDEN))
    layer = dict(
        forward_ms=1.0,
        input_grad_ms=1.0,
        weight_grad_ms=1.0,
        backward_ms=2.0,
        activation_bytes=activation,
        activation_freed_by_input_grad_bytes=activation // 2,
        param_count=LAYER_PARAMS,
        param_bytes=2 * LAYER_PARAMS,
        flops=flops,
    )
    cut = int(2 * SEQ * HIDDEN * cut_scale)
    return Profile(
        layers=tuple(LayerProfile(name=f"block{i}", **layer) for i in range(num_layers)),
        cut_bytes=(cut,) * (num_layers - 1),
        provenance=Provenance(source="analytic", batch_size=1, model="blocks", tokens_per_sample=SEQ, dtype="bfloat16"),
    )


def hardware(memory_gb: float = 40.0, network_gb_per_s: float = 50.0) -> Hardware:
    return Hardware(
        name="test-gpu",
        peak_bf16_flops=1e15,
        peak_tf32_flops=5e14,
        memory_bytes=int(memory_gb * 1e9),
        hbm_bandwidth=3e12,
        nvlink_bandwidth=4.5e11,
        network_bandwidth=network_gb_per_s * 1e9,
    )


def config(**overrides) -> CapacityConfig:
    base = dict(hardware=hardware(), device_counts=(4, 8), global_batch_size=16, devices_per_node=4)
    return capacity_config(**{**base, **overrides})


def all_evaluations(profile: Profile, cfg: CapacityConfig, num_devices: int) -> list[Evaluation]:
    """Every layout the search enumerates, evaluated (no pruning)."""
    cluster = cluster_for(cfg.hardware, num_devices, cfg.devices_per_node)
    found = []
    for layout in enumerate_layouts(profile.num_layers, cluster, cfg.search, cfg.schedules):
        if isinstance(layout, Rejection):
            continue
        result = evaluate(
            layout,
            scale_profile(profile, layout.microbatch_size),
            cluster,
            optimizer=cfg.search.optimizer,
            global_batch_size=cfg.search.global_batch_size,
            precision=cfg.search.precision,
        )
        if isinstance(result, Evaluation):
            found.append(result)
    return found


def test_weights_gradients_optimizer_are_16_bytes_per_param_of_the_devices_stages():
    # bf16-mixed under torch.autocast: fp32 weights (the master copy) 4 + fp32 gradients 4 + Adam moments 8
    profile = transformer_profile()
    cfg = config(microbatch_sizes=(1, 2))
    evaluations = all_evaluations(profile, cfg, 8)
    assert len(evaluations) > 10
    for evaluation in evaluations:
        scaled = scale_profile(profile, evaluation.layout.microbatch_size)
        split = device_memory_split(evaluation, scaled, cfg.search.split)
        stages = [evaluation.partition.stages[s] for s in evaluation.pipeline.device_stages[split.device]]
        params = sum(layer.param_count for s in stages for layer in profile.layers[s.first_layer : s.last_layer + 1])
        assert split.param_count == params
        assert (split.weights, split.gradients, split.optimizer) == (4 * params, 4 * params, 8 * params)
        assert split.weights + split.gradients + split.optimizer == 16 * params
        # the split adds up to the planner's own prediction for that device, the busiest one
        assert split.total == pytest.approx(evaluation.device_memory_bytes[split.device], abs=len(stages))
        assert evaluation.device_memory_bytes[split.device] == evaluation.peak_memory_bytes
    for row in capacity_sweep(profile, cfg).rows:
        assert row.fits
        assert row.memory.weights + row.memory.gradients + row.memory.optimizer == 16 * row.memory.param_count


@pytest.mark.parametrize("flash_attention", [True, False], ids=["flash", "math-attention"])
def test_activation_column_is_the_replayed_peak_of_the_per_layer_formula(flash_attention):
    """Replay the device's op list: F holds a microbatch's per-layer formula x layers, I releases half of it (the
    profile's I-freed share), W or B the rest; the column is the largest total (fused-B schedules: in flight x
    formula x layers)."""
    profile = transformer_profile(flash_attention=flash_attention)
    cfg = config(microbatch_sizes=(1, 2), schedules=("gpipe", "1f1b", "zb-h1", "interleaved"))
    checked = 0
    for evaluation in all_evaluations(profile, cfg, 8):
        layout = evaluation.layout
        b = layout.microbatch_size
        per_layer = 34 * SEQ * b * HIDDEN + (0 if flash_attention else 5 * HEADS * SEQ**2 * b)
        split = device_memory_split(evaluation, scale_profile(profile, b), static_split("adamw", "bf16-mixed"))
        stages = evaluation.partition.stages
        live, peak = {}, 0
        for text in evaluation.pipeline.device_ops[split.device]:
            op = Op.parse(text)
            layers = stages[op.stage].num_layers
            if op.kind == "F":
                live[(op.stage, op.microbatch)] = per_layer * layers
            elif op.kind == "I":
                live[(op.stage, op.microbatch)] = (per_layer - per_layer // 2) * layers
            else:
                del live[(op.stage, op.microbatch)]
            peak = max(peak, sum(live.values()))
        assert split.activations == peak
        checked += 1
    assert checked >= 8


def test_time_split_adds_up_to_the_step_and_bubble_rate_comes_from_the_simulator():
    profile = transformer_profile()
    cfg = config()
    result = search_plans(profile, cluster_for(cfg.hardware, 8, 4), cfg.search, cfg.schedules)
    for evaluation in result.ranked[:5]:
        split = time_split(evaluation)
        assert split.compute_ms + split.bubble_ms + split.comm_ms == pytest.approx(evaluation.step_ms)
        assert min(split.compute_ms, split.bubble_ms, split.comm_ms) >= 0.0
    heavy = synthetic_profile(num_layers=4, heavy_last=6.0, activation_bytes=1_000_000, cut_bytes=50_000_000)
    plain = SearchConfig(
        global_batch_size=12, zero=0, precision="bf16-mixed"
    )  # ZeRO-1 would let plain data parallelism fit
    replicated = search_plans(heavy, make_cluster(3, memory=60 * 2**20), plain, ["1f1b"])
    assert max(replicated.best.partition.replicas) > 1
    split = time_split(replicated.best)  # free transfers: the same (expanded) lists, never a longer step
    assert split.compute_ms + split.bubble_ms <= replicated.best.timeline.makespan * (1 + 1e-9)
    assert split.comm_ms > 0
    row = capacity_sweep(profile, config(device_counts=(8,))).rows[0]
    assert row.bubble_rate == pytest.approx(result.best.timeline.bubble_rate)
    assert row.step_ms == pytest.approx(result.best.step_ms)


def test_tokens_per_s_and_mfu():
    profile = transformer_profile()
    flops_per_token = model_flops_per_token(profile)
    # 3 x forward: 6 x matmul parameters (24 h^2 = 2 x 12 h^2 per token) plus the attention scores 12 s h
    assert flops_per_token == pytest.approx(8 * (6 * LAYER_PARAMS + 12 * SEQ * HIDDEN))
    for row in capacity_sweep(profile, config()).rows:
        assert row.tokens_per_s == pytest.approx(16 * SEQ / (row.step_ms / 1000.0))
        assert row.mfu == pytest.approx(row.tokens_per_s * flops_per_token / (1e15 * row.num_devices))
        assert 0 < row.mfu < 1


def test_binding_names_communication_bubble_and_memory():
    slow_network = capacity_sweep(
        transformer_profile(cut_scale=200.0), config(hardware=hardware(network_gb_per_s=0.05), device_counts=(8,))
    ).rows[0]
    assert slow_network.binding == "communication"
    assert slow_network.time.comm_ms > slow_network.time.bubble_ms
    few_microbatches = capacity_sweep(transformer_profile(), config(device_counts=(8,), global_batch_size=2)).rows[0]
    assert few_microbatches.binding == "bubble"
    assert few_microbatches.time.bubble_ms > few_microbatches.time.comm_ms
    # 8 layers of 12 h^2 params at 18 B/param (1.8 GB) need P >= 4 in 1 GB; shorter (faster) pipelines do not fit
    # one node (fast all-reduce): pure data parallelism would be fastest, but needs 1.8 GB per device
    tight_config = config(hardware=hardware(memory_gb=1.0), device_counts=(8,), devices_per_node=8)
    tight = capacity_sweep(transformer_profile(), tight_config).rows[0]
    assert tight.binding == "memory", tight
    assert "does not fit in memory" in tight.reason


def test_device_counts_that_cannot_hold_the_model_say_what_would():
    cfg = config(hardware=hardware(memory_gb=1.0), device_counts=(1, 2, 8))
    rows = {row.num_devices: row for row in capacity_sweep(transformer_profile(), cfg).rows}
    for n in (1, 2):
        assert not rows[n].fits and rows[n].binding == "does-not-fit"
        assert rows[n].needed_devices == 8
        # a lower bound from the memory screen, or (when a schedule was searched) the search's own one-line reason
        assert rows[n].needed_memory_bytes is None or rows[n].needed_memory_bytes > 1e9
        assert "per device" in rows[n].reason
    assert rows[8].fits


def test_nothing_listed_fits_so_the_sweep_doubles():
    cfg = config(hardware=hardware(memory_gb=1.0), device_counts=(1, 2))
    rows = capacity_sweep(transformer_profile(), cfg).rows
    assert [r.num_devices for r in rows] == [1, 2, 4]
    assert rows[-1].extended and rows[-1].fits
    assert rows[0].needed_devices == 4
    assert rows[0].needed_memory_bytes > 1e9  # one device: weights + gradients + optimizer state alone are 1.8 GB


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h2", "interleaved", "zbv"])
def test_memory_floor_is_a_lower_bound_on_the_partitioners_need(schedule):
    profile = transformer_profile(num_layers=10)
    cfg = config(schedules=(schedule,), global_batch_size=16)
    cluster = cluster_for(cfg.hardware, 8, 8)
    layouts = [x for x in enumerate_layouts(10, cluster, cfg.search, (schedule,)) if not isinstance(x, Rejection)]
    assert layouts
    for layout in layouts:
        floor = memory_floor_bytes(layout, profile, bytes_per_param("adamw", "bf16-mixed"))
        need = min_memory_bytes(layout, profile, cluster, optimizer="adamw-bf16", precision="bf16-mixed")
        assert need is not None and floor <= need * (1 + 1e-3)
        if schedule in ("gpipe", "1f1b"):  # fused B: the floor and the screen count the same microbatches
            assert floor >= 0.98 * need  # exact for one stage per device, up to the bisections' tolerance


def test_cuttable_and_least_total_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n, stages = int(rng.integers(2, 7)), int(rng.integers(1, 5))
        if stages > n:
            continue
        static = np.concatenate([[0.0], np.cumsum(rng.integers(1, 9, n).astype(float))])
        active = np.concatenate([[0.0], np.cumsum(rng.integers(0, 9, n).astype(float))])
        inflight = np.asarray(rng.integers(1, 5, stages))
        cuts = []
        for inner in itertools.combinations(range(1, n), stages - 1):
            bounds = (0, *inner, n)
            cuts.append(
                [static[b] - static[a] + c * (active[b] - active[a]) for a, b, c in zip(bounds, bounds[1:], inflight)]
            )
        best = min(max(costs) for costs in cuts)
        assert _cuttable(static, active, inflight, best)
        assert not _cuttable(static, active, inflight, best - 0.5)
        for limit in (best, best + 3.0):
            least = min(sum(costs) for costs in cuts if max(costs) <= limit)
            assert _least_total(static, active, inflight, limit) == pytest.approx(least)
        assert _least_total(static, active, inflight, best - 0.5) == math.inf


def _row(n: int, tokens_per_s: float | None) -> CapacityRow:
    if tokens_per_s is None:
        return CapacityRow(num_devices=n, binding="does-not-fit")
    return CapacityRow(num_devices=n, binding="compute", schedule="1f1b", tokens_per_s=tokens_per_s)


def test_answer_devices_is_the_smallest_count_that_reaches_the_rate_and_monotone():
    rows = [_row(8, None), _row(16, 100.0), _row(32, 180.0), _row(64, 150.0), _row(128, 400.0)]
    assert answer_devices(rows, 50.0) == 16
    assert answer_devices(rows, 160.0) == 32
    assert answer_devices(rows, 200.0) == 128
    assert answer_devices(rows, 401.0) is None
    previous = 0
    for needed in np.linspace(1.0, 400.0, 60):
        n = answer_devices(rows, float(needed))
        assert n is not None and n >= previous
        assert all(r.tokens_per_s < needed for r in rows if r.fits and r.num_devices < n)
        previous = n


def test_target_tokens_answer_is_consistent_with_the_rows():
    profile = transformer_profile()
    rows = capacity_sweep(profile, config()).rows
    rate = {row.num_devices: row.tokens_per_s for row in rows}
    days = 2.0
    target = rate[8] * 0.99 * days * 86_400  # only 8 devices are fast enough (or 4 is, then it answers 4)
    report = capacity_sweep(profile, config(target_tokens=target, days=days))
    answer = report.answer
    assert answer.num_devices == min(n for n, r in rate.items() if r >= target / (days * 86_400))
    assert answer.tokens_per_s >= answer.tokens_per_s_needed
    assert answer.days_needed <= days
    beyond = capacity_sweep(profile, config(target_tokens=target * 100, days=days, max_devices=16))
    assert beyond.answer.num_devices is None or beyond.answer.num_devices == 16
    assert [r.num_devices for r in beyond.rows] == [4, 8, 16]
    assert "tokens/s" in beyond.answer.message


def test_config_errors_name_the_option():
    with pytest.raises(ConfigError, match="--days"):
        config(target_tokens=1e12)
    with pytest.raises(ConfigError, match="--devices-per-node"):
        config(device_counts=(12,), devices_per_node=8)
    with pytest.raises(ConfigError, match="--schedule"):
        config(schedules=("nope",))
    assert default_global_batch(4096, (1,)) == 256
    assert default_global_batch(1024, (1, 3)) == 1026
