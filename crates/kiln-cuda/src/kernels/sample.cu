// One draw of the next token from a row of logits, as kiln_core::sampling::pick does it
// (repetition penalty, top-k, top-p, min-p, temperature, draw), so that only the token
// goes back to the host. `sample_rows` draws for one row or a server's whole batch in one
// launch, a block of 1024 threads a draw, each with its own settings: a draw does not
// depend on the batch it is in.
//
// The k best are found without sorting the vocabulary: a radix select over the logits'
// order-preserving 32-bit keys (4 passes of 8 bits) gives the k-th largest value, ties
// at it going to the lowest ids as in the reference's stable order. Only those k are
// then sorted (bitonic, in shared memory), and top-p, min-p and the draw are prefix sums
// over them.

#define SAMPLE_MAX_K 1024

// Larger float, larger key (NaN aside).
__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Inclusive prefix sum over the block (blockDim.x a multiple of 32); `tmp` holds 32
// floats.
__device__ float block_scan(float v, float* tmp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();
    if (lane == 31) tmp[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? tmp[lane] : 0.0f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += n;
        }
        tmp[lane] = t;
    }
    __syncthreads();
    return warp > 0 ? v + tmp[warp - 1] : v;
}

// Does candidate (la, ia) come before (lb, ib)? Larger logit first, then lower id.
__device__ __forceinline__ bool before(float la, int ia, float lb, int ib) {
    return la > lb || (la == lb && ia < ib);
}

// The repetition penalty on the row, in place (the ids are distinct), by the block.
__device__ void penalize(float* logits, int vocab, const int* penalized, int n_penalized,
                         float penalty) {
    for (int i = threadIdx.x; i < n_penalized; i += blockDim.x) {
        const int t = penalized[i];
        if (t >= 0 && t < vocab) {
            const float l = logits[t];
            logits[t] = l > 0.0f ? l / penalty : l * penalty;
        }
    }
    __syncthreads();
}

// The k-th largest key of the row (1 <= k <= vocab) into *key, and into *ties how many
// of the logits equal to it are among the k (the lowest ids): digit by digit from the
// top, keep the bin where the count of larger keys reaches k.
__device__ void kth_key(const float* logits, int vocab, u32 k, u32* key_out, u32* ties) {
    __shared__ u32 hist[256];
    __shared__ u32 chosen_prefix, chosen_left;
    const int tid = threadIdx.x, threads = blockDim.x;
    u32 prefix = 0, mask = 0, left = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += threads) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < vocab; i += threads) {
            const u32 key = order_key(logits[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 above = 0;
            int d = 255;
            for (; d > 0; d--) {
                if (above + hist[d] >= left) break;
                above += hist[d];
            }
            chosen_prefix = prefix | ((u32)d << shift);
            chosen_left = left - above;
        }
        __syncthreads();
        prefix = chosen_prefix;
        left = chosen_left;
        mask |= 255u << shift;
        __syncthreads();
    }
    *key_out = prefix;
    *ties = left;
}

