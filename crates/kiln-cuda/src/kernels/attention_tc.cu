// Prompt-shaped attention on tensor cores over an f16 KV cache (a prompt, or a server's
// prompt chunks): the scores Q·Kᵀ and the value sum P·V are mma.m16n8k16 products of f16
// tiles with f32 sums, under the same online softmax as attention.cu, in log2 units (the
// queries carry scale · log2(e), so a probability is one ex2).
//
// Over an f16 cache (attention_tc_*) the queries (times the scale) and the probabilities
// each go in as two f16 parts, hi + lo (mma.cuh's split_f16x2), two products each: the
// results keep f32's accuracy, within the bounds the CUDA-core kernel meets. Over
// training's f32 pool, when the products were asked to round their inputs, the host
// rounds keys and values to f16 first (a 10-bit mantissa, as TF32's, and f16's range,
// which they must then stay within) and attention_tc_once_* takes queries and
// probabilities rounded to f16 once too, as the products that asked for rounding do with
// their operands (half the tensor-core work: 11% of a BF16 training step was this kernel
// with both parts; rounding keys and values on their way into shared memory kept the
// loads from overlapping the products).
//
// Training's forward under BF16 / F16 products (attention_tc_kept_*) reads the queries,
// keys and values the tape keeps for the backward, rounded already (bf16 or f16): the
// scores are their raw products, scaled in f32 as the flash backward's
// (attention_grad_tc.cu) are, and it keeps what that backward can use: each row's
// log-sum-exp of its scores (log2 units) and the output rounded as its operands are.
//
// A block serves one KV head and a tile of 16 · T query rows of one sequence: warp w takes
// head kvh · group + w % group and rows 16 · (w / group) .. + 16 of the tile, so every
// key and value loaded serves the group's heads and the tile's rows. Keys and values
// stream through shared memory in chunks of 64 positions at multiples of 64, two chunks in
// flight (cp.async); a row's result depends only on its own keys, never on the rows
// beside it in the tile.
//
// Tiles: with `tiles` null, tile x holds rows [x · 16T, min(n, x · 16T + 16T)) (one
// sequence's contiguous cache); otherwise tiles[2x] is its first row and tiles[2x + 1]
// its row count (a paged batch's runs of one sequence, cut by the host). Positions and
// paged tables as attention.cu (table entries outside the pool hide their keys).
//
// The queries times the scale must stay within f16's range (|q · scale · log2(e)| <
// 65504), as any real model's do.
//
// Launch: grid (tiles, kv_heads), block (32, group · T) with group · T <= 8, dynamic
// shared memory 2 · 2 · ATC_KEYS · ATC_ROW(D) halves and 2 · ATC_KEYS ints
// (attention_tc.rs's shared_bytes).

#define ATC_KEYS 64
// Halfs a shared key or value row holds: D and 8 of padding, so that the 8 rows one
// ldmatrix reads start in different banks.
#define ATC_ROW(D) ((D) + 8)
#define ATC_LOG2E 1.4426950408889634f

// 2^x, the SFU's approximation (a few ulp of f32).
__device__ __forceinline__ float atc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// What the queries are: f32 (scaled and rounded to f16 in the kernel), or the tape's
// rounded f16 or bf16 copies (raw; the products of the same type).
#define ATC_Q_F32 0
#define ATC_Q_F16 1
#define ATC_Q_BF16 2

template <int QT> __device__ __forceinline__ void atc_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    if constexpr (QT == ATC_Q_BF16) {
        mma_bf16_16816(c, a, b0, b1);
    } else {
        mma_16816(c, a, b0, b1);
    }
}

// Two floats as the products' 16-bit pair, `lo` in the low half.
template <int QT> __device__ __forceinline__ u32 atc_pack(float lo, float hi) {
    if constexpr (QT == ATC_Q_BF16) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    } else {
        return pack_f16x2(lo, hi);
    }
}

