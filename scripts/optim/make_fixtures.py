#!/usr/bin/env python3
"""Fixtures for kiln-optim's parity tests: PyTorch's optimizers, single-tensor path
(foreach=False), run for 50 seeded steps on a few tensors of awkward sizes, with zero,
denormal, huge, inf and NaN gradients among them.

Writes crates/kiln-optim/tests/fixtures/optim.json (cases, hyperparameters, where each
array lies) and optim.bin (the arrays, f32 little-endian, one after another).

    python3 scripts/optim/make_fixtures.py           # needs torch (CPU is enough) and numpy

One substitution: on x86 CPUs PyTorch computes Tensor.sqrt with MKL's vsSqrt, which is not
correctly rounded (on the Zen 3 development machine, with torch 2.15, 20% of float32 square
roots differ from the IEEE result by one ulp). PyTorch's CUDA path, the fused kernels and
kiln use the IEEE square root, so this script replaces Tensor.sqrt and Tensor.sqrt_ with
numpy's (correctly rounded) before running the optimizers; every other operation is
PyTorch's own. Run with --mkl-sqrt to leave it, and see the parity tests fail.
"""

import argparse
import json
import math
import pathlib

import numpy as np
import torch

SHAPES = [("a", [37]), ("b", [16, 13]), ("c", [1]), ("empty", [0, 5]), ("d", [3, 7]), ("e", [129])]
STEPS = 50
CHECKPOINTS = [1, 2, 5, 50]
OUT = pathlib.Path(__file__).resolve().parents[2] / "crates/kiln-optim/tests/fixtures"


def ieee_sqrt(self):
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(self.detach().numpy()))


def ieee_sqrt_(self):
    self.copy_(ieee_sqrt(self))
    return self


class Bin:
    def __init__(self):
        self.parts, self.len = [], 0

    def add(self, values):
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
        ref = {"offset": self.len, "len": int(a.size)}
        self.parts.append(a)
        self.len += a.size
        return ref


def flat(tensors):
    return np.concatenate([t.detach().reshape(-1).numpy() for t in tensors])


def initial_params(gen):
    n = sum(math.prod(s) for _, s in SHAPES)
    p = torch.randn(n, generator=gen) * 0.5
    # Values at the edges: zero, negative zero, denormals, huge.
    p[0], p[1], p[2], p[3], p[4] = 0.0, -0.0, 1e-40, -3e-42, 1e20
    return p


def gradients(gen):
    n = sum(math.prod(s) for _, s in SHAPES)
    gs = []
    for k in range(STEPS):
        scale = 10.0 ** float(torch.randint(-3, 2, (1,), generator=gen))
        g = torch.randn(n, generator=gen) * scale
        g[5] = 0.0  # always zero
        g[6] = -0.0
        g[7] = 1e-40 if k % 2 else -2e-39  # denormal
        g[8] = 1e-45 * (k + 1)  # smallest denormals
        if k % 7 == 3:
            g[9] = 1e30 if k % 2 else -3e35  # huge: its square overflows f32
        if k == 20:
            g[10] = float("nan")
        if k == 30:
            g[11] = float("inf")
        gs.append(g)
    return gs


def split(flat_tensor):
    out, at = [], 0
    for _, shape in SHAPES:
        size = math.prod(shape)
        out.append(flat_tensor[at : at + size].reshape(shape))
        at += size
    return out


def make_optimizer(rule, params, lr):
    kind = rule["kind"]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=rule["momentum"], dampening=rule["dampening"],
                               nesterov=rule["nesterov"], weight_decay=rule["weight_decay"], foreach=False)
    if kind == "adam":
        cls = torch.optim.AdamW if rule["decoupled_weight_decay"] else torch.optim.Adam
        return cls(params, lr=lr, betas=(rule["beta1"], rule["beta2"]), eps=rule["eps"],
                   weight_decay=rule["weight_decay"], amsgrad=rule["amsgrad"], foreach=False)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=rule["alpha"], eps=rule["eps"],
                                   weight_decay=rule["weight_decay"], momentum=rule["momentum"],
                                   centered=rule["centered"], foreach=False)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, lr_decay=rule["lr_decay"], weight_decay=rule["weight_decay"],
                                   eps=rule["eps"], initial_accumulator_value=rule["initial_accumulator_value"],
                                   foreach=False)
    raise ValueError(kind)


