// One-shot all-reduce between the GPUs of one process over peer-to-peer memory (NVLink),
// for the small sums of decode, where NCCL's latency (10+ µs) outweighs the bytes.
//
// Every rank pushes its values into a staging area on every rank (its own slot of
// [2 parities][world senders][cap]), raises a flag on each, waits for every rank's flag
// on its own GPU (polling local memory), then adds the slots in rank order: every rank
// gets the same bits. Flags carry a per-block epoch kept on the device (so a recorded CUDA
// graph replays it unchanged); the two parities let a rank write call e+1 while a slow
// peer still reads call e: it cannot get to call e+2 before every peer has finished e.
// Every call launches the same grid (ONE_SHOT_BLOCKS), so each block's epoch counts calls.
//
// table: [world] staging addresses, then [world] flag addresses (flags: u32 [blocks][world],
// then this rank's u32 [blocks] epochs). Launch: grid ONE_SHOT_BLOCKS, block 256.

__device__ __forceinline__ void store_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void all_reduce_one_shot(float4* data, int n4, int rank, int world,
                                               const u64* table, int cap4,
                                               u64 timeout_ns) {
    follow_previous();
    const int b = blockIdx.x, blocks = gridDim.x;
    u32* my_flags = (u32*)table[world + rank];
    u32* epochs = my_flags + blocks * world;
    __shared__ u32 epoch_s;
    if (threadIdx.x == 0) epoch_s = epochs[b] + 1;
    __syncthreads();
    const u32 epoch = epoch_s;
    const int parity = epoch & 1;
    const int per = (n4 + blocks - 1) / blocks;
    const int lo = b * per, hi = min(n4, lo + per);

    // Push this rank's slice into its slot on every rank.
    for (int p = 0; p < world; p++) {
        float4* slot = (float4*)table[p] + ((size_t)parity * world + rank) * cap4;
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) __stcg(slot + i, data[i]);
    }
    __syncthreads();
    if (threadIdx.x < world) {
        const int p = threadIdx.x;
        __threadfence_system();
        store_release_sys((u32*)table[world + p] + b * world + rank, epoch);
        // Wait for rank p's slice on this GPU (epochs wrap after 2^32 calls: compare
        // by difference).
        const u32* flag = my_flags + b * world + p;
        const u64 start = global_ns();
        while ((int)(load_acquire_sys(flag) - epoch) < 0) {
            if (global_ns() - start > timeout_ns) {
                printf("kiln: rank %d waited %llu s for rank %d in an all-reduce; stopping\n",
                       rank, timeout_ns / 1000000000ull, p);
                __trap();
            }
        }
    }
    __syncthreads();
    const float4* mine = (const float4*)table[rank] + (size_t)parity * world * cap4;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float4 s = __ldcg(mine + i);
        for (int p = 1; p < world; p++) {
            const float4 v = __ldcg(mine + (size_t)p * cap4 + i);
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
        }
        data[i] = s;
    }
    if (threadIdx.x == 0) epochs[b] = epoch;
}