// Positions c0 .. c0 + 63 of KV head kvh into chunk buffer `buf` (keys, values, and a
// flag each: present and within [lo, hi]), 16-byte pieces of f16 by cp.async, zeros
// elsewhere; a thread takes one piece of every (threads / (D / 8))-th position, and one
// group is committed. The chunk's rows are found once (KvRows::run), not a table lookup
// and a division a piece: that arithmetic was a quarter of the kernel's instructions.
// A chunk whose positions all lie in consecutive rows and in [lo, hi] (every chunk of a
// training step, all but a prompt's last) steps its addresses by a constant: the general
// loop's tests and 64-bit products per piece were ~50 instructions a position, a quarter
// of a training forward's instructions (SASS, H200 build).
template <int D>
__device__ __forceinline__ void atc_load_chunk(u16* Ks, u16* Vs, int* seen, const u8* kc, const u8* vc,
                                               const KvRows& src, int kv_heads, int kvh, int c0,
                                               int lo, int hi, int buf) {
    constexpr int ROW = ATC_ROW(D), PARTS = D / 8;
    u16* kd = Ks + buf * ATC_KEYS * ROW;
    u16* vd = Vs + buf * ATC_KEYS * ROW;
    const int tid = threadIdx.y * 32 + threadIdx.x, step = blockDim.y * 32 / PARTS;
    const int part = tid % PARTS;
    const size_t row_bytes = 2 * (size_t)kv_heads * D, at = 2 * ((size_t)kvh * D + 8 * part);
    const size_t first = src.run(c0, ATC_KEYS);
    if (first != KvRows::NO_ROW && c0 >= lo && c0 + ATC_KEYS - 1 <= hi) {
        const size_t e = (first + tid / PARTS) * row_bytes + at, stride = step * row_bytes;
        const u8* kp = kc + e;
        const u8* vp = vc + e;
        for (int j = tid / PARTS; j < ATC_KEYS; j += step, kp += stride, vp += stride) {
            cp_async16(kd + j * ROW + 8 * part, kp, 16);
            cp_async16(vd + j * ROW + 8 * part, vp, 16);
            if (part == 0) seen[buf * ATC_KEYS + j] = 1;
        }
        cp_async_commit();
        return;
    }
    for (int j = tid / PARTS; j < ATC_KEYS; j += step) {
        const int kp = c0 + j;
        size_t row = KvRows::NO_ROW;
        if (kp >= lo && kp <= hi) row = first != KvRows::NO_ROW ? first + j : src.row(kp);
        const bool ok = row != KvRows::NO_ROW;
        const size_t e = ok ? row * row_bytes + at : 0;
        cp_async16(kd + j * ROW + 8 * part, kc + e, ok ? 16 : 0);
        cp_async16(vd + j * ROW + 8 * part, vc + e, ok ? 16 : 0);
        if (part == 0) seen[buf * ATC_KEYS + j] = ok;
    }
    cp_async_commit();
}

