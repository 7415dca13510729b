// Quantized weights times activations rounded to 8 bits, for decode and small batches.
//
// The float matvec reads 4 bytes of x for every weight, several times a Q4_0 weight's
// bytes: the L1 traffic, not the weights, set its pace. Here x is first quantized per 32
// values (an f32 scale and 32 int8, as llama.cpp's q8_1 and kiln's CPU path do), and
// each weight unit meets it in integer dot products (dp4a: four byte products a cycle).
// The stored formats' offsets and mins are folded in with the sum of the x quants.

// x [n, k] f32 -> xq [n, k] int8 and xd [n, k / 32] scales (k a multiple of 32).
// Launch: 1-D, one thread per 32 values.
extern "C" __global__ void quantize_x_q8(const float* __restrict__ x, i8* __restrict__ xq,
                                         float* __restrict__ xd, int units) {
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= units) return;
    const float4* src = (const float4*)(x + (size_t)u * 32);
    float v[32];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 f = src[i];
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(f.x), fabsf(f.y)), fmaxf(fabsf(f.z), fabsf(f.w))));
    }
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    u32 words[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 w = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) w |= ((u32)(u8)(i8)__float2int_rn(v[4 * i + j] * id)) << (8 * j);
        words[i] = w;
    }
    uint4* dst = (uint4*)(xq + (size_t)u * 32);
    dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
    dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
    xd[u] = d;
}

__device__ __forceinline__ int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }

__device__ __forceinline__ int load_i32_2(const u8* p) {
    // Two 16-bit loads: ggml blocks of 18, 34 and 210 bytes are only 2-byte aligned.
    return (int)((u32)load_u16(p) | ((u32)load_u16(p + 2) << 16));
}

__device__ __forceinline__ int load_i32(const i8* p) { return *(const int*)p; }

__device__ __forceinline__ int byte_sum(int v) { return __dp4a(v, 0x01010101, 0); }

// A row is walked in "items": a few bytes of quants that one lane takes at a time, so
// that the 32 lanes of a warp read consecutive bytes (coalesced loads). Each format
// says how many items a block has, decodes one (`load`), and dots it with a row of x
// (`dot`: xq the row's int8 values, xd its per-32 scales).
template <int T> struct Item;

// Q4_0: 4 items per block; item j holds bytes 4j..4j+3 of the quants: values 4j.. (low
// nibbles) and 16 + 4j.. (high nibbles).
template <> struct Item<W_Q4_0> {
    static constexpr int PER_BLOCK = 4;
    float d;
    int lo, hi, blk, j;
    __device__ __forceinline__ void load(const u8* row, int item) {
        blk = item >> 2;
        j = item & 3;
        const u8* b = row + (size_t)blk * 18;
        d = f16_to_f32(load_u16(b));
        const int q = load_i32_2(b + 2 + 4 * j);
        lo = q & 0x0F0F0F0F;
        hi = (q >> 4) & 0x0F0F0F0F;
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const i8* x = xq + blk * 32;
        const int xa = load_i32(x + 4 * j), xb = load_i32(x + 16 + 4 * j);
        const int s = __dp4a(lo, xa, __dp4a(hi, xb, 0)) - 8 * (byte_sum(xa) + byte_sum(xb));
        return d * xd[blk] * (float)s;
    }
};

// Q8_0: 4 items per block of 8 values each.
template <> struct Item<W_Q8_0> {
    static constexpr int PER_BLOCK = 4;
    float d;
    int q0, q1, blk, j;
    __device__ __forceinline__ void load(const u8* row, int item) {
        blk = item >> 2;
        j = item & 3;
        const u8* b = row + (size_t)blk * 34;
        d = f16_to_f32(load_u16(b));
        q0 = load_i32_2(b + 2 + 8 * j);
        q1 = load_i32_2(b + 6 + 8 * j);
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const i8* x = xq + blk * 32 + 8 * j;
        const int s = __dp4a(q0, load_i32(x), __dp4a(q1, load_i32(x + 4), 0));
        return d * xd[blk] * (float)s;
    }
};

