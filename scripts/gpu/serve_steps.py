#!/usr/bin/env python3
"""Sum a kiln serve log's step lines (`RUST_LOG=kiln_serve::engine=debug`) by kind of step:
how many, their mean and total time, and the host's time between steps. A step that reads
nothing back (a prompt chunk before the prompt's last) returns once queued: its row is
marked, its time is the host's, and the device's time is in the next step's.

    python3 scripts/gpu/serve_steps.py serve.log
"""
import re
import sys
from collections import defaultdict

FIELD = re.compile(r"(\w+)=(\d+|true|false)")


def kind(f):
    queued = "" if f.get("reads_back", 1) else " (nothing read back: host time)"
    if f["prompt_tokens"] == 0:
        return f"decode only, {bucket(f['decodes'])} rows{queued}"
    if f["decodes"] == 0:
        return f"prompts only, {bucket(f['prompt_tokens'])} tokens{queued}"
    return f"mixed, {bucket(f['prompt_tokens'])} prompt tokens{queued}"


def bucket(n):
    b = 1
    while b < n:
        b *= 2
    return f"<= {b}"


def main():
    steps = defaultdict(lambda: [0, 0, 0, 0])  # count, run us, before us, tokens out
    total_run = total_before = 0
    for line in open(sys.argv[1], errors="replace"):
        if " step " not in line and not line.rstrip().endswith("step"):
            continue
        f = {k: {"true": 1, "false": 0}.get(v) if v in ("true", "false") else int(v)
             for k, v in FIELD.findall(line)}
        if "run_us" not in f:
            continue
        s = steps[kind(f)]
        s[0] += 1
        s[1] += f["run_us"]
        s[2] += f["before_us"]
        s[3] += f["decodes"]
        total_run += f["run_us"]
        total_before += f["before_us"]
    wall = total_run + total_before
    print(f"steps' time {total_run / 1e6:.2f} s, between steps {total_before / 1e6:.2f} s")
    print("| step | count | mean ms | share of time | host ms before, mean | decode rows |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, (n, run, before, rows) in sorted(steps.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n} | {run / n / 1e3:.2f} | {100 * (run + before) / max(wall, 1):.1f}% "
              f"| {before / n / 1e3:.2f} | {rows} |")


if __name__ == "__main__":
    main()
