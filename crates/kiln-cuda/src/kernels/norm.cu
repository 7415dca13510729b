// Row normalisations and softmax: one block per row, the row reduced in registers and
// shared memory, then written once.

// out = x / sqrt(mean(x^2) + eps) * w.   Launch: grid (rows), block 256.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int dim, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// out = (x - mean) / sqrt(var + eps) * w + b.   Launch: grid (rows), block 256.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ b, float* __restrict__ out,
                                      int dim, float eps) {
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