template <int D, bool SPLIT, int QT>
__device__ void attention_tc_body(const u8* __restrict__ q, const u8* __restrict__ kc,
                                  const u8* __restrict__ vc, const int* __restrict__ pos,
                                  float* __restrict__ out, const int* __restrict__ seq,
                                  const int* __restrict__ tables, const int* __restrict__ tiles,
                                  int max_blocks, int block, int pool_rows, int n, int heads,
                                  int kv_heads, float scale, float cap, int window,
                                  float* __restrict__ lse_out, u16* __restrict__ out_half) {
    static_assert(!SPLIT || QT == ATC_Q_F32, "two parts only from f32 queries");
    constexpr int KS = D / 16;  // k-steps of the scores, and pairs of 8-wide value tiles
    constexpr int ROW = ATC_ROW(D);
    follow_previous();
    extern __shared__ __align__(16) u8 atc_smem[];
    u16* Ks = (u16*)atc_smem;                 // [2][ATC_KEYS][ROW]
    u16* Vs = Ks + 2 * ATC_KEYS * ROW;        // [2][ATC_KEYS][ROW]
    int* seen = (int*)(Vs + 2 * ATC_KEYS * ROW);  // [2][ATC_KEYS]: key present in the cache
    const int group = heads / kv_heads, kvh = blockIdx.y;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int qt = 16 * (blockDim.y / group);
    int first, rows;
    if (tiles == nullptr) {
        first = blockIdx.x * qt;
        rows = min(qt, n - first);
    } else {
        first = tiles[2 * blockIdx.x];
        rows = tiles[2 * blockIdx.x + 1];
    }
    const int h = kvh * group + warp % group;
    const int sub = 16 * (warp / group);  // this warp's rows of the tile
    const int g = lane >> 2, c = lane & 3;

    // The keys any row of the tile sees.
    int hi = -1, lo = 0x7fffffff;
    for (int t = 0; t < rows; t++) {
        const int p = pos[first + t];
        hi = max(hi, p);
        lo = min(lo, window > 0 ? max(0, p - window + 1) : 0);
    }
    const KvRows src = {tables != nullptr ? tables + (size_t)seq[first] * max_blocks : nullptr, max_blocks,
                        block, pool_rows};

    // This thread's two rows (g and g + 8 of the warp's 16) and their positions; rows past
    // the tile see nothing and are not written.
    int rpos[2];
    bool live[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int t = sub + g + 8 * i;
        live[i] = t < rows;
        rpos[i] = live[i] ? pos[first + t] : -1;
    }

    // The least and most position of the warp's live rows: a chunk of keys all of them
    // see whole (every key present) skips the mask.
    int w_min = 0x7fffffff, w_max = -1;
#pragma unroll
    for (int i = 0; i < 2; i++)
        if (live[i]) {
            w_min = min(w_min, rpos[i]);
            w_max = max(w_max, rpos[i]);
        }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) {
        w_min = min(w_min, __shfl_xor_sync(0xffffffffu, w_min, x));
        w_max = max(w_max, __shfl_xor_sync(0xffffffffu, w_max, x));
    }

    // The queries as A fragments (hi and lo parts when SPLIT), times scale · log2(e):
    // k-step s holds columns 16s + 2c, + 1 (registers 0, 1 for rows g, g + 8) and the same
    // + 8 (registers 2, 3). A softcap applies in natural units.
    const float qscale = scale * ATC_LOG2E, cap2 = cap * ATC_LOG2E;
    u32 qh[KS][4], ql[KS][4];
#pragma unroll
    for (int s = 0; s < KS; s++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int i = r & 1, col = 16 * s + 2 * c + 8 * (r >> 1);
            const size_t e = ((size_t)(first + sub + g + 8 * i) * heads + h) * D + col;
            if constexpr (QT != ATC_Q_F32) {
                qh[s][r] = live[i] ? *(const u32*)((const u16*)q + e) : 0u;
            } else {
                float2 v = make_float2(0.0f, 0.0f);
                if (live[i]) v = *(const float2*)((const float*)q + e);
                if constexpr (SPLIT) {
                    split_f16x2(v.x * qscale, v.y * qscale, qh[s][r], ql[s][r]);
                } else {
                    qh[s][r] = pack_f16x2(v.x * qscale, v.y * qscale);
                }
            }
        }

    auto load_chunk = [&](int c0, int buf) {
        atc_load_chunk<D>(Ks, Vs, seen, kc, vc, src, kv_heads, kvh, c0, lo, hi, buf);
    };

    float o[2 * KS][4];
