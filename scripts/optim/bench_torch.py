#!/usr/bin/env python3
"""PyTorch's AdamW step on the shape of `kiln bench --optimizer`: 268M fp32 parameters in
64 tensors (2^28 / 64 each), fused=True and foreach=True, median ms per step and G params/s.
Run it beside kiln on the same GPU, alternating:

    python3 scripts/optim/bench_torch.py                 # both variants, the default sizes
    kiln bench --optimizer --device cuda -r 20
    python3 scripts/optim/bench_torch.py --variant fused

Prints one JSON line per variant (and a copy-bandwidth line for the ceiling: a
device-to-device copy of the same bytes, read + written counted).
"""

import argparse
import json
import statistics

import torch


def time_steps(step, reps, steps_per_rep):
    step()  # warm-up: states allocated, kernels loaded
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps_per_rep):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps_per_rep)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=1 << 28)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps-per-rep", type=int, default=10)
    ap.add_argument("--variant", choices=["fused", "foreach", "both"], default="both")
    args = ap.parse_args()
    dev = torch.device("cuda")
    per = args.params // args.tensors
    sizes = [per] * (args.tensors - 1) + [args.params - per * (args.tensors - 1)]
    name = torch.cuda.get_device_name(dev)

    variants = ["fused", "foreach"] if args.variant == "both" else [args.variant]
    for variant in variants:
        params = [torch.full((s,), 0.5, device=dev, requires_grad=True) for s in sizes]
        for p in params:
            p.grad = torch.full_like(p, 0.01)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{variant: True})
        ms = time_steps(opt.step, args.reps, args.steps_per_rep)
        print(json.dumps({"test": "adamw", "impl": f"torch {torch.__version__} {variant}=True", "device": name,
                          "params": args.params, "tensors": args.tensors, "median_ms": ms,
                          "g_params_per_s": args.params / ms / 1e6,
                          "gb_per_s": 28 * args.params / ms / 1e6}))
        del opt, params
        torch.cuda.empty_cache()

    # The ceiling: copy 28 bytes a parameter (14 read, 14 written) as one tensor.
    src = torch.empty(7 * args.params // 2, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    ms = time_steps(lambda: dst.copy_(src), args.reps, args.steps_per_rep)
    print(json.dumps({"test": "copy", "device": name, "bytes": 28 * args.params, "median_ms": ms,
                      "tb_per_s": 28 * args.params / ms / 1e9,
                      "adamw_ceiling_g_params_per_s": args.params / ms / 1e6}))


if __name__ == "__main__":
    main()
