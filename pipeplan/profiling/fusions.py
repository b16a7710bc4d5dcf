"""RMSNorm written by hand, recognized by structure and counted as the fused kernel production engines run.

Hugging Face models (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, GemmaRMSNorm, ...) and many user models write
RMSNorm out: cast to float32, `pow(2).mean(-1)`, `rsqrt`, multiply, cast back, scale by the weight (Gemma by
1 + weight). Run op by op, autograd saves a float32 copy of the input and the normalized values besides the
input; the fused kernels of Megatron-Core / Transformer Engine / Apex save the input and one float32 statistic
per row (`gpu_ops._FusedRMSNorm`, what `F.rms_norm` is counted as). The analytic profile counts what a GPU run of
the model on such an engine keeps, so a hand-written RMSNorm is counted as that kernel too.

A *norm region* of a layer's graph is the set of call_function nodes whose innermost module (`nn_module_stack`)
is one module instance, that reads one tensor from outside and exactly one parameter of that module, a vector as long
as the last dimension of the one value it produces for nodes outside it. It is RMSNorm when the region,
run on a small random CPU input (its ops are shape-agnostic reductions and elementwise ops; a region that cannot
run so is left alone), gives weight · x / rms(x) or (1 + weight) · x / rms(x). Each such region becomes one call
of `gpu_ops.fused_rms_norm` (the profiled graph only; the model's graph and what the runtime runs are unchanged).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from pipeplan.profiling.gpu_ops import fused_rms_norm

PROBE_ROWS = 6  # rows of the CPU probe
TOLERANCE = 3e-2  # relative: the region may round through bf16


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    value = list(stack.values())[-1]
    return value[0] if isinstance(value, tuple) else str(value)


def _regions(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    regions: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        path = _module_path(node) if node.op == "call_function" else None
        if path:
            regions.setdefault(path, []).append(node)
    return regions


def _boundary(gm: fx.GraphModule, path: str, nodes: list[fx.Node]):
    """(input node, weight get_attr node, output node) of a candidate norm region, or None."""
    members = set(nodes)
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    outside = {arg for node in nodes for arg in node.all_input_nodes if arg not in members}
    weights = [n for n in outside if n.op == "get_attr" and str(n.target).startswith(path + ".")]
    inputs = [n for n in outside if n not in weights]
    results = [n for n in nodes if any(user not in members for user in n.users)]
    if len(weights) != 1 or len(inputs) != 1 or len(results) != 1 or str(weights[0].target) not in params:
        return None
    x, weight, y = inputs[0], weights[0], results[0]
    width, out = (getattr(n.meta.get("val"), "shape", None) for n in (weight, y))  # a stage input has no meta
    if width is None or out is None or len(width) != 1 or not out or out[-1] != width[0]:
        return None
    return x, weight, y


def _probe(nodes: list[fx.Node], x: fx.Node, weight: fx.Node, y: fx.Node) -> float | None:
    """The region's weight offset (0: weight · x / rms, 1: (1 + weight) · x / rms) found on a CPU probe, or None
    when it is not RMSNorm (or cannot run on the probe)."""
    graph = fx.Graph()
    env = {x: graph.placeholder("x"), weight: graph.placeholder("weight")}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(env[y])
    width = weight.meta["val"].shape[0]
    generator = torch.Generator().manual_seed(0)
    probe_x = torch.randn(PROBE_ROWS, width, generator=generator) * 3
    probe_w = torch.rand(width, generator=generator) + 0.5
    try:
        with torch.no_grad():
            out = fx.GraphModule(torch.nn.Module(), graph)(probe_x.to(y.meta["val"].dtype), probe_w).float()
    except Exception:  # shape-specialized or data-dependent ops: not a norm this check can vouch for
        return None
    normed = probe_x * torch.rsqrt(probe_x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for offset in (0.0, 1.0):
        expected = normed * (probe_w + offset)
        if out.shape == expected.shape and torch.allclose(out, expected, rtol=TOLERANCE, atol=TOLERANCE):
            return offset
    return None


def _signature(nodes: list[fx.Node], x: fx.Node, weight: fx.Node, y: fx.Node) -> tuple:
    """The region's ops with their arguments, nodes numbered within it: equal signatures probe alike."""
    numbers = {x: "x", weight: "weight", **{node: index for index, node in enumerate(nodes)}}

    def arg(value):
        if isinstance(value, fx.Node):
            return ("node", numbers[value])
        if isinstance(value, list | tuple):
            return tuple(arg(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, arg(v)) for k, v in value.items())
        return repr(value)

    width = weight.meta["val"].shape[0]
    return width, str(y.meta["val"].dtype), tuple((str(n.target), arg(n.args), arg(n.kwargs)) for n in nodes)


def fuse_norms(gm: fx.GraphModule, probed: dict | None = None) -> int:
    """Replace each hand-written RMSNorm region of `gm` by one fused_rms_norm call (module docstring); returns how
    many it replaced. `probed` keeps each region signature's probe across calls (a model's norms probe once)."""
    probed = {} if probed is None else probed
    replaced = 0
    for path, nodes in _regions(gm).items():
        found = _boundary(gm, path, nodes)
        if found is None:
            continue
        signature = _signature(nodes, *found)
        if signature not in probed:
            probed[signature] = _probe(nodes, *found)
        offset = probed[signature]
        if offset is None:
            continue
        x, weight, y = found
        dtype = y.meta["val"].dtype
        with gm.graph.inserting_before(y):
            fused = gm.graph.call_function(fused_rms_norm, (x, weight), {"offset": offset, "dtype": dtype})
        fused.meta = {**y.meta}
        y.replace_all_uses_with(fused)
        for node in reversed(nodes):
            gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced
