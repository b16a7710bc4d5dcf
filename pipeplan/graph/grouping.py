"""Group the nodes of a traced graph (torch.fx or torch.export) into layers and find the values live across each
cut between adjacent layers.

Layers follow the model's module structure. By default each item of a repeated-block container (an
nn.ModuleList / nn.Sequential whose children share one type: gpt `blocks.{i}`, HF GPT-2 `transformer.h.{i}`) is
a layer and every other child on the way down to such a container is one layer (gpt `embed`, `head`; HF
`transformer.wte`, `lm_head`). `granularity=N` instead groups by the first N components of each node's module
path (1 = top-level children only; 3 splits a gpt block into ln1/attn/ln2/mlp). Nodes outside any module at that
depth (functional ops such as a top-level residual add, the mask code of a container's own forward) join the
layer of the nearest preceding node; nodes before the first module join the next one; placeholders join their
first user.

Before grouping, the graph is normalized so that no cut carries a tuple or a shared parameter: every getitem
moves right after the node it unpacks, and every get_attr is duplicated per user and placed right before it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols


def normalize_graph(gm: fx.GraphModule) -> None:
    """Move getitems of tuples next to their source; give each get_attr user its own get_attr, just before it."""
    graph = gm.graph
    placed: set[fx.Node] = set()
    for node in list(graph.nodes):  # in order, so a source (itself maybe a getitem) is already in place
        if _unpacks(node):
            anchor = node.args[0]
            while anchor.next in placed:
                anchor = anchor.next
            if anchor is not node:
                anchor.append(node)  # pure unpacking: depends on its source only
            placed.add(node)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        users = list(node.users)
        if not users:  # an attribute nothing reads (export lists every buffer) would make an empty layer
            graph.erase_node(node)
            continue
        for user in users[1:]:
            with graph.inserting_before(user):
                copy = graph.get_attr(node.target)
            copy.meta = dict(node.meta)
            user.replace_input_with(node, copy)
        users[0].prepend(node)
    graph.lint()
    gm.recompile()


def _unpacks(node: fx.Node) -> bool:
    """A getitem taking one element of a tuple/list/dict value with a constant key."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return False
    source = node.args[0]
    return len(node.all_input_nodes) == 1 and source.meta.get("value_type") in ("tuple", "list", "dict")


def node_module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        value = list(stack.values())[-1]
        path = value[0] if isinstance(value, tuple) else str(value)
        if path:
            return path
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    return ""


def _repeated_containers(module: nn.Module) -> set[str]:
    """Paths of ModuleList/Sequential containers whose children all share one type (repeated blocks)."""
    found = set()
    for path, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList | nn.Sequential) and len({type(child) for child in sub}) == 1:
            found.add(path)
    return found


def leaf_layer(module: nn.Module, path: str, *, whole: Callable[[nn.Module], bool] = lambda m: False) -> str:
    """The layer (default grouping) the module at `path` would lie in as a leaf: its repeated block (`blocks.0` for
    `blocks.0.moe`, `blocks.0` itself), or itself when it is a layer of its own (a top-level child); '' when a leaf
    there would swallow several layers: the root, a single-child wrapper, or a top-level child holding repeated
    blocks (an `encoder` above its layers) unless `whole(that module)` says it is one unit (an MoE layer above its
    experts)."""
    keys = _DefaultKeys(module)
    key = keys(path, leaf=True)
    if not key or not (path == key or path.startswith(key + ".")):
        return ""
    own_layer = path == key and path.rpartition(".")[0] not in keys.repeated  # a layer of its own, not a block
    holds_blocks = any(c.startswith(path + ".") for c in keys.repeated)
    return "" if own_layer and holds_blocks and not whole(module.get_submodule(path)) else key


def _root_prefix(module: nn.Module) -> str:
    """Descend through single-child wrappers (`self.model = Inner()`) so they do not make a one-layer model."""
    prefix, current = "", module
    while True:
        children = list(current.named_children())
        if len(children) != 1:
            return prefix
        name, child = children[0]
        prefix = f"{prefix}.{name}" if prefix else name
        current = child


class _DefaultKeys:
    """Layer key of a module path under the repeated-block rule ('' = code of a container that is split up)."""

    def __init__(self, module: nn.Module) -> None:
        self.repeated = _repeated_containers(module)
        self.root_prefix = _root_prefix(module)
        # containers above a repeated-block container are descended into (HF `transformer` above `transformer.h`)
        self.descend = {
            ".".join(path.split(".")[:i]) for path in self.repeated if path for i in range(1, path.count(".") + 1)
        }

    def __call__(self, path: str, leaf: bool = False) -> str:
        """`leaf`: the path is a module fx did not trace into (one call_module node), never split up."""
        if not path:
            return ""
        root = self.root_prefix
        if root and not (path == root or path.startswith(root + ".")):
            return path.split(".")[0]
        parts = path.split(".")
        depth = len(root.split(".")) if root else 0
        if len(parts) <= depth:
            return ""
        while True:
            head = ".".join(parts[: depth + 1])
            if head in self.repeated and len(parts) > depth + 1:
                return ".".join(parts[: depth + 2])
            if head in self.descend and head not in self.repeated:
                if len(parts) == depth + 1:
                    return head if leaf else ""  # the container's own code joins a neighbour
                depth += 1
                continue
            return head