// One block of 1024 threads draws from `logits` (one row of `vocab`) into out[0].
// 1 <= top_k <= min(vocab, SAMPLE_MAX_K).
__device__ void draw_row(float* logits, int vocab, const int* penalized,
                         int n_penalized, float penalty, int top_k,
                         float top_p, float min_p, float temperature,
                         float draw, int* out) {
    __shared__ int count;
    __shared__ float cand_l[SAMPLE_MAX_K];
    __shared__ int cand_i[SAMPLE_MAX_K];
    __shared__ float tmp[32];
    const int tid = threadIdx.x, threads = blockDim.x;
    penalize(logits, vocab, penalized, n_penalized, penalty);

    u32 prefix, left;
    kth_key(logits, vocab, (u32)top_k, &prefix, &left);
    // Now `prefix` is the k-th largest key and `left` of the logits equal to it are
    // taken: the lowest ids. Each thread walks a contiguous span of ids, so a scan of
    // per-thread tie counts ranks the ties by id.
    const int span = (vocab + threads - 1) / threads;
    const int lo = min(tid * span, vocab), hi = min(lo + span, vocab);
    int ties = 0;
    for (int i = lo; i < hi; i++) ties += order_key(logits[i]) == prefix;
    int rank = (int)(block_scan((float)ties, tmp) - (float)ties);
    if (tid == 0) count = 0;
    __syncthreads();
    for (int i = lo; i < hi; i++) {
        const u32 key = order_key(logits[i]);
        bool take = key > prefix;
        if (key == prefix) take = rank++ < (int)left;
        if (take) {
            const int slot = atomicAdd(&count, 1);
            cand_l[slot] = logits[i];
            cand_i[slot] = i;
        }
    }
    __syncthreads();

    // Sort the k candidates (padded to a power of two) best first.
    int n = 1;
    while (n < top_k) n <<= 1;
    if (tid >= top_k && tid < n) {
        cand_l[tid] = NEG_INF;
        cand_i[tid] = 0x7fffffff;
    }
    __syncthreads();
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const int j = tid ^ stride;
            if (tid < n && j > tid) {
                const float la = cand_l[tid], lb = cand_l[j];
                const int ia = cand_i[tid], ib = cand_i[j];
                const bool swap = (tid & size) == 0 ? before(lb, ib, la, ia) : before(la, ia, lb, ib);
                if (swap) {
                    cand_l[tid] = lb; cand_l[j] = la;
                    cand_i[tid] = ib; cand_i[j] = ia;
                }
            }
            __syncthreads();
        }
    }

    // Probabilities at temperature 1 (relative to the best, whose weight is 1).
    const float best = cand_l[0];
    const bool mine = tid < top_k;
    const float e = mine ? expf(cand_l[tid] - best) : 0.0f;
    const float cum = block_scan(e, tmp);
    __shared__ float total;
    if (tid == top_k - 1) total = cum;
    __syncthreads();
    int keep = top_k;
    if (top_p < 1.0f) {
        // The first candidate whose cumulative probability reaches top_p ends the set.
        const int below = (int)block_sum(mine && cum < top_p * total ? 1.0f : 0.0f, tmp);
        keep = min(below + 1, top_k);
    }
    if (min_p > 0.0f) {
        const int above = (int)block_sum(tid < keep && e >= min_p ? 1.0f : 0.0f, tmp);
        keep = max(min(above, keep), 1);
    }
    // The draw at the temperature: the first candidate whose cumulative weight passes it.
    const float t = tid < keep ? expf((cand_l[tid] - best) / temperature) : 0.0f;
    const float tcum = block_scan(t, tmp);
    __shared__ float ttotal;
    if (tid == keep - 1) ttotal = tcum;
    __syncthreads();
    const int passed = (int)block_sum(tid < keep && tcum <= draw * ttotal ? 1.0f : 0.0f, tmp);
    if (tid == 0) out[0] = cand_i[min(passed, keep - 1)];
}

// ---- Draws over the whole vocabulary (top-k off, or past SAMPLE_MAX_K) ----
//
// Nothing is sorted. The reference's order (larger logit first, lower id first among
// equals) is walked by weight instead of by count: a radix descent over the keys whose
// histograms sum the candidates' weights finds where the cumulative weight reaches a
// target (top-p's cut, then the draw), and a scan over ids settles ties. Sums are in f32
// in no fixed order, so a draw within ~1e-6 of a boundary between two tokens may go either
// way (the reference sums in f64).

