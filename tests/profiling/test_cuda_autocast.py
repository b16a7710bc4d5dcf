"""The analytic profiler's CUDA autocast (profiling/cuda_autocast.py) against torch's own: the AutocastCUDA kernels,
which a CPU build of torch registers and runs on fake CUDA tensors (without autograd: a CUDA autograd node needs a
CUDA device guard, so the reference runs under no_grad; dtypes do not depend on it). Checked: the op lists are the
registered ones, each policy gives torch's output dtype, and whole traced models (fx and torch.export graphs) get
torch's dtype at every node."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model
from pipeplan.profiling.cuda_autocast import FP32, FP32_OUTPUT, LOWER, PROMOTE, CudaAutocast, op_name

COMPOSITES = {"cross_entropy", "cross_entropy_loss", "interpolate"}  # Python-level, made of listed fp32 ops
BANNED = {"binary_cross_entropy"}  # autocast raises on it (use the _with_logits form)


@contextlib.contextmanager
def torch_cuda_autocast(dtype: torch.dtype):
    """torch's AutocastCUDA kernels on (torch.autocast('cuda') refuses without a GPU; the kernels do not)."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def test_the_lists_are_the_ops_torch_autocasts_on_cuda():
    registered = {
        name.partition("::")[2].partition(".")[0]
        for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
        if name.startswith("aten::")
    }
    listed = LOWER | FP32 | FP32_OUTPUT | PROMOTE
    assert registered - listed == BANNED
    assert listed - registered == COMPOSITES
    assert not (LOWER & FP32) and not (FP32 & FP32_OUTPUT) and not (FP32_OUTPUT & PROMOTE) and not (LOWER & PROMOTE)


def _dtypes(value):
    return tree_map(lambda v: v.dtype if isinstance(v, torch.Tensor) else None, value)


CALLS = {  # name -> call(tensors): f = fp32 (4, 8), h = bf16 (4, 8), w = fp32 (8, 8), ...
    "linear": lambda t: F.linear(t["f"], t["w"], t["b"]),
    "matmul": lambda t: t["f"] @ t["w"],
    "rmatmul": lambda t: t["w"].__rmatmul__(t["h"]),
    "mm": lambda t: torch.mm(t["h"], t["w"]),
    "bmm": lambda t: torch.bmm(t["f3"], t["f3"].transpose(1, 2)),
    "baddbmm": lambda t: torch.baddbmm(t["f3"], t["f3"], t["f3"]),
    "addmm": lambda t: torch.addmm(t["b"], t["f"], t["w"]),
    "einsum": lambda t: torch.einsum("ij,jk->ik", t["f"], t["w"]),
    "conv2d": lambda t: F.conv2d(t["image"], t["kernel"]),
    "sdpa": lambda t: F.scaled_dot_product_attention(t["q"], t["q"], t["q"], is_causal=True),
    "layer_norm": lambda t: F.layer_norm(t["h"], (8,), t["b"], t["b"]),
    "layer_norm fp32 in": lambda t: F.layer_norm(t["f"], (8,)),
    "rms_norm": lambda t: F.rms_norm(t["h"], (8,), t["b"]),
    "group_norm": lambda t: F.group_norm(t["image"].bfloat16(), 1),
    "exp": lambda t: torch.exp(t["h"]),
    "pow": lambda t: t["h"].pow(2),
    "pow operator": lambda t: t["h"] ** 2,
    "rpow": lambda t: 2 ** t["h"],
    "rsqrt": lambda t: t["h"].rsqrt(),
    "log": lambda t: t["h"].log(),
    "softplus": lambda t: F.softplus(t["h"]),
    "mse_loss": lambda t: F.mse_loss(t["h"], t["h"]),
    "cross_entropy": lambda t: F.cross_entropy(t["h"], t["target"]),
    "nll_loss": lambda t: F.nll_loss(t["h"], t["target"]),
    "softmax": lambda t: F.softmax(t["h"], -1),
    "softmax method": lambda t: t["h"].softmax(-1),
    "softmax given dtype": lambda t: F.softmax(t["h"], -1, dtype=torch.bfloat16),
    "log_softmax": lambda t: torch.log_softmax(t["h"], -1),
    "sum": lambda t: t["h"].sum(),
    "sum dim": lambda t: t["h"].sum(-1),
    "cumsum": lambda t: torch.cumsum(t["h"], 0),
    "prod": lambda t: t["h"].prod(),
    "vector_norm": lambda t: torch.linalg.vector_norm(t["h"]),
    "logsumexp": lambda t: torch.logsumexp(t["h"], -1),
    "addcmul promotes": lambda t: torch.addcmul(t["f"], t["h"], t["h"]),
    "addcmul low": lambda t: torch.addcmul(t["h"], t["h"], t["h"]),
    "atan2": lambda t: torch.atan2(t["h"], t["f"]),
    "gelu (no policy)": lambda t: F.gelu(t["h"]),
    "add (no policy)": lambda t: t["f"] + t["h"],
    "mean (no policy)": lambda t: t["h"].mean(-1),
    "embedding (no policy)": lambda t: F.embedding(t["target"], t["w"]),
    "double stays": lambda t: F.linear(t["d"], t["d"]),
}
SHAPES = {
    "f": ((4, 8), torch.float32),
    "h": ((4, 8), torch.bfloat16),
    "d": ((8, 8), torch.float64),
    "w": ((8, 8), torch.float32),
    "b": ((8,), torch.float32),
    "f3": ((2, 8, 8), torch.float32),
    "image": ((2, 4, 6, 6), torch.float32),
    "kernel": ((3, 4, 3, 3), torch.float32),
    "q": ((1, 2, 8, 8), torch.float32),
    "target": ((4,), torch.int64),
}


