"""Profile: per-layer costs the partitioner and simulator consume. Versioned JSON, read with one clear error.

Times are milliseconds for one microbatch of `batch_size` samples; bytes are per microbatch (activations) or
totals (parameters). `cut_bytes[i]` is everything live across the cut between layer i and layer i+1 (skip
connections included), so `len(cut_bytes) == len(layers) - 1`.

Activation recomputation (schema 2): each layer records what it keeps for backward between its forward and its
backward under each mode of RECOMPUTE_MODES, and what recomputing costs (see `profiling.recompute` for how the
measured and analytic profilers fill them):
- none: `activation_bytes`, nothing recomputed;
- selective: `selective_activation_bytes` = activation_bytes less the attention internals (the s×s scores,
  probabilities and dropout masks, Korthikanti et al.'s 5·a·s²·b); `selective_recompute_ms` re-runs that attention
  core (0 and equal bytes for layers without one, or with a fused attention kernel that saves none);
- full: `full_activation_bytes` = the layer's inputs only; `full_recompute_ms` = the layer's forward again.
Around a split backward, recomputation happens when the layer's backward starts (I, or B), so what must live from I
to W is `activation_kept_until_weight_grad_bytes` in every mode; only the bytes held from F to I/B change.
Layers without recorded data (PipeDream imports, schema-1 files) get: selective = none, full = the bytes crossing
the cut before the layer (`input_bytes` for the first), full recompute = forward_ms, selective recompute = 0.

The last layer is profiled with the model's `loss_fn` (profiling.loss_stage): its activation bytes (and time,
FLOPs) include what the loss saves for backward (cross-entropy: the b·s·V log-softmax, fp32 under a mixed
precision, and the target), kept under none and selective, recomputed under full. `provenance.loss_in_last_layer`
says so; profiles written before (the field absent) left it out of measured profiles and counted it in the compute
dtype in mixed-precision analytic ones, and loading one warns.

Mixture-of-experts models: `provenance.expert_routing` says, per MoE layer, how the measured profile's sample batch
was routed by the model's own routers (tokens per expert; `profiling.routing`), and `provenance.eager_modules`
which modules ran eagerly inside their layers (data-dependent code, `graph.fx_trace`). Both are absent (empty) in
older files and in profiles of dense models; no schema change.

How steady a measured profile's times were (schema 4, `profiling.rounds`): each layer's `spread` holds, per pass,
the spread of the samples its median was taken over (interquartile range / median); `whole_split_backward_ms` is
the split backward (I + W) of the whole model run as two stages (the first layer, then the rest), the reference the
layers' I + W sum is checked against (beside `whole_forward_ms` for F and `whole_backward_ms` for B); and
`measurement` how the samples were taken. `profiling.consistency` checks them. All three are absent (None) in
older files and in analytic and PipeDream profiles.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pipeplan.errors import FormatError
from pipeplan.graph.recompute_modes import RECOMPUTE_MODES
from pipeplan.jsonio import build_dataclass, fingerprint, read_json, write_json
from pipeplan.profiling.kernels import Kernel, KernelRates

PROFILE_SCHEMA_VERSION = 5
OLDER_PROFILE_VERSIONS = (1, 2, 3, 4)  # still read: 1 lacks the recompute fields (defaults above), 1 and 2 the
# work, 1-3 the spreads and the split-backward reference (None: not checked), 1-4 the work's traffic (its other ops
# keep their roofline ms)
SOURCES = ("measured", "analytic", "pipedream")


@dataclass(frozen=True, kw_only=True)
class PassTraffic:
    """A pass's other ops as a GPU runs them (`profiling.stack_traffic`, under the stack the profile's precision stands
    for): HBM bytes and kernel launches of the memory-bound ones, ms of those whose FLOPs bind (convolutions)."""

    bytes: float = 0.0
    kernels: int = 0
    compute_ms: float = 0.0

    def scaled(self, factor: float) -> PassTraffic:
        """The same ops on `factor` times the elements: bytes and FLOPs scale, the kernels launched do not."""
        return replace(self, bytes=self.bytes * factor, compute_ms=self.compute_ms * factor)


@dataclass(frozen=True, kw_only=True)
class LayerWork:
    """What an analytic profile's times are made of (schema 3, traffic: schema 5), so that they can be taken again
    at another shape (`profiling.retime.retime_layer`: a tensor- or context-parallel rank, another microbatch size):
    the forward's matmul and attention kernels (`profiling.kernels`, their backward follows from them) and, per
    pass, the other ops: their traffic (bytes, kernels; GPU profiles) and the roofline ms of each op (what a
    profile without an SM count, a CPU's, times them by; profiles before schema 5 have only these)."""

    kernels: tuple[Kernel, ...]
    rest_forward_ms: float
    rest_input_grad_ms: float
    rest_weight_grad_ms: float
    rest_backward_ms: float
    rest_selective_ms: float = 0.0  # the attention core's ops that are not kernels
    forward_traffic: PassTraffic | None = None  # None: a profile before schema 5 (its rest ms are used)
    input_grad_traffic: PassTraffic | None = None
    weight_grad_traffic: PassTraffic | None = None
    backward_traffic: PassTraffic | None = None
    selective_traffic: PassTraffic | None = None

    def traffic(self, name: str) -> PassTraffic | None:
        """One pass's traffic: forward, input_grad, weight_grad, backward or selective."""
        return getattr(self, f"{name}_traffic")

    def reshaped(self, *, t: int = 1, cp: int = 1, batch_scale: float = 1.0, ep: int = 1) -> LayerWork:
        """The work of one rank of t tensor- x cp context-parallel ranks, for a microbatch `batch_scale` times as
        large: kernels at the rank's shape (`Kernel.on_rank`); the rest (norms, dropouts, residual adds: split along
        the sequence under sequence and context parallelism) x batch_scale / (t x cp), its kernel launches as many;
        grouped expert matmuls under expert parallelism `ep` (`Kernel.on_rank`)."""
        rest = batch_scale / (t * cp)
        traffic = {
            f"{name}_traffic": (value.scaled(rest) if (value := self.traffic(name)) is not None else None)
            for name in TRAFFIC_PASSES
        }
        return LayerWork(
            kernels=tuple(k.on_rank(t=t, cp=cp, batch_scale=batch_scale, ep=ep) for k in self.kernels),
            rest_forward_ms=self.rest_forward_ms * rest,
            rest_input_grad_ms=self.rest_input_grad_ms * rest,
            rest_weight_grad_ms=self.rest_weight_grad_ms * rest,
            rest_backward_ms=self.rest_backward_ms * rest,
            rest_selective_ms=self.rest_selective_ms * rest,
            **traffic,
        )


TRAFFIC_PASSES = ("forward", "input_grad", "weight_grad", "backward", "selective")


@dataclass(frozen=True, kw_only=True)
class PassSpread:
    """How far a layer's (or the whole model's) timings of each pass scattered around the medians it records: the
    interquartile range over the median (0.1 = the middle half of the samples lies within 10% of the median),
    `samples` timings per pass (after outliers were re-measured, `profiling.rounds`). A pass not timed is 0."""

    samples: int
    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0
    backward: float = 0.0
    full_recompute: float = 0.0
    selective_recompute: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """How a measured profile's times were taken (`profiling.rounds`): `rounds` timed rounds over every layer and
    the whole-model references in turn after `warmup` untimed ones; `attempts` measurements in all (more than one:
    out-of-bounds parts were re-measured automatically, `remeasured` names them); `clock`: wall, cpu or
    cuda-events."""

    rounds: int
    warmup: int
    attempts: int = 1
    remeasured: tuple[str, ...] = ()
    outliers_replaced: int = 0  # samples dropped as outliers and timed again
    clock: str = "wall"
    whole_spread: PassSpread | None = None  # the whole-model references' (forward, backward, split backward: I+W)


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    name: str
    forward_ms: float
    input_grad_ms: float  # I: gradient w.r.t. the layer's inputs only
    weight_grad_ms: float  # W: gradient w.r.t. the layer's parameters only
    backward_ms: float  # B: fused backward (I and W together)
    activation_bytes: int  # saved for backward per microbatch (parameters excluded, storages de-duplicated)
    activation_freed_by_input_grad_bytes: int  # part of activation_bytes no longer needed once I is done
    param_count: int
    param_bytes: int
    output_bytes: int = 0  # bytes of this layer's outputs per microbatch
    flops: float = 0.0  # forward FLOPs per microbatch
    peak_memory_bytes: int = 0  # measured on CUDA: peak allocation growth during the forward (0 = not measured)
    module_path: str = ""
    selective_activation_bytes: int | None = None  # kept under selective recompute (None: = activation_bytes)
    full_activation_bytes: int | None = None  # kept under full recompute: the inputs (None: Profile fills it)
    full_recompute_ms: float | None = None  # full recompute: the forward again (None: = forward_ms)
    selective_recompute_ms: float = 0.0  # selective recompute: the attention core's forward again
    work: LayerWork | None = None  # analytic profiles: kernels and the rest, per pass (None: measured, older)
    expert_param_count: int = 0  # of param_count: routed experts' weights (expert parallelism splits them)
    spread: PassSpread | None = None  # measured (schema 4): how steady each pass's timings were
    replicated_param_count: int = 0  # of param_count: weights every tensor-parallel rank holds whole (duplicated
    # linears: MLA's down-projections, a router; analytic profiles)

    def __post_init__(self) -> None:
        if self.selective_activation_bytes is None:
            object.__setattr__(self, "selective_activation_bytes", self.activation_bytes)
        if self.full_recompute_ms is None:
            object.__setattr__(self, "full_recompute_ms", self.forward_ms)
        for f in ("forward_ms", "input_grad_ms", "weight_grad_ms", "backward_ms", "full_recompute_ms"):
            if getattr(self, f) < 0:
                raise FormatError(f"layer {self.name!r}: {f} must be >= 0")
        if self.selective_recompute_ms < 0 or (self.full_activation_bytes or 0) < 0:
            raise FormatError(f"layer {self.name!r}: recompute times and bytes must be >= 0")
        if not 0 <= self.activation_freed_by_input_grad_bytes <= max(self.activation_bytes, 0):
            raise FormatError(
                f"layer {self.name!r}: activation_freed_by_input_grad_bytes must lie in [0, activation_bytes]"
            )
        if not 0 <= self.kept_bytes("selective") <= max(self.activation_bytes, 0):
            raise FormatError(f"layer {self.name!r}: selective_activation_bytes must lie in [0, activation_bytes]")

    @property
    def activation_kept_until_weight_grad_bytes(self) -> int:
        return self.activation_bytes - self.activation_freed_by_input_grad_bytes

    def kept_bytes(self, recompute: str) -> int:
        """Bytes held from this layer's forward to its backward under `recompute` (one of RECOMPUTE_MODES)."""
        _check_mode(recompute)
        if recompute == "full":
            assert self.full_activation_bytes is not None, "full_activation_bytes is filled by Profile"
            return self.full_activation_bytes
        if recompute == "selective":
            assert self.selective_activation_bytes is not None, "__post_init__ fills selective_activation_bytes"
            return self.selective_activation_bytes
        return self.activation_bytes

    def recompute_ms(self, recompute: str) -> float:
        """Time the backward spends re-running forward work under `recompute` (0 for none)."""
        _check_mode(recompute)
        if recompute == "full":
            assert self.full_recompute_ms is not None, "__post_init__ fills full_recompute_ms"
            return self.full_recompute_ms
        return self.selective_recompute_ms if recompute == "selective" else 0.0


def _check_mode(recompute: str) -> None:
    assert recompute in RECOMPUTE_MODES, f"recompute mode must be one of {RECOMPUTE_MODES}, got {recompute!r}"


@dataclass(frozen=True, kw_only=True)
class ExpertRouting:
    """How one mixture-of-experts layer routed the profiled sample batch (measured profiles: the model's own router
    on the sample batch, `profiling.routing`); its layer's times were measured with this routing."""

    module: str  # the MoE layer's module path (graph.moe.moe_modules)
    experts: int
    top_k: int | None
    tokens: int  # tokens entering the layer
    tokens_per_expert: tuple[int, ...]  # (token, expert) assignments each expert received

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.tokens_per_expert) / len(self.tokens_per_expert) if self.tokens_per_expert else 0.0
        return max(self.tokens_per_expert) / mean if mean else 1.0


