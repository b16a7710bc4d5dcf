"""The dtype each graph value really has when the model runs under a precision mode: the traced graph runs once on
fake tensors (no memory, no compute) of the run's device type, under that mode's autocast or with its
low-precision parameters. Autocast's op lists differ between CPU and CUDA (e.g. CUDA keeps layer_norm and
softmax in fp32), so the dtypes are those of `device_type`. The runtime sends cut values in these dtypes, and
profiles count the bytes crossing a cut with them.

A module run eagerly (`LayerGraph.eager_modules`: data-dependent code such as MoE dispatch) cannot run on fake
tensors; it runs once on real random tensors of the device type instead (when that device is here: always for the
CPU), under the same autocast, and its outputs' dtypes are read off that run.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_map

from pipeplan.errors import TraceError
from pipeplan.precision import get_precision


def export_dtype(precision: str) -> torch.dtype | None:
    """The parameters' dtype an export for `precision` is specialized to (graph.trace): a low-precision mode without
    autocast holds its parameters in bf16/fp16 and runs in it; None for float32 parameters (autocast casts at run
    time, and an export of float32 parameters records exactly what it runs)."""
    mode = get_precision(precision)
    if mode.autocast_dtype is not None or mode.param_dtype == torch.float32:
        return None
    return mode.param_dtype


class _Recorder(fx.Interpreter):
    """Runs the meta-traced graph on fake tensors of `device`: devices the trace baked in (`device=meta` arguments,
    constant tensors) are moved to it."""

    def __init__(self, module: fx.GraphModule, device: torch.device, eager: tuple[str, ...] = ()) -> None:
        super().__init__(module)
        self.device = device
        self.eager = eager
        self.dtypes: dict[str, object] = {}

    def _move(self, value):
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=self.device)
        return value

    def fetch_attr(self, target: str):
        return self._move(super().fetch_attr(target))

    def call_module(self, target, args, kwargs):
        try:
            return super().call_module(target, args, kwargs)
        except Exception:
            real = self.device.type == "cpu" or (self.device.type == "cuda" and torch.cuda.is_available())
            if target not in self.eager or not real:
                raise
        return self._real_run(self.fetch_attr(target), args, kwargs)

    def _real_run(self, module: nn.Module, args, kwargs):
        """`module` once on real random tensors of the same shapes and dtypes (see the module docstring), its outputs
        as fake tensors again."""

        def real(value):
            if not isinstance(value, torch.Tensor):
                return value
            if value.is_floating_point():
                return torch.randn(tuple(value.shape), dtype=value.dtype, device=self.device)
            return torch.zeros(tuple(value.shape), dtype=value.dtype, device=self.device)

        with unset_fake_temporarily(), torch.no_grad():
            state = {name: real(t) for name, t in (*module.named_parameters(), *module.named_buffers())}
            result = torch.func.functional_call(module, state, tree_map(real, args), tree_map(real, kwargs))
        # back under the fake mode: empty tensors of the real outputs' shapes and dtypes
        return tree_map(
            lambda v: (
                torch.empty(tuple(v.shape), dtype=v.dtype, device=self.device) if isinstance(v, torch.Tensor) else v
            ),
            result,
        )

    def run_node(self, node: fx.Node):
        with self._set_current_node(node):
            args, kwargs = tree_map(self._move, self.fetch_args_kwargs_from_env(node))
            result = getattr(self, node.op)(node.target, args, kwargs)
        self.dtypes[node.name] = tree_map(lambda v: v.dtype if isinstance(v, torch.Tensor) else None, result)
        return result


class _Runner(nn.Module):
    def __init__(self, graph_module: fx.GraphModule, device: torch.device, eager: tuple[str, ...]) -> None:
        super().__init__()
        self.gm = graph_module
        self.device = device
        self.eager = eager
        self.recorder: _Recorder | None = None

    def forward(self, *inputs):
        self.recorder = _Recorder(self.gm, self.device, self.eager)
        return self.recorder.run(*inputs)


def value_dtypes(traced, precision: str, device_type: str) -> dict[str, object]:
    """Graph node name -> dtype of its output (a pytree of dtypes for container values) under `precision`, from one
    run on fake tensors."""
    mode = get_precision(precision)
    device = torch.device(device_type)
    runner = _Runner(traced.graph_module, device, traced.layer_graph.eager_modules)
    sample, _ = traced.spec.sample_batch(traced.batch_size, generator=torch.Generator().manual_seed(0))

    def fake(t: torch.Tensor) -> torch.Tensor:
        low = t.is_floating_point() and mode.param_dtype != torch.float32  # bf16 parameters and inputs
        dtype = mode.param_dtype if low else t.dtype
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=device)

    try:
        with FakeTensorMode():
            state = {f"gm.{name}": fake(t) for name, t in _tensors(traced.graph_module)}
            for name, _ in traced.graph_module.named_parameters():
                state[f"gm.{name}"].requires_grad_(state[f"gm.{name}"].is_floating_point())  # as in a run
            inputs = tuple(fake(t) for t in sample)
            with mode.autocast(device_type), torch.enable_grad():
                torch.func.functional_call(runner, state, inputs, tie_weights=True, strict=False)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TraceError(
            f"could not run {traced.spec.name!r} on fake tensors to find its dtypes under --precision {precision} "
            f"({type(exc).__name__}: {first}); use --precision fp32"
        ) from None
    assert runner.recorder is not None
    return runner.recorder.dtypes


def _tensors(module: nn.Module):
    yield from module.named_parameters()  # one name per tied tensor: functional_call(tie_weights=True) ties
    yield from module.named_buffers()


def value_dtype(dtypes: dict[str, object], name: str) -> torch.dtype | None:
    """The dtype of a stage value: a node's output, or element i of a container output (`name.i`)."""
    if name in dtypes:
        found = dtypes[name]
        return found if isinstance(found, torch.dtype) else None
    base, _, index = name.rpartition(".")
    if base in dtypes and index.isdigit():
        found = dtypes[base]
        if isinstance(found, list | tuple) and int(index) < len(found):
            item = found[int(index)]
            return item if isinstance(item, torch.dtype) else None
    return None


def cut_bytes_under(cut, dtypes: dict[str, object]) -> int:
    """Bytes of the values crossing one cut (TensorInfo list) in the dtypes they have under a precision mode."""
    total = 0
    for info in cut:
        dtype = value_dtype(dtypes, info.producer)
        if dtype is None:  # not a tensor (0 bytes), or a container: as traced
            total += info.bytes
            continue
        numel = 1
        for dim in info.shape:
            numel *= dim
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total
