"""`pipeplan profile`: measure (cpu/cuda) or estimate (meta + --hardware) per-layer costs and save a Profile."""

from __future__ import annotations

from pipeplan.console import out, print_json
from pipeplan.options import command
from pipeplan.profiling.profile_options import ProfileOptions


@command(ProfileOptions)
def profile(options: ProfileOptions) -> None:
    """Profile MODEL layer by layer: forward (F), input-gradient (I), weight-gradient (W) and fused backward (B)
    times, saved activations, parameters and the bytes crossing each cut.

    Example: pipeplan profile gpt -a layers=4 -a hidden=256 --batch-size 4 -o p.json
    Example: pipeplan profile gpt --precision bf16-mixed -o p-bf16.json
    Example: pipeplan profile gpt -b 2 --concurrent 2 -o p-2ranks.json  # beside a sibling, as 2 ranks run
    Example: pipeplan profile hf:llama-3-8b --device meta --hardware h100 --attention math -o p-math.json
    """
    from pipeplan.profiling.profile_job import profile_from_options  # torch: imported when the command runs
    from pipeplan.profiling.summary import (
        consistency_lines,
        measured_with_line,
        options_line,
        profile_table,
        routing_lines,
    )

    result = profile_from_options(options)
    if options.as_json:
        print_json(result.to_dict())
        return
    out.print(profile_table(result))
    for line in [options_line(result), measured_with_line(result), *routing_lines(result), *consistency_lines(result)]:
        if line:
            out.print(line, highlight=False)
    if options.output is not None:
        out.print(f"wrote {options.output}", highlight=False)
