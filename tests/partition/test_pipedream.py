"""PipeDream graph.txt import and the `pipedream` cost model against PipeDream's own optimizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipeplan.costs import numerics
from pipeplan.errors import FormatError
from pipeplan.partition import Cluster, PartitionConfig, partition
from pipeplan.profiling.pipedream import read_pipedream_graph

PROFILES = Path(__file__).resolve().parents[1] / "data" / "pipedream-profiles"  # MIT, see its README and LICENSE

_spec = importlib.util.spec_from_file_location(
    "pipedream_reference", Path(__file__).with_name("pipedream_reference.py")
)
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

# PipeDream's own printed output for `optimizer_graph_hierarchical.py -f vgg16/graph.txt -n 4
# --activation_compression_ratio 1`: (0, 17) 3 replicas, (17, 40) 1 replica, 0.2055 s per minibatch.
VGG16_4 = {"seconds": 0.2055, "ranges": ((0, 16), (17, 39)), "replicas": (3, 1)}


def pipedream_cluster(num_devices: int) -> Cluster:
    return Cluster(
        num_devices=num_devices, devices_per_node=num_devices, memory_per_device=10**15, intra_node_bandwidth=1e9
    )


def pipedream_partition(name: str, num_devices: int, *, mode: str = "replicated"):
    profile = read_pipedream_graph(PROFILES / f"{name}.txt")
    config = PartitionConfig(
        num_microbatches=4, cost_model="pipedream", mode=mode, numerics=numerics("adamw", "bf16-mixed")
    )
    return profile, partition(profile, pipedream_cluster(num_devices), config)


def test_vgg16_on_4_devices_reproduces_pipedream_output():
    _, result = pipedream_partition("vgg16", 4)
    assert result.stage_ranges == VGG16_4["ranges"]
    assert result.replicas == VGG16_4["replicas"]
    assert result.objective_ms / 1000 == pytest.approx(VGG16_4["seconds"], abs=5e-5)
    ref, _ = reference.pipedream_objective(PROFILES / "vgg16.txt", 4)
    assert result.objective_ms == pytest.approx(ref * 1000, rel=1e-12)
    assert result.stages[0].devices == (0, 1, 2) and result.stages[1].devices == (3,)


@pytest.mark.parametrize("name", ["vgg16", "alexnet"])
@pytest.mark.parametrize("num_devices", [1, 2, 3, 8])
def test_chain_profiles_equal_pipedream_objective(name, num_devices):
    _, result = pipedream_partition(name, num_devices)
    ref, _ = reference.pipedream_objective(PROFILES / f"{name}.txt", num_devices)
    assert result.objective_ms == pytest.approx(ref * 1000, rel=1e-12)
    assert sum(result.replicas) == num_devices


@pytest.mark.parametrize("name", ["vgg16", "alexnet"])
def test_straight_chain_equals_pipedream_straight(name):
    _, result = pipedream_partition(name, 4, mode="straight")
    ref, _ = reference.pipedream_objective(PROFILES / f"{name}.txt", 4, straight=True)
    assert result.objective_ms == pytest.approx(ref * 1000, rel=1e-12)
    assert result.replicas == (1, 1, 1, 1)


@pytest.mark.parametrize(("name", "num_devices"), [("gnmt", 4), ("gnmt", 8), ("resnet50", 4)])
def test_dag_linearization_within_2_percent_of_pipedream_antichains(name, num_devices):
    _, result = pipedream_partition(name, num_devices)
    ref, _ = reference.pipedream_objective(PROFILES / f"{name}.txt", num_devices)
    assert result.objective_ms <= ref * 1000 * 1.02


def test_reader_structure():
    vgg = read_pipedream_graph(PROFILES / "vgg16.txt")
    assert vgg.num_layers == 40  # node1 (Input) dropped
    assert vgg.provenance.source == "pipedream"
    assert vgg.layers[0].name == "node2" and vgg.layers[0].forward_ms == pytest.approx(22.307)
    assert vgg.layers[0].input_grad_ms == vgg.layers[0].backward_ms and vgg.layers[0].weight_grad_ms == 0
    assert vgg.cut_bytes[0] == vgg.layers[0].activation_bytes  # chain: only the last output crosses
    gnmt = read_pipedream_graph(PROFILES / "gnmt.txt")
    lstm = next(la for la in gnmt.layers if la.name == "node7")
    assert lstm.activation_bytes == 6291456 + 131072 + 131072  # [a; b; c] is summed


def write(tmp_path, text):
    path = tmp_path / "graph.txt"
    path.write_text(text)
    return path


NODE = "{n} -- {d} -- forward_compute_time={f}, backward_compute_time=2.0, activation_size={a}, parameter_size=8.000"


def test_dag_cut_bytes_charge_skip_connections(tmp_path):
    lines = [
        NODE.format(n="node1", d="Input", f=5.0, a=100.0),
        NODE.format(n="node2", d="Conv", f=1.0, a=10.0),
        NODE.format(n="node3", d="Conv", f=1.0, a=20.0),
        NODE.format(n="node4", d="Add", f=1.0, a=40.0),
        "\tnode1 -- node2",
        "\tnode2 -- node3",
        "\tnode3 -- node4",
        "\tnode2 -- node4",
    ]
    profile = read_pipedream_graph(write(tmp_path, "\n".join(lines)))
    assert [la.name for la in profile.layers] == ["node2", "node3", "node4"]
    assert profile.cut_bytes == (10, 30)  # node2's output is live across both cuts
    assert profile.layers[0].param_count == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("node1 -- Conv -- forward_compute_time=1.0", "forward_compute_time"),
        (
            "node1 -- Conv -- forward_compute_time=x, backward_compute_time=1, activation_size=1, parameter_size=1",
            "not a",
        ),
        (NODE.format(n="node1", d="A", f=1.0, a=1.0) + "\n\tnode1 -- node9", "undefined node"),
        (NODE.format(n="node1", d="A", f=1.0, a=1.0) + "\n\tnode1", "edge"),
        (NODE.format(n="node1", d="A", f=1.0, a="[1.0; x]"), "not a number"),
        (NODE.format(n="node1", d="A", f=-1.0, a=1.0), "negative"),
        (NODE.format(n="node1", d="A", f=1.0, a=1.0) + "\n" + NODE.format(n="node1", d="B", f=1.0, a=1.0), "twice"),
        ("", "no nodes"),
    ],
)
def test_malformed_files_raise_format_error(tmp_path, text, match):
    with pytest.raises(FormatError, match=match):
        read_pipedream_graph(write(tmp_path, text))


def test_cycle_and_missing_file(tmp_path):
    lines = [NODE.format(n="node1", d="A", f=1.0, a=1.0), NODE.format(n="node2", d="B", f=1.0, a=1.0)]
    with pytest.raises(FormatError, match="cycle"):
        read_pipedream_graph(write(tmp_path, "\n".join([*lines, "\tnode1 -- node2", "\tnode2 -- node1"])))
    with pytest.raises(FormatError, match="cannot read"):
        read_pipedream_graph(tmp_path / "missing.txt")
