"""The files `pipeplan plan` writes next to plan.json: `launch.sh` (torchrun, one node or several through NNODES /
NODE_RANK / MASTER_ADDR / MASTER_PORT), `job.sbatch` (SLURM, one torchrun per node) and `timeline.json` (Chrome
trace of the predicted step). The scripts are pure text functions of the Plan, so golden-file tests pin them."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.profile_ref import ProfileRef
from pipeplan.jsonio import atomic_write_text, write_json
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.ops import Op
from pipeplan.schedules.render import timeline_to_chrome_trace

PLAN_FILE = "plan.json"
LAUNCH_FILE = "launch.sh"
SBATCH_FILE = "job.sbatch"
TIMELINE_FILE = "timeline.json"
PROFILE_FILE = "profile.json"  # the profile the plan was made from (`refine` scales it to a run's measured ops)
PLAN_DIR_FILES = (PLAN_FILE, LAUNCH_FILE, SBATCH_FILE, TIMELINE_FILE, PROFILE_FILE)  # what `plan -o DIR` writes
WORKER = "pipeplan.runtime.launch.worker"


def describe(plan: Plan) -> str:
    """One line naming the plan: model, devices, schedule, layout."""
    options = " ".join(f"{k}={v}" for k, v in sorted(plan.model.options.items()))
    model = f"{plan.model.ref}" + (f" ({options})" if options else "")
    counts = [stage.replicas for stage in plan.stages]
    replicas = f" (replicas {','.join(map(str, counts))})" if max(counts) > 1 else ""
    t, cp = plan.training.tensor_parallel, plan.training.context_parallel
    devices = plan.world_size * t * cp  # each rank of the plan is a group of t x cp devices
    tensor = f", tensor parallel t={t} (each stage device a group of {t})" if t > 1 else ""
    tensor += f", context parallel cp={cp} (each stage device's sequence over {cp} ranks)" if cp > 1 else ""
    ep = plan.training.expert_parallel
    tensor += f", expert parallel ep={ep} (routed experts split over {ep} pipelines' ranks)" if ep > 1 else ""
    return (
        f"{model} on {devices} device(s) ({plan.cluster.num_nodes} node(s) x "
        f"{min(devices, plan.cluster.devices_per_node)}), schedule {plan.schedule}, {len(plan.stages)} "
        f"stage(s){replicas} x {plan.training.data_parallel} pipeline(s), {plan.training.num_microbatches} "
        f"microbatch(es) of {plan.training.microbatch_size}{tensor}"
    ).replace("\n", " ")


def ranks_per_node(plan: Plan) -> int:
    return min(plan.world_size, plan.cluster.devices_per_node)


def _python_line(python: str | None) -> str:
    """The interpreter pipeplan planned with (its torch and pipeplan), unless PIPEPLAN_PYTHON names another."""
    return f'PYTHON="${{PIPEPLAN_PYTHON:-{shlex.quote(python or sys.executable)}}}"'


def launch_script(plan: Plan, *, python: str | None = None) -> str:
    per_node = ranks_per_node(plan)
    nodes = plan.cluster.num_nodes
    return f"""#!/usr/bin/env bash
# pipeplan launch script for: {describe(plan)}
# One node:    bash launch.sh [--steps N] [--trace FILE] [--init-from WEIGHTS] [--checkpoint-dir DIR] [--resume]
# (from any directory: the plan and its model file are found by absolute path)
# {nodes} node(s): on every node run
#   NNODES={nodes} NODE_RANK=<0..{nodes - 1}> MASTER_ADDR=<host of node 0> MASTER_PORT=29500 bash launch.sh [...]
# Arguments after the script name go to `python -m {WORKER}`, started by torch's launcher (torchrun) under the
# interpreter pipeplan planned with (PIPEPLAN_PYTHON=... to choose another). On one node a free port is picked
# unless MASTER_PORT is set, so several runs can start side by side.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
{_python_line(python)}
NNODES="${{NNODES:-1}}"
NODE_RANK="${{NODE_RANK:-0}}"
MASTER_ADDR="${{MASTER_ADDR:-127.0.0.1}}"
if [ -z "${{MASTER_PORT:-}}" ]; then
  if [ "$NNODES" -eq 1 ]; then
    MASTER_PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
  else
    MASTER_PORT=29500
  fi
fi
NPROC_PER_NODE={per_node}
WORLD_SIZE={plan.world_size}
if [ $((NNODES * NPROC_PER_NODE)) -ne "$WORLD_SIZE" ]; then
  echo "launch.sh: this plan needs $WORLD_SIZE ranks = {nodes} node(s) x $NPROC_PER_NODE; set NNODES={nodes}" >&2
  exit 1
