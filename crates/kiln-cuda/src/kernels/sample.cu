// One draw of the next token from a row of logits, as kiln_core::sampling::pick does it
// (repetition penalty, top-k, top-p, min-p, temperature, draw), so that only the token
// goes back to the host. One block of 1024 threads; top-k at most SAMPLE_MAX_K.
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

// Launch: grid 1, block 1024. 1 <= top_k <= min(vocab, SAMPLE_MAX_K).
extern "C" __global__ void __launch_bounds__(1024)
    sample_top_k(float* logits, int vocab, const int* penalized,
                 int n_penalized, float penalty, int top_k,
                 float top_p, float min_p, float temperature,
                 float draw, int* out) {
    follow_previous();
    __shared__ u32 hist[256];
    __shared__ u32 chosen_prefix, chosen_left;
    __shared__ int count;
    __shared__ float cand_l[SAMPLE_MAX_K];
    __shared__ int cand_i[SAMPLE_MAX_K];
    __shared__ float tmp[32];
    const int tid = threadIdx.x, threads = blockDim.x;

    // Repetition penalty, in place (the ids are distinct).
    for (int i = tid; i < n_penalized; i += threads) {
        const int t = penalized[i];
        if (t >= 0 && t < vocab) {
            const float l = logits[t];
            logits[t] = l > 0.0f ? l / penalty : l * penalty;
        }
    }
    __syncthreads();

    // The k-th largest key: digit by digit from the top, keep the bin where the count
    // of larger keys reaches k.
    u32 prefix = 0, mask = 0, left = (u32)top_k;
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
    }
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
