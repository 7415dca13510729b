// Row normalisations and softmax: one block per row, the row reduced in registers and
// shared memory, then written once.

// out = x / sqrt(mean(x^2) + eps) * w.   Launch: grid (rows), block of up to 1024 (a
// row is one step of float4 per thread where possible: at n = 1 a longer loop would be
// a chain of memory latencies).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int dim, float eps) {
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
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            const float4 v = x4[i], g = w4[i];
            o4[i] = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
    }
}

// out = (x - mean) / sqrt(var + eps) * w + b.   Launch: grid (rows), block up to 1024.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ w,
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