def layer_keys(gm: fx.GraphModule, module: nn.Module, granularity: int | None) -> list[str]:
    """One key per node ('' = unowned), in graph order."""
    default = _DefaultKeys(module)
    has_children = {path for path, sub in module.named_modules() if next(sub.children(), None) is not None}
    keys = []
    for node in gm.graph.nodes:
        path = node_module_path(node) if node.op not in ("placeholder", "output") else ""
        if node.op == "get_attr" and len(node.users) == 1:  # a tied weight is named after one of its owners
            path = node_module_path(next(iter(node.users))) or path
        if granularity is None:
            keys.append(default(path, leaf=node.op == "call_module"))
            continue
        parts = path.split(".") if path else []
        if len(parts) >= granularity:
            keys.append(".".join(parts[:granularity]))
        else:  # a shallower leaf module is its own layer; code of a subdivided module joins a neighbour
            keys.append(path if path and path not in has_children else "")
    return keys


def assign_unowned(nodes: list[fx.Node], keys: list[str]) -> list[str]:
    """Give every unowned node the key of its nearest preceding owned node (or the next one at the start)."""
    resolved = list(keys)
    last = ""
    for i, key in enumerate(resolved):
        if key:
            last = key
        elif nodes[i].op not in ("placeholder", "output") and last:
            resolved[i] = last
    following = ""
    for i in range(len(resolved) - 1, -1, -1):
        if resolved[i]:
            following = resolved[i]
        elif nodes[i].op not in ("placeholder", "output"):
            resolved[i] = following
    if not any(resolved):
        resolved = ["model" if n.op not in ("placeholder", "output") else "" for n in nodes]
    return resolved


def group(nodes: list[fx.Node], keys: list[str]) -> tuple[list[tuple[str, list[str]]], dict[str, int]]:
    """Contiguous runs of equal keys become layers (name, node names); a key seen before (a module called again
    later) stays in the current layer, so layers remain contiguous. Placeholders join their first user's layer."""
    layers: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for node, key in zip(nodes, keys):
        if node.op in ("placeholder", "output"):
            continue
        if layers and key in seen:
            layers[-1][1].append(node.name)
        else:
            layers.append((key, [node.name]))
            seen.add(key)
    node_layer = {name: i for i, (_, names) in enumerate(layers) for name in names}
    for node in reversed([n for n in nodes if n.op == "placeholder"]):
        users = [node_layer[u.name] for u in node.users if u.name in node_layer]
        target = min(users, default=0)
        layers[target][1].insert(0, node.name)
        node_layer[node.name] = target
    return layers, node_layer


def cut_producers(nodes: list[fx.Node], node_layer: dict[str, int], num_layers: int) -> list[list[fx.Node]]:
    """cuts[i]: the nodes whose values are live between layers i and i+1 (skip connections included)."""
    cuts: list[list[fx.Node]] = [[] for _ in range(num_layers - 1)]
    for node in nodes:
        if node.op == "output" or not node.users:
            continue
        produced = node_layer[node.name]
        last_use = max(num_layers if u.op == "output" else node_layer[u.name] for u in node.users)
        for cut in range(produced, min(last_use, num_layers - 1)):
            cuts[cut].append(node)
    return cuts


def check_in_place(nodes: list[fx.Node], node_layer: dict[str, int]) -> str | None:
    """A value modified in place in one layer and read after that by a later layer would reach the later layer
    unmodified once stages copy their in-place inputs: describe the first such case (None if there is none)."""
    for node in nodes:
        for name in node.meta.get("mutates", ()):
            value = next(arg for arg in node.all_input_nodes if arg.name == name)
            if node_layer.get(value.name) == node_layer[node.name]:
                continue  # modified where it is made: every stage sees the modified value
            later = [u for u in value.users if u is not node and node_layer.get(u.name, -1) > node_layer[node.name]]
            if later:
                return f"{value.name!r} is modified in place by {node.name!r} and read afterwards by {later[0].name!r}"
    return None


def _data_dependent(node: fx.Node) -> bool:
    """The node's value has a size only the data decides (an unbacked SymInt: `x[mask]`, `nonzero`), or is such a
    size itself: no number describes it before the run, so no cut may carry it."""
    value = node.meta.get("val")
    values = value if isinstance(value, list | tuple) else (value,)
    for item in values:
        if isinstance(item, torch.SymInt) and free_unbacked_symbols(item):
            return True
        if isinstance(item, torch.Tensor) and any(
            free_unbacked_symbols(d) for d in item.shape if isinstance(d, torch.SymInt)
        ):
            return True
    return False


def merge_data_dependent_cuts(
    nodes: list[fx.Node], layers: list[tuple[str, list[str]]], node_layer: dict[str, int]
) -> tuple[list[tuple[str, list[str]]], dict[str, int]]:
    """Merge adjacent layers across every cut a data-dependent value (`_data_dependent`) would cross, so that
    each such value is made and used within one layer (where the layer runs, it has the sample's size)."""
    while True:
        cuts = cut_producers(nodes, node_layer, len(layers))
        bad = next((i for i, cut in enumerate(cuts) if any(_data_dependent(n) for n in cut)), None)
        if bad is None:
            return layers, node_layer
        merged = (layers[bad][0], layers[bad][1] + layers[bad + 1][1])
        layers = [*layers[:bad], merged, *layers[bad + 2 :]]
        node_layer = {name: i for i, (_, names) in enumerate(layers) for name in names}