def _tensors(device: str) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in SHAPES.items()}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_policy_gives_torchs_dtype(name):
    with FakeTensorMode(), torch_cuda_autocast(torch.bfloat16):
        want = _dtypes(CALLS[name](_tensors("cuda")))
    with CudaAutocast(torch.bfloat16):
        got = _dtypes(CALLS[name](_tensors("meta")))
    assert got == want


def _on(device: str):
    def move(value):
        if isinstance(value, torch.device):
            return torch.device(device)
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return value

    return move


class _Recorder(fx.Interpreter):
    """Each node's output dtypes; meta devices and constants the trace baked in moved to `device`. On fake CUDA
    tensors, a node whose Python-level code needs a CUDA device guard (indexing, `.to(device=)`), which a CPU build
    lacks, runs on meta tensors of the same dtypes instead, without autocast: `fell_back` names them, and none may
    be an op autocast handles."""

    def __init__(self, module: fx.GraphModule, device: torch.device) -> None:
        super().__init__(module)
        self.device, self.dtypes, self.fell_back = device, {}, {}

    def _move(self, value):
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        if isinstance(value, torch.Tensor) and value.device.type == "meta" and self.device.type != "meta":
            return torch.empty(tuple(value.shape), dtype=value.dtype, device=self.device)
        return value

    def fetch_attr(self, target: str):
        return self._move(super().fetch_attr(target))

    def run_node(self, node: fx.Node):
        with self._set_current_node(node):
            args, kwargs = tree_map(self._move, self.fetch_args_kwargs_from_env(node))
            try:
                result = getattr(self, node.op)(node.target, args, kwargs)
            except RuntimeError as exc:
                if "not linked with support for cuda" not in str(exc):
                    raise
                self.fell_back[node.name] = node.target
                with torch.autocast("cpu", enabled=False), torch.no_grad():
                    args, kwargs = tree_map(_on("meta"), (args, kwargs))
                    result = tree_map(_on("cuda"), getattr(self, node.op)(node.target, args, kwargs))
        self.dtypes[node.name] = _dtypes(result)
        return result


class _Runner(nn.Module):
    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__()
        self.gm, self.recorder = gm, _Recorder(gm, device)

    def forward(self, *inputs):
        return self.recorder.run(*inputs)


def _node_dtypes(traced, device: str, context) -> tuple[dict, dict]:
    runner = _Runner(traced.graph_module, torch.device(device))
    named = [*traced.graph_module.named_parameters(), *traced.graph_module.named_buffers()]
    sample, _ = traced.spec.sample_batch(traced.batch_size, generator=torch.Generator().manual_seed(0))
    with context():
        state = {f"gm.{n}": torch.empty(tuple(t.shape), dtype=t.dtype, device=device) for n, t in named}
        for name, param in traced.graph_module.named_parameters():
            state[f"gm.{name}"].requires_grad_(device == "meta" and param.is_floating_point())  # the cache's path
        inputs = [torch.empty(tuple(t.shape), dtype=t.dtype, device=device) for t in sample]
        torch.func.functional_call(runner, state, tuple(inputs), tie_weights=True, strict=False)
    return runner.recorder.dtypes, runner.recorder.fell_back


def _reference():
    stack = contextlib.ExitStack()
    stack.enter_context(FakeTensorMode())
    stack.enter_context(torch_cuda_autocast(torch.bfloat16))
    return stack


MODELS = [
    ("gpt", dict(layers=1, hidden=64, heads=4, seq=16, vocab=64), "fx"),
    ("llama", dict(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, seq=16, vocab=64), "fx"),
    ("resnet", dict(blocks=1, channels=8, image=8), "fx"),
    ("gpt", dict(layers=1, hidden=64, heads=4, seq=16, vocab=64), "export"),
    (
        "hf:llama",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=1,
            intermediate_size=128,
            vocab_size=64,
            seq_len=16,
        ),
        "auto",
    ),
]


@pytest.mark.parametrize("ref, options, tracer", MODELS, ids=[f"{m[0]}-{m[2]}" for m in MODELS])
def test_whole_models_get_torchs_dtypes_at_every_node(ref, options, tracer):
    if ref.startswith("hf:"):
        pytest.importorskip("transformers")
    spec = load_model(ref, {k: str(v) for k, v in options.items()})
    traced = trace_model(spec, batch_size=2, device="meta", tracer=tracer)
    want, fell_back = _node_dtypes(traced, "cuda", _reference)
    got, _ = _node_dtypes(traced, "meta", lambda: CudaAutocast(torch.bfloat16))
    assert got == want
    assert any(d == torch.bfloat16 for d in want.values()) and any(d == torch.float32 for d in want.values())
    handled = LOWER | FP32 | FP32_OUTPUT | PROMOTE
    assert not {name: t for name, t in fell_back.items() if op_name(t) in handled}


def test_parameter_casts_are_cached_once_per_forward():
    """A weight used twice in one forward is cast once (autocast's cache); a new forward casts again."""
    w = torch.empty(8, 8, device="meta", requires_grad=True)
    x = torch.empty(4, 8, device="meta")
    for _ in range(2):
        with CudaAutocast(torch.bfloat16) as mode:
            first = F.linear(x, w)
            second = F.linear(x, w)
            assert len(mode._cache) == 1 and first.dtype == second.dtype == torch.bfloat16
        assert not mode._cache
