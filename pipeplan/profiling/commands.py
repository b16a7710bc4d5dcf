"""`pipeplan profile`: measure (cpu/cuda) or estimate (meta + --hardware) per-layer costs and save a Profile."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeplan.console import out, print_json, warn
from pipeplan.errors import ConfigError
from pipeplan.models.registry import load_model, parse_assignments
from pipeplan.paths import check_output_file
from pipeplan.precision import check_device_precision, default_precision
from pipeplan.profiling.hardware import load_hardware
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.summary import fidelity_line, profile_table
from pipeplan.profiling.trace import check_tracer


def _check_device(device: str, hardware: str | None, hardware_file: Path | None = None) -> None:
    if device not in ("cpu", "cuda", "meta") and not device.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu, cuda or meta, got {device!r}")
    if device == "meta" and not hardware:
        raise ConfigError("--device meta estimates costs analytically and needs --hardware NAME (e.g. h100)")
    if hardware:
        load_hardware(hardware, hardware_file=hardware_file)  # an unknown name is an error even where then ignored
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but CUDA is not available here; use --device cpu")


def _analytic(
    spec, *, model: str, options: dict, batch_size: int, hardware, granularity, quiet: bool, tracer: str,
    precision: str,
):  # fmt: skip
    from pipeplan.profiling.analytic import profile_analytic  # written separately; imported only when needed

    given = {key: spec.options.get(key, value) for key, value in options.items()}
    return profile_analytic(
        spec, batch_size=batch_size, hardware=hardware, granularity=granularity, progress=not quiet,
        model_ref=model, model_options=given, tracer=tracer, precision=precision,
    )  # fmt: skip


def _set_threads(threads: int | None, device: str) -> None:
    if threads is None:
        return
    if threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if device == "meta":
        warn("--threads is ignored with --device meta (nothing is run)")
    import torch

    torch.set_num_threads(threads)


def _render(result: Profile, output: Path | None) -> None:
    out.print(profile_table(result))
    line = fidelity_line(result)
    if line:
        out.print(line, highlight=False)
    if output is not None:
        out.print(f"wrote {output}", highlight=False)


def profile(
    model: str = typer.Argument(
        ..., help="Built-in model name (`pipeplan models`), file.py:factory or pkg.mod:factory."
    ),
    assignments: list[str] = typer.Option(None, "--arg", "-a", help="Model option key=value (repeatable)."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Samples per profiled microbatch."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (measured), meta (analytic, needs --hardware)."),
    hardware: str = typer.Option(None, "--hardware", help="Hardware preset for --device meta (h100, a100-80gb, ...)."),
    hardware_file: Path = typer.Option(None, "--hardware-file", help="JSON file adding presets (pipeplan calibrate)."),
    granularity: int = typer.Option(None, "--granularity", help="Module depth of a layer (default: repeated blocks)."),
    tracer: str = typer.Option(
        "auto", "--tracer", help="fx, export (torch.export) or auto: fx, else export (e.g. --tracer export)."
    ),
    warmup: int = typer.Option(2, "--warmup", help="Untimed runs per layer before measuring."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs per layer; the median is kept."),
    threads: int = typer.Option(None, "--threads", help="CPU threads torch may use (default: torch's choice)."),
    timer: str = typer.Option("wall", "--timer", help="wall, or cpu: process CPU time (steady on a busy CPU)."),
    precision: str = typer.Option(
        None,
        "--precision",
        help="fp32, bf16-mixed, fp16-mixed (CUDA) or bf16 (default: bf16-mixed on cuda/meta, fp32 on cpu), "
        "e.g. --precision bf16-mixed.",
    ),
    output: str = typer.Option(None, "--output", "-o", help="Write the Profile JSON here (atomically)."),
    as_json: bool = typer.Option(False, "--json", help="Print only the Profile JSON on stdout."),
) -> None:
    """Profile MODEL layer by layer: forward (F), input-gradient (I), weight-gradient (W) and fused backward (B)
    times, saved activations, parameters and the bytes crossing each cut.

    Example: pipeplan profile gpt -a layers=4 -a hidden=256 --batch-size 4 -o p.json
    Example: pipeplan profile gpt --precision bf16-mixed -o p-bf16.json
    """
    options = parse_assignments(assignments)
    output = check_output_file(output, "--output") if output is not None else None
    _check_device(device, hardware, hardware_file)
    precision = precision or default_precision(device)
    check_device_precision(precision, "cpu" if device == "cpu" else "cuda")
    check_tracer(tracer)
    _set_threads(threads, device)
    spec = load_model(model, options)
    if device == "meta":
        hardware = load_hardware(hardware, hardware_file=hardware_file) if hardware_file is not None else hardware
        if warmup != 2 or repeats != 5 or timer != "wall":
            warn("--warmup/--repeats/--timer are ignored with --device meta (nothing is run)")
        result = _analytic(
            spec, model=model, options=options, batch_size=batch_size, hardware=hardware,
            granularity=granularity, quiet=as_json, tracer=tracer, precision=precision,
        )  # fmt: skip
    else:
        if hardware or hardware_file:
            warn(f"--hardware/--hardware-file are ignored with --device {device} (measured)")
        from pipeplan.profiling.measure import profile_model

        result = profile_model(
            spec, batch_size=batch_size, device=device, granularity=granularity, warmup=warmup, repeats=repeats,
            progress=not as_json, model_ref=model, model_options=options, timer=timer, tracer=tracer,
            precision=precision,
        )  # fmt: skip
    if output is not None:
        result.save(output)
    if as_json:
        print_json(result.to_dict())
    else:
        _render(result, output)
