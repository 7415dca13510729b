"""Nsight Compute's CSV of `gpu__time_duration.sum` per launch, summed by kernel (the
first 90 characters of its name: cuBLAS's names carry their tile shapes) and grid,
largest first: python3 ncu_sum.py FILE.csv [TOP]"""
import collections
import csv
import sys

head, agg = None, collections.defaultdict(lambda: [0, 0.0])
for r in csv.reader(open(sys.argv[1])):
    if 'Kernel Name' in r:
        head = r
        continue
    if head and len(r) == len(head):
        d = dict(zip(head, r))
        if d.get('Metric Name') == 'gpu__time_duration.sum':
            a = agg[(d['Kernel Name'][:90], d.get('Grid Size', ''))]
            a[0] += 1
            a[1] += float(d['Metric Value'].replace(',', ''))
total = sum(t for _, t in agg.values()) or 1.0
top = int(sys.argv[2]) if len(sys.argv) > 2 else len(agg)
print(f"total {total/1e3:.1f} us over {sum(n for n, _ in agg.values())} launches")
for (k, grid), (n, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:top]:
    print(f"{t/1e3:9.1f} us {100*t/total:5.1f}% {n:4d} x {t/n/1e3:8.2f} us {grid:>14}  {k}")
