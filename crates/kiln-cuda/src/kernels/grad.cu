// Backward kernels for training (kiln_core::GradOps): each adds into the gradients of an
// op's inputs (`+=`) from the gradient of its output. Reductions over rows run in a
// fixed order (a thread per column walking the rows), never by atomics, so that a step
// gives the same bits every run and a resumed run equals an uninterrupted one.

// The elementwise kernels below that move most of a training step's bytes (the tape's
// copies of saved values, the gated activation's gradient) take four consecutive
// elements a thread, one 16-byte access an operand where every operand's address allows
// it (the allocator's buffers do), else one element at a time: single-element accesses
// reached ~1.7 TB/s on an H100, 16-byte ones ~2.7.
#define GRAD_VEC4(i, n, ptrs) ((i) + 3 < (n) && ((ptrs) & 15) == 0)

// dst = src, 4-byte words (F32 values, I32 ids).   Launch: 1-D over ceil(n / 4).
extern "C" __global__ void grad_copy(u32* dst, const u32* src, size_t n) {
    follow_previous();
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (GRAD_VEC4(i, n, (size_t)dst | (size_t)src)) {
        *(uint4*)(dst + i) = *(const uint4*)(src + i);
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) dst[j] = src[j];
    }
}

// partial[b] = Σ x² over block b's share of x, each square and the sums in f64 (a finite
// x never overflows them). Launch: grid (partials, at most 1024), block 256; the host
// adds the partials in order, so the result is the same every run.
extern "C" __global__ void grad_sum_squares(const float* x, u64 n, double* partial) {
    follow_previous();
    double sum = 0.0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double v = x[i];
        sum += v * v;
    }
    __shared__ double sums[256];
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

// acc += a * x.   Launch: 1-D over ceil(n / 4).
extern "C" __global__ void grad_add_scaled(float* acc, const float* x, size_t n, float a) {
    follow_previous();
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (GRAD_VEC4(i, n, (size_t)acc | (size_t)x)) {
        float4 o = *(float4*)(acc + i);
        const float4 v = *(const float4*)(x + i);
        o.x += a * v.x;
        o.y += a * v.y;
        o.z += a * v.z;
        o.w += a * v.w;
        *(float4*)(acc + i) = o;
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) acc[j] += a * x[j];
    }
}

// acc[c] += sum_r x[r, c].   Launch: 1-D over cols.
extern "C" __global__ void grad_sum_rows(const float* x, float* acc, int rows, int cols) {
    follow_previous();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += x[(size_t)r * cols + c];
    acc[c] += s;
}

// dtable[ids[i], c] += dy[i, c], the tokens in order (an id outside the table is skipped:
// its forward row was zeros). Block (x, y) owns columns 256x .. 256x + 255 of the table
// rows EMB_ROWS · y ..: it reads every id and adds the tokens of its rows, so each
// element's sum still runs over its tokens in order, while the blocks cover the table
// side by side (one thread a column for the whole table was 7 ms over 16,384 tokens).
// Launch: grid (ceil(dim / 256), ceil(vocab / EMB_ROWS)), block 256.
#define EMB_ROWS 128
#define EMB_IDS 2048
extern "C" __global__ void grad_embedding(const float* __restrict__ dy, const int* __restrict__ ids,
                                          float* __restrict__ dtable, int n, int dim, int vocab) {
    follow_previous();
    // The ids a chunk at a time in shared memory: read by every thread, they are the loop.
    __shared__ int chunk[EMB_IDS];
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int r0 = blockIdx.y * EMB_ROWS, r1 = min(vocab, r0 + EMB_ROWS);
    for (int i0 = 0; i0 < n; i0 += EMB_IDS) {
        const int m = min(EMB_IDS, n - i0);
        __syncthreads();
        for (int j = threadIdx.x; j < m; j += blockDim.x) chunk[j] = ids[i0 + j];
        __syncthreads();
        if (c >= dim) continue;
        for (int j = 0; j < m; j++) {
            const int id = chunk[j];
            if (id >= r0 && id < r1) dtable[(size_t)id * dim + c] += dy[(size_t)(i0 + j) * dim + c];
        }
    }
}

