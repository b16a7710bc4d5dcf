#!/usr/bin/env bash
# pipeplan's prepared GPU check: one command, `OUT=dir bash benchmarks/gpu_check.sh`, for the next machine that has
# a GPU (one H100 or H200, torch a CUDA build, nothing to download). Every step is time-boxed inside one budget
# (GPU_CHECK_BUDGET_S, default 470 s with CUDA: under 8 minutes), so one hang cannot eat it, and goes through the CLI
# where a user would:
#   setup           Python, torch, CUDA, the GPUs, the packages; pipeplan runs from this checkout (PYTHONPATH),
#                   nothing is installed; a missing optional package (transformers) skips the steps needing it
#   profile-gpt     pipeplan profile gpt (hidden 2048, 8 layers, seq 2048) --device cuda --precision bf16-mixed
#   profile-llama   the same for hf:llama scaled to hidden 2048 (8 layers, 16 heads, 4 key/value heads)
#   run-gpt         pipeplan plan --profile (1 GPU), then pipeplan run --trace --log: measured vs predicted
#   run-llama       the same for the llama
#   calibrate       pipeplan calibrate --device cuda --dtype bf16
#   analytic        pipeplan profile --device meta for the datasheet preset of this GPU, then the calibrate file
#   split-backward  benchmarks/bench_split_backward.py: (I+W)/B at widths 1024/2048/4096, host time per op
#   tests-gpu       pytest -m gpu: the GPU-marked tests
#   tests-suite     pytest -m "not slow and not gpu" with CUDA visible (what is left of the budget)
# Without CUDA (or with GPU_CHECK_DEVICE=cpu) it is a dry run: the same steps on the CPU at small sizes, the GPU
# tests skip themselves and tests-suite says "skipped: no CUDA" (`make test` runs it). Either way it writes
# $OUT/summary.txt, $OUT/gpu_check.json, $OUT/logs.txt and $OUT/artifacts.tar.gz; docs/profiling.md says how to
# read them. Knobs: PYTHON (default .venv/bin/python if there, else python3), GPU_CHECK_DEVICE (auto, cuda, cpu),
# GPU_CHECK_SIZE (full, small; default full on CUDA, small on the CPU), GPU_CHECK_BUDGET_S, GPU_CHECK_WORK (a
# scratch folder; default a new temporary one).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${OUT:?set OUT to the folder the results go to, e.g. OUT=gpu-out bash benchmarks/gpu_check.sh}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="${GPU_CHECK_WORK:-$(mktemp -d)}"
mkdir -p "$WORK/logs"
WORK="$(cd "$WORK" && pwd)"
: >"$WORK/status.tsv"
RESERVE=20  # seconds kept for the summary
START=$(date +%s)
cd "$ROOT" || exit 1

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY="$ROOT/.venv/bin/python"
else
    PY=python3
fi
export PY WORK ROOT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's pipeplan, installed or not
export PYTHONUNBUFFERED=1
export PP="$PY -m pipeplan"
export HELPER="$ROOT/benchmarks/gpu_check.py"

case "${GPU_CHECK_DEVICE:-auto}" in
    cpu) CUDA=0 && export CUDA_VISIBLE_DEVICES="" ;;  # a dry run where a GPU is visible too: its tests skip
    cuda) CUDA=1 ;;
    *) "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && CUDA=1 || CUDA=0 ;;
esac
SIZE="${GPU_CHECK_SIZE:-$([ "$CUDA" = 1 ] && echo full || echo small)}"
# the budget protects a lent GPU's minutes; a dry run on a shared CPU gets 900 s and time boxes 3x as long
BUDGET="${GPU_CHECK_BUDGET_S:-$([ "$CUDA" = 1 ] && echo 470 || echo 900)}"
SCALE=$([ "$CUDA" = 1 ] && echo 1 || echo 3)
if [ "$CUDA" = 1 ]; then
    export DEV=cuda MODE=cuda PROFILE_OPTS="" RUN_OPTS="" CAL_OPTS="--dtype bf16" SPLIT_OPTS=""
