// The KV cache's element types (kiln_core::DType::KV_CACHE) and how kernels read and
// write them, for attention.cu and rope.cu and the row writes below.
//
// A cache holds `elements` values ([rows, kv_heads, D]). F32 as it is; F16 and BF16 in 16
// bits each; Q8_0 in blocks of 32 (D a multiple of 32), stored split as every quantized
// tensor is on the GPU (common.cuh): the quant of element e at byte e, then the f16 scale
// of every block, block b's at byte `elements + 2b`. Writes convert from f32 as
// Backend::write_rows states: round to nearest even; Q8_0 as ggml's quantize_row_q8_0
// (scale max|x| / 127, values round(x * (1/scale)), ties away from zero).

enum KvType { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

// Four values from element e (a multiple of 4) of a cache.
template <int KV>
__device__ __forceinline__ float4 kv_load4(const u8* __restrict__ c, size_t e, size_t elements) {
    if (KV == KV_F32) return *(const float4*)((const float*)c + e);
    if (KV == KV_Q8_0) {
        const u32 w = *(const u32*)(c + e);
        const float d = f16_to_f32(load_u16(c + elements + 2 * (e / 32)));
        return make_float4((float)(i8)w * d, (float)(i8)(w >> 8) * d, (float)(i8)(w >> 16) * d,
                           (float)(i8)(w >> 24) * d);
    }
    const uint2 w = *(const uint2*)((const u16*)c + e);
    const u16 h[4] = {(u16)w.x, (u16)(w.x >> 16), (u16)w.y, (u16)(w.y >> 16)};
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = KV == KV_F16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
    return make_float4(v[0], v[1], v[2], v[3]);
}

// Eight values from element e (a multiple of 8) of a cache, as stored: one 16-byte read
// (two for F32, 8 bytes and a scale for Q8_0), held until `at` decodes them, so that a
// thread keeps several reads in flight in few registers.
template <int KV>
struct Kv8 {
    uint4 w[KV == KV_F32 ? 2 : 1];
    float d;  // Q8_0's block scale

    __device__ __forceinline__ void load(const u8* __restrict__ c, size_t e, size_t elements) {
        if (KV == KV_F32) {
            w[0] = *(const uint4*)((const float*)c + e);
            w[KV == KV_F32 ? 1 : 0] = *(const uint4*)((const float*)c + e + 4);
        } else if (KV == KV_Q8_0) {
            const uint2 q = *(const uint2*)(c + e);
            w[0] = make_uint4(q.x, q.y, 0u, 0u);
            d = f16_to_f32(load_u16(c + elements + 2 * (e / 32)));
        } else {
            w[0] = *(const uint4*)((const u16*)c + e);
        }
    }

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < (KV == KV_F32 ? 2 : 1); i++) w[i] = make_uint4(0u, 0u, 0u, 0u);
        d = 0.0f;
    }

    // Value i (0..8, known at compile time where it is called unrolled).
    __device__ __forceinline__ float at(int i) const {
        if (KV == KV_F32) {
            const uint4 v = w[i >> 2];
            const u32 x = (i & 3) == 0 ? v.x : (i & 3) == 1 ? v.y : (i & 3) == 2 ? v.z : v.w;
            return __uint_as_float(x);
        }
        const u32 word = (i >> 1) == 0 ? w[0].x : (i >> 1) == 1 ? w[0].y : (i >> 1) == 2 ? w[0].z : w[0].w;
        if (KV == KV_Q8_0) {
            const u32 q = i < 4 ? w[0].x : w[0].y;
            return (float)(i8)(q >> (8 * (i & 3))) * d;
        }
        const u16 h = (u16)(word >> (16 * (i & 1)));
        return KV == KV_F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
};

