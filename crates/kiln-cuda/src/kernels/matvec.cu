// out[b, r] = sum_k x[b, k] * w[r, k] for a few rows b of x (batch 1..8) and float
// weights (F32/F16/BF16): decode and small batches, where reading the weights once is
// the whole cost.
//
// One warp per weight row (or pair of rows); each piece of weights is decoded once and
// used for every row of x. x is small and read through the L1 cache.
//
// Kernels come per weight type and per batch bound B (1, 2, 4, 8), so that decode
// (B = 1) keeps few registers. Launch: block (32, 4), grid (ceil(rows / 4)).
// x rows must be 16-byte aligned (k a multiple of 4).

// Eight consecutive values of a float row: chunk c is values 8c .. 8c + 7.
template <int T> __device__ __forceinline__ void load8(const u8* row, int c, float w[8]) {
    if (T == W_F32) {
        const float4* p = (const float4*)row + 2 * c;
        const float4 a = p[0], b = p[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else {
        const uint4 v = ((const uint4*)row)[c];
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u16 lo = words[j] & 0xffff, hi = words[j] >> 16;
            w[2 * j] = T == W_F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
            w[2 * j + 1] = T == W_F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
        }
    }
}

// acc[j][b] = dot(w row j, x row b) for R weight rows read side by side; every lane
// ends with the full sums. Lane l takes chunks l, l + 32, ... of eight values, so a warp
// reads consecutive 16- or 32-byte pieces (coalesced). Rows whose length is not a
// multiple of 8 go value by value.
template <int T, int B, int R>
__device__ __forceinline__ void dot_rows(const u8* const rows[R], const float* __restrict__ x,
                                         int k, int n, float acc[R][B]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = 0.0f;
    const int chunks = (k & 7) == 0 ? k / 8 : 0;
#pragma unroll 2
    for (int c = threadIdx.z * 32 + lane; c < chunks; c += 32 * blockDim.z) {
        float xv[B][8];
#pragma unroll
        for (int b = 0; b < B; b++) {
            if (b < n) {
                const float4* p = (const float4*)(x + (size_t)b * k) + 2 * c;
                const float4 a = p[0], e = p[1];
                xv[b][0] = a.x; xv[b][1] = a.y; xv[b][2] = a.z; xv[b][3] = a.w;
                xv[b][4] = e.x; xv[b][5] = e.y; xv[b][6] = e.z; xv[b][7] = e.w;
            }
        }
#pragma unroll
        for (int j = 0; j < R; j++) {
            float wv[8];
            load8<T>(rows[j], c, wv);
#pragma unroll
            for (int b = 0; b < B; b++)
                if (b < n)
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[j][b] += wv[i] * xv[b][i];
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

// out (+)= x · wᵀ.
template <int T, int B>
__device__ __forceinline__ void matvec(const u8* w, const float* x, float* out, int m, int k,
                                       int n, int accumulate) {
    const int r0 = blockIdx.x * blockDim.y + threadIdx.y;
    const bool valid = r0 < m;
    const int r = valid ? r0 : m - 1;  // idle rows still reach combine_parts' barrier
    const u8* rows[1] = {w + (size_t)r * row_bytes<T>(k)};
    float acc[1][B];
    dot_rows<T, B, 1>(rows, x, k, n, acc);
    if (combine_parts<1, B>(acc) && valid)
#pragma unroll
        for (int b = 0; b < B; b++)
            if (b < n) {
                float* o = out + (size_t)b * m + r;
                *o = accumulate ? *o + acc[0][b] : acc[0][b];
            }
}

// Three projections of the same x (Q, K, V) in one launch: rows [0, m0) of the grid go
// to w0, the next m1 to w1, the last m2 to w2.
template <int T, int B>
__device__ __forceinline__ void matvec3(const u8* w0, const u8* w1, const u8* w2, float* o0,
                                        float* o1, float* o2, int m0, int m1, int m2,
                                        const float* x, int k, int n) {
    int r = blockIdx.x * blockDim.y + threadIdx.y;
    bool valid = true;
    const u8* w;
    float* out;
    int m;
    if (r < m0) { w = w0; out = o0; m = m0; }
    else if (r < m0 + m1) { r -= m0; w = w1; out = o1; m = m1; }
    else if (r < m0 + m1 + m2) { r -= m0 + m1; w = w2; out = o2; m = m2; }
    else { r = 0; w = w0; out = o0; m = m0; valid = false; }
    const u8* rows[1] = {w + (size_t)r * row_bytes<T>(k)};
    float acc[1][B];
    dot_rows<T, B, 1>(rows, x, k, n, acc);
    if (combine_parts<1, B>(acc) && valid)
#pragma unroll
        for (int b = 0; b < B; b++)
            if (b < n) out[(size_t)b * m + r] = acc[0][b];
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh_act(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

// out = act(x · gateᵀ) * (x · upᵀ): a warp reads row r of gate and of up together.
template <int T, int B>
__device__ __forceinline__ void gate_up(const u8* wg, const u8* wu, const float* x, float* out,
                                        int m, int k, int n, int gelu) {
    const int r0 = blockIdx.x * blockDim.y + threadIdx.y;
    const bool valid = r0 < m;
    const int r = valid ? r0 : m - 1;  // idle rows still reach combine_parts' barrier
    const size_t off = (size_t)r * row_bytes<T>(k);
    const u8* rows[2] = {wg + off, wu + off};
    float acc[2][B];
    dot_rows<T, B, 2>(rows, x, k, n, acc);
    if (combine_parts<2, B>(acc) && valid)
#pragma unroll
        for (int b = 0; b < B; b++)
            if (b < n) {
                const float g = acc[0][b];
                out[(size_t)b * m + r] = (gelu ? gelu_tanh_act(g) : silu(g)) * acc[1][b];
            }
}

#define MATVEC_KERNELS(T, NAME, B)                                                           \
    extern "C" __global__ void matvec_##NAME##_##B(const u8* w, const float* x, float* out,  \
                                                   int m, int k, int n, int accumulate) {    \
        matvec<T, B>(w, x, out, m, k, n, accumulate);                                        \
    }                                                                                        \
    extern "C" __global__ void matvec3_##NAME##_##B(                                         \
        const u8* w0, const u8* w1, const u8* w2, float* o0, float* o1, float* o2, int m0,   \
        int m1, int m2, const float* x, int k, int n) {                                      \
        matvec3<T, B>(w0, w1, w2, o0, o1, o2, m0, m1, m2, x, k, n);                          \
    }                                                                                        \
    extern "C" __global__ void gate_up_##NAME##_##B(const u8* wg, const u8* wu,              \
                                                    const float* x, float* out, int m,       \
                                                    int k, int n, int gelu) {                \
        gate_up<T, B>(wg, wu, x, out, m, k, n, gelu);                                        \
    }
#define MATVEC_TYPE(T, NAME) \
    MATVEC_KERNELS(T, NAME, 1) MATVEC_KERNELS(T, NAME, 2) MATVEC_KERNELS(T, NAME, 4) MATVEC_KERNELS(T, NAME, 8)

// Float weights only: quantized weights take the int8 path of matvec_q8.cu.
MATVEC_TYPE(W_F32, f32)
MATVEC_TYPE(W_F16, f16)
MATVEC_TYPE(W_BF16, bf16)
