#!/usr/bin/env bash
# pipeplan demo (`make demo`): profile a small gpt (hidden 256, sequence 128, 4 blocks: ops of several ms, so that
# compute, not per-message latency, sets the step time) on this CPU, plan it as a 2-device pipeline for 2
# processes, show the plan, and run it for a few steps, printing the measured step time next to the prediction.
# Everything goes to demo-out/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIPEPLAN="${PIPEPLAN:-.venv/bin/pipeplan}"
[ -x "$PIPEPLAN" ] || PIPEPLAN=pipeplan
OUT=demo-out
STEPS="${STEPS:-6}"
MODEL=(gpt -a hidden=256 -a seq=128 -a layers=4)
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1. profile ${MODEL[*]} at microbatch size 2 (one thread, as each of the 2 ranks will run) =="
"$PIPEPLAN" profile "${MODEL[@]}" --batch-size 2 --threads 1 -o "$OUT/gpt-profile.json"

echo
echo "== 2. plan it as one pipeline over 2 CPU processes (no replicated stages), global batch 16, fp32 AdamW =="
"$PIPEPLAN" plan "${MODEL[@]}" --profile "$OUT/gpt-profile.json" --devices 2 --parallel pp=2,replicate=off \
  --global-batch-size 16 --precision fp32,adamw -o "$OUT"

echo
echo "== 3. show the saved plan again =="
"$PIPEPLAN" show "$OUT/plan.json"

echo
echo "== 4. export the per-rank op lists as torch.distributed.pipelining's CSV schedule =="
"$PIPEPLAN" export "$OUT/plan.json" --format torch-csv -o "$OUT/schedule.csv"
cat "$OUT/schedule.csv"

echo
echo "== 5. run it: $STEPS steps on 2 gloo processes (one thread each), measured vs predicted =="
"$PIPEPLAN" run "$OUT/plan.json" --steps "$STEPS" --threads 1 --trace "$OUT/measured.json"