// RMSNorm, per row: dx += r*w*dy - x * r^3/dim * sum(dy*w*x) (`=` with `write`), with
// r = (mean(x^2)+eps)^-1/2, kept in rs for the weight's gradient.   Launch: grid (rows), block 256.
extern "C" __global__ void grad_rms_norm_dx(const float* x, const float* w, const float* dy,
                                            float* dx, float* rs, int dim, float eps, int write) {
    follow_previous();
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    const float* d = dy + (size_t)blockIdx.x * dim;
    float* o = dx + (size_t)blockIdx.x * dim;
    float ss = 0.0f, dot = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        ss += xr[i] * xr[i];
        dot += d[i] * w[i] * xr[i];
    }
    ss = block_sum(ss, scratch);
    dot = block_sum(dot, scratch);
    const float r = rsqrtf(ss / (float)dim + eps);
    const float c = dot * r * r * r / (float)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float g = r * w[i] * d[i] - xr[i] * c;
        o[i] = write ? g : o[i] + g;
    }
    if (threadIdx.x == 0) rs[blockIdx.x] = r;
}

// A norm's weight gradient, dw[c] += sum_r dy[r,c] * xh[r,c], in two deterministic
// steps: parts[p, c] sums the rows of part p (block (32, 8): 32 columns, 8 lanes down the
// rows, added in a fixed order), then norm_dw_sum adds the parts in order. One thread a
// column over every row left most of the GPU idle (3 blocks for a 768-wide model).
// xh is x * rs[r] (RMS norm, stats 1 a row) or (x - mean[r]) * rs[r] (layer norm, stats
// mean and rs a row). Launch: grid (ceil(dim / 32), parts), block (32, 8).
extern "C" __global__ void norm_dw_parts(const float* x, const float* dy, const float* stats,
                                         float* parts, int rows, int dim, int rows_per_part,
                                         int layer) {
    follow_previous();
    __shared__ float sums[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_part, r1 = min(r0 + rows_per_part, rows);
    float s = 0.0f;
    if (c < dim) {
        for (int r = r0 + threadIdx.y; r < r1; r += 8) {
            const size_t at = (size_t)r * dim + c;
            const float xh = layer ? (x[at] - stats[2 * r]) * stats[2 * r + 1] : x[at] * stats[r];
            s += dy[at] * xh;
        }
    }
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < dim) {
        float t = 0.0f;
#pragma unroll
        for (int y = 0; y < 8; y++) t += sums[y][threadIdx.x];
        parts[(size_t)blockIdx.y * dim + c] = t;
    }
}

// dw[c] += the parts' sums of column c, in order. Launch: 1-D over dim.
extern "C" __global__ void norm_dw_sum(const float* parts, float* dw, int n_parts, int dim) {
    follow_previous();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    float s = 0.0f;
    for (int p = 0; p < n_parts; p++) s += parts[(size_t)p * dim + c];
    dw[c] += s;
}

// LayerNorm, per row: with xh = (x - mean) * r and g = dy * w,
// dx += r * (g - mean(g) - xh * mean(g * xh)) (`=` with `write`); mean and r kept in stats
// (2 per row).   Launch: grid (rows), block 256.
extern "C" __global__ void grad_layer_norm_dx(const float* x, const float* w, const float* dy,
                                              float* dx, float* stats, int dim, float eps, int write) {
    follow_previous();
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    const float* d = dy + (size_t)blockIdx.x * dim;
    float* o = dx + (size_t)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, scratch) / (float)dim;
    float v = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
    const float r = rsqrtf(block_sum(v, scratch) / (float)dim + eps);
    float gs = 0.0f, gx = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float g = d[i] * w[i];
        gs += g;
        gx += g * (xr[i] - mean) * r;
    }
    const float g_mean = block_sum(gs, scratch) / (float)dim;
    const float gx_mean = block_sum(gx, scratch) / (float)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float xh = (xr[i] - mean) * r;
        const float g = r * (d[i] * w[i] - g_mean - xh * gx_mean);
        o[i] = write ? g : o[i] + g;
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = r;
    }
}

// Softmax from its output: dx += y * (dy - sum(dy * y)).   Launch: grid (rows), block 256.
extern "C" __global__ void grad_softmax(const float* y, const float* dy, float* dx, int cols) {
    follow_previous();
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * cols;
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += y[base + i] * dy[base + i];
    s = block_sum(s, scratch);
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        dx[base + i] += y[base + i] * (dy[base + i] - s);
}

