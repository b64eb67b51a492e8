#pragma once
// gemv.cuh: the device code of the small-batch GEMV (gemv.cu's entry points; attention.cu's
// persistent decode kernel runs the batch-of-one body as its linear-layer phases).
//
// Small-batch GEMV with fused prologue and epilogue, for decode steps of at most
// BATON_GEMV_MAX_T tokens, where every linear layer is bound by streaming its weights once and
// the separate norm and activation kernels of the cuBLAS path cost a launch each.
//
// One warp per output row (two weight rows in SiLU mode), the row read once in 16-byte vectors
// (several per lane in flight on the batch-of-one entries, see the entry points below); the T
// activation rows are read (and normalized) by every warp of a block from L1/L2, as in the
// split-free GEMV of llama.cpp's `mul_mat_vec` and vLLM's fused-norm decode paths.
//
//   xin[t, k] = norm_w ? round(norm_w[k] * round(x[t, k] * inv[t])) : x[t, k]
//               inv[t] = 1 / sqrt(mean_k(x[t, k]^2) + eps)   (rmsnorm.cu's numerics: statistics
//               in fp32 over the stored values, normalize, round, multiply by the weight, round)
//   acc[t, n] = sum_k xin[t, k] * W[n, k]                   (fp32)
//   mode 0  store:     out[t, n] = round(acc)                        elem_t, row stride N
//   mode 1  f32:       out[t, n] = acc                               float, row stride N (logits)
//   mode 2  residual:  out[t, n] = round(out[t, n] + round(acc))     out is the residual stream
//                      (the add of rmsnorm.cu's baton_add_rmsnorm, on the rounded GEMM output)
//   mode 3  silu:      g = round(acc over W[n]), u = round(acc over W[N + n]),
//                      out[t, n] = round(silu(g) * u)                (activation.cu's numerics)
//
// Shapes: x [T, K] elem_t, row stride K; W [N, K] elem_t row-major ([2N, K] in mode 3: the gate
// rows, then the up rows, as the fused gate_up projection); norm_w [K] elem_t or null; out as
// above. T <= BATON_GEMV_MAX_T. `out` must not alias `x` or `W` (mode 2 reads and writes `out`
// at the same index only, from one thread).
// Launch: grid = (ceil(N / rows_per_block)), block = (256); rows_per_block a multiple of 8
// (each of the 8 warps takes every 8th row of its block's range). Vectorized when K is a
// multiple of BATON_VEC and x, W, norm_w are 16-byte aligned; scalar otherwise.
#define BATON_GEMV_MAX_T 8

__device__ __forceinline__ float baton_gemv_silu(float x) { return x / (1.0f + expf(-x)); }

