// Causal grouped-query attention over the KV cache, flash style: keys and values stream
// through shared memory in chunks of 32, each query keeps a running max, sum and output
// (online softmax), so scores are never stored.
//
// q [n, heads, D], k/v cache [cap, kv_heads, D], out [n, heads, D]; query i is at
// position pos[i] and sees keys at positions p with p <= pos[i] and p > pos[i] - window.
// The caches are of any KV type (kv_cache.cu; a kernel per type): their values are
// decoded to f32 as they are loaded into shared memory, and everything after is as for
// an f32 cache.
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

// KV: the caches' type; DV = ceil(D / 32): output dimensions per lane; QW: queries per warp
template <int KV, int DV, int QW>
__device__ void attention_body(const float* __restrict__ q, const u8* __restrict__ kc,
                               const u8* __restrict__ vc, const int* __restrict__ pos,
                               float* __restrict__ out, float* __restrict__ part,
                               i8* __restrict__ xq, float* __restrict__ xd, u16* __restrict__ xh,
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
    // Values in each cache (the Q8_0 scales follow them).
    const size_t elements = (size_t)pool_rows * kv_heads * D;
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
                    kv = kv_load4<KV>(kc, off, elements);
                    vv = kv_load4<KV>(vc, off, elements);
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
                    kv = kv_load1<KV>(kc, off, elements);
                    vv = kv_load1<KV>(vc, off, elements);
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
                if (xh != nullptr && d < D) xh[row * D + d] = f32_to_f16(acc[w][i] * inv);
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
// sizes their blocks to what each runs. Named attention_<KV type>_<DV>_<QW>.
#define ATTENTION(KV, NAME, DV, QW, BOUNDS)                                                  \
    extern "C" __global__ void BOUNDS attention_##NAME##_##DV##_##QW(                        \
        const float* q, const u8* kc, const u8* vc, const int* pos, float* out,              \
        float* part, i8* xq, float* xd, u16* xh, const int* seq, const int* tables,          \
        int max_blocks,                                                                      \
        int block, int pool_rows, int n, int heads, int kv_heads, int D, float scale,        \
        float cap, int window, int qt, int span) {                                           \
        attention_body<KV, DV, QW>(q, kc, vc, pos, out, part, xq, xd, xh, seq, tables,       \
                                   max_blocks, block, pool_rows, n, heads, kv_heads, D,      \
                                   scale, cap, window, qt, span);                            \
    }
#define ATTENTION_QW(KV, NAME, DV) \
    ATTENTION(KV, NAME, DV, 1, __launch_bounds__(1024)) ATTENTION(KV, NAME, DV, 2, )
#define ATTENTION_KV(KV, NAME)                                                               \
    ATTENTION_QW(KV, NAME, 1) ATTENTION_QW(KV, NAME, 2) ATTENTION_QW(KV, NAME, 3)            \
    ATTENTION_QW(KV, NAME, 4) ATTENTION_QW(KV, NAME, 5) ATTENTION_QW(KV, NAME, 6)            \
    ATTENTION_QW(KV, NAME, 7) ATTENTION_QW(KV, NAME, 8)
ATTENTION_KV(KV_F32, f32)
ATTENTION_KV(KV_F16, f16)
ATTENTION_KV(KV_BF16, bf16)
ATTENTION_KV(KV_Q8_0, q8_0)