else
    export DEV=cpu MODE=cpu-dry-run PROFILE_OPTS="--threads 1 --warmup 0 --repeats 1" RUN_OPTS="--threads 1"
    export CAL_OPTS="--quick" SPLIT_OPTS="--widths 32,64 --rounds 3 --warmup 1"
fi
if [ "$SIZE" = full ]; then
    export GPT_ARGS="-a layers=8 -a hidden=2048 -a heads=16 -a seq=2048 -a vocab=32000"
    export LLAMA_ARGS="-a hidden_size=2048 -a intermediate_size=5632 -a num_attention_heads=16 \
-a num_key_value_heads=4 -a num_hidden_layers=8 -a vocab_size=32000 -a max_position_embeddings=2048 -a seq_len=2048"
    export BATCH=2 GLOBAL_BATCH=8 STEPS=10
else
    export GPT_ARGS="-a layers=1 -a hidden=64 -a heads=4 -a seq=32 -a vocab=256"
    export LLAMA_ARGS="-a hidden_size=64 -a intermediate_size=128 -a num_attention_heads=4 -a num_key_value_heads=2 \
-a num_hidden_layers=1 -a vocab_size=256 -a seq_len=32"
    export BATCH=2 GLOBAL_BATCH=4 STEPS=3
fi
export PRESET=h100 HAS_TRANSFORMERS=0

record() {  # name status rc seconds note
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$WORK/status.tsv"
    printf '%-15s %-10s %4ss %s\n' "$1" "$2${3:+ (rc $3)}" "$4" "$5"
}

# step NAME CAP COMMAND...: run COMMAND for at most CAP seconds (and never past the budget), its output in
# $WORK/logs/NAME.log; at the time box it gets SIGINT (pipeplan's ranks and pytest stop cleanly), 20 s later SIGKILL
step() {
    local name=$1 cap=$2 left limit began rc status note
    shift 2
    left=$((START + BUDGET - RESERVE - $(date +%s)))
    if [ "$left" -lt 15 ]; then
        record "$name" skipped "" 0 "skipped: out of time (budget ${BUDGET} s)"
        return 0
    fi
    cap=$((cap * SCALE))
    limit=$((cap < left ? cap : left))
    began=$(date +%s)
    timeout --signal=INT --kill-after=20 "$limit" "$@" >"$WORK/logs/$name.log" 2>&1 </dev/null
    rc=$?
    note=""
    case "$rc" in
        0) status=ok ;;
        124 | 137) status=timed_out note="time box ${limit} s" ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$rc" "$(($(date +%s) - began))" "$note"
}

skip() {  # name reason
    record "$1" skipped "" 0 "skipped: $2"
}

model_of() {  # key -> model reference and its options
    if [ "$1" = gpt ]; then echo "gpt $GPT_ARGS"; else echo "hf:llama $LLAMA_ARGS"; fi
}

profile_measured() {  # key: a measured bf16-mixed profile
    # shellcheck disable=SC2046
    $PP profile $(model_of "$1") -b "$BATCH" --device "$DEV" --precision bf16-mixed $PROFILE_OPTS \
        -o "$WORK/$1-measured.json"
}

plan_and_run() {  # key: a 1-device plan from the measured profile, then a traced, logged run of it (one interpreter)
    # shellcheck disable=SC2046
    "$PY" "$HELPER" cli plan $(model_of "$1") --profile "$WORK/$1-measured.json" --devices 1 -B "$GLOBAL_BATCH" \
        -o "$WORK/plan-$1" :: run "$WORK/plan-$1/plan.json" --steps "$STEPS" --trace "$WORK/trace-$1.json" \
        --log "$WORK/log-$1.jsonl" $RUN_OPTS
}