// The rows of one block: T <= TT tokens (TT the compile-time bound the accumulators are sized
// for), SILU mode (two weight rows per output) and U weight vectors per lane in flight, all but
// T compile-time, so that a specialized entry takes only the registers it needs (a runtime T
// up to 8 with 8 vectors in flight took 240 registers: one block per SM, and the compiler then
// sank the loads next to their uses, leaving a third of the bandwidth).
template <int TT, bool SILU, int U>
__device__ __forceinline__ void baton_gemv_rows(void* out, const elem_t* __restrict__ x,
                                                const elem_t* __restrict__ w,
                                                const elem_t* __restrict__ norm_w,
                                                const float* inv_s, int T, int N, int K,
                                                int mode, int first, int end, bool vec) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const bool norm = norm_w != nullptr;
    for (int n = first + warp; n < end; n += nwarps) {
        float acc[TT];
        float acc2[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            acc[t] = 0.0f;
            acc2[t] = 0.0f;
        }
        const elem_t* w0 = w + (size_t)n * K;
        const elem_t* w1 = SILU ? w + (size_t)(N + n) * K : w0;
        if (vec) {
            // U vectors of each weight row per lane per iteration, loaded before the first
            // FMA; each lane still visits its vectors in ascending order.
            const int nv = K / BATON_VEC;
            const baton_vec* w0v = reinterpret_cast<const baton_vec*>(w0);
            const baton_vec* w1v = reinterpret_cast<const baton_vec*>(w1);
            for (int i0 = lane; i0 < nv; i0 += BATON_WARP * U) {
                baton_vec a[U];
                baton_vec b[SILU ? U : 1];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int i = i0 + u * BATON_WARP;
                    if (i < nv) {
                        a[u] = w0v[i];
                        if (SILU) b[SILU ? u : 0] = w1v[i];
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int i = i0 + u * BATON_WARP;
                    if (i < nv) {
                        baton_vec g = a[u];
                        if (norm) g = reinterpret_cast<const baton_vec*>(norm_w)[i];
#pragma unroll
                        for (int t = 0; t < TT; ++t) {
                            if (t >= T) break;
                            const baton_vec xv =
                                reinterpret_cast<const baton_vec*>(x + (size_t)t * K)[i];
#pragma unroll
                            for (int j = 0; j < BATON_VEC; ++j) {
                                float xi = baton_to_f(xv.e[j]);
                                if (norm)
                                    xi = baton_round(baton_to_f(g.e[j]) *
                                                     baton_round(xi * inv_s[t]));
                                acc[t] = fmaf(xi, baton_to_f(a[u].e[j]), acc[t]);
                                if (SILU)
                                    acc2[t] = fmaf(xi, baton_to_f(b[SILU ? u : 0].e[j]), acc2[t]);
                            }
                        }
                    }
                }
            }
        } else {
            for (int k = lane; k < K; k += BATON_WARP) {
                const float a = baton_to_f(w0[k]);
                const float b = SILU ? baton_to_f(w1[k]) : 0.0f;
                const float g = norm ? baton_to_f(norm_w[k]) : 0.0f;
#pragma unroll
                for (int t = 0; t < TT; ++t) {
                    if (t >= T) break;
                    float xi = baton_to_f(x[(size_t)t * K + k]);
                    if (norm) xi = baton_round(g * baton_round(xi * inv_s[t]));
                    acc[t] = fmaf(xi, a, acc[t]);
                    if (SILU) acc2[t] = fmaf(xi, b, acc2[t]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t >= T) break;
            acc[t] = baton_warp_sum(acc[t]);
            if (SILU) acc2[t] = baton_warp_sum(acc2[t]);
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                if (t >= T) break;
                const size_t o = (size_t)t * N + n;
                if (mode == 1) {
                    static_cast<float*>(out)[o] = acc[t];
                } else if (mode == 2) {
                    elem_t* r = static_cast<elem_t*>(out);
                    r[o] = baton_from_f(baton_to_f(r[o]) + baton_round(acc[t]));
                } else if (SILU) {
                    const float gate = baton_round(acc[t]), up = baton_round(acc2[t]);
                    static_cast<elem_t*>(out)[o] = baton_from_f(baton_gemv_silu(gate) * up);
                } else {
                    static_cast<elem_t*>(out)[o] = baton_from_f(acc[t]);
                }
            }
        }
    }
}

// The prologue (the norm statistics of the T token rows) and the block's rows.
template <int TT, bool SILU, int U>
__device__ __forceinline__ void baton_gemv_body(void* out, const elem_t* __restrict__ x,
                                                const elem_t* __restrict__ w,
                                                const elem_t* __restrict__ norm_w, int N, int K,
                                                int T, float eps, int mode,
                                                int rows_per_block) {
    __shared__ float scratch[33];
    __shared__ float inv_s[BATON_GEMV_MAX_T];
    const bool norm = norm_w != nullptr;
    if (norm) {
        for (int t = 0; t < T; ++t) {
            const float ss = baton_row_sumsq(x + (size_t)t * K, K, scratch);
            if (threadIdx.x == 0) inv_s[t] = 1.0f / sqrtf(ss / (float)K + eps);
        }
        __syncthreads();
    }
    const bool vec = K % BATON_VEC == 0 && baton_aligned16(x) && baton_aligned16(w) &&
                     (!norm || baton_aligned16(norm_w));
    const int first = blockIdx.x * rows_per_block;
    const int end = first + rows_per_block < N ? first + rows_per_block : N;
    baton_gemv_rows<TT, SILU, U>(out, x, w, norm_w, inv_s, T, N, K, mode, first, end, vec);
}

