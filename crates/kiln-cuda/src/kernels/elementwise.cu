// Element-wise ops and row copies. Launch (unless noted): 1-D, one thread per element.

// acc[i] += x[i % period] (period = numel of x: equal shapes, or one row broadcast); four
// consecutive elements a thread, 16-byte accesses where the addresses and the period
// allow.   Launch: 1-D over ceil(n / 4).
template <bool MUL>
__device__ __forceinline__ void assign_body(float* acc, const float* x, size_t n, size_t period) {
    follow_previous();
    auto op = [](float a, float b) { return MUL ? a * b : a + b; };
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n && period % 4 == 0 && (((size_t)acc | (size_t)x) & 15) == 0) {
        float4 a = *(float4*)(acc + i);
        const float4 v = *(const float4*)(x + i % period);
        *(float4*)(acc + i) = make_float4(op(a.x, v.x), op(a.y, v.y), op(a.z, v.z), op(a.w, v.w));
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) acc[j] = op(acc[j], x[j % period]);
    }
}

extern "C" __global__ void add_assign(float* acc, const float* x, size_t n, size_t period) {
    assign_body<false>(acc, x, n, period);
}

extern "C" __global__ void mul_assign(float* acc, const float* x, size_t n, size_t period) {
    assign_body<true>(acc, x, n, period);
}

extern "C" __global__ void scale(float* x, size_t n, float s) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// out = act(gate) * up, four consecutive elements a thread (16-byte accesses where every
// address allows: a prompt's or a training batch's [rows, ffn] activations move ~400 MB
// a layer).   Launch: 1-D over ceil(n / 4).
template <bool GELU>
__device__ __forceinline__ void gated_body(const float* gate, const float* up, float* out, size_t n) {
    follow_previous();
    auto act = [](float g) { return GELU ? gelu_tanh(g) : silu(g); };
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n && (((size_t)gate | (size_t)up | (size_t)out) & 15) == 0) {
        const float4 g = *(const float4*)(gate + i), u = *(const float4*)(up + i);
        *(float4*)(out + i) = make_float4(act(g.x) * u.x, act(g.y) * u.y, act(g.z) * u.z, act(g.w) * u.w);
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) out[j] = act(gate[j]) * up[j];
    }
}

// gated_body's out, with gate, up and out also rounded to 16 bits (bf16 when bf, else f16)
// as f32_to_half rounds them: what training keeps of the gated activation under 16-bit
// products (gate and up for its gradient, out for the down projection), one pass where
// three roundings read ~600 MB a layer of a 134M model's batch. gate_r and up_r may be
// null (inference keeps only out's copy, which the down projection reads).   Launch: 1-D
// over ceil(n / 4).
template <bool GELU>
__device__ __forceinline__ void gated_keep_body(const float* gate, const float* up, float* out, u16* gate_r,
                                                u16* up_r, u16* out_r, size_t n, int bf) {
    follow_previous();
    auto act = [](float g) { return GELU ? gelu_tanh(g) : silu(g); };
    auto half = [bf](float v) -> u32 { return bf ? f32_to_bf16(v) : f32_to_f16(v); };
    auto pair = [&](float lo, float hi) { return half(lo) | (half(hi) << 16); };
    const size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    const size_t at = (size_t)gate | (size_t)up | (size_t)out | (size_t)gate_r | (size_t)up_r | (size_t)out_r;
    if (i + 3 < n && (at & 15) == 0) {
        const float4 g = *(const float4*)(gate + i), u = *(const float4*)(up + i);
        const float4 o = make_float4(act(g.x) * u.x, act(g.y) * u.y, act(g.z) * u.z, act(g.w) * u.w);
        *(float4*)(out + i) = o;
        if (gate_r != nullptr) *(uint2*)(gate_r + i) = make_uint2(pair(g.x, g.y), pair(g.z, g.w));
        if (up_r != nullptr) *(uint2*)(up_r + i) = make_uint2(pair(u.x, u.y), pair(u.z, u.w));
        *(uint2*)(out_r + i) = make_uint2(pair(o.x, o.y), pair(o.z, o.w));
    } else {
        for (size_t j = i; j < n && j < i + 4; j++) {
            const float o = act(gate[j]) * up[j];
            out[j] = o;
            if (gate_r != nullptr) gate_r[j] = (u16)half(gate[j]);
            if (up_r != nullptr) up_r[j] = (u16)half(up[j]);
            out_r[j] = (u16)half(o);
        }
    }
}