// Q4_K: 32 items per block, one per 4 bytes of its 128 bytes of nibbles: item i lies in
// chunk c = i / 8 of 32 bytes, whose low nibbles are sub-block 2c and high nibbles
// sub-block 2c + 1; l = 4 (i % 8) is the offset inside both.
template <> struct Item<W_Q4_K> {
    static constexpr int PER_BLOCK = 32;
    float da, ma, db, mb;  // scale and min of both sub-blocks, d and dmin applied
    int lo, hi, blk, c, l;
    __device__ __forceinline__ void load(const u8* row, int item) {
        blk = item >> 5;
        const int i = item & 31;
        c = i >> 3;
        l = 4 * (i & 7);
        const u8* b = row + (size_t)blk * 144;
        const float d = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
        float sc, mn;
        q4k_scale_min(2 * c, b + 4, &sc, &mn);
        da = d * sc;
        ma = dmin * mn;
        q4k_scale_min(2 * c + 1, b + 4, &sc, &mn);
        db = d * sc;
        mb = dmin * mn;
        const int q = *(const int*)(b + 16 + 32 * c + l);
        lo = q & 0x0F0F0F0F;
        hi = (q >> 4) & 0x0F0F0F0F;
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const int ua = blk * 8 + 2 * c;  // x units of the two sub-blocks
        const int xa = load_i32(xq + ua * 32 + l), xb = load_i32(xq + (ua + 1) * 32 + l);
        return xd[ua] * (da * (float)__dp4a(lo, xa, 0) - ma * (float)byte_sum(xa)) +
               xd[ua + 1] * (db * (float)__dp4a(hi, xb, 0) - mb * (float)byte_sum(xb));
    }
};

// Q6_K: 32 items per block, one per 4 bytes of its 128 bytes of low nibbles. Byte L of
// that array (half h = L / 64, l = L % 64) gives, in its low nibble, value 128h + l
// (quarter t = 0 or 1 for l < 32 or not) and, in its high nibble, value 128h + 64 + l
// (t + 2); the top two bits come from byte 32h + l % 32 of qh, at bit 2t.
template <> struct Item<W_Q6_K> {
    static constexpr int PER_BLOCK = 32;
    float sa, sb;  // d times the scales of the two 16-value groups
    int qa, qb, blk, unit_a, off;
    __device__ __forceinline__ void load(const u8* row, int item) {
        blk = item >> 5;
        const int L = 4 * (item & 31), h = L >> 6, l = L & 63, t = l >> 5;
        off = l & 31;
        const u8* b = row + (size_t)blk * 210;
        const u32 ql = (u32)load_i32_2(b + L);
        const u32 qh = (u32)load_i32_2(b + 128 + 32 * h + off);
        qa = (int)((ql & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4));
        qb = (int)(((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * t + 4)) & 0x03030303) << 4));
        const i8* sc = (const i8*)(b + 192) + 8 * h + off / 16;
        const float d = f16_to_f32(load_u16(b + 208));
        sa = d * (float)sc[2 * t];
        sb = d * (float)sc[2 * t + 4];
        unit_a = blk * 8 + 4 * h + t;  // x unit of the low-nibble values; +2 for the high
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const int xa = load_i32(xq + unit_a * 32 + off), xb = load_i32(xq + (unit_a + 2) * 32 + off);
        return xd[unit_a] * sa * (float)(__dp4a(qa, xa, 0) - 32 * byte_sum(xa)) +
               xd[unit_a + 2] * sb * (float)(__dp4a(qb, xb, 0) - 32 * byte_sum(xb));
    }
};

// acc[j][b] = dot(weight row j, x row b) for R rows side by side; every lane ends with
// the full sums.
template <int T, int B, int R>
__device__ __forceinline__ void dot_rows_q8(const u8* const rows[R], const i8* __restrict__ xq,
                                            const float* __restrict__ xd, int k, int n,
                                            float acc[R][B]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = 0.0f;
    const int items = k / Fmt<T>::BLOCK * Item<T>::PER_BLOCK;
#pragma unroll 2
    for (int i = threadIdx.z * 32 + lane; i < items; i += 32 * blockDim.z) {
#pragma unroll
        for (int j = 0; j < R; j++) {
            Item<T> it;
            it.load(rows[j], i);
#pragma unroll
            for (int b = 0; b < B; b++)
                if (b < n) acc[j][b] += it.dot(xq + (size_t)b * k, xd + (size_t)b * (k / 32));
        }
    }
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = warp_sum(acc[j][b]);
}

