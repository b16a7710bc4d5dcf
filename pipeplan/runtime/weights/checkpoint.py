"""Per-stage checkpoints: `DIR/step_00000012/stage_003.pt` holds that stage's parameters, their optimizer state, the
step and the writer's RNG state; `DIR/latest` (written last, atomically, after every stage file is in place) names
the newest complete checkpoint, so a crash while saving leaves the previous one intact. Each file is written to a
temp name and renamed; files are read with torch.load(weights_only=True). Beside the stage files, `plan.json` (the
run's effective plan) and `run.json` (the `--init-from` file the run started from, carried over by resumed runs)
let `pipeplan export-weights` rebuild the whole model's state_dict from a checkpoint alone."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeplan.errors import RunError
from pipeplan.jsonio import atomic_write, atomic_write_text
from pipeplan.plan.plan import Plan

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
        "rng": torch.get_rng_state(),
    }
    atomic_write(stage_file(root, step, stage), lambda tmp: torch.save(state, tmp))


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


def load_stage(
    root: str | os.PathLike,
    *,
    step: int,
    stage: int,
    params: dict[str, nn.Parameter],
    buffers: dict[str, torch.Tensor],
    fingerprint: str,
    partition: str,
) -> dict[str, dict[str, Any]]:
    """Copy a stage's saved parameters and buffers into this rank's (same names, same shapes); returns the saved
    optimizer state of each parameter (name -> state, CPU tensors) for the optimizer to install."""
    path = stage_file(root, step, stage)
    if not path.is_file():
        raise RunError(f"checkpoint file {str(path)!r} is missing; resume from an intact checkpoint directory")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise RunError(f"cannot read checkpoint {str(path)!r}: {type(exc).__name__}: {exc}") from None
    if state.get("fingerprint") and fingerprint and state["fingerprint"] != fingerprint:
        raise RunError(f"checkpoint {str(path)!r} belongs to another model graph; use a matching --checkpoint-dir")
    if state.get("partition") != partition:
        raise RunError(
            f"checkpoint {str(path)!r} was written for another partition of the model (other stage cuts); resume "
            "with the plan that wrote it, or drop --resume"
        )
    with torch.no_grad():
        for name, value in state["params"].items():
            if name not in params or params[name].shape != value.shape:
                raise RunError(f"checkpoint {str(path)!r} has parameter {name!r} this plan's stage {stage} lacks")
            params[name].copy_(value)
        for name, value in state.get("buffers", {}).items():
            if name not in buffers or buffers[name].shape != value.shape:
                raise RunError(f"checkpoint {str(path)!r} has buffer {name!r} this plan's stage {stage} lacks")
            buffers[name].copy_(value)
    torch.set_rng_state(state["rng"])
    return {name: dict(state["optimizer"].get(name) or {}) for name in state["params"]}
