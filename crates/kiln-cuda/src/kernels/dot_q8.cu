// Dot products of quantized weight rows with activations rounded to 8 bits, for the
// matvec kernels of matvec.cu (decode and small batches).
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
    follow_previous();
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

// A warp's 32 values (one a lane, consecutive in memory) rounded to int8 into q[lane]
// with their scale into *d, as quantize_x_q8 rounds a 32-value unit: for kernels whose
// output a quantized matvec reads next. Every lane of the warp calls it.
__device__ __forceinline__ void quantize_warp_unit(float v, i8* q, float* d) {
    const float amax = warp_max(fabsf(v));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    q[threadIdx.x & 31] = (i8)__float2int_rn(v * inv);
    if ((threadIdx.x & 31) == 0) *d = scale;
}

// The activations of a quantized-weight matvec: x [n, k] as int8 (16-byte aligned rows)
// and one f32 scale per 32 values.
struct XQ8 {
    const i8* q;
    const float* d;
};

// sum_i a[i] * b[i] over 16 int8 pairs.
__device__ __forceinline__ int dot16(int4 a, int4 b) {
    return __dp4a(a.x, b.x, __dp4a(a.y, b.y, __dp4a(a.z, b.z, __dp4a(a.w, b.w, 0))));
}

// The sum of 16 int8.
__device__ __forceinline__ int sum16(int4 b) {
    return __dp4a(b.x, 0x01010101, __dp4a(b.y, 0x01010101,
                  __dp4a(b.z, 0x01010101, __dp4a(b.w, 0x01010101, 0))));
}

__device__ __forceinline__ int4 low_nibbles(int4 q) {
    return make_int4(q.x & 0x0F0F0F0F, q.y & 0x0F0F0F0F, q.z & 0x0F0F0F0F, q.w & 0x0F0F0F0F);
}

__device__ __forceinline__ int4 high_nibbles(int4 q) {
    return make_int4((q.x >> 4) & 0x0F0F0F0F, (q.y >> 4) & 0x0F0F0F0F, (q.z >> 4) & 0x0F0F0F0F,
                     (q.w >> 4) & 0x0F0F0F0F);
}

__device__ __forceinline__ int4 load16(const void* p) { return *(const int4*)p; }

// A row is walked in "items" of 16 quant bytes, one aligned 16-byte load per lane, lane
// l of a warp taking items l, l + 32, ... (so a warp reads 512 consecutive bytes). Each
// format says how many items a block has, loads one (`load`: its quants and the scales
// they need) and dots it with a row of x (`dot`: q the row's int8 values, d its per-32
// scales).
template <int T> struct Item;

// Q8_0: 2 items per block, 16 values each.
template <> struct Item<W_Q8_0> {
    static constexpr int PER_BLOCK = 2;
    float d;
    int4 q;
    int item;
    __device__ __forceinline__ void load(WRow row, int i) {
        item = i;
        q = load16(row.q + 16 * (size_t)i);
        d = f16_to_f32(load_u16(row.meta + 2 * (i >> 1)));
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        return d * xd[item >> 1] * (float)dot16(q, load16(xq + 16 * item));
    }
};

// Q4_0: 1 item per block: low nibbles are values 0..15, high nibbles 16..31.
template <> struct Item<W_Q4_0> {
    static constexpr int PER_BLOCK = 1;
    float d;
    int4 q;
    int blk;
    __device__ __forceinline__ void load(WRow row, int i) {
        blk = i;
        q = load16(row.q + 16 * (size_t)i);
        d = f16_to_f32(load_u16(row.meta + 2 * i));
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const int4 xa = load16(xq + 32 * blk), xb = load16(xq + 32 * blk + 16);
        const int s = dot16(low_nibbles(q), xa) + dot16(high_nibbles(q), xb) -
                      8 * (sum16(xa) + sum16(xb));
        return d * xd[blk] * (float)s;
    }
};

