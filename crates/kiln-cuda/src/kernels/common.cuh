// Shared by every kiln kernel: integer types, half-precision conversions without CUDA's
// headers (NVRTC then needs no include paths), warp reductions, and the decoding of ggml
// blocks into floats, written once for every op that reads weights.
//
// Weights are decoded in units of 32 consecutive values of a row. A unit is one block
// for Q8_0/Q4_0, one sub-block for Q4_K/Q6_K, and 32 plain values for F32/F16/BF16.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90 and later; kernels.rs launches every kernel with
// it): a kernel's blocks may be scheduled while the kernel before it finishes, so the
// launch latency hides behind the previous kernel's tail. Every kernel calls this
// first: it waits until the previous kernel has completed and its writes are visible,
// then lets the next kernel be scheduled (only once all of this grid's blocks have run
// it, so the next kernel never takes the place of one of ours).
__device__ __forceinline__ void follow_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024). `scratch` holds 32
// floats; every thread gets the total.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// GELU with the tanh approximation (what GPT-2 and Gemma use).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

__device__ __forceinline__ u16 load_u16(const u8* p) { return *(const u16*)p; }

// float(q) for 0 <= q < 2^23, exactly, without the conversion unit (a quarter of the
// arithmetic rate): q's bits under the exponent of 2^23, less 2^23. Decoding quants
// does one per value.
__device__ __forceinline__ float exact_float(u32 q) { return __int_as_float(0x4B000000u | q) - 8388608.0f; }

// Two floats rounded to f16, `lo` in the low half (one instruction on sm_80 and later).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
#endif
}

// ---- ggml block formats (byte layouts as in ggml-common.h) ----

// Q8_0: f16 d, 32 x i8.  Q4_0: f16 d, 16 bytes (low nibbles: values 0..15, high: 16..31).
// Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.
// Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 x i8 scales, f16 d.
//
// On the GPU a quantized tensor is stored split (done at upload by kiln_core::quant::gpu_layout): first the
// quant bytes of every block, in order (QBYTES per block), then the rest of every block
// (its scales and mins, in their order within the block). The bits are ggml's; the split
// only puts the quants of a row at 16-byte aligned addresses, so a lane reads 16 bytes of
// them at once (ggml's 18-, 34- and 210-byte blocks are only 2-byte aligned).
enum WeightType { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_Q8_0 = 3, W_Q4_0 = 4, W_Q4_K = 5, W_Q6_K = 6 };

template <int T> struct Fmt;
template <> struct Fmt<W_F32>  { static constexpr int BLOCK = 1,   BYTES = 4,   QBYTES = 4; };
template <> struct Fmt<W_F16>  { static constexpr int BLOCK = 1,   BYTES = 2,   QBYTES = 2; };
template <> struct Fmt<W_BF16> { static constexpr int BLOCK = 1,   BYTES = 2,   QBYTES = 2; };
template <> struct Fmt<W_Q8_0> { static constexpr int BLOCK = 32,  BYTES = 34,  QBYTES = 32; };
template <> struct Fmt<W_Q4_0> { static constexpr int BLOCK = 32,  BYTES = 18,  QBYTES = 16; };
template <> struct Fmt<W_Q4_K> { static constexpr int BLOCK = 256, BYTES = 144, QBYTES = 128; };
template <> struct Fmt<W_Q6_K> { static constexpr int BLOCK = 256, BYTES = 210, QBYTES = 192; };

// Row r of a [rows, k] weight: its quants (for float types, its values) and, for
// quantized types, its blocks' scales (`meta`, BYTES - QBYTES per block).
struct WRow {
    const u8* q;
    const u8* meta;
};

template <int T> __device__ __forceinline__ WRow weight_row(const u8* w, int rows, int k, int r) {
    const size_t blocks = (size_t)(k / Fmt<T>::BLOCK);
    constexpr int META = Fmt<T>::BYTES - Fmt<T>::QBYTES;
    return WRow{w + (size_t)r * blocks * Fmt<T>::QBYTES,
                w + (size_t)rows * blocks * Fmt<T>::QBYTES + (size_t)r * blocks * META};
}

// Decode unit `u` (values 32u .. 32u+31) of a row.
// Float rows must hold the whole unit (callers handle a row's tail themselves).
template <int T> __device__ __forceinline__ void load_unit(WRow row, int u, float w[32]);

template <> __device__ __forceinline__ void load_unit<W_F32>(WRow row, int u, float w[32]) {
    const float* p = (const float*)row.q + (size_t)u * 32;
    if ((((size_t)p) & 15) == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = ((const float4*)p)[i];
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = p[i];
    }
}