// ---------------------------------------------------------------------------------------------
// The batch-of-one path (T = 1, vectorized, K <= BATON_GEMV_SMEM_K), built so that a launch is
// bound by the weight stream alone:
//   - the activation row is staged once per block in shared memory, already normalized and
//     rounded (xin above, as elem_t: exactly the value the generic path computes per element),
//     so the per-row loop is loads and FMAs only;
//   - each warp walks its rows (first + warp, + 8, ... below end) in chunks of 32 U vectors,
//     and issues the next chunk's loads (of the same row, or of its next row) before the FMAs
//     of the current one: U vectors per lane are always in flight (software pipelining, two
//     register buffers);
//   - the first chunk's loads are issued before BATON_PDL_WAIT (weights are never written), so
//     with programmatic dependent launch the weight stream starts while the previous kernel
//     finishes.
// The host sizes rows_per_block so that the grid is about two blocks per SM (one wave); the
// prologue (norm statistics and staging) is then paid once per block, not once per 8 rows.
// Registers: __launch_bounds__(256, 2) caps them at 128 (two blocks per SM).
#define BATON_GEMV_SMEM_BYTES 32768
// Bytes at the start of a block's weight rows that the batch-of-one path asks L2 to fetch
// before BATON_PDL_WAIT (0: none), on top of the first chunk's register loads: while the
// previous kernel finishes, the HBM would otherwise sit idle. Tunable (BATON_KERNEL_DEFINES);
// off until a GPU A/B run (scripts/gpu-ab.sh) shows a gain.
#ifndef BATON_GEMV_PREWAIT_L2
#define BATON_GEMV_PREWAIT_L2 0
#endif
#define BATON_GEMV_SMEM_K (BATON_GEMV_SMEM_BYTES / (int)sizeof(elem_t))
#ifndef BATON_GEMV_T1_U  // tunable: BATON_KERNEL_DEFINES (crates/cuda/src/kernels.rs)
#define BATON_GEMV_T1_U 4
#endif

// baton_block_sum over 2 x blockDim.x virtual threads: v0 is thread t's sum, v1 thread
// t + blockDim.x's; the virtual warps' sums are added in order (warps of v0, then of v1), as
// baton_block_sum adds them for a block of twice the size. Every thread gets the result.
__device__ __forceinline__ float baton_block_sum_pairs(float v0, float v1, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v0 = baton_warp_sum(v0);
    v1 = baton_warp_sum(v1);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) {
        scratch[warp] = v0;
        scratch[warp + nwarps] = v1;
    }
    __syncthreads();
    const float v = lane < 2 * nwarps ? scratch[lane] : 0.0f;
    return baton_warp_sum(v);
}

// Loads chunk c of weight row n (and of row N + n in SiLU mode): vectors c*32U + u*32 + lane.
template <bool SILU, int U, bool GRID>
__device__ __forceinline__ void baton_gemv1_load(baton_vec (&a)[U], baton_vec (&b)[SILU ? U : 1],
                                                 const baton_vec* __restrict__ wv, int N, int nv,
                                                 int n, int c, int lane) {
    const baton_vec* r0 = wv + (size_t)n * nv;
    const baton_vec* r1 = wv + (size_t)(SILU ? N + n : n) * nv;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int i = (c * U + u) * BATON_WARP + lane;
        if (i < nv) {
            a[u] = baton_ld_weight_vec<GRID>(r0 + i);
            if (SILU) b[SILU ? u : 0] = baton_ld_weight_vec<GRID>(r1 + i);
        }
    }
}

