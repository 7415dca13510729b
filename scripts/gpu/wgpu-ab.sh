#!/usr/bin/env bash
# Two kiln builds through Vulkan (kiln-wgpu) on the GPU machine, in turn, row by row, so
# that a change is measured beside the build before it in one call (BENCHMARKS.md,
# issue 16):
#   scripts/gpu/wgpu-ab.sh BEFORE AFTER [ROUNDS] [BENCH ARGS...]
# e.g. scripts/gpu/wgpu-ab.sh .gpu-bin/kiln-base .gpu-bin/kiln 2 -p 0 -n 64 -r 2
# The Vulkan loader is unpacked first from the .deb files in $DEBS (default .gpu-bin: copy
# ../shared/gpu/gl/*.deb there; ../shared/gpu/README.md says why). ROWS overrides the rows
# ("model type" pairs separated by commas); CUDA=1 adds the AFTER build on CUDA once a row.
set -uo pipefail
before=$1
after=$2
rounds=${3:-2}
shift $(($# < 3 ? $# : 3))
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-p 0 -n 64 -r 2)
debs=${DEBS:-.gpu-bin}
for f in "$debs"/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig >/dev/null 2>&1
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
IFS=, read -r -a rows <<<"${ROWS:-tinyllama-1.1b q4_k_m,llama3-8b f16}"
for row in "${rows[@]}"; do
  read -r model type <<<"$row"
  for ((round = 1; round <= rounds; round++)); do
    for build in "$before" "$after"; do
      printf '%s round %d: ' "$build" "$round"
      "$build" bench --synthetic "$model" --type "$type" --device wgpu "${args[@]}" 2>&1 \
        | grep -E '\| (pp|tg)[0-9]' | awk -F'|' '{printf "%s %s %s %s; ", $2, $3, $6, $7} END {print ""}'
    done
  done
  if [ "${CUDA:-0}" = 1 ]; then
    printf '%s on CUDA: ' "$after"
    "$after" bench --synthetic "$model" --type "$type" --device cuda "${args[@]}" 2>&1 \
      | grep -E '\| (pp|tg)[0-9]' | awk -F'|' '{printf "%s %s %s %s; ", $2, $3, $6, $7} END {print ""}'
  fi
done
