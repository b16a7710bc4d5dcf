"""Read PipeDream's profile format (graph.txt from its profiler) into a Profile.

    node<id> -- <module repr> -- forward_compute_time=<ms>, backward_compute_time=<ms>, activation_size=<B or [a; b]>,
        parameter_size=<B>[ -- stage_id=<k>]
    <TAB>node<a> -- node<b>

Conventions (those of PipeDream's optimizer): source nodes whose description starts with `Input` are dropped (their
time is data loading, and PipeDream zeroes them); sinks starting with `__getitem__` are dropped. Times are ms per
PipeDream minibatch; the fused backward becomes both B and I (W = 0, PipeDream does not split it); parameter_size is
fp32 bytes (count = bytes / 4); activation_size (a list is summed) is each node's output, which is also what its
stage keeps for backward. Layers follow a topological order (Kahn's algorithm, smallest node number first), and
`cut_bytes[k]` sums the outputs of every node at or before position k that a node after k consumes, so branches and
skip connections are charged at every cut they cross.
"""

from __future__ import annotations

import heapq
import os
import re

from pipeplan.console import warn
from pipeplan.errors import FormatError
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_LIST = re.compile(rf"^\[\s*{_NUMBER}(?:\s*;\s*{_NUMBER})*\s*\]$")


def _value(text: str, where: str, key: str) -> float:
    text = text.strip()
    try:
        if text.startswith("["):
            if not _LIST.match(text):
                raise ValueError
            return sum(float(x) for x in text[1:-1].split(";"))
        return float(text)
    except ValueError:
        raise FormatError(f"{where}: {key}={text!r} is not a number") from None


def _parse_node(line: str, where: str) -> tuple[str, str, dict[str, float]]:
    tokens = line.split(" -- ")
    meta_at = next((i for i, t in enumerate(tokens) if t.startswith("forward_compute_time=")), None)
    if len(tokens) < 3 or meta_at is None or meta_at < 2:
        raise FormatError(f"{where}: expected 'nodeK -- <description> -- forward_compute_time=..., ...'")
    parts = [p.split("=", 1) for p in tokens[meta_at].split(", ")]
    if [p[0] for p in parts] != list(_FIELDS) or any(len(p) != 2 for p in parts):
        raise FormatError(f"{where}: metadata must be {', '.join(f + '=...' for f in _FIELDS)}")
    values = {k: _value(v, where, k) for k, v in parts}
    if any(values[k] < 0 for k in _FIELDS):
        raise FormatError(f"{where}: negative time or size")
    return tokens[0].strip(), " -- ".join(tokens[1:meta_at]).strip(), values


def _parse(text: str, name: str):
    nodes: dict[str, tuple[str, dict[str, float]]] = {}
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{name}:{lineno}"
        if not line.strip():
            continue
        if line.startswith("\t") or line.startswith(" "):
            ends = line.strip().split(" -- ")
            if len(ends) != 2 or not all(ends):
                raise FormatError(f"{where}: expected an edge '<TAB>nodeA -- nodeB'")
            edges.append((ends[0].strip(), ends[1].strip()))
            continue
        node_id, desc, values = _parse_node(line.strip(), where)
        if node_id in nodes:
            raise FormatError(f"{where}: node {node_id!r} defined twice")
        nodes[node_id] = (desc, values)
    for a, b in edges:
        for end in (a, b):
            if end not in nodes:
                raise FormatError(f"{name}: edge {a} -- {b} names undefined node {end!r}")
    if not nodes:
        raise FormatError(f"{name}: no nodes")
    return nodes, edges


def _sort_key(node_id: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", node_id)
    return (int(digits) if digits else -1, node_id)


def _topological(nodes, succ, pred, name: str) -> list[str]:
    indegree = {n: len(pred[n]) for n in nodes}
    ready = [(_sort_key(n), n) for n in nodes if indegree[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in succ[n]:
            indegree[m] -= 1
            if indegree[m] == 0:
                heapq.heappush(ready, (_sort_key(m), m))
    if len(order) != len(nodes):
        raise FormatError(f"{name}: the graph has a cycle")
    return order


def _drop_pipedream_extras(nodes, succ, pred) -> list[str]:
    dropped = [n for n, (desc, _) in nodes.items() if not pred[n] and desc.startswith("Input")]
    dropped += [n for n, (desc, _) in nodes.items() if not succ[n] and desc.startswith("__getitem__")]
    for n in dropped:
        for m in succ.pop(n):
            pred[m].discard(n)
        for m in pred.pop(n):
            succ[m].discard(n)
        nodes.pop(n)
    return dropped


def read_pipedream_graph(path: str | os.PathLike) -> Profile:
    """Profile of a PipeDream graph.txt (see the module docstring for the conventions)."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise FormatError(f"cannot read PipeDream profile {name!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise FormatError(f"PipeDream profile {name!r} is not text (a graph.txt is UTF-8 lines)") from None
    nodes, edges = _parse(text, name)
    if any(" -- stage_id=" in line for line in text.splitlines()):
        warn(f"{name}: stage_id annotations are ignored (the partitioner chooses stages)")
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    pred: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        succ[a].add(b)
        pred[b].add(a)
    dropped = _drop_pipedream_extras(nodes, succ, pred)
    if not nodes:
        raise FormatError(f"{name}: only input nodes")
    order = _topological(nodes, succ, pred, name)
    return Profile(
        layers=tuple(_layer(n, *nodes[n]) for n in order),
        cut_bytes=_cut_bytes(order, nodes, succ),
        provenance=Provenance(
            source="pipedream",
            model=os.path.basename(os.path.dirname(os.path.abspath(name))) or name,
            notes=f"imported from {name}; times per PipeDream minibatch; dropped {', '.join(dropped) or 'nothing'}",
        ),
    )


def _layer(node_id: str, desc: str, values: dict[str, float]) -> LayerProfile:
    backward = values["backward_compute_time"]
    activation = int(round(values["activation_size"]))
    return LayerProfile(
        name=node_id,
        forward_ms=values["forward_compute_time"],
        input_grad_ms=backward,
        weight_grad_ms=0.0,
        backward_ms=backward,
        activation_bytes=activation,
        activation_freed_by_input_grad_bytes=0,
        param_count=int(round(values["parameter_size"] / 4)),
        param_bytes=int(round(values["parameter_size"])),
        output_bytes=activation,
        module_path=desc,
    )


def _cut_bytes(order: list[str], nodes, succ) -> tuple[int, ...]:
    """cut k (after position k): outputs of nodes at <= k consumed at > k; a difference array over positions."""
    position = {n: i for i, n in enumerate(order)}
    delta = [0] * (len(order) + 1)
    for n in order:
        if succ[n]:
            last_use = max(position[m] for m in succ[n])
            size = int(round(nodes[n][1]["activation_size"]))
            delta[position[n]] += size
            delta[last_use] -= size
    cuts, running = [], 0
    for k in range(len(order) - 1):
        running += delta[k]
        cuts.append(running)
    return tuple(cuts)