// The FMAs of chunk c against the staged activation row.
template <bool SILU, int U>
__device__ __forceinline__ void baton_gemv1_fma(float& acc, float& acc2, const baton_vec (&a)[U],
                                                const baton_vec (&b)[SILU ? U : 1],
                                                const baton_vec* xs, int nv, int c, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int i = (c * U + u) * BATON_WARP + lane;
        if (i < nv) {
            const baton_vec xv = xs[i];
#pragma unroll
            for (int j = 0; j < BATON_VEC; ++j) {
                const float xi = baton_to_f(xv.e[j]);
                acc = fmaf(xi, baton_to_f(a[u].e[j]), acc);
                if (SILU) acc2 = fmaf(xi, baton_to_f(b[SILU ? u : 0].e[j]), acc2);
            }
        }
    }
}

// Stages xin into the block's buffer `xs` (shared memory, K / BATON_VEC vectors): the rounded,
// normalized activation row (or the row itself), exactly the value the generic path computes
// per element; ends with the barrier that publishes it. `scratch`: 33 floats of shared memory
// for the norm's block sum. GRID as baton_gemv1_body.
template <bool GRID>
__device__ __forceinline__ void baton_gemv1_stage(const elem_t* __restrict__ x,
                                                  const elem_t* __restrict__ norm_w, int K,
                                                  float eps, baton_vec* xs, float* scratch) {
    const int nv = K / BATON_VEC;
    const baton_vec* xv = reinterpret_cast<const baton_vec*>(x);
    if (norm_w != nullptr) {
        // The statistic is summed in the 256-thread entry points' order whatever the block
        // size: a GRID block has 128 threads, so each thread sums for two of the entry's
        // threads (t and t + 128) and the block sum takes those 8 warps' sums in order. The
        // persistent kernel's values are then bit-identical to the per-kernel path's (with
        // one sum per thread, rows of more than 128 vectors summed in another order).
        const int stride = GRID ? 2 * (int)blockDim.x : (int)blockDim.x;
        float ss = 0.0f, ss2 = 0.0f;
        for (int i = threadIdx.x; i < nv; i += stride) {
            const baton_vec v = baton_ld_act_vec<GRID>(xv + i);
#pragma unroll
            for (int j = 0; j < BATON_VEC; ++j) {
                const float f = baton_to_f(v.e[j]);
                ss = fmaf(f, f, ss);
            }
            if (GRID && i + (int)blockDim.x < nv) {
                const baton_vec v2 = baton_ld_act_vec<GRID>(xv + i + blockDim.x);
#pragma unroll
                for (int j = 0; j < BATON_VEC; ++j) {
                    const float f = baton_to_f(v2.e[j]);
                    ss2 = fmaf(f, f, ss2);
                }
            }
        }
        ss = GRID ? baton_block_sum_pairs(ss, ss2, scratch) : baton_block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
        const baton_vec* gv = reinterpret_cast<const baton_vec*>(norm_w);
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            const baton_vec v = baton_ld_act_vec<GRID>(xv + i), g = gv[i];
            baton_vec r;
#pragma unroll
            for (int j = 0; j < BATON_VEC; ++j)
                r.e[j] = baton_from_f(baton_to_f(g.e[j]) * baton_round(baton_to_f(v.e[j]) * inv));
            xs[i] = r;
        }
    } else {
        for (int i = threadIdx.x; i < nv; i += blockDim.x)
            xs[i] = baton_ld_act_vec<GRID>(xv + i);
    }
    __syncthreads();
}

