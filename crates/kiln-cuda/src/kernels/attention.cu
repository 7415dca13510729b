// Causal grouped-query attention over the KV cache, flash style: keys and values stream
// through shared memory in chunks of 32, each query keeps a running max, sum and output
// (online softmax), so scores are never stored.
//
// q [n, heads, D], k/v cache [cap, kv_heads, D], out [n, heads, D]; query i is at
// position pos[i] and sees keys at positions p with p <= pos[i] and p > pos[i] - window.
//
// A block serves one KV head and a tile of `qt` queries: its warps are the (query, head)
// pairs of that tile that read this KV head, QW queries of one head to a warp (group *
// qt / QW warps), so each chunk of keys is loaded once for all of them. Within a warp,
// lane j scores key j of the chunk for each of its queries; for the output, lane l owns
// dimensions l, l + 32, ... With QW = 2 (prompts) each key and value read from shared
// memory serves two queries.
//
// Split-K (flash-decoding): grid.z splits the key range into `span`-sized pieces; with
// more than one split each writes (max, sum, unnormalised output) to `part` and
// attention_combine merges them. One token of decode then still fills the GPU.
//
// Paged caches (a server's batch of sequences sharing one pool of blocks): with `tables`
// non-null, query i belongs to sequence seq[i] and its position p lies in pool row
// tables[seq[i] * max_blocks + p / block] * block + p % block. A tile then holds one query
// (qt = 1), since the queries of a tile share the keys they load. A table entry outside the
// pool's `pool_rows` rows (which the device cannot report mid-step) hides its keys.
//
// Launch: grid (ceil(n / qt), kv_heads, splits), block (32, group * qt / QW), dynamic
// shared memory (32 * (D + 4) + 32 * D + group * qt * D) floats; qt a multiple of QW.

template <int DV, int QW>  // ceil(D / 32): output dimensions per lane; queries per warp
__device__ void attention_body(const float* __restrict__ q, const float* __restrict__ kc,
                               const float* __restrict__ vc, const int* __restrict__ pos,
                               float* __restrict__ out, float* __restrict__ part,
                               i8* __restrict__ xq, float* __restrict__ xd,
                               const int* __restrict__ seq, const int* __restrict__ tables,
                               int max_blocks, int block, int pool_rows, int n, int heads, int kv_heads,
                               int D, float scale, float cap, int window, int qt, int span) {
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
    float* Qs = Vs + 32 * D;          // [warps * QW][D]

    // This warp's queries: q0 + r / group + w * (qt / QW), all of head h.
    const int q0 = blockIdx.x * qt;
    const int h = kvh * group + r % group;
    int qi[QW], qpos[QW];
    bool active[QW], any_active = false;
#pragma unroll
    for (int w = 0; w < QW; w++) {
        qi[w] = q0 + r / group + w * (qt / QW);
        active[w] = qi[w] < n;
        qpos[w] = active[w] ? pos[qi[w]] : -1;
        any_active |= active[w];
    }

    // The keys any query of this tile can see, cut to this split's piece.
    int hi = -1, lo = 0x7fffffff;
    for (int t = q0; t < min(q0 + qt, n); t++) {
        const int p = pos[t];
        hi = max(hi, p);
        lo = min(lo, window > 0 ? max(0, p - window + 1) : 0);
    }
    lo = max(lo, split * span);
    hi = min(hi, (split + 1) * span - 1);
    // Pool row of position kp: the cache row itself, or through the query's block table.
    const int* table = tables != nullptr ? tables + (size_t)seq[q0] * max_blocks : nullptr;
    const size_t NO_ROW = ~(size_t)0;
    auto kv_row = [&](int kp) -> size_t {
        if (table == nullptr) return (size_t)kp;
        if (kp / block >= max_blocks) return NO_ROW;
        const int b = table[kp / block];
        const size_t row = (size_t)b * block + kp % block;
        return b < 0 || row >= (size_t)pool_rows ? NO_ROW : row;
    };

#pragma unroll
    for (int w = 0; w < QW; w++)
        if (active[w])
            for (int d = lane; d < D; d += 32)
                Qs[(r * QW + w) * D + d] = q[((size_t)qi[w] * heads + h) * D + d];

    float m[QW], l[QW], acc[QW][DV];
#pragma unroll
    for (int w = 0; w < QW; w++) {
        m[w] = NEG_INF;
        l[w] = 0.0f;
#pragma unroll
        for (int i = 0; i < DV; i++) acc[w][i] = 0.0f;
    }

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
                const size_t row = kp <= hi ? kv_row(kp) : NO_ROW;
                if (row != NO_ROW) {
                    const size_t off = (row * kv_heads + kvh) * D + d;
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
                const size_t row = kp <= hi ? kv_row(kp) : NO_ROW;
                if (row != NO_ROW) {
                    const size_t off = (row * kv_heads + kvh) * D + d;
                    kv = kc[off];
                    vv = vc[off];
                }
                Ks[j * ks + d] = kv;
                Vs[j * D + d] = vv;
            }
        }
        __syncthreads();
        if (!any_active) continue;

        // Scores of key c0 + lane against each query (the key read once for all).
        const int kp = c0 + lane;
        const float* kr = Ks + lane * ks;
        float dot[QW];
