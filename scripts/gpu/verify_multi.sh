#!/usr/bin/env bash
# Issue 19 on a machine of 2-4 GPUs, in one device call, from the repository root after
# packing (see scripts/gpu/pack.sh; this needs the `collective`, `tp` and `train` test
# binaries and `kiln` in .gpu-bin/):
#   source .gpu-bin/unpack.sh; bash scripts/gpu/verify_multi.sh
# 1. NCCL and the one-shot kernel: sums, gathers, scatters exact; the one-shot timings;
# 2. the split llama fixtures (heads, head and embedding split) through both paths;
# 3. data parallelism on two GPUs, plain and ZeRO-1, against the CPU run;
# 4. `kiln run --tp 2` and `kiln serve --tp 2` give the whole model's greedy text;
# 5. llama3-8b TP=1/2/4 decode (regressions of the above);
# 6. the two-host script's refusal and killed-host cases.
set -u
export NCCL_NVLS_ENABLE=0
mkdir -p /work && ln -sfn "$PWD" /work/main 2>/dev/null
K=$PWD/.gpu-bin/kiln
gpus=$(nvidia-smi -L | wc -l)
echo "== $gpus GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
t() { timeout "$1" "${@:2}" 2>&1 | grep -E "^test |test result|SKIPPED|one-shot|KiB|panicked|error" | head -40; }
echo "== 1"; t 300 .gpu-bin/collective-* --include-ignored --nocapture --test-threads=1
echo "== 2"; t 200 .gpu-bin/tp-* --include-ignored --nocapture split_over
echo "== 3"; t 300 .gpu-bin/train-* --include-ignored --nocapture two_gpus
echo "== 4"
p="Permission is hereby granted"
for tp in 1 2; do
  timeout 120 "$K" run -p "$p" -n 24 --temp 0 -o json --device cuda --tp $tp 2>/dev/null | tail -1 | python3 -c 'import json,sys; print("run --tp '$tp':", json.load(sys.stdin)["text"][:80])'
done
for tp in 1 2; do
  timeout 180 "$K" serve --device cuda --port 0 --tp $tp 2>/tmp/serve$tp.txt &
  pid=$!
  for _ in $(seq 120); do grep -q "listening on" /tmp/serve$tp.txt && break; sleep 1; done
  url=$(grep -o "http://[0-9.:]*" /tmp/serve$tp.txt | head -1)
  curl -s "$url/v1/completions" -d '{"prompt": "'"$p"'", "max_tokens": 24, "temperature": 0, "ignore_eos": true}' \
    | python3 -c 'import json,sys; print("serve --tp '$tp':", json.load(sys.stdin)["choices"][0]["text"][:80])'
  kill -TERM $pid; wait $pid
  grep -E "listening|rror" /tmp/serve$tp.txt | head -2
done
echo "== 5"
timeout 90 "$K" bench --synthetic llama3-8b --type f16 -p 512 -n 128 -r 3 2>&1 | grep "| llama"
for tp in 2 4; do
  [ "$tp" -le "$gpus" ] || continue
  timeout 120 "$K" bench --synthetic llama3-8b --type f16 -p 512 -n 128 -r 3 --tp $tp 2>&1 | grep -E "\| llama|roofline"
done
if [ "$gpus" -ge 4 ]; then
  echo "== 6"; KILN="$K" timeout 250 bash scripts/gpu/two_hosts.sh 23
fi
