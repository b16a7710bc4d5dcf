"""Norms and activations written out op by op, recognized by structure and counted as the kernels the built-in
models call (what production engines run).

Hugging Face models and many user models write RMSNorm out (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm,
GemmaRMSNorm: cast to float32, `pow(2).mean(-1)`, `rsqrt`, multiply, cast back, scale by the weight, Gemma by
1 + weight) and some write their activation out (GPT-2's NewGELUActivation: the tanh formula). Run op by op,
autograd saves a float32 copy of the input and every intermediate; the fused RMSNorm kernels of Megatron-Core /
Transformer Engine / Apex save the input and one float32 statistic per row (`gpu_ops._FusedRMSNorm`, what
`F.rms_norm` is counted as), and the GELU and SiLU kernels (`F.gelu`, `F.silu`) save their input. The analytic
profile counts what a GPU run on such an engine does, so these regions are counted as those kernels.

A *region* of a layer's graph is the set of call_function and call_method nodes whose innermost module
(`nn_module_stack`) is one module instance; it qualifies when it reads one tensor from outside (and, for a norm,
exactly one parameter of that module: a vector as long as the last dimension of its result) and produces one value
read outside it, of its input's last dimension. What it computes is then checked on a small random CPU input
(regions whose ops cannot run on it are left alone): a norm must give weight · x / rms(x) or (1 + weight) · x /
rms(x); an activation must give GELU (tanh or erf form) or SiLU to float32 rounding. Each recognized region becomes
one call of the kernel (`gpu_ops.fused_rms_norm`, `F.gelu`, `F.silu`) in the profiled graph only: the model's graph
and what the runtime runs are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from pipeplan.profiling.gpu_ops import fused_rms_norm

PROBE_ROWS = 6  # rows of the CPU probe
NORM_TOLERANCE = 3e-2  # relative: a norm may round through bf16 (its candidates differ by far more)
ACTIVATION_TOLERANCE = 1e-4  # GELU's tanh and erf forms differ by up to 5e-4 (and quick_gelu by 2e-2)
# name -> (the function the built-ins call, keyword arguments)
ACTIVATIONS: dict[str, tuple[Callable[..., torch.Tensor], dict[str, str]]] = {
    "gelu_tanh": (F.gelu, {"approximate": "tanh"}),
    "gelu": (F.gelu, {}),
    "silu": (F.silu, {}),
}


def _meta(node: fx.Node):
    """(shape, dtype) of a node's value as the trace recorded it (export: `val`, fx: `tensor_meta`), or None."""
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return (tuple(shape), dtype) if shape is not None and dtype is not None else None


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    value = list(stack.values())[-1]
    return value[0] if isinstance(value, tuple) else str(value)