PROFILE_DTYPES = ("float32", "bfloat16", "float16")  # the compute dtypes a profile is measured or counted in


@dataclass(frozen=True, kw_only=True)
class Provenance:
    source: str  # measured | analytic | pipedream
    device: str = "cpu"  # cpu, cuda:NAME, meta
    hardware: str | None = None  # hardware preset for analytic profiles
    dtype: str = "float32"  # compute dtype (the precision's)
    precision: str = ""  # pipeplan.precision mode ("" in older profiles: see precision.profile_precision)
    batch_size: int = 1  # samples per profiled microbatch
    torch_version: str = ""
    model: str = ""  # model reference (name, file.py:factory, pkg.mod:factory)
    model_options: dict[str, Any] = field(default_factory=dict)  # what the user gave: load_model rebuilds from it
    spec_options: dict[str, Any] = field(default_factory=dict)  # every option built with (structural checks)
    graph_fingerprint: str = ""
    tracer: str = ""  # fx | export: how the graph was traced ("" in older profiles: fx)
    tokens_per_sample: int | None = None
    notes: str = ""
    attention: str = ""  # analytic: what attention ran as (flash, memory-efficient, math; gpu_ops.attention_summary)
    loss_in_last_layer: bool = False  # the last layer counts loss_fn (its saved tensors: False in older profiles)
    kernel_rates: KernelRates | None = None  # analytic: what its kernels were timed with (`retime_layer` reuses it)
    eager_modules: tuple[str, ...] = ()  # modules run eagerly inside their layer (graph.LayerGraph.eager_modules)
    expert_routing: tuple[ExpertRouting, ...] = ()  # per MoE layer, how the sample batch was routed (measured)
    threads: int | None = None  # measured on a CPU: torch's threads (None: analytic, CUDA, older files)
    refined_from: str = ""  # a profile refined from a run (`pipeplan refine`): the run's trace and plan
    # refined: the bytes/s an optimizer update ran at in that run, learned from its step tails (`refine.job`); what
    # predict.gradient_sync times updates with where kernel_rates (analytic) does not say (None: updates untimed)
    update_bytes_per_s: float | None = None
    # measured on a CPU with --concurrent N: N processes side by side (this one and N - 1 siblings running the model's
    # training step, profiling/siblings.py), as N ranks share the machine in a run (None: measured alone)
    concurrent: int | None = None
    wall_over_cpu: float | None = None  # --concurrent: the times are CPU times x this measured ratio (siblings.py)
    # refined: what each F / I / W / B op cost beyond its layers' work in that run (ms; the executor's bookkeeping,
    # sends, the trace's timing), learned by `refine` (bookkeeping.op_overhead_ms) and counted once per op by
    # costs.stage_op_ms, whatever layers a stage groups (None: not learned, 0)
    op_overhead_ms: float | None = None
    # refined from a synchronized run's step tails (`refine.updates`): the gradient exchange's measured speed over
    # the plan's (the calibrated link's) time for it, which predict.gradient_sync.stage_allreduce_ms divides every
    # exchange by; and the global checks' fixed cost per step (the gradient-norm row and the all-gather), which a
    # synchronized step end counts on every device (predict.StepInputs.step_checks_ms). None: not learned
    exchange_efficiency: float | None = None
    step_checks_ms: float | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise FormatError(f"provenance.source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.batch_size < 1:
            raise FormatError("provenance.batch_size must be >= 1")
        if self.device not in ("cpu", "meta", "cuda") and not self.device.startswith("cuda:"):
            raise FormatError(f"provenance.device must be cpu, meta or cuda[:NAME], got {self.device!r}; re-profile")
        if self.dtype not in PROFILE_DTYPES:
            raise FormatError(
                f"provenance.dtype must be one of {', '.join(PROFILE_DTYPES)}, got {self.dtype!r}; re-profile"
            )
        if self.tokens_per_sample is not None and (
            isinstance(self.tokens_per_sample, bool) or self.tokens_per_sample < 1
        ):
            raise FormatError(f"provenance.tokens_per_sample must be >= 1 or null, got {self.tokens_per_sample!r}")


@dataclass(frozen=True, kw_only=True)
class Profile:
    layers: tuple[LayerProfile, ...]
    cut_bytes: tuple[int, ...]
    provenance: Provenance
    input_bytes: int = 0  # model inputs per microbatch
    whole_forward_ms: float | None = None  # whole-model reference timings (fidelity checks)
    whole_backward_ms: float | None = None
    whole_split_backward_ms: float | None = None  # I + W of the first layer, then the rest as one stage (schema 4)
    measurement: Measurement | None = None  # measured (schema 4): rounds, attempts, re-measured parts

    def __post_init__(self) -> None:
        if not self.layers:
            raise FormatError("profile has no layers")
        if len(self.cut_bytes) != len(self.layers) - 1:
            raise FormatError(
                f"profile has {len(self.layers)} layers but {len(self.cut_bytes)} cut_bytes (need layers-1)"
            )
        if any(layer.full_activation_bytes is None for layer in self.layers):
            entering = (self.input_bytes, *self.cut_bytes)  # what crosses the cut before each layer
            filled = tuple(
                layer if layer.full_activation_bytes is not None else replace(layer, full_activation_bytes=before)
                for layer, before in zip(self.layers, entering, strict=True)
            )
            object.__setattr__(self, "layers", filled)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for optional in (
            "update_bytes_per_s",
            "concurrent",
            "wall_over_cpu",
            "op_overhead_ms",
            "exchange_efficiency",
            "step_checks_ms",
        ):  # written only when set: older files, same bytes
            if data["provenance"][optional] is None:
                del data["provenance"][optional]
        return {"schema_version": PROFILE_SCHEMA_VERSION, **data}

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @property
    def fingerprint(self) -> str:
        """Of its file's content (`jsonio.fingerprint`): what a plan records of the profile it was made from."""
        return fingerprint(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "profile") -> Profile:
        return build_dataclass(cls, {k: v for k, v in data.items() if k != "schema_version"}, where=where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        data = read_json(
            path, kind="profile", schema_version=PROFILE_SCHEMA_VERSION, older_versions=OLDER_PROFILE_VERSIONS
        )
        profile = cls.from_dict(data, where=f"profile file {str(path)!r}")
        if not any(layer.forward_ms > 0 for layer in profile.layers):
            raise FormatError(
                f"profile file {str(path)!r}: its layers take no time (every forward_ms is 0), so there is nothing "
                "to balance; re-profile the model"
            )
        prov = profile.provenance
        if prov.source in ("measured", "analytic") and not prov.loss_in_last_layer:
            from pipeplan.console import warn

            warn(
                f"profile file {str(path)!r} was made before profiles counted what the loss keeps for backward "
                "(cross-entropy's b·s·V fp32 log-softmax) in the last layer: its last stage's memory may be "
                "under-counted; re-profile the model"
            )
        return profile
