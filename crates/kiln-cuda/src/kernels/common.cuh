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

__device__ __forceinline__ u16 load_u16(const u8* p) { return *(const u16*)p; }

// ---- ggml block formats (byte layouts as in ggml-common.h) ----

// Q8_0: f16 d, 32 x i8.  Q4_0: f16 d, 16 bytes (low nibbles: values 0..15, high: 16..31).
// Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.
// Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 x i8 scales, f16 d.
enum WeightType { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_Q8_0 = 3, W_Q4_0 = 4, W_Q4_K = 5, W_Q6_K = 6 };

template <int T> struct Fmt;
template <> struct Fmt<W_F32>  { static constexpr int BLOCK = 1,   BYTES = 4; };
template <> struct Fmt<W_F16>  { static constexpr int BLOCK = 1,   BYTES = 2; };
template <> struct Fmt<W_BF16> { static constexpr int BLOCK = 1,   BYTES = 2; };
template <> struct Fmt<W_Q8_0> { static constexpr int BLOCK = 32,  BYTES = 34; };
template <> struct Fmt<W_Q4_0> { static constexpr int BLOCK = 32,  BYTES = 18; };
template <> struct Fmt<W_Q4_K> { static constexpr int BLOCK = 256, BYTES = 144; };
template <> struct Fmt<W_Q6_K> { static constexpr int BLOCK = 256, BYTES = 210; };

// Bytes of a row of k values.
template <int T> __device__ __forceinline__ size_t row_bytes(int k) {
    return (size_t)(k / Fmt<T>::BLOCK) * Fmt<T>::BYTES;
}

// Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
__device__ __forceinline__ void q4k_scale_min(int j, const u8* s, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Decode unit `u` (values 32u .. 32u+31) of a row whose data starts at `row`.
// Float rows must hold the whole unit (callers handle a row's tail themselves).
template <int T> __device__ __forceinline__ void load_unit(const u8* row, int u, float w[32]);

template <> __device__ __forceinline__ void load_unit<W_F32>(const u8* row, int u, float w[32]) {
    const float* p = (const float*)row + (size_t)u * 32;
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
__device__ __forceinline__ void load_unit_half(const u8* row, int u, float w[32]) {
    const u16* p = (const u16*)row + (size_t)u * 32;
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

template <> __device__ __forceinline__ void load_unit<W_F16>(const u8* row, int u, float w[32]) {
    load_unit_half<W_F16>(row, u, w);
}

template <> __device__ __forceinline__ void load_unit<W_BF16>(const u8* row, int u, float w[32]) {
    load_unit_half<W_BF16>(row, u, w);
}

template <> __device__ __forceinline__ void load_unit<W_Q8_0>(const u8* row, int u, float w[32]) {
    const u8* b = row + (size_t)u * 34;
    const float d = f16_to_f32(load_u16(b));
    // The quants sit at an even offset: read them as 16 pairs.
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u16 pair = load_u16(b + 2 + 2 * i);
        w[2 * i] = d * (float)(i8)(pair & 0xff);
        w[2 * i + 1] = d * (float)(i8)(pair >> 8);
    }
}

template <> __device__ __forceinline__ void load_unit<W_Q4_0>(const u8* row, int u, float w[32]) {
    const u8* b = row + (size_t)u * 18;
    const float d = f16_to_f32(load_u16(b));
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u16 pair = load_u16(b + 2 + 2 * i);
        u32 q0 = pair & 0xff, q1 = pair >> 8;
        w[2 * i] = d * ((float)(q0 & 0xF) - 8.0f);
        w[2 * i + 1] = d * ((float)(q1 & 0xF) - 8.0f);
        w[2 * i + 16] = d * ((float)(q0 >> 4) - 8.0f);
        w[2 * i + 17] = d * ((float)(q1 >> 4) - 8.0f);
    }
}

template <> __device__ __forceinline__ void load_unit<W_Q4_K>(const u8* row, int u, float w[32]) {
    // Blocks are 144 bytes, so with an aligned base every block is 16-byte aligned.
    const u8* b = row + (size_t)(u >> 3) * 144;
    const int j = u & 7;
    const float d = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
    float sc, mn;
    q4k_scale_min(j, b + 4, &sc, &mn);
    const float scale = d * sc, offset = dmin * mn;
    const uint4* q = (const uint4*)(b + 16 + (j >> 1) * 32);
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = q[i];
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int wd = 0; wd < 4; wd++) {
#pragma unroll
            for (int by = 0; by < 4; by++) {
                u32 q4 = (words[wd] >> (8 * by + shift)) & 0xF;
                w[16 * i + 4 * wd + by] = scale * (float)q4 - offset;
            }
        }
    }
}

template <> __device__ __forceinline__ void load_unit<W_Q6_K>(const u8* row, int u, float w[32]) {
    const u8* b = row + (size_t)(u >> 3) * 210;
    const int j = u & 7, half = j >> 2, t = j & 3;
    const u8* ql = b + 64 * half + 32 * (t & 1);
    const u8* qh = b + 128 + 32 * half;
    const i8* sc = (const i8*)(b + 192) + 8 * half + 2 * t;
    const float d = f16_to_f32(load_u16(b + 208));
    const int lshift = 4 * (t >> 1), hshift = 2 * t;
    const float s0 = d * (float)sc[0], s1 = d * (float)sc[1];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u16 lo = load_u16(ql + 2 * i), hi = load_u16(qh + 2 * i);
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int l = 2 * i + e;
            int q = (((lo >> (8 * e)) >> lshift) & 0xF) | ((((hi >> (8 * e)) >> hshift) & 3) << 4);
            w[l] = (l < 16 ? s0 : s1) * (float)(q - 32);
        }
    }
}

// Plain float types: one value at index i of a row.
template <int T> __device__ __forceinline__ float load_one(const u8* row, int i) {
    if (T == W_F32) return ((const float*)row)[i];
    if (T == W_F16) return f16_to_f32(((const u16*)row)[i]);
    return bf16_to_f32(((const u16*)row)[i]);
}

// Matvec kernels may split a row over blockDim.z warps (threadIdx.z = part; short rows
// then still have enough loads in flight). After each warp has summed its part, this
// adds the parts up in shared memory; true for the one thread (lane 0, part 0) that then
// holds the row's totals and writes them. Every thread of the block must call it.
template <int R, int B>
__device__ __forceinline__ bool combine_parts(float acc[R][B]) {
    const int lane = threadIdx.x & 31;
    if (blockDim.z == 1) return lane == 0;
    __shared__ float parts[8][8][16];  // [part][row of the block][R * B]
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
