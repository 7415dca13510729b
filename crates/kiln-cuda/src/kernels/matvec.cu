// out[b, r] = sum_k x[b, k] * w[r, k] for a few rows b of x (batch 1..8): decode and
// small batches, where reading the weights once is the whole cost.
//
// A warp takes a few weight rows (below), split over blockDim.z warps when matrices are
// short; each piece of weights is decoded once and used for every row of x.
// The kernels are written once over the activations' form `X` (dot_float.cu: f32 x for
// float weights; dot_q8.cu: int8 x for quantized weights), which picks `dot_rows`.
//
// Kernels come per weight type and per batch bound B (1, 2, 4, 8; F32 up to 4, F16 and
// BF16 only 1), so that decode (B = 1) keeps few registers. Launch: block (32, 4, parts), grid (ceil(rows / (4 rows
// per warp))).

// A warp of matvec and matvec3 takes MATVEC_ROWS_PER_WARP consecutive weight rows, and a
// warp of gate_up GATE_UP_ROWS_PER_WARP rows of each matrix, and reads each piece of x
// once for all of them: with one row a warp, the loads of x (4 bytes per float weight,
// 1 or 2 per quantized one) were as many as the weights' and held the kernel back.
// (matmul.rs sizes the grids with the same numbers.)
#define MATVEC_ROWS_PER_WARP 2
#define GATE_UP_ROWS_PER_WARP 1

// out (+)= x · wᵀ.
template <int T, int B, class X>
__device__ __forceinline__ void matvec(const u8* w, X x, float* out, int m, int k, int n,
                                       int accumulate) {
    follow_previous();
    constexpr int R = MATVEC_ROWS_PER_WARP;
    const int r0 = R * (blockIdx.x * blockDim.y + threadIdx.y);
    WRow rows[R];
#pragma unroll
    for (int j = 0; j < R; j++)  // idle rows read row m - 1 and still reach the barrier
        rows[j] = weight_row<T>(w, m, k, min(r0 + j, m - 1));
    float acc[R][B];
    dot_rows<T, B, R>(rows, x, k, n, acc);
    if (combine_parts<R, B>(acc))
#pragma unroll
        for (int j = 0; j < R; j++)
            if (r0 + j < m)
#pragma unroll
                for (int b = 0; b < B; b++)
                    if (b < n) {
                        float* o = out + (size_t)b * m + r0 + j;
                        *o = accumulate ? *o + acc[j][b] : acc[j][b];
                    }
}

// Three projections of the same x (Q, K, V) in one launch: rows [0, m0) of the grid go
// to w0, the next m1 to w1, the last m2 to w2.
template <int T, int B, class X>
__device__ __forceinline__ void matvec3(const u8* w0, const u8* w1, const u8* w2, float* o0,
                                        float* o1, float* o2, int m0, int m1, int m2, X x,
                                        int k, int n) {
    follow_previous();
    constexpr int R = MATVEC_ROWS_PER_WARP;
    const int g0 = R * (blockIdx.x * blockDim.y + threadIdx.y);
    int r[R], m[R];
    bool valid[R];
    float* out[R];
    WRow rows[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
        int g = g0 + j;
        const u8* wj;
        valid[j] = true;
        if (g < m0) { wj = w0; out[j] = o0; m[j] = m0; }
        else if (g < m0 + m1) { g -= m0; wj = w1; out[j] = o1; m[j] = m1; }
        else if (g < m0 + m1 + m2) { g -= m0 + m1; wj = w2; out[j] = o2; m[j] = m2; }
        else { g = 0; wj = w0; out[j] = o0; m[j] = m0; valid[j] = false; }
        r[j] = g;
        rows[j] = weight_row<T>(wj, m[j], k, g);
    }
    float acc[R][B];
    dot_rows<T, B, R>(rows, x, k, n, acc);
    if (combine_parts<R, B>(acc))
#pragma unroll
        for (int j = 0; j < R; j++)
            if (valid[j])
#pragma unroll
                for (int b = 0; b < B; b++)
                    if (b < n) out[j][(size_t)b * m[j] + r[j]] = acc[j][b];
}

