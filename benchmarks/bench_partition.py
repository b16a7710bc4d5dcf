"""Partitioner benchmark: DP speed (medians), bottleneck vs baselines, and PipeDream's objective reproduced.

    .venv/bin/python benchmarks/bench_partition.py [--repeats 3] [--skip-measured] [--reference-devices 4]

Prints three tables and writes benchmarks/results/partition.json. Speed targets: 1,000 layers on 1,024 devices
(128 nodes x 8) < 10 s; 200 layers on 64 devices < 1 s; each PipeDream reference profile on 16 devices < 1 s.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from pathlib import Path

from arguments import parse_args


def _options(parser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per speed case (median kept)")
    parser.add_argument("--skip-measured", action="store_true", help="use a synthetic profile, not measured models")
    parser.add_argument("--reference-devices", type=int, nargs="+", default=[4], help="devices for PipeDream's cases")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

import numpy as np  # noqa: E402
from timing import median_seconds  # noqa: E402

from pipeplan.partition import (  # noqa: E402
    Cluster,
    PartitionConfig,
    parameter_balanced_partition,
    partition,
    uniform_partition,
)
from pipeplan.profiling.pipedream import read_pipedream_graph  # noqa: E402
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "tests" / "data" / "pipedream-profiles"  # PipeDream (MIT), see its README and LICENSE
REFERENCE_NAMES = ("alexnet", "vgg16", "resnet50", "resnet101", "gnmt", "gnmt_large")
GIB = 2**30


def synthetic(num_layers: int, seed: int = 0) -> Profile:
    """Transformer-like layers with +-50% jitter in time, activations, parameters and cut bytes."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(num_layers):
        f, ig, wg = (float(x) for x in rng.uniform(0.5, 1.5, 3))
        count = int(rng.uniform(0.5, 1.5) * 5e7)
        layers.append(
            LayerProfile(
                name=f"layer{i}",
                forward_ms=f,
                input_grad_ms=ig,
                weight_grad_ms=wg,
                backward_ms=ig + wg,
                activation_bytes=int(rng.uniform(0.5, 1.5) * 2e8),
                activation_freed_by_input_grad_bytes=0,
                param_count=count,
                param_bytes=2 * count,
            )
        )
    cuts = tuple(int(x) for x in rng.uniform(0.5, 1.5, num_layers - 1) * 1.6e7)
    return Profile(layers=tuple(layers), cut_bytes=cuts, provenance=Provenance(source="analytic", model="synthetic"))


def speed_cases():
    big = synthetic(1000)
    mid = synthetic(200, seed=1)
    mem = 80 * GIB
    yield (
        "1000 layers, 1024 dev (128x8), 1f1b",
        big,
        Cluster(num_devices=1024, devices_per_node=8, memory_per_device=mem),
        PartitionConfig(num_microbatches=64, precision="bf16-mixed"),
        10.0,
    )
    yield (
        "200 layers, 64 dev (1x64), 1f1b",
        mid,
        Cluster(num_devices=64, devices_per_node=64, memory_per_device=mem),
        PartitionConfig(num_microbatches=64, precision="bf16-mixed"),
        1.0,
    )
    yield (
        "200 layers, 64 dev (8x8), 1f1b",
        mid,
        Cluster(num_devices=64, devices_per_node=8, memory_per_device=mem),
        PartitionConfig(num_microbatches=64, precision="bf16-mixed"),
        1.0,
    )
    yield (
        "200 layers, 64 dev (8x8), straight",
        mid,
        Cluster(num_devices=64, devices_per_node=8, memory_per_device=mem),
        PartitionConfig(num_microbatches=64, mode="straight", precision="bf16-mixed"),
        1.0,
    )
    yield (
        "200 layers, 64 dev (8x8), zbv",
        mid,
        Cluster(num_devices=64, devices_per_node=8, memory_per_device=mem),
        PartitionConfig(num_microbatches=128, schedule="zbv", precision="bf16-mixed"),
        None,
    )
    yield (
        "200 layers, 64 dev (8x8), interleaved v=2",
        mid,
        Cluster(num_devices=64, devices_per_node=8, memory_per_device=mem),
        PartitionConfig(num_microbatches=64, schedule="interleaved", precision="bf16-mixed"),
        None,
    )
    for name in REFERENCE_NAMES:
        profile = read_pipedream_graph(PROFILES / f"{name}.txt")
        cluster = Cluster(num_devices=16, devices_per_node=16, memory_per_device=10**15, intra_node_bandwidth=1e9)
        for model in ("pipedream", "pipeplan"):
            yield (
                f"{name} ({profile.num_layers} layers), 16 dev, {model}",
                profile,
                cluster,
                PartitionConfig(num_microbatches=16, cost_model=model, precision="bf16-mixed"),
                1.0,
            )  # noqa: E501


