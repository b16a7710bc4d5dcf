"""Analytic profiles: what each layer would cost on a GPU, computed on the meta device (no real memory).

The model is built and traced on the meta device; each layer runs as its own StageModule on meta tensors in the
training dtype, under three instruments (see `opcount` and `gpu_ops`):

- forward FLOPs, bytes and roofline time per aten op (`OpRecorder`), with dropout and attention swapped for their
  CUDA equivalents (`GpuSemantics`: 1-byte dropout masks; each scaled_dot_product_attention call as the kernel a
  GPU runs it with, FlashAttention-2 or memory-efficient attention, or the Megatron math path under `--attention
  math`; attention a model writes by hand runs as written) and, under bf16-/fp16-mixed, CUDA's autocast applied to
  fp32 parameters (`cuda_autocast`: matmuls in the low dtype, norms, softmax and the loss in fp32, the residual
  stream fp32, each forward's weight copies saved for backward);
- tensors saved for backward (`saved_tensors.SavedTensors`), storages de-duplicated, parameters and buffers
  excluded, split into what the input-gradient (I) pass frees and what the weight-gradient (W) pass still reads,
  by the rule the measured profiler and the runtime follow;
- the backward, run for real on meta tensors by the implementation the runtime runs (`split_backward`), twice:
  once for the layer's input gradients only (I: autograd then skips every weight-gradient kernel, e.g. the
  `mat1ᵀ @ grad` of a Linear), once for inputs and parameters together (B). I is the first pass's roofline
  time, B the second's, and W = B - I: the ops the full pass adds. For a Linear this gives I ≈ W ≈ F, the 2:1
  rule, without assuming it; layers without floating-point inputs (the
  embedding) have I = 0 and W = B. Kernels that compute input and weight gradients in one launch (convolution,
  layer/batch norm backward) are timed as two kernels when taking W, as a split backward runs them; so
  I + W >= B, the difference being what fusing saves.

The last layer also runs the model's `loss_fn`, as a pipeline's last stage does: its saved tensors (cross-entropy's
log-softmax), FLOPs and times are the last layer's (`loss_stage`; under a mixed precision in fp32, as autocast
runs losses). The other precisions run the model in their compute dtype (bf16 parameters and activations). Times
are the layer's work timed by the kernel model (`retime.retime_layer`): each matmul and attention call by its
shape (`kernels`), every other kernel as its HBM bytes over the memory rate plus a launch under the fusions of the
stack the precision stands for (`stack_traffic`: Megatron/TE for Megatron's precisions, eager otherwise), with no
overlap between kernels; on a CPU (no SM count) each other op keeps its roofline `max(flops / rate, bytes /
rate)` (`opcount.Roofline.seconds`). The rates are peak × efficiency at the training clock, or what `pipeplan
calibrate` measured.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from pipeplan.errors import ConfigError
from pipeplan.graph.loss_stage import last_layer_stage, model_loss
from pipeplan.graph.run_dtypes import export_dtype
from pipeplan.hardware import Hardware, load_hardware
from pipeplan.models.spec import ModelSpec
from pipeplan.precision import get_precision
from pipeplan.profiling.cuda_autocast import gpu_forward
from pipeplan.profiling.experts import check_experts_counted
from pipeplan.profiling.fusions import fuse_regions
from pipeplan.profiling.gpu_ops import GpuSemantics, attention_summary
from pipeplan.profiling.kernels import KernelRates
from pipeplan.profiling.layer_count import LayerCounts, count_layer, tensor_bytes
from pipeplan.profiling.opcount import Roofline
from pipeplan.profiling.profile import LayerProfile, LayerWork, Profile, Provenance
from pipeplan.profiling.profile_options import ATTENTION_MODES
from pipeplan.profiling.recompute import analytic_recompute
from pipeplan.profiling.repeats import layer_key
from pipeplan.profiling.retime import retime_layer

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DTYPE_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16-mixed", "float16": "fp16-mixed"}


def precision_of_dtype(dtype: str) -> str:
    """The precision a bare `dtype` stands for (the compute dtype of: fp32, bf16-mixed, fp16-mixed)."""
    canonical = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if canonical not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; choose one of: {', '.join(DTYPES)}")
    return DTYPE_PRECISIONS[canonical]


@dataclass(frozen=True, kw_only=True)
class AnalyticConfig:
    batch_size: int
    hardware: Hardware
    granularity: int | None = None
    dtype: str = "bfloat16"
    attention: str = "auto"  # ATTENTION_MODES: what each SDPA call runs as (profiling.gpu_ops)
    matmul_efficiency: float | None = None  # None: the hardware preset's
    memory_efficiency: float | None = None
    fp8_linears: bool = False  # linears' matmuls at the FP8 peak (precision fp8)
    stack: str = "eager"  # whose fusions time the other ops (profiling.stack_traffic): megatron for Megatron precisions
    grad_bytes: int = 0  # Megatron stack: weight gradients accumulate into a buffer of these bytes per element

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        canonical = DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower())
        if canonical not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported; choose one of: {', '.join(DTYPES)}")
        object.__setattr__(self, "dtype", canonical)
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(f"--attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        for name in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} must lie in (0, 1], got {value}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def roofline(self) -> Roofline:
        hardware = self.hardware
        matmul = hardware.matmul_flops_per_s(self.torch_dtype, self.matmul_efficiency)
        return Roofline(
            flops_per_s=matmul,
            bytes_per_s=hardware.memory_bytes_per_s(self.memory_efficiency),
            launch_s=hardware.kernel_launch_s,
            attention_flops_per_s=hardware.attention_flops_per_s(self.torch_dtype, flash2=self.attention == "flash2"),
            sm_count=hardware.sm_count,
            fp8_flops_per_s=hardware.fp8_matmul_flops_per_s(self.matmul_efficiency) if self.fp8_linears else None,
            gemm_overhead_s=hardware.gemm_overhead_s,
            epilogue_exposed=hardware.epilogue_exposed,
            grad_bytes=self.grad_bytes,
            tile_reuse_half=hardware.tile_reuse_half,
            stream_k=hardware.stream_k,
        )


def layer_profile(
    name: str, module_path: str, counts: LayerCounts, work: LayerWork, rates: KernelRates, **recompute_bytes
) -> LayerProfile:
    """The layer's profile: its times are its work timed at the profiled shape (`retime_layer`);
    `recompute_bytes`: what selective and full recomputation keep."""
    layer = LayerProfile(
        name=name,
        module_path=module_path,
        forward_ms=0.0,
        input_grad_ms=0.0,
        weight_grad_ms=0.0,
        backward_ms=0.0,
        activation_bytes=counts.saved_bytes,
        activation_freed_by_input_grad_bytes=counts.saved_bytes - counts.kept_until_weight_grad_bytes,
        param_count=counts.param_count,
        param_bytes=counts.param_bytes,
        output_bytes=counts.output_bytes,
        flops=counts.forward_flops,
        work=work,
        expert_param_count=counts.expert_param_count,
        replicated_param_count=counts.replicated_param_count,
        **recompute_bytes,
    )
    return retime_layer(layer, rates)


def _model_batch(spec: ModelSpec, batch_size: int, dtype: torch.dtype) -> tuple[tuple, object]:
    """The spec's sample batch moved to the meta device, floating-point tensors cast to `dtype`."""
    inputs, target = spec.sample_batch(batch_size, generator=torch.Generator().manual_seed(0))

    def to_meta(value):
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to("meta")
        return value.to(dtype) if value.is_floating_point() else value

    return tuple(to_meta(v) for v in inputs), to_meta(target)