// Q4_K: 8 items per block. Item j lies in chunk c = j / 2 of 32 bytes, whose low nibbles
// are sub-block 2c and high nibbles sub-block 2c + 1; l = 16 (j % 2) is the offset of
// its 16 values inside both. The block's 16 bytes of scales come in one load.
template <> struct Item<W_Q4_K> {
    static constexpr int PER_BLOCK = 8;
    float da, ma, db, mb;  // scale and min of both sub-blocks, d and dmin applied
    int4 q;
    int unit_a, l;
    __device__ __forceinline__ void load(WRow row, int i) {
        const int blk = i >> 3, j = i & 7, c = j >> 1;
        l = 16 * (j & 1);
        unit_a = blk * 8 + 2 * c;
        q = load16(row.q + 16 * (size_t)i);
        const uint4 meta = *(const uint4*)(row.meta + 16 * (size_t)blk);
        const float d = f16_to_f32((u16)(meta.x & 0xffff)), dmin = f16_to_f32((u16)(meta.x >> 16));
        // Scales and mins of sub-blocks 2c and 2c + 1, in registers (ggml's
        // get_scale_min_k4 on the 12 bytes meta.y, meta.z, meta.w). c < 2 reads 6-bit
        // fields; c >= 2 joins 4 bits with the top 2 bits of the first 8 bytes. Both
        // are computed and one kept, so lanes of a warp do not diverge.
        const int sh = 16 * (c & 1);  // byte (2c) % 4 of each word, and the next
        const u32 s0 = meta.y >> sh, s1 = meta.z >> sh, s2 = meta.w >> sh;  // two bytes each
        const bool high = c >= 2;
        const u32 sc_lo = s0 & 0x3F3F, mn_lo = s1 & 0x3F3F;
        const u32 sc_hi = (s2 & 0x0F0F) | ((s0 >> 2) & 0x3030);
        const u32 mn_hi = ((s2 >> 4) & 0x0F0F) | ((s1 >> 2) & 0x3030);
        const u32 scs = high ? sc_hi : sc_lo, mns = high ? mn_hi : mn_lo;
        da = d * (float)(scs & 0xFF);
        db = d * (float)((scs >> 8) & 0xFF);
        ma = dmin * (float)(mns & 0xFF);
        mb = dmin * (float)((mns >> 8) & 0xFF);
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const int4 xa = load16(xq + 32 * unit_a + l), xb = load16(xq + 32 * (unit_a + 1) + l);
        return xd[unit_a] * (da * (float)dot16(low_nibbles(q), xa) - ma * (float)sum16(xa)) +
               xd[unit_a + 1] * (db * (float)dot16(high_nibbles(q), xb) - mb * (float)sum16(xb));
    }
};

// Q6_K: 8 items per block, one per 16 bytes of its 128 bytes of low nibbles. Byte L of
// that array (half h = L / 64, l = L % 64) gives, in its low nibble, value 128h + l
// (quarter t = 0 or 1 for l < 32 or not) and, in its high nibble, value 128h + 64 + l
// (t + 2); the top two bits come from byte 32h + l % 32 of qh, at bit 2t (and 2t + 4).
template <> struct Item<W_Q6_K> {
    static constexpr int PER_BLOCK = 8;
    float sa, sb;  // d times the scales of the two 16-value groups
    int4 qa, qb;
    int unit_a, off;
    __device__ __forceinline__ void load(WRow row, int i) {
        const int blk = i >> 3, L = 16 * (i & 7), h = L >> 6, l = L & 63, t = l >> 5;
        off = l & 31;
        const u8* b = row.q + 192 * (size_t)blk;
        const int4 ql = load16(b + L), qh = load16(b + 128 + 32 * h + off);
        const int sh = 2 * t;
        const int lo[4] = {ql.x, ql.y, ql.z, ql.w}, hi[4] = {qh.x, qh.y, qh.z, qh.w};
        int a[4], c[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            a[e] = (lo[e] & 0x0F0F0F0F) | (((hi[e] >> sh) & 0x03030303) << 4);
            c[e] = ((lo[e] >> 4) & 0x0F0F0F0F) | (((hi[e] >> (sh + 4)) & 0x03030303) << 4);
        }
        qa = make_int4(a[0], a[1], a[2], a[3]);
        qb = make_int4(c[0], c[1], c[2], c[3]);
        const u8* m = row.meta + 18 * (size_t)blk;
        const i8* sc = (const i8*)m + 8 * h + off / 16;
        const float d = f16_to_f32(load_u16(m + 16));
        sa = d * (float)sc[2 * t];
        sb = d * (float)sc[2 * t + 4];
        unit_a = blk * 8 + 4 * h + t;  // x unit of the low-nibble values; +2 for the high
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd) const {
        const int4 xa = load16(xq + 32 * unit_a + off), xb = load16(xq + 32 * (unit_a + 2) + off);
        return xd[unit_a] * sa * (float)(dot16(qa, xa) - 32 * sum16(xa)) +
               xd[unit_a + 2] * sb * (float)(dot16(qb, xb) - 32 * sum16(xb));
    }
};

// acc[j][b] = dot(weight row j, x row b) for R rows side by side, over this warp's part
// of the row (see combine_parts); every lane ends with the warp's sums.
template <int T, int B, int R>
__device__ __forceinline__ void dot_rows(const WRow rows[R], XQ8 in, int k, int n,
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
                if (b < n) acc[j][b] += it.dot(in.q + (size_t)b * k, in.d + (size_t)b * (k / 32));
        }
    }
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[j][b] = warp_sum(acc[j][b]);
}