// out = act(x · gateᵀ) * (x · upᵀ): a warp reads rows of gate and of up together.
template <int T, int B, class X>
__device__ __forceinline__ void gate_up(const u8* wg, const u8* wu, X x, float* out, int m,
                                        int k, int n, int gelu) {
    follow_previous();
    constexpr int R = GATE_UP_ROWS_PER_WARP;
    const int r0 = R * (blockIdx.x * blockDim.y + threadIdx.y);
    WRow rows[2 * R];  // gate rows, then up rows
#pragma unroll
    for (int j = 0; j < R; j++) {
        const int r = min(r0 + j, m - 1);
        rows[j] = weight_row<T>(wg, m, k, r);
        rows[R + j] = weight_row<T>(wu, m, k, r);
    }
    float acc[2 * R][B];
    dot_rows<T, B, 2 * R>(rows, x, k, n, acc);
    if (combine_parts<2 * R, B>(acc))
#pragma unroll
        for (int j = 0; j < R; j++)
            if (r0 + j < m)
#pragma unroll
                for (int b = 0; b < B; b++)
                    if (b < n) {
                        const float g = acc[j][b];
                        out[(size_t)b * m + r0 + j] = (gelu ? gelu_tanh(g) : silu(g)) * acc[R + j][b];
                    }
}

// One set of kernels for weight type T, batch bound B and activations X, passed to the
// kernel as the parameters X_PARAMS (in parentheses) and built from them by X_VALUE.
#define UNPAREN(...) __VA_ARGS__
#define MATVEC_KERNELS(T, NAME, B, X_PARAMS, X_VALUE)                                          \
    extern "C" __global__ void matvec_##NAME##_##B(const u8* w, UNPAREN X_PARAMS, float* out,  \
                                                   int m, int k, int n, int accumulate) {      \
        matvec<T, B>(w, X_VALUE, out, m, k, n, accumulate);                                    \
    }                                                                                          \
    extern "C" __global__ void matvec3_##NAME##_##B(const u8* w0, const u8* w1, const u8* w2,  \
                                                    float* o0, float* o1, float* o2, int m0,   \
                                                    int m1, int m2, UNPAREN X_PARAMS, int k,   \
                                                    int n) {                                   \
        matvec3<T, B>(w0, w1, w2, o0, o1, o2, m0, m1, m2, X_VALUE, k, n);                      \
    }                                                                                          \
    extern "C" __global__ void gate_up_##NAME##_##B(const u8* wg, const u8* wu,                \
                                                    UNPAREN X_PARAMS,                          \
                                                    float* out, int m, int k, int n,           \
                                                    int gelu) {                                \
        gate_up<T, B>(wg, wu, X_VALUE, out, m, k, n, gelu);                                    \
    }

#define F32_X_PARAMS (const float* x)
#define F32_X (XF32{x})
#define Q8_X_PARAMS (const i8* xq, const float* xd)
#define Q8_X (XQ8{xq, xd})

#define MATVEC_TYPE(T, NAME, XP, XV)                                                           \
    MATVEC_KERNELS(T, NAME, 1, XP, XV) MATVEC_KERNELS(T, NAME, 2, XP, XV)                      \
    MATVEC_KERNELS(T, NAME, 4, XP, XV) MATVEC_KERNELS(T, NAME, 8, XP, XV)

// F16 and BF16 weights take one row of x here, F32 up to 4; more go to cuBLAS (matmul.rs),
// since f32 x read again for every weight row cost more than the weights' own bytes.
MATVEC_KERNELS(W_F32, f32, 1, F32_X_PARAMS, F32_X)
MATVEC_KERNELS(W_F32, f32, 2, F32_X_PARAMS, F32_X)
MATVEC_KERNELS(W_F32, f32, 4, F32_X_PARAMS, F32_X)
MATVEC_KERNELS(W_F16, f16, 1, F32_X_PARAMS, F32_X)
MATVEC_KERNELS(W_BF16, bf16, 1, F32_X_PARAMS, F32_X)
MATVEC_TYPE(W_Q8_0, q8_0, Q8_X_PARAMS, Q8_X)
MATVEC_TYPE(W_Q4_0, q4_0, Q8_X_PARAMS, Q8_X)
MATVEC_TYPE(W_Q4_K, q4_k, Q8_X_PARAMS, Q8_X)
MATVEC_TYPE(W_Q6_K, q6_k, Q8_X_PARAMS, Q8_X)
