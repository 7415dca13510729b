#!/usr/bin/env bash
# kiln bench for every row of the GPU table in ../shared/anchors.md, on the GPU machine:
#   scripts/gpu/bench-h200.sh [KILN] [REPS] > results.md
# KILN defaults to .gpu-bin/kiln (see scripts/gpu/pack.sh).
set -uo pipefail
kiln=${1:-.gpu-bin/kiln}
reps=${2:-3}
for row in "tinyllama-1.1b f16" "tinyllama-1.1b q8_0" "tinyllama-1.1b q4_0" "tinyllama-1.1b q4_k_m" \
           "llama3-8b f16" "llama3-8b q8_0" "llama3-8b q4_k_m"; do
  set -- $row
  "$kiln" bench --synthetic "$1" --type "$2" --device cuda -p 512 -n 128 -r "$reps" -o md 2>&1 \
    | grep -v '^| model' | grep -v '^|---'
done
