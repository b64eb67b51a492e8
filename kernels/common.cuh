// Baton kernel prelude: prepended (textually, before a `#line 1` directive) to every kernel
// source by `baton_cuda::kernels::full_source`, so each .cu compiles as one NVRTC program with
// no header table. Only NVRTC built-ins and cuda_bf16.h (from the CUDA include dir) are used: no
// C/C++ standard headers, which NVRTC does not ship.
//
// Conventions for every kernel:
// - Activations, weights and the KV cache are `elem_t`, row-major, innermost dimension last;
//   all accumulation is fp32; results are rounded to `elem_t` once. `elem_t` is chosen per NVRTC
//   program by `-DBATON_DTYPE=<n>` (see `baton_cuda::kernels::Dtype`): 0 = bf16 (default),
//   1 = f16, 2 = f32. The same source compiles to three modules with the same entry names.
// - Index types: `int` for counts and positions (< 2^31), `size_t` for element offsets into
//   large buffers (KV cache, weights).
// - Every entry point is declared `BATON_ENTRY` (`extern "C" __global__`) and named
//   `baton_<op>[_<variant>]`.
//
// Host emulation (crates/cuda-emu): with `-DBATON_EMU` the same sources compile as C++ for the
// CPU. The emulator's prelude then supplies the CUDA types and intrinsics (so no CUDA header is
// included here), and entry points get C++ linkage, because each dtype's copy of a kernel lives
// in its own C++ namespace in one binary.
#pragma once
#ifdef BATON_EMU
#define BATON_ENTRY __global__
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define BATON_ENTRY extern "C" __global__
#endif

// Programmatic dependent launch (PDL, sm_90+). The host launches every kernel with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (baton_cuda::device), so a kernel's
// blocks may start while the kernel before it in the stream is still running. The rule every
// entry point keeps: BATON_PDL_WAIT() runs before its first read of memory that earlier stream
// work writes and before its first global write; before it, a kernel may only read weights
// (never written after load) and memory last written at least two kernels back in the stream:
// the step's uploaded inputs (positions, slots, sequence lengths, block tables) and the KV
// cache entries of earlier steps. That second kind is safe because every entry point runs
// BATON_PDL_LAUNCH only after its own BATON_PDL_WAIT: when kernel n + 1 starts, every block of
// kernel n has passed its wait, so kernel n - 1 and everything before it have completed. BATON_PDL_WAIT returns once every earlier kernel in the stream
// has completed and its writes are visible (griddepcontrol.wait; PTX ISA, "Parallel
// synchronization and communication instructions"). BATON_PDL_LAUNCH lets the next kernel's
// blocks be scheduled before this one finishes (griddepcontrol.launch_dependents). It must come
// after the block's BATON_PDL_WAIT, and a launch must have at least one block that runs
// BATON_PDL_WAIT (a block may return before waiting if another does not): the two-kernels-back
// rule above rests on both. Both are no-ops below sm_90, without the launch
// attribute, and in the host emulator (which runs kernels one after another).
#if defined(BATON_EMU) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
#define BATON_PDL_WAIT_RAW() ((void)0)
#define BATON_PDL_LAUNCH() ((void)0)
#else
#define BATON_PDL_WAIT_RAW() asm volatile("griddepcontrol.wait;" ::: "memory")
#define BATON_PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" :::)
#endif
// The launch trace (BATON_TRACE below) wraps the wait; otherwise BATON_PDL_WAIT is the bare
// instruction.
#ifndef BATON_TRACE  // tunable: BATON_KERNEL_DEFINES (crates/cuda/src/kernels.rs)
#define BATON_TRACE 0
#endif
#if defined(BATON_EMU) || (BATON_TRACE && defined(__CUDA_ARCH__))
// The host emulator always has the trace compiled in: it is off until its device sets a table.
#define BATON_TRACE_ON 1
#define BATON_PDL_WAIT() baton_trace_wait<baton_trace_file(baton_trace_base_name(__FILE__))>(__LINE__)
#else
#define BATON_TRACE_ON 0
#define BATON_PDL_WAIT() BATON_PDL_WAIT_RAW()
#endif

