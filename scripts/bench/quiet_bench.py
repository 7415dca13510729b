#!/usr/bin/env python3
"""Run kiln and llama.cpp side by side, alternating, many times; beside every run record
the share of the 2 CPUs that other processes took while it ran (from /proc/stat and this
run's own CPU time), so that runs on a quiet machine can be told from the rest.
    quiet_bench.py OUT.jsonl TRIALS TYPE...
Environment: LLAMA_BIN (llama.cpp's bin folder), MODELS (the folder of the tl-*.gguf files,
as for cpu_side_by_side.sh), KILNS (kiln binaries, separated by spaces), REPS (default 2).
Keep the runs whose "others" is near 0: llama.cpp's spinning threads collapse when another
process takes a core, and so do the figures."""
import json, os, re, resource, subprocess, sys, time

B = os.environ["LLAMA_BIN"]
M = os.environ["MODELS"]
out, trials, types = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
kilns = os.environ["KILNS"].split()
reps = os.environ.get("REPS", "2")

def cpu_busy():
    f = open("/proc/stat").readline().split()[1:]
    v = list(map(int, f))
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)

def run(cmd, env=None):
    b0, t0 = cpu_busy()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=M)
    wall = time.time() - w0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    b1, t1 = cpu_busy()
    hz = os.sysconf("SC_CLK_TCK")
    mine = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    busy = (b1 - b0) / hz
    total = (t1 - t0) / hz
    others = max(0.0, busy - mine) / total if total else 1.0
    res = {}
    for line in p.stdout.splitlines():
        m = re.search(r"\|\s*(pp64|tg32)\s*\|\s*([\d.]+)", line)
        if m:
            res[m.group(1)] = float(m.group(2))
    return res, others, wall

with open(out, "a") as f:
    for trial in range(trials):
        for t in types:
            fn = "tl-f16.gguf" if t == "F16" else f"tl-{t}.gguf"
            cmds = [("llama.cpp", [f"{B}/llama-bench", "-m", fn, "-p", "64", "-n", "32", "-r", reps, "-t", "2"])]
            cmds += [(os.path.basename(k), [k, "bench", "-m", fn, "-p", "64", "-n", "32", "-r", reps, "-t", "2"]) for k in kilns]
            for name, cmd in cmds:
                env = dict(os.environ, LD_LIBRARY_PATH=B)
                res, others, wall = run(cmd, env)
                rec = dict(time=time.strftime("%H:%M:%S"), trial=trial, type=t, prog=name, others=round(others, 3), wall=round(wall, 1), **res)
                f.write(json.dumps(rec) + "\n"); f.flush()
