#!/usr/bin/env python3
"""What a server step's Q, K and V products cost as kiln runs them (Q alone, then K and V
as one strided batched call) against one product over the three weights laid end to end
(6,144 rows of an 8B model), with and without splitting its output into Q, K and V
afterwards; the O product alone beside them. out[n, m] = x[n, k] · w[m, k]ᵀ, F16
operands, F32 output, through cublasGemmEx as kiln calls it. Each form runs over 8 layers'
worth of distinct weights back to back (as a step reads them: cold, no flush between),
recorded as a CUDA graph (as kiln's steps run: no host time between launches; timed from
Python without one, the host's ~10 µs a call made two launches look twice as slow as
one), replayed and timed by CUDA events, divided by 8.

    python3 scripts/gpu/qkv_products.py [N ...]      (default N = 16 32 64 128)

Needs torch (its CUDA runtime and cuBLAS handle); ctypes for the cuBLAS calls.
"""
import ctypes
import sys

import torch

DIM, KV, LAYERS = 4096, 1024, 8
R_16F, R_32F, COMPUTE_32F, OP_N, OP_T, DEFAULT = 2, 0, 68, 0, 1, -1

blas = ctypes.CDLL("libcublas.so.13")
vp, i64 = ctypes.c_void_p, ctypes.c_longlong
one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)


def gemm(h, w, m, x, n, k, out):
    """out[n, m] (f32) = x[n, k] · w[m, k]ᵀ: column-major C(m × n) = Wᵀ-stored · X."""
    s = blas.cublasGemmEx(h, OP_T, OP_N, m, n, k, ctypes.byref(one), vp(w), R_16F, k, vp(x), R_16F, k,
                          ctypes.byref(zero), vp(out), R_32F, m, COMPUTE_32F, DEFAULT)
    assert s == 0, f"cublasGemmEx: {s}"


def gemm_pair(h, w0, w1, m, x, n, k, o0, o1):
    s = blas.cublasGemmStridedBatchedEx(h, OP_T, OP_N, m, n, k, ctypes.byref(one), vp(w0), R_16F, k,
                                        i64((w1 - w0) // 2), vp(x), R_16F, k, i64(0), ctypes.byref(zero),
                                        vp(o0), R_32F, m, i64((o1 - o0) // 4), 2, COMPUTE_32F, DEFAULT)
    assert s == 0, f"cublasGemmStridedBatchedEx: {s}"


def timed(fn, h, reps=7):
    def on_stream():
        # cuBLAS launches on the stream its handle names: the capture's.
        assert blas.cublasSetStream_v2(h, vp(torch.cuda.current_stream().cuda_stream)) == 0
        fn()

    on_stream()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        on_stream()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        samples.append(s.elapsed_time(e) * 1000 / LAYERS)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    ns = [int(a) for a in sys.argv[1:]] or [16, 32, 64, 128]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    h = vp(torch.cuda.current_blas_handle())
    k = DIM
    # Per layer: Q, K, V end to end (one allocation), and O.
    qkv = [torch.randn(DIM + 2 * KV, k, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
    wo = [torch.randn(DIM, k, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
    mb = lambda rows: rows * k * 2 / 1e6
    print("| n | Q, then K+V batched µs | Q+K+V as one product µs | and split into Q, K, V µs | O alone µs (TB/s) | one product / today |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in ns:
        x = torch.randn(n, k, device="cuda", dtype=torch.float16)
        q = torch.empty(n, DIM, device="cuda")
        kv = torch.empty(2, n, KV, device="cuda")
        fused = torch.empty(n, DIM + 2 * KV, device="cuda")
        o = torch.empty(n, DIM, device="cuda")
        ksz = KV * k * 2

        def today():
            for w in qkv:
                base = w.data_ptr()
                gemm(h, base, DIM, x.data_ptr(), n, k, q.data_ptr())
                gemm_pair(h, base + DIM * k * 2, base + DIM * k * 2 + ksz, KV, x.data_ptr(), n, k,
                          kv[0].data_ptr(), kv[1].data_ptr())

        def one_product():
            for w in qkv:
                gemm(h, w.data_ptr(), DIM + 2 * KV, x.data_ptr(), n, k, fused.data_ptr())

        def one_product_split():
            for w in qkv:
                gemm(h, w.data_ptr(), DIM + 2 * KV, x.data_ptr(), n, k, fused.data_ptr())
                q.copy_(fused[:, :DIM])
                kv[0].copy_(fused[:, DIM:DIM + KV])
                kv[1].copy_(fused[:, DIM + KV:])

        def o_alone():
            for w in wo:
                gemm(h, w.data_ptr(), DIM, x.data_ptr(), n, k, o.data_ptr())

        # The forms agree (one product's columns are today's three outputs).
        assert blas.cublasSetStream_v2(h, vp(torch.cuda.current_stream().cuda_stream)) == 0
        today()
        one_product()
        torch.cuda.synchronize()
        assert torch.equal(q, fused[:, :DIM]) or torch.allclose(q, fused[:, :DIM], rtol=1e-3, atol=1e-2)
        t0, t1, t2, t3 = (timed(f, h) for f in (today, one_product, one_product_split, o_alone))
        print(f"| {n} | {t0:.1f} ({mb(DIM + 2 * KV) / t0:.2f} TB/s) | {t1:.1f} ({mb(DIM + 2 * KV) / t1:.2f}) "
              f"| {t2:.1f} | {t3:.1f} ({mb(DIM) / t3:.2f}) | {t1 / t0:.2f} |")


if __name__ == "__main__":
    main()
