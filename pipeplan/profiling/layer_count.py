"""One layer run forward and backward on the meta device under the op recorder (`count_layer`): the passes' op
totals, the forward's kernels, what it saves for backward (split by what I frees), its parameters — what the
analytic profiler builds each `LayerProfile` from (see `profiling.analytic`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeplan.graph.saved_tensors import SavedSplit, SavedTensors, saved_split, storage_key
from pipeplan.graph.split_backward import analyze, backward_full, backward_input
from pipeplan.profiling.cuda_autocast import gpu_forward
from pipeplan.profiling.fp8_saved import Fp8Linears, fp8_saved_split
from pipeplan.profiling.gpu_ops import GpuSemantics
from pipeplan.profiling.kernels import Kernel
from pipeplan.profiling.opcount import OpRecorder, OpTotals, Roofline
from pipeplan.profiling.profile import LayerWork, PassTraffic
from pipeplan.profiling.stack_traffic import Traffic, traffic


@dataclass(frozen=True, kw_only=True)
class LayerCounts:
    """Everything measured for one layer on the meta device: the passes' op totals (times in seconds, kernels
    apart), the forward's kernels, bytes and parameters."""

    forward: OpTotals
    input_grad: OpTotals
    backward: OpTotals
    saved_bytes: int
    kept_until_weight_grad_bytes: int
    output_bytes: int
    param_count: int
    param_bytes: int
    expert_param_count: int = 0  # of param_count: stacked expert weights (`KernelTracer.expert_params`)
    attention_kernels: dict[str, int] = field(default_factory=dict)  # SDPA calls by the kernel they ran as
    replicated_param_count: int = 0  # of param_count: duplicated linears' weights (`KernelTracer`)
    outputs: tuple = field(default=(), repr=False)
    forward_keep: frozenset[int] = frozenset()  # storages the forward must write: saved for backward, outputs
    input_grad_keep: frozenset[int] = frozenset()  # storages I produces (input gradients)
    backward_keep: frozenset[int] = frozenset()  # storages B produces (input and parameter gradients)

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return tuple(self.forward.kernels)

    @property
    def forward_flops(self) -> float:
        """The forward's FLOPs with its kernels' as they run (a causal attention's half; torch counts it whole)."""
        return self.forward.flops - self.forward.kernel_flops + sum(k.flops for k in self.kernels)

    def work(
        self, selective_rest_seconds: float = 0.0, *, stack: str = "eager", selective: Traffic | None = None
    ) -> LayerWork:
        """The layer's kernels and the rest of each pass (ms, and traffic under `stack`:
        `profiling.stack_traffic`): what `retime_layer` takes times from. W's rest is the fused pass (fused
        conv/norm gradient kernels timed as split) less I's; the whole backward's when the layer has no input
        gradient to compute; W's traffic is B's less I's. `selective`: the attention core's traffic (selective
        recomputation)."""
        weight_rest = self.backward.rest_seconds
        forward = traffic(self.forward.calls, stack, self.forward_keep)
        backward = traffic(self.backward.calls, stack, self.backward_keep)
        input_grad = (
            traffic(self.input_grad.calls, stack, self.input_grad_keep) if self.input_grad.num_ops else Traffic()
        )
        if self.input_grad.num_ops:
            weight_rest = max(self.backward.rest_split_seconds - self.input_grad.rest_seconds, 0.0)
        weight_grad = Traffic(
            bytes=max(backward.bytes - input_grad.bytes, 0.0),
            kernels=max(backward.kernels - input_grad.kernels, 0),
            compute_seconds=max(backward.compute_seconds - input_grad.compute_seconds, 0.0),
        )
        return LayerWork(
            kernels=self.kernels,
            rest_forward_ms=self.forward.rest_seconds * 1e3,
            rest_input_grad_ms=self.input_grad.rest_seconds * 1e3,
            rest_weight_grad_ms=weight_rest * 1e3,
            rest_backward_ms=self.backward.rest_seconds * 1e3,
            rest_selective_ms=selective_rest_seconds * 1e3,
            forward_traffic=_pass_traffic(forward),
            input_grad_traffic=_pass_traffic(input_grad),
            weight_grad_traffic=_pass_traffic(weight_grad),
            backward_traffic=_pass_traffic(backward),
            selective_traffic=_pass_traffic(selective or Traffic()),
        )


def _pass_traffic(found: Traffic) -> PassTraffic:
    return PassTraffic(bytes=found.bytes, kernels=found.kernels, compute_ms=found.compute_seconds * 1e3)


