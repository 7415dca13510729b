#!/usr/bin/env bash
# Per-kernel GPU time of training steps (one 1024-token sequence of issue 18's 134M shape,
# after a first step), from Nsight Compute, summed by kernel: scripts/gpu/profile-train.sh [KILN]. Clocks and caches are left as
# they run in service (no locking, no flushing).
set -euo pipefail
kiln=${1:-.gpu-bin/kiln}
csv=$(mktemp)
ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip "${SKIP:-3000}" --launch-count "${COUNT:-2500}" --csv \
  "$kiln" bench --train llama-134m -b 1 --seq-len 1024 -r 2 --device cuda > "$csv" 2>/dev/null || true
python3 - "$csv" <<'PY'
import csv, collections, sys
rows = list(csv.reader(open(sys.argv[1])))
head, agg = None, collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    if 'Kernel Name' in r:
        head = r
        continue
    if head and len(r) == len(head):
        d = dict(zip(head, r))
        if d.get('Metric Name') == 'gpu__time_duration.sum':
            a = agg[d['Kernel Name'][:50]]
            a[0] += 1
            a[1] += float(d['Metric Value'].replace(',', ''))
total = sum(t for _, t in agg.values())
print(f"total {total/1e3:.1f} us over {sum(n for n, _ in agg.values())} launches")
for k, (n, t) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{t/1e3:9.1f} us {100*t/total:5.1f}% {n:4d} x {t/n/1e3:7.2f} us  {k}")
PY
rm -f "$csv"
