"""Per-stage checkpoints: `DIR/step_00000012/stage_003.pt` holds that stage's parameters, their optimizer state, the
step and the writer's RNG state; `DIR/latest` (written last, atomically, after every stage file is in place) names
the newest complete checkpoint, so a crash while saving leaves the previous one intact. Each file is written to a
temp name and renamed; files are read with torch.load(weights_only=True). Beside the stage files, `plan.json` (the
run's effective plan) and `run.json` (the `--init-from` file the run started from, carried over by resumed runs)
let `pipeplan export-weights` rebuild the whole model's state_dict from a checkpoint alone."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeplan.artifact.plan import Plan
from pipeplan.errors import RunError
from pipeplan.jsonio import atomic_write, atomic_write_text

LATEST = "latest"
PLAN_FILE = "plan.json"
RUN_FILE = "run.json"
KEEP = 2  # complete checkpoints kept


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def stage_file(root: str | os.PathLike, step: int, stage: int) -> Path:
    return step_dir(root, step) / f"stage_{stage:03d}.pt"


def partition_key(plan: Plan) -> str:
    """Digest of the plan's partition (each stage's layers and FX nodes): a checkpoint resumes only into the same."""
    stages = [(s.first_layer, s.last_layer, list(s.node_names)) for s in plan.stages]
    return hashlib.sha256(json.dumps(stages).encode()).hexdigest()[:16]


def save_stage(
    root: str | os.PathLike,
    *,
    step: int,
    stage: int,
    names: tuple[str, ...],
    params: dict[str, nn.Parameter],
    buffers: dict[str, torch.Tensor],
    optimizer_states: dict[str, dict[str, Any]],
    fingerprint: str,
    partition: str,
    num_stages: int,
) -> None:
    """Write one stage's state atomically (temp file in the same directory, then rename): its parameters, their
    optimizer state (`optimizer_states`: name -> that parameter's full state, whether the run shards it or not),
    its buffers (running statistics), and what partition it belongs to."""
    state = {
        "step": step,
        "stage": stage,
        "fingerprint": fingerprint,
        "partition": partition,
        "num_stages": num_stages,
        "params": {name: params[name].detach().cpu() for name in names},
        "buffers": {name: value.detach().cpu() for name, value in buffers.items()},
        "optimizer": {name: _cpu(optimizer_states.get(name, {})) for name in names},
        "stateless": sorted(name for name in names if not optimizer_states.get(name)),  # no gradient yet: no state
        "rng": torch.get_rng_state(),
    }
    atomic_write(stage_file(root, step, stage), lambda tmp: _save(state, tmp))


def _save(state: dict[str, Any], path: str) -> None:
    """torch.save, a full disk said as one (torch reports it as `RuntimeError: [enforce fail ...] unexpected pos`)."""
    try:
        torch.save(state, path)
    except RuntimeError:
        free = shutil.disk_usage(Path(path).parent).free
        needed = sum(t.numel() * t.element_size() for t in _tensors(state))
        if free < needed:
            raise OSError(
                errno.ENOSPC, f"No space left on device ({free} bytes free, the stage needs {needed})"
            ) from None
        raise


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def mark_latest(root: str | os.PathLike, step: int, plan: Plan | None = None, init_from: str | None = None) -> None:
    """Publish `step` as the newest complete checkpoint, then prune all but the newest KEEP. With `plan`, first
    write the plan and the run's initial-weights file (`init_from`, absolute) beside the stage files."""
    if plan is not None:
        plan.save(step_dir(root, step) / PLAN_FILE)
        source = str(Path(init_from).absolute()) if init_from else None
        atomic_write_text(step_dir(root, step) / RUN_FILE, json.dumps({"init_from": source}) + "\n")
    atomic_write_text(Path(root) / LATEST, step_dir(root, step).name + "\n")
    done = sorted(p for p in Path(root).glob("step_*") if p.is_dir())
    for old in done[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def latest_step(root: str | os.PathLike) -> int:
    marker = Path(root) / LATEST
    if not marker.is_file():
        raise RunError(f"no complete checkpoint in {str(root)!r} (no '{LATEST}' file); drop --resume to start fresh")
    name = marker.read_text().strip()
    try:
        return int(name.removeprefix("step_"))
    except ValueError:
        raise RunError(f"checkpoint marker {str(marker)!r} holds {name!r}, not step_NNNNNNNN") from None


def recorded_init_from(root: str | os.PathLike, step: int | None = None) -> str | None:
    """The `--init-from` file the run that wrote checkpoint `step` (default the newest) started from (None: the
    plan's seed, or no record)."""
    try:
        record = step_dir(root, latest_step(root) if step is None else step) / RUN_FILE
        return json.loads(record.read_text()).get("init_from") if record.is_file() else None
    except (RunError, ValueError, OSError):
        return None


def check_complete(root: str | os.PathLike, step: int, num_stages: int) -> None:
    """Every stage file of this plan's partition is in checkpoint `step`, and no other."""
    found = sorted(p.name for p in step_dir(root, step).glob("stage_*.pt"))
    expected = [stage_file(root, step, s).name for s in range(num_stages)]
    if found != expected:
        raise RunError(
            f"checkpoint {str(step_dir(root, step))!r} holds {len(found)} stage file(s) but this plan has "
            f"{num_stages} stage(s); resume with the plan that wrote it, or drop --resume"
        )


@dataclass(frozen=True, kw_only=True)
class StageExpectation:
    """What a stage file of this run must hold: the plan's identity, each parameter's and buffer's shape (and each
    parameter's dtype, the run's precision), and the optimizer state's keys (None: a factory's optimizer)."""

    step: int
    num_stages: int
    fingerprint: str
    partition: str
    params: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buffers: dict[str, tuple[int, ...]]
    optimizer_keys: frozenset[str] | None


def expected_stages(plan: Plan, tensors: list, optimizer_keys: frozenset[str] | None, step: int = 0) -> list:
    """One StageExpectation per stage from each stage's tensors (`params`: name -> (shape, dtype), `buffers`:
    name -> shape; runtime/step/stages.stage_tensors) and the run's optimizer's state keys."""
    return [
        StageExpectation(
            step=step,
            num_stages=len(plan.stages),
            fingerprint=plan.model.fingerprint,
            partition=partition_key(plan),
            params=dict(held.params),
            buffers=dict(held.buffers),
            optimizer_keys=optimizer_keys,
        )
        for held in tensors
    ]


def read_stage(path: Path) -> dict[str, Any]:
    """A stage file's contents (tensors memory-mapped where the file allows), or one RunError."""
    if not path.is_file():
        raise RunError(f"checkpoint file {str(path)!r} is missing; resume from an intact checkpoint directory")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a truncated or foreign file
        raise RunError(f"cannot read checkpoint {str(path)!r}: {type(exc).__name__}: {exc}") from None
    needed = {"step", "stage", "partition", "params", "optimizer", "rng"}
    if not isinstance(state, dict) or not needed <= set(state):
        raise RunError(f"{str(path)!r} is not a stage file of `pipeplan run --checkpoint-dir`; resume from one")
    return state


def verify_stage(state: dict[str, Any], path: Path, *, stage: int, expected: StageExpectation) -> None:
    """Refuse a stage file that is not this stage of this step of this plan's run, whole (one RunError)."""
    redo = "resume from a checkpoint one run wrote whole, or drop --resume"
    if state["step"] != expected.step or state["stage"] != stage:
        raise RunError(
            f"{str(path)!r} holds stage {state['stage']} of step {state['step']}, not stage {stage} of step "
            f"{expected.step}: the checkpoint mixes steps or stages; {redo}"
        )
    if state.get("num_stages", expected.num_stages) != expected.num_stages or state["partition"] != expected.partition:
        raise RunError(
            f"checkpoint {str(path)!r} was written for another partition of the model (other stage cuts); resume "
            "with the plan that wrote it, or drop --resume"
        )
    if state.get("fingerprint") and expected.fingerprint and state["fingerprint"] != expected.fingerprint:
        raise RunError(f"checkpoint {str(path)!r} belongs to another model graph; use a matching --checkpoint-dir")
    _verify_tensors(state, path, stage=stage, expected=expected)
    _verify_optimizer(state, path, expected=expected)


def _verify_tensors(state: dict[str, Any], path: Path, *, stage: int, expected: StageExpectation) -> None:
    saved = state["params"]
    if set(saved) != set(expected.params):
        missing, extra = sorted(set(expected.params) - set(saved)), sorted(set(saved) - set(expected.params))
        problem = (
            f"lacks parameter {missing[0]!r}" if missing else f"has parameter {extra[0]!r} this plan's stage lacks"
        )
        raise RunError(f"checkpoint {str(path)!r} {problem} (stage {stage}); resume from an intact checkpoint")
    for name, (shape, dtype) in expected.params.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RunError(f"checkpoint {str(path)!r}: parameter {name!r} is {found}, the model's is {shape}")
        if value.dtype != dtype:
            raise RunError(
                f"checkpoint {str(path)!r} holds {name!r} in {value.dtype} but this run keeps parameters in {dtype} "
                "(the plan's --precision); resume with the precision the checkpoint was written with"
            )
    buffers = state.get("buffers", {})
    for name, value in buffers.items():
        if name not in expected.buffers or tuple(value.shape) != expected.buffers[name]:
            raise RunError(f"checkpoint {str(path)!r} has buffer {name!r} this plan's stage {stage} lacks")


def _verify_optimizer(state: dict[str, Any], path: Path, *, expected: StageExpectation) -> None:
    """Each parameter's optimizer state: the run's optimizer's keys (or none, only where the writer recorded that
    the parameter had none yet) and tensors of the parameter's shape and dtype."""
    optimizer, stateless = state["optimizer"], set(state.get("stateless", expected.params))
    for name, (shape, dtype) in expected.params.items():
        entry = optimizer.get(name)
        if not isinstance(entry, dict) or (not entry and name not in stateless):
            raise RunError(
                f"checkpoint {str(path)!r} holds no optimizer state for {name!r}, which had one when it was written; "
                "resume from an intact checkpoint"
            )
        if entry and expected.optimizer_keys is not None and set(entry) != expected.optimizer_keys:
            raise RunError(
                f"checkpoint {str(path)!r}: {name!r}'s optimizer state holds {sorted(entry)}, this run's optimizer "
                f"keeps {sorted(expected.optimizer_keys)}; resume with the optimizer that wrote it"
            )
        for key, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and (tuple(value.shape), value.dtype) != (shape, dtype)
            ):
                raise RunError(
                    f"checkpoint {str(path)!r}: {name!r}'s optimizer state {key!r} is {tuple(value.shape)} "
                    f"{value.dtype}, the parameter is {shape} {dtype}; resume from an intact checkpoint"
                )


def load_stage(root: str | os.PathLike, *, stage: int, expected: StageExpectation, params, buffers) -> dict[str, Any]:
    """Check a stage's file (`verify_stage`), copy its parameters and buffers into this rank's; returns the saved
    optimizer state of each parameter (name -> state, CPU tensors) for the optimizer to install."""
    path = stage_file(root, expected.step, stage)
    state = read_stage(path)
    verify_stage(state, path, stage=stage, expected=expected)
    with torch.no_grad():
        for name, value in state["params"].items():
            params[name].copy_(value)
        for name, value in state.get("buffers", {}).items():
            buffers[name].copy_(value)
    torch.set_rng_state(state["rng"])
    return {name: dict(state["optimizer"].get(name) or {}) for name in state["params"]}


def verify_checkpoint(root: str | os.PathLike, expectations: list[StageExpectation]) -> None:
    """Before any rank starts: the newest complete checkpoint in `root` holds each of the plan's stages whole (every
    stage file read and checked; `expectations` from `expected_stages`, one per stage)."""
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"--resume: --checkpoint-dir {str(root)!r} does not exist; drop --resume to start fresh")
    step = latest_step(root)
    if not step_dir(root, step).is_dir():
        raise RunError(f"{str(root / LATEST)!r} names step {step}, whose directory is missing; drop --resume")
    check_complete(root, step, len(expectations))
    for stage, expected in enumerate(expectations):
        path = stage_file(root, step, stage)
        verify_stage(read_stage(path), path, stage=stage, expected=dataclasses.replace(expected, step=step))
