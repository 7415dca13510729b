#!/usr/bin/env bash
# kiln serve, and llama.cpp's llama-server when LLAMA_BIN names its bin folder, each under
# the same load from kiln bench-serve (issue 17's workload: ~400-token prompts sharing half
# their tokens, 128 new tokens each, ignore_eos, streamed):
#   scripts/gpu/serve-h200.sh MODEL.gguf [KILN] > results.txt
# LEVELS (default 1,16,64) are the concurrency levels; REQUESTS, when set, the requests a
# level sends (default two a client); KILN_ARGS go to kiln serve. kiln's steps are logged
# and summed by kind after its levels (scripts/gpu/serve_steps.py).
set -uo pipefail
model=$1
kiln=${2:-.gpu-bin/kiln}
levels=${LEVELS:-1,16,64}
load=(--concurrency "$levels" --prompt-tokens 400 --output-tokens 128 --shared-prefix 0.5
      --max-seconds "${MAX_SECONDS:-60}" ${REQUESTS:+--requests "$REQUESTS"})

# Start a server (the command after the port), wait for /health, load it, stop it.
measure() {
  local name=$1 port=$2
  shift 2
  "$@" > "/tmp/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "$name did not start:"; tail -5 "/tmp/$name.log"; return; }
    sleep 0.5
  done
  echo "=== $name ($(date -u +%H:%M:%S))"
  "$kiln" bench-serve --url "http://127.0.0.1:$port" "${load[@]}"
  kill -TERM $pid
  wait $pid
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
RUST_LOG=${RUST_LOG:-kiln_serve::engine=debug} measure kiln 8090 "$kiln" serve -m "$model" --device cuda --port 8090 --max-seqs 64 ${KILN_ARGS:-}
python3 "$(dirname "$0")/serve_steps.py" /tmp/kiln.log
if [ -n "${LLAMA_BIN:-}" ]; then
  measure llama-server 8091 "$LLAMA_BIN/llama-server" -m "$model" -ngl 99 -fa on -np 64 \
    -c 65536 --port 8091
fi