fi
exec "$PYTHON" -m torch.distributed.run \\
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \\
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \\
  -m {WORKER} "$HERE/{PLAN_FILE}" "$@"
"""


def sbatch_script(plan: Plan, *, python: str | None = None) -> str:
    per_node = ranks_per_node(plan)
    nodes = plan.cluster.num_nodes
    if plan.cluster.hardware == "cpu":
        resources = f"#SBATCH --cpus-per-task={per_node}"
    else:
        resources = f"#SBATCH --gpus-per-node={per_node}"
    job_name = shlex.quote(f"pipeplan-{Path(plan.model.ref.split(':')[0]).stem}")
    return f"""#!/bin/bash
# pipeplan SLURM job for: {describe(plan)}
# Submit from any directory: sbatch <plan dir>/job.sbatch [--steps N] [--trace FILE] [--init-from WEIGHTS]
# Arguments go to `python -m {WORKER}`; one torchrun (`python -m torch.distributed.run` under the interpreter
# pipeplan planned with, or PIPEPLAN_PYTHON) per node starts {per_node} rank(s) each. The plan is the
# plan.json beside this script as submitted (SLURM runs a copy; scontrol names the original), or $PLAN.
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{resources}
#SBATCH --output=pipeplan-%j.out
set -euo pipefail
{_python_line(python)}
if [ -z "${{PLAN:-}}" ]; then
  SUBMITTED="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\\([^ ]*\\).*/\\1/p' | head -n 1)"
  PLAN="$(dirname "${{SUBMITTED:-${{SLURM_SUBMIT_DIR:-$PWD}}/x}}")/{PLAN_FILE}"
fi
if [ ! -f "$PLAN" ]; then
  echo "job.sbatch: no plan at $PLAN; set PLAN=/path/to/{PLAN_FILE}" >&2
  exit 1
fi
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR="${{NODES[0]}}"
MASTER_PORT="${{MASTER_PORT:-29500}}"
srun "$PYTHON" -m torch.distributed.run \\
  --nnodes="$SLURM_NNODES" --nproc-per-node={per_node} \\
  --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \\
  -m {WORKER} "$PLAN" "$@"
"""


def with_profile(plan: Plan, profile: Profile) -> Plan:
    """`plan` recording the profile it was made from (`Plan.profile`: its fingerprint, source and threads)."""
    prov = profile.provenance
    ref = ProfileRef(
        fingerprint=profile.fingerprint, source=prov.source, threads=prov.threads, refined_from=prov.refined_from
    )
    return replace(plan, profile=ref)


def write_plan_dir(
    plan: Plan,
    timeline_rows: Iterable[tuple[int, str, float, float]],
    directory: str | Path,
    profile: Profile | None = None,
) -> Path:
    """Write plan.json, launch.sh, job.sbatch, timeline.json and, when given, the profile the plan was made from
    (profile.json, which must be the one `plan.profile` names) into `directory` (each atomically); return it."""
    target = Path(directory)
    if profile is not None:
        assert plan.profile is not None and plan.profile.fingerprint == profile.fingerprint, "another profile"
        profile.save(target / PROFILE_FILE)
    plan.save(target / PLAN_FILE)
    for name, text in ((LAUNCH_FILE, launch_script(plan)), (SBATCH_FILE, sbatch_script(plan))):
        atomic_write_text(target / name, text)
        os.chmod(target / name, 0o755)
    write_json(target / TIMELINE_FILE, steps_trace(timeline_rows, plan.training.num_microbatches))
    return target


def steps_trace(rows: Iterable[tuple[int, str, float, float]], num_microbatches: int) -> dict:
    """The Chrome trace of predicted steps (`plan.timing.plan_steps_timeline`: step k's microbatches numbered from
    k x m) in `run --trace`'s form: each op named as in its step's op list, its step in args."""
    trace = timeline_to_chrome_trace(rows)
    for event in trace["traceEvents"]:
        if event["ph"] != "X":
            continue
        args, op = event.setdefault("args", {}), Op.parse(event["name"])
        step = op.parts[0].microbatch // num_microbatches  # (an overlapped F&B op: both halves in one step)
        args["step"] = step
        if "microbatch" in args:
            args["microbatch"] -= step * num_microbatches
        event["name"] = str(op.shifted(-step * num_microbatches))
    return trace
