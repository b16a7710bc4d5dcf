"""Measured profiler: run each layer of a traced model as its own stage module and time forward (F), input-gradient
(I), weight-gradient (W) and fused backward (B), on CPU or CUDA: in interleaved rounds (every layer and the
whole-model references once per round, `warmup` untimed rounds then `repeats` timed ones), medians with their
spreads, outliers timed again, parts out of bounds re-measured (`profiling.rounds`, checks:
`profiling.consistency`); a profile still out of bounds is kept with a one-line warning naming the layer.

Memory per layer: the bytes autograd saves for backward (storages de-duplicated, parameters and buffers excluded),
split into what I frees and what must live until W, by the one rule the runtime follows (saved_tensors). F, I, W
and B run the backward implementation the runtime runs (split_backward). The last layer runs the model's loss
after it, as a pipeline's last stage does (loss_stage): what the loss saves (cross-entropy's log-softmax), its
FLOPs and its time are the last layer's. Whole-model forward (with the loss) and backward times are measured too,
and the whole model's split backward (the first layer, then the rest as one stage), to check that the per-layer
sums agree, pass by pass. Layers run on the activations of the sample batch, so mixture-of-experts
layers are timed with the routing their own routers choose for it, which the profile records (routing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.console import progress as progress_bar
from pipeplan.console import warn
from pipeplan.errors import ConfigError
from pipeplan.graph.host_memory import check_fits_host
from pipeplan.graph.loss_stage import LossStage, last_layer_stage, model_loss
from pipeplan.graph.run_dtypes import cut_bytes_under, value_dtypes
from pipeplan.graph.saved_tensors import SavedTensors, saved_split
from pipeplan.graph.split_backward import analyze
from pipeplan.graph.stage import StageModule, build_stage_module
from pipeplan.graph.trace import TracedModel, trace_model
from pipeplan.models.spec import ModelSpec
from pipeplan.precision import check_device_precision, get_precision
from pipeplan.profiling import rounds
from pipeplan.profiling.consistency import out_of_bounds_message
from pipeplan.profiling.measured_times import SPLIT_UNIT, WHOLE_UNIT, TimedProfile
from pipeplan.profiling.profile import LayerProfile, Profile, Provenance
from pipeplan.profiling.profile_options import unknown_device
from pipeplan.profiling.recompute import RecomputeCosts, input_bytes, measured_attention_core
from pipeplan.profiling.routing import measure_routing
from pipeplan.profiling.timed_units import LayerUnit, WholeUnit


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    batch_size: int
    device: str = "cpu"
    granularity: int | None = None
    warmup: int = 2
    repeats: int = 5
    timer: str = "wall"  # wall | cpu (process CPU time: immune to other jobs on a shared CPU; use with 1 thread)
    precision: str = "fp32"  # pipeplan.precision: forwards run under its autocast / with its parameter dtype

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {self.repeats}")
        if self.device == "meta":
            raise ConfigError("measured profiling needs a real device; use --device meta with --hardware (analytic)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise unknown_device(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but CUDA is not available here; use --device cpu")
        if self.timer not in TIMERS:
            raise ConfigError(f"--timer must be one of {', '.join(TIMERS)}, got {self.timer!r}")
        if self.timer == "cpu" and self.device != "cpu":
            raise ConfigError("--timer cpu measures CPU time and only works with --device cpu; use --timer wall")
        check_device_precision(self.precision, "cpu" if self.device == "cpu" else "cuda")

    @property
    def device_type(self) -> str:
        return "cpu" if self.device == "cpu" else "cuda"

    def autocast(self):
        """The precision's autocast around every forward (backward follows the forward's dtypes, as in a run)."""
        return get_precision(self.precision).autocast(self.device_type)


TIMERS = ("wall", "cpu")


def _tensor_bytes(values: Sequence[object]) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _forward_memory(stage: StageModule, inputs: list, params: list, autocast) -> tuple[int, int, int]:
    """(saved bytes, of which I frees, CUDA peak allocation growth or 0 on CPU) for one forward of `stage`."""
    cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in inputs) or any(p.is_cuda for p in params)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with SavedTensors() as saved, autocast():
        outs = stage(*inputs)
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = max(0, torch.cuda.max_memory_allocated() - base)
    info = analyze([o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad], inputs, params)
    split = saved_split(saved, info.weight_grad_nodes, exclude=[*stage.parameters(), *stage.buffers()])
    return split.total_bytes, split.total_bytes - split.kept_until_weight_grad_bytes, peak


def _leaves(values: Sequence[object]) -> list:
    return [v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v for v in values]


def _layer_flops(stage: StageModule, inputs: list, config: MeasureConfig) -> float:
    plain = [v.detach() if isinstance(v, torch.Tensor) else v for v in inputs]  # no autograd hooks to place
    with torch.no_grad(), config.autocast(), FlopCounterMode(display=False) as counter:
        stage(*plain)
    return float(counter.get_total_flops())


def _layer_stages(traced: TracedModel, target: torch.Tensor) -> list[StageModule | LossStage]:
    """One stage per layer; the last one runs the model's loss after it, as a pipeline's last stage does."""
    layers = traced.layer_graph.layers
    stages: list[StageModule | LossStage] = [build_stage_module(traced, layer.nodes) for layer in layers[:-1]]
    last = last_layer_stage(traced, layers[-1].nodes)
    return [*stages, LossStage(last, model_loss(traced, last, traced.spec.loss_fn, target))]


def _layer_values(
    traced: TracedModel, stages: list[StageModule | LossStage], inputs: tuple, config: MeasureConfig
) -> dict[str, object]:
    """Every layer's outputs, by name (the last layer's before its loss)."""
    env: dict[str, object] = dict(zip(traced.layer_graph.input_names, inputs))
    with torch.no_grad(), config.autocast():
        for stage in stages:
            module = stage.stage if isinstance(stage, LossStage) else stage
            env.update(zip(module.outputs, module(*[env[name] for name in module.inputs])))
    return env


def profile_traced(
    traced: TracedModel,
    config: MeasureConfig,
    *,
    model_ref: str | None = None,
    model_options=None,
    progress=True,
    clock: rounds.Clock | None = None,
) -> Profile:
    """Measure every layer of an already traced (real-device) model; `clock` (default: `make_clock(config)`)
    times the passes."""
    spec = traced.spec
    sample, target = spec.sample_batch(config.batch_size, generator=torch.Generator().manual_seed(0))
    param_dtype = get_precision(config.precision).param_dtype
    low = (
        param_dtype if param_dtype != torch.float32 else None
    )  # bf16: floating inputs in bf16 too; else as the model gives them
    inputs = tuple(t.to(config.device, low if low and t.is_floating_point() else t.dtype) for t in sample)
    target = target.to(config.device)  # as the runtime moves it: in its own dtype
    stages = _layer_stages(traced, target)
    env = _layer_values(traced, stages, inputs, config)
    seen_params: set[int] = set()
    prepared = [
        _prepare_layer(layer, stage, env, config, seen_params)
        for layer, stage in zip(traced.layer_graph.layers, stages)
    ]
    whole = WholeUnit(WHOLE_UNIT, traced.module, spec.loss_fn, inputs, target, config.autocast)
    split = _split_unit(traced, env, target, config)
    units: list[rounds.Unit] = [whole, *([split] if split else []), *(unit for _, unit in prepared)]
    clock = clock or make_clock(config)
    base = Profile(
        layers=tuple(LayerProfile(**fields) for fields, _ in prepared),
        cut_bytes=_cut_bytes(traced, config),
        provenance=_provenance(traced, config, model_ref, model_options, inputs),
        input_bytes=_tensor_bytes(inputs),
    )
    timed = TimedProfile(base=base, warmup=config.warmup, repeats=config.repeats, clock=clock.name)
    with progress_bar(quiet=not progress) as bar:
        total = len(units) * (config.warmup + config.repeats)
        task = bar.add_task(f"profiling {spec.name}", total=total)
        done = [0]

        def advance() -> None:
            done[0] += 1
            bar.update(task, completed=done[0], total=max(total, done[0]))

        pools = rounds.measure(
            units, clock, warmup=config.warmup, repeats=config.repeats, assess=timed.suspects, on_sample=advance
        )
    profile = timed.profile(pools)
    message = out_of_bounds_message(profile)
    if message:
        warn(message)
    return profile


def make_clock(config: MeasureConfig) -> rounds.Clock:
    """CUDA events on a GPU; else wall-clock or (--timer cpu) process CPU time."""
    if config.device.startswith("cuda"):
        return rounds.EventClock(torch.cuda.Event, torch.cuda.synchronize)
    return rounds.HostClock(cpu=config.timer == "cpu")


def _prepare_layer(layer, stage, env: dict, config: MeasureConfig, seen_params: set[int]) -> tuple[dict, LayerUnit]:
    """A layer's untimed fields (memory, parameters, FLOPs, recompute bytes; its times 0 until measured) and the
    unit that times it."""
    leaves = _leaves([env[name] for name in stage.inputs])
    params = [p for p in stage.parameters() if p.requires_grad]
    own = [p for p in stage.parameters() if id(p) not in seen_params]
    seen_params.update(id(p) for p in own)
    total, freed, peak = _forward_memory(stage, leaves, params, config.autocast)
    core = measured_attention_core(stage, leaves, autocast=config.autocast)
    recompute = RecomputeCosts(
        attention_bytes=core.saved_bytes,
        input_bytes=input_bytes(leaves),
        full_recompute_ms=0.0,
        selective_recompute_ms=0.0,
    )
    fields = dict(
        name=layer.name,
        module_path=layer.module_path,
        forward_ms=0.0,
        input_grad_ms=0.0,
        weight_grad_ms=0.0,
        backward_ms=0.0,
        activation_bytes=total,
        activation_freed_by_input_grad_bytes=freed,
        param_count=sum(p.numel() for p in own),
        param_bytes=sum(p.numel() * p.element_size() for p in own),
        output_bytes=_tensor_bytes([env[name] for name in stage.outputs]),
        flops=_layer_flops(stage, leaves, config),
        peak_memory_bytes=peak,
        **recompute.layer_fields(total),
    )
    return fields, LayerUnit(layer.name, stage, leaves, params, config.autocast, core_calls=core.calls)


def _split_unit(traced: TracedModel, env: dict, target: torch.Tensor, config: MeasureConfig) -> LayerUnit | None:
    """Every layer but the first as one stage with the loss, timed F, I, W: with the first layer's own I + W, the
    whole model's split backward (None for a one-layer model: the layer is the whole)."""
    layers = traced.layer_graph.layers
    if len(layers) < 2:
        return None
    last = last_layer_stage(traced, [name for layer in layers[1:] for name in layer.nodes])
    rest = LossStage(last, model_loss(traced, last, traced.spec.loss_fn, target))
    leaves = _leaves([env[name] for name in rest.inputs])
    params = [p for p in rest.parameters() if p.requires_grad]
    return LayerUnit(SPLIT_UNIT, rest, leaves, params, config.autocast, fused=False)


