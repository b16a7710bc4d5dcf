#!/usr/bin/env bash
# pipeplan launch script for: examples/my_model.py:build (layers=8) on 2 device(s) (1 node(s) x 2), schedule 1f1b, 2 stage(s) x 1 pipeline(s), 32 microbatch(es) of 1
# One node:    bash launch.sh [--steps N] [--trace FILE] [--init-from WEIGHTS] [--checkpoint-dir DIR] [--resume]
# (from any directory: the plan and its model file are found by absolute path)
# 1 node(s): on every node run
#   NNODES=1 NODE_RANK=<0..0> MASTER_ADDR=<host of node 0> MASTER_PORT=29500 bash launch.sh [...]
# Arguments after the script name go to `python -m pipeplan.runtime.launch.worker`, started by torch's launcher (torchrun) under the
# interpreter pipeplan planned with (PIPEPLAN_PYTHON=... to choose another). On one node a free port is picked
# unless MASTER_PORT is set, so several runs can start side by side.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PIPEPLAN_PYTHON:-/opt/venv/bin/python}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
if [ -z "${MASTER_PORT:-}" ]; then
  if [ "$NNODES" -eq 1 ]; then
    MASTER_PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
  else
    MASTER_PORT=29500
  fi
fi
NPROC_PER_NODE=2
WORLD_SIZE=2
if [ $((NNODES * NPROC_PER_NODE)) -ne "$WORLD_SIZE" ]; then
  echo "launch.sh: this plan needs $WORLD_SIZE ranks = 1 node(s) x $NPROC_PER_NODE; set NNODES=1" >&2
  exit 1
fi
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m pipeplan.runtime.launch.worker "$HERE/plan.json" "$@"
