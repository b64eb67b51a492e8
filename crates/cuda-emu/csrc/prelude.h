// Host emulation of the CUDA C surface that kernels/*.cu use. Force-included (before
// kernels/common.cuh, which skips the CUDA headers under BATON_EMU) into every generated wrapper
// translation unit; see crates/cuda-emu/build.rs and src/lib.rs for the execution model.
//
// Everything here runs on the calling OS thread: one emulated CUDA thread is one fiber, and a
// fiber gives up the CPU only inside __syncthreads() and __shfl_xor_sync() (runtime.cpp).
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

// ---- Declaration specifiers ---------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Blocks of one launch run one after another and launches are serialized, so a function-local
// static is exactly one block's shared memory. build.rs moves every zero-initialized static of a
// kernel translation unit (which are exactly its __shared__ variables) into the section
// `baton_emu_shared`, and the runtime fills that section with 0xff bytes (NaN floats, all-ones
// integers) before every block: a kernel that reads shared memory it has not written in this
// block sees poison, not a previous block's data. (A section attribute here would not do: GCC
// ignores it on statics of function templates.)
#define __shared__ static
// __restrict__ is a GNU C++ keyword already.

// ---- Vector and coordinate types ----------------------------------------------------------------
struct uint2 {
    unsigned int x, y;
} __attribute__((aligned(8)));
struct uint3 {
    unsigned int x, y, z;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned int x, y, z, w;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return uint4{x, y, z, w};
}

// ---- Runtime hooks (runtime.cpp) ---------------------------------------------------------------
namespace baton_emu {
// Coordinates of the fiber that runs now; the scheduler rewrites them before every resume.
struct Coords {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
extern Coords g_coords;
// cp.async (common.cuh's BATON_CP_ASYNC16 / _COMMIT / _WAIT): a copy is recorded when issued
// and performed when a wait covers its group, the latest moment the GPU may perform it.
void cp_async16(void* dst, const void* src);
void cp_async_commit();
void cp_async_wait(int pending);
// Block barrier; `file`/`line` name the textual __syncthreads() so divergent barriers are caught.
void syncthreads_at(const char* file, int line);
// Grid barrier of a cooperative launch (common.cuh's BATON_GRID_SYNC): the block's threads wait
// until every block of the grid has arrived; a failure in a launch that is not cooperative.
void grid_sync_at(const char* file, int line);
// Exchanges `size` bytes with lane (lane ^ lane_mask) of the same warp.
void shfl_xor_at(const char* file, int line, const void* in, void* out, unsigned size,
                 unsigned mask, int lane_mask, int width);
// The launch trace (common.cuh): the running launch's trace table (0: off) and launch number
// (%gridid), both set per launch by the Rust side (baton_emu_set_trace), and %globaltimer
// (the host's monotonic clock, ns).
extern unsigned long long g_trace_buf;
extern unsigned long long g_gridid;
unsigned long long globaltimer();
}  // namespace baton_emu

#define threadIdx (static_cast<const uint3&>(::baton_emu::g_coords.thread_idx))
#define blockIdx (static_cast<const uint3&>(::baton_emu::g_coords.block_idx))
#define blockDim (static_cast<const dim3&>(::baton_emu::g_coords.block_dim))
#define gridDim (static_cast<const dim3&>(::baton_emu::g_coords.grid_dim))
#define warpSize 32

#define __syncthreads() ::baton_emu::syncthreads_at(__FILE__, __LINE__)

template <class T>
inline T baton_emu_shfl_xor(const char* file, int line, unsigned mask, T v, int lane_mask,
                            int width = 32) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                  "__shfl_xor_sync: the emulator moves at most 8 trivially copyable bytes");
    T out;
    ::baton_emu::shfl_xor_at(file, line, &v, &out, sizeof(T), mask, lane_mask, width);
    return out;
}
#define __shfl_xor_sync(...) baton_emu_shfl_xor(__FILE__, __LINE__, __VA_ARGS__)

// ---- Atomics: one OS thread runs every fiber and fibers switch only at barriers, so a plain
// read-modify-write is atomic. Return the old value, as CUDA does. ------------------------------
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    const unsigned int o = *p; *p = o + v; return o;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long o = *p; *p = o + v; return o;
}
inline float atomicAdd(float* p, float v) { const float o = *p; *p = o + v; return o; }
inline double atomicAdd(double* p, double v) { const double o = *p; *p = o + v; return o; }

// Blocks of a launch run one after another, so a memory fence has nothing to order, and a
// load that bypasses L1 (__ldcg) is a plain load.
inline void __threadfence() {}
template <class T>
inline T __ldcg(const T* p) { return *p; }
// The read-only (non-coherent) path (__ldg) is a plain load too.
template <class T>
inline T __ldg(const T* p) { return *p; }

// ---- Integer / bit intrinsics -------------------------------------------------------------------
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned int __float_as_uint(float f) { unsigned int i; memcpy(&i, &f, 4); return i; }
// IEEE round-to-nearest arithmetic that the GPU compiler never contracts into an FMA (the host
// build does not contract at all: -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// cvt.rn.f32.u32: round to nearest even.
inline float __uint2float_rn(unsigned int u) { return (float)u; }
// cvt.rni.u64.f32: round to nearest even, saturate to [0, 2^64 - 1]; NaN -> 2^63 (PTX ISA 9.0:
// NaN gives 1 << 63 for a 64-bit destination from an f32 source, 0 for narrower ones).
inline unsigned long long __float2ull_rn(float f) {
    if (f != f) return 1ull << 63;
    if (!(f > 0.0f)) return 0;
    if (f >= 18446744073709551616.0f) return ~0ull;
    return (unsigned long long)nearbyintf(f);  // default rounding mode: to nearest even
}

// ---- bf16 / f16 ---------------------------------------------------------------------------------
struct __nv_bfloat16 {
    unsigned short __x;
};
struct __half {
    unsigned short __x;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    const unsigned int u = (unsigned int)h.__x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even; a NaN stays a NaN of the same sign (quiet bit set).
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(unsigned short)((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(unsigned short)(u >> 16)};
}
inline float __half2float(__half h) {
    _Float16 v;
    memcpy(&v, &h.__x, 2);
    return (float)v;
}
// IEEE binary16, round to nearest even (the compiler's conversion).
inline __half __float2half_rn(float f) {
    const _Float16 v = (_Float16)f;
    __half h;
    memcpy(&h.__x, &v, 2);
    return h;
}