def profile_analytic(
    spec: ModelSpec,
    *,
    batch_size: int,
    hardware: str | Hardware,
    precision: str,
    granularity: int | None = None,
    attention: str = "auto",
    matmul_efficiency: float | None = None,
    memory_efficiency: float | None = None,
    progress: bool = False,
    model_ref: str | None = None,
    model_options: dict | None = None,
    tracer: str = "auto",
) -> Profile:
    """Profile `spec` for `hardware` without running it: per-layer F/I/W/B times, FLOPs, saved activations.

    `precision` (pipeplan.precision, the caller's choice) sets the compute dtype; the mixed modes run fp32
    parameters under CUDA's autocast (`cuda_autocast`), so parameters, gradients (all-reduce bytes), saved tensors
    and the values crossing cuts have the dtypes a CUDA run gives them.

    `attention` (ATTENTION_MODES): each scaled_dot_product_attention call as a GPU runs it (auto; flash: the same,
    refusing attention written by hand; flash2: as flash, at the hardware's FlashAttention-2 rate) or the math path
    (math); the provenance records what ran.

    `hardware` is a preset name or a Hardware (e.g. from `load_hardware(name, hardware_file=...)`); `model_ref` and
    `model_options` are recorded in the provenance (default: the spec's name and options).
    """
    mode = get_precision(precision)
    efficiencies: dict[str, Any] = dict(matmul_efficiency=matmul_efficiency, memory_efficiency=memory_efficiency)
    config = AnalyticConfig(
        batch_size=batch_size,
        hardware=load_hardware(hardware),
        granularity=granularity,
        dtype=mode.compute_dtype_name,
        attention=attention,
        fp8_linears=mode.fp8_linears,
        **efficiencies,
        **_stack_fields(mode),
    )
    if mode.fp8_linears and not config.hardware.peak_fp8_flops:
        raise ConfigError(f"--precision fp8 needs FP8 tensor cores; hardware {config.hardware.name!r} has none")
    traced = _trace(spec, batch_size=batch_size, granularity=granularity, tracer=tracer, precision=precision)
    traced.graph_module.to(mode.param_dtype)  # fp32 under autocast (its master weights), else the compute dtype
    model_inputs, target = _model_batch(spec, batch_size, mode.param_dtype)
    env: dict[str, object] = dict(zip(traced.layer_graph.input_names, model_inputs))
    upcast = mode.autocast_dtype is not None  # autocast runs the loss in fp32 (profiling.loss_stage)
    make_loss = lambda stage: model_loss(traced, stage, spec.loss_fn, target, upcast=upcast)  # noqa: E731
    layers, attention_used = _profile_layers(
        traced, config, env, make_loss, autocast_dtype=mode.autocast_dtype, progress=progress
    )
    check_experts_counted(traced.module, traced.layer_graph.layers, layers)
    cuts = tuple(_cut_bytes(cut, env) for cut in traced.layer_graph.cuts)
    provenance = _provenance(spec, config, traced.layer_graph, model_ref, model_options, precision, attention_used)
    return Profile(layers=tuple(layers), cut_bytes=cuts, provenance=provenance, input_bytes=tensor_bytes(model_inputs))


