"""`pipeplan refine`: parse -> refine the plan from a run's trace -> render."""

from __future__ import annotations

from pipeplan.console import out, print_json
from pipeplan.options import command
from pipeplan.refine.options import RefineOptions


@command(RefineOptions)
def refine(options: RefineOptions) -> None:
    """Re-plan from a run's measured ops: the trace `pipeplan run PLAN --trace FILE` wrote becomes per-layer costs
    measured in place (each stage's layers scaled so that its F, I, W or B equal the run's median op times; a
    refined profile), the run's own plan is timed again with them (it reproduces the run), and the model is planned
    again with the plan's settings into DIR (plan.json, scripts, timeline.json and the refined profile.json).

    The trace names the plan it ran (and the plan its profile): a trace of another plan or model is refused. Record
    one with `pipeplan run plan/plan.json --steps 20 --trace plan/measured.json`.

    Example: pipeplan refine plan/measured.json -o plan-refined
    Example: pipeplan refine measured.json --plan plan/plan.json --schedule auto -o plan-auto
    Example: pipeplan refine plan/run1.json --with plan/run2.json -o plan-refined  # two runs pooled
    """
    from pipeplan.refine.job import refine as refine_plan  # the search: imported when it runs
    from pipeplan.refine.report import refined_dict, render_refined

    result = refine_plan(options)
    if options.json_output:
        print_json(refined_dict(result))
        return
    render_refined(out, result)