def run_speed(repeats: int) -> list[dict]:
    rows = []
    print(f"{'case':52} {'median s':>9} {'target s':>9} {'ok':>3} {'objective ms':>13} {'stages':>6} {'devices':>7}")
    for label, profile, cluster, config, target in speed_cases():
        seconds, result = median_seconds(lambda p=profile, c=cluster, k=config: partition(p, c, k), repeats)
        ok = "" if target is None else ("yes" if seconds < target else "NO")
        print(
            f"{label:52} {seconds:9.3f} {target or '-':>9} {ok:>3} {result.objective_ms:13.3f} "
            f"{result.num_stages:6d} {result.num_devices:7d}"
        )
        rows.append(
            {
                "case": label,
                "median_s": seconds,
                "target_s": target,
                "objective_ms": result.objective_ms,
                "num_stages": result.num_stages,
                "num_devices": result.num_devices,
                "layer_groups": result.layer_groups,
            }
        )
    return rows


def measured_profiles(skip: bool) -> list[tuple[str, Profile]]:
    if skip:
        return [("synthetic-48", synthetic(48, seed=2))]
    from pipeplan.models.registry import load_model
    from pipeplan.profiling.measure import profile_model

    out = []
    for ref, options in (("gpt", {}), ("mlp", {}), ("resnet", {})):
        spec = load_model(ref, options)
        profile = profile_model(
            spec, batch_size=4, warmup=1, repeats=3, progress=False, model_ref=ref, timer="cpu", precision="fp32"
        )
        out.append((f"{ref} (measured, cpu)", profile))
    return out


def run_baselines(skip_measured: bool) -> list[dict]:
    cases = [(name, read_pipedream_graph(PROFILES / f"{name}.txt")) for name in REFERENCE_NAMES]
    cases += measured_profiles(skip_measured)
    rows = []
    print(
        f"\n{'profile':24} {'dev':>4} {'DP repl.':>10} {'DP straight':>12} {'uniform':>10} {'params-bal.':>12} "
        f"{'uniform/DP':>11} {'params/DP':>10}"
    )
    for name, profile in cases:
        devices = min(8, profile.num_layers)
        cluster = Cluster(num_devices=devices, devices_per_node=8, memory_per_device=10**15, intra_node_bandwidth=1e9)
        config = PartitionConfig(num_microbatches=16, precision="bf16-mixed")
        straight = PartitionConfig(num_microbatches=16, mode="straight", precision="bf16-mixed")
        dp = partition(profile, cluster, config).objective_ms
        dps = partition(profile, cluster, straight).objective_ms
        uni = uniform_partition(profile, cluster, straight).objective_ms
        bal = parameter_balanced_partition(profile, cluster, straight).objective_ms
        print(
            f"{name:24} {devices:4d} {dp:10.3f} {dps:12.3f} {uni:10.3f} {bal:12.3f} {uni / dps:11.2f} {bal / dps:10.2f}"
        )
        rows.append(
            {
                "profile": name,
                "devices": devices,
                "dp_replicated_ms": dp,
                "dp_straight_ms": dps,
                "uniform_ms": uni,
                "parameter_balanced_ms": bal,
            }
        )
    return rows


def run_pipedream(devices: list[int]) -> list[dict]:
    spec = importlib.util.spec_from_file_location(
        "pipedream_reference", ROOT / "tests" / "partition" / "pipedream_reference.py"
    )
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    rows = []
    print(f"\n{'profile':12} {'dev':>4} {'states':>7} {'PipeDream ref s':>16} {'pipeplan s':>12} {'rel. diff':>10}")
    for name in REFERENCE_NAMES:
        profile = read_pipedream_graph(PROFILES / f"{name}.txt")
        for n in devices:
            ref, states = reference.pipedream_objective(PROFILES / f"{name}.txt", n)
            cluster = Cluster(num_devices=n, devices_per_node=n, memory_per_device=10**15, intra_node_bandwidth=1e9)
            ours = partition(
                profile, cluster, PartitionConfig(num_microbatches=4, cost_model="pipedream", precision="bf16-mixed")
            )
            diff = ours.objective_ms / (ref * 1000) - 1
            print(f"{name:12} {n:4d} {states:7d} {ref:16.6f} {ours.objective_ms / 1000:12.6f} {diff:10.2e}")
            rows.append(
                {
                    "profile": name,
                    "devices": n,
                    "antichain_states": states,
                    "pipedream_s": ref,
                    "pipeplan_s": ours.objective_ms / 1000,
                    "replicas": ours.replicas,
                    "stages": ours.stage_ranges,
                }
            )
    return rows


def main(args) -> None:
    results = {
        "machine": platform.platform(),
        "speed": run_speed(args.repeats),
        "baselines": run_baselines(args.skip_measured),
        "pipedream": run_pipedream(args.reference_devices),
    }
    out = ROOT / "benchmarks" / "results" / "partition.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(ARGS)
