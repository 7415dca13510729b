// Products of a batch's rows (9-64 of them: a server's decode step) with quantized
// weights on tensor cores: out[n, m] = x[n, k] · w[m, k]ᵀ.
//
// Each weight is read from memory once for every TC_BN activation rows (once a step up
// to 64 rows): a block decodes a tile of weight rows, one unit of 32 values a row at a
// time, into f16 in shared memory, and multiplies it with the same unit of each of its
// activation rows (x, already rounded to f16) by mma.m16n8k16 with f32 accumulators.
// The rounding is that of the decoded-copy-and-cuBLAS path it replaces: weights decoded
// to f32, then rounded to f16, products summed in f32.
// Two units' loads are in flight while one is multiplied from shared memory; a unit is
// decoded as it is stored there.
//
// Launch: grid (ceil(m / TC_BM), ceil(n / TC_BN), parts), block TC_THREADS; k a multiple
// of 32. Part z takes units [z · units_per_part, ...) of every row; with more than one
// part each writes its sums to parts[z, n, m] and gemm_tc_sum adds them in part order,
// so a row's result never depends on the other rows of the batch.

#define TC_BM 128
#define TC_BN 64
#define TC_THREADS 128
// Halfs a shared row holds: a unit and 8 of padding, so that the 8 rows one ldmatrix
// reads start in different banks.
#define TC_ROW 40

// One thread's unit of a weight row, as loaded; decoded to f16 as it is stored.
template <int T> struct TcUnit {
    Unit<T> raw;
    __device__ __forceinline__ void fetch(WRow row, int u) { raw = fetch_unit<T>(row, u); }
    __device__ __forceinline__ void store(u16* dst) const {
        float v[32];
        decode_unit<T>(raw, v);
        store_unit_f16(v, dst);
    }
};

// What one thread loads of a unit: its weight row's unit, and two 16-byte pieces of x
// (activation rows c / 4, quarters c % 4 of the unit, for c = tid and tid + TC_THREADS).
template <int T> struct TcStage {
    TcUnit<T> unit;
    uint4 x[2];
    __device__ __forceinline__ void fetch(WRow row, const u16* const xsrc[2], int xrows, int u) {
        unit.fetch(row, u);
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (i * TC_THREADS + (int)threadIdx.x < 4 * xrows) x[i] = *(const uint4*)(xsrc[i] + (size_t)u * 32);
    }
    __device__ __forceinline__ void store(u16* wdst, u16* xbuf, const int xdst[2], int xrows) const {
        unit.store(wdst);
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (i * TC_THREADS + (int)threadIdx.x < 4 * xrows) *(uint4*)(xbuf + xdst[i]) = x[i];
    }
};

// The block's products of one unit from shared memory: warp w's 32 weight rows times
// PAIRS pairs of 8-row activation tiles. PAIRS is a template argument so that a unit's
// loads and products have no branch between them: the compiler issues the matrix loads
// together and the products back to back (a runtime test per pair made every product
// wait on its own load; found on the F16 form of this kernel).
template <int PAIRS>
__device__ __forceinline__ void tc_multiply(const u16* wb, const u16* xb, float acc[2][8][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < 32; kk += 16) {
        u32 a[2][4], b[PAIRS][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
            ldmatrix_x4(a[mt], wb + (mt * 16 + (lane & 15)) * TC_ROW + kk + (lane >> 4) * 8);
#pragma unroll
        for (int p = 0; p < PAIRS; p++)
            ldmatrix_x4(b[p], xb + (p * 16 + ((lane >> 4) << 3) + (lane & 7)) * TC_ROW + kk +
                                  ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int p = 0; p < PAIRS; p++)
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                mma_16816(acc[mt][2 * p], a[mt], b[p][0], b[p][1]);
                mma_16816(acc[mt][2 * p + 1], a[mt], b[p][2], b[p][3]);
            }
    }
}

// tc_multiply for the `pairs` (1-4) pairs of 8-row tiles that hold rows of x, the choice
// made once a unit.
__device__ __forceinline__ void tc_multiply_pairs(const u16* wb, const u16* xb, int pairs, float acc[2][8][4]) {
    switch (pairs) {
        case 1: tc_multiply<1>(wb, xb, acc); break;
        case 2: tc_multiply<2>(wb, xb, acc); break;
        case 3: tc_multiply<3>(wb, xb, acc); break;
        default: tc_multiply<4>(wb, xb, acc); break;
    }
}