// Merge the splits' partial results of each (query, head); with xq non-null also the
// int8 copy, as attention_body writes it. With `rows` non-null the n queries' results go to
// rows rows[0..n) of the output (the decode kernel's row list). The splits' weights (their sums scaled to the
// common max) are found by the warp together, a lane a split, then each thread sums its
// dimensions over the splits with independent reads. Launch: grid (n * heads), block
// 32 * ceil(D / 32), dynamic shared memory splits floats.
extern "C" __global__ void attention_combine(const float* part, float* out, i8* xq, float* xd, u16* xh,
                                             int n, int heads, int D, int splits,
                                             const int* rows) {
    follow_previous();
    extern __shared__ float weight[];  // [splits]
    __shared__ float total;
    const size_t row = blockIdx.x;  // i * heads + h, for the i-th query
    const size_t stride = (size_t)n * heads * (D + 2);
    const float* base = part + row * (D + 2);
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float M = NEG_INF;
        for (int s = lane; s < splits; s += 32) M = fmaxf(M, base[s * stride]);
        M = warp_max(M);
        float L = 0.0f;
        for (int s = lane; s < splits; s += 32) {
            const float m = base[s * stride];
            const float w = m != NEG_INF ? expf(m - M) : 0.0f;
            weight[s] = w;
            L += base[s * stride + 1] * w;
        }
        L = warp_sum(L);
        if (lane == 0) total = L;
    }
    __syncthreads();
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const size_t orow = rows != nullptr ? (size_t)rows[row / heads] * heads + row % heads : row;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float w = weight[s];
            if (w != 0.0f) o += base[s * stride + 2 + d] * w;
        }
        out[orow * D + d] = o * inv;
        if (xq != nullptr) quantize_warp_unit(o * inv, xq + orow * D + (d & ~31), xd + orow * (D / 32) + d / 32);
        if (xh != nullptr) xh[orow * D + d] = f32_to_f16(o * inv);
    }
}

