"""`pipeplan export-weights CKPT_DIR -o OUT`: the whole model's state_dict, under the names `model.state_dict()` of
a whole-model build has (the names `--init-from` reads), from a checkpoint `pipeplan run --checkpoint-dir` wrote.

A checkpoint step holds one file per stage (checkpoint.py: the stage's parameters under their canonical names, its
buffers under their model-qualified names; the first replica of pipeline 0 writes it, with ZeRO-1 the gathered
parameters, with asynchronous schedules the newest weights) and the run's plan. Each state_dict key takes the value
of whichever of its tied names (init_weights.alias_groups: one mapping for reading and writing) a stage file holds;
a tensor that several stage files hold (a weight tied across stages) must be equal in all of them. Keys no stage
file holds (buffers the run only used through torch.fx constants, never trained) come from the run's initial weights:
its recorded `--init-from` file, else the whole-model build with the plan's seed. Refused in one line: a checkpoint
missing stage files, files of another step or partition, shared tensors that disagree.

Output (weights_output.py): `-o FILE.safetensors` one file; `-o DIR` a directory of shards and
`model.safetensors.index.json` as transformers writes them, with the config.json of an `hf:` model, so
`AutoModelForCausalLM.from_pretrained(DIR)` loads it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeplan.artifact.plan import Plan
from pipeplan.errors import ConfigError, RunError
from pipeplan.graph.trace import build_module
from pipeplan.runtime.step.stages import load_spec
from pipeplan.runtime.weights import checkpoint
from pipeplan.runtime.weights.init_weights import alias_groups, load_initial_weights
from pipeplan.runtime.weights.materialize import build_whole, named_tensors
from pipeplan.runtime.weights.weights_output import check_target, hf_config, write_weights


@dataclass(kw_only=True)
class CheckpointStep:
    root: Path
    step: int
    plan: Plan
    init_from: str | None  # the --init-from file the run started from (None: the plan's seed)
    stages: list[dict[str, Any]]  # each stage file's contents


@dataclass(kw_only=True)
class WholeState:
    tensors: dict[str, torch.Tensor]  # state_dict key -> value, in the whole model's state_dict order
    model: torch.nn.Module  # the whole model on the meta device (its config, for an hf: model)
    initial: list[str]  # keys taken from the run's initial weights (not in any stage file)


def read_checkpoint(
    root: str | os.PathLike, *, step: int | None = None, plan_file: str | None = None
) -> CheckpointStep:
    """The stage files of checkpoint `step` (default: the newest complete one), checked complete and consistent."""
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"checkpoint directory {str(root)!r} does not exist; give a --checkpoint-dir of `pipeplan run`")
    if step is None and not (root / checkpoint.LATEST).is_file():
        raise RunError(
            f"{str(root)!r} holds no complete checkpoint (no '{checkpoint.LATEST}' file): not a --checkpoint-dir of "
            "`pipeplan run`, or its first checkpoint is still being written; or pick one with --step"
        )
    step = checkpoint.latest_step(root) if step is None else step
    where = checkpoint.step_dir(root, step)
    if not where.is_dir():
        kept = sorted(p.name for p in root.glob("step_*"))
        raise RunError(f"{str(root)!r} holds no checkpoint of step {step} (it holds {kept or 'none'}); pick --step")
    plan_path = Path(plan_file) if plan_file else where / checkpoint.PLAN_FILE
    if plan_file and not plan_path.is_file():
        raise RunError(f"--plan {plan_file!r} does not exist; give the plan file the run used")
    if not plan_path.is_file():
        raise RunError(
            f"checkpoint {str(where)!r} holds no {checkpoint.PLAN_FILE} (an older pipeplan wrote it); give the plan "
            "it was run with: --plan PLAN"
        )
    plan = Plan.load(plan_path)
    _check_stage_files(where, len(plan.stages))
    stages = [_read_stage(where, step, index, plan) for index in range(len(plan.stages))]
    init_from = checkpoint.recorded_init_from(root, step)
    return CheckpointStep(root=root, step=step, plan=plan, init_from=init_from, stages=stages)


def _check_stage_files(where: Path, num_stages: int) -> None:
    found = {p.name for p in where.glob("stage_*.pt")}
    expected = {f"stage_{s:03d}.pt" for s in range(num_stages)}
    if found != expected:
        missing, extra = sorted(expected - found), sorted(found - expected)
        problem = f"misses {', '.join(missing)}" if missing else f"has {', '.join(extra)} beyond the plan's stages"
        raise RunError(
            f"checkpoint {str(where)!r} is not complete: it {problem} ({num_stages} stage(s) in its plan); export a "
            "complete step (--step) or the directory `pipeplan run` wrote"
        )


def _read_stage(where: Path, step: int, index: int, plan: Plan) -> dict[str, Any]:
    path = where / f"stage_{index:03d}.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise RunError(f"cannot read checkpoint {str(path)!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or not {"params", "step", "stage", "partition"} <= set(state):
        raise RunError(f"{str(path)!r} is not a stage file of `pipeplan run --checkpoint-dir`")
    if state["step"] != step or state["stage"] != index:
        raise RunError(
            f"{str(path)!r} holds stage {state['stage']} of step {state['step']}, not stage {index} of step {step}: "
            "the checkpoint mixes steps; export a checkpoint one run wrote whole"
        )
    if state["partition"] != checkpoint.partition_key(plan):
        raise RunError(f"{str(path)!r} was written for another partition than its plan's; give the plan it ran with")
    return state


def _held(stages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every tensor the stage files hold by name; one that several hold (tied across stages) must be equal."""
    held: dict[str, tuple[int, torch.Tensor]] = {}
    for state in stages:
        for name, value in [*state["params"].items(), *state.get("buffers", {}).items()]:
            if name in held and not _equal(held[name][1], value):
                raise RunError(
                    f"stages {held[name][0]} and {state['stage']} of the checkpoint hold different values of "
                    f"{name!r}, which must be equal after a step; the checkpoint is damaged or mixed"
                )
            held.setdefault(name, (state["stage"], value))
    return {name: value for name, (_, value) in held.items()}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaNs in the same places count as equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def whole_state(ckpt: CheckpointStep) -> WholeState:
    """The whole model's state_dict from the checkpoint's stage files (see the module docstring)."""
    spec = load_spec(ckpt.plan)
    model = build_module(spec, "meta")
    groups = alias_groups(model)
    held = _held(ckpt.stages)
    tensors: dict[str, torch.Tensor] = {}
    initial: list[str] = []
    for key, expected in model.state_dict(keep_vars=True).items():
        names = [name for name in groups[key] if name in held]
        if not names:
            initial.append(key)
            continue
        value = held[names[0]]
        for other in names[1:]:
            if not _equal(held[other], value):
                raise RunError(f"the checkpoint holds tied tensors {names[0]!r} and {other!r} with different values")
        if tuple(value.shape) != tuple(expected.shape):
            raise RunError(
                f"the checkpoint holds {key!r} as {tuple(value.shape)}, the plan's model as {tuple(expected.shape)}; "
                "give the plan it was run with (--plan)"
            )
        tensors[key] = value.clone(memory_format=torch.contiguous_format)  # its own storage (ZeRO-1 saved views)
    if initial:
        _fill_initial(ckpt, spec, tensors, initial)
        tensors = {key: tensors[key] for key in model.state_dict(keep_vars=True)}
    return WholeState(tensors=tensors, model=model, initial=initial)


