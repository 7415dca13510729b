// Training's attention backward on tensor cores, flash-style (under BF16 / F16 products):
// the score matrices are never written, and key tiles no query row sees (the causal
// mask's upper half) are skipped. It replaced five cuBLAS products a head around a
// softmax-backward kernel over the whole n × cap square (grad.cu's grad_attention_rows).
//
// Operands are the 16-bit copies the products read (q, k, v, dout rounded once: bf16, or
// f16 with BF = false); the products are mma.m16n8k16 with f32 sums; the probabilities P
// and score gradients dS go into their products rounded to 16 bits, as the cuBLAS path
// wrote them. With z = scale · q·k (then softcap · tanh(z / softcap) when capped):
//   P = exp(z − lse), dP = dO·Vᵀ, D = Σ_keys P ∘ dP (= rowsum(dO ∘ O)),
//   dS = P ∘ (dP − D) ∘ dz/draw, dQ += scale · dS·K, dK += scale · dSᵀ·Q, dV += Pᵀ·dO.
//
// Two kernels over the same list of tiles (cut by attention_grad_tc.rs), 6 ints each:
// a run's first query row and rows, its first key row and keys (a key's position is its
// offset in the run), and the tile's own first offset and count (query rows for agt_dq,
// key positions for agt_dkv). Positions as grad_attention_rows: a query at p sees keys
// min(p, keys - 1) and back (to p - window + 1 with a window).
//   agt_dq_*: a block of 4 warps owns 64 query rows of one head (16 a warp). A first
//     pass over the keys it sees gives each row lse (in log2 units) and D, written for
//     agt_dkv; a second adds dQ. Launch: grid (tiles, heads), block (32, 4).
//   agt_dkv_*: a block owns 64 key positions of one KV head (16 a warp), and runs every
//     head of its group over every chunk of QC query rows that sees one of them, two
//     chunks in flight; it adds dK and dV. Launch: grid (tiles, kv_heads), block (32, 4).
// Each block alone writes its rows of dQ, or its keys' rows of dK and dV, in a fixed
// order: the sums are the same on every run. With `write` the block writes them (the
// gradients begin here) instead of adding to what they hold.

#define AGT_KEYS 64
// Words of agt_dkv's bit sets over a run's chunks of query rows (a bit a chunk): runs of
// at most 32 · AGT_CHUNK_WORDS chunks (attention_grad_tc.rs cuts longer ones).
#define AGT_CHUNK_WORDS 64
#define AGT_ROW(D) ((D) + 8)

// Two floats as a 16-bit pair, `lo` in the low half.
template <bool BF> __device__ __forceinline__ u32 agt_pack(float lo, float hi) {
    if constexpr (BF) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    } else {
        return pack_f16x2(lo, hi);
    }
}

template <bool BF> __device__ __forceinline__ void agt_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    if constexpr (BF) {
        mma_bf16_16816(c, a, b0, b1);
    } else {
        mma_16816(c, a, b0, b1);
    }
}

// Fragments from a shared tile of rows ROW halves apart (mma.cuh's layout):
// A of rows m0 .. m0 + 15 at columns k0 .. k0 + 15 of an [m][k] tile;
__device__ __forceinline__ void agt_a(u32 a[4], const u16* t, int row, int m0, int k0) {
    const int lane = threadIdx.x;
    ldmatrix_x4(a, t + (m0 + (lane & 15)) * row + k0 + (lane >> 4) * 8);
}
// B of columns n0 .. n0 + 15 (b[0], b[1]: n0 .. n0 + 7; b[2], b[3]: the next 8) at rows
// k0 .. k0 + 15, from an [n][k] tile;
__device__ __forceinline__ void agt_b_nk(u32 b[4], const u16* t, int row, int n0, int k0) {
    const int lane = threadIdx.x;
    ldmatrix_x4(b, t + (n0 + (lane & 7) + ((lane >> 4) << 3)) * row + k0 + ((lane >> 3) & 1) * 8);
}
// the same from a [k][n] tile.
__device__ __forceinline__ void agt_b_kn(u32 b[4], const u16* t, int row, int k0, int n0) {
    const int lane = threadIdx.x;
    ldmatrix_x4_trans(b, t + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * row + n0 + (lane >> 4) * 8);
}

