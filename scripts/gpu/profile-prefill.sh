#!/usr/bin/env bash
# Per-kernel GPU time of one 512-token prompt, from Nsight Compute, summed by kernel:
#   scripts/gpu/profile-prefill.sh SHAPE TYPE [KILN]. Clocks and caches as in service.
set -euo pipefail
shape=$1 type=$2 kiln=${3:-.gpu-bin/kiln}
csv=$(mktemp)
ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --launch-skip 420 --launch-count 420 --csv \
  "$kiln" bench --synthetic "$shape" --type "$type" --device cuda -p 512 -n 0 -r 1 > "$csv" 2>/dev/null || true
python3 - "$csv" <<'PY'
import csv, collections, sys
rows = list(csv.reader(open(sys.argv[1])))
head, agg = None, collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    if 'Kernel Name' in r:
        head = r; continue
    if head and len(r) == len(head):
        d = dict(zip(head, r))
        if d.get('Metric Name') == 'gpu__time_duration.sum':
            a = agg[d['Kernel Name'][:60]]; a[0] += 1; a[1] += float(d['Metric Value'].replace(',', ''))
total = sum(t for _, t in agg.values())
print(f"total {total/1e3:.1f} us over {sum(n for n, _ in agg.values())} launches")
for k, (n, t) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{t/1e3:9.1f} us {100*t/total:5.1f}% {n:4d} x {t/n/1e3:8.2f} us  {k}")
PY
