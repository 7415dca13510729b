#!/usr/bin/env bash
# One kernel's Nsight Compute sections (throughput, occupancy, launch, warp stalls) in a
# kiln run, recorded steps off so that each launch is profiled on its own:
#   scripts/gpu/ncu-kernel.sh REGEX KILN_ARGS...
# e.g. scripts/gpu/ncu-kernel.sh attention_decode .gpu-bin/kiln bench --synthetic llama3-8b
#      --type f16 --device cuda -p 0 -n 16 -b 64 -d 448 -r 1
set -euo pipefail
regex=$1
shift
KILN_NO_GRAPHS=1 ncu --kernel-name "regex:$regex" --launch-skip 64 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis "$@" 2>&1 \
  | grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles|Issued|Dynamic Shared|Grid Size|Block Size|Bandwidth|Hit Rate|One or More|No Eligible" \
  | grep -v "^ *----"
