// Tensor-core and asynchronous-copy building blocks (sm_80 and later; the launch code
// sends older GPUs elsewhere), shared by gemm_tc.cu, attention_tc.cu and attention_grad_tc.cu.
//
// mma.m16n8k16 with f16 inputs and f32 sums: thread t of a warp (g = t / 4, c = t % 4)
// holds A's rows g and g + 8 at columns 2c, 2c + 1 (and + 8), B's column g at rows 2c,
// 2c + 1 (and + 8), and C's rows g and g + 8 at columns 2c, 2c + 1.

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 f16 matrices from shared memory: lanes 8m..8m+7 give the rows of matrix m,
// r[m] receives it in the fragment layout above.
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* p) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
#endif
}

// The same, each matrix transposed: a B operand from a row-major [k][n] tile.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* p) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
#endif
}

// c += a · b over a 16x8x16 tile.
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The same with bf16 inputs.
__device__ __forceinline__ void mma_bf16_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// 16 bytes from global to shared memory without passing through registers; with
// `bytes` 0 nothing is read and the 16 bytes become zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(bytes)
                 : "memory");
#endif
}

// 4 bytes the same way (through L1), zeros with `bytes` 0.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared_address(dst)), "l"(src), "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Two floats as f16 pairs hi + lo (22 bits between them): the rounded values, and what
// rounding left, rounded again. A product of both parts with f16 data keeps f32's
// accuracy on tensor cores.
__device__ __forceinline__ void split_f16x2(float a, float b, u32& hi, u32& lo) {
    hi = pack_f16x2(a, b);
    lo = pack_f16x2(a - f16_to_f32((u16)(hi & 0xffff)), b - f16_to_f32((u16)(hi >> 16)));
}