#pragma unroll
        for (int w = 0; w < QW; w++) dot[w] = 0.0f;
        if (kp <= hi) {
            if (vec4) {
                // 16-byte reads (the queries' are broadcasts) and four running sums.
                float4 acc4[QW];
#pragma unroll
                for (int w = 0; w < QW; w++) acc4[w] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int d = 0; d < D; d += 4) {
                    const float4 c = *(const float4*)(kr + d);
#pragma unroll
                    for (int w = 0; w < QW; w++) {
                        const float4 a = *(const float4*)(Qs + (r * QW + w) * D + d);
                        acc4[w].x += a.x * c.x;
                        acc4[w].y += a.y * c.y;
                        acc4[w].z += a.z * c.z;
                        acc4[w].w += a.w * c.w;
                    }
                }
#pragma unroll
                for (int w = 0; w < QW; w++)
                    dot[w] = (acc4[w].x + acc4[w].y) + (acc4[w].z + acc4[w].w);
            } else {
                for (int d = 0; d < D; d++) {
                    const float c = kr[d];
#pragma unroll
                    for (int w = 0; w < QW; w++) dot[w] += Qs[(r * QW + w) * D + d] * c;
                }
            }
        }
        // Online softmax per query; p[w] is 0 where the key is not visible.
        float p[QW];
        bool any = false;
#pragma unroll
        for (int w = 0; w < QW; w++) {
            float s = NEG_INF;
            if (kp <= hi && kp <= qpos[w] && (window <= 0 || kp > qpos[w] - window) &&
                (table == nullptr || kv_row(kp) != NO_ROW)) {
                s = dot[w] * scale;
                if (cap > 0.0f) s = cap * tanhf(s / cap);
            }
            p[w] = 0.0f;
            const float cm = warp_max(s);
            if (cm == NEG_INF) continue;  // nothing visible in this chunk for this query
            any = true;
            const float m_new = fmaxf(m[w], cm);
            const float corr = expf(m[w] - m_new);
            p[w] = s == NEG_INF ? 0.0f : expf(s - m_new);
            l[w] = l[w] * corr + warp_sum(p[w]);
#pragma unroll
            for (int i = 0; i < DV; i++) acc[w][i] *= corr;
            m[w] = m_new;
        }
        if (!any) continue;
        for (int j = 0; j < 32; j++) {
            float pj[QW];
#pragma unroll
            for (int w = 0; w < QW; w++) pj[w] = __shfl_sync(0xffffffffu, p[w], j);
            const float* vr = Vs + j * D;
#pragma unroll
            for (int i = 0; i < DV; i++) {
                const int d = lane + 32 * i;
                if (d < D) {
                    const float v = vr[d];
#pragma unroll
                    for (int w = 0; w < QW; w++) acc[w][i] += pj[w] * v;
                }
            }
        }
    }

#pragma unroll
    for (int w = 0; w < QW; w++) {
        if (!active[w]) continue;
        if (splits == 1) {
            const float inv = 1.0f / l[w];
            const size_t row = (size_t)qi[w] * heads + h;
            float* o = out + row * D;
#pragma unroll
            for (int i = 0; i < DV; i++) {
                const int d = lane + 32 * i;
                if (d < D) o[d] = acc[w][i] * inv;
                // int8 copy for the output projection (the host passes xq only when D
                // is a multiple of 32, so every lane holds a value)
                if (xq != nullptr)
                    quantize_warp_unit(acc[w][i] * inv, xq + row * D + 32 * i, xd + row * (D / 32) + i);
            }
        } else {
            float* pp = part + (((size_t)split * n + qi[w]) * heads + h) * (D + 2);
            if (lane == 0) {
                pp[0] = m[w];
                pp[1] = l[w];
            }
#pragma unroll
            for (int i = 0; i < DV; i++) {
                const int d = lane + 32 * i;
                if (d < D) pp[2 + d] = acc[w][i];
            }
        }
    }
}

// The 1-query kernels are compiled for blocks of 1024 threads (at most 64 registers a
// thread): one block holds a whole group of up to 32 heads (attention.rs checks each
// kernel's limit at load). The 2-query kernels are left their registers; attention.rs
// sizes their blocks to what each runs.
#define ATTENTION(DV, QW, BOUNDS)                                                            \
    extern "C" __global__ void BOUNDS attention_##DV##_##QW(                                 \
        const float* q, const float* kc, const float* vc, const int* pos, float* out,        \
        float* part, i8* xq, float* xd, const int* seq, const int* tables, int max_blocks,   \
        int block, int pool_rows, int n, int heads, int kv_heads, int D, float scale,        \
        float cap, int window, int qt, int span) {                                           \
        attention_body<DV, QW>(q, kc, vc, pos, out, part, xq, xd, seq, tables, max_blocks,   \
                               block, pool_rows, n, heads, kv_heads, D, scale, cap, window,  \
                               qt, span);                                                    \
    }
#define ATTENTION_QW(DV) ATTENTION(DV, 1, __launch_bounds__(1024)) ATTENTION(DV, 2, )
ATTENTION_QW(1)
ATTENTION_QW(2)
ATTENTION_QW(3)
ATTENTION_QW(4)
ATTENTION_QW(5)
ATTENTION_QW(6)
ATTENTION_QW(7)
ATTENTION_QW(8)

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
