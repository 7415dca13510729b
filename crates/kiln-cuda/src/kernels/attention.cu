// Causal grouped-query attention over the KV cache, flash style: keys and values stream
// through shared memory in chunks of 32, each query keeps a running max, sum and output
// (online softmax), so scores are never stored.
//
// q [n, heads, D], k/v cache [cap, kv_heads, D], out [n, heads, D]; query i is at
// position pos[i] and sees keys at positions p with p <= pos[i] and p > pos[i] - window.
//
// A block serves one KV head and a tile of `qt` queries: its warps are the (query, head)
// pairs of that tile that read this KV head (group * qt warps), so each chunk of keys is
// loaded once for all of them. Within a warp, lane j scores key j of the chunk; for the
// output, lane l owns dimensions l, l + 32, ...
//
// Split-K (flash-decoding): grid.z splits the key range into `span`-sized pieces; with
// more than one split each writes (max, sum, unnormalised output) to `part` and
// attention_combine merges them. One token of decode then still fills the GPU.
//
// Launch: grid (ceil(n / qt), kv_heads, splits), block (32, group * qt), dynamic shared
// memory (32 * (D + 4) + 32 * D + group * qt * D) floats.

template <int DV>  // ceil(D / 32): output dimensions per lane
__device__ void attention_body(const float* __restrict__ q, const float* __restrict__ kc,
                               const float* __restrict__ vc, const int* __restrict__ pos,
                               float* __restrict__ out, float* __restrict__ part,
                               i8* __restrict__ xq, float* __restrict__ xd, int n,
                               int heads, int kv_heads, int D, float scale, float cap,
                               int window, int qt, int span) {
    follow_previous();
    extern __shared__ float smem[];
    const int group = heads / kv_heads;
    const int kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x, r = threadIdx.y;
    const int tid = r * 32 + lane, nthreads = blockDim.y * 32;
    // Key rows are padded so that the lanes, each reading its own key, spread over the
    // banks: by 4 floats when D allows 16-byte reads (lanes then 4 banks apart, eight
    // lanes a phase), else by 1.
    const bool vec4 = (D & 3) == 0;
    const int ks = vec4 ? D + 4 : D + 1;
    float* Ks = smem;                 // [32][ks]
    float* Vs = Ks + 32 * (D + 4);    // [32][D]
    float* Qs = Vs + 32 * D;          // [rows][D]

    const int q0 = blockIdx.x * qt;
    const int qi = q0 + r / group;
    const int h = kvh * group + r % group;
    const bool active = qi < n;
    const int qpos = active ? pos[qi] : -1;

    // The keys any query of this tile can see, cut to this split's piece.
    int hi = -1, lo = 0x7fffffff;
    for (int t = q0; t < min(q0 + qt, n); t++) {
        const int p = pos[t];
        hi = max(hi, p);
        lo = min(lo, window > 0 ? max(0, p - window + 1) : 0);
    }
    lo = max(lo, split * span);
    hi = min(hi, (split + 1) * span - 1);

    if (active)
        for (int d = lane; d < D; d += 32) Qs[r * D + d] = q[((size_t)qi * heads + h) * D + d];

    float m = NEG_INF, l = 0.0f, acc[DV];
#pragma unroll
    for (int i = 0; i < DV; i++) acc[i] = 0.0f;

    for (int c0 = lo; c0 <= hi; c0 += 32) {
        __syncthreads();
        // The chunk's keys and values into shared memory; past the range, zeros (never
        // NaN garbage). Unrolled so that each thread has several loads in flight: for
        // one token of decode this load, not the arithmetic, is the kernel's time.
        if (vec4) {
            const int D4 = D >> 2;
#pragma unroll 4
            for (int idx = tid; idx < 32 * D4; idx += nthreads) {
                const int j = idx / D4, d = 4 * (idx - j * D4), kp = c0 + j;
                float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
                if (kp <= hi) {
                    const size_t off = ((size_t)kp * kv_heads + kvh) * D + d;
                    kv = *(const float4*)(kc + off);
                    vv = *(const float4*)(vc + off);
                }
                *(float4*)(Ks + j * ks + d) = kv;
                *(float4*)(Vs + j * D + d) = vv;
            }
        } else {
            for (int idx = tid; idx < 32 * D; idx += nthreads) {
                const int j = idx / D, d = idx - j * D, kp = c0 + j;
                float kv = 0.0f, vv = 0.0f;
                if (kp <= hi) {
                    const size_t off = ((size_t)kp * kv_heads + kvh) * D + d;
                    kv = kc[off];
                    vv = vc[off];
                }
                Ks[j * ks + d] = kv;
                Vs[j * D + d] = vv;
            }
        }
        __syncthreads();
        if (!active) continue;

        const int kp = c0 + lane;
        float s = NEG_INF;
        if (kp <= hi && kp <= qpos && (window <= 0 || kp > qpos - window)) {
            const float* kr = Ks + lane * ks;
            const float* qr = Qs + r * D;
            float dot = 0.0f;
            if (vec4) {
                // 16-byte reads (the query's a broadcast) and four running sums.
                float4 part = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int d = 0; d < D; d += 4) {
                    const float4 a = *(const float4*)(qr + d), c = *(const float4*)(kr + d);
                    part.x += a.x * c.x;
                    part.y += a.y * c.y;
                    part.z += a.z * c.z;
                    part.w += a.w * c.w;
                }
                dot = (part.x + part.y) + (part.z + part.w);
            } else {
                for (int d = 0; d < D; d++) dot += qr[d] * kr[d];
            }
            s = dot * scale;
            if (cap > 0.0f) s = cap * tanhf(s / cap);
        }
        const float cm = warp_max(s);
        if (cm == NEG_INF) continue;  // nothing visible in this chunk for this query
        const float m_new = fmaxf(m, cm);
        const float corr = expf(m - m_new);
        const float p = s == NEG_INF ? 0.0f : expf(s - m_new);
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DV; i++) acc[i] *= corr;
        for (int j = 0; j < 32; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const float* vr = Vs + j * D;
#pragma unroll
            for (int i = 0; i < DV; i++) {
                const int d = lane + 32 * i;
                if (d < D) acc[i] += pj * vr[d];
            }
        }
        m = m_new;
    }
    if (!active) return;

    if (splits == 1) {
        const float inv = 1.0f / l;
        const size_t row = (size_t)qi * heads + h;
        float* o = out + row * D;
#pragma unroll
        for (int i = 0; i < DV; i++) {
            const int d = lane + 32 * i;
            if (d < D) o[d] = acc[i] * inv;
            // int8 copy for the output projection (the host passes xq only when D is
            // a multiple of 32, so every lane holds a value)
            if (xq != nullptr) quantize_warp_unit(acc[i] * inv, xq + row * D + 32 * i, xd + row * (D / 32) + i);
        }
    } else {
        float* pp = part + (((size_t)split * n + qi) * heads + h) * (D + 2);
        if (lane == 0) {
            pp[0] = m;
            pp[1] = l;
        }
#pragma unroll
        for (int i = 0; i < DV; i++) {
            const int d = lane + 32 * i;
            if (d < D) pp[2 + d] = acc[i];
        }
    }
}

