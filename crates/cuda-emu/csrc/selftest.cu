// Kernels that test the emulator itself (crates/cuda-emu/tests/emulator.rs); not part of Baton.
// Compiled per dtype like kernels/*.cu, after kernels/common.cuh.

// Coordinates and block order: out[b * threads + t] = b << 16 | t for linear block b and linear
// thread t; thread 0 of block b writes order[b] = how many blocks ran before it.
BATON_ENTRY void emu_test_coords(u32* out, u32* order, u32* counter) {
    const u32 b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const u32 t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const u32 nt = blockDim.x * blockDim.y * blockDim.z;
    out[b * nt + t] = (b << 16) | t;
    if (t == 0) order[b] = atomicAdd(counter, 1u);
}

// Shared memory across a barrier and the block reduction of common.cuh. For block b with
// x = in[b * blockDim.x ..]: mirrored[b * blockDim.x + t] = x[blockDim.x - 1 - t] and
// sums[b * blockDim.x + t] = sum(x), max of x in maxes likewise (every thread's copy).
BATON_ENTRY void emu_test_block_reduce(float* mirrored, float* sums, float* maxes,
                                       const float* in) {
    __shared__ float stage[1024];
    __shared__ float scratch[33];
    const int t = threadIdx.x, n = blockDim.x;
    const size_t base = (size_t)blockIdx.x * n;
    const float v = in[base + t];
    stage[t] = v;
    __syncthreads();
    mirrored[base + t] = stage[n - 1 - t];
    sums[base + t] = baton_block_sum(v, scratch);
    maxes[base + t] = baton_block_max(v, scratch);
}

// Deadlock: odd threads wait at __syncthreads while the even lanes of each warp wait for a
// shuffle partner that never comes.
BATON_ENTRY void emu_test_deadlock(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x & 1) {
        __syncthreads();
    } else {
        v = __shfl_xor_sync(BATON_FULL_MASK, v, 2);
    }
    out[threadIdx.x] = v;
}

// Divergent __syncthreads: the two halves of the block sync at different barriers.
BATON_ENTRY void emu_test_divergent_sync(float* out) {
    __shared__ float s[1024];
    const int t = threadIdx.x;
    if (t < (int)blockDim.x / 2) {
        s[t] = 1.0f;
        __syncthreads();
    } else {
        s[t] = 2.0f;
        __syncthreads();
    }
    out[t] = s[blockDim.x - 1 - t];
}

// out[t] = t ^ lane_mask via one shuffle (fails in a partial warp or with a bad lane mask).
BATON_ENTRY void emu_test_shuffle(float* out, int lane_mask) {
    out[threadIdx.x] = __shfl_xor_sync(BATON_FULL_MASK, (float)threadIdx.x, lane_mask);
}

// Threads >= 32 exit early; the rest still pass a barrier (exited threads do not count).
// out[t] = t + 1 for t < 32, after reading a neighbour's value through shared memory.
BATON_ENTRY void emu_test_exit_then_sync(float* out) {
    __shared__ float s[32];
    const int t = threadIdx.x;
    if (t >= 32) return;
    s[t] = (float)t;
    __syncthreads();
    out[t] = s[t] + 1.0f;
}

// Shared memory is poisoned (0xff bytes) before every block, in plain and template functions:
// out[b * blockDim.x + t] = the float thread t reads from shared memory before any write, then
// writes its own value (which the next block must not see).
template <int N>
__device__ float emu_test_read_first(float v) {
    __shared__ float s[N];
    const float before = s[threadIdx.x];
    s[threadIdx.x] = v;
    return before;
}
BATON_ENTRY void emu_test_uninit_shared(float* out, u32* raw) {
    __shared__ u32 plain[64];
    const int t = threadIdx.x;
    out[blockIdx.x * blockDim.x + t] = emu_test_read_first<64>(1.0f);
    raw[blockIdx.x * blockDim.x + t] = plain[t];
    plain[t] = 7u;
}

// A race: each thread writes s[t] and then, without a barrier, reads its neighbour's slot.
// out[t] = s[(t + 1) % n] is right only when the neighbour happened to run first.
BATON_ENTRY void emu_test_race(float* out) {
    __shared__ float s[1024];
    const int t = threadIdx.x, n = blockDim.x;
    s[t] = (float)t;
    out[t] = s[(t + 1) % n];
    __syncthreads();
}

// Two block sums through the same scratch without the barrier between them that baton_block_sum
// has: warp 0 may overwrite scratch[0] before the other warps have read the first sum's partial.
// out[t] = n + 2n for a block of n threads when the warps happen to stay in step.
BATON_ENTRY void emu_test_scratch_reuse(float* out) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float a = baton_warp_sum(1.0f);
    if (lane == 0) scratch[warp] = a;
    __syncthreads();
    a = baton_warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
    float b = baton_warp_sum(2.0f);
    if (lane == 0) scratch[warp] = b;
    __syncthreads();
    b = baton_warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
    out[threadIdx.x] = a + b;
}

// Grid barriers (cooperative launches). Thread 0 of block b writes a[b] = b + 1 and keeps
// 1000 (b + 1) in shared memory; after the barrier it writes out[b] = sum(a) + that shared
// value (so every block's write is seen, and a block's shared memory survives the other blocks'
// turns); after a second barrier it writes a[b] = out[(b + 1) % nb], another block's output.
BATON_ENTRY void emu_test_grid_sync(u32* a, u32* out, unsigned* bar) {
    __shared__ u32 mine;
    const u32 b = blockIdx.x, nb = gridDim.x;
    if (threadIdx.x == 0) {
        a[b] = b + 1;
        mine = 1000 * (b + 1);
    }
    BATON_GRID_SYNC(bar);
    if (threadIdx.x == 0) {
        u32 s = 0;
        for (u32 i = 0; i < nb; ++i) s += a[i];
        out[b] = s + mine;
    }
    BATON_GRID_SYNC(bar);
    if (threadIdx.x == 0) a[b] = out[(b + 1) % nb];
}

// Block `early` returns before the grid barrier the others wait at: a hang on a GPU.
BATON_ENTRY void emu_test_grid_sync_early_exit(unsigned* bar, int early) {
    if ((int)blockIdx.x == early) return;
    BATON_GRID_SYNC(bar);
}

// The first warp waits at __syncthreads while the rest of the block waits at the grid barrier.
BATON_ENTRY void emu_test_grid_sync_mixed(unsigned* bar) {
    if (threadIdx.x < 32) {
        __syncthreads();
    } else {
        BATON_GRID_SYNC(bar);
    }
}
