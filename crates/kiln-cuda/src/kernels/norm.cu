// Row normalisations and softmax: one block per row, the row reduced in registers and
// shared memory, then written once.

// out = x / sqrt(mean(x^2) + eps) * w.   Launch: grid (rows), block of up to 1024 (a
// row is one step of float4 per thread where possible: at n = 1 a longer loop would be
// a chain of memory latencies).
//
// With xq non-null (dim a multiple of 32) the kernel also writes out rounded to int8 per
// 32 values, as quantize_x_q8 does, for the quantized matvec that reads it next: a
// launch fewer. Eight consecutive lanes hold a 32-value unit; they find its largest
// magnitude by shuffles.
//
// With out_half non-null (dim a multiple of 4) it also writes out rounded to bf16 (bf) or
// f16 as f32_to_half does, and with x_copy non-null a copy of x: what training keeps of a
// norm under 16-bit products (its input for the backward, its output for the products
// that read it), in the pass that reads x anyway.
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm(const float* __restrict__ x, const float* __restrict__ w,
             float* __restrict__ out, i8* __restrict__ xq,
             float* __restrict__ xd, int dim, float eps, float* __restrict__ x_copy,
             u16* __restrict__ out_half, int bf) {
    follow_previous();
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    if ((dim & 3) == 0) {
        const float4* x4 = (const float4*)xr;
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            const float4 v = x4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)dim + eps);
    if ((dim & 3) == 0) {
        const float4* x4 = (const float4*)xr;
        const float4* w4 = (const float4*)w;
        float4* o4 = (float4*)o;
        // Every thread runs every round (the shuffles need whole warps).
        for (int base = 0; base < dim / 4; base += blockDim.x) {
            const int i = base + threadIdx.x;
            const bool here = i < dim / 4;
            float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (here) {
                const float4 v = x4[i], g = w4[i];
                r = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
                o4[i] = r;
                const size_t at = (size_t)blockIdx.x * dim + 4 * i;
                if (x_copy != nullptr) *(float4*)(x_copy + at) = v;
                if (out_half != nullptr) {
                    auto half = [bf](float f) -> u32 { return bf ? f32_to_bf16(f) : f32_to_f16(f); };
                    *(uint2*)(out_half + at) =
                        make_uint2(half(r.x) | (half(r.y) << 16), half(r.z) | (half(r.w) << 16));
                }
            }
            if (xq != nullptr) {
                float amax = fmaxf(fmaxf(fabsf(r.x), fabsf(r.y)), fmaxf(fabsf(r.z), fabsf(r.w)));
#pragma unroll
                for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                const float d = amax / 127.0f;
                const float id = d > 0.0f ? 1.0f / d : 0.0f;
                if (here) {
                    const u32 q = (u32)(u8)(i8)__float2int_rn(r.x * id) |
                                  ((u32)(u8)(i8)__float2int_rn(r.y * id) << 8) |
                                  ((u32)(u8)(i8)__float2int_rn(r.z * id) << 16) |
                                  ((u32)(u8)(i8)__float2int_rn(r.w * id) << 24);
                    ((u32*)(xq + (size_t)blockIdx.x * dim))[i] = q;
                    if ((i & 7) == 0) xd[((size_t)blockIdx.x * dim + 4 * i) / 32] = d;
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
    }
}

// out = (x - mean) / sqrt(var + eps) * w + b.   Launch: grid (rows), block up to 1024.
extern "C" __global__ void __launch_bounds__(1024)
    layer_norm(const float* __restrict__ x, const float* __restrict__ w,
               const float* __restrict__ b, float* __restrict__ out,
               int dim, float eps) {
    follow_previous();
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, scratch) / (float)dim;
    // Second pass over the row (it is in cache): a variance free of cancellation.
    float v = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float d = xr[i] - mean;
        v += d * d;
    }
    const float inv = rsqrtf(block_sum(v, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = (xr[i] - mean) * inv * w[i] + b[i];
}

// Softmax of each row in place.   Launch: grid (rows), block 256.
extern "C" __global__ void softmax(float* x, int cols) {
    follow_previous();
    __shared__ float scratch[32];
    float* r = x + (size_t)blockIdx.x * cols;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, r[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float e = expf(r[i] - m);
        r[i] = e;
        s += e;
    }
    const float inv = 1.0f / block_sum(s, scratch);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) r[i] *= inv;
}