#define ATTENTION(DV)                                                                        \
    extern "C" __global__ void attention_##DV(                                               \
        const float* q, const float* kc, const float* vc, const int* pos, float* out,        \
        float* part, i8* xq, float* xd, int n, int heads, int kv_heads, int D, float scale,  \
        float cap, int window, int qt, int span) {                                           \
        attention_body<DV>(q, kc, vc, pos, out, part, xq, xd, n, heads, kv_heads, D, scale,  \
                           cap, window, qt, span);                                           \
    }
ATTENTION(1)
ATTENTION(2)
ATTENTION(3)
ATTENTION(4)
ATTENTION(5)
ATTENTION(6)
ATTENTION(7)
ATTENTION(8)

// Merge the splits' partial results of each (query, head); with xq non-null also the
// int8 copy, as attention_body writes it. Launch: grid (n * heads), block 32.
extern "C" __global__ void attention_combine(const float* part, float* out, i8* xq, float* xd,
                                             int n, int heads, int D, int splits) {
    follow_previous();
    const size_t row = blockIdx.x;  // qi * heads + h
    const size_t stride = (size_t)n * heads * (D + 2);
    float M = NEG_INF;
    for (int s = 0; s < splits; s++) M = fmaxf(M, part[s * stride + row * (D + 2)]);
    float L = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float* pp = part + s * stride + row * (D + 2);
        if (pp[0] != NEG_INF) L += pp[1] * expf(pp[0] - M);
    }
    const float inv = 1.0f / L;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float* pp = part + s * stride + row * (D + 2);
            if (pp[0] != NEG_INF) o += pp[2 + d] * expf(pp[0] - M);
        }
        out[row * D + d] = o * inv;
        if (xq != nullptr) quantize_warp_unit(o * inv, xq + row * D + (d & ~31), xd + row * (D / 32) + d / 32);
    }
}
