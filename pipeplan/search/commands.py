"""`pipeplan plan`: parse -> resolve -> plan (the library call) -> write the plan directory -> render."""

from __future__ import annotations

from pipeplan.console import out, print_json, progress_task
from pipeplan.options import command
from pipeplan.search.plan_options import PlanOptions


@command(PlanOptions)
def plan(options: PlanOptions) -> None:
    """Choose pipeline depth, replication, microbatches and schedule, and write a runnable plan.

    Writes DIR/plan.json, launch.sh, job.sbatch, timeline.json and profile.json (the costs planned from, which
    `pipeplan refine` starts from; DIR defaults to ./plan). MODEL is profiled on the spot (measured on cpu/cuda,
    analytic with --device meta --hardware NAME); --profile FILE plans from a saved profile (not runnable alone:
    give MODEL too so the plan names each stage's FX nodes). Profile costs are scaled linearly to the microbatch
    size.

    Example: pipeplan plan gpt --devices 2 --global-batch-size 8 -o demo-out
    Example: pipeplan plan gpt --precision bf16-mixed --devices 2 -B 8 -o demo-bf16
    Example: pipeplan plan --profile llama.json --hardware h100 --devices 64 -B 1024 --memory reserve=6GiB
    Example: pipeplan plan llama-7b --device meta --hardware h100 --devices 8x8 -B 256 --parallel tp=auto,pp=4/8
    Example: pipeplan plan hf:mistral-7b --device meta --hardware h100 --devices 8 -B 64 --attention math
    Example: pipeplan plan gpt --devices 4 -B 32 --schedule all -o demo-async
    """
    from pipeplan.artifact.summary import render_summary, summary_dict
    from pipeplan.search.plan_job import prepare_plan, write_plan  # the search: imported when it runs
    from pipeplan.search.planner import plan as plan_layouts

    job = prepare_plan(options)
    with progress_task("searching plans", quiet=options.json_output) as update:
        progress = lambda done, total: update(completed=done, total=total)  # noqa: E731
        chosen = plan_layouts(job.source, job.cluster, job.config, progress=progress)
    timeline = write_plan(chosen, job.output, job.source.profile)
    if options.json_output:
        print_json(summary_dict(chosen, plan_dir=str(job.output), timeline=timeline))
        return
    render_summary(out, chosen, timeline=timeline)
    out.print(f"wrote {job.output}/plan.json, launch.sh, job.sbatch, timeline.json, profile.json")
