#!/usr/bin/env bash
# Per-kernel GPU time of one 512-token prompt, from Nsight Compute, summed by kernel:
#   scripts/gpu/profile-prefill.sh SHAPE TYPE [KILN]. Clocks and caches as in service.
set -euo pipefail
shape=$1 type=$2 kiln=${3:-.gpu-bin/kiln}
csv=$(mktemp)
ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip 420 --launch-count 420 --csv \
  "$kiln" bench --synthetic "$shape" --type "$type" --device cuda -p 512 -n 0 -r 1 > "$csv" 2>/dev/null || true
python3 "$(dirname "$0")/ncu_sum.py" "$csv"