def _fill_initial(ckpt: CheckpointStep, spec, tensors: dict[str, torch.Tensor], keys: list[str]) -> None:
    """The run's initial values of `keys`: the whole-model build with the plan's seed, then its --init-from file."""
    whole = build_whole(spec, ckpt.plan.training.seed)
    if ckpt.init_from:
        if not Path(ckpt.init_from).exists():
            raise RunError(
                f"the run started from --init-from {ckpt.init_from!r}, which no longer exists, and the checkpoint "
                f"does not hold {keys[0]!r} (an untrained buffer); put that file back to export"
            )
        load_initial_weights(ckpt.init_from, model=whole, tensors=list(named_tensors(whole)))
    state = whole.state_dict()
    for key in keys:
        tensors[key] = state[key].detach().clone(memory_format=torch.contiguous_format)


@dataclass(kw_only=True)
class Exported:
    files: list[Path]
    step: int
    keys: int
    initial: list[str]  # keys written with the run's initial values (untrained buffers)
    config_written: bool


def export_weights(
    root: str | os.PathLike,
    output: str,
    *,
    step: int | None = None,
    plan_file: str | None = None,
    shard_gb: float = 5.0,
    force: bool = False,
) -> Exported:
    """Write checkpoint `step` of `root` (default the newest) as the whole model's state_dict to `output`: a
    `.safetensors` file, or a directory of shards with an index (and config.json for an `hf:` model)."""
    if not shard_gb > 0:
        raise ConfigError(f"--shard-gb must be > 0, got {shard_gb}")
    target = check_target(output, force=force)  # before reading anything
    ckpt = read_checkpoint(root, step=step, plan_file=plan_file)
    whole = whole_state(ckpt)
    config = hf_config(whole.model) if not target.name.endswith(".safetensors") else None
    files = write_weights(whole.tensors, target, shard_gb=shard_gb, config=config)
    return Exported(
        files=files, step=ckpt.step, keys=len(whole.tensors), initial=whole.initial, config_written=config is not None
    )