template <int T>
__device__ __forceinline__ void load_unit_half(WRow row, int u, float w[32]) {
    const u16* p = (const u16*)row.q + (size_t)u * 32;
    if ((((size_t)p) & 15) == 0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 v = ((const uint4*)p)[i];
            u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                u16 lo = words[j] & 0xffff, hi = words[j] >> 16;
                w[8 * i + 2 * j] = T == W_F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
                w[8 * i + 2 * j + 1] = T == W_F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = T == W_F16 ? f16_to_f32(p[i]) : bf16_to_f32(p[i]);
    }
}

template <> __device__ __forceinline__ void load_unit<W_F16>(WRow row, int u, float w[32]) {
    load_unit_half<W_F16>(row, u, w);
}

template <> __device__ __forceinline__ void load_unit<W_BF16>(WRow row, int u, float w[32]) {
    load_unit_half<W_BF16>(row, u, w);
}

// The 32 bytes at p (16-byte aligned) as eight words.
__device__ __forceinline__ void load_words8(const u8* p, u32 words[8]) {
    const uint4 a = ((const uint4*)p)[0], b = ((const uint4*)p)[1];
    words[0] = a.x; words[1] = a.y; words[2] = a.z; words[3] = a.w;
    words[4] = b.x; words[5] = b.y; words[6] = b.z; words[7] = b.w;
}

// A quantized unit's bytes as loaded, before decoding: a kernel can issue the loads of
// the next unit and decode them only after other work, while they are in flight.
template <int T> struct Unit;
template <int T> __device__ __forceinline__ Unit<T> fetch_unit(WRow row, int u);
template <int T> __device__ __forceinline__ void decode_unit(const Unit<T>& raw, float w[32]);

// Quantized types: fetch, then decode.
template <int T> __device__ __forceinline__ void load_unit(WRow row, int u, float w[32]) {
    decode_unit<T>(fetch_unit<T>(row, u), w);
}

template <> struct Unit<W_Q8_0> { u32 q[8]; u16 d; };

template <> __device__ __forceinline__ Unit<W_Q8_0> fetch_unit<W_Q8_0>(WRow row, int u) {
    Unit<W_Q8_0> raw;
    raw.d = load_u16(row.meta + 2 * (size_t)u);
    load_words8(row.q + (size_t)u * 32, raw.q);
    return raw;
}

template <> __device__ __forceinline__ void decode_unit<W_Q8_0>(const Unit<W_Q8_0>& raw, float w[32]) {
    const float d = f16_to_f32(raw.d);
    // Bytes flipped to offset binary: q + 128, exact.
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = d * (exact_float((raw.q[i / 4] >> (8 * (i % 4)) & 0xFF) ^ 0x80) - 128.0f);
}

template <> struct Unit<W_Q4_0> { u32 q[4]; u16 d; };

template <> __device__ __forceinline__ Unit<W_Q4_0> fetch_unit<W_Q4_0>(WRow row, int u) {
    Unit<W_Q4_0> raw;
    raw.d = load_u16(row.meta + 2 * (size_t)u);
    const uint4 v = ((const uint4*)row.q)[u];
    raw.q[0] = v.x; raw.q[1] = v.y; raw.q[2] = v.z; raw.q[3] = v.w;
    return raw;
}

template <> __device__ __forceinline__ void decode_unit<W_Q4_0>(const Unit<W_Q4_0>& raw, float w[32]) {
    const float d = f16_to_f32(raw.d);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const u32 q = (raw.q[i / 4] >> (8 * (i % 4))) & 0xFF;
        w[i] = d * (exact_float(q & 0xF) - 8.0f);
        w[i + 16] = d * (exact_float(q >> 4) - 8.0f);
    }
}

// Q4_K: `meta` is the block's 16 bytes (f16 d, f16 dmin, 12 bytes of 6-bit scales and
// mins; 16-byte aligned in the split layout); `j` the sub-block.
template <> struct Unit<W_Q4_K> { u32 q[8]; uint4 meta; int j; };

template <> __device__ __forceinline__ Unit<W_Q4_K> fetch_unit<W_Q4_K>(WRow row, int u) {
    Unit<W_Q4_K> raw;
    const int blk = u >> 3;
    raw.j = u & 7;
    raw.meta = *(const uint4*)(row.meta + (size_t)blk * 16);
    // Sub-blocks 2c and 2c + 1 share the 32 bytes of chunk c: low and high nibbles.
    load_words8(row.q + (size_t)blk * 128 + (raw.j >> 1) * 32, raw.q);
    return raw;
}

// Byte i (0..11) of the three words after a Q4_K block's d and dmin.
__device__ __forceinline__ u32 q4k_scale_byte(const uint4& meta, int i) {
    const u32 word = i < 4 ? meta.y : (i < 8 ? meta.z : meta.w);
    return (word >> (8 * (i & 3))) & 0xFF;
}