// Grid-wide barrier of a cooperative launch: the host launches with
// CU_LAUNCH_ATTRIBUTE_COOPERATIVE and a grid no larger than what the SMs hold at once
// (cuOccupancyMaxActiveBlocksPerMultiprocessor), so every block is resident and may wait for
// the others. Every block of the grid must reach each barrier (a block that returns early hangs
// the rest; the host emulator reports it as a deadlock). `bar` is two words of global memory,
// zero at allocation: bar[0] counts the blocks that arrived, bar[1] is the generation; the
// barrier leaves bar[0] at 0, so a launch needs no reset. After the block's __syncthreads,
// thread 0 reads the generation, fences the block's writes device-wide and counts the block;
// the last block to arrive resets the count and bumps the generation, the others spin until it
// moves; a fence and a second __syncthreads release the block, whose reads then see every
// block's writes from before the barrier. The protocol of cooperative groups' grid.sync (CUDA
// C++ Programming Guide, "Grid Synchronization"; the generation word replaces its flipped top
// bit). In the host emulator it is a barrier over every block's threads (crates/cuda-emu).
#ifdef BATON_EMU
#define BATON_GRID_SYNC(bar) ((void)(bar), ::baton_emu::grid_sync_at(__FILE__, __LINE__))
#else
__device__ __forceinline__ void baton_grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* gen = bar + 1;
        const unsigned g = *gen;
        __threadfence();  // the block's writes, and the generation read, before the count
        if (atomicAdd(bar, 1u) == gridDim.x * gridDim.y * gridDim.z - 1) {
            atomicExch(bar, 0u);
            __threadfence();  // the reset before the release
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == g) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}
#define BATON_GRID_SYNC(bar) baton_grid_sync(bar)
#endif

// A hint that the 128-byte line holding p will be read soon: fetched into L2 without occupying
// a register or waiting (PTX prefetch.global.L2). No effect on results; a no-op in the host
// emulator.
#if defined(BATON_EMU) || !defined(__CUDA_ARCH__)
#define BATON_PREFETCH_L2(p) ((void)(p))
#else
#define BATON_PREFETCH_L2(p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p))
#endif

// Asynchronous 16-byte copy global -> shared (sm_80+ cp.async.cg: bypasses L1 and registers),
// in groups: BATON_CP_ASYNC_COMMIT closes the group of the copies issued since the last one,
// BATON_CP_ASYNC_WAIT(n) waits until at most n groups are still in flight (PTX ISA,
// "Data movement and conversion instructions: cp.async"). The copies are visible to the
// issuing thread after the wait and to the block after a __syncthreads that follows it. Both
// addresses must be 16-byte aligned. The host emulator performs each copy at the wait that
// covers it (the latest moment the GPU may), so a kernel that touches a destination before
// its wait fails there; below sm_80 the copy is a plain load and store.
#if defined(BATON_EMU)
#define BATON_CP_ASYNC16(dst, src) ::baton_emu::cp_async16((dst), (src))
#define BATON_CP_ASYNC_COMMIT() ::baton_emu::cp_async_commit()
#define BATON_CP_ASYNC_WAIT(n) ::baton_emu::cp_async_wait(n)
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
#define BATON_CP_ASYNC16(dst, src) \
    (*reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src))
#define BATON_CP_ASYNC_COMMIT() ((void)0)
#define BATON_CP_ASYNC_WAIT(n) ((void)0)
#else
#define BATON_CP_ASYNC16(dst, src)                                                        \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(                       \
                     (unsigned)__cvta_generic_to_shared(dst)),                             \
                 "l"(src)                                                                  \
                 : "memory")
#define BATON_CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define BATON_CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
#endif

typedef unsigned int u32;

// An input id with this bit set is a `PendingFrom` reference: the low bits index the device ring
// of ids earlier launches sampled (see baton_embedding_gather). The host's copy is
// baton_cuda::staging::PENDING_TAG.
#define BATON_PENDING_TAG 0x80000000u
typedef unsigned long long u64;

