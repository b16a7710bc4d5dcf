"""The one "model -> profile" path: build the model, measure it (cpu/cuda) or estimate it (meta, for a hardware
preset). `pipeplan profile`, `pipeplan plan` (profiling on the spot) and `pipeplan capacity` all call
`profile_request` with a `ProfileRequest` their job resolved (hardware read once, precision decided by the
command)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeplan.cluster import CPU_DEFAULT_DEVICES, cpu_threads_per_rank
from pipeplan.errors import ConfigError
from pipeplan.hardware import Hardware, resolve_hardware
from pipeplan.models.assignments import parse_assignments
from pipeplan.precision import check_device_precision
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.profile_options import (
    DEFAULT_REPEATS,
    DEFAULT_TIMER,
    DEFAULT_WARMUP,
    ProfileOptions,
    check_attention,
    check_concurrent,
    unknown_device,
)
from pipeplan.profiling.siblings import (
    SiblingModel,
    own_step_times,
    sibling_load,
    slowest_share,
    under_concurrency,
    update_bytes_per_s,
)

if TYPE_CHECKING:
    from pipeplan.models.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """A model to profile and how: measured on cpu/cuda, or analytic on meta for `hardware`."""

    model: str
    options: dict[str, str] = field(default_factory=dict)
    batch_size: int
    precision: str  # pipeplan.precision mode: the command decides (no default here)
    device: str = "cpu"
    hardware: Hardware | None = None
    granularity: int | None = None
    tracer: str = "auto"
    progress: bool = False
    warmup: int = DEFAULT_WARMUP
    repeats: int = DEFAULT_REPEATS
    timer: str = DEFAULT_TIMER
    preset_overridable: tuple[str, ...] = ()  # preset options the request may replace (capacity's --seq)
    attention: str = "auto"  # analytic profiles: what each SDPA call runs as (profile_options.ATTENTION_MODES)
    threads: int | None = None  # CPU threads measured with (cluster.cpu_threads_per_rank; None: torch's current)
    concurrent: int = 1  # CPU: processes measuring side by side, as a run's ranks share the machine (siblings.py)

    def __post_init__(self) -> None:
        kind = self.device.partition(":")[0]
        if kind not in ("cpu", "cuda", "meta"):
            raise unknown_device(self.device)
        if kind == "meta" and self.hardware is None:
            raise ConfigError("--device meta profiles analytically and needs --hardware NAME (e.g. --hardware h100)")
        if kind == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda requested but CUDA is not available here; use --device cpu")
        check_device_precision(self.precision, kind)
        check_attention(self.attention, kind)
        check_concurrent(self.concurrent, kind)


def profile_request(request: ProfileRequest, *, check=None) -> tuple[Profile, ModelSpec]:
    """The Profile of `request` and the model it was made from; `check(spec)` runs on the built model before the
    (slow) profiling. The provenance records the options given (what rebuilds the model) and all of them."""
    from pipeplan.models.registry import load_model  # torch: imported once a model is built

    spec = load_model(request.model, request.options, preset_overridable=request.preset_overridable)
    if check is not None:
        check(spec)
    common: dict[str, Any] = dict(  # the keywords both profilers take
        batch_size=request.batch_size,
        granularity=request.granularity,
        progress=request.progress,
        model_ref=request.model,
        tracer=request.tracer,
        precision=request.precision,
    )
    if request.device == "meta":
        from pipeplan.profiling.analytic import profile_analytic  # imported only when needed

        given = {key: spec.options.get(key, value) for key, value in request.options.items()}
        assert request.hardware is not None, "ProfileRequest refuses --device meta without --hardware"
        profile = profile_analytic(
            spec, hardware=request.hardware, model_options=given, attention=request.attention, **common
        )
        return profile, spec
    from pipeplan.graph.host_memory import check_fits_host  # (torch: imported only when measuring)
    from pipeplan.profiling.measure import profile_model

    concurrent, model = request.concurrent > 1, _sibling_model(request)
    if concurrent:  # before any sibling builds the model: every process holds it
        check_fits_host(spec, batch_size=request.batch_size, device=request.device, processes=request.concurrent)
    with _torch_threads(request.threads), sibling_load(model, request.concurrent - 1) as shares:
        profile = profile_model(
            spec,
            device=request.device,
            warmup=request.warmup,
            repeats=request.repeats,
            model_options=dict(request.options),
            timer="cpu" if concurrent else request.timer,  # CPU time x the measured wall / CPU ratio: siblings.py
            **common,
        )
        if concurrent:  # beside the siblings still: this process's time per training step and the update rate
            own, update_rate = own_step_times(model), update_bytes_per_s(model)
    if concurrent:  # x the slowest process's wall per step / this one's CPU per step (siblings.py)
        profile = under_concurrency(profile, request.concurrent, slowest_share(own, shares.step_walls_s), update_rate)
    return profile, spec


def _sibling_model(request: ProfileRequest) -> SiblingModel:
    import torch

    return SiblingModel(
        model=request.model,
        options=dict(request.options),
        batch_size=request.batch_size,
        precision=request.precision,
        threads=request.threads or torch.get_num_threads(),
    )


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to `threads` for the block, then put back (the Python API's caller keeps its own)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def profile_from_options(options: ProfileOptions) -> Profile:
    """The Profile `pipeplan profile` prints, written to --output when given. A CPU profile measures with --threads,
    by default a CPU_DEFAULT_DEVICES-rank run's share of the cores (cluster.cpu_threads_per_rank), or with
    --concurrent N an N-rank run's: the threads each rank of such a plan runs with."""
    threads = options.threads
    if threads is None and options.device == "cpu":
        threads = cpu_threads_per_rank(options.concurrent if options.concurrent > 1 else CPU_DEFAULT_DEVICES)
    request = ProfileRequest(
        model=options.model,
        options=parse_assignments(options.assignments),
        batch_size=options.batch_size,
        precision=options.run_precision,
        device=options.device,
        hardware=resolve_hardware(options.hardware, options.hardware_file) if options.device == "meta" else None,
        granularity=options.granularity,
        tracer=options.tracer,
        progress=not options.as_json,
        warmup=options.warmup,
        repeats=options.repeats,
        timer=options.timer,
        attention=options.attention,
        threads=threads,
        concurrent=options.concurrent if options.device == "cpu" else 1,
    )
    profile, _ = profile_request(request)
    if options.output is not None:
        profile.save(options.output)
    return profile