template <int T, int B>
__device__ __forceinline__ void matvec_q8(const u8* w, const i8* xq, const float* xd, float* out,
                                          int m, int k, int n, int accumulate) {
    const int r0 = blockIdx.x * blockDim.y + threadIdx.y;
    const bool valid = r0 < m;
    const int r = valid ? r0 : m - 1;  // idle rows still reach combine_parts' barrier
    const u8* rows[1] = {w + (size_t)r * row_bytes<T>(k)};
    float acc[1][B];
    dot_rows_q8<T, B, 1>(rows, xq, xd, k, n, acc);
    if (combine_parts<1, B>(acc) && valid)
#pragma unroll
        for (int b = 0; b < B; b++)
            if (b < n) {
                float* o = out + (size_t)b * m + r;
                *o = accumulate ? *o + acc[0][b] : acc[0][b];
            }
}

template <int T, int B>
__device__ __forceinline__ void matvec3_q8(const u8* w0, const u8* w1, const u8* w2, float* o0,
                                           float* o1, float* o2, int m0, int m1, int m2,
                                           const i8* xq, const float* xd, int k, int n) {
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
    dot_rows_q8<T, B, 1>(rows, xq, xd, k, n, acc);
    if (combine_parts<1, B>(acc) && valid)
#pragma unroll
        for (int b = 0; b < B; b++)
            if (b < n) out[(size_t)b * m + r] = acc[0][b];
}

template <int T, int B>
__device__ __forceinline__ void gate_up_q8(const u8* wg, const u8* wu, const i8* xq,
                                           const float* xd, float* out, int m, int k, int n,
                                           int gelu) {
    const int r0 = blockIdx.x * blockDim.y + threadIdx.y;
    const bool valid = r0 < m;
    const int r = valid ? r0 : m - 1;  // idle rows still reach combine_parts' barrier
    const size_t off = (size_t)r * row_bytes<T>(k);
    const u8* rows[2] = {wg + off, wu + off};
    float acc[2][B];
    dot_rows_q8<T, B, 2>(rows, xq, xd, k, n, acc);
    if (combine_parts<2, B>(acc) && valid)
#pragma unroll
        for (int b = 0; b < B; b++)
            if (b < n) {
                const float g = acc[0][b];
                out[(size_t)b * m + r] = (gelu ? gelu_tanh_act(g) : silu(g)) * acc[1][b];
            }
}

#define MATVEC_Q8_KERNELS(T, NAME, B)                                                        \
    extern "C" __global__ void matvec_q8x_##NAME##_##B(const u8* w, const i8* xq,            \
                                                       const float* xd, float* out, int m,   \
                                                       int k, int n, int accumulate) {       \
        matvec_q8<T, B>(w, xq, xd, out, m, k, n, accumulate);                                \
    }                                                                                        \
    extern "C" __global__ void matvec3_q8x_##NAME##_##B(                                     \
        const u8* w0, const u8* w1, const u8* w2, float* o0, float* o1, float* o2, int m0,   \
        int m1, int m2, const i8* xq, const float* xd, int k, int n) {                       \
        matvec3_q8<T, B>(w0, w1, w2, o0, o1, o2, m0, m1, m2, xq, xd, k, n);                  \
    }                                                                                        \
    extern "C" __global__ void gate_up_q8x_##NAME##_##B(const u8* wg, const u8* wu,          \
                                                        const i8* xq, const float* xd,       \
                                                        float* out, int m, int k, int n,     \
                                                        int gelu) {                          \
        gate_up_q8<T, B>(wg, wu, xq, xd, out, m, k, n, gelu);                                \
    }
#define MATVEC_Q8_TYPE(T, NAME)                                                    \
    MATVEC_Q8_KERNELS(T, NAME, 1) MATVEC_Q8_KERNELS(T, NAME, 2)                    \
    MATVEC_Q8_KERNELS(T, NAME, 4) MATVEC_Q8_KERNELS(T, NAME, 8)

MATVEC_Q8_TYPE(W_Q8_0, q8_0)
MATVEC_Q8_TYPE(W_Q4_0, q4_0)
MATVEC_Q8_TYPE(W_Q4_K, q4_k)
MATVEC_Q8_TYPE(W_Q6_K, q6_k)
