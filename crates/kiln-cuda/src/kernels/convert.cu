// Conversions feeding cuBLAS: for prompts, weights of any stored type decoded to f16
// (quantized types) and activations rounded to f16 or bf16 to match the weights; for
// training's backward, frozen weights decoded to f32.

// Decode a whole [m, k] weight matrix to f16, one 32-value unit per thread.
// Launch: 1-D, one thread per unit (m * k / 32 of them); k a multiple of 32.
template <int T>
__device__ void dequant_f16(const u8* __restrict__ w, u16* __restrict__ out, int m, int k) {
    follow_previous();
    const size_t units_per_row = k / 32;
    const size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (size_t)m * units_per_row) return;
    const size_t r = g / units_per_row;
    const int u = (int)(g % units_per_row);
    float v[32];
    load_unit<T>(weight_row<T>(w, m, k, (int)r), u, v);
    store_unit_f16(v, out + r * k + (size_t)u * 32);
}

extern "C" __global__ void dequant_f16_q8_0(const u8* w, u16* out, int m, int k) { dequant_f16<W_Q8_0>(w, out, m, k); }
extern "C" __global__ void dequant_f16_q4_0(const u8* w, u16* out, int m, int k) { dequant_f16<W_Q4_0>(w, out, m, k); }
extern "C" __global__ void dequant_f16_q4_k(const u8* w, u16* out, int m, int k) { dequant_f16<W_Q4_K>(w, out, m, k); }
extern "C" __global__ void dequant_f16_q6_k(const u8* w, u16* out, int m, int k) { dequant_f16<W_Q6_K>(w, out, m, k); }

// Rows [r0, r0 + rows) of a stored [m, k] quantized weight decoded to f32, as training's
// backward reads a frozen weight (QLoRA). Launch: 1-D, a thread per 32-value unit of the
// rows; k a multiple of the block.
template <int T>
__device__ void dequant_rows_f32(const u8* __restrict__ w, float* __restrict__ out, int m, int k, int r0,
                                 int rows) {
    follow_previous();
    const size_t units_per_row = k / 32;
    const size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (size_t)rows * units_per_row) return;
    const size_t r = g / units_per_row;
    const int u = (int)(g % units_per_row);
    float v[32];
    load_unit<T>(weight_row<T>(w, m, k, r0 + (int)r), u, v);
    float4* dst = (float4*)(out + r * k + (size_t)u * 32);
#pragma unroll
    for (int i = 0; i < 8; i++) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

#define DEQUANT_ROWS_F32(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const u8* w, float* out, int m, int k, int r0, int rows) {     \
        dequant_rows_f32<T>(w, out, m, k, r0, rows);                                             \
    }
DEQUANT_ROWS_F32(dequant_rows_f32_q8_0, W_Q8_0)
DEQUANT_ROWS_F32(dequant_rows_f32_q4_0, W_Q4_0)
DEQUANT_ROWS_F32(dequant_rows_f32_q4_k, W_Q4_K)
DEQUANT_ROWS_F32(dequant_rows_f32_q6_k, W_Q6_K)

// x [n] f16 (or bf16 when `bf16`) -> out [n] f32. Launch: 1-D, n threads.
extern "C" __global__ void half_to_f32(const u16* __restrict__ x, float* __restrict__ out, size_t n,
                                       int bf16) {
    follow_previous();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16 ? bf16_to_f32(x[i]) : f16_to_f32(x[i]);
}

// x [n] f32 -> out [n] f16, or bf16 when `bf16`: four values a thread (one 16-byte load,
// one 8-byte store). Launch: 1-D, ceil(n / 4) threads.
extern "C" __global__ void f32_to_half(const float* __restrict__ x, u16* __restrict__ out,
                                       size_t n, int bf16) {
    follow_previous();
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n) {
        const float4 v = *(const float4*)(x + i);
        const float f[4] = {v.x, v.y, v.z, v.w};
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) h[j] = bf16 ? f32_to_bf16(f[j]) : f32_to_f16(f[j]);
        *(uint2*)(out + i) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    } else {
        for (size_t j = i; j < n; j++) out[j] = bf16 ? f32_to_bf16(x[j]) : f32_to_f16(x[j]);
    }
}

// out[i, :] = table[ids[i], :] decoded to f32; an id outside the table gives zeros.
// Launch: grid (n), block 256.
template <int T>
__device__ void embedding(const u8* __restrict__ table, const int* __restrict__ ids,
                          float* __restrict__ out, int rows, int dim) {
    follow_previous();
    const int i = blockIdx.x;
    const int id = ids[i];
    float* o = out + (size_t)i * dim;
    if (id < 0 || id >= rows) {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = 0.0f;
        return;
    }
    const WRow row = weight_row<T>(table, rows, dim, id);
    const int units = dim / 32;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        float v[32];
        load_unit<T>(row, u, v);
#pragma unroll
        for (int j = 0; j < 32; j++) o[u * 32 + j] = v[j];
    }
    if (Fmt<T>::BLOCK == 1)
        for (int c = units * 32 + threadIdx.x; c < dim; c += blockDim.x) o[c] = load_one<T>(row, c);
}

#define EMBEDDING(T, NAME)                                                                   \
    extern "C" __global__ void NAME(const u8* table, const int* ids, float* out, int rows,   \
                                    int dim) {                                               \
        embedding<T>(table, ids, out, rows, dim);                                            \
    }
EMBEDDING(W_F32, embedding_f32)
EMBEDDING(W_F16, embedding_f16)
EMBEDDING(W_BF16, embedding_bf16)
EMBEDDING(W_Q8_0, embedding_q8_0)
EMBEDDING(W_Q4_0, embedding_q4_0)
EMBEDDING(W_Q4_K, embedding_q4_k)
EMBEDDING(W_Q6_K, embedding_q6_k)