def _trace(spec: ModelSpec, *, batch_size: int, granularity, tracer: str, precision: str):
    """The model traced on the meta device as a run of `precision` traces it: an export is specialized to its
    parameters' dtype (`graph.run_dtypes.export_dtype`: float32 under autocast, which `cuda_autocast` then applies
    to each layer's forward as a CUDA run does)."""
    from pipeplan.graph.trace import trace_model

    return trace_model(
        spec,
        batch_size=batch_size,
        granularity=granularity,
        device="meta",
        tracer=tracer,
        dtype=export_dtype(precision),
    )


def _stack_fields(mode) -> dict:
    """The stack a precision stands for: Megatron-Core/TE for Megatron's precisions (their fusions, weight
    gradients accumulated into the gradient buffer: gradient_accumulation_fusion), PyTorch eager otherwise."""
    if mode.main_weights:
        return dict(stack="megatron", grad_bytes=mode.grad_bytes)
    return dict(stack="eager", grad_bytes=0)


def _profile_layers(
    traced, config: AnalyticConfig, env: dict[str, object], make_loss, *, autocast_dtype, progress: bool
):
    """Count every layer in order, feeding each the values `env` holds; adds each layer's outputs to `env`. The
    last layer runs with its loss, `make_loss(stage)` (profiling.loss_stage); `autocast_dtype`: CUDA's autocast
    around each forward (None: none)."""
    from pipeplan.console import progress as progress_bar
    from pipeplan.graph.stage import build_stage_module

    graph = traced.layer_graph
    layers: list[LayerProfile] = []
    kernels: Counter[str] = Counter()
    counted: dict[tuple, tuple] = {}  # a repeated layer's counts (profiling.repeats)
    probed: dict[tuple, float | None] = {}  # each norm region's probe (profiling.fusions)
    by_hand: list[str] = []  # layers whose attention is written by hand (an s x s core that no SDPA call made)
    with progress_bar(quiet=not progress) as bar:
        task = bar.add_task(f"analytic profile ({config.hardware.name})", total=graph.num_layers)
        for index, layer in enumerate(graph.layers):
            last = index == graph.num_layers - 1
            stage = last_layer_stage(traced, layer.nodes) if last else build_stage_module(traced, layer.nodes)
            fuse_regions(stage, probed)  # hand-written RMSNorm and GELU as the kernels (profiling.fusions)
            loss = make_loss(stage) if last else None
            needs = [name not in graph.input_names for name in stage.inputs]
            inputs = [env[name] for name in stage.inputs]
            key = None if last else layer_key(stage, layer.module_path, inputs, needs)
            if key is not None and key in counted:
                counts, recompute = counted[key]
            else:
                counts, recompute = _count(layer.name, stage, inputs, needs, loss, config, autocast_dtype, last)
                if key is not None:
                    counted[key] = (counts, recompute)
            env.update(zip(stage.outputs, counts.outputs))
            kernels.update(counts.attention_kernels)
            if recompute.attention_bytes and not counts.attention_kernels.get("math"):
                by_hand.append(layer.name)
            work = counts.work(
                recompute.selective_rest_seconds,
                stack=config.stack,
                selective=recompute.selective_traffic(config.stack),
            )
            if last:  # the LM head: not an FP8 linear (Kernel.fp8)
                work = replace(work, kernels=tuple(replace(k, fp8=False) for k in work.kernels))
            kept = recompute.byte_fields(counts.saved_bytes)
            layers.append(
                layer_profile(layer.name, layer.module_path, counts, work, config.roofline.kernel_rates, **kept)
            )
            bar.advance(task)
    if by_hand and config.attention in ("flash", "flash2"):
        raise ConfigError(
            f"--attention {config.attention}: layer {by_hand[0]!r} computes attention by hand (softmax(QKᵀ)V), which "
            "runs as written (the math path); call F.scaled_dot_product_attention in the model, or drop --attention"
        )
    return layers, attention_summary(kernels, bool(by_hand))


