"""What `run` checks before any rank starts (ranks take tens of seconds to start, and each would fail alike): the
`--init-from` file against the model (keys, a base model's mapping, shapes and dtypes, no tensor data read), and
that the whole model can be built on this host for exact materialization (or the factory declares the meta path's
initializer), and a --resume checkpoint whole: every stage file of its newest step read and checked against the
plan (step, stage set, partition, graph fingerprint, parameter names, shapes and dtypes, optimizer state). Each
problem is one line."""

from __future__ import annotations

from pipeplan.artifact.plan import Plan
from pipeplan.console import warn
from pipeplan.graph.trace import build_module
from pipeplan.models.spec import ModelSpec
from pipeplan.precision import get_precision
from pipeplan.runtime.step.stages import load_spec, stage_tensors, trace_for_plan
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.optim import run_optimizer, state_keys
from pipeplan.runtime.weights.checkpoint import expected_stages, verify_checkpoint
from pipeplan.runtime.weights.init_weights import check_initial_weights
from pipeplan.runtime.weights.materialize import refuse_or_announce_meta_path, whole_build_fits


def check_before_launch(plan: Plan, config: RunConfig, *, check_resume: bool = True) -> None:
    """Refuse, before starting ranks, a run whose ranks would all fail the same way (see the module docstring).
    All `plan.world_size` ranks of a local run share this host. `check_resume=False`: the checkpoint is written by
    an earlier run of the same launch (its ranks check it when they load it)."""
    spec = load_spec(plan)
    if config.resume and check_resume:
        verify_resume(plan, spec, config)
    model = build_module(spec, "meta")
    if config.init_from:
        note = check_initial_weights(config.init_from, model)
        if note:
            warn(note)
    fits, needed, available = whole_build_fits(model, plan.world_size)
    if not fits and spec.init_module is None:  # every rank would refuse it after starting
        refuse_or_announce_meta_path(spec, rank=0, needed=needed, available=available, ranks=plan.world_size)


def verify_resume(plan: Plan, spec: ModelSpec, config: RunConfig) -> None:
    """The newest checkpoint in --checkpoint-dir is this plan's run's, whole (checkpoint.verify_checkpoint)."""
    traced = trace_for_plan(plan, spec)
    tensors = stage_tensors(plan, traced, get_precision(plan.training.precision).param_dtype)
    name = run_optimizer(plan, spec, optimizer=config.optimizer, momentum=config.momentum)
    expectations = expected_stages(plan, tensors, state_keys(name, config.momentum))
    assert config.checkpoint_dir is not None, "--resume needs --checkpoint-dir (RunConfig checks)"
    verify_checkpoint(config.checkpoint_dir, expectations)