// Where position kp's key and value lie: the cache row itself, or through a block table
// (NO_ROW for an entry outside the pool or past the table).
struct KvRows {
    const int* table;  // null for one sequence's cache
    int max_blocks, block, pool_rows;
    static constexpr size_t NO_ROW = ~(size_t)0;
    __device__ __forceinline__ size_t row(int kp) const {
        if (table == nullptr) return (size_t)kp;
        if (kp / block >= max_blocks) return NO_ROW;
        const int b = table[kp / block];
        const size_t r = (size_t)b * block + kp % block;
        return b < 0 || r >= (size_t)pool_rows ? NO_ROW : r;
    }
    // The row of position c0 when positions c0 .. c0 + n - 1 lie in consecutive rows
    // (always without a table; with one, when they share a block that lies in the pool),
    // else NO_ROW (then each position's row is looked up alone).
    __device__ __forceinline__ size_t run(int c0, int n) const {
        if (table == nullptr) return (size_t)c0;
        const int bi = c0 / block, off = c0 - bi * block;
        if (off + n > block || bi >= max_blocks) return NO_ROW;
        const int b = table[bi];
        const size_t r = (size_t)b * block + off;
        return b < 0 || r + n > (size_t)pool_rows ? NO_ROW : r;
    }
};

// Element e of a cache.
template <int KV>
__device__ __forceinline__ float kv_load1(const u8* __restrict__ c, size_t e, size_t elements) {
    if (KV == KV_F32) return ((const float*)c)[e];
    if (KV == KV_F16) return f16_to_f32(((const u16*)c)[e]);
    if (KV == KV_BF16) return bf16_to_f32(((const u16*)c)[e]);
    return (float)((const i8*)c)[e] * f16_to_f32(load_u16(c + elements + 2 * (e / 32)));
}

// Write the n values of `src` (global or shared memory) at elements e0.. of a cache,
// converted to its type. Every thread of the (1-D, whole-warp) block calls it; for Q8_0,
// e0 and n are whole blocks, each taken by one warp.
template <int KV>
__device__ void kv_store_row(u8* __restrict__ c, size_t elements, size_t e0, const float* src,
                             int n) {
    if (KV == KV_Q8_0) {
        const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
        for (int b = threadIdx.x >> 5; b < n / 32; b += warps) {
            const float x = src[32 * b + lane];
            const float d = warp_max(fabsf(x)) / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const size_t e = e0 + 32 * b + lane;
            ((i8*)c)[e] = (i8)roundf(x * id);
            if (lane == 0) *(u16*)(c + elements + 2 * (e / 32)) = f32_to_f16(d);
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float x = src[i];
        if (KV == KV_F32) ((float*)c)[e0 + i] = x;
        if (KV == KV_F16) ((u16*)c)[e0 + i] = f32_to_f16(x);
        if (KV == KV_BF16) ((u16*)c)[e0 + i] = f32_to_bf16(x);
    }
}

// dst[pos[r], :] = src[r, :] (rows of row_len f32 values) in the cache's type; rows whose
// position is outside dst's dst_rows are skipped (the host checks positions it wrote; a
// recorded step cannot report). Launch: grid (rows), block 256.
template <int KV>
__device__ void write_rows_body(const float* src, u8* dst, const int* pos, int row_len,
                                int dst_rows) {
    follow_previous();
    const int p = pos[blockIdx.x];
    if (p < 0 || p >= dst_rows) return;
    kv_store_row<KV>(dst, (size_t)dst_rows * row_len, (size_t)p * row_len,
                     src + (size_t)blockIdx.x * row_len, row_len);
}

#define WRITE_ROWS(KV, NAME)                                                                 \
    extern "C" __global__ void write_rows_##NAME(const float* src, u8* dst, const int* pos, \
                                                 int row_len, int dst_rows) {             \
        write_rows_body<KV>(src, dst, pos, row_len, dst_rows);                            \
    }
WRITE_ROWS(KV_F32, f32)
WRITE_ROWS(KV_F16, f16)
WRITE_ROWS(KV_BF16, bf16)
WRITE_ROWS(KV_Q8_0, q8_0)

// Rows of a cache copied as stored into a larger one: row r of src (row_bytes bytes) to
// row pos[r] of dst, skipped outside dst's dst_rows. A Q8_0 cache is copied in two
// launches, its quants and its scales. Launch: grid (rows), block 256.
extern "C" __global__ void copy_rows(const u8* src, u8* dst, const int* pos, int row_bytes,
                                     int dst_rows) {
    follow_previous();
    const int p = pos[blockIdx.x];
    if (p < 0 || p >= dst_rows) return;
    const u8* s = src + (size_t)blockIdx.x * row_bytes;
    u8* d = dst + (size_t)p * row_bytes;
    for (int i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = s[i];
}