template <int T>
__device__ void gemm_tc(const u8* __restrict__ w, const u16* __restrict__ x,
                        float* __restrict__ out, float* __restrict__ parts, int m, int k, int n,
                        int units_per_part, int accumulate) {
    follow_previous();
    __shared__ __align__(16) u16 ws[2][TC_BM * TC_ROW];
    __shared__ __align__(16) u16 xs[2][TC_BN * TC_ROW];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.x * TC_BM, n0 = blockIdx.y * TC_BN;
    const int u0 = blockIdx.z * units_per_part, u1 = min(k / 32, u0 + units_per_part);
    // Rows past the matrix's end read its last row: their sums are never written. Rows
    // of x past n are not loaded: what their place in shared memory holds only reaches
    // sums that are never written either.
    const WRow row = weight_row<T>(w, m, k, min(m0 + tid, m - 1));
    const int xrows = min(TC_BN, n - n0);
    const u16* xsrc[2];
    int xdst[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int c = tid + TC_THREADS * i, r = c >> 2, q = c & 3;
        xsrc[i] = x + (size_t)min(n0 + r, n - 1) * k + q * 8;
        xdst[i] = r * TC_ROW + q * 8;
    }
    u16* wdst[2] = {ws[0] + tid * TC_ROW, ws[1] + tid * TC_ROW};
    const u16* wsrc[2] = {ws[0] + warp * 32 * TC_ROW, ws[1] + warp * 32 * TC_ROW};

    // Two units' loads in flight while one is multiplied: `even` holds the units at even
    // offsets from u0 (shared buffer 0), `odd` the others (buffer 1).
    TcStage<T> even, odd;
    even.fetch(row, xsrc, xrows, u0);
    if (u0 + 1 < u1) odd.fetch(row, xsrc, xrows, u0 + 1);
    even.store(wdst[0], xs[0], xdst, xrows);
    __syncthreads();
    if (u0 + 2 < u1) even.fetch(row, xsrc, xrows, u0 + 2);

    float acc[2][8][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int b = 0; b < 8; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;
    const int pairs = (xrows + 15) / 16;  // pairs of 8-row tiles that hold rows of x

    for (int u = u0; u < u1; u += 2) {
        tc_multiply_pairs(wsrc[0], xs[0], pairs, acc);
        if (u + 1 < u1) odd.store(wdst[1], xs[1], xdst, xrows);
        if (u + 3 < u1) odd.fetch(row, xsrc, xrows, u + 3);
        __syncthreads();
        if (u + 1 >= u1) break;
        tc_multiply_pairs(wsrc[1], xs[1], pairs, acc);
        if (u + 2 < u1) even.store(wdst[0], xs[0], xdst, xrows);
        if (u + 4 < u1) even.fetch(row, xsrc, xrows, u + 4);
        __syncthreads();
    }

    // Accumulator c of tile (mt, nt): weight row g (+8 for c >= 2), activation row
    // 2q + (c & 1) of the tile.
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int mr = m0 + warp * 32 + mt * 16 + g + 8 * (c >> 1);
                const int nr = n0 + nt * 8 + 2 * q + (c & 1);
                if (mr >= m || nr >= n) continue;
                const float v = acc[mt][nt][c];
                if (gridDim.z > 1) {
                    parts[((size_t)blockIdx.z * n + nr) * m + mr] = v;
                } else {
                    float* o = out + (size_t)nr * m + mr;
                    *o = accumulate ? *o + v : v;
                }
            }
}

#define GEMM_TC(T, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                  \
        NAME(const u8* w, const u16* x, float* out, float* parts, int m, int k, int n,        \
             int units_per_part, int accumulate) {                                            \
        gemm_tc<T>(w, x, out, parts, m, k, n, units_per_part, accumulate);                    \
    }
GEMM_TC(W_Q8_0, gemm_tc_q8_0)
GEMM_TC(W_Q4_0, gemm_tc_q4_0)
GEMM_TC(W_Q4_K, gemm_tc_q4_k)
GEMM_TC(W_Q6_K, gemm_tc_q6_k)

// out[i] = (accumulate ? out[i] : 0) + Σ_z parts[z, i], parts added in order.
// Launch: 1-D, one thread per output value.
extern "C" __global__ void gemm_tc_sum(const float* __restrict__ parts, float* __restrict__ out,
                                       size_t len, int count, int accumulate) {
    follow_previous();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float total = parts[i];
    for (int z = 1; z < count; z++) total += parts[(size_t)z * len + i];
    out[i] = accumulate ? out[i] + total : total;
}