// Launch trace, a diagnostic (`baton bench decode --launch-trace`; compiled in only with
// BATON_KERNEL_DEFINES=BATON_TRACE=1, and always in the host emulator, which times launches
// one after another with its own clock and launch counter). Thread 0 of every block that
// runs BATON_PDL_WAIT reads %globaltimer (ns, one clock for every SM) before and after the wait
// and folds them into its launch's slot of a table whose device address the host stores in
// this module's `baton_trace_buf` (0: off). The slot is a multiplicative hash of %gridid
// (unique per launch, graph replays included) into 2^BATON_TRACE_SLOT_BITS slots of 16 u64,
// all ones before each step (the host fills the table); every field is an atomic minimum, or
// an increment, whose result is not read (a RED instruction: the block does not wait for it):
// [0] %gridid, [1] ~%gridid (two launches in one slot show as [0] != ~[1]), [2] the first
// arrival at the wait, [3] the first release, [4] ~the last release, [5] the blocks, counted
// up from all ones, [6] the wait's site (FNV-1a of the file name, low 16 bits, above the line
// number; `baton_cuda::trace::tag_name` inverts it; the smallest when blocks wait at different
// lines), [7] the grid's blocks, [8] ~the last exit: every entry point opens with
// BATON_TRACE_SCOPE(), whose destructor (on every return path) lets the block's last warp to
// leave fold %globaltimer in; [9..16) unused. The release orders launches: a kernel's waits
// return only after every earlier kernel in the stream has completed, so the first release of
// launch i + 1 minus that of launch i is launch i's share of the step, overlap included; of
// it, the last exit minus the release is the kernel's own work after its wait and the next
// release minus the last exit the hand-over between kernels (PTX ISA: griddepcontrol,
// %globaltimer, %gridid; red).
#define BATON_TRACE_SLOT_BITS 18
__host__ __device__ constexpr u32 baton_trace_file(const char* s, u32 h = 2166136261u) {
    return *s ? baton_trace_file(s + 1, (h ^ (u32)(unsigned char)*s) * 16777619u) : (h & 0xffffu);
}
// `path` after its last '/' (NVRTC's __FILE__ is the bare name already; the emulator's is a path).
__host__ __device__ constexpr const char* baton_trace_base_from(const char* p, const char* last) {
    return *p == 0 ? last : baton_trace_base_from(p + 1, *p == '/' ? p + 1 : last);
}
__host__ __device__ constexpr const char* baton_trace_base_name(const char* path) {
    return baton_trace_base_from(path, path);
}
// %globaltimer: ns, one clock for every SM (PTX ISA, special registers); in the emulator the
// host's monotonic clock.
#ifdef BATON_EMU
__device__ __forceinline__ u64 baton_globaltimer() { return ::baton_emu::globaltimer(); }
#else
__device__ __forceinline__ u64 baton_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
#endif
#if BATON_TRACE_ON
__device__ __forceinline__ u64 baton_trace_now() { return baton_globaltimer(); }
#ifdef BATON_EMU
__device__ __forceinline__ u64 baton_trace_grid() { return ::baton_emu::g_gridid; }
__device__ __forceinline__ u64 baton_trace_table() { return ::baton_emu::g_trace_buf; }
// Blocks run one at a time: a plain minimum is atomic.
__device__ __forceinline__ void baton_trace_red_min(u64 a, u64 v) {
    u64* p = reinterpret_cast<u64*>(a);
    if (v < *p) *p = v;
}
__device__ __forceinline__ void baton_trace_red_inc(u64 a) { *reinterpret_cast<u64*>(a) += 1; }
#define BATON_TRACE_GLOBAL(p) ((u64)(p))
#else
// Constant memory: every warp reads it at its exit, through the constant cache.
__constant__ u64 baton_trace_buf;
__device__ __forceinline__ u64 baton_trace_grid() {
    u64 g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    return g;
}
__device__ __forceinline__ u64 baton_trace_table() { return baton_trace_buf; }
// An atomic minimum (increment) at global address `a` whose result is not returned (PTX red).
__device__ __forceinline__ void baton_trace_red_min(u64 a, u64 v) {
    asm volatile("red.global.min.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ void baton_trace_red_inc(u64 a) {
    asm volatile("red.global.add.u64 [%0], 1;" ::"l"(a) : "memory");
}
#define BATON_TRACE_GLOBAL(p) ((u64)__cvta_generic_to_global(p))
#endif
// The global address of this launch's slot, or 0 when the trace is off.
__device__ __forceinline__ u64 baton_trace_slot() {
    const u64 base = baton_trace_table();
    if (base == 0) return 0;
    const u64 h = (baton_trace_grid() * 0x9E3779B97F4A7C15ull) >> (64 - BATON_TRACE_SLOT_BITS);
    return BATON_TRACE_GLOBAL(reinterpret_cast<u64*>(base) + h * 16);
}
// The block's warps still running (BatonTraceScope) and thread 0's time before its wait.
__shared__ u32 baton_trace_live_warps;
__shared__ u64 baton_trace_t_pre;
__device__ __forceinline__ u32 baton_trace_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
// Opens every entry point: with the trace on (a value uniform over the grid, so the barrier is
// reached by every thread or by none), counts the block's warps; the last warp to leave folds
// the block's exit time into the slot, one atomic per block.
struct BatonTraceScope {
    __device__ __forceinline__ BatonTraceScope() {
        if (baton_trace_table() == 0) return;
        if (baton_trace_tid() == 0)
            baton_trace_live_warps = (blockDim.x * blockDim.y * blockDim.z + 31u) / 32u;
        __syncthreads();
    }
    __device__ __forceinline__ ~BatonTraceScope() {
        if ((baton_trace_tid() & 31u) != 0) return;
        const u64 s = baton_trace_slot();
        if (s == 0) return;
        if (atomicAdd(&baton_trace_live_warps, 0xffffffffu) != 1u) return;  // not the last
        baton_trace_red_min(s + 64, ~baton_trace_now());
    }
};
#define BATON_TRACE_SCOPE() BatonTraceScope baton_trace_scope_
// Thread 0's time before the wait is parked in shared memory, so no register stays live
// across the wait (register-capped kernels spilled with one).
template <u32 FILE_HASH>
__device__ __forceinline__ void baton_trace_wait(int line) {
    const bool first = baton_trace_tid() == 0;
    if (first) baton_trace_t_pre = baton_trace_now();
    BATON_PDL_WAIT_RAW();
    if (first) {
        const u64 t1 = baton_trace_now();
        const u64 s = baton_trace_slot();
        if (s == 0) return;
        const u64 grid = baton_trace_grid();
        baton_trace_red_min(s + 0, grid);
        baton_trace_red_min(s + 8, ~grid);
        baton_trace_red_min(s + 16, baton_trace_t_pre);
        baton_trace_red_min(s + 24, t1);
        baton_trace_red_min(s + 32, ~t1);
        baton_trace_red_inc(s + 40);
        baton_trace_red_min(s + 48, (u64)((FILE_HASH << 16) | ((u32)line & 0xffffu)));
        baton_trace_red_min(s + 56, (u64)(gridDim.x * gridDim.y * gridDim.z));
    }
}
#else
#define BATON_TRACE_SCOPE() ((void)0)
#endif

#ifndef BATON_DTYPE
#define BATON_DTYPE 0
#endif
#if BATON_DTYPE == 0
typedef __nv_bfloat16 elem_t;
__device__ __forceinline__ float baton_to_f(elem_t x) { return __bfloat162float(x); }
__device__ __forceinline__ elem_t baton_from_f(float x) { return __float2bfloat16_rn(x); }
#elif BATON_DTYPE == 1
typedef __half elem_t;
__device__ __forceinline__ float baton_to_f(elem_t x) { return __half2float(x); }
__device__ __forceinline__ elem_t baton_from_f(float x) { return __float2half_rn(x); }
#elif BATON_DTYPE == 2
typedef float elem_t;
__device__ __forceinline__ float baton_to_f(elem_t x) { return x; }
__device__ __forceinline__ elem_t baton_from_f(float x) { return x; }
#else
#error "BATON_DTYPE must be 0 (bf16), 1 (f16) or 2 (f32)"
#endif
// Round an fp32 value to elem_t precision and back (identity for f32).
__device__ __forceinline__ float baton_round(float x) { return baton_to_f(baton_from_f(x)); }
// Elements per 16-byte vector (8 for bf16/f16, 4 for f32).
#define BATON_VEC ((int)(16 / sizeof(elem_t)))
// True when p is 16-byte aligned.
__device__ __forceinline__ bool baton_aligned16(const void* p) {
    return (reinterpret_cast<size_t>(p) & 15) == 0;
}

#define BATON_WARP 32
#define BATON_FULL_MASK 0xffffffffu
// NVRTC has no <math.h> INFINITY; these are exact bit patterns.
#define BATON_NEG_INF __int_as_float(0xff800000)
#define BATON_POS_INF __int_as_float(0x7f800000)
#define BATON_FLT_MAX 3.402823466e+38f

// Block-wide sum / max for blockDim.x a multiple of 32 and <= 1024. Every thread gets the result.
// Uses 33 floats of shared scratch passed by the caller (so several reductions can coexist).
__device__ __forceinline__ float baton_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(BATON_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float baton_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(BATON_FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float baton_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = baton_warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return baton_warp_sum(v);
}
__device__ __forceinline__ float baton_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = baton_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : BATON_NEG_INF;
    return baton_warp_max(v);
}

// Sum of squares of the n stored values of one row x, over the block (strided by thread, then
// baton_block_sum): the RMSNorm statistic. Every thread gets the result.
__device__ __forceinline__ float baton_row_sumsq(const elem_t* x, int n, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = baton_to_f(x[i]);
        ss = fmaf(v, v, ss);
    }
    return baton_block_sum(ss, scratch);
}

