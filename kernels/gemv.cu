// Small-batch GEMV entry points. The device code, its numerics, shapes and launch geometry are
// in gemv.cuh (shared with attention.cu's persistent decode kernel).
#include "gemv.cuh"

// Entry points, same parameters. baton_gemv takes any T <= BATON_GEMV_MAX_T and any mode, one
// weight vector per lane in flight (78 registers). baton_gemv_t1 (modes 0-2) and
// baton_gemv_silu_t1 (mode 3) are the batch-of-one decode path above (baton_gemv1_body: 8 and
// 4 vectors per lane and weight row in flight), falling back to the generic rows (4 vectors in
// flight) when the row is not vectorizable or K > BATON_GEMV_SMEM_K. A T = 1 entry given
// another T or mode does nothing. Specializing every T multiplied NVRTC's compile time by 20.
BATON_ENTRY void __launch_bounds__(256) baton_gemv(void* out, const elem_t* __restrict__ x,
                                                   const elem_t* __restrict__ w,
                                                   const elem_t* __restrict__ norm_w, int T,
                                                   int N, int K, float eps, int mode,
                                                   int rows_per_block) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    if (T < 1 || T > BATON_GEMV_MAX_T) return;
    if (mode == 3)
        baton_gemv_body<BATON_GEMV_MAX_T, true, 1>(out, x, w, norm_w, N, K, T, eps, mode,
                                                   rows_per_block);
    else
        baton_gemv_body<BATON_GEMV_MAX_T, false, 1>(out, x, w, norm_w, N, K, T, eps, mode,
                                                    rows_per_block);
}

BATON_ENTRY void __launch_bounds__(256, 2) baton_gemv_t1(void* out, const elem_t* __restrict__ x,
                                                         const elem_t* __restrict__ w,
                                                         const elem_t* __restrict__ norm_w,
                                                         int T, int N, int K, float eps,
                                                         int mode, int rows_per_block) {
    BATON_TRACE_SCOPE();
    if (T != 1 || mode == 3) {
        BATON_PDL_WAIT();
        return;
    }
    if (baton_gemv1_fits(x, w, norm_w, K, BATON_GEMV_SMEM_K)) {
        __shared__ baton_vec xs[BATON_GEMV_SMEM_K / BATON_VEC];
        baton_gemv1_body<false, 2 * BATON_GEMV_T1_U, false>(out, x, w, norm_w, N, K, eps, mode,
                                                             rows_per_block, xs, nullptr);
    } else {
        BATON_PDL_WAIT();
        BATON_PDL_LAUNCH();
        baton_gemv_body<1, false, BATON_GEMV_T1_U>(out, x, w, norm_w, N, K, 1, eps, mode,
                                                   rows_per_block);
    }
}

BATON_ENTRY void __launch_bounds__(256, 2) baton_gemv_silu_t1(
    void* out, const elem_t* __restrict__ x, const elem_t* __restrict__ w,
    const elem_t* __restrict__ norm_w, int T, int N, int K, float eps, int mode,
    int rows_per_block) {
    BATON_TRACE_SCOPE();
    if (T != 1 || mode != 3) {
        BATON_PDL_WAIT();
        return;
    }
    if (baton_gemv1_fits(x, w, norm_w, K, BATON_GEMV_SMEM_K)) {
        __shared__ baton_vec xs[BATON_GEMV_SMEM_K / BATON_VEC];
        baton_gemv1_body<true, BATON_GEMV_T1_U, false>(out, x, w, norm_w, N, K, eps, mode,
                                                       rows_per_block, xs, nullptr);
    } else {
        BATON_PDL_WAIT();
        BATON_PDL_LAUNCH();
        baton_gemv_body<1, true, BATON_GEMV_T1_U>(out, x, w, norm_w, N, K, 1, eps, mode,
                                                  rows_per_block);
    }
}

// The same two entries with the weight stream in shared memory (baton_gemv1_async_body in
// gemv.cuh: bit-identical outputs, 64 registers, the first stages issued before the wait),
// for K <= BATON_GEMV_ASYNC_K; longer or unaligned rows take the entries' paths above. The
// worker launches them instead of baton_gemv_t1 / baton_gemv_silu_t1 with BATON_GEMV_ASYNC=1.
// The entries' shared body: `SILU` (mode 3 only) or not (modes 0-2).
template <bool SILU>
__device__ __forceinline__ void baton_gemv_t1_async_entry(void* out, const elem_t* __restrict__ x,
                                                          const elem_t* __restrict__ w,
                                                          const elem_t* __restrict__ norm_w, int T,
                                                          int N, int K, float eps, int mode,
                                                          int rows_per_block) {
    if (T != 1 || (mode == 3) != SILU) {
        BATON_PDL_WAIT();
        return;
    }
    if (baton_gemv1_fits(x, w, norm_w, K, BATON_GEMV_ASYNC_K)) {
        __shared__ baton_vec xs[BATON_GEMV_ASYNC_XS_BYTES / 16];
        __shared__ baton_vec ring[BATON_GEMV_ASYNC_RING_VECS];
        baton_gemv1_async_body<SILU>(out, x, w, norm_w, N, K, eps, mode, rows_per_block, xs,
                                     ring);
    } else {
        BATON_PDL_WAIT();
        BATON_PDL_LAUNCH();
        baton_gemv_body<1, SILU, 2>(out, x, w, norm_w, N, K, 1, eps, mode, rows_per_block);
    }
}

BATON_ENTRY void __launch_bounds__(256, 4) baton_gemv_t1_async(
    void* out, const elem_t* __restrict__ x, const elem_t* __restrict__ w,
    const elem_t* __restrict__ norm_w, int T, int N, int K, float eps, int mode,
    int rows_per_block) {
    BATON_TRACE_SCOPE();
    baton_gemv_t1_async_entry<false>(out, x, w, norm_w, T, N, K, eps, mode, rows_per_block);
}

BATON_ENTRY void __launch_bounds__(256, 4) baton_gemv_silu_t1_async(
    void* out, const elem_t* __restrict__ x, const elem_t* __restrict__ w,
    const elem_t* __restrict__ norm_w, int T, int N, int K, float eps, int mode,
    int rows_per_block) {
    BATON_TRACE_SCOPE();
    baton_gemv_t1_async_entry<true>(out, x, w, norm_w, T, N, K, eps, mode, rows_per_block);
}
