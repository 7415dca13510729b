#!/usr/bin/env bash
# Per-kernel GPU time of decode steps (eager, no graph), from Nsight Compute, summed by
# kernel: scripts/gpu/profile-decode.sh SHAPE TYPE [KILN]. Clocks and caches are left as
# they run in service (no locking, no flushing).
set -euo pipefail
shape=$1 type=$2 kiln=${3:-.gpu-bin/kiln}
csv=$(mktemp)
KILN_NO_GRAPHS=1 ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip 600 --launch-count 400 --csv \
  "$kiln" bench --synthetic "$shape" --type "$type" --device cuda -p 0 -n 8 -r 1 > "$csv" 2>/dev/null || true
python3 "$(dirname "$0")/ncu_sum.py" "$csv"
rm -f "$csv"