// Rope's inverse in place on d [tokens, heads, head_dim]: each pair turned by -theta, with
// the forward kernel's angles, rows as rope.cu's rope takes them.
// Launch: grid (ceil(rows / 8)), block (32, 8), rows = tokens * heads.
extern "C" __global__ void grad_rope(float* d, const int* pos, const float* inv_freq, int rows,
                                     int heads, int head_dim, int rot_dim, int neox) {
    follow_previous();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const int t = row / heads;
    float* v = d + (size_t)row * head_dim;
    const float p = (float)pos[t];
    const int half = rot_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float g0 = v[a], g1 = v[b];
        v[a] = g0 * c + g1 * s;
        v[b] = -g0 * s + g1 * c;
    }
}

// One element of the gated activation's gradient (below).
__device__ __forceinline__ void grad_gated_one(float g, float u, float d, bool gelu, float& dg, float& du) {
    float act, slope;
    if (gelu) {
        const float c = 0.7978845608028654f;
        const float t = tanhf(c * (g + 0.044715f * g * g * g));
        act = 0.5f * g * (1.0f + t);
        slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * g * g);
    } else {
        const float s = 1.0f / (1.0f + expf(-g));
        act = g * s;
        slope = s * (1.0f + g * (1.0f - s));
    }
    dg += d * u * slope;
    du += d * act;
}

// out = act(gate) * up: dgate += dout * up * act'(gate), dup += dout * act(gate) (`=`
// with `write`, where nothing has begun them); act is SiLU, or GELU (tanh) when gelu.
// Launch: 1-D over ceil(n / 4).
extern "C" __global__ void grad_gated(const float* gate, const float* up, const float* dout,
                                      float* dgate, float* dup, size_t n, int gelu, int write) {
    follow_previous();
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (GRAD_VEC4(i, n, (size_t)gate | (size_t)up | (size_t)dout | (size_t)dgate | (size_t)dup)) {
        const float4 g = *(const float4*)(gate + i), u = *(const float4*)(up + i), d = *(const float4*)(dout + i);
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 dg = write ? zero : *(float4*)(dgate + i), du = write ? zero : *(float4*)(dup + i);
        grad_gated_one(g.x, u.x, d.x, gelu, dg.x, du.x);
        grad_gated_one(g.y, u.y, d.y, gelu, dg.y, du.y);
        grad_gated_one(g.z, u.z, d.z, gelu, dg.z, du.z);
        grad_gated_one(g.w, u.w, d.w, gelu, dg.w, du.w);
        *(float4*)(dgate + i) = dg;
        *(float4*)(dup + i) = du;
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) {
            float dg = write ? 0.0f : dgate[j], du = write ? 0.0f : dup[j];
            grad_gated_one(gate[j], up[j], dout[j], gelu, dg, du);
            dgate[j] = dg;
            dup[j] = du;
        }
    }
}

// grad_gated over gate and up kept rounded (bf16 when bf, else f16): training's 16-bit
// products keep them so, as PyTorch's autocast does, at half an F32 copy's bytes.
// Launch: 1-D over ceil(n / 4).
extern "C" __global__ void grad_gated_half(const u16* gate, const u16* up, const float* dout,
                                           float* dgate, float* dup, size_t n, int gelu, int write, int bf) {
    follow_previous();
    auto wide = [bf](u32 h) { return bf ? bf16_to_f32((u16)h) : f16_to_f32((u16)h); };
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (GRAD_VEC4(i, n, (size_t)gate | (size_t)up | (size_t)dout | (size_t)dgate | (size_t)dup)) {
        const uint2 gp = *(const uint2*)(gate + i), up2 = *(const uint2*)(up + i);
        const float g[4] = {wide(gp.x & 0xffffu), wide(gp.x >> 16), wide(gp.y & 0xffffu), wide(gp.y >> 16)};
        const float u[4] = {wide(up2.x & 0xffffu), wide(up2.x >> 16), wide(up2.y & 0xffffu), wide(up2.y >> 16)};
        const float4 d = *(const float4*)(dout + i);
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 dg = write ? zero : *(float4*)(dgate + i), du = write ? zero : *(float4*)(dup + i);
        grad_gated_one(g[0], u[0], d.x, gelu, dg.x, du.x);
        grad_gated_one(g[1], u[1], d.y, gelu, dg.y, du.y);
        grad_gated_one(g[2], u[2], d.z, gelu, dg.z, du.z);
        grad_gated_one(g[3], u[3], d.w, gelu, dg.w, du.w);
        *(float4*)(dgate + i) = dg;
        *(float4*)(dup + i) = du;
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) {
            float dg = write ? 0.0f : dgate[j], du = write ? 0.0f : dup[j];
            grad_gated_one(wide(gate[j]), wide(up[j]), dout[j], gelu, dg, du);
            dgate[j] = dg;
            dup[j] = du;
        }
    }
}

