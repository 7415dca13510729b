// Dot products of float weight rows (F32/F16/BF16) with f32 activations, for the matvec
// kernels of matvec.cu. x is small and read through the L1 cache.

// The activations of a float-weight matvec: x [n, k] f32, rows 16-byte aligned.
struct XF32 {
    const float* x;
};

// Eight consecutive values of a float row: chunk c is values 8c .. 8c + 7.
template <int T> __device__ __forceinline__ void load8(WRow row, int c, float w[8]) {
    if (T == W_F32) {
        const float4* p = (const float4*)row.q + 2 * c;
        const float4 a = p[0], b = p[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else {
        const uint4 v = ((const uint4*)row.q)[c];
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u16 lo = words[j] & 0xffff, hi = words[j] >> 16;
            w[2 * j] = T == W_F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
            w[2 * j + 1] = T == W_F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
        }
    }
}

// acc[j][b] = dot(w row j, x row b) for R weight rows read side by side, over this
// warp's part of the row (see combine_parts); every lane ends with the warp's sums.
// Lane l takes chunks l, l + 32, ... of eight values, so a warp reads consecutive 16-
// or 32-byte pieces (coalesced). Rows whose length is not a multiple of 8 go value by
// value. A chunk's weights of all R rows are held while the B rows of x stream past
// one at a time: holding x's chunks of all B rows instead (8 B values) took the 8-row
// kernels past 128 registers, the most a thread of a 512-thread block may have.
template <int T, int B, int R>
__device__ __forceinline__ void dot_rows(const WRow rows[R], XF32 in, int k, int n,
                                         float acc[R][B]) {
    const float* __restrict__ x = in.x;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = 0.0f;
    const int chunks = (k & 7) == 0 ? k / 8 : 0;
#pragma unroll 2
    for (int c = threadIdx.z * 32 + lane; c < chunks; c += 32 * blockDim.z) {
        float wv[R][8];
#pragma unroll
        for (int j = 0; j < R; j++) load8<T>(rows[j], c, wv[j]);
#pragma unroll
        for (int b = 0; b < B; b++) {
            if (b < n) {
                const float4* p = (const float4*)(x + (size_t)b * k) + 2 * c;
                const float4 a = p[0], e = p[1];
                const float xv[8] = {a.x, a.y, a.z, a.w, e.x, e.y, e.z, e.w};
#pragma unroll
                for (int j = 0; j < R; j++)
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[j][b] += wv[j][i] * xv[i];
            }
        }
    }
    for (int i = chunks * 8 + threadIdx.z * 32 + lane; i < k; i += 32 * blockDim.z) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            const float wi = load_one<T>(rows[j], i);
#pragma unroll
            for (int b = 0; b < B; b++)
                if (b < n) acc[j][b] += wi * x[(size_t)b * k + i];
        }
    }
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = warp_sum(acc[j][b]);
}