// The logit a key stands for (order_key's inverse).
__device__ __forceinline__ float key_logit(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// A prefix of the row in the reference's order: every key above `key`, then the first
// `ties` ids whose key is `key`.
struct Prefix {
    u32 key;
    int ties;
};

__device__ __forceinline__ Prefix shorter(Prefix a, Prefix b) {
    return (a.key > b.key || (a.key == b.key && a.ties < b.ties)) ? a : b;
}

__device__ __forceinline__ bool in_prefix_above(u32 key, Prefix p) { return key > p.key; }

// How many logits of the row have `key`, and the id of the `n`-th of them (0-based, by
// id; the last one when there are fewer). Each thread walks a contiguous span of ids, so
// a scan of the per-thread counts ranks them by id.
__device__ int nth_with_key(const float* logits, int vocab, u32 key, int n, int* count_out,
                            float* tmp) {
    __shared__ int found;
    const int tid = threadIdx.x, threads = blockDim.x;
    const int span = (vocab + threads - 1) / threads;
    const int lo = min(tid * span, vocab), hi = min(lo + span, vocab);
    int mine = 0;
    for (int i = lo; i < hi; i++) mine += order_key(logits[i]) == key;
    const int total = (int)block_sum((float)mine, tmp);
    int rank = (int)(block_scan((float)mine, tmp) - (float)mine);
    const int want = min(max(n, 0), max(total - 1, 0));
    if (tid == 0) found = 0;
    __syncthreads();
    if (rank <= want && want < rank + mine) {
        for (int i = lo; i < hi; i++) {
            if (order_key(logits[i]) == key) {
                if (rank == want) found = i;
                rank++;
            }
        }
    }
    __syncthreads();
    *count_out = total;
    return found;
}

// Σ of exp((l - best)·scale) over prefix `p`.
__device__ float prefix_weight(const float* logits, int vocab, Prefix p, float best, float scale,
                               float* tmp) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = logits[i];
        if (in_prefix_above(order_key(l), p)) sum += expf((l - best) * scale);
    }
    sum = block_sum(sum, tmp);
    // (An empty prefix's key stands for no logit: a NaN, which must not reach the sum.)
    return p.ties > 0 ? sum + (float)p.ties * expf((key_logit(p.key) - best) * scale) : sum;
}

// Where the cumulative weight exp((l - best)·scale) over prefix `in`, in the reference's
// order, first reaches `target` (`strict`: first passes it): the shortest prefix of `in`
// holding that much. `in` itself when its whole weight falls short. `whist` is 32
// histograms of 256 floats, one a warp, so that the atomics of one bin spread.
__device__ Prefix weighted_cut(const float* logits, int vocab, Prefix in, float best, float scale,
                               float target, bool strict, float (*whist)[256], float* tmp) {
    __shared__ u32 s_prefix;
    __shared__ float s_left;
    __shared__ int s_hit;
    const int tid = threadIdx.x, threads = blockDim.x, warp = tid >> 5;
    const float in_weight = expf((key_logit(in.key) - best) * scale);
    u32 prefix = 0, mask = 0;
    float left = target;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 32 * 256; i += threads) whist[i >> 8][i & 255] = 0.0f;
        __syncthreads();
        for (int i = tid; i < vocab; i += threads) {
            const float l = logits[i];
            const u32 key = order_key(l);
            if (in_prefix_above(key, in) && (key & mask) == prefix)
                atomicAdd(&whist[warp][(key >> shift) & 255], expf((l - best) * scale));
        }
        __syncthreads();
        for (int d = tid; d < 256; d += threads) {
            float sum = 0.0f;
            for (int w = 0; w < 32; w++) sum += whist[w][d];
            whist[0][d] = sum;
        }
        __syncthreads();
        if (tid == 0) {
            // The prefix's ties at its last key weigh in as one lump in that key's bin.
            if (in.ties > 0 && (in.key & mask) == prefix)
                whist[0][(in.key >> shift) & 255] += (float)in.ties * in_weight;
            float above = 0.0f;
            s_hit = 0;
            for (int d = 255; d >= 0; d--) {
                const float h = whist[0][d];
                if (h > 0.0f && (strict ? above + h > left : above + h >= left)) {
                    s_hit = 1;
                    s_prefix = prefix | ((u32)d << shift);
                    s_left = left - above;
                    break;
                }
                above += h;
            }
        }
        __syncthreads();
        if (!s_hit) return in;
        prefix = s_prefix;
        left = s_left;
        mask |= 255u << shift;
        __syncthreads();
    }
    // `prefix` is the key reached; each of its ties in `in` weighs `w`: take ties up to the
    // one whose weight reaches what is left.
    int count;
    nth_with_key(logits, vocab, prefix, 0, &count, tmp);
    if (prefix == in.key) count = min(count, in.ties);
    const float w = expf((key_logit(prefix) - best) * scale);
    int j = strict ? (int)floorf(left / w) : (int)ceilf(left / w) - 1;
    j = min(max(j, 0), max(count - 1, 0));
    return Prefix{prefix, j + 1};
}