STATE_NAMES = {
    "sgd": lambda r: ["momentum_buffer"] if r["momentum"] != 0 else [],
    "adam": lambda r: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if r["amsgrad"] else []),
    "rmsprop": lambda r: ["square_avg"] + (["momentum_buffer"] if r["momentum"] > 0 else [])
    + (["grad_avg"] if r["centered"] else []),
    "adagrad": lambda r: ["sum"],
}


def make_scheduler(schedule, opt):
    kind = schedule["kind"]
    lrs = torch.optim.lr_scheduler
    if kind == "constant":
        return None
    if kind == "linear_warmup":
        return lrs.LinearLR(opt, start_factor=schedule["start_factor"], end_factor=1.0,
                            total_iters=schedule["warmup"])
    if kind == "cosine":
        assert schedule["warmup"] == 0, "PyTorch's CosineAnnealingLR has no warm-up"
        return lrs.CosineAnnealingLR(opt, T_max=schedule["total"], eta_min=schedule["min_lr"])
    if kind == "step":
        return lrs.StepLR(opt, step_size=schedule["step_size"], gamma=schedule["gamma"])
    if kind == "one_cycle":
        return lrs.OneCycleLR(opt, max_lr=schedule["max_lr"], total_steps=schedule["total"],
                              pct_start=schedule["pct_start"], div_factor=schedule["div_factor"],
                              final_div_factor=schedule["final_div_factor"], anneal_strategy="cos",
                              three_phase=False, cycle_momentum=False)
    raise ValueError(kind)


def schedule_lr0(schedule):
    return schedule.get("lr", schedule.get("max_lr"))


def run_case(case, init, grads, out):
    params = [torch.nn.Parameter(t.clone()) for t in split(init.clone())]
    opt = make_optimizer(case["rule"], params, schedule_lr0(case["schedule"]))
    sched = make_scheduler(case["schedule"], opt)
    scaling = case.get("loss_scaling")
    scaler = None
    if scaling:
        scaler = torch.amp.GradScaler("cpu", init_scale=scaling["init_scale"], growth_factor=scaling["growth_factor"],
                                      backoff_factor=scaling["backoff_factor"],
                                      growth_interval=scaling["growth_interval"])
        scaler.scale(torch.zeros(()))  # makes the scale tensor (done lazily by the first scale(loss))
    record = {"checkpoints": [], "lrs": [], "norms": [], "loss_scales": [], "skipped": []}
    fed = []
    for k, g in enumerate(grads):
        g = g.clone()
        if scaler is not None:
            scale = scaler.get_scale()
            g = g * torch.tensor(scale, dtype=torch.float32)
            if k in (4, 5, 17):  # overflow in the backward pass: these steps are skipped
                g[12 + k] = float("inf") if k != 5 else float("nan")
            record["loss_scales"].append(scale)
        fed.append(g.clone())
        for p, gp in zip(params, split(g)):
            p.grad = gp.clone()
        record["lrs"].append(opt.param_groups[0]["lr"])
        if scaler is not None:
            scaler.unscale_(opt)
        if case.get("max_grad_norm") is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, case["max_grad_norm"], foreach=False)
            # JSON has no inf/NaN: a non-finite norm is null.
            record["norms"].append(float(norm) if math.isfinite(float(norm)) else None)
        if scaler is not None:
            scaler.step(opt)
            found = sum(float(v) for v in scaler._found_inf_per_device(opt).values())
            record["skipped"].append(found > 0)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        if k + 1 in CHECKPOINTS:
            record["checkpoints"].append({"step": k + 1, "params": out.add(flat(params))})
    names = STATE_NAMES[case["rule"]["kind"]](case["rule"])
    record["states"] = {}
    for name in names:
        record["states"][name] = out.add(flat([opt.state[p][name] for p in params]))
    if scaler is not None:
        record["grads"] = out.add(np.stack([f.numpy() for f in fed]))
    return record