def _regions(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    regions: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        path = _module_path(node) if node.op in ("call_function", "call_method") else None
        if path:
            regions.setdefault(path, []).append(node)
    return regions


def _boundary(gm: fx.GraphModule, path: str, nodes: list[fx.Node]):
    """(input node, weight get_attr node or None, output node) of a candidate region, or None."""
    members = set(nodes)
    outside = {arg for node in nodes for arg in node.all_input_nodes if arg not in members}
    weights = [n for n in outside if n.op == "get_attr" and str(n.target).startswith(path + ".")]
    inputs = [n for n in outside if n not in weights and n.op != "get_attr"]
    results = [n for n in nodes if any(user not in members for user in n.users)]
    if len(weights) > 1 or len(inputs) != 1 or len(results) != 1 or len(outside) != len(inputs) + len(weights):
        return None
    weight = weights[0] if weights else None
    if weight is not None and str(weight.target) not in {name for name, _ in gm.named_parameters()}:
        return None
    out = _meta(results[0])  # (a stage input has no meta: the input's shape is not read)
    width = _meta(weight) if weight is not None else None
    if out is None or not out[0] or (weight is not None and (width is None or width[0] != out[0][-1:])):
        return None
    return inputs[0], weight, results[0]


def _run(nodes: list[fx.Node], x: fx.Node, weight: fx.Node | None, y: fx.Node, *values) -> torch.Tensor | None:
    """The region run on CPU values (None when it cannot run so)."""
    graph = fx.Graph()
    env = {x: graph.placeholder("x")}
    if weight is not None:
        env[weight] = graph.placeholder("weight")
    for node in nodes:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(env[y])
    try:
        with torch.no_grad():
            return fx.GraphModule(torch.nn.Module(), graph)(*values).float()
    except Exception:  # shape-specialized or data-dependent ops: not a region this check can vouch for
        return None


def _probe(nodes: list[fx.Node], x: fx.Node, weight: fx.Node | None, y: fx.Node):
    """What the region computes: ("norm", offset), ("activation", name), or None."""
    shape, dtype = _meta(y)
    width = shape[-1]
    generator = torch.Generator().manual_seed(0)
    probe_x = torch.randn(PROBE_ROWS, width, generator=generator) * 3
    if weight is None:
        out = _run(nodes, x, None, y, probe_x)
        if out is None or out.shape != probe_x.shape:  # e.g. attention's region: its input is q, k and v together
            return None
        for name, (function, kwargs) in ACTIVATIONS.items():
            if torch.allclose(out, function(probe_x, **kwargs), rtol=0, atol=ACTIVATION_TOLERANCE):
                return "activation", name
        return None
    probe_w = torch.rand(width, generator=generator) + 0.5
    out = _run(nodes, x, weight, y, probe_x.to(dtype), probe_w)
    normed = probe_x * torch.rsqrt(probe_x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for offset in (0.0, 1.0):
        expected = normed * (probe_w + offset)
        tolerance = NORM_TOLERANCE
        if out is not None and out.shape == expected.shape and torch.allclose(out, expected, tolerance, tolerance):
            return "norm", offset
    return None


def _signature(nodes: list[fx.Node], x: fx.Node, weight: fx.Node | None, y: fx.Node) -> tuple:
    """The region's ops with their arguments, nodes numbered within it: equal signatures probe alike."""
    numbers: dict[fx.Node | None, str | int] = {x: "x", weight: "weight", **{n: i for i, n in enumerate(nodes)}}

    def arg(value):
        if isinstance(value, fx.Node):
            return ("node", numbers[value])
        if isinstance(value, list | tuple):
            return tuple(arg(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, arg(v)) for k, v in value.items())
        return repr(value)

    shape, dtype = _meta(y)
    return weight is not None, shape[-1], str(dtype), tuple((str(n.target), arg(n.args), arg(n.kwargs)) for n in nodes)


def _kernel(kind: tuple) -> tuple:
    """(function, keyword arguments) a recognized region becomes (positional: the input, and a norm's weight)."""
    if kind[0] == "norm":
        return fused_rms_norm, {"offset": kind[1]}
    return ACTIVATIONS[kind[1]]


def fuse_regions(gm: fx.GraphModule, probed: dict | None = None) -> int:
    """Replace each recognized norm or activation region of `gm` by one kernel call (module docstring); returns
    how many it replaced. `probed` keeps each region signature's probe across calls (a model's norms probe once)."""
    probed = {} if probed is None else probed
    replaced = 0
    for path, nodes in _regions(gm).items():
        found = _boundary(gm, path, nodes)
        if found is None:
            continue
        signature = _signature(nodes, *found)
        if signature not in probed:
            probed[signature] = _probe(nodes, *found)
        kind = probed[signature]
        if kind is None:
            continue
        x, weight, y = found
        function, kwargs = _kernel(kind)
        with gm.graph.inserting_before(y):
            fused = gm.graph.call_function(function, (x, weight) if weight is not None else (x,), dict(kwargs))
        fused.meta = {**y.meta}
        y.replace_all_uses_with(fused)
        for node in reversed(nodes):
            gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced
