#!/usr/bin/env bash
# Per-kernel GPU time of decode steps (eager, no graph), from Nsight Compute, summed by
# kernel: [BATCH=1] [DEPTH=0] [SKIP=600 COUNT=400] scripts/gpu/profile-decode.sh SHAPE TYPE [KILN].
# BATCH sequences decode together (a server's step), DEPTH positions into the cache.
# Clocks and caches are left as they run in service (no locking, no flushing).
set -euo pipefail
shape=$1 type=$2 kiln=${3:-.gpu-bin/kiln}
csv=$(mktemp)
KILN_NO_GRAPHS=1 ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip "${SKIP:-600}" --launch-count "${COUNT:-400}" --csv \
  "$kiln" bench --synthetic "$shape" --type "$type" --device cuda -p 0 -n 8 -r 1 \
  -b "${BATCH:-1}" -d "${DEPTH:-0}" > "$csv" 2>/dev/null || true
python3 "$(dirname "$0")/ncu_sum.py" "$csv" "${TOP:-40}"
rm -f "$csv"