def _cut_bytes(traced: TracedModel, config: MeasureConfig) -> tuple[int, ...]:
    """Bytes crossing each cut in the dtypes the values have under the precision (what the runtime sends)."""
    graph = traced.layer_graph
    if config.precision == "fp32":
        return tuple(graph.cut_bytes(i) for i in range(len(graph.cuts)))
    dtypes = value_dtypes(traced, config.precision, config.device_type)
    return tuple(cut_bytes_under(cut, dtypes) for cut in graph.cuts)


def _given_options(spec: ModelSpec, given: dict | None) -> dict:
    """The options the user passed (what load_model needs to rebuild it), typed as the factory converted them."""
    if given is None:
        return dict(spec.options)
    return {key: spec.options.get(key, value) for key, value in given.items()}


def _provenance(traced: TracedModel, config: MeasureConfig, model_ref, model_options, inputs) -> Provenance:
    spec = traced.spec
    device = config.device
    if device.startswith("cuda"):
        device = f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    return Provenance(
        source="measured",
        device=device,
        dtype=get_precision(config.precision).compute_dtype_name,
        precision=config.precision,
        batch_size=config.batch_size,
        torch_version=torch.__version__,
        model=model_ref or spec.name,
        model_options=_given_options(spec, model_options),
        spec_options=dict(spec.options),
        graph_fingerprint=traced.layer_graph.fingerprint,
        tracer=traced.tracer,
        tokens_per_sample=spec.tokens_per_sample,
        notes=f"warmup={config.warmup} repeats={config.repeats} timer={config.timer} threads={torch.get_num_threads()}",
        loss_in_last_layer=True,
        eager_modules=traced.layer_graph.eager_modules,
        expert_routing=measure_routing(traced.module, inputs, config.autocast),
        threads=torch.get_num_threads() if device == "cpu" else None,
    )


def profile_model(
    spec: ModelSpec,
    *,
    batch_size: int,
    precision: str,
    device: str = "cpu",
    granularity: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
    model_ref: str | None = None,
    model_options: dict | None = None,
    timer: str = "wall",
    tracer: str = "auto",
) -> Profile:
    """Trace `spec` on `device` and measure every layer for one microbatch of `batch_size` samples."""
    config = MeasureConfig(
        batch_size=batch_size,
        device=device,
        granularity=granularity,
        warmup=warmup,
        repeats=repeats,
        timer=timer,
        precision=precision,
    )
    check_fits_host(spec, batch_size=batch_size, device=device)
    torch.manual_seed(0)
    traced = trace_model(spec, batch_size=batch_size, granularity=granularity, device=device, tracer=tracer)
    traced.module.train()
    if get_precision(precision).param_dtype != torch.float32:
        traced.module.to(get_precision(precision).param_dtype)  # bf16: low-precision parameters (in place)
    return profile_traced(traced, config, model_ref=model_ref, model_options=model_options, progress=progress)