def _count(name: str, stage, inputs: list, needs: list[bool], loss, config: AnalyticConfig, autocast_dtype, head: bool):
    """(LayerCounts, AnalyticRecompute) of one layer run on the meta device (under CUDA's autocast to
    `autocast_dtype`, None: none); the `head` (the last layer) keeps its linears out of an FP8 recipe."""
    try:
        counts = count_layer(
            stage,
            inputs,
            roofline=config.roofline,
            attention=config.attention,
            input_needs_grad=needs,
            loss=loss,
            autocast_dtype=autocast_dtype,
            fp8_linears=config.fp8_linears and not head,
        )
        recompute = analytic_recompute(
            stage,
            inputs,
            roofline=config.roofline,
            input_needs_grad=needs,
            context=lambda: gpu_forward(GpuSemantics(attention=config.attention), autocast_dtype),
        )
    except Exception as exc:  # e.g. data-dependent code (.item(), nonzero) cannot run on meta tensors
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise ConfigError(
            f"analytic profiling runs layer {name!r} on the meta device and it failed ({reason}); "
            "profile with --device cpu or cuda instead"
        ) from None
    return counts, recompute


def _cut_bytes(cut, env: dict[str, object]) -> int:
    """Bytes live across a cut in the profiled dtype (the trace's TensorInfo sizes are in the build dtype)."""
    total = 0
    for info in cut:
        value = env.get(info.producer)
        total += tensor_bytes([value]) if isinstance(value, torch.Tensor) else info.bytes
    return total


_STACK_NOTES = {
    "eager": "one kernel per op (PyTorch eager)",
    "megatron": "Megatron-Core/Transformer Engine fusions (one kernel between matmuls)",
}


def _notes(config: AnalyticConfig, attention: str) -> str:
    roofline = config.roofline
    peak = "tf32" if config.torch_dtype == torch.float32 else "bf16/fp16"
    calibrated = config.matmul_efficiency is None and config.hardware.measured_flops(config.torch_dtype) is not None
    basis = f"calibrated {peak}" if calibrated else f"{peak} tensor-core peak x efficiency"
    per = "per memory-bound kernel" if roofline.sm_count else "kernel launch floor"
    launch = f", {roofline.launch_s * 1e6:.1f} us {per}" if roofline.launch_s else ""
    return (
        f"roofline: {roofline.flops_per_s / 1e12:.1f} TFLOP/s matmul ({basis}){launch}, "
        f"{roofline.bytes_per_s / 1e9:.0f} GB/s memory; attention: {attention} (--attention {config.attention}); "
        f"other ops: {_STACK_NOTES[config.stack]}; last layer includes loss_fn"
    )


def _provenance(
    spec: ModelSpec, config: AnalyticConfig, graph, model_ref, model_options, precision: str, attention: str
) -> Provenance:
    roofline = config.roofline
    return Provenance(
        source="analytic",
        device="meta",
        hardware=config.hardware.name,
        dtype=config.dtype,
        batch_size=config.batch_size,
        torch_version=torch.__version__,
        model=model_ref or spec.name,
        model_options=dict(spec.options if model_options is None else model_options),
        spec_options=dict(spec.options),
        graph_fingerprint=graph.fingerprint,
        tracer=graph.tracer,
        eager_modules=graph.eager_modules,
        precision=precision,
        attention=attention,
        notes=_notes(config, attention),
        tokens_per_sample=spec.tokens_per_sample,
        loss_in_last_layer=True,
        kernel_rates=roofline.kernel_rates,
    )
