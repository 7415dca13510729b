#!/usr/bin/env python3
"""What cuBLASLt's candidate algorithms give a server step's products, beside the one its
heuristic ranks first (what cublasGemmEx's default amounts to): for each projection of an
8B model at n rows, out[n, m] = x[n, k] · w[m, k]ᵀ with F16 operands and F32 output as
kiln's products are, every candidate timed alone with L2 flushed before each call (a
model's step reads each weight once, cold). Each candidate is also tried with other
split-K counts, reduction schemes and CTA swizzles than the heuristic gave it (those
cuBLASLt accepts for it), since the heuristic ranks only the configurations it proposes.

    python3 scripts/gpu/gemm_algos.py [N ...]      (default N = 64)

Needs torch (its CUDA runtime and cuBLASLt); ctypes for the cuBLASLt calls.
"""
import ctypes
import sys

import torch

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
R_16F, R_32F, COMPUTE_32F = 2, 0, 68
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
CAP_SPLITK, CAP_REDUCTION_MASK, CAP_SWIZZLE = 0, 1, 2
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE, CFG_CUSTOM, CFG_STAGES = 0, 1, 2, 3, 4, 5, 6
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16]
WORKSPACE = 32 << 20
CANDIDATES = 24


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


lt = ctypes.CDLL("libcublasLt.so.13")
vp = ctypes.c_void_p


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cuBLASLt status {status}")


def cap_u32(algo, attr):
    v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
    lt.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(written))
    return v.value


def get_cfg(algo, attr, size=4):
    v, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
    lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), size, ctypes.byref(written))
    return v.value


def set_cfg(algo, attr, value):
    v = ctypes.c_uint32(value)
    check(lt.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4), "config")


def config(algo):
    names = {CFG_ID: "id", CFG_TILE: "tile", CFG_STAGES: "stages", CFG_SPLITK: "split",
             CFG_REDUCTION: "red", CFG_SWIZZLE: "swz", CFG_CUSTOM: "opt"}
    return " ".join(f"{v}={get_cfg(algo, a)}" for a, v in names.items())


def variants(seed):
    """The seed with every split-K count, reduction scheme and swizzle its algorithm allows."""
    splits = SPLITS if cap_u32(seed, CAP_SPLITK) else [1]
    mask = cap_u32(seed, CAP_REDUCTION_MASK)
    schemes = [r for r in (1, 2, 4) if mask & r]
    swizzles = [0, 1] if cap_u32(seed, CAP_SWIZZLE) else [0]
    for split in splits:
        for red in (schemes if split > 1 else [0]):
            for swz in swizzles:
                v = Algo()
                ctypes.memmove(ctypes.byref(v), ctypes.byref(seed), ctypes.sizeof(Algo))
                set_cfg(v, CFG_SPLITK, split)
                set_cfg(v, CFG_REDUCTION, red)
                set_cfg(v, CFG_SWIZZLE, swz)
                if bytes(v) != bytes(seed):
                    yield v


def layout(dtype, rows, cols, ld):
    h = vp()
    check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, ctypes.c_uint64(rows),
                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
    return h


def main():
    ns = [int(a) for a in sys.argv[1:]] or [64]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    handle = vp()
    check(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    stream = vp(torch.cuda.current_stream().cuda_stream)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    print("| n | product | m | k | first-ranked us (TB/s) | best us (TB/s) | best's seed rank | candidates + variants |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in ns:
        for name, (m, k) in SHAPES.items():
            w = torch.randn(m, k, device="cuda", dtype=torch.float16)
            x = torch.randn(n, k, device="cuda", dtype=torch.float16)
            out = torch.empty(n, m, device="cuda", dtype=torch.float32)
            desc = vp()
            check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "desc")
            for attr, val in ((DESC_TRANSA, 1), (DESC_TRANSB, 0)):
                v = ctypes.c_int32(val)
                check(lt.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4), "trans")
            a, b, c = layout(R_16F, k, m, k), layout(R_16F, k, n, k), layout(R_32F, m, n, m)
            pref = vp()
            check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
            ws = ctypes.c_uint64(WORKSPACE)
            check(lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "pref ws")
            results = (Heuristic * CANDIDATES)()
            count = ctypes.c_int(0)
            check(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref, CANDIDATES, results,
                                                     ctypes.byref(count)), "heuristic")
            def time_algo(algo):
                def call():
                    return lt.cublasLtMatmul(handle, desc, ctypes.byref(one), vp(w.data_ptr()), a,
                                             vp(x.data_ptr()), b, ctypes.byref(zero), vp(out.data_ptr()), c,
                                             vp(out.data_ptr()), c, ctypes.byref(algo),
                                             vp(workspace.data_ptr()), ctypes.c_size_t(WORKSPACE), stream)
                if call() != 0:
                    return None
                samples = []
                for _ in range(7):
                    flush.zero_()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    call()
                    e.record()
                    torch.cuda.synchronize()
                    samples.append(s.elapsed_time(e) * 1000)
                samples.sort()
                return samples[len(samples) // 2]

            times = []
            tried = 0
            for i in range(count.value):
                t = time_algo(results[i].algo)
                if t is not None:
                    times.append((t, i, config(results[i].algo)))
                for variant in variants(results[i].algo):
                    check_result = Heuristic()
                    if lt.cublasLtMatmulAlgoCheck(handle, desc, a, b, c, c, ctypes.byref(variant),
                                                  ctypes.byref(check_result)) != 0:
                        continue
                    if check_result.workspaceSize > WORKSPACE:
                        continue
                    tried += 1
                    t = time_algo(variant)
                    if t is not None:
                        times.append((t, i, config(variant)))
            gb = m * k * 2 / 1e9
            first, _, first_cfg = times[0]
            best, rank, best_cfg = min(times)
            print(f"| {n} | {name} | {m} | {k} | {first:.1f} ({gb / first * 1e3:.2f}) | "
                  f"{best:.1f} ({gb / best * 1e3:.2f}) | {rank} | {count.value} + {tried} |")
            print(f"|  | first {first_cfg} | best {best_cfg} | | | | | |")
            for h in (a, b, c):
                lt.cublasLtMatrixLayoutDestroy(h)
            lt.cublasLtMatmulDescDestroy(desc)
            lt.cublasLtMatmulPreferenceDestroy(pref)


if __name__ == "__main__":
    main()