// One block of 1024 threads draws from `logits` (one row of `vocab`) with top-k off
// (top_k <= 0) or past SAMPLE_MAX_K, as the reference does: top-k, top-p and min-p each
// keep a prefix of the order, the shortest wins, and the draw walks it at the temperature.
__device__ void draw_full(float* logits, int vocab, const int* penalized, int n_penalized,
                          float penalty, int top_k, float top_p, float min_p, float temperature,
                          float draw, int* out) {
    __shared__ float whist[32][256];
    __shared__ float tmp[32];
    __shared__ u32 min_kept;
    const int tid = threadIdx.x, threads = blockDim.x;
    penalize(logits, vocab, penalized, n_penalized, penalty);
    float best = NEG_INF;
    for (int i = tid; i < vocab; i += threads) best = fmaxf(best, logits[i]);
    best = block_max(best, tmp);
    int best_count;
    const int best_id = nth_with_key(logits, vocab, order_key(best), 0, &best_count, tmp);
    // Top-k: the k best (all of them when off).
    Prefix kept = {0u, 0};
    if (top_k > 0 && top_k < vocab) {
        u32 key, ties;
        kth_key(logits, vocab, (u32)top_k, &key, &ties);
        kept = Prefix{key, (int)ties};
    }
    // Top-p: the first candidates whose probability (temperature 1) reaches top_p.
    if (top_p < 1.0f) {
        const float total = prefix_weight(logits, vocab, kept, best, 1.0f, tmp);
        kept = shorter(kept, weighted_cut(logits, vocab, kept, best, 1.0f, top_p * total, false,
                                          whist, tmp));
    }
    // Min-p: the candidates whose probability is at least min_p times the best's, every
    // tie of the last one, and the best whatever min_p is.
    if (min_p > 0.0f) {
        if (tid == 0) min_kept = 0xffffffffu;
        __syncthreads();
        u32 mine = 0xffffffffu;
        for (int i = tid; i < vocab; i += threads) {
            const float l = logits[i];
            if (expf(l - best) >= min_p) mine = min(mine, order_key(l));
        }
        atomicMin(&min_kept, mine);
        __syncthreads();
        Prefix by_min_p = {order_key(best), 1};
        if (min_kept != 0xffffffffu) {
            int count;
            nth_with_key(logits, vocab, min_kept, 0, &count, tmp);
            by_min_p = Prefix{min_kept, count};
        }
        kept = shorter(kept, by_min_p);
    }
    // The draw at the temperature: the first candidate whose cumulative weight passes it.
    const float scale = 1.0f / temperature;
    const float total = prefix_weight(logits, vocab, kept, best, scale, tmp);
    const Prefix at = weighted_cut(logits, vocab, kept, best, scale, draw * total, true, whist, tmp);
    int count;
    int id = nth_with_key(logits, vocab, at.key, at.ties - 1, &count, tmp);
    // An empty prefix (nothing but NaN logits past the best) draws the best.
    if (at.ties <= 0 || count == 0) id = best_id;
    if (tid == 0) out[0] = id;
    (void)best_count;
}

// Either draw: top-k within what the sort keeps, or the whole vocabulary.
__device__ void draw_any(float* logits, int vocab, const int* penalized, int n_penalized,
                         float penalty, int top_k, float top_p, float min_p, float temperature,
                         float draw, int* out) {
    if (top_k >= 1 && top_k <= SAMPLE_MAX_K && top_k <= vocab)
        draw_row(logits, vocab, penalized, n_penalized, penalty, top_k, top_p, min_p,
                 temperature, draw, out);
    else
        draw_full(logits, vocab, penalized, n_penalized, penalty, top_k, top_p, min_p,
                  temperature, draw, out);
}

// Launch: grid = draws, block 1024. top_k <= 0: off. Draw b takes row rows[b] of `logits`, top_k[b], the
// penalized ids penalized[pen_at[b] .. pen_at[b + 1]], and settings[5 b ..] = penalty,
// top-p, min-p, temperature, draw; its token goes to out[b]. Rows are distinct.
extern "C" __global__ void __launch_bounds__(1024)
    sample_rows(float* logits, int vocab, const int* rows, const int* top_k,
                const int* pen_at, const int* penalized, const float* settings,
                int* out) {
    follow_previous();
    const int b = blockIdx.x;
    const float* s = settings + 5 * b;
    draw_any(logits + (size_t)rows[b] * vocab, vocab, penalized + pen_at[b],
             pen_at[b + 1] - pen_at[b], s[0], top_k[b], s[1], s[2], s[3], s[4], out + b);
}