analytic() {  # the analytic profiles of the models: the datasheet preset, then the calibrated entry (one interpreter)
    local key commands=()
    for key in gpt llama; do
        [ "$key" = llama ] && [ "$HAS_TRANSFORMERS" = 0 ] && continue
        # shellcheck disable=SC2207
        commands+=(:: profile $(model_of "$key") -b "$BATCH" --device meta --hardware "$PRESET" --precision bf16-mixed
            -o "$WORK/$key-analytic.json")
        if [ -f "$WORK/hw.json" ]; then
            # shellcheck disable=SC2207
            commands+=(:: profile $(model_of "$key") -b "$BATCH" --device meta --hardware calibrated
                --hardware-file "$WORK/hw.json" --precision bf16-mixed -o "$WORK/$key-analytic-calibrated.json")
        fi
    done
    "$PY" "$HELPER" cli --keep-going "${commands[@]:1}"
}

gpu_tests() {  # the files holding @pytest.mark.gpu tests, -m gpu
    # shellcheck disable=SC2046
    "$PY" -m pytest $(grep -rl --include='test_*.py' 'mark.gpu' tests | sort) -m gpu -rfEs -p no:cacheprovider \
        --junitxml="$WORK/tests-gpu.xml"
}

suite_tests() {  # everything but the slow and GPU-marked tests, over 8 workers where pytest-xdist is there (one
    # file per worker at a time), then the failed ones again in one process: a failure both times is not the workers'
    local workers="" rc
    "$PY" -c 'import xdist' 2>/dev/null && workers="-n 8 --dist loadfile"
    # shellcheck disable=SC2086
    "$PY" -m pytest -m "not slow and not gpu" $workers -rfE -o cache_dir="$WORK/pytest-cache" \
        --junitxml="$WORK/tests-suite.xml"
    rc=$?
    if [ "$rc" -eq 1 ] && [ -n "$workers" ]; then
        echo "--- rerun: the failed tests again, in one process"
        "$PY" -m pytest -m "not slow and not gpu" --last-failed -rfE -o cache_dir="$WORK/pytest-cache" \
            --junitxml="$WORK/tests-suite-rerun.xml"
    fi
    return "$rc"
}

export -f profile_measured plan_and_run analytic gpu_tests suite_tests model_of

command -v timeout >/dev/null || { echo "gpu_check.sh needs coreutils' timeout"; exit 1; }
echo "pipeplan GPU check: mode $MODE, sizes $SIZE, python $PY, budget ${BUDGET} s, work $WORK"
step setup 60 "$PY" "$HELPER" setup --work "$WORK"
if ! grep -q '^setup	ok' "$WORK/status.tsv"; then
    echo "setup failed: $(tail -n 3 "$WORK/logs/setup.log")"
fi
PRESET="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["preset"])' "$WORK/setup.json" 2>/dev/null)"
PRESET="${PRESET:-h100}"  # the datasheet preset of this GPU (h200 on an H200), for the analytic profiles
"$PY" -c 'import transformers' 2>/dev/null && HAS_TRANSFORMERS=1
export PRESET HAS_TRANSFORMERS

step profile-gpt 100 bash -c 'profile_measured gpt'
if [ "$HAS_TRANSFORMERS" = 1 ]; then
    step profile-llama 120 bash -c 'profile_measured llama'
else
    skip profile-llama "transformers missing"
fi
for key in gpt llama; do
    if [ -f "$WORK/$key-measured.json" ]; then
        step "run-$key" 100 bash -c "plan_and_run $key"
    else
        skip "run-$key" "no measured profile of $key"
    fi
done
step calibrate 60 bash -c "\$PP calibrate --device $DEV -o \"\$WORK/hw.json\" --name calibrated $CAL_OPTS"
step analytic 90 bash -c analytic
step split-backward 60 bash -c "\"\$PY\" benchmarks/bench_split_backward.py --device $DEV \
    --out \"\$WORK/split_backward.json\" $SPLIT_OPTS"
step tests-gpu 150 bash -c gpu_tests
if [ "$CUDA" = 1 ]; then
    step tests-suite 300 bash -c suite_tests
else
    skip tests-suite "no CUDA (make test runs the suite)"
fi

"$PY" "$HELPER" summary --work "$WORK" --out "$OUT" --mode "$MODE" --wall "$(($(date +%s) - START))" --budget "$BUDGET"
