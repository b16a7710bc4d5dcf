"""What `pipeplan refine` does between parsing and printing: read the run's trace, find the plan it ran and the
profile that plan was made from (and refuse, in one line, any that do not belong together), turn the measured ops
into a refined profile (`bookkeeping`), time the run's own plan again with it, and plan again (`replan`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pipeplan.artifact.measured import MeasuredRun, read_measured, refined_dir
from pipeplan.artifact.plan import Plan
from pipeplan.artifact.scripts import PROFILE_FILE
from pipeplan.artifact.timing import plan_step_ms
from pipeplan.errors import ConfigError, FormatError
from pipeplan.paths import check_output_dir
from pipeplan.profiling.profile import Profile
from pipeplan.refine.bookkeeping import Medians, learned_op_overhead, measured_medians, refined_layers, retimed_plan
from pipeplan.refine.options import RefineOptions
from pipeplan.refine.pool import pooled
from pipeplan.refine.replan import replan
from pipeplan.refine.updates import LearnedTail, learned_tail, with_learned_tail
from pipeplan.search.scaling import scale_profile


@dataclass(frozen=True, kw_only=True)
class Refined:
    """A refine's result: the run (`run.record`: measured and predicted step), the refined profile and what it
    predicts for the run's own plan, the medians per (stage, kind) beside the plan's op times, and the new plan."""

    run: MeasuredRun
    plan: Plan  # the plan the run ran
    plan_path: Path
    profile: Profile  # refined
    medians: Medians
    retimed: Plan  # the run's plan with the refined op times (same schedule, same layout)
    refined_ms: float  # its predicted step for the setting run
    new_plan: Plan
    output: Path

    def rows(self) -> list[tuple[int, str, float, float, float]]:
        """(stage, kind, planned ms, measured median ms, refined ms) for every measured (stage, kind)."""
        field = {"F": "forward_ms", "I": "input_grad_ms", "W": "weight_grad_ms", "B": "backward_ms"}
        return [
            (s, kind, getattr(self.plan.stages[s], field[kind]), ms, getattr(self.retimed.stages[s], field[kind]))
            for (s, kind), ms in sorted(self.medians.items())
        ]


def refine(options: RefineOptions) -> Refined:
    """The whole `pipeplan refine` (module docstring)."""
    run = pooled([read_measured(path) for path in (options.trace, *(options.pooled_with or ()))])
    plan_path = _plan_path(options, run)
    plan = _checked_plan(plan_path, run)
    profile = _checked_profile(options.profile or plan_path.parent / PROFILE_FILE, plan, given=bool(options.profile))
    output = Path(options.output) if options.output else refined_dir(plan_path)
    if output.resolve() == plan_path.parent.resolve():
        raise ConfigError(f"-o {str(output)!r} is the run's plan directory; write the refined plan elsewhere")
    check_output_dir(output, "--output")
    medians = measured_medians(plan, run)
    refined = refined_profile(plan, profile, medians, run)
    retimed = with_learned_tail(retimed_plan(plan, refined), learned(refined), profile.provenance.exchange_efficiency)
    refined_ms = plan_step_ms(retimed, post_validate=run.record.post_validate)
    schedules = options.schedules(plan.schedule)
    new_plan, _ = replan(refined, plan, schedules=schedules, output=output)
    return Refined(
        run=run,
        plan=plan,
        plan_path=plan_path,
        profile=refined,
        medians=medians,
        retimed=retimed,
        refined_ms=refined_ms,
        new_plan=new_plan,
        output=output,
    )


def refined_profile(plan: Plan, profile: Profile, medians: Medians, run: MeasuredRun) -> Profile:
    """`profile` at the plan's microbatch size with its layers scaled to the run's medians: what the ranks' ops
    cost in place, their threads recorded, what each op cost beyond its work (`bookkeeping.op_overhead_ms`), what
    its step tails' parts teach (`updates`: the exchange's efficiency, the checks, the update rate); the whole-model
    references and spreads of the original measurement no longer apply and are dropped."""
    scaled = scale_profile(profile, plan.training.microbatch_size)
    prov = scaled.provenance
    per_op = learned_op_overhead(plan, profile, medians)
    tail = learned_tail(plan, run, prov.exchange_efficiency)
    note = f"refined from the run traced in {run.path} (plan {run.record.plan_fingerprint})"
    return replace(
        scaled,
        layers=refined_layers(plan, profile, medians, per_op),
        whole_forward_ms=None,
        whole_backward_ms=None,
        whole_split_backward_ms=None,
        measurement=None,
        provenance=replace(
            prov,
            graph_fingerprint=plan.model.fingerprint or prov.graph_fingerprint,  # the graph at this microbatch size
            threads=run.record.threads,
            refined_from=note,
            # what this run did not teach (no marks: post-validated) stays as the profile had it
            update_bytes_per_s=tail.update_bytes_per_s or prov.update_bytes_per_s,
            exchange_efficiency=tail.exchange_efficiency or prov.exchange_efficiency,
            step_checks_ms=prov.step_checks_ms if tail.step_checks_ms is None else tail.step_checks_ms,
            op_overhead_ms=per_op,
            notes=f"{prov.notes}; {note}".strip("; "),
        ),
    )


def learned(profile: Profile) -> LearnedTail:
    """The tail's parts a refined profile records (`refine.updates`)."""
    prov = profile.provenance
    return LearnedTail(prov.update_bytes_per_s, prov.exchange_efficiency, prov.step_checks_ms)


def _plan_path(options: RefineOptions, run: MeasuredRun) -> Path:
    if options.plan is not None:
        return Path(options.plan)
    if not run.record.plan:
        raise ConfigError(f"trace {run.path!r} does not name its plan file; give it with --plan PLAN.json")
    path = Path(run.record.plan)
    if not path.exists():
        raise ConfigError(f"the plan trace {run.path!r} ran, {str(path)!r}, is gone; give it with --plan PLAN.json")
    return path


def _checked_plan(path: Path, run: MeasuredRun) -> Plan:
    """The plan at `path`, which must be the one the run ran (its fingerprint)."""
    plan = Plan.load(path)
    record = run.record
    if plan.fingerprint != record.plan_fingerprint:
        model = "another model" if plan.model.fingerprint != record.model_fingerprint else "another plan"
        raise ConfigError(
            f"trace {run.path!r} was measured running {model} than {str(path)!r} (plan fingerprint "
            f"{record.plan_fingerprint}, this one {plan.fingerprint}); give the plan it ran (--plan) or run this "
            "plan with --trace"
        )
    return plan


def _checked_profile(path: Path, plan: Plan, *, given: bool) -> Profile:
    """The profile `plan` was made from: profile.json beside it (or --profile), its fingerprint the one the plan
    records (a plan that records none: the same layers)."""
    if not path.exists():
        hint = "" if given else f" (plans written before `plan` kept {PROFILE_FILE} beside plan.json)"
        raise ConfigError(f"no profile {str(path)!r}{hint}; give the profile the plan was made from with --profile")
    profile = Profile.load(path)
    if plan.profile is not None and profile.fingerprint != plan.profile.fingerprint:
        raise ConfigError(
            f"profile {str(path)!r} is not the one the plan was made from (fingerprint {profile.fingerprint}, the "
            f"plan's {plan.profile.fingerprint}); give that profile with --profile"
        )
    names = [name for stage in plan.stages for name in stage.layer_names]
    if [layer.name for layer in profile.layers] != names:
        raise FormatError(f"profile {str(path)!r} has other layers than the plan's stages; give the plan's profile")
    return profile