// dx += gelu'(x) * dy (tanh approximation).   Launch: 1-D over n.
extern "C" __global__ void grad_gelu(const float* x, const float* dy, float* dx, size_t n) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = x[i], c = 0.7978845608028654f;
    const float t = tanhf(c * (g + 0.044715f * g * g * g));
    dx[i] += dy[i] * (0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * g * g));
}

// From the output y = cap * tanh(x / cap): dx += (1 - (y/cap)^2) * dy.   Launch: 1-D over n.
extern "C" __global__ void grad_softcap(const float* y, const float* dy, float* dx, size_t n,
                                        float cap) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float t = y[i] / cap;
    dx[i] += dy[i] * (1.0f - t * t);
}

// dsrc[r, col0 + c] += ddst[r, c].   Launch: 1-D over rows * cols.
extern "C" __global__ void grad_slice_cols(const float* ddst, float* dsrc, int rows, int cols,
                                           int src_cols, int col0) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols) return;
    const size_t r = i / cols, c = i % cols;
    dsrc[r * src_cols + col0 + c] += ddst[i];
}

// dsrc[i, c] += ddst[pos[i], c] (positions outside ddst's rows skipped, as the forward
// skipped them); with `write`, `=` (zeros for the skipped rows).   Launch: 1-D over ceil(rows * row_len / 4).
extern "C" __global__ void grad_gather_rows(const float* ddst, const int* pos, float* dsrc,
                                            int rows, int row_len, int dst_rows, int write) {
    follow_previous();
    const size_t n = (size_t)rows * row_len, i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (GRAD_VEC4(i, n, (size_t)ddst | (size_t)dsrc | (size_t)(row_len & 3))) {
        // A multiple of 4 in rows of a multiple of 4: the four are in one row.
        const size_t r = i / row_len, c = i % row_len;
        const int p = pos[r];
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (p < 0 || p >= dst_rows) {
            if (write) *(float4*)(dsrc + i) = zero;
            return;
        }
        float4 o = write ? zero : *(float4*)(dsrc + i);
        const float4 v = *(const float4*)(ddst + (size_t)p * row_len + c);
        o.x += v.x;
        o.y += v.y;
        o.z += v.z;
        o.w += v.w;
        *(float4*)(dsrc + i) = o;
        return;
    }
    for (size_t j = i; j < n && j < i + 4; j++) {
        const size_t r = j / row_len, c = j % row_len;
        const int p = pos[r];
        const float v = p >= 0 && p < dst_rows ? ddst[(size_t)p * row_len + c] : 0.0f;
        dsrc[j] = write ? v : dsrc[j] + v;
    }
}

// ddst[pos[i], c] = 0.   Launch: 1-D over rows * row_len.
extern "C" __global__ void grad_zero_rows(float* ddst, const int* pos, int rows, int row_len,
                                          int dst_rows) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * row_len) return;
    const size_t r = i / row_len, c = i % row_len;
    const int p = pos[r];
    if (p >= 0 && p < dst_rows) ddst[(size_t)p * row_len + c] = 0.0f;
}