// Rows [0, count) of a tile of `rows` (rows ≥ count become zeros) from 16-bit rows
// `stride` elements apart, by cp.async; a thread takes one 16-byte piece of every
// (threads / (D / 8))-th row (its address a step of the last one's: the index arithmetic
// of a piece had been ~70 instructions).
template <int D>
__device__ __forceinline__ void agt_load(u16* dst, const u16* src, size_t stride, int rows, int count) {
    constexpr int PARTS = D / 8;
    const int tid = threadIdx.y * 32 + threadIdx.x, step = blockDim.y * 32 / PARTS, part = tid % PARTS;
    int r = tid / PARTS;
    const u16* from = src + r * stride + 8 * part;
    u16* to = dst + r * AGT_ROW(D) + 8 * part;
    for (; r < rows; r += step, from += step * stride, to += step * AGT_ROW(D))
        cp_async16(to, r < count ? from : src, r < count ? 16 : 0);
}

#define AGT_LOG2E 1.4426950408889634f

// 2^x (the SFU's approximation, a few ulp of f32: the probabilities it makes are rounded
// to 16 bits for their products). The softmax runs in log2 units: z · log2(e) and
// lse · log2(e), one FMA and one ex2 a probability.
__device__ __forceinline__ float agt_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The score z of raw product s (scaled, capped) in log2 units, and dz/ds over scale. The
// kernels take CAP (cap > 0) as a template argument, chosen once at their entry: a test a
// score had made every score's code a branch.
template <bool CAP> __device__ __forceinline__ float agt_score2(float s, float scale, float cap, float* dz) {
    if constexpr (CAP) {
        const float t = tanhf(s * scale / cap);
        *dz = 1.0f - t * t;
        return cap * AGT_LOG2E * t;
    }
    *dz = 1.0f;
    return s * (scale * AGT_LOG2E);
}

// The position up to which a query at `p` sees a run of `keys` keys (-1: none).
__device__ __forceinline__ int agt_last_key(int p, int keys) { return min(p, keys - 1); }

__device__ __forceinline__ bool agt_sees(int kp, int last, int window) {
    return kp >= 0 && kp <= last && (window <= 0 || kp > last - window);
}

template <int D, bool BF, bool CAP>
__device__ void agt_dq_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                            const u16* __restrict__ dout, const int* __restrict__ pos,
                            const int* __restrict__ tiles, float* __restrict__ dq, float* __restrict__ lse_out,
                            float* __restrict__ d_out, int heads, int kv_heads, float scale, float cap,
                            int window, int given, int write) {
    constexpr int KS = D / 16, ROW = AGT_ROW(D);
    follow_previous();
    extern __shared__ __align__(16) u8 agt_smem[];
    u16* Ks = (u16*)agt_smem;          // [2][AGT_KEYS][ROW]
    u16* Vs = Ks + 2 * AGT_KEYS * ROW;  // [2][AGT_KEYS][ROW]
    const int* tile = tiles + 6 * blockIdx.x;
    const int k0 = tile[2], keys = tile[3], first = tile[0] + tile[4], rows = tile[5];
    const int h = blockIdx.y, kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x, warp = threadIdx.y, g = lane >> 2, c = lane & 3;

    // The keys any row of the tile sees (each warp finds them, its lanes taking rows).
    int hi = -1, lo = 0x7fffffff;
    for (int t = lane; t < rows; t += 32) {
        const int last = agt_last_key(pos[first + t], keys);
        if (last < 0) continue;
        hi = max(hi, last);
        lo = min(lo, window > 0 ? max(0, last - window + 1) : 0);
    }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) {
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, x));
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, x));
    }

    // This thread's two rows, g and g + 8 of the warp's 16, and their last keys.
    int last[2];
    bool live[2];
    size_t at[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int t = 16 * warp + g + 8 * i;
        live[i] = t < rows;
        last[i] = live[i] ? agt_last_key(pos[first + t], keys) : -1;
        at[i] = ((size_t)(first + t) * heads + h) * D;
    }
    // The least and most a live row of this warp sees: a chunk of keys every row sees
    // whole skips the mask (the causal square's tiles below the diagonal).
    int w_min = 0x7fffffff, w_max = -1;
