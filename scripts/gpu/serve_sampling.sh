#!/usr/bin/env bash
# What drawing tokens costs a server: kiln serve (the embedded default model, CUDA) under
# kiln bench-serve at temperature 0 (greedy: argmax on the device) and 1.0 (drawn, top-k
# off as OpenAI's clients send), for each kiln binary given, alternating:
#   bash scripts/gpu/serve_sampling.sh .gpu-bin/kiln-old .gpu-bin/kiln
# LEVELS (default 1,16,64), MAX_SECONDS (default 20) a level. The last binary given
# generates the load for all (older ones may lack bench-serve's --temperature).
set -uo pipefail
levels=${LEVELS:-1,16,64}
load=${*: -1}
for temp in 1.0 0; do
  for k in "$@"; do
    "$k" serve --device cuda --port 8090 --max-seqs 64 > /tmp/serve.log 2>&1 &
    pid=$!
    for _ in $(seq 240); do
      curl -sf http://127.0.0.1:8090/health > /dev/null && break
      sleep 0.5
    done
    echo "=== $k, temperature $temp"
    "$load" bench-serve --url http://127.0.0.1:8090 --concurrency "$levels" --prompt-tokens 128 \
      --output-tokens 64 --temperature "$temp" --max-seconds "${MAX_SECONDS:-20}" 2>&1 | grep -E "^\||clients"
    kill -TERM $pid
    wait $pid
  done
done