extern "C" __global__ void silu_mul_keep(const float* gate, const float* up, float* out, u16* gate_r, u16* up_r,
                                         u16* out_r, size_t n, int bf) {
    gated_keep_body<false>(gate, up, out, gate_r, up_r, out_r, n, bf);
}

extern "C" __global__ void gelu_mul_keep(const float* gate, const float* up, float* out, u16* gate_r, u16* up_r,
                                         u16* out_r, size_t n, int bf) {
    gated_keep_body<true>(gate, up, out, gate_r, up_r, out_r, n, bf);
}

extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, size_t n) {
    gated_body<false>(gate, up, out, n);
}

extern "C" __global__ void gelu_mul(const float* gate, const float* up, float* out, size_t n) {
    gated_body<true>(gate, up, out, n);
}

extern "C" __global__ void gelu(float* x, size_t n) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = gelu_tanh(x[i]);
}

extern "C" __global__ void softcap(float* x, size_t n, float cap) {
    follow_previous();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// dst[r, :] = src[r, col0 : col0 + dst_cols].   Launch: grid (rows), block 256.
extern "C" __global__ void slice_cols(const float* src, float* dst, int src_cols, int col0,
                                      int dst_cols) {
    follow_previous();
    const float* s = src + (size_t)blockIdx.x * src_cols + col0;
    float* d = dst + (size_t)blockIdx.x * dst_cols;
    for (int i = threadIdx.x; i < dst_cols; i += blockDim.x) d[i] = s[i];
}

// A product's rows [rows, c0 + c1 + c2] split by columns into three outputs (Q, K and V
// computed as one product), 16 bytes a thread; every c a multiple of 4.
// Launch: 1-D over rows * (c0 + c1 + c2) / 4.
extern "C" __global__ void split_cols3(const float4* src, float4* d0, float4* d1, float4* d2,
                                       int rows, int c0, int c1, int c2) {
    follow_previous();
    const int q0 = c0 / 4, q1 = c1 / 4, q2 = c2 / 4, quads = q0 + q1 + q2;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * quads) return;
    const size_t r = i / quads;
    const int c = (int)(i - r * quads);
    const float4 v = src[i];
    if (c < q0) {
        d0[r * q0 + c] = v;
    } else if (c < q0 + q1) {
        d1[r * q1 + (c - q0)] = v;
    } else {
        d2[r * q2 + (c - q0 - q1)] = v;
    }
}

// The best (largest value, then lowest index) of the block's (bv, bi); thread 0 gets it.
// NaN never wins. blockDim.x a multiple of 32, at most 1024.
__device__ void block_best(float& bv, int& bi) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        bv = lane < warps ? best_v[lane] : NEG_INF;
        bi = lane < warps ? best_i[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
    }
}

// Argmax of each row in two launches, so that a long row (a 128k vocabulary) is read
// by many SMs: first the best of each of gridDim.x pieces of a row, then the best of
// the pieces. Launch: grid (pieces, rows), block 256.
extern "C" __global__ void argmax_pieces(const float* x, float* piece_v, int* piece_i, int cols) {
    follow_previous();
    const float* r = x + (size_t)blockIdx.y * cols;
    const int per = (cols + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per, hi = min(lo + per, cols);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    // Threads see increasing i, so ties keep the lower index.
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = r[i];
        if (v > bv) { bv = v; bi = i; }
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        piece_v[blockIdx.y * gridDim.x + blockIdx.x] = bv;
        piece_i[blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

// out[r] = the first index of the largest value of row r. Launch: grid (rows), block 32
// times ceil(pieces / 32), pieces <= 1024.
extern "C" __global__ void argmax_finish(const float* piece_v, const int* piece_i, int pieces,
                                         int* out) {
    follow_previous();
    const int p = threadIdx.x;
    float bv = p < pieces ? piece_v[blockIdx.x * pieces + p] : NEG_INF;
    int bi = p < pieces ? piece_i[blockIdx.x * pieces + p] : 0x7fffffff;
    block_best(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}