#pragma unroll
    for (int i = 0; i < 2; i++)
        if (live[i]) {
            w_min = min(w_min, last[i]);
            w_max = max(w_max, last[i]);
        }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) {
        w_min = min(w_min, __shfl_xor_sync(0xffffffffu, w_min, x));
        w_max = max(w_max, __shfl_xor_sync(0xffffffffu, w_max, x));
    }
    auto whole = [&](int c0) { return c0 + AGT_KEYS - 1 <= w_min && (window <= 0 || c0 > w_max - window); };

    // Queries and output gradients as A fragments (k-step s: columns 16s + 2c, + 1, and + 8).
    u32 qa[KS][4], da[KS][4];
#pragma unroll
    for (int s = 0; s < KS; s++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int i = r & 1, col = 16 * s + 2 * c + 8 * (r >> 1);
            qa[s][r] = live[i] ? *(const u32*)(q + at[i] + col) : 0u;
            da[s][r] = live[i] ? *(const u32*)(dout + at[i] + col) : 0u;
        }

    const size_t kv_stride = (size_t)kv_heads * D;
    const int c_first = hi < 0 ? 0 : (lo / AGT_KEYS) * AGT_KEYS;
    const int chunks = hi < 0 ? 0 : (hi - c_first) / AGT_KEYS + 1;
    auto load_chunk = [&](int ch, int buf) {
        const int c0 = c_first + ch * AGT_KEYS;
        const size_t e = ((size_t)(k0 + c0) * kv_heads + kvh) * D;
        agt_load<D>(Ks + buf * AGT_KEYS * ROW, k + e, kv_stride, AGT_KEYS, min(AGT_KEYS, keys - c0));
        agt_load<D>(Vs + buf * AGT_KEYS * ROW, v + e, kv_stride, AGT_KEYS, min(AGT_KEYS, keys - c0));
        cp_async_commit();
    };
    // Scores S (raw products) and dP of the warp's rows against chunk `buf`'s 64 keys:
    // tile j holds keys 8j + 2c, + 1 of rows g (registers 0, 1) and g + 8 (2, 3).
    auto products = [&](int buf, float sc[8][4], float dp[8][4]) {
        const u16* kb = Ks + buf * AGT_KEYS * ROW;
        const u16* vb = Vs + buf * AGT_KEYS * ROW;
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) sc[j][r] = dp[j][r] = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; p++)
#pragma unroll
            for (int s = 0; s < KS; s++) {
                u32 b[4];
                agt_b_nk(b, kb, ROW, 16 * p, 16 * s);
                agt_mma<BF>(sc[2 * p], qa[s], b[0], b[1]);
                agt_mma<BF>(sc[2 * p + 1], qa[s], b[2], b[3]);
                agt_b_nk(b, vb, ROW, 16 * p, 16 * s);
                agt_mma<BF>(dp[2 * p], da[s], b[0], b[1]);
                agt_mma<BF>(dp[2 * p + 1], da[s], b[2], b[3]);
            }
    };
    // Chunk ch's keys and values in shared memory (buffer ch & 1), the next chunk's loads
    // in flight; the loop's body ends with a barrier before the next refill.
    auto await_chunk = [&](int ch) {
        if (ch == 0) load_chunk(0, 0);
        if (ch + 1 < chunks) {
            load_chunk(ch + 1, (ch + 1) & 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
    };

    // Pass 1: each row's running max m, and its lanes' shares of l = Σ exp(z − m) and
    // a = Σ exp(z − m) · dP (m and lse in log2 units, as written for agt_dkv); skipped
    // when the forward kept lse and D came from its output (`given`).
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, a[2] = {0.0f, 0.0f};
    for (int ch = 0; ch < (given ? 0 : chunks); ch++) {
        await_chunk(ch);
        const int c0 = c_first + ch * AGT_KEYS, buf = ch & 1;
        float sc[8][4], dp[8][4];
        products(buf, sc, dp);
        const bool full = whole(c0);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float dz;
                    const float z = agt_score2<CAP>(sc[j][2 * i + e], scale, cap, &dz);
                    const bool ok = full || agt_sees(c0 + 8 * j + 2 * c + e, last[i], window);
                    sc[j][2 * i + e] = ok ? z : NEG_INF;
                    mx = fmaxf(mx, sc[j][2 * i + e]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[i], mx);
            if (m_new == NEG_INF) continue;
            const float corr = agt_exp2(m[i] - m_new);
            float ls = 0.0f, as = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float z = sc[j][2 * i + e];
                    const float p = agt_exp2(z - m_new);
                    ls += p;
                    as += p * dp[j][2 * i + e];
                }
            l[i] = l[i] * corr + ls;
            a[i] = a[i] * corr + as;
            m[i] = m_new;
        }
        __syncthreads();
    }
    float lse[2], dsum[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (given) {
            const size_t r = (size_t)(first + 16 * warp + g + 8 * i) * heads + h;
            lse[i] = live[i] ? lse_out[r] : -NEG_INF;
            dsum[i] = live[i] ? d_out[r] : 0.0f;
            continue;
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], x);
            a[i] += __shfl_xor_sync(0xffffffffu, a[i], x);
        }
        // A row that sees no key has P = 0 throughout.
        const bool any = l[i] > 0.0f;
        lse[i] = any ? m[i] + log2f(l[i]) : (-NEG_INF);
        dsum[i] = any ? a[i] / l[i] : 0.0f;
        if (live[i] && c == 0) {
            const size_t r = (size_t)(first + 16 * warp + g + 8 * i) * heads + h;
            lse_out[r] = lse[i];
            d_out[r] = dsum[i];
        }
    }

    // Pass 2: dS of the chunk as A fragments (keys 16p .. 16p + 15 are score tiles 2p
    // and 2p + 1 as they lie), times the keys: dQ tile j holds dimensions 8j + 2c, + 1.
    float acc[2 * KS][4];