template <> __device__ __forceinline__ void decode_unit<W_Q4_K>(const Unit<W_Q4_K>& raw, float w[32]) {
    const int j = raw.j;
    const float d = f16_to_f32(raw.meta.x & 0xFFFF), dmin = f16_to_f32(raw.meta.x >> 16);
    // ggml's get_scale_min_k4.
    float sc, mn;
    if (j < 4) {
        sc = (float)(q4k_scale_byte(raw.meta, j) & 63);
        mn = (float)(q4k_scale_byte(raw.meta, j + 4) & 63);
    } else {
        const u32 b = q4k_scale_byte(raw.meta, j + 4);
        sc = (float)((b & 0xF) | ((q4k_scale_byte(raw.meta, j - 4) >> 6) << 4));
        mn = (float)((b >> 4) | ((q4k_scale_byte(raw.meta, j) >> 6) << 4));
    }
    const float scale = d * sc, offset = dmin * mn;
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 32; i++)
        w[i] = scale * exact_float((raw.q[i / 4] >> (8 * (i % 4) + shift)) & 0xF) - offset;
}

// Q6_K: the low-nibble and high-pair bytes of the unit, its two i8 scales (one per 16
// values) and the block's d; `t` the unit's place within its half block.
template <> struct Unit<W_Q6_K> { u32 lo[8], hi[8]; u16 scales, d; int t; };

template <> __device__ __forceinline__ Unit<W_Q6_K> fetch_unit<W_Q6_K>(WRow row, int u) {
    Unit<W_Q6_K> raw;
    const int blk = u >> 3, j = u & 7, half = j >> 2;
    raw.t = j & 3;
    const u8* b = row.q + (size_t)blk * 192;
    const u8* m = row.meta + (size_t)blk * 18;
    load_words8(b + 64 * half + 32 * (raw.t & 1), raw.lo);
    load_words8(b + 128 + 32 * half, raw.hi);
    raw.scales = load_u16(m + 8 * half + 2 * raw.t);
    raw.d = load_u16(m + 16);
    return raw;
}

template <> __device__ __forceinline__ void decode_unit<W_Q6_K>(const Unit<W_Q6_K>& raw, float w[32]) {
    const float d = f16_to_f32(raw.d);
    const int lshift = 4 * (raw.t >> 1), hshift = 2 * raw.t;
    const float s0 = d * (float)(i8)(raw.scales & 0xFF), s1 = d * (float)(i8)(raw.scales >> 8);
#pragma unroll
    for (int l = 0; l < 32; l++) {
        const int sh = 8 * (l % 4);
        const int q = ((raw.lo[l / 4] >> (sh + lshift)) & 0xF) | (((raw.hi[l / 4] >> (sh + hshift)) & 3) << 4);
        w[l] = (l < 16 ? s0 : s1) * (exact_float(q) - 32.0f);
    }
}

// A decoded unit rounded to f16 at dst (16-byte aligned): four 16-byte stores.
__device__ __forceinline__ void store_unit_f16(const float v[32], u16* dst) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) h[j] = pack_f16x2(v[8 * i + 2 * j], v[8 * i + 2 * j + 1]);
        ((uint4*)dst)[i] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

// Plain float types: one value at index i of a row.
template <int T> __device__ __forceinline__ float load_one(WRow row, int i) {
    if (T == W_F32) return ((const float*)row.q)[i];
    if (T == W_F16) return f16_to_f32(((const u16*)row.q)[i]);
    return bf16_to_f32(((const u16*)row.q)[i]);
}

// Matvec kernels may split a row over blockDim.z warps (threadIdx.z = part; short rows
// then still have enough loads in flight). After each warp has summed its part, this
// adds the parts up in shared memory; true for the one thread (lane 0, part 0) that then
// holds the row's totals and writes them. Every thread of the block must call it.
template <int R, int B>
__device__ __forceinline__ bool combine_parts(float acc[R][B]) {
    const int lane = threadIdx.x & 31;
    if (blockDim.z == 1) return lane == 0;
    static_assert(R * B <= 32, "combine_parts holds 32 sums a warp");
    __shared__ float parts[4][4][32];  // [part (at most 4)][warp of the block][R * B]
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < R; j++)
#pragma unroll
            for (int b = 0; b < B; b++) parts[threadIdx.z][threadIdx.y][j * B + b] = acc[j][b];
    __syncthreads();
    if (threadIdx.z != 0 || lane != 0) return false;
    for (int z = 1; z < blockDim.z; z++)
#pragma unroll
        for (int j = 0; j < R; j++)
#pragma unroll
            for (int b = 0; b < B; b++) acc[j][b] += parts[z][threadIdx.y][j * B + b];
    return true;
}