// Lane 0's store of output row n from the warp's sums (modes as at the top of this file).
template <bool SILU, bool GRID>
__device__ __forceinline__ void baton_gemv1_store(void* out, int n, int mode, float acc,
                                                  float acc2) {
    if (mode == 1) {
        static_cast<float*>(out)[n] = acc;
    } else if (mode == 2) {
        elem_t* r = static_cast<elem_t*>(out);
        const float prev = baton_to_f(baton_ld_act<GRID>(r + n));
        r[n] = baton_from_f(prev + baton_round(acc));
    } else if (SILU) {
        const float gate = baton_round(acc), up = baton_round(acc2);
        static_cast<elem_t*>(out)[n] = baton_from_f(baton_gemv_silu(gate) * up);
    } else {
        static_cast<elem_t*>(out)[n] = baton_from_f(acc);
    }
}

// `xs` is the block's staging buffer (shared memory, K elements). GRID: the body runs as one
// phase of a persistent kernel (decode_layers in attention.cu) and waits at the grid barrier
// `bar` where an entry point waits for its predecessor (BATON_PDL_WAIT); the first chunk's
// loads and the L2 prefetch still go out before it.
template <bool SILU, int U, bool GRID>
__device__ __forceinline__ void baton_gemv1_body(void* out, const elem_t* __restrict__ x,
                                                 const elem_t* __restrict__ w,
                                                 const elem_t* __restrict__ norm_w, int N, int K,
                                                 float eps, int mode, int rows_per_block,
                                                 baton_vec* xs, unsigned* bar) {
    __shared__ float scratch[33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int first = blockIdx.x * rows_per_block;
    const int end = first + rows_per_block < N ? first + rows_per_block : N;
    const int nv = K / BATON_VEC;
    const int cpr = (nv + BATON_WARP * U - 1) / (BATON_WARP * U);  // chunks per row
    const baton_vec* wv = reinterpret_cast<const baton_vec*>(w);
    baton_vec a[U], b[SILU ? U : 1];
    int n = first + warp, c = 0;
    if (n < end) baton_gemv1_load<SILU, U, GRID>(a, b, wv, N, nv, n, 0, lane);
    // (Compile-time, so that the default build holds no comparison with 0 bytes.)
    if constexpr (BATON_GEMV_PREWAIT_L2 > 0) {
        if (first < end) {
            // Rows [first, end) are contiguous (row-major [N, K]); in SiLU mode so are the up
            // rows N + first... One 128-byte line per thread per step.
            const size_t bytes = (size_t)(end - first) * K * sizeof(elem_t);
            const size_t cap = (size_t)BATON_GEMV_PREWAIT_L2;
            const size_t lim = bytes < cap ? bytes : cap;
            const char* r0 = reinterpret_cast<const char*>(w + (size_t)first * K);
            const char* r1 =
                SILU ? reinterpret_cast<const char*>(w + (size_t)(N + first) * K) : r0;
            for (size_t off = (size_t)threadIdx.x * 128; off < lim;
                 off += (size_t)blockDim.x * 128) {
                BATON_PREFETCH_L2(r0 + off);
                if (SILU) BATON_PREFETCH_L2(r1 + off);
            }
        }
    }

    if (GRID) {
        BATON_GRID_SYNC(bar);
    } else {
        BATON_PDL_WAIT();
        BATON_PDL_LAUNCH();
    }
    baton_gemv1_stage<GRID>(x, norm_w, K, eps, xs, scratch);

    float acc = 0.0f, acc2 = 0.0f;
    while (n < end) {
        int nn = n, nc = c + 1;
        if (nc == cpr) {
            nn = n + nwarps;
            nc = 0;
        }
        baton_vec a2[U], b2[SILU ? U : 1];
        if (nn < end) baton_gemv1_load<SILU, U, GRID>(a2, b2, wv, N, nv, nn, nc, lane);
        baton_gemv1_fma<SILU, U>(acc, acc2, a, b, xs, nv, c, lane);
        if (nc == 0) {  // row n is complete
            acc = baton_warp_sum(acc);
            if (SILU) acc2 = baton_warp_sum(acc2);
            if (lane == 0) baton_gemv1_store<SILU, GRID>(out, n, mode, acc, acc2);
            acc = 0.0f;
            acc2 = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            a[u] = a2[u];
            if (SILU) b[SILU ? u : 0] = b2[SILU ? u : 0];
        }
        n = nn;
        c = nc;
    }
}

// True when the batch-of-one body applies: 16-byte rows and an activation row of K elements
// that fits a staging buffer of `cap` elements.
__device__ __forceinline__ bool baton_gemv1_fits(const elem_t* x, const elem_t* w,
                                                 const elem_t* norm_w, int K, int cap) {
    return K % BATON_VEC == 0 && K <= cap && baton_aligned16(x) && baton_aligned16(w) &&
           (norm_w == nullptr || baton_aligned16(norm_w));
}

// ---------------------------------------------------------------------------------------------
// The batch-of-one path with its weight stream in shared memory (cp.async), an A/B variant of
// baton_gemv1_body (gemv.cu's `_async` entries; the host takes them with BATON_GEMV_ASYNC=1,
// crates/cuda/src/plan.rs). Same rows, same per-lane order of vectors, same sums: the output
// is bit-identical. What changes is where the bytes in flight wait: instead of two register
// buffers per warp (which take the 128 registers of two 256-thread blocks per SM, so the
// next kernel's blocks cannot be resident until one exits), each warp keeps
// BATON_GEMV_ASYNC_STAGES stages of its weight stream in a shared-memory ring, a stage being
// U vectors per lane of one row chunk (of the gate and the up row in SiLU mode). Each lane
// copies and later reads only its own slots, so no barrier is needed between the copies and
// their use: `cp.async.wait_group` per thread (common.cuh) is the only wait. All of a warp's
// first stages are issued before BATON_PDL_WAIT (32 KB a block with the defaults, as many
// bytes as the register path keeps in flight), and the entries declare __launch_bounds__
// (256, 4) so that the GEMV and its successor fit an SM together (64 registers a thread).
//
// Stage g of a warp covers its row first + warp + (g / cpr) * nwarps, chunk g % cpr, where a
// row has cpr = ceil(nv / (32 U)) chunks; lane l's vectors in chunk c are (c U + u) 32 + l,
// u < U, ascending, as in baton_gemv1_body. Ring layout, per warp, per stage, per weight row
// (2 in SiLU mode), per u: 32 lanes' vectors. Shared memory: the ring
// (BATON_GEMV_ASYNC_RING_BYTES) and the activation row (BATON_GEMV_ASYNC_XS_BYTES: K up to
// 4096 16-bit elements or 2048 f32 ones; longer rows take baton_gemv1_body's entry path).
#ifndef BATON_GEMV_ASYNC_STAGES
#define BATON_GEMV_ASYNC_STAGES 4
#endif
#define BATON_GEMV_ASYNC_XS_BYTES 8192
#define BATON_GEMV_ASYNC_K (BATON_GEMV_ASYNC_XS_BYTES / (int)sizeof(elem_t))
// U vectors per lane and stage of one weight row: 2 (one row), 1 (SiLU: gate and up rows).
#define BATON_GEMV_ASYNC_U(SILU) ((SILU) ? 1 : 2)
#define BATON_GEMV_ASYNC_RING_VECS (8 * BATON_GEMV_ASYNC_STAGES * 2 * BATON_WARP)
#define BATON_GEMV_ASYNC_RING_BYTES (BATON_GEMV_ASYNC_RING_VECS * 16)

// Issues stage g of this lane's warp into its ring slot (g % STAGES) and closes the copy group,
// which is empty when the warp has no stage g (so that every lane's group count stays in
// step with g).
template <bool SILU>
__device__ __forceinline__ void baton_gemv1_async_issue(baton_vec* ring, const baton_vec* wv,
                                                        int N, int nv, int row0, int nwarps,
                                                        int end, int cpr, int g, int lane) {
    constexpr int U = BATON_GEMV_ASYNC_U(SILU), P = SILU ? 2 : 1;
    const int n = row0 + (g / cpr) * nwarps, c = g % cpr;
    if (n < end) {
        baton_vec* slot = ring + (g % BATON_GEMV_ASYNC_STAGES) * P * U * BATON_WARP;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const baton_vec* r = wv + (size_t)(p == 0 ? n : N + n) * nv;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = (c * U + u) * BATON_WARP + lane;
                if (i < nv) BATON_CP_ASYNC16(slot + (p * U + u) * BATON_WARP + lane, r + i);
            }
        }
    }
    BATON_CP_ASYNC_COMMIT();
}

