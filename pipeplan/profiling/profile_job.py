"""What `pipeplan profile` does between parsing and printing: build the model, measure it (cpu/cuda) or estimate
it (meta, from a hardware preset), and save the Profile."""

from __future__ import annotations

from pipeplan.hardware import load_hardware
from pipeplan.models.registry import load_model, parse_assignments
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.profile_options import ProfileOptions


def profile_from_options(options: ProfileOptions) -> Profile:
    """The Profile `pipeplan profile` prints, written to --output when given."""
    model_options = parse_assignments(options.assignments)
    if options.threads is not None and options.device != "meta":
        import torch

        torch.set_num_threads(options.threads)
    spec = load_model(options.model, model_options)
    common = dict(
        batch_size=options.batch_size,
        granularity=options.granularity,
        progress=not options.as_json,
        model_ref=options.model,
        tracer=options.tracer,
        precision=options.run_precision,
    )
    if options.device == "meta":
        from pipeplan.profiling.analytic import profile_analytic  # imported only when needed

        hardware = options.hardware
        if options.hardware_file is not None:
            hardware = load_hardware(options.hardware, hardware_file=options.hardware_file)
        given = {key: spec.options.get(key, value) for key, value in model_options.items()}
        profile = profile_analytic(spec, hardware=hardware, model_options=given, **common)
    else:
        from pipeplan.profiling.measure import profile_model

        profile = profile_model(
            spec,
            device=options.device,
            warmup=options.warmup,
            repeats=options.repeats,
            model_options=model_options,
            timer=options.timer,
            **common,
        )
    if options.output is not None:
        profile.save(options.output)
    return profile