// The softmax's backward over one row of scores, between the cuBLAS products of the
// attention gradient (see grad.rs): for query (i, h), S holds the raw scores q.k of every
// key and DS holds dO.v. With z = softcap(scale * s) over the keys it sees (the causal
// limit pos[i] and the window), p = softmax(z), and ds = p * (dp - sum_j p_j dp_j) * dz/ds;
// S and DS are overwritten in place with p and ds, zeros for keys it does not see (whose
// scores are never read: the cache past the filled rows may hold anything). With `half`
// (1 BF16, 2 F16), p and ds go rounded to 16 bits into PH and DSH instead, rows of cap,
// for products on 16-bit tensor cores.
// Launch: grid (n * heads), block 256.
extern "C" __global__ void grad_attention_rows(float* S, float* DS, const int* pos, int heads,
                                               int cap, float scale, float softcap,
                                               int window, u16* PH, u16* DSH, int half) {
    follow_previous();
    __shared__ float scratch[32];
    const int row = blockIdx.x, i = row / heads;
    const int p = min(pos[i], cap - 1);
    const int first = window > 0 ? max(0, p + 1 - window) : 0;
    float* Sr = S + (size_t)row * cap;
    float* DSr = DS + (size_t)row * cap;
    auto z_of = [&](int j, float* dz) {
        const float s = Sr[j] * scale;
        if (softcap > 0.0f) {
            const float t = tanhf(s / softcap);
            *dz = (1.0f - t * t) * scale;
            return softcap * t;
        }
        *dz = scale;
        return s;
    };
    auto put = [&](int j, float pj, float dsj) {
        if (half == 0) {
            Sr[j] = pj;
            DSr[j] = dsj;
        } else {
            const size_t at = (size_t)row * cap + j;
            PH[at] = half == 1 ? f32_to_bf16(pj) : f32_to_f16(pj);
            DSH[at] = half == 1 ? f32_to_bf16(dsj) : f32_to_f16(dsj);
        }
    };
    float dz;
    float m = NEG_INF;
    for (int j = first + threadIdx.x; j <= p; j += blockDim.x) m = fmaxf(m, z_of(j, &dz));
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int j = first + threadIdx.x; j <= p; j += blockDim.x) sum += expf(z_of(j, &dz) - m);
    const float lse = m + logf(block_sum(sum, scratch));
    float delta = 0.0f;
    for (int j = first + threadIdx.x; j <= p; j += blockDim.x)
        delta += expf(z_of(j, &dz) - lse) * DSr[j];
    delta = block_sum(delta, scratch);
    for (int j = threadIdx.x; j < cap; j += blockDim.x) {
        if (j < first || j > p) {
            put(j, 0.0f, 0.0f);
            continue;
        }
        const float pj = expf(z_of(j, &dz) - lse);
        put(j, pj, pj * (DSr[j] - delta) * dz);
    }
}

// Fused cross-entropy, one row of a block of logits z [rows, vocab] per block (z = h.W^T,
// made by cuBLAS): the softcap, loss[r] = logsumexp(z) - z[target], and, when grad, the
// gradient scale * (softmax(z) - onehot) * dz/draw: in place of z, or (`half` not null,
// under BF16 / F16 products, whose two products read it rounded) rounded into `half`, a
// quarter of the bytes written and no rounding pass after. Two passes over the row (a
// running max and sum, then the gradient; the softcap recomputed, not written): the rows
// of a 1,048-row block (134 MB at 32,000 words) do not stay in L2 between passes.
// Launch: grid (rows), block 256.
extern "C" __global__ void grad_cross_entropy_rows(float* z, const int* targets, float* loss,
                                                   int vocab, float softcap, float scale,
                                                   int grad, u16* half, int bf16) {
    follow_previous();
    __shared__ float scratch[32];
    float* zr = z + (size_t)blockIdx.x * vocab;
    auto capped = [&](float v) { return softcap > 0.0f ? softcap * tanhf(v / softcap) : v; };
    // Each thread's running max and its sum of exp(z - max).
    float m = NEG_INF, s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float v = capped(zr[j]);
        if (v > m) {
            s = s * expf(m - v) + 1.0f;
            m = v;
        } else {
            s += expf(v - m);
        }
    }
    const int t = targets[blockIdx.x];
    // A target outside the vocabulary gives a NaN loss, which stops training.
    const bool valid = t >= 0 && t < vocab;
    // The target's logit, read before the barriers below: the gradient pass overwrites it.
    const float zt = threadIdx.x == 0 && valid ? capped(zr[t]) : 0.0f;
    const float mb = block_max(m, scratch);
    const float lse = mb + logf(block_sum(m == NEG_INF ? 0.0f : s * expf(m - mb), scratch));
    if (threadIdx.x == 0) loss[blockIdx.x] = valid ? lse - zt : __int_as_float(0x7fc00000);
    if (!grad || !valid) return;
    u16* hr = half == nullptr ? nullptr : half + (size_t)blockIdx.x * vocab;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float zj = capped(zr[j]);
        const float through = softcap > 0.0f ? 1.0f - (zj / softcap) * (zj / softcap) : 1.0f;
        const float g = (expf(zj - lse) - (j == t ? 1.0f : 0.0f)) * scale * through;
        if (hr != nullptr) {
            hr[j] = bf16 ? f32_to_bf16(g) : f32_to_f16(g);
        } else {
            zr[j] = g;
        }
    }
}
