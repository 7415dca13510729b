// out[b, r] = sum_k x[b, k] * w[r, k] for a few rows b of x (batch 1..8): decode and
// small batches, where reading the weights once is the whole cost.
//
// One warp per weight row (or pair of rows). Lanes walk the row's 32-value units, so a
// warp reads a run of consecutive blocks (coalesced); each unit is decoded once and used
// for every row of x. x is small and read through the L1 cache.
//
// Kernels come per weight type and per batch bound B (1, 2, 4, 8), so that decode
// (B = 1) keeps few registers. Launch: block (32, 4), grid (ceil(rows / 4)).
// x rows must be 16-byte aligned (k a multiple of 4).

// acc[j][b] = dot(w row j, x row b) for R weight rows read side by side; every lane
// ends with the full sums.
template <int T, int B, int R>
__device__ __forceinline__ void dot_rows(const u8* const rows[R], const float* __restrict__ x,
                                         int k, int n, float acc[R][B]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = 0.0f;
    const int units = k / 32;
    for (int u = lane; u < units; u += 32) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            float wv[32];
            load_unit<T>(rows[j], u, wv);
#pragma unroll
            for (int b = 0; b < B; b++) {
                if (b < n) {
                    const float4* xv = (const float4*)(x + (size_t)b * k + (size_t)u * 32);
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 v = xv[i];
                        s += wv[4 * i] * v.x + wv[4 * i + 1] * v.y + wv[4 * i + 2] * v.z +
                             wv[4 * i + 3] * v.w;
                    }
                    acc[j][b] += s;
                }
            }
        }
    }
    if (Fmt<T>::BLOCK == 1) {
        // Plain float rows may end in a partial unit.
        for (int i = units * 32 + lane; i < k; i += 32) {
#pragma unroll
            for (int j = 0; j < R; j++) {
                float wi = load_one<T>(rows[j], i);
#pragma unroll
                for (int b = 0; b < B; b++)
                    if (b < n) acc[j][b] += wi * x[(size_t)b * k + i];
            }
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
    const int r = blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= m) return;
    const u8* rows[1] = {w + (size_t)r * row_bytes<T>(k)};
    float acc[1][B];
    dot_rows<T, B, 1>(rows, x, k, n, acc);
    if ((threadIdx.x & 31) == 0)
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
    const u8* w;
    float* out;
    int m;
    if (r < m0) { w = w0; out = o0; m = m0; }
    else if (r < m0 + m1) { r -= m0; w = w1; out = o1; m = m1; }
    else if (r < m0 + m1 + m2) { r -= m0 + m1; w = w2; out = o2; m = m2; }
    else return;
    const u8* rows[1] = {w + (size_t)r * row_bytes<T>(k)};
    float acc[1][B];
    dot_rows<T, B, 1>(rows, x, k, n, acc);
    if ((threadIdx.x & 31) == 0)
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
    const int r = blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= m) return;
    const size_t off = (size_t)r * row_bytes<T>(k);
    const u8* rows[2] = {wg + off, wu + off};
    float acc[2][B];
    dot_rows<T, B, 2>(rows, x, k, n, acc);
    if ((threadIdx.x & 31) == 0)
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

MATVEC_TYPE(W_F32, f32)
MATVEC_TYPE(W_F16, f16)
MATVEC_TYPE(W_BF16, bf16)
MATVEC_TYPE(W_Q8_0, q8_0)
MATVEC_TYPE(W_Q4_0, q4_0)
MATVEC_TYPE(W_Q4_K, q4_k)
MATVEC_TYPE(W_Q6_K, q6_k)