def tensor_bytes(values: Sequence) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _leaf_input(value, needs_grad: bool):
    if not isinstance(value, torch.Tensor):
        return value
    leaf = value.detach()
    return leaf.requires_grad_(needs_grad and leaf.is_floating_point())


def _record(
    roofline: Roofline, run: Callable[[], object], params: Sequence[torch.Tensor]
) -> tuple[OpTotals, frozenset[int]]:
    """The ops one backward pass launches (parameter gradients cleared before and after), and the storages of
    what it produces (the gradients it returns and accumulates)."""
    for p in params:
        p.grad = None
    with OpRecorder(roofline) as recorder:
        result = run()
    produced = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    produced += [p.grad for p in params if p.grad is not None]
    keep = frozenset(storage_key(t) for t in produced)
    for p in params:
        p.grad = None
    return recorder.totals, keep


def _saved(saved: SavedTensors, weight_grad_nodes, exclude: list, *, fp8: Fp8Linears | None, roots) -> SavedSplit:
    """What the layer saves for backward, split by what I frees (`saved_split`), as an FP8 run keeps it when `fp8`
    recorded its linears (`fp8_saved`)."""
    split = saved_split(saved, weight_grad_nodes, exclude=exclude)
    if fp8 is None:
        return split
    held = saved.storage_bytes(exclude=exclude)
    return fp8_saved_split(split, held, linears=fp8, roots=roots, weight_grad_nodes=weight_grad_nodes)


def count_layer(
    module: nn.Module,
    inputs: Sequence,
    *,
    roofline: Roofline,
    attention: str = "auto",
    input_needs_grad: Sequence[bool] | None = None,
    loss: Callable[[tuple], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    fp8_linears: bool = False,
) -> LayerCounts:
    """Run `module(*inputs)` forward and backward on meta tensors and count it (see the module docstring).

    `loss(outputs)` makes the backward start from that scalar (the last pipeline stage); otherwise from every
    floating-point output, with gradients shaped like them. `autocast_dtype`: the forward (and loss) under CUDA's
    autocast to it (`cuda_autocast`; None: none). `fp8_linears`: an FP8 recipe's saved bytes (`fp8_saved`).
    """
    needs = list(input_needs_grad) if input_needs_grad is not None else [True] * len(inputs)
    leaves = [_leaf_input(value, need) for value, need in zip(inputs, needs)]
    params = _unique_parameters(module)
    saved = SavedTensors()
    tracing = OpRecorder(roofline, trace_kernels=True, params=params)
    semantics = GpuSemantics(attention=attention, fp8_linears=(fp8 := Fp8Linears() if fp8_linears else None))
    with gpu_forward(semantics, autocast_dtype), tracing as forward, saved:
        outputs = module(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        roots = [r for r in ([loss(outputs)] if loss is not None else outputs) if _requires_grad(r)]
    grads = [torch.empty_like(r) if r.dim() else torch.ones_like(r) for r in roots]
    grad_inputs = [leaf for leaf in leaves if _requires_grad(leaf)]
    weights = [p for p in params if p.requires_grad]
    info = analyze(roots, grad_inputs, weights)
    split = _saved(saved, info.weight_grad_nodes, [*params, *module.buffers()], fp8=fp8, roots=roots)
    forward_keep = frozenset(saved.storage_bytes(exclude=[*params, *module.buffers()])) | {
        storage_key(o) for o in outputs if isinstance(o, torch.Tensor)
    }
    # the passes the runtime runs (split_backward): B with the graph kept, then I (W is B's ops less I's)
    backward, backward_keep = _record(
        roofline, lambda: backward_full(roots, grads, grad_inputs, weights, retain_graph=True), weights
    )
    input_grad, input_grad_keep = _record(roofline, lambda: backward_input(roots, grads, grad_inputs, weights), weights)
    param_count = sum(p.numel() for p in params)
    tracer = tracing.tracer
    assert tracer is not None, "an OpRecorder with trace_kernels has a KernelTracer"
    return LayerCounts(
        forward=forward.totals,
        input_grad=input_grad,
        backward=backward,
        saved_bytes=split.total_bytes,
        kept_until_weight_grad_bytes=split.kept_until_weight_grad_bytes,
        output_bytes=tensor_bytes(outputs),
        param_count=param_count,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        expert_param_count=sum(p.numel() for p in tracer.expert_params.values()),
        attention_kernels=dict(semantics.kernels_used),
        replicated_param_count=tracer.duplicated_params,
        outputs=tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs),
        forward_keep=forward_keep,
        input_grad_keep=input_grad_keep,
        backward_keep=backward_keep,
    )


def _requires_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad
