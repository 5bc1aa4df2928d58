#!/usr/bin/env bash
# Random-weight fp16 timing traces on a GPU machine with no network.
#
# Timing depends on model shapes, dtype and hardware, not on the weights' values, so this
# records, for each pair's real shapes built with seeded random weights (rakv.shapes), the
# ops table only (prefill, decode, verify, ... timings) into traces/gpu-<pair>. Acceptance
# for the same pair comes from another trace recorded with the real weights (on a CPU).
#
# Usage: scripts/gpu_record.sh [PAIR ...]     (default: gpt2 gpt2-medium gpt2-large qwen-coder smollm2)
# Env:   BUDGET_S (total seconds, default 460), PYTHON (default python), DEVICE (default cuda)
# Each pair runs under `timeout`; a pair that would not fit in what is left of the budget
# is skipped. A rerun continues interrupted recordings (--resume). Exits 1 if any pair
# failed, timed out or was skipped.
set -euo pipefail

cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-460}  # + up to 10 s kill grace: under 8 minutes
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
MIN_PAIR_S=45  # do not start a pair with less than this left
START=$(date +%s)

# pair -> its own cap in seconds (smollm2 last: only if time allows)
declare -A CAP=([gpt2]=75 [gpt2-medium]=90 [gpt2-large]=100 [qwen-coder]=150 [smollm2]=90)
if [ "$#" -gt 0 ]; then PAIRS=("$@"); else PAIRS=(gpt2 gpt2-medium gpt2-large qwen-coder smollm2); fi

echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
else
    echo "nvidia-smi not found"
fi
"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "| transformers", transformers.__version__)'

declare -a SUMMARY=()
status=0
for pair in "${PAIRS[@]}"; do
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    cap=${CAP[$pair]:-120}
    limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt "$MIN_PAIR_S" ]; then
        SUMMARY+=("$pair: skipped (${left}s of budget left)")
        status=1
        continue
    fi
    out="traces/gpu-$pair"
    resume=()
    if [ -e "$out" ]; then resume=(--resume); fi
    echo "== $pair -> $out (limit ${limit}s)"
    t0=$(date +%s.%N)
    rc=0
    timeout -k 10 "$limit" "$PYTHON" -m profiler.record --random-weights --device "$DEVICE" \
        --dtype float16 --pair "$pair" --out "$out" ${resume[@]+"${resume[@]}"} || rc=$?
    wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    case $rc in
        0) what="ok" ;;
        124|137) what="TIMED OUT (rerun to resume)"; status=1 ;;
        *) what="FAILED rc=$rc"; status=1 ;;
    esac
    echo "== $pair: $what in ${wall}s"
    SUMMARY+=("$pair: $what, ${wall}s")
done

echo "== summary (total $(( $(date +%s) - START ))s of ${BUDGET_S}s)"
printf '  %s\n' "${SUMMARY[@]}"
exit "$status"
