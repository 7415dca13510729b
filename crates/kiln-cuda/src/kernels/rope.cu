// Rotary position embedding in place on x [tokens, heads, head_dim]; token t at position
// pos[t]. Pair i (of rot_dim / 2) turns by pos * inv_freq[i]; interleaved pairs are
// (2i, 2i+1), NeoX pairs (i, i + rot_dim/2). A warp a (token, head) row, 8 rows a block:
// a block a row left most of a 16,384-token batch's time to block scheduling.
// Launch: grid (ceil(rows / 8)), block (32, 8), rows = tokens * heads.
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int rows,
                                int heads, int head_dim, int rot_dim, int neox) {
    follow_previous();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const int t = row / heads;
    float* v = x + (size_t)row * head_dim;
    const float p = (float)pos[t];
    const int half = rot_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

// Fused for decode: rotate q and k (when inv_freq is given), and write k and v to the
// caches at their positions (or, with `rows` non-null, at rows[t]: a paged pool's slots),
// in the caches' type (kv_cache.cu). Block b < tokens*heads is
// a query head; the rest are KV heads. q [tokens, heads, D], k/v [tokens, kv_heads, D],
// caches [cap, kv_heads, D]. Launch: grid (tokens * (heads + kv_heads)), block 64.
template <int KV>
__device__ void rope_write_kv_body(float* q, float* k, const float* v, const int* pos,
                                   const int* rows, const float* inv_freq, u8* k_cache,
                                   u8* v_cache, int tokens, int heads, int kv_heads, int D,
                                   int rot_dim, int neox, int cap) {
    follow_previous();
    const int qblocks = tokens * heads;
    const bool is_q = blockIdx.x < qblocks;
    const int idx = is_q ? blockIdx.x : blockIdx.x - qblocks;
    const int nh = is_q ? heads : kv_heads;
    const int t = idx / nh, h = idx % nh;
    const int p = pos[t];
    float* x = (is_q ? q : k) + ((size_t)t * nh + h) * D;
    const int half = rot_dim / 2;
    if (inv_freq != 0) {
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float s, c;
            sincosf((float)p * inv_freq[i], &s, &c);
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float x0 = x[a], x1 = x[b];
            x[a] = x0 * c - x1 * s;
            x[b] = x0 * s + x1 * c;
        }
    }
    const int r = rows != nullptr ? rows[t] : p;
    if (is_q || r < 0 || r >= cap) return;
    __syncthreads();  // the rotated k is read back below by other threads
    const size_t src = ((size_t)t * kv_heads + h) * D, dst = ((size_t)r * kv_heads + h) * D;
    const size_t elements = (size_t)cap * kv_heads * D;
    kv_store_row<KV>(k_cache, elements, dst, x, D);
    kv_store_row<KV>(v_cache, elements, dst, v + src, D);
}

#define ROPE_WRITE_KV(KV, NAME)                                                              \
    extern "C" __global__ void rope_write_kv_##NAME(                                         \
        float* q, float* k, const float* v, const int* pos, const int* rows,                 \
        const float* inv_freq, u8* k_cache, u8* v_cache, int tokens, int heads, int kv_heads,\
        int D, int rot_dim, int neox, int cap) {                                             \
        rope_write_kv_body<KV>(q, k, v, pos, rows, inv_freq, k_cache, v_cache, tokens,       \
                               heads, kv_heads, D, rot_dim, neox, cap);                      \
    }
ROPE_WRITE_KV(KV_F32, f32)
ROPE_WRITE_KV(KV_F16, f16)
ROPE_WRITE_KV(KV_BF16, bf16)
ROPE_WRITE_KV(KV_Q8_0, q8_0)
