// One-shot all-reduce between the GPUs of one process over peer-to-peer memory (NVLink),
// for the small sums of decode, where NCCL's latency outweighs the bytes.
//
// Every rank pushes its values into a staging area on every rank, each 8 bytes as one
// value and the call's epoch (NCCL's low-latency protocol): a 16-byte line {v0, epoch,
// v1, epoch} is stored in one instruction, each 8-byte half of it arrives whole, so a
// reader that sees the epoch in a half sees its value too, with no fence or flag round
// trip. Each rank polls its own memory for every rank's lines and adds them in rank
// order: every rank gets the same bits.
//
// The epochs are counted on the device, per block (so a recorded CUDA graph replays the
// kernel unchanged; every call launches the same grid, so each block's count is the
// call's). Two parities of the staging area let a rank write call e+1 while a slow peer
// still reads call e: it cannot start call e+2 before every peer has finished e (it
// needs their e+1 values, which they send only after e).
//
// staging: [world] addresses, each rank's area of [2 parities][world senders][cap lines].
// Launch: grid ONE_SHOT_BLOCKS, block 256.

__device__ __forceinline__ void store_line(uint4* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ uint4 load_line(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void all_reduce_one_shot(float2* data, int n2, int rank, int world,
                                               const u64* staging, u32* epochs,
                                               int cap_lines, u64 timeout_ns) {
    follow_previous();
    __shared__ u32 epoch_s;
    // Epoch 0 is what the zeroed staging area holds: after 2^32 calls it is skipped for
    // 2, which keeps the parity.
    if (threadIdx.x == 0) epoch_s = epochs[blockIdx.x] + 1 == 0 ? 2 : epochs[blockIdx.x] + 1;
    __syncthreads();
    const u32 e = epoch_s;
    const size_t area = (size_t)(e & 1) * world * cap_lines;
    const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int i = first; i < n2; i += stride) {
        const float2 v = data[i];
        const uint4 line = make_uint4(__float_as_uint(v.x), e, __float_as_uint(v.y), e);
        for (int p = 0; p < world; p++)
            store_line((uint4*)staging[p] + area + (size_t)rank * cap_lines + i, line);
    }
    const uint4* mine = (const uint4*)staging[rank] + area;
    for (int i = first; i < n2; i += stride) {
        float2 s = make_float2(0.0f, 0.0f);
        for (int p = 0; p < world; p++) {
            const uint4* at = mine + (size_t)p * cap_lines + i;
            uint4 line = load_line(at);
            if (line.y != e || line.w != e) {
                const u64 start = global_ns();
                do {
                    if (global_ns() - start > timeout_ns) {
                        printf("kiln: rank %d waited %llu s for rank %d in an all-reduce; "
                               "stopping\n",
                               rank, timeout_ns / 1000000000ull, p);
                        __trap();
                    }
                    line = load_line(at);
                } while (line.y != e || line.w != e);
            }
            // Rank 0's value first, then the others in order, as on every rank.
            s.x = p == 0 ? __uint_as_float(line.x) : s.x + __uint_as_float(line.x);
            s.y = p == 0 ? __uint_as_float(line.z) : s.y + __uint_as_float(line.z);
        }
        data[i] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) epochs[blockIdx.x] = e;
}
