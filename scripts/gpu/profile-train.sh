#!/usr/bin/env bash
# Per-kernel GPU time of training (about one 1024-token sequence of issue 18's 134M shape,
# forward and backward, after a first step), from Nsight Compute, summed by kernel:
#   [PRECISION=bf16] [BATCH=16] scripts/gpu/profile-train.sh [KILN]. Clocks and caches as in service.
set -euo pipefail
kiln=${1:-.gpu-bin/kiln}
csv=$(mktemp)
ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip "${SKIP:-3000}" --launch-count "${COUNT:-2500}" --csv \
  "$kiln" bench --train llama-134m -b "${BATCH:-1}" --seq-len 1024 -r 2 --device cuda ${PRECISION:+--precision "$PRECISION"} > "$csv" 2>/dev/null || true
python3 "$(dirname "$0")/ncu_sum.py" "$csv"
rm -f "$csv"