#pragma unroll
    for (int j = 0; j < 2 * KS; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) o[j][r] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    const int c_first = hi < 0 ? 0 : (lo / ATC_KEYS) * ATC_KEYS;
    const int chunks = hi < 0 ? 0 : (hi - c_first) / ATC_KEYS + 1;
    if (chunks > 0) load_chunk(c_first, 0);
    for (int ch = 0; ch < chunks; ch++) {
        const int c0 = c_first + ch * ATC_KEYS, buf = ch & 1;
        if (ch + 1 < chunks) {
            load_chunk(c0 + ATC_KEYS, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* kb = Ks + buf * ATC_KEYS * ROW;
        const u16* vb = Vs + buf * ATC_KEYS * ROW;
        const int* sb = seen + buf * ATC_KEYS;

        // Scores of the warp's 16 rows against the chunk's 64 keys: tile j holds keys
        // 8j + 2c, + 1 of rows g (registers 0, 1) and g + 8 (2, 3).
        float sc[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) sc[j][r] = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; p++)
#pragma unroll
            for (int s = 0; s < KS; s++) {
                u32 b[4];
                ldmatrix_x4(b, kb + (16 * p + (lane & 7) + ((lane >> 4) << 3)) * ROW + 16 * s +
                                   ((lane >> 3) & 1) * 8);
                atc_mma<QT>(sc[2 * p], qh[s], b[0], b[1]);
                atc_mma<QT>(sc[2 * p + 1], qh[s], b[2], b[3]);
                if constexpr (SPLIT) {
                    mma_16816(sc[2 * p], ql[s], b[0], b[1]);
                    mma_16816(sc[2 * p + 1], ql[s], b[2], b[3]);
                }
            }
        // Raw products of kept queries scaled here, in f32, as the backward scales them.
        if constexpr (QT != ATC_Q_F32) {
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) sc[j][r] *= qscale;
        }

        // Online softmax of each row: masked scores are -inf; the row's four lanes share
        // its max. A chunk every row of the warp sees whole, each key present, skips the
        // mask (the causal square's tiles below the diagonal). The softcap (natural units)
        // and the mask are warp-uniform branches around straight-line code: per score,
        // they had been 12 instructions of branches and reconvergence.
        const bool full = __all_sync(0xffffffffu, sb[lane] && sb[lane + 32]) && c0 + ATC_KEYS - 1 <= w_min &&
                          (window <= 0 || c0 > w_max - window);
        if (cap > 0.0f) {
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) sc[j][r] = cap2 * tanhf(sc[j][r] / cap2);
        }
        if (!full) {
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int kj = 8 * j + 2 * c + e, kp = c0 + kj;
                    const bool present = sb[kj] != 0;
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const bool ok = present & (kp <= rpos[i]) & ((window <= 0) | (kp > rpos[i] - window));
                        sc[j][2 * i + e] = ok ? sc[j][2 * i + e] : NEG_INF;
                    }
                }
        }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) mx = fmaxf(mx, sc[j][2 * i + e]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[i], mx);
            // A row that has seen no key yet subtracts 0: exp2(-inf) is 0 without a test
            // a score (its sums and output stay 0).
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;
            corr[i] = atc_exp2(m[i] - m_use);
            m[i] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float p = atc_exp2(sc[j][2 * i + e] - m_use);
                    sc[j][2 * i + e] = p;
                    sum += p;
                }
            l[i] = l[i] * corr[i] + sum;
        }
#pragma unroll
        for (int j = 0; j < 2 * KS; j++) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }

        // The value sum: the probabilities of keys 16p .. 16p + 15 are the A fragment of
        // k-step p as they lie (score tiles 2p and 2p + 1), in hi and lo parts.
