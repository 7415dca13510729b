#!/usr/bin/env bash
# Per-kernel GPU time of training issue 18's 134M shape (by default a little more than one
# step of 16 sequences of 1024 tokens, after the first), from Nsight Compute, summed by
# kernel and grid:
#   [PRECISION=bf16] [BATCH=16] [SKIP=5000 COUNT=4000] scripts/gpu/profile-train.sh [KILN].
# Clocks and caches as in service.
set -euo pipefail
kiln=${1:-.gpu-bin/kiln}
csv=$(mktemp)
ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip "${SKIP:-5000}" --launch-count "${COUNT:-4000}" --csv \
  "$kiln" bench --train llama-134m -b "${BATCH:-16}" --seq-len 1024 -r 2 --device cuda ${PRECISION:+--precision "$PRECISION"} > "$csv" 2>/dev/null || true
python3 "$(dirname "$0")/ncu_sum.py" "$csv" 40
rm -f "$csv"
