"""What `run` checks before any rank starts (ranks take tens of seconds to start, and each would fail alike): the
`--init-from` file against the model (keys, a base model's mapping, shapes and dtypes, no tensor data read), and
that the whole model can be built on this host for exact materialization (or the factory declares the meta path's
initializer). Each problem is one line."""

from __future__ import annotations

from pipeplan.console import warn
from pipeplan.graph.trace import build_module
from pipeplan.plan.plan import Plan
from pipeplan.runtime.step.stages import load_spec
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights.init_weights import check_initial_weights
from pipeplan.runtime.weights.materialize import refuse_or_announce_meta_path, whole_build_fits


def check_before_launch(plan: Plan, config: RunConfig) -> None:
    """Refuse, before starting ranks, a run whose ranks would all fail the same way (see the module docstring).
    All `plan.world_size` ranks of a local run share this host."""
    spec = load_spec(plan)
    model = build_module(spec, "meta")
    if config.init_from:
        note = check_initial_weights(config.init_from, model)
        if note:
            warn(note)
    fits, needed, available = whole_build_fits(model, plan.world_size)
    if not fits and spec.init_module is None:  # every rank would refuse it after starting
        refuse_or_announce_meta_path(spec, rank=0, needed=needed, available=available, ranks=plan.world_size)