#pragma unroll
        for (int p = 0; p < 4; p++) {
            u32 ph[4], pl[4];
            if constexpr (SPLIT) {
                split_f16x2(sc[2 * p][0], sc[2 * p][1], ph[0], pl[0]);
                split_f16x2(sc[2 * p][2], sc[2 * p][3], ph[1], pl[1]);
                split_f16x2(sc[2 * p + 1][0], sc[2 * p + 1][1], ph[2], pl[2]);
                split_f16x2(sc[2 * p + 1][2], sc[2 * p + 1][3], ph[3], pl[3]);
            } else {
                ph[0] = atc_pack<QT>(sc[2 * p][0], sc[2 * p][1]);
                ph[1] = atc_pack<QT>(sc[2 * p][2], sc[2 * p][3]);
                ph[2] = atc_pack<QT>(sc[2 * p + 1][0], sc[2 * p + 1][1]);
                ph[3] = atc_pack<QT>(sc[2 * p + 1][2], sc[2 * p + 1][3]);
            }
#pragma unroll
            for (int s = 0; s < KS; s++) {
                u32 b[4];
                ldmatrix_x4_trans(b, vb + (16 * p + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW +
                                         16 * s + (lane >> 4) * 8);
                atc_mma<QT>(o[2 * s], ph, b[0], b[1]);
                atc_mma<QT>(o[2 * s + 1], ph, b[2], b[3]);
                if constexpr (SPLIT) {
                    mma_16816(o[2 * s], pl, b[0], b[1]);
                    mma_16816(o[2 * s + 1], pl, b[2], b[3]);
                }
            }
        }
        // Every warp is done with this buffer before the next chunk's loads refill it.
        __syncthreads();
    }

    // Each row's sum over its four lanes, then the normalised output: value tile j holds
    // dimensions 8j + 2c, + 1.
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (!live[i]) continue;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        const size_t row = (size_t)(first + sub + g + 8 * i) * heads + h;
        float* dst = out + row * D + 2 * c;
#pragma unroll
        for (int j = 0; j < 2 * KS; j++)
            *(float2*)(dst + 8 * j) = make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
        if constexpr (QT != ATC_Q_F32) {
            // A row that sees no key: P = 0 throughout in the backward (lse = +inf).
            if (c == 0) lse_out[row] = l[i] > 0.0f ? m[i] + log2f(l[i]) : -NEG_INF;
            u16* hd = out_half + row * D + 2 * c;
#pragma unroll
            for (int j = 0; j < 2 * KS; j++)
                *(u32*)(hd + 8 * j) = atc_pack<QT>(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
        }
    }
}

// Named attention_tc_<head dimensions> (two parts), attention_tc_once_<head dimensions>
// and attention_tc_kept_<f16|bf16>_<head dimensions>; blocks of up to 8 warps. `lse` and
// `out_half` are the kept kernels' (null for the others). The kept kernels for heads of
// 64 are held to 128 registers (16 warps an SM instead of 12; ptxas spills 96 bytes):
// training's BF16 step on an H200 ran ~0.8% faster in three rounds of three.
#define ATTENTION_TC(NAME, D, SPLIT, QT, MIN_BLOCKS)                                           \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                        \
        const u8* q, const u8* kc, const u8* vc, const int* pos, float* out, const int* seq,    \
        const int* tables, const int* tiles, int max_blocks, int block, int pool_rows, int n,   \
        int heads, int kv_heads, float scale, float cap, int window, float* lse,                \
        u16* out_half) {                                                                        \
        attention_tc_body<D, SPLIT, QT>(q, kc, vc, pos, out, seq, tables, tiles, max_blocks,    \
                                        block, pool_rows, n, heads, kv_heads, scale, cap,       \
                                        window, lse, out_half);                                 \
    }
ATTENTION_TC(attention_tc_64, 64, true, ATC_Q_F32, 1)
ATTENTION_TC(attention_tc_128, 128, true, ATC_Q_F32, 1)
ATTENTION_TC(attention_tc_once_64, 64, false, ATC_Q_F32, 1)
ATTENTION_TC(attention_tc_once_128, 128, false, ATC_Q_F32, 1)
ATTENTION_TC(attention_tc_kept_f16_64, 64, false, ATC_Q_F16, 2)
ATTENTION_TC(attention_tc_kept_f16_128, 128, false, ATC_Q_F16, 1)
ATTENTION_TC(attention_tc_kept_bf16_64, 64, false, ATC_Q_BF16, 2)
ATTENTION_TC(attention_tc_kept_bf16_128, 128, false, ATC_Q_BF16, 1)