def sgd(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    return {"kind": "sgd", "momentum": momentum, "dampening": dampening, "nesterov": nesterov,
            "weight_decay": weight_decay}


def adam(weight_decay=0.0, decoupled=False, amsgrad=False, betas=(0.9, 0.999), eps=1e-8):
    return {"kind": "adam", "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled, "amsgrad": amsgrad}


def rmsprop(alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False):
    return {"kind": "rmsprop", "alpha": alpha, "eps": eps, "weight_decay": weight_decay, "momentum": momentum,
            "centered": centered}


def adagrad(lr_decay=0.0, weight_decay=0.0, eps=1e-10, initial_accumulator_value=0.0):
    return {"kind": "adagrad", "lr_decay": lr_decay, "weight_decay": weight_decay, "eps": eps,
            "initial_accumulator_value": initial_accumulator_value}


def const(lr):
    return {"kind": "constant", "lr": lr}


ONE_CYCLE = {"kind": "one_cycle", "max_lr": 0.01, "total": STEPS, "pct_start": 0.3, "div_factor": 25.0,
             "final_div_factor": 1e4}

CASES = [
    {"name": "sgd", "rule": sgd(), "schedule": const(0.05)},
    {"name": "sgd_momentum_dampening_decay", "rule": sgd(0.9, 0.1, False, 0.01), "schedule": const(0.01)},
    {"name": "sgd_nesterov_decay", "rule": sgd(0.9, 0.0, True, 1e-3), "schedule":
     {"kind": "step", "lr": 0.02, "step_size": 7, "gamma": 0.5}},
    {"name": "adam", "rule": adam(), "schedule": const(1e-3)},
    {"name": "adam_l2_amsgrad", "rule": adam(weight_decay=0.01, amsgrad=True, betas=(0.8, 0.99), eps=1e-6),
     "schedule": const(3e-3)},
    {"name": "adamw_one_cycle", "rule": adam(weight_decay=0.1, decoupled=True), "schedule": ONE_CYCLE},
    {"name": "adamw_amsgrad_warmup", "rule": adam(weight_decay=0.01, decoupled=True, amsgrad=True, betas=(0.6, 0.95)),
     "schedule": {"kind": "linear_warmup", "lr": 2e-3, "start_factor": 0.1, "warmup": 10}},
    {"name": "rmsprop", "rule": rmsprop(), "schedule": const(1e-3)},
    {"name": "rmsprop_centered_momentum_decay", "rule": rmsprop(0.9, 1e-6, 0.01, 0.9, True),
     "schedule": {"kind": "cosine", "lr": 1e-3, "min_lr": 1e-5, "warmup": 0, "total": STEPS}},
    {"name": "rmsprop_centered", "rule": rmsprop(centered=True), "schedule": const(1e-3)},
    {"name": "adagrad", "rule": adagrad(0.01, 0.01, 1e-10, 0.1), "schedule": const(0.05)},
    {"name": "adamw_clipped", "rule": adam(weight_decay=0.01, decoupled=True), "schedule": const(1e-3),
     "max_grad_norm": 1.0},
    {"name": "adamw_loss_scaled_clipped", "rule": adam(weight_decay=0.01, decoupled=True), "schedule": const(1e-3),
     "max_grad_norm": 5.0,
     "loss_scaling": {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}},
]

SCHEDULES = [
    {"kind": "linear_warmup", "lr": 0.1, "start_factor": 0.25, "warmup": 12},
    {"kind": "cosine", "lr": 0.1, "min_lr": 0.001, "warmup": 0, "total": 60},
    {"kind": "step", "lr": 0.1, "step_size": 9, "gamma": 0.3},
    dict(ONE_CYCLE, total=60),
]


def schedule_lrs(schedule, steps=60):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=schedule_lr0(schedule))
    sched = make_scheduler(schedule, opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mkl-sqrt", action="store_true", help="keep PyTorch's CPU Tensor.sqrt (not IEEE)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    if not args.mkl_sqrt:
        torch.Tensor.sqrt = ieee_sqrt
        torch.Tensor.sqrt_ = ieee_sqrt_
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20261125)
    init = initial_params(gen)
    grads = gradients(gen)
    out = Bin()
    index = {
        "torch": torch.__version__,
        "ieee_sqrt": not args.mkl_sqrt,
        "layout": [{"name": n, "shape": s} for n, s in SHAPES],
        "steps": STEPS,
        "init": out.add(init.numpy()),
        "grads": out.add(np.stack([g.numpy() for g in grads])),
        "cases": [],
        "schedules": [{"schedule": s, "lrs": schedule_lrs(s)} for s in SCHEDULES],
    }
    for case in CASES:
        record = run_case(case, init, grads, out)
        index["cases"].append(dict(case, **record))
        print(f"{case['name']}: {len(record['checkpoints'])} checkpoints, states {list(record['states'])}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optim.json").write_text(json.dumps(index, indent=1, allow_nan=False) + "\n")
    np.concatenate(out.parts).astype("<f4").tofile(args.out / "optim.bin")
    print(f"wrote {args.out}/optim.json and optim.bin ({out.len * 4} bytes)")


if __name__ == "__main__":
    main()