// Decode-shaped attention: every query on its own (a server's decodes, a paged batch's
// rows, a few tokens of one sequence), keys read straight from the cache into registers
// (no shared-memory staging, so nothing waits on a block-wide barrier between reads).
//
// A block serves one query, one KV head and one split of the key range. Its warps are
// (head set, key slot) pairs: a warp scores up to HPW = 4 heads of the KV head's group,
// the block's sets cover the group, and the key slots take turns through the keys. A key
// row spans LK = D / 8 lanes, 8 values a lane (one 16-byte read of an f16 cache), so a
// warp reads 32 / LK keys at once and U such reads back to back: 4 rows of K and 4 of V
// in flight a lane. Each lane sums its 8 products per head, the LK lanes of a key add
// theirs (shuffles), and the softmax runs online per head with one running max for the
// warp (in base 2: scores scaled by log2 e, exp2); a lane keeps the sum and output (its 8
// dimensions) of its own keys, merged across the warp's key groups at the end and across
// key slots through shared memory.
//
// The kernel is bound by the instructions it issues, so the loop holds only what each
// read needs: a read's rows are found once (KvRows::run; a lookup a key only where its
// keys straddle a block), the softcap is a template argument (CAP), and exp2 takes
// scores already in base 2. (A head whose keys are not yet visible is skipped by a
// branch: without it the compiler interleaves the four heads and spills.)
//
// Split-K and paged tables as attention_body (the same `part` layout, its maxima in the
// natural base; attention_combine merges the splits). With `rows` non-null block x serves
// query rows[x] (a paged batch's rows that are alone in their sequence, beside prompt
// chunks that attention_tc takes), n counts those, and `part` is laid out by x. Launch:
// grid (n, kv_heads, splits), block (32, sets * slots) with sets = ceil(group / 4),
// dynamic shared memory sets * slots * 4 * (D + 2) floats.
// One step of summing 2 * O values over lane pairs (lane, lane ^ O): the lane keeps the
// lower or upper O (by bit O of `piece`) plus its partner's copy of them, in d[0, O).
template <int O>
__device__ __forceinline__ void decode_halve(float* d, int piece) {
    const bool upper = (piece & O) != 0;
#pragma unroll
    for (int k = 0; k < O; k++) {
        const float send = upper ? d[k] : d[k + O];
        const float keep = upper ? d[k + O] : d[k];
        d[k] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

#define DECODE_LOG2E 1.4426950408889634f
#define DECODE_LN2 0.6931471805599453f
template <int KV, int D, bool CAP>
__device__ void attention_decode_body(const float* __restrict__ q, const u8* __restrict__ kc,
                                      const u8* __restrict__ vc, const int* __restrict__ pos,
                                      float* __restrict__ out, float* __restrict__ part,
                                      i8* __restrict__ xq, float* __restrict__ xd, u16* __restrict__ xh,
                                      const int* __restrict__ seq, const int* __restrict__ tables,
                                      int max_blocks, int block, int pool_rows, int n, int heads,
                                      int kv_heads, float scale, float cap, int window, int span,
                                      const int* __restrict__ rows) {
    constexpr int LK = D / 8, KPL = 32 / LK, U = 4, HPW = 4;
    follow_previous();
    extern __shared__ float smem[];
    const int group = heads / kv_heads, sets = (group + HPW - 1) / HPW;
    const int slots = blockDim.y / sets;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int set = warp % sets, slot = warp / sets;
    const int slot_q = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int qi = rows != nullptr ? rows[slot_q] : slot_q;
    const int sub = lane / LK, piece = lane % LK;  // which key of a read, which 8 values
    const int qpos = pos[qi];
    const int lo = max(window > 0 ? max(0, qpos - window + 1) : 0, split * span);
    const int hi = min(qpos, (split + 1) * span - 1);
    const size_t elements = (size_t)pool_rows * kv_heads * D;
    const KvRows src{tables != nullptr ? tables + (size_t)seq[qi] * max_blocks : nullptr, max_blocks,
                     block, pool_rows};
    // Scores in base 2: s2 = s * log2 e, and the softcap's cap * tanh(s / cap) likewise.
    const float scale2 = scale * DECODE_LOG2E, cap2 = cap * DECODE_LOG2E;

    // This warp's heads: kvh * group + set * HPW + g, for g < HPW within the group.
    float qv[HPW][8];
#pragma unroll
    for (int g = 0; g < HPW; g++) {
        const int gh = set * HPW + g;
        const float* qr = q + ((size_t)qi * heads + kvh * group + min(gh, group - 1)) * D + 8 * piece;
        const float4 a = *(const float4*)qr, b = *(const float4*)(qr + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; i++) qv[g][i] = gh < group ? v[i] : 0.0f;
    }

    float m[HPW], l[HPW], acc[HPW][8];
#pragma unroll
    for (int g = 0; g < HPW; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.0f;
    }

    const int stride = slots * KPL * U;
    for (int c0 = lo + slot * KPL * U; c0 <= hi; c0 += stride) {
        const size_t first = src.run(c0, KPL * U);
        Kv8<KV> kr[U], vr[U];
        bool seen[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int kp = c0 + u * KPL + sub;
            size_t row = KvRows::NO_ROW;
            if (kp <= hi) row = first != KvRows::NO_ROW ? first + u * KPL + sub : src.row(kp);
            seen[u] = row != KvRows::NO_ROW;
            if (seen[u]) {
                const size_t e = (row * kv_heads + kvh) * D + 8 * piece;
                kr[u].load(kc, e, elements);
                vr[u].load(vc, e, elements);
            } else {
                kr[u].zero();
                vr[u].zero();
            }
        }
        // The softmax's weights p of the read's keys for the warp's heads (the same in every
        // lane of a key), the running max and sum updated; each key piece is widened to
        // f32 once and used for every head.
        float s[U][HPW];
        if constexpr (LK == 16) {
            // Heads of 128: each lane's 16 partial dots (u, g) are summed over the key's 16
            // lanes by halving: at each step a lane keeps half its values and adds its
            // partner's copy of that half (the pairs the one-value butterfly adds, so the
            // sums are the same to the bit), and lane `piece` ends with the whole dot of
            // (u, g) = (piece / 4, piece % 4): 15 shuffles instead of 64, and one score
            // and exp2 a lane instead of 16; the weights then go to every lane by shuffle.
            float d[U * HPW];
#pragma unroll
            for (int u = 0; u < U; u++) {
                float kf[8];
#pragma unroll
                for (int i = 0; i < 8; i++) kf[i] = kr[u].at(i);
#pragma unroll
                for (int g = 0; g < HPW; g++) {
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; i++) dot += qv[g][i] * kf[i];
                    d[u * HPW + g] = dot;
                }
            }
            decode_halve<8>(d, piece);
            decode_halve<4>(d, piece);
            decode_halve<2>(d, piece);
            decode_halve<1>(d, piece);
            const int own_u = piece >> 2, own_g = piece & 3;
            bool seen_own = false;
#pragma unroll
            for (int u = 0; u < U; u++) seen_own = u == own_u ? seen[u] : seen_own;
            const float sc = CAP ? cap2 * tanhf(d[0] * scale / cap) : d[0] * scale2;
            const float s_own = seen_own ? sc : NEG_INF;
            // A head's lanes differ in bits 2 and 3 (the read) and 4 (the key group).
            float mx = fmaxf(s_own, __shfl_xor_sync(0xffffffffu, s_own, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            float m_own = NEG_INF;
#pragma unroll
            for (int g = 0; g < HPW; g++) {
                const float mg = __shfl_sync(0xffffffffu, mx, g);  // lane g: head g's max
                // Rescaled only when the running max rises (the same in every lane), which
                // after the first keys is seldom; never while no key has been visible.
                if (mg > m[g]) {
                    const float corr = exp2f(m[g] - mg);  // 0 for the first visible keys
                    m[g] = mg;
                    l[g] *= corr;
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[g][i] *= corr;
                }
                m_own = g == own_g ? m[g] : m_own;
            }
            // While no key has been visible m is -inf and every weight exp2(-inf) = 0.
            const float p_own = exp2f(s_own - (m_own == NEG_INF ? 0.0f : m_own));
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int g = 0; g < HPW; g++) {
                    s[u][g] = __shfl_sync(0xffffffffu, p_own, (lane & 16) | (u * HPW + g));
                    l[g] += s[u][g];
                }
            }
        } else {
#pragma unroll
            for (int u = 0; u < U; u++) {
                float kf[8];
#pragma unroll
                for (int i = 0; i < 8; i++) kf[i] = kr[u].at(i);
#pragma unroll
                for (int g = 0; g < HPW; g++) {
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; i++) dot += qv[g][i] * kf[i];
#pragma unroll
                    for (int o = LK / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    const float sc = CAP ? cap2 * tanhf(dot * scale / cap) : dot * scale2;
                    s[u][g] = seen[u] ? sc : NEG_INF;
                }
            }
#pragma unroll
            for (int g = 0; g < HPW; g++) {
                float mx = s[0][g];
#pragma unroll
                for (int u = 1; u < U; u++) mx = fmaxf(mx, s[u][g]);
#pragma unroll
                for (int o = LK; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                if (mx > m[g]) {
                    const float corr = exp2f(m[g] - mx);
                    m[g] = mx;
                    l[g] *= corr;
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[g][i] *= corr;
                }
                const float m_use = m[g] == NEG_INF ? 0.0f : m[g];  // then every p is 0
#pragma unroll
                for (int u = 0; u < U; u++) {
                    s[u][g] = exp2f(s[u][g] - m_use);
                    l[g] += s[u][g];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float vf[8];
#pragma unroll
            for (int i = 0; i < 8; i++) vf[i] = vr[u].at(i);
#pragma unroll
            for (int g = 0; g < HPW; g++) {
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] += s[u][g] * vf[i];
            }
        }
    }

    // The warp's key groups merged (they share the warp's running max), then each warp's
    // (max, sum, output) into shared memory: [warp][g][max, sum, D values].
#pragma unroll
    for (int g = 0; g < HPW; g++) {
#pragma unroll
        for (int o = LK; o < 32; o <<= 1) {
            l[g] += __shfl_xor_sync(0xffffffffu, l[g], o);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        }
        float* w = smem + ((size_t)warp * HPW + g) * (D + 2);
        if (sub == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) w[2 + 8 * piece + i] = acc[g][i];
        }
        if (lane == 0) {
            w[0] = m[g];
            w[1] = l[g];
        }
    }
    __syncthreads();

    // Each (head of the group, dimension) merged over the key slots; a warp's 32 threads
    // take 32 consecutive dimensions of one head (D is a multiple of 32), as the int8
    // copy's rounding wants.
    const int tid = warp * 32 + lane, nthreads = blockDim.y * 32;
    for (int idx = tid; idx < group * D; idx += nthreads) {
        const int gh = idx / D, d = idx - gh * D;
        const int hs = gh / HPW, g = gh % HPW;
        float M = NEG_INF;
        for (int k = 0; k < slots; k++) M = fmaxf(M, smem[((size_t)(k * sets + hs) * HPW + g) * (D + 2)]);
        float L = 0.0f, o = 0.0f;
        if (M != NEG_INF) {
            for (int k = 0; k < slots; k++) {
                const float* w = smem + ((size_t)(k * sets + hs) * HPW + g) * (D + 2);
                const float f = exp2f(w[0] - M);
                L += w[1] * f;
                o += w[2 + d] * f;
            }
        }
        const size_t row = (size_t)qi * heads + kvh * group + gh;
        if (splits == 1) {
            const float v = L > 0.0f ? o / L : 0.0f;
            out[row * D + d] = v;
            if (xq != nullptr) quantize_warp_unit(v, xq + row * D + (d & ~31), xd + row * (D / 32) + d / 32);
            if (xh != nullptr) xh[row * D + d] = f32_to_f16(v);
        } else {
            float* pp = part + (((size_t)split * n + slot_q) * heads + kvh * group + gh) * (D + 2);
            if (d == 0) {
                pp[0] = M * DECODE_LN2;  // attention_combine weighs splits by exp(max)
                pp[1] = L;
            }
            pp[2 + d] = o;
        }
    }
}

// The softcapped loop (Gemma 2) as a call of its own: inlined beside the plain loop, its
// registers made the plain loop spill.
template <int KV, int D>
__device__ __noinline__ void attention_decode_capped(
    const float* q, const u8* kc, const u8* vc, const int* pos, float* out, float* part, i8* xq,
    float* xd, u16* xh, const int* seq, const int* tables, int max_blocks, int block, int pool_rows, int n,
    int heads, int kv_heads, float scale, float cap, int window, int span, const int* rows) {
    attention_decode_body<KV, D, true>(q, kc, vc, pos, out, part, xq, xd, xh, seq, tables, max_blocks,
                                       block, pool_rows, n, heads, kv_heads, scale, cap, window,
                                       span, rows);
}

// Named attention_decode_<KV type>_<head dimensions>; blocks of up to 8 warps (a group of
// 32 heads), two such blocks an SM at least: 128 registers a thread, which leaves four
// blocks of a 4-head group an SM.
#define ATTENTION_DECODE(KV, NAME, D)                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) attention_decode_##NAME##_##D(           \
        const float* q, const u8* kc, const u8* vc, const int* pos, float* out, float* part,   \
        i8* xq, float* xd, u16* xh, const int* seq, const int* tables, int max_blocks,         \
        int block,                                                                             \
        int pool_rows, int n, int heads, int kv_heads, float scale, float cap, int window,     \
        int span, const int* rows) {                                                           \
        if (cap > 0.0f)                                                                        \
            attention_decode_capped<KV, D>(q, kc, vc, pos, out, part, xq, xd, xh, seq, tables, \
                                           max_blocks, block, pool_rows, n, heads, kv_heads,   \
                                           scale, cap, window, span, rows);                    \
        else                                                                                   \
            attention_decode_body<KV, D, false>(q, kc, vc, pos, out, part, xq, xd, xh, seq,    \
                                                tables, max_blocks, block, pool_rows, n,       \
                                                heads, kv_heads, scale, cap, window, span,     \
                                                rows);                                         \
    }
#define ATTENTION_DECODE_KV(KV, NAME) \
    ATTENTION_DECODE(KV, NAME, 64) ATTENTION_DECODE(KV, NAME, 128) ATTENTION_DECODE(KV, NAME, 256)
ATTENTION_DECODE_KV(KV_F32, f32)
ATTENTION_DECODE_KV(KV_F16, f16)
ATTENTION_DECODE_KV(KV_BF16, bf16)
ATTENTION_DECODE_KV(KV_Q8_0, q8_0)
