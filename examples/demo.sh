#!/usr/bin/env bash
# pipeplan demo (`make demo`): profile the default gpt on this CPU, plan it for 2 processes with a memory limit
# that one process cannot meet (so the planner must pipeline), show the plan, and run it for a few steps,
# printing the measured step time next to the prediction. Everything goes to demo-out/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIPEPLAN="${PIPEPLAN:-.venv/bin/pipeplan}"
[ -x "$PIPEPLAN" ] || PIPEPLAN=pipeplan
OUT=demo-out
STEPS="${STEPS:-5}"
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1. profile gpt (one thread, as each of the 2 ranks will run) =="
"$PIPEPLAN" profile gpt --threads 1 -o "$OUT/gpt-profile.json"

echo
echo "== 2. plan gpt for 2 CPU processes of 12 MiB each (the whole model needs more), fp32 AdamW as run trains =="
"$PIPEPLAN" plan gpt --profile "$OUT/gpt-profile.json" --devices 2 --memory-per-device 12MiB \
  --global-batch-size 8 --optimizer adamw-fp32 -o "$OUT"

echo
echo "== 3. show the saved plan again =="
"$PIPEPLAN" show "$OUT/plan.json"

echo
echo "== 4. export the per-rank op lists as torch.distributed.pipelining's CSV schedule =="
"$PIPEPLAN" export "$OUT/plan.json" --format torch-csv -o "$OUT/schedule.csv"
cat "$OUT/schedule.csv"

echo
echo "== 5. run it: $STEPS steps on 2 gloo processes, measured vs predicted =="
"$PIPEPLAN" run "$OUT/plan.json" --steps "$STEPS" --threads 1 --trace "$OUT/measured.json"
