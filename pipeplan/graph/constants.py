"""Values that need not cross a cut: a traced graph's *constant* values — computed from buffers and constants alone,
never from a model input or a parameter (Hugging Face's rotary embedding: cos and sin from the `inv_freq` buffer
and the positions 0..s-1; a sliding-window mask) — are made again in each layer that reads them, as a pipeline
stage can make them itself, instead of being sent across every cut between the layer that made them and the last
that reads them. A helper module that only makes such values (`model.rotary_emb`) then leaves no layer of its own:
it is not a layer to cut or to shard.

A node is constant when it is a buffer's or a tensor constant's `get_attr`, or an ATen op (export graphs) that
draws no random numbers, modifies none of its inputs and reads only constant nodes (shapes are specialized in an
export, so `arange(s)` is one). torch.fx graphs keep their Python-level calls (`torch.arange`, methods) and are
left alone. The copies go right before their first reader in each layer, so layers stay contiguous runs of nodes;
a value is made again only where it crossed a cut, and the original is erased once nothing reads it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx


def _op_is_constant_safe(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable:
        return False
    return not any(tag == torch.Tag.nondeterministic_seeded for tag in target.tags)


def constant_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The graph's constant nodes (module docstring)."""
    parameters = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    constant: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if str(node.target) not in parameters:
                constant.add(node)
        elif node.op == "call_function" and _op_is_constant_safe(node) and constant.issuperset(node.all_input_nodes):
            constant.add(node)
    return constant


def _ancestry(node: fx.Node, constant: set[fx.Node]) -> list[fx.Node]:
    """`node` and the constant nodes it is computed from, in graph order."""
    found: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if current in found:
            continue
        found[current] = None
        stack.extend(arg for arg in current.all_input_nodes if arg in constant)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def rematerialize_constants(gm: fx.GraphModule, node_layer: dict[str, int]) -> bool:
    """Make each constant value read in a later layer again in that layer (module docstring); erase originals
    nothing reads any more. `node_layer` maps node names to layers and gets the copies' layers. Returns whether
    the graph changed."""
    constant = constant_nodes(gm)
    changed = False
    for node in [n for n in gm.graph.nodes if n in constant]:
        home = node_layer.get(node.name)
        readers: dict[int, list[fx.Node]] = {}
        for user in node.users:
            layer = node_layer.get(user.name)
            if user.op != "output" and layer is not None and layer != home:
                readers.setdefault(layer, []).append(user)
        for layer, users in readers.items():
            _copy_into(gm, node, users, layer, constant, node_layer)
            changed = True
    if changed:
        _erase_unread(gm, constant, node_layer)
        gm.graph.lint()
        gm.recompile()
    return changed


def _copy_into(gm, node: fx.Node, users: list[fx.Node], layer: int, constant: set[fx.Node], node_layer) -> None:
    """Copies of `node`'s constant computation right before the first of `users` (all in `layer`)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(users, key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(first):
        for source in _ancestry(node, constant):
            if node_layer.get(source.name) == layer:  # already made in this layer
                copies[source] = source
                continue
            copy = gm.graph.node_copy(source, lambda arg: copies.get(arg, arg))
            copy.meta = dict(source.meta)
            copies[source] = copy
            constant.add(copy)
            node_layer[copy.name] = layer
    for user in users:
        user.replace_input_with(node, copies[node])


def _erase_unread(gm: fx.GraphModule, constant: set[fx.Node], node_layer: dict[str, int]) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if node in constant and not node.users:
            gm.graph.erase_node(node)
            node_layer.pop(node.name, None)
