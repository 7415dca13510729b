#!/bin/bash
set -u
# Two kiln binaries on one GGUF file, alternating, ROUNDS times (default 8): prompt speed
# (kiln bench -p 64 -n 0 -r 4 -t 2). The 2-core machine's speed moves by up to 2x within
# minutes, so only alternating runs compare; prints each binary's runs and median.
# Usage: ab_kiln.sh BASE_BINARY NEW_BINARY MODEL.gguf
[ $# -eq 3 ] || { echo "usage: $0 BASE_BINARY NEW_BINARY MODEL.gguf" >&2; exit 2; }
base=$1 new=$2 model=$3
declare -A runs=([base]="" [new]="")
for _ in $(seq "${ROUNDS:-8}"); do
  for which in base new; do
    bin=${!which}
    tps=$("$bin" bench -m "$model" -p 64 -n 0 -r 4 -t 2 2>&1 | awk -F'|' '/pp64/ {print $6}' | awk '{print $1}')
    runs[$which]+="$tps "
  done
done
for which in base new; do
  echo "$which ${!which}: ${runs[$which]}" | tr -s ' '
  echo "${runs[$which]}" | tr ' ' '\n' | grep . | sort -n | awk -v w=$which \
    '{a[NR] = $1} END {m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%s median %.1f t/s over %d runs\n", w, m, NR}'
done
