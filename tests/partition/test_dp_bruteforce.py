"""The DP's objective equals brute force over every partition (all cut sets x all replica assignments), with stage
costs written out here from the documented formulas using Cluster.transfer_s / Cluster.allreduce_s directly."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.costs import numerics
from pipeplan.errors import InfeasibleError, ScheduleError
from pipeplan.partition import Cluster, PartitionConfig, partition
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance
from pipeplan.schedules.registry import generate, stage_device


@st.composite
def profiles(draw, max_layers=8):
    n = draw(st.integers(1, max_layers))
    layers = []
    for i in range(n):
        fwd, ig, wg = (draw(st.integers(0, 20)) / 2 for _ in range(3))
        act = draw(st.integers(0, 50)) * 1000
        count = draw(st.integers(0, 30)) * 1000
        layers.append(
            LayerProfile(
                name=f"l{i}",
                forward_ms=fwd,
                input_grad_ms=ig,
                weight_grad_ms=wg,
                backward_ms=ig + wg + draw(st.integers(0, 2)) / 4,
                activation_bytes=act,
                activation_freed_by_input_grad_bytes=act * draw(st.integers(0, 4)) // 4,
                param_count=count,
                param_bytes=4 * count,
            )
        )
    cuts = tuple(draw(st.integers(0, 80)) * 1000 for _ in range(n - 1))
    return Profile(layers=tuple(layers), cut_bytes=cuts, provenance=Provenance(source="analytic"))


def compositions(total, parts):
    """Ordered tuples of `parts` positive ints summing to `total`."""
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def cut_sets(n):
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            edges = (0, *cuts, n)
            yield [(edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1)]


def stage_time(profile, cluster, config, stages, s, r, same_node_in, same_node_out):
    a, b = stages[s]
    layers = profile.layers[a : b + 1]
    split = config.schedule in ("zb-h1", "zb-h2", "zb-auto", "zbv", "dualpipev")
    if config.cost_model == "pipedream":
        compute = sum(la.forward_ms + la.backward_ms for la in layers)
        params = sum(la.param_bytes for la in layers)
        bw = cluster.intra_node_bandwidth
        t = (compute + 4 * (r - 1) * params / (bw * r) * 1000) / r
        if a > 0:
            t = max(t, 2 * profile.cut_bytes[a - 1] / (bw * r) * 1000)
            if b < profile.num_layers - 1:
                t = max(t, 2 * profile.cut_bytes[b] / (bw * r) * 1000)
        return t
    split = split and a > 0  # the model's first stage: its W runs the whole backward in one pass (the layers' B)
    compute = sum(la.forward_ms + (la.input_grad_ms + la.weight_grad_ms if split else la.backward_ms) for la in layers)
    params = sum(la.param_bytes for la in layers)
    reduce = cluster.allreduce_s(params, r, same_node=True) * 1000
    t_in = cluster.transfer_s(profile.cut_bytes[a - 1], same_node=same_node_in) if a > 0 else 0.0
    t_out = cluster.transfer_s(profile.cut_bytes[b], same_node=same_node_out) if b < profile.num_layers - 1 else 0.0
    return max(compute / r + reduce / config.num_microbatches, (t_in + t_out) * 1000 / r)


def stage_memory(profile, config, stages, s, r, inflight):
    """The screen written out: in flight x (saved - freed by I) + in flight before I x freed, per replica."""
    a, b = stages[s]
    layers = profile.layers[a : b + 1]
    params = sum(la.param_count for la in layers) * config.optimizer_bytes_per_param
    freed = sum(la.activation_freed_by_input_grad_bytes for la in layers)
    saved = sum(la.activation_bytes for la in layers)
    total, before = inflight
    return params + math.ceil(total / r) * (saved - freed) + math.ceil(before / r) * freed


def memory_model(name, p, m, chunks, limit):
    """Per stage (max in flight, max in flight before I), counted by replaying the op lists step by step."""
    schedule = generate(name, num_devices=p, num_microbatches=m, chunks=chunks, memory_limit=limit)
    live: dict = {}
    peaks = [[0, 0] for _ in range(schedule.num_stages)]
    for ops in schedule.device_ops:
        for o in ops:
            state = live.setdefault(o.stage, set()), live.setdefault(("i", o.stage), set())
            if o.kind == "F":
                state[0].add(o.microbatch)
                state[1].add(o.microbatch)
            if o.kind in "BW":
                state[0].discard(o.microbatch)
            if o.kind in "BI":
                state[1].discard(o.microbatch)
            peaks[o.stage] = [max(peaks[o.stage][0], len(state[0])), max(peaks[o.stage][1], len(state[1]))]
    return [tuple(x) for x in peaks]


def brute_force(profile, cluster, config):
    best = math.inf
    g = cluster.devices_per_node
    for stages in cut_sets(profile.num_layers):
        p = len(stages)
        if config.num_stages is not None and p != config.num_stages:
            continue
        if config.mode == "straight":
            if p > cluster.num_devices or (config.cost_model == "pipedream" and p != cluster.num_devices):
                continue
            assignments = [(1,) * p]
        elif config.cost_model == "pipedream":
            assignments = list(compositions(cluster.num_devices, p)) if p <= cluster.num_devices else []
        else:
            assignments = [c for total in range(p, cluster.num_devices + 1) for c in compositions(total, p)]
        if not assignments:
            continue
        inflight = memory_model(config.schedule, p, config.num_microbatches, 1, None)
        for reps in assignments:
            if any(
                stage_memory(profile, config, stages, s, reps[s], inflight[s]) > cluster.memory_per_device
                for s in range(p)
            ):
                continue
            worst = max(
                stage_time(profile, cluster, config, stages, s, reps[s], not (s % g == 0 and s > 0), (s + 1) % g != 0)
                for s in range(p)
            )
            best = min(best, worst)
    return best


def brute_force_chunked(profile, cluster, config):
    """Straight pipelines of p * v chunks on p devices; the objective is the slowest chunk."""
    best, v, n = math.inf, config.chunks, profile.num_layers
    for stages in cut_sets(n):
        if len(stages) % v or len(stages) // v > cluster.num_devices:
            continue
        p = len(stages) // v
        try:
            inflight = memory_model(config.schedule, p, config.num_microbatches, v, None)
        except ScheduleError:
            continue
        same = p <= cluster.devices_per_node
        used = [0.0] * p
        for s, device in enumerate(stage_device(config.schedule, p, v)):
            used[device] += stage_memory(profile, config, stages, s, 1, inflight[s])
        if max(used) > cluster.memory_per_device:
            continue
        best = min(
            best, max(stage_time(profile, cluster, config, stages, s, 1, same, same) for s in range(len(stages)))
        )
    return best


def check(profile, cluster, config, expected):
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            partition(profile, cluster, config)
        return None
    result = partition(profile, cluster, config)
    assert result.objective_ms == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert max(s.time_ms for s in result.stages) == pytest.approx(result.objective_ms, rel=1e-9, abs=1e-9)
    assert all(s.memory_bytes <= cluster.memory_per_device for s in result.stages)
    used = sorted({d for s in result.stages for d in s.devices})  # a pipeline's devices are ranks 0..n-1, no gap
    assert used == list(range(result.num_devices)) == list(range(len(result.device_load_ms)))
    return result


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(
    profile=profiles(),
    num_devices=st.integers(1, 4),
    mode=st.sampled_from(["replicated", "straight"]),
    cost_model=st.sampled_from(["pipeplan", "pipedream"]),
    schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1"]),
    memory=st.sampled_from([10**12, 400_000, 250_000, 150_000]),
    microbatches=st.integers(1, 6),
    fixed=st.booleans(),
    data=st.data(),
)
def test_dp_equals_brute_force_one_node(
    profile, num_devices, mode, cost_model, schedule, memory, microbatches, fixed, data
):
    num_stages = data.draw(st.integers(1, min(num_devices, profile.num_layers))) if fixed else None
    cluster = Cluster(num_devices=num_devices, devices_per_node=4, memory_per_device=memory, intra_node_bandwidth=1e7)
    config = PartitionConfig(
        num_microbatches=microbatches,
        schedule=schedule,
        mode=mode,
        cost_model=cost_model,
        num_stages=num_stages,
        numerics=numerics("adamw-fp32", "fp32"),
    )
    result = check(profile, cluster, config, brute_force(profile, cluster, config))
    if result is not None and cost_model == "pipedream":
        assert sum(result.replicas) == num_devices  # PipeDream uses every machine


@FAST
@given(profile=profiles(), memory=st.sampled_from([10**12, 300_000]), microbatches=st.integers(1, 4))
def test_straight_pipeline_across_nodes_equals_brute_force(profile, memory, microbatches):
    cluster = Cluster(
        num_devices=4, devices_per_node=2, memory_per_device=memory, intra_node_bandwidth=1e8, inter_node_bandwidth=1e6
    )
    config = PartitionConfig(num_microbatches=microbatches, mode="straight", numerics=numerics("sgd", "bf16-mixed"))
    check(profile, cluster, config, brute_force(profile, cluster, config))


@FAST
@given(
    profile=profiles(max_layers=9),
    num_devices=st.integers(1, 3),
    schedule=st.sampled_from(["interleaved", "zbv", "dualpipev"]),
    microbatches=st.sampled_from([2, 4, 6, 12]),
)
def test_chunked_dp_equals_brute_force(profile, num_devices, schedule, microbatches):
    cluster = Cluster(num_devices=num_devices, devices_per_node=4, memory_per_device=10**12, intra_node_bandwidth=1e7)
    config = PartitionConfig(num_microbatches=microbatches, schedule=schedule, numerics=numerics("adamw", "bf16-mixed"))
    expected = brute_force_chunked(profile, cluster, config)
    if math.isinf(expected):
        with pytest.raises((InfeasibleError, ScheduleError)):
            partition(profile, cluster, config)
        return
    result = check(profile, cluster, config, expected)
    p = result.num_stages // 2
    assert [s.devices[0] for s in result.stages] == list(stage_device(schedule, p, 2))


def two_level_brute_force(profile, cluster, config):
    """The documented two-level model: blocks of layers on whole nodes, each node running the best one-node
    sub-pipeline of its block (block edge cuts are charged only across nodes)."""
    g, m = cluster.devices_per_node, config.num_microbatches
    layers, cuts, n = profile.layers, profile.cut_bytes, profile.num_layers

    def span(a, b, key):
        return sum(getattr(la, key) for la in layers[a : b + 1])

    def t_cut(index, *, same_node):  # transfer of the cut before layer `index`, ms
        return cluster.transfer_s(cuts[index - 1], same_node=same_node) * 1000 if 0 < index < n else 0.0

    def sub_pipeline(a, b):
        best = math.inf
        for stages in cut_sets(b - a + 1):
            stages = [(x + a, y + a) for x, y in stages]
            for total in range(len(stages), g + 1):
                for reps in compositions(total, len(stages)):
                    worst = 0.0
                    for (x, y), r in zip(stages, reps):
                        work = span(x, y, "forward_ms") + span(x, y, "backward_ms")
                        reduce = cluster.allreduce_s(span(x, y, "param_bytes"), r, same_node=True) * 1000
                        comm = (t_cut(x, same_node=True) if x > a else 0.0) + (
                            t_cut(y + 1, same_node=True) if y < b else 0.0
                        )
                        worst = max(worst, work / r + reduce / m, comm / r)
                    best = min(best, worst)
        return best

    best = math.inf
    for blocks in cut_sets(n):
        inner = [sub_pipeline(a, b) for a, b in blocks]
        for total in range(len(blocks), cluster.num_nodes + 1):
            for copies in compositions(total, len(blocks)):
                worst = 0.0
                for (a, b), a1, c in zip(blocks, inner, copies):
                    reduce = cluster.allreduce_s(span(a, b, "param_bytes") / g, c, same_node=False) * 1000
                    comm = t_cut(a, same_node=False) + t_cut(b + 1, same_node=False)
                    worst = max(worst, a1 / c + reduce / m, comm / c)
                best = min(best, worst)
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(max_layers=6), num_nodes=st.integers(2, 3), microbatches=st.integers(1, 4))
def test_two_level_dp_equals_brute_force(profile, num_nodes, microbatches):
    cluster = Cluster(
        num_devices=2 * num_nodes,
        devices_per_node=2,
        memory_per_device=10**12,
        intra_node_bandwidth=1e8,
        inter_node_bandwidth=2e6,
    )
    config = PartitionConfig(num_microbatches=microbatches, numerics=numerics("sgd", "bf16-mixed"))
    check(profile, cluster, config, two_level_brute_force(profile, cluster, config))
