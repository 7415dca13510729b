#!/usr/bin/env bash
# Issue 19's data-parallel goal, and what gradient buckets change: `kiln train` of issue
# 18's 110 M shape on 1, 2 and 4 GPUs, the gradients summed after the backward pass
# (--bucket-mb 0) or in 25 MiB buckets beside it (the default); the median step of steps
# 3-8 from train.json, and the losses (equal to the bit at --dp 2, where a sum is a + b).
# On the GPU machine, from the repository root, after scripts/gpu/pack.sh:
#   KILN=.gpu-bin/kiln bash scripts/gpu/dp_scaling.sh [BATCH, default 16]
set -u
K=${KILN:-.gpu-bin/kiln}
batch=${1:-16}
export NCCL_NVLS_ENABLE=0
text=/tmp/dp-text.txt
find crates -name '*.rs' -print0 | sort -z | xargs -0 cat >"$text"
gpus=$(nvidia-smi -L | wc -l)
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) × $gpus; text $(wc -c <"$text") bytes; batch $batch"
train() { # OUT ARGS...
  local out=$1
  shift
  rm -rf "$out"
  timeout 300 "$K" train --data "$text" --arch llama --dim 768 --layers 12 --heads 12 --ffn 2048 \
    --context 1024 --batch "$batch" --seq-len 1024 --steps 8 --eval-windows 1 --device cuda \
    --out "$out" "$@" >/dev/null 2>"$out.err" || { echo "failed: $*"; tail -3 "$out.err"; }
}
train /tmp/dp-1
for n in 2 4; do
  [ "$n" -le "$gpus" ] || continue
  train "/tmp/dp-$n-after" --dp "$n" --bucket-mb 0
  train "/tmp/dp-$n-buckets" --dp "$n"
done
python3 - "$batch" <<'PY'
import json, statistics, sys, os
batch = int(sys.argv[1])
def run(name):
    path = f"/tmp/{name}/train.json"
    if not os.path.exists(path):
        return None
    steps = json.load(open(path))["steps"]
    return statistics.median(s["seconds"] for s in steps[2:]), [round(s["loss"], 5) for s in steps]
one = run("dp-1")
print("| GPUs | gradients | step | tokens/s | of linear | losses |")
print("|---|---|---:|---:|---:|---|")
for name, gpus, how in [("dp-1", 1, "-"), ("dp-2-after", 2, "after backward"), ("dp-2-buckets", 2, "25 MiB buckets"),
                        ("dp-4-after", 4, "after backward"), ("dp-4-buckets", 4, "25 MiB buckets")]:
    r = run(name)
    if r is None:
        continue
    step, losses = r
    linear = f"{100 * one[0] / (gpus * step):.1f}%" if one and gpus > 1 else ""
    print(f"| {gpus} | {how} | {step:.4f} s | {batch * 1024 / step:,.0f} | {linear} | {' '.join(map(str, losses))} |")
PY