// The rows of this block, their weights streamed through the ring (see above). Requirements as
// baton_gemv1_body's (vectorized, K <= BATON_GEMV_ASYNC_K); `xs` and `ring` are the block's
// shared buffers of BATON_GEMV_ASYNC_XS_BYTES and BATON_GEMV_ASYNC_RING_BYTES.
template <bool SILU>
__device__ __forceinline__ void baton_gemv1_async_body(void* out, const elem_t* __restrict__ x,
                                                       const elem_t* __restrict__ w,
                                                       const elem_t* __restrict__ norm_w, int N,
                                                       int K, float eps, int mode,
                                                       int rows_per_block, baton_vec* xs,
                                                       baton_vec* ring) {
    constexpr int U = BATON_GEMV_ASYNC_U(SILU), P = SILU ? 2 : 1, S = BATON_GEMV_ASYNC_STAGES;
    __shared__ float scratch[33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int first = blockIdx.x * rows_per_block;
    const int end = first + rows_per_block < N ? first + rows_per_block : N;
    const int nv = K / BATON_VEC;
    const int cpr = (nv + BATON_WARP * U - 1) / (BATON_WARP * U);
    const int row0 = first + warp;
    // Stages of this warp: cpr for each of its rows row0, row0 + nwarps, ... below end.
    const int stages = row0 < end ? (end - row0 + nwarps - 1) / nwarps * cpr : 0;
    const baton_vec* wv = reinterpret_cast<const baton_vec*>(w);
    baton_vec* mine = ring + warp * S * P * U * BATON_WARP;
    // Weights are never written: the first stages go out before the wait.
#pragma unroll
    for (int g = 0; g < S; ++g)
        baton_gemv1_async_issue<SILU>(mine, wv, N, nv, row0, nwarps, end, cpr, g, lane);
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    baton_gemv1_stage<false>(x, norm_w, K, eps, xs, scratch);

    float acc = 0.0f, acc2 = 0.0f;
    for (int g = 0; g < stages; ++g) {
        BATON_CP_ASYNC_WAIT(S - 1);  // this lane's copies of stage g have landed
        const baton_vec* slot = mine + (g % S) * P * U * BATON_WARP;
        const int c = g % cpr;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = (c * U + u) * BATON_WARP + lane;
            if (i < nv) {
                const baton_vec xv = xs[i], a = slot[u * BATON_WARP + lane];
                const baton_vec b = SILU ? slot[(U + u) * BATON_WARP + lane] : a;
#pragma unroll
                for (int j = 0; j < BATON_VEC; ++j) {
                    const float xi = baton_to_f(xv.e[j]);
                    acc = fmaf(xi, baton_to_f(a.e[j]), acc);
                    if (SILU) acc2 = fmaf(xi, baton_to_f(b.e[j]), acc2);
                }
            }
        }
        if (c == cpr - 1) {  // the row is complete
            acc = baton_warp_sum(acc);
            if (SILU) acc2 = baton_warp_sum(acc2);
            const int n = row0 + (g / cpr) * nwarps;
            if (lane == 0) baton_gemv1_store<SILU, false>(out, n, mode, acc, acc2);
            acc = 0.0f;
            acc2 = 0.0f;
        }
        // The slot's values are in registers now (the copy below may overwrite it).
        baton_gemv1_async_issue<SILU>(mine, wv, N, nv, row0, nwarps, end, cpr, g + S, lane);
    }
    BATON_CP_ASYNC_WAIT(0);  // nothing of this block's copies outlives it
}
