#!/usr/bin/env bash
# pipeplan launch script for: synthetic on 2 device(s) (1 node(s) x 2), schedule zbv, 4 stage(s) x 1 pipeline(s), 8 microbatch(es) of 1
# One node:    bash launch.sh [--steps N] [--trace FILE] [--checkpoint-dir DIR] [--resume]
# 1 node(s): on every node run
#   NNODES=1 NODE_RANK=<0..0> MASTER_ADDR=<host of node 0> MASTER_PORT=29500 bash launch.sh [...]
# Arguments after the script name go to `python -m pipeplan.runtime.worker`.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
NPROC_PER_NODE=2
WORLD_SIZE=2
if [ $((NNODES * NPROC_PER_NODE)) -ne "$WORLD_SIZE" ]; then
  echo "launch.sh: this plan needs $WORLD_SIZE ranks = 1 node(s) x $NPROC_PER_NODE; set NNODES=1" >&2
  exit 1
fi
exec torchrun \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m pipeplan.runtime.worker "$HERE/plan.json" "$@"