// BATON_VEC elements in one 16-byte vector, for vectorized loads/stores.
struct __align__(16) baton_vec {
    elem_t e[BATON_VEC];
};

// Loads of activations that other blocks of the same launch write (the persistent decode
// kernel reads, after a grid barrier, what other blocks wrote before it): through L2
// (ld.global.cg, __ldcg), never from the non-coherent read-only path that a const __restrict__
// pointer lets the compiler use, nor from an L1 line filled before the barrier. With GRID false
// (a kernel whose inputs were written by earlier launches) a plain load.
// Through the unsigned type of T's size: the 2-byte __ldcg of cuda_bf16.h / cuda_fp16.h is a
// plain asm (no volatile, no memory clobber) that the compiler could move across the grid
// barrier; the integer overloads are asm volatile.
template <bool GRID, class T>
__device__ __forceinline__ T baton_ld_act(const T* p) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "2- or 4-byte elements");
    if (GRID) {
        if (sizeof(T) == 2) {
            const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
            return *reinterpret_cast<const T*>(&u);
        }
        const unsigned int u = __ldcg(reinterpret_cast<const unsigned int*>(p));
        return *reinterpret_cast<const T*>(&u);
    }
    return *p;
}
template <bool GRID>
__device__ __forceinline__ baton_vec baton_ld_act_vec(const baton_vec* p) {
    if (GRID) {
        const uint4 u = __ldcg(reinterpret_cast<const uint4*>(p));
        return *reinterpret_cast<const baton_vec*>(&u);
    }
    return *p;
}
// A 16-byte weight vector. GRID: through the read-only path explicitly (ld.global.nc): inside
// the persistent kernel's __noinline__ phases the weight pointers come from the layer table
// and would otherwise be loaded through generic addresses; weights are never written. Else a
// plain load (which the entry points' compiler turns into ld.global.nc itself).
template <bool GRID>
__device__ __forceinline__ baton_vec baton_ld_weight_vec(const baton_vec* p) {
    if (GRID) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
        return *reinterpret_cast<const baton_vec*>(&u);
    }
    return *p;
}
