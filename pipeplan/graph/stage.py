"""Stage modules: a runnable nn.Module for any set of FX nodes of a traced model (one layer for the profiler, a
union of layers for a pipeline stage in the runtime).

An input the stage modifies in place (recorded by tracing) is cloned on entry: the caller's tensor (a leaf that
requires grad, an activation another stage also reads) is never written, and autograd sees an ordinary op.

The stage references, never copies, the original submodules and Parameters it uses (tied weights stay one
Parameter object) and holds only those, so a rank can build the model on the meta device and materialize just its
own part. Parameter names are the original qualified names (`blocks.0.attn.qkv.weight`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from pipeplan.graph.trace import TracedModel


class StageModule(fx.GraphModule):
    """`forward(*values)` takes `inputs` in order and returns a tuple in `outputs` order."""

    inputs: tuple[str, ...]  # values consumed but produced elsewhere (other stages or model placeholders)
    outputs: tuple[str, ...]  # values produced here and needed later (the model output included)
    node_names: tuple[str, ...]  # the original FX nodes this stage runs, in graph order

    def __init__(self, root, graph: fx.Graph, *, inputs, outputs, node_names) -> None:
        super().__init__(root, graph, class_name="StageModule")
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.node_names = tuple(node_names)


def stage_boundary(traced: TracedModel, node_names: Iterable[str]) -> tuple[list[fx.Node], list[str], list[str]]:
    """(nodes in graph order, input value names, output value names) for a set of node names."""
    wanted = set(node_names)
    graph_nodes = list(traced.graph_module.graph.nodes)
    known = {n.name for n in graph_nodes}
    unknown = sorted(wanted - known)
    assert not unknown, f"unknown FX nodes: {unknown[:5]}"
    nodes = [n for n in graph_nodes if n.name in wanted and n.op != "output"]
    members = {n.name for n in nodes}
    inputs: list[str] = []
    for node in nodes:
        if node.op == "placeholder":
            inputs.append(node.name)
            continue
        for arg in node.all_input_nodes:
            if arg.name not in members and arg.name not in inputs:
                inputs.append(arg.name)
    outputs = [
        n.name
        for n in nodes
        if n.op != "placeholder" and any(u.op == "output" or u.name not in members for u in n.users)
    ]
    return nodes, inputs, outputs


def last_stage_outputs(traced: TracedModel, node_names: Iterable[str]) -> list[str]:
    """The outputs of a pipeline's last stage (or the last layer as the profilers run it): what its nodes produce
    for later nodes, then every value the model's output is built from that an earlier stage computes (passed
    through from its inputs), so that `loss_fn` runs there."""
    outputs = stage_boundary(traced, node_names)[2]
    return outputs + [name for name in traced.layer_graph.output_names if name not in outputs]


def _mutated_inputs(nodes: list[fx.Node], inputs: list[str]) -> list[str]:
    """Stage inputs some node of the stage modifies in place (`nn.ReLU(inplace=True)`, `x += y`)."""
    written = {name for node in nodes for name in node.meta.get("mutates", ())}
    return [name for name in inputs if name in written]


def _leaf_count(node: fx.Node) -> int:
    """Tensors in a flat tuple/list value of tensors (a leaf module returning a pair), else 0."""
    meta = node.meta.get("tensor_meta")
    if node.meta.get("value_type") not in ("tuple", "list") or not isinstance(meta, list | tuple) or not meta:
        return 0
    return len(meta) if all(isinstance(m, TensorMetadata) for m in meta) else 0


def value_tensor_meta(traced: TracedModel, name: str) -> TensorMetadata | None:
    """Shape and dtype of a stage input/output value: a graph node's, or element i of a container (`name.i`)."""
    nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    base, _, index = name.partition(".")
    meta = nodes[base].meta.get("tensor_meta")
    if index:
        meta = meta[int(index)]
    return meta if isinstance(meta, TensorMetadata) else None


def build_stage_module(
    traced: TracedModel, node_names: Iterable[str], *, outputs: Iterable[str] | None = None
) -> StageModule:
    """A StageModule computing the given FX nodes of `traced.graph_module`.

    `outputs` overrides which values it returns (default: everything it produces that a later node needs); a name
    it does not produce is passed through from its inputs, so an adjacent-stage pipeline can return exactly the
    values of the next cut (`[t.producer for t in layer_graph.cuts[i]]`), skip connections included. A tuple or
    list of tensors crossing the stage's boundary (not the model's own output) travels as its elements, named
    `value.0`, `value.1`, ...: the stage returns them one by one and a consuming stage rebuilds the container.
    """
    nodes, inputs, default_outputs = stage_boundary(traced, node_names)
    assert nodes, "a stage needs at least one node"
    produced = {n.name for n in nodes if n.op != "placeholder"}
    outputs = default_outputs if outputs is None else list(outputs)
    inputs += [name for name in outputs if name not in produced and name not in inputs]
    by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    kept = set(traced.layer_graph.output_names)
    count = {name: 0 if name in kept else _leaf_count(by_name[name]) for name in {*inputs, *outputs}}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in inputs:
        if count[name]:
            elements = [graph.placeholder(f"{name}_{i}") for i in range(count[name])]
            maker = tuple if by_name[name].meta["value_type"] == "tuple" else list
            env[name] = graph.call_function(maker, (elements,))
        else:
            env[name] = graph.placeholder(name)
    for name in _mutated_inputs(nodes, [n for n in inputs if not count[n]]):  # a copy: the caller's value stays
        env[name] = graph.call_method("clone", (env[name],))
    for node in nodes:
        if node.op == "placeholder":
            continue
        env[node.name] = graph.node_copy(node, lambda arg: env[arg.name])
    results = [
        graph.call_function(operator.getitem, (env[name], i)) if count[name] else env[name]
        for name in outputs
        for i in range(max(count[name], 1))
    ]
    graph.output(tuple(results))
    graph.lint()
    return StageModule(
        traced.graph_module,
        graph,
        inputs=_expanded(inputs, count),
        outputs=_expanded(outputs, count),
        node_names=[n.name for n in nodes],
    )


def _expanded(names: list[str], count: dict[str, int]) -> list[str]:
    return [f"{name}.{i}" if count[name] else name for name in names for i in range(max(count[name], 1))]