#pragma unroll
    for (int j = 0; j < 2 * KS; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[j][r] = 0.0f;
    for (int ch = 0; ch < chunks; ch++) {
        await_chunk(ch);
        const int c0 = c_first + ch * AGT_KEYS, buf = ch & 1;
        float sc[8][4], dp[8][4];
        products(buf, sc, dp);
        const bool full = whole(c0);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                // Computed for every score, kept where the row sees the key (straight-line
                // code; a masked score's value, whatever it is, is dropped by the select).
                const int i = r >> 1;
                float dz;
                const float z = agt_score2<CAP>(sc[j][r], scale, cap, &dz);
                const float ds = agt_exp2(z - lse[i]) * (dp[j][r] - dsum[i]) * dz;
                const bool ok = full || agt_sees(c0 + 8 * j + 2 * c + (r & 1), last[i], window);
                sc[j][r] = ok ? ds : 0.0f;
            }
        const u16* kb = Ks + buf * AGT_KEYS * ROW;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const u32 fa[4] = {agt_pack<BF>(sc[2 * p][0], sc[2 * p][1]), agt_pack<BF>(sc[2 * p][2], sc[2 * p][3]),
                               agt_pack<BF>(sc[2 * p + 1][0], sc[2 * p + 1][1]),
                               agt_pack<BF>(sc[2 * p + 1][2], sc[2 * p + 1][3])};
#pragma unroll
            for (int s = 0; s < KS; s++) {
                u32 b[4];
                agt_b_kn(b, kb, ROW, 16 * p, 16 * s);
                agt_mma<BF>(acc[2 * s], fa, b[0], b[1]);
                agt_mma<BF>(acc[2 * s + 1], fa, b[2], b[3]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (!live[i]) continue;
        float* dst = dq + at[i] + 2 * c;
#pragma unroll
        for (int j = 0; j < 2 * KS; j++) {
            float2 o = write ? make_float2(0.0f, 0.0f) : *(float2*)(dst + 8 * j);
            o.x += scale * acc[j][2 * i];
            o.y += scale * acc[j][2 * i + 1];
            *(float2*)(dst + 8 * j) = o;
        }
    }
}

template <int D, bool BF, int QC, bool CAP>
__device__ void agt_dkv_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                             const u16* __restrict__ dout, const int* __restrict__ pos,
                             const int* __restrict__ tiles, const float* __restrict__ lse_in,
                             const float* __restrict__ d_in, float* __restrict__ dk, float* __restrict__ dv,
                             int heads, int kv_heads, float scale, float cap, int window, int write) {
    constexpr int KS = D / 16, ROW = AGT_ROW(D);
    follow_previous();
    extern __shared__ __align__(16) u8 agt_smem[];
    u16* Ks = (u16*)agt_smem;            // [AGT_KEYS][ROW]
    u16* Vs = Ks + AGT_KEYS * ROW;        // [AGT_KEYS][ROW]
    u16* Qs = Vs + AGT_KEYS * ROW;        // [2][QC][ROW]
    u16* Ds = Qs + 2 * QC * ROW;          // [2][QC][ROW]: output gradients
    float* lse_s = (float*)(Ds + 2 * QC * ROW);  // [2][QC]
    float* d_s = lse_s + 2 * QC;                 // [2][QC]
    int* pos_s = (int*)(d_s + 2 * QC);           // [2][QC]
    const int* tile = tiles + 6 * blockIdx.x;
    const int q0 = tile[0], qn = tile[1], k0 = tile[2], keys = tile[3], t0 = tile[4], tn = tile[5];
    const int kvh = blockIdx.y, group = heads / kv_heads;
    const int lane = threadIdx.x, warp = threadIdx.y, g = lane >> 2, c = lane & 3;
    const int tid = warp * 32 + lane;
    const int q_chunks = (qn + QC - 1) / QC;

    // Which chunks of query rows see one of the tile's keys, and which see all of them
    // (those skip the mask), as bits; one pass over the run's positions.
    __shared__ u32 sees_bits[AGT_CHUNK_WORDS], whole_bits[AGT_CHUNK_WORDS];
    for (int i = tid; i < AGT_CHUNK_WORDS; i += blockDim.y * 32) {
        sees_bits[i] = 0u;
        whole_bits[i] = tn == AGT_KEYS ? ~0u : 0u;
    }
    __syncthreads();
    for (int r = tid; r < qn; r += blockDim.y * 32) {
        const int last = agt_last_key(pos[q0 + r], keys), cq = r / QC;
        const u32 bit = 1u << (cq & 31);
        if (last >= t0 && (window <= 0 || last - window + 1 <= t0 + tn - 1)) atomicOr(&sees_bits[cq >> 5], bit);
        if (!(last >= t0 + tn - 1 && (window <= 0 || t0 > last - window))) atomicAnd(&whole_bits[cq >> 5], ~bit);
    }
    __syncthreads();
    auto next_chunk = [&](int cq) {
        while (cq < q_chunks && !((sees_bits[cq >> 5] >> (cq & 31)) & 1u)) cq++;
        return cq;
    };
    auto sees_whole_tile = [&](int cq) { return ((whole_bits[cq >> 5] >> (cq & 31)) & 1u) != 0; };
    // Items are (chunk, head of the group), heads innermost. Rows past the run load as
    // zeros (q, dO, lse, D and position): their P·dO and dS·Q add nothing.
    auto load_item = [&](int cq, int hh, int buf) {
        const int h = kvh * group + hh, r0 = cq * QC, count = min(QC, qn - r0);
        const size_t e = ((size_t)(q0 + r0) * heads + h) * D;
        agt_load<D>(Qs + buf * QC * ROW, q + e, (size_t)heads * D, QC, count);
        agt_load<D>(Ds + buf * QC * ROW, dout + e, (size_t)heads * D, QC, count);
        for (int r = tid; r < QC; r += blockDim.y * 32) {
            const bool ok = r < count;
            const size_t at = ok ? (size_t)(q0 + r0 + r) * heads + h : 0;
            cp_async4(lse_s + buf * QC + r, lse_in + at, ok ? 4 : 0);
            cp_async4(d_s + buf * QC + r, d_in + at, ok ? 4 : 0);
            cp_async4(pos_s + buf * QC + r, pos + (ok ? q0 + r0 + r : 0), ok ? 4 : 0);
        }
        cp_async_commit();
    };

    int cq = next_chunk(0), hh = 0;
    if (cq >= q_chunks) {
        // No query sees these keys: their gradients are zeros, written when asked.
        if (write)
            for (int e = tid; e < tn * D; e += blockDim.y * 32) {
                const size_t at = ((size_t)(k0 + t0 + e / D) * kv_heads + kvh) * D + e % D;
                dk[at] = 0.0f;
                dv[at] = 0.0f;
            }
        return;
    }
    bool full = sees_whole_tile(cq);
    {
        const size_t e = ((size_t)(k0 + t0) * kv_heads + kvh) * D;
        agt_load<D>(Ks, k + e, (size_t)kv_heads * D, AGT_KEYS, tn);
        agt_load<D>(Vs, v + e, (size_t)kv_heads * D, AGT_KEYS, tn);
        cp_async_commit();
    }
    load_item(cq, hh, 0);

    float dka[2 * KS][4], dva[2 * KS][4];
#pragma unroll
    for (int j = 0; j < 2 * KS; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) dka[j][r] = dva[j][r] = 0.0f;
    // This thread's keys: rows g and g + 8 of the warp's 16.
    const int kr0 = 16 * warp + g;

    for (int buf = 0; cq < q_chunks; buf ^= 1) {
        int ncq = cq, nhh = hh + 1;
        bool next_full = full;
        if (nhh == group) {
            nhh = 0;
            ncq = next_chunk(cq + 1);
            if (ncq < q_chunks) next_full = sees_whole_tile(ncq);
        }
        if (ncq < q_chunks) {
            load_item(ncq, nhh, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* qb = Qs + buf * QC * ROW;
        const u16* db = Ds + buf * QC * ROW;
        const float* lb = lse_s + buf * QC;
        const float* dsb = d_s + buf * QC;
        const int* posb = pos_s + buf * QC;

        // Sᵀ and dPᵀ of the warp's 16 keys against the chunk's QC rows: tile j holds
        // rows 8j + 2c, + 1 of keys g (registers 0, 1) and g + 8 (2, 3).
        float st[QC / 8][4], dpt[QC / 8][4];
#pragma unroll
        for (int j = 0; j < QC / 8; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) st[j][r] = dpt[j][r] = 0.0f;
#pragma unroll
        for (int s = 0; s < KS; s++) {
            u32 ka[4], va[4];
            agt_a(ka, Ks, ROW, 16 * warp, 16 * s);
            agt_a(va, Vs, ROW, 16 * warp, 16 * s);
#pragma unroll
            for (int p = 0; p < QC / 16; p++) {
                u32 b[4];
                agt_b_nk(b, qb, ROW, 16 * p, 16 * s);
                agt_mma<BF>(st[2 * p], ka, b[0], b[1]);
                agt_mma<BF>(st[2 * p + 1], ka, b[2], b[3]);
                agt_b_nk(b, db, ROW, 16 * p, 16 * s);
                agt_mma<BF>(dpt[2 * p], va, b[0], b[1]);
                agt_mma<BF>(dpt[2 * p + 1], va, b[2], b[3]);
            }
        }
        // Pᵀ and dSᵀ in place.
#pragma unroll
        for (int j = 0; j < QC / 8; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                // As agt_dq's: computed for every score, kept where the query sees the key.
                const int kr = kr0 + 8 * (r >> 1), row = 8 * j + 2 * c + (r & 1);
                float dz;
                const float z = agt_score2<CAP>(st[j][r], scale, cap, &dz);
                const float p = agt_exp2(z - lb[row]);
                const float ds = p * (dpt[j][r] - dsb[row]) * dz;
                const bool ok = full || (kr < tn && agt_sees(t0 + kr, agt_last_key(posb[row], keys), window));
                st[j][r] = ok ? p : 0.0f;
                dpt[j][r] = ok ? ds : 0.0f;
            }
        // dV += Pᵀ·dO and dK += dSᵀ·Q: rows 16p .. 16p + 15 of the chunk are tiles 2p and
        // 2p + 1 as they lie.
#pragma unroll
        for (int p = 0; p < QC / 16; p++) {
            const u32 pa[4] = {agt_pack<BF>(st[2 * p][0], st[2 * p][1]), agt_pack<BF>(st[2 * p][2], st[2 * p][3]),
                               agt_pack<BF>(st[2 * p + 1][0], st[2 * p + 1][1]),
                               agt_pack<BF>(st[2 * p + 1][2], st[2 * p + 1][3])};
            const u32 sa[4] = {agt_pack<BF>(dpt[2 * p][0], dpt[2 * p][1]),
                               agt_pack<BF>(dpt[2 * p][2], dpt[2 * p][3]),
                               agt_pack<BF>(dpt[2 * p + 1][0], dpt[2 * p + 1][1]),
                               agt_pack<BF>(dpt[2 * p + 1][2], dpt[2 * p + 1][3])};
#pragma unroll
            for (int s = 0; s < KS; s++) {
                u32 b[4];
                agt_b_kn(b, db, ROW, 16 * p, 16 * s);
                agt_mma<BF>(dva[2 * s], pa, b[0], b[1]);
                agt_mma<BF>(dva[2 * s + 1], pa, b[2], b[3]);
                agt_b_kn(b, qb, ROW, 16 * p, 16 * s);
                agt_mma<BF>(dka[2 * s], sa, b[0], b[1]);
                agt_mma<BF>(dka[2 * s + 1], sa, b[2], b[3]);
            }
        }
        // Every warp is done with this buffer before the next item's loads refill it.
        __syncthreads();
        cq = ncq;
        hh = nhh;
        full = next_full;
    }

#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int kr = kr0 + 8 * i;
        if (kr >= tn) continue;
        const size_t e = ((size_t)(k0 + t0 + kr) * kv_heads + kvh) * D + 2 * c;
#pragma unroll
        for (int j = 0; j < 2 * KS; j++) {
            const float2 zero = make_float2(0.0f, 0.0f);
            float2 o = write ? zero : *(float2*)(dk + e + 8 * j);
            o.x += scale * dka[j][2 * i];
            o.y += scale * dka[j][2 * i + 1];
            *(float2*)(dk + e + 8 * j) = o;
            o = write ? zero : *(float2*)(dv + e + 8 * j);
            o.x += dva[j][2 * i];
            o.y += dva[j][2 * i + 1];
            *(float2*)(dv + e + 8 * j) = o;
        }
    }
}

// D = Σ_d dO · O of each (query row, head) from the output the forward kept (its
// rounded copy) and the rounded output gradients: what agt_dq's first pass finds as
// Σ_keys P · dP. A warp a (row, head). Launch: grid (rows · heads / 8), block 256.
template <int D>
__device__ void agt_dsum_body(const u16* __restrict__ dout, const u16* __restrict__ out, float* __restrict__ dsum,
                              int count, bool bf) {
    const int w = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (w >= count) return;
    const u16* a = dout + (size_t)w * D;
    const u16* b = out + (size_t)w * D;
    float s = 0.0f;
#pragma unroll
    for (int j = lane; j < D; j += 32) {
        const float x = bf ? bf16_to_f32(a[j]) : f16_to_f32(a[j]);
        const float y = bf ? bf16_to_f32(b[j]) : f16_to_f32(b[j]);
        s += x * y;
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) s += __shfl_xor_sync(0xffffffffu, s, x);
    if (lane == 0) dsum[w] = s;
}

// agt_dq_<head dimensions>_<bf16|f16> and agt_dkv_<...>; the chunk of query rows agt_dkv
// holds is 64 for heads of 64 and 32 for heads of 128 (registers). Heads of 64 are held to
// 168 registers, three blocks an SM: at two (197 and 223 registers) the SMs had 8 warps,
// and no warp could issue in 62-72% of cycles (Nsight Compute, H200).
#define AGT_KERNELS(D, BF, TYPE, QC, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) agt_dq_##D##_##TYPE(                               \
        const u16* q, const u16* k, const u16* v, const u16* dout, const int* pos, const int* tiles,     \
        float* dq, float* lse, float* dsum, int heads, int kv_heads, float scale, float cap, int window,  \
        int given, int write) {                                                                          \
        if (cap > 0.0f)                                                                                  \
            agt_dq_body<D, BF, true>(q, k, v, dout, pos, tiles, dq, lse, dsum, heads, kv_heads, scale, cap,   \
                                     window, given, write);                                              \
        else                                                                                             \
            agt_dq_body<D, BF, false>(q, k, v, dout, pos, tiles, dq, lse, dsum, heads, kv_heads, scale, cap,  \
                                      window, given, write);                                             \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) agt_dsum_##D##_##TYPE(const u16* dout, const u16* out, \
                                                                          float* dsum, int count) {       \
        agt_dsum_body<D>(dout, out, dsum, count, BF);                                                     \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) agt_dkv_##D##_##TYPE(                              \
        const u16* q, const u16* k, const u16* v, const u16* dout, const int* pos, const int* tiles,     \
        const float* lse, const float* dsum, float* dk, float* dv, int heads, int kv_heads, float scale, \
        float cap, int window, int write) {                                                              \
        if (cap > 0.0f)                                                                                  \
            agt_dkv_body<D, BF, QC, true>(q, k, v, dout, pos, tiles, lse, dsum, dk, dv, heads, kv_heads,     \
                                          scale, cap, window, write);                                    \
        else                                                                                             \
            agt_dkv_body<D, BF, QC, false>(q, k, v, dout, pos, tiles, lse, dsum, dk, dv, heads, kv_heads,    \
                                           scale, cap, window, write);                                   \
    }
AGT_KERNELS(64, true, bf16, 64, 3)
AGT_KERNELS(64, false, f16, 64, 3)
AGT_KERNELS(128, true, bf16, 32, 1)
AGT_KERNELS(128, false, f16, 32, 1)
