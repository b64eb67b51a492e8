// Paged attention over the KV cache (elem_t): decode (split-K, combined in the same launch), causal varlen prefill,
// and a generic kernel for any head_dim (both cases; the fast paths cover 64, 128 and 256).
//
// KV cache, per layer, for K and for V: [num_blocks][block_size][num_kv_heads][head_dim] elem_t
// (see baton_rope_and_cache in rope.cu). A row's block table [max_blocks_per_row] int maps
// logical block `pos / block_size` to a physical page. Every key/value a query attends to must
// be in the cache before the launch (baton_rope_and_cache runs first), except in the decode
// kernels of head dims 64/128/256, which rotate the step's own k and write it and its v to the
// cache themselves (see "Decode" below).
//
// GQA: query head h uses kv head h / (num_heads / num_kv_heads). A thread block serves one kv
// head and up to BATON_ATTN_MAX_G of its query heads, so each K/V vector is loaded once per
// block and reused across the group; grid.y = num_kv_heads * ceil(group / BATON_ATTN_MAX_G).
//
// Numerics: scores are the fp32 dot q . k (in dimension order) times `scale * log2(e)`;
// softmax uses exp2f in fp32 with an online (running max / running sum) softmax, accumulation
// is fp32, output rounded once to elem_t.
// Block = 4 warps (128 threads). Within a chunk of BATON_ATTN_PART keys: scores take one key per
// lane (warp w: keys [32 w, 32 w + 32), then [32 (w + 4), ...)); for p . v, warp w takes U
// consecutive keys per iteration (U = 16 / (D / 32): 8, 4, 2) and lane l owns head dims
// [l * D/32, (l+1) * D/32).
//
// Entry points exist for head_dim 64, 128 and 256 (`_hd64`, `_hd128`, `_hd256`).
// Checked on an H200 by scripts/gpu-check.sh (sessions 7 and 8; session 8 with PDL).

#include "gemv.cuh"

#define BATON_ATTN_PART 512
#define BATON_ATTN_MAX_G 8
#define BATON_ATTN_WARPS 4
#define BATON_LOG2E 1.4426950408889634f

// VPL consecutive elements, loaded as one (up to 16-byte) vector. Callers guarantee the address
// is a multiple of the pack size: every offset is a multiple of VPL elements (head_dim = 32 VPL,
// strides multiples of head_dim) from a cudaMalloc'ed base.
template <int VPL>
struct alignas(sizeof(elem_t) * VPL > 16 ? 16 : sizeof(elem_t) * VPL) BatonPack {
    elem_t e[VPL];
};

template <int VPL>
__device__ __forceinline__ void baton_load_pack(const elem_t* p, float (&out)[VPL]) {
    const BatonPack<VPL> v = *reinterpret_cast<const BatonPack<VPL>*>(p);
#pragma unroll
    for (int i = 0; i < VPL; ++i) out[i] = baton_to_f(v.e[i]);
}

// Keys of one decode partition of a sequence of `ctx` keys, from the launch's arguments:
// `z` partitions per sequence at most (grid.z), `fill` partitions the host would like per
// sequence to fill the GPU at this batch size (1 <= fill <= z), partitions of at least
// `min_part` keys and, when filling, of at most `long_part`:
//   max(min_part, min(ceil(ctx / fill), long_part), ceil(ctx / z)), each term but min_part
//   rounded up to a multiple of BATON_ATTN_PART_ALIGN (the host's min_part is one).
// So a short sequence is one partition (no combine) when ctx <= min_part; a batch large
// enough to fill the GPU (fill 1) splits only sequences longer than long_part; and a sequence
// never needs more than z partitions. The decode kernel walks a partition in tiles of
// BatonDecodeTile<D>::TK keys.
#define BATON_ATTN_PART_ALIGN 64
__device__ __forceinline__ int baton_attn_align(int keys) {
    return (keys + BATON_ATTN_PART_ALIGN - 1) / BATON_ATTN_PART_ALIGN * BATON_ATTN_PART_ALIGN;
}
__device__ __forceinline__ int baton_decode_part_size(int ctx, int z, int fill, int min_part,
                                                      int long_part) {
    fill = max(fill, 1);
    const int by_fill = min(baton_attn_align((ctx + fill - 1) / fill), long_part);
    const int by_grid = baton_attn_align((ctx + z - 1) / z);
    return max(max(min_part, by_fill), by_grid);
}

// The first key a query that attends to `ctx` keys (itself the last) reads: under a sliding
// window (window > 0; transformers' sliding_window, FlashAttention's window_size = (window - 1,
// 0)) its last `window` keys, else all.
__device__ __forceinline__ int baton_window_start(int ctx, int window) {
    return window > 0 ? max(ctx - window, 0) : 0;
}

// Online softmax update over the scores p[g][0..n) (log2 domain) of query heads g < ng, one
// warp per head: p becomes exp2(score - m_new), and m (running max), l (running sum) and alpha
// (the factor that rescales what earlier keys contributed; 0 on the first keys, m = -inf)
// are updated. The caller publishes the results with a barrier.
template <int N>
__device__ __forceinline__ void baton_attn_softmax(float (*p)[N], float* m, float* l,
                                                   float* alpha, int ng, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < ng; g += BATON_ATTN_WARPS) {
        float mx = BATON_NEG_INF;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, p[g][j]);
        mx = baton_warp_max(mx);
        const float m_old = m[g];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.0f;
        for (int j = lane; j < n; j += 32) {
            const float e = exp2f(p[g][j] - m_new);
            p[g][j] = e;
            sum += e;
        }
        sum = baton_warp_sum(sum);
        if (lane == 0) {
            const float a = exp2f(m_old - m_new);
            alpha[g] = a;
            l[g] = l[g] * a + sum;
            m[g] = m_new;
        }
    }
}

// Shared state of one attention block.
template <int D>
struct BatonAttnShared {
    alignas(16) elem_t q[BATON_ATTN_MAX_G][D];  // the group's query vectors (unscaled)
    union {
        float logits[BATON_ATTN_MAX_G][BATON_ATTN_PART];       // scores, then p, of a chunk
        float red[BATON_ATTN_WARPS - 1][BATON_ATTN_MAX_G][D];  // after the last chunk
    };
    float m[BATON_ATTN_MAX_G];      // running max (log2 domain)
    float l[BATON_ATTN_MAX_G];      // running sum of exp2(score - m)
    float alpha[BATON_ATTN_MAX_G];  // rescale factor of the last chunk
};

// Which kv head and which query heads the block at grid row y serves.
struct BatonAttnHeads {
    int kvh, head0, ng;
};
__device__ __forceinline__ BatonAttnHeads baton_attn_heads_at(int y, int num_heads,
                                                              int num_kv_heads) {
    const int group = num_heads / num_kv_heads;
    const int chunks = (group + BATON_ATTN_MAX_G - 1) / BATON_ATTN_MAX_G;
    const int kvh = y / chunks, c = y - kvh * chunks;
    BatonAttnHeads h;
    h.kvh = kvh;
    h.head0 = kvh * group + c * BATON_ATTN_MAX_G;
    h.ng = min(BATON_ATTN_MAX_G, group - c * BATON_ATTN_MAX_G);
    return h;
}
__device__ __forceinline__ BatonAttnHeads baton_attn_heads(int num_heads, int num_kv_heads) {
    return baton_attn_heads_at(blockIdx.y, num_heads, num_kv_heads);
}

// The group's query vectors into shared memory (zeros past h.ng). The block's threads share
// the work; baton_attn_init's barrier publishes them.
template <int D>
__device__ __forceinline__ void baton_attn_load_q(BatonAttnShared<D>& sh, const elem_t* q_tok,
                                                  const BatonAttnHeads& h) {
    for (int i = threadIdx.x; i < BATON_ATTN_MAX_G * D; i += blockDim.x) {
        const int g = i / D, d = i - g * D;
        sh.q[g][d] = g < h.ng ? q_tok[(size_t)(h.head0 + g) * D + d] : baton_from_f(0.0f);
    }
}

// Attend to keys [c0, c1) (c1 - c0 <= BATON_ATTN_PART), updating the running max/sum in shared
// memory and this warp's partial accumulator. Must be called by all threads of the block.
template <int D>
__device__ __forceinline__ void baton_attn_chunk(
    BatonAttnShared<D>& sh, float qscale, float (&acc)[BATON_ATTN_MAX_G][D / 32],
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ block_table, int block_size, int num_kv_heads,
    const BatonAttnHeads& h, int c0, int c1) {
    constexpr int VPL = D / 32;
    constexpr int U = 16 / VPL;  // keys per warp per iteration of step 3 (16 registers)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = c1 - c0;
    const size_t tok_stride = (size_t)num_kv_heads * D;
    const size_t head_off = (size_t)h.kvh * D + lane * VPL;

    // 1. Scores q . k for every key of the chunk and every query head of the group: one key
    //    per lane, 32 keys per warp, the lane's whole key loaded (16-byte vectors, all in flight
    //    at once) and dotted with each head's q from shared memory (a broadcast). No cross-lane
    //    reduction: a warp-wide sum per key and head made this step shuffle-bound.
    for (int j0 = warp * 32; j0 < n; j0 += BATON_ATTN_WARPS * 32) {
        const int j = j0 + lane;
        if (j < n) {
            const int t = c0 + j;
            const int page = block_table[t / block_size];
            const size_t kv_off =
                ((size_t)page * block_size + (t % block_size)) * tok_stride + (size_t)h.kvh * D;
            const elem_t* kp = k_cache + kv_off;
            // Step 3 reads this key's value row: start it towards L2 now, so that its loads
            // there (a dependent round trip per group of keys) do not each wait on DRAM.
#pragma unroll
            for (int b = 0; b < (int)(D * sizeof(elem_t)); b += 128)
                BATON_PREFETCH_L2(reinterpret_cast<const char*>(v_cache + kv_off) + b);
            baton_vec kv[D / BATON_VEC];
#pragma unroll
            for (int v = 0; v < D / BATON_VEC; ++v) kv[v] = reinterpret_cast<const baton_vec*>(kp)[v];
            // One head at a time (a runtime loop: unrolling it over BATON_ATTN_MAX_G heads
            // multiplied the code, the registers and NVRTC's compile time).
#pragma unroll 1
            for (int g = 0; g < h.ng; ++g) {
                const baton_vec* qg = reinterpret_cast<const baton_vec*>(&sh.q[g][0]);
                float d = 0.0f;
#pragma unroll
                for (int v = 0; v < D / BATON_VEC; ++v) {
                    const baton_vec qv = qg[v];
#pragma unroll
                    for (int e = 0; e < BATON_VEC; ++e)
                        d = fmaf(baton_to_f(qv.e[e]), baton_to_f(kv[v].e[e]), d);
                }
                sh.logits[g][j] = d * qscale;
            }
        }
    }
    __syncthreads();

    // 2. Online softmax update per query head.
    baton_attn_softmax<BATON_ATTN_PART>(sh.logits, sh.m, sh.l, sh.alpha, h.ng, n);
    __syncthreads();

    // 3. Rescale and accumulate p * v.
#pragma unroll
    for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
        if (g < h.ng) {
            const float a = sh.alpha[g];
#pragma unroll
            for (int i = 0; i < VPL; ++i) acc[g][i] *= a;
        }
    }
    for (int j0 = warp * U; j0 < n; j0 += BATON_ATTN_WARPS * U) {
        float vf[U][VPL];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            if (j < n) {
                const int t = c0 + j;
                const int page = block_table[t / block_size];
                const size_t off =
                    ((size_t)page * block_size + (t % block_size)) * tok_stride + head_off;
                baton_load_pack<VPL>(v_cache + off, vf[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (j0 + u < n) {
#pragma unroll
                for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
                    if (g < h.ng) {
                        const float p = sh.logits[g][j0 + u];
#pragma unroll
                        for (int i = 0; i < VPL; ++i) acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
                    }
                }
            }
        }
    }
    __syncthreads();  // the next chunk overwrites sh.logits
}

template <int D>
__device__ __forceinline__ void baton_attn_init(BatonAttnShared<D>& sh,
                                                float (&acc)[BATON_ATTN_MAX_G][D / 32]) {
    if (threadIdx.x < BATON_ATTN_MAX_G) {
        sh.m[threadIdx.x] = BATON_NEG_INF;
        sh.l[threadIdx.x] = 0.0f;
    }
#pragma unroll
    for (int g = 0; g < BATON_ATTN_MAX_G; ++g)
#pragma unroll
        for (int i = 0; i < D / 32; ++i) acc[g][i] = 0.0f;
    __syncthreads();
}

// Sum the per-warp accumulators into warp 0's registers.
template <int D>
__device__ __forceinline__ void baton_attn_reduce_warps(BatonAttnShared<D>& sh,
                                                        float (&acc)[BATON_ATTN_MAX_G][D / 32],
                                                        int ng) {
    constexpr int VPL = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp > 0) {
#pragma unroll
        for (int g = 0; g < BATON_ATTN_MAX_G; ++g)
            if (g < ng)
#pragma unroll
                for (int i = 0; i < VPL; ++i) sh.red[warp - 1][g][lane * VPL + i] = acc[g][i];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int g = 0; g < BATON_ATTN_MAX_G; ++g)
            if (g < ng)
#pragma unroll
                for (int i = 0; i < VPL; ++i)
#pragma unroll
                    for (int w = 0; w < BATON_ATTN_WARPS - 1; ++w)
                        acc[g][i] += sh.red[w][g][lane * VPL + i];
    }
}

// Warp 0 writes acc / l (or zeros when l == 0, i.e. an empty context) as elem_t.
template <int D>
__device__ __forceinline__ void baton_attn_store(elem_t* out_tok, const BatonAttnShared<D>& sh,
                                                 const float (&acc)[BATON_ATTN_MAX_G][D / 32],
                                                 const BatonAttnHeads& h) {
    constexpr int VPL = D / 32;
    const int lane = threadIdx.x & 31;
    if ((threadIdx.x >> 5) != 0) return;
#pragma unroll
    for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
        if (g < h.ng) {
            const float l = sh.l[g];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            elem_t* o = out_tok + (size_t)(h.head0 + g) * D + lane * VPL;
#pragma unroll
            for (int i = 0; i < VPL; ++i) o[i] = baton_from_f(acc[g][i] * inv);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode: one query token per sequence, with RoPE and the KV-cache write of that token fused in
// (the executor launches no baton_rope_and_cache for a decode step on these head dims), split-K
// over up to max_partitions partitions per sequence (sized by baton_decode_part_size), the
// partitions combined in the same launch by the block that finishes last. The host picks
// `fill` from the batch so that small batches still fill the GPU (a batch of one sequence and
// 8 kv heads would otherwise be 8 thread blocks) and large ones split only long sequences.
//
// Latency, not bandwidth, bounds this kernel at small batches: a partition is a few tens of
// KB. So a block walks its partition in tiles of TK keys (16 KB of K and 16 KB of V), and for
// each tile issues every block-table read, then every K and V copy into shared memory at once
// (cp.async), before any arithmetic. The first tile is issued before BATON_PDL_WAIT: its keys
// were written by earlier steps and the sequence length and block table by the step's upload
// (see common.cuh), so those three dependent round trips overlap the QKV projection.
//
// The step's token sits at position seq_len - 1. Its q heads (every block of its group) and
// its k (the blocks whose partition holds that position) are rotated as baton_rope_and_cache
// does (rope.cu: same formula, fp32, rounded to elem_t); the rotated k and the v go into the
// last tile from registers (never read back from the cache, which the same launch writes) and,
// by the head-chunk-0 block, to the cache slot slot_mapping[seq] (skipped when < 0).
//
// Per tile: scores (thread x scores key x % TK for query heads hs, hs + HS, ... of the group,
// hs = x / TK, HS = 128 / TK), an online-softmax update per head (one warp per head), then
// p . v with lane l owning head dims [l * D/32, (l+1) * D/32) and warp w taking U consecutive
// keys per iteration, 4 U apart (U = 16 / (D / 32)). Numerics as above: fp32 dots in dimension
// order, exp2f, fp32 accumulation; the reductions over the 4 warps and over partitions are fp32.
//
// Split-K combine: every block of a split sequence writes its unnormalized partial (acc, m, l)
// to part_acc / part_m / part_l, fences, and counts itself in counters[seq, blockIdx.y]; the
// block that brings the count to the sequence's partition count reads every partial (L2, past
// L1) and writes out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p, then resets the
// counter to 0 for the next launch (the pattern of the CUDA samples' threadFenceReduction).
//
// Shapes: out [num_seqs, num_heads, D] elem_t; qkv [num_seqs, (num_heads + 2 num_kv_heads) D]
// elem_t, the QKV projection before RoPE (q heads, k heads, v heads) with row stride
// `qkv_stride` elements; k_cache / v_cache as above; block_tables [num_seqs,
// max_blocks_per_row] int; seq_lens [num_seqs] int = context length including the current
// token (0 for a padding row: its output is zeros, nothing is written to the cache);
// slot_mapping [num_seqs] int; inv_freq [D / 2] f32 (rope.cu). Partials: part_acc [num_seqs,
// num_heads, max_partitions, D] f32 (unnormalized), part_m / part_l [num_seqs, num_heads,
// max_partitions] f32 (log2-domain max, sum); counters [num_seqs, gridDim.y] int, all 0 before
// the launch and left 0 after it. max_partitions >= 1 (the partials' stride and grid.z);
// fill, min_part, long_part: partition sizing, see baton_decode_part_size (the host's
// plan::decode_fill, plan::Tuning::attn_min_partition and plan::ATTN_LONG_PARTITION), over the
// keys a sequence attends to: all of them, or its last `window` under a sliding window
// (window > 0, baton_window_start), partitioned from the first.
// Launch: grid = (num_seqs, num_kv_heads * ceil(group / 8), max_partitions), block = (128).
template <int D>
struct BatonDecodeTile {
    // Keys per tile: 16 KB of K (and of V) per tile, at most 128 keys.
    static constexpr int TK_RAW = 16384 / (D * (int)sizeof(elem_t));
    static constexpr int TK = TK_RAW > 128 ? 128 : TK_RAW;
    // Padded row in 16-byte vectors: one vector more than a row, so that the 8 lanes of a
    // quarter warp reading the same column of 8 consecutive rows hit 8 different bank groups.
    static constexpr int VR = D / BATON_VEC;  // vectors per row
    static constexpr int SVR = VR + 1;        // vectors per padded row
    static constexpr int HS = BATON_ATTN_WARPS * 32 / TK;  // head sets of the scores step
    static constexpr int GPT = (BATON_ATTN_MAX_G + HS - 1) / HS;  // heads per scoring thread
    static_assert(TK * VR == 1024, "a tile is 1024 vectors of K (and of V): 8 per thread");
};

template <int D>
struct BatonDecodeShared {
    typedef BatonDecodeTile<D> T;
    alignas(16) float q[BATON_ATTN_MAX_G][D];  // the group's query vectors (unscaled, fp32)
    union {
        struct {
            uint4 k[T::TK][T::SVR];  // the tile's keys (elem_t, as raw 16-byte vectors)
            uint4 v[T::TK][T::SVR];  // and values
        } kv;
        float red[BATON_ATTN_WARPS - 1][BATON_ATTN_MAX_G][D];  // after the last tile
        float w[BATON_ATTN_MAX_G][64];  // combine: weights of the first 64 partitions
    };
    float p[BATON_ATTN_MAX_G][T::TK];  // scores, then exp2(score - m), of a tile
    float m[BATON_ATTN_MAX_G];         // running max (log2 domain), then the combined max
    float l[BATON_ATTN_MAX_G];         // running sum, then 1 / the combined sum
    float alpha[BATON_ATTN_MAX_G];     // rescale factor of the last tile
    int last;                          // this block combines the partitions
};

// Issue the copies of keys [c0, c0 + n) (n <= TK) of kv head `kvh` into the tile, except key
// `skip` (the step's own token, which the kernel writes from registers): K as one cp.async
// group, then V as a second, so that the scores can start when K has landed.
template <int D>
__device__ __forceinline__ void baton_decode_load_tile(BatonDecodeShared<D>& sh,
                                                       const elem_t* __restrict__ k_cache,
                                                       const elem_t* __restrict__ v_cache,
                                                       const int* __restrict__ bt,
                                                       int block_size, size_t tok_stride,
                                                       int kvh, int c0, int n, int skip) {
    typedef BatonDecodeTile<D> T;
    constexpr int PER = T::TK * T::VR / (BATON_ATTN_WARPS * 32);  // vectors per thread
    size_t off[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int x = threadIdx.x + i * BATON_ATTN_WARPS * 32;
        const int j = x / T::VR, c = x - j * T::VR;
        const int t = c0 + min(j, n - 1);
        off[i] = ((size_t)bt[t / block_size] * block_size + (t % block_size)) * tok_stride +
                 (size_t)kvh * D + (size_t)c * BATON_VEC;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int x = threadIdx.x + i * BATON_ATTN_WARPS * 32;
        const int j = x / T::VR, c = x - j * T::VR;
        if (j < n && c0 + j != skip) BATON_CP_ASYNC16(&sh.kv.k[j][c], k_cache + off[i]);
    }
    BATON_CP_ASYNC_COMMIT();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int x = threadIdx.x + i * BATON_ATTN_WARPS * 32;
        const int j = x / T::VR, c = x - j * T::VR;
        if (j < n && c0 + j != skip) BATON_CP_ASYNC16(&sh.kv.v[j][c], v_cache + off[i]);
    }
    BATON_CP_ASYNC_COMMIT();
}

// Attend to the n keys of the tile just issued: scores, online softmax, p . v into acc.
// Called by all threads of the block.
template <int D>
__device__ __forceinline__ void baton_decode_tile(BatonDecodeShared<D>& sh, float qscale,
                                                  float (&acc)[BATON_ATTN_MAX_G][D / 32],
                                                  int ng, int n) {
    typedef BatonDecodeTile<D> T;
    constexpr int VPL = D / 32;
    constexpr int U = 16 / VPL;  // keys per warp per iteration of the p . v step
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    BATON_CP_ASYNC_WAIT(1);  // this thread's K copies
    __syncthreads();         // everyone's

    // 1. Scores.
    {
        const int j = threadIdx.x % T::TK, hs = threadIdx.x / T::TK;
        if (j < n) {
            float dot[T::GPT];
#pragma unroll
            for (int gi = 0; gi < T::GPT; ++gi) dot[gi] = 0.0f;
            const baton_vec* kr = reinterpret_cast<const baton_vec*>(&sh.kv.k[j][0]);
#pragma unroll
            for (int c = 0; c < T::VR; ++c) {
                const baton_vec kv = kr[c];
                float kf[BATON_VEC];
#pragma unroll
                for (int e = 0; e < BATON_VEC; ++e) kf[e] = baton_to_f(kv.e[e]);
#pragma unroll
                for (int gi = 0; gi < T::GPT; ++gi) {
                    const int g = hs + gi * T::HS;
                    if (g < ng) {
                        const float* qg = &sh.q[g][c * BATON_VEC];
#pragma unroll
                        for (int e = 0; e < BATON_VEC; ++e) dot[gi] = fmaf(qg[e], kf[e], dot[gi]);
                    }
                }
            }
#pragma unroll
            for (int gi = 0; gi < T::GPT; ++gi) {
                const int g = hs + gi * T::HS;
                if (g < ng) sh.p[g][j] = dot[gi] * qscale;
            }
        }
    }
    __syncthreads();

    // 2. Online softmax update per query head.
    baton_attn_softmax<T::TK>(sh.p, sh.m, sh.l, sh.alpha, ng, n);
    BATON_CP_ASYNC_WAIT(0);  // this thread's V copies
    __syncthreads();

    // 3. Rescale and accumulate p * v.
#pragma unroll
    for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
        if (g < ng) {
            const float a = sh.alpha[g];
#pragma unroll
            for (int i = 0; i < VPL; ++i) acc[g][i] *= a;
        }
    }
    for (int j0 = warp * U; j0 < n; j0 += BATON_ATTN_WARPS * U) {
        float vf[U][VPL];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (j0 + u < n) {
                const elem_t* vr = reinterpret_cast<const elem_t*>(&sh.kv.v[j0 + u][0]);
                baton_load_pack<VPL>(vr + lane * VPL, vf[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (j0 + u < n) {
#pragma unroll
                for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
                    if (g < ng) {
                        const float p = sh.p[g][j0 + u];
#pragma unroll
                        for (int i = 0; i < VPL; ++i) acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
                    }
                }
            }
        }
    }
    __syncthreads();  // the next tile overwrites sh.kv and sh.p
}

// One block's work: sequence `seq`, grid row `gy` of `ny` (kv head and query-head chunk) and
// partition `part`, with shared state `sh` (the entry point's, or the persistent kernel's). An
// entry point passes its block coordinates; GRID: the persistent decode kernel below passes a
// work item and waits at the grid barrier `bar` (when not null) where an entry point waits for
// its predecessor, on every path.
template <int D, bool GRID>
__device__ __forceinline__ void baton_decode_body(
    elem_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_m,
    float* __restrict__ part_l, int* __restrict__ counters, const elem_t* __restrict__ qkv,
    int qkv_stride, elem_t* __restrict__ k_cache, elem_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks_per_row, const int* __restrict__ seq_lens,
    const int* __restrict__ slot_mapping, const float* __restrict__ inv_freq, int num_heads,
    int num_kv_heads, int block_size, float scale, int max_partitions, int fill, int min_part,
    int long_part, int window, BatonDecodeShared<D>& sh, int seq, int gy, int part, int ny,
    unsigned* bar) {
    typedef BatonDecodeTile<D> T;
    constexpr int VPL = D / 32;
    constexpr int HALF = D / 2;
    constexpr int NT = BATON_ATTN_WARPS * 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const BatonAttnHeads h = baton_attn_heads_at(gy, num_heads, num_kv_heads);
    // Before BATON_PDL_WAIT: the step's staging inputs and the cache entries of earlier steps
    // only (common.cuh: both were written at least two kernels back). Every key but the step's
    // own token `cur` is such an entry, so the first tile's copies go out now, overlapping the
    // QKV projection that precedes this kernel.
    // Keys [lo, ctx): the last `window` ones under a sliding window (window > 0), split into
    // partitions of psize keys from lo.
    const int ctx = seq_lens[seq];
    const int lo = baton_window_start(ctx, window);
    const int span = ctx - lo;
    const int psize = baton_decode_part_size(span, max_partitions, fill, min_part, long_part);
    const int num_parts = (span + psize - 1) / psize;
    if (part >= max(num_parts, 1)) {
        if (GRID && bar != nullptr) BATON_GRID_SYNC(bar);
        return;
    }
    const int c0 = lo + part * psize, c1 = min(ctx, c0 + psize);
    const int cur = ctx - 1;  // the step's token: position ctx - 1, K and V from qkv
    const bool has_cur = c0 <= cur && cur < c1;
    const int* bt = block_tables + (size_t)seq * max_blocks_per_row;
    const size_t tok_stride = (size_t)num_kv_heads * D;
    if (c0 < c1)
        baton_decode_load_tile<D>(sh, k_cache, v_cache, bt, block_size, tok_stride, h.kvh, c0,
                                  min(c1 - c0, T::TK), cur);
    if (GRID) {
        if (bar != nullptr) BATON_GRID_SYNC(bar);
    } else {
        BATON_PDL_WAIT();
        BATON_PDL_LAUNCH();
    }
    // RoPE (rope.cu's formula and roundings) of the group's query heads into sh.q, and of this
    // kv head's key if the block holds the step's token; that key and its value are kept in
    // registers until their tile, and written to the cache slot by the head chunk 0 block.
    const elem_t* q_tok = qkv + (size_t)seq * qkv_stride;
    const float pos = (float)cur;
    for (int x = threadIdx.x; x < BATON_ATTN_MAX_G * HALF; x += NT) {
        const int g = x / HALF, i = x - g * HALF;
        float r1 = 0.0f, r2 = 0.0f;
        if (g < h.ng) {
            const elem_t* qh = q_tok + (size_t)(h.head0 + g) * D;
            float sn, cs;
            sincosf(pos * inv_freq[i], &sn, &cs);
            const float x1 = baton_to_f(baton_ld_act<GRID>(qh + i));
            const float x2 = baton_to_f(baton_ld_act<GRID>(qh + i + HALF));
            r1 = baton_round(x1 * cs - x2 * sn);
            r2 = baton_round(x2 * cs + x1 * sn);
        }
        sh.q[g][i] = r1;
        sh.q[g][i + HALF] = r2;
    }
    constexpr int KPT = (HALF + NT - 1) / NT, VPT = (D + NT - 1) / NT;  // per thread
    elem_t k_new[KPT][2], v_new[VPT];
    if (has_cur) {
        const elem_t* kh = q_tok + (size_t)(num_heads + h.kvh) * D;
        const elem_t* vh = q_tok + (size_t)(num_heads + num_kv_heads + h.kvh) * D;
        const int slot = slot_mapping[seq];
        const bool write = slot >= 0 && h.head0 == h.kvh * (num_heads / num_kv_heads);
        const size_t dst = (size_t)(write ? slot : 0) * tok_stride + (size_t)h.kvh * D;
        elem_t* kd = k_cache + dst;  // dereferenced only when `write`
        elem_t* vd = v_cache + dst;
#pragma unroll
        for (int u = 0; u < KPT; ++u) {
            const int i = threadIdx.x + u * NT;
            if (i < HALF) {
                float sn, cs;
                sincosf(pos * inv_freq[i], &sn, &cs);
                const float x1 = baton_to_f(baton_ld_act<GRID>(kh + i));
                const float x2 = baton_to_f(baton_ld_act<GRID>(kh + i + HALF));
                k_new[u][0] = baton_from_f(x1 * cs - x2 * sn);
                k_new[u][1] = baton_from_f(x2 * cs + x1 * sn);
                if (write) {
                    kd[i] = k_new[u][0];
                    kd[i + HALF] = k_new[u][1];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < VPT; ++u) {
            const int i = threadIdx.x + u * NT;
            if (i < D) {
                v_new[u] = baton_ld_act<GRID>(vh + i);
                if (write) vd[i] = v_new[u];
            }
        }
    }
    if (threadIdx.x < BATON_ATTN_MAX_G) {
        sh.m[threadIdx.x] = BATON_NEG_INF;
        sh.l[threadIdx.x] = 0.0f;
    }
    float acc[BATON_ATTN_MAX_G][VPL];
#pragma unroll
    for (int g = 0; g < BATON_ATTN_MAX_G; ++g)
#pragma unroll
        for (int i = 0; i < VPL; ++i) acc[g][i] = 0.0f;
    // (baton_decode_tile's first barrier publishes q, m, l and the step's key and value.)
    const float qscale = scale * BATON_LOG2E;
    for (int s0 = c0; s0 < c1; s0 += T::TK) {
        const int n = min(c1 - s0, T::TK);
        if (s0 != c0)
            baton_decode_load_tile<D>(sh, k_cache, v_cache, bt, block_size, tok_stride, h.kvh,
                                      s0, n, cur);
        if (has_cur && cur < s0 + n) {  // the last tile: the step's key and value
            elem_t* kr = reinterpret_cast<elem_t*>(&sh.kv.k[cur - s0][0]);
            elem_t* vr = reinterpret_cast<elem_t*>(&sh.kv.v[cur - s0][0]);
#pragma unroll
            for (int u = 0; u < KPT; ++u) {
                const int i = threadIdx.x + u * NT;
                if (i < HALF) {
                    kr[i] = k_new[u][0];
                    kr[i + HALF] = k_new[u][1];
                }
            }
#pragma unroll
            for (int u = 0; u < VPT; ++u) {
                const int i = threadIdx.x + u * NT;
                if (i < D) vr[i] = v_new[u];
            }
        }
        baton_decode_tile<D>(sh, qscale, acc, h.ng, n);
    }
    __syncthreads();  // an empty partition skipped the tiles' barriers: publish m and l
    // Sum the per-warp accumulators into warp 0's registers (sh.red overlays the tiles).
    if (warp > 0) {
#pragma unroll
        for (int g = 0; g < BATON_ATTN_MAX_G; ++g)
            if (g < h.ng)
#pragma unroll
                for (int i = 0; i < VPL; ++i) sh.red[warp - 1][g][lane * VPL + i] = acc[g][i];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int g = 0; g < BATON_ATTN_MAX_G; ++g)
            if (g < h.ng)
#pragma unroll
                for (int i = 0; i < VPL; ++i)
#pragma unroll
                    for (int w = 0; w < BATON_ATTN_WARPS - 1; ++w)
                        acc[g][i] += sh.red[w][g][lane * VPL + i];
    }
    if (num_parts <= 1) {
        if (warp == 0) {
#pragma unroll
            for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
                if (g < h.ng) {
                    const float l = sh.l[g];
                    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                    elem_t* o = out + ((size_t)seq * num_heads + h.head0 + g) * D + lane * VPL;
#pragma unroll
                    for (int i = 0; i < VPL; ++i) o[i] = baton_from_f(acc[g][i] * inv);
                }
            }
        }
        return;
    }
    // Split: publish this partition's partial, then count it.
    const size_t ph0 = ((size_t)seq * num_heads + h.head0) * max_partitions;
    if (warp == 0) {
#pragma unroll
        for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
            if (g < h.ng) {
                const size_t ph = ph0 + (size_t)g * max_partitions + part;
                if (lane == 0) {
                    part_m[ph] = sh.m[g];
                    part_l[ph] = sh.l[g];
                }
#pragma unroll
                for (int i = 0; i < VPL; ++i) part_acc[ph * D + lane * VPL + i] = acc[g][i];
            }
        }
        __threadfence();  // the partial is visible device-wide before the count
    }
    __syncthreads();
    int* counter = counters + (size_t)seq * ny + gy;
    if (threadIdx.x == 0) sh.last = atomicAdd(counter, 1) == num_parts - 1;
    __syncthreads();
    if (!sh.last) return;
    __threadfence();  // every other partition's partial is visible to this block's reads
    // Combined max, 1 / sum and each partition's weight 2^(m_p - M) per head: one warp per
    // head, one partition per lane (the first 64 partitions' weights kept in sh.w). Every load
    // of a round is issued before any is used: the partials come from L2.
    for (int g = warp; g < h.ng; g += BATON_ATTN_WARPS) {
        const float* pm = part_m + ph0 + (size_t)g * max_partitions;
        const float* pl = part_l + ph0 + (size_t)g * max_partitions;
        const bool in0 = lane < num_parts, in1 = lane + 32 < num_parts;
        const float m0 = in0 ? __ldcg(pm + lane) : BATON_NEG_INF;
        const float m1 = in1 ? __ldcg(pm + lane + 32) : BATON_NEG_INF;
        const float l0 = in0 ? __ldcg(pl + lane) : 0.0f;
        const float l1 = in1 ? __ldcg(pl + lane + 32) : 0.0f;
        float m = fmaxf(m0, m1);
        for (int p = lane + 64; p < num_parts; p += 32) m = fmaxf(m, __ldcg(pm + p));
        m = baton_warp_max(m);  // finite: every partition of a split sequence has keys
        const float w0 = exp2f(m0 - m), w1 = exp2f(m1 - m);  // 0 for absent partitions
        float l = l0 * w0 + l1 * w1;
        for (int p = lane + 64; p < num_parts; p += 32)
            l += __ldcg(pl + p) * exp2f(__ldcg(pm + p) - m);
        l = baton_warp_sum(l);
        sh.w[g][lane] = w0;
        sh.w[g][lane + 32] = w1;
        if (lane == 0) {
            sh.m[g] = m;
            sh.l[g] = l > 0.0f ? 1.0f / l : 0.0f;
        }
    }
    __syncthreads();
    // out = sum_p w_p acc_p / l, four head dims per thread (float4 loads of the partials).
    for (int x = threadIdx.x; x < h.ng * (D / 4); x += NT) {
        const int g = x / (D / 4), d = (x - g * (D / 4)) * 4;
        const size_t b = ph0 + (size_t)g * max_partitions;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int p = 0; p < num_parts; ++p) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(part_acc + (b + p) * D + d));
            const float w = p < 2 * 32 ? sh.w[g][p] : exp2f(__ldcg(part_m + b + p) - sh.m[g]);
            a[0] = fmaf(v.x, w, a[0]);
            a[1] = fmaf(v.y, w, a[1]);
            a[2] = fmaf(v.z, w, a[2]);
            a[3] = fmaf(v.w, w, a[3]);
        }
        elem_t* o = out + ((size_t)seq * num_heads + h.head0 + g) * D + d;
        const float inv = sh.l[g];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = baton_from_f(a[i] * inv);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
}

#define BATON_DECODE_ENTRY(D)                                                                  \
    BATON_ENTRY void __launch_bounds__(128) baton_paged_attention_decode_hd##D(                \
        elem_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_m,      \
        float* __restrict__ part_l, int* __restrict__ counters, const elem_t* __restrict__ qkv, \
        int qkv_stride, elem_t* __restrict__ k_cache, elem_t* __restrict__ v_cache,            \
        const int* __restrict__ block_tables, int max_blocks_per_row,                           \
        const int* __restrict__ seq_lens, const int* __restrict__ slot_mapping,                 \
        const float* __restrict__ inv_freq, int num_heads, int num_kv_heads, int block_size,   \
        float scale, int max_partitions, int fill, int min_part, int long_part, int window) {  \
        BATON_TRACE_SCOPE();                                                                   \
        __shared__ BatonDecodeShared<D> sh;                                                    \
        baton_decode_body<D, false>(out, part_acc, part_m, part_l, counters, qkv, qkv_stride,  \
                                    k_cache, v_cache, block_tables, max_blocks_per_row,        \
                                    seq_lens, slot_mapping, inv_freq, num_heads, num_kv_heads, \
                                    block_size, scale, max_partitions, fill, min_part,         \
                                    long_part, window, sh, blockIdx.x, blockIdx.y, blockIdx.z, \
                                    gridDim.y, nullptr);                                       \
    }
BATON_DECODE_ENTRY(64)
BATON_DECODE_ENTRY(128)
BATON_DECODE_ENTRY(256)

// ---------------------------------------------------------------------------------------------
// Persistent decode: every decoder layer of a batch-of-one decode step in one cooperative launch
// (the host's `persistent_decode` option, Llama-style layers without q/k/v biases or q/k norms,
// head dims 64 and 128). The per-kernel fused path launches five kernels per layer (the QKV,
// O, gate_up and down GEMVs and decode attention); on the H200 each launch boundary cost about
// 5 us beyond its work (bench/RESULTS.md, sessions 8-9), most of the gap to the HBM floor at
// batch 1. Here the boundaries are grid barriers (BATON_GRID_SYNC) inside one kernel, and each
// phase still issues its first weight loads (and decode attention its first K/V tile) before
// its barrier, as the entry points do before BATON_PDL_WAIT.
//
// Per layer l, with the layer's pointers L = layers[8 l ..] = {qkv, o, gate_up, down, input
// norm, post-attention norm, k cache, v cache}:
//   qkv  = gemv(resid, W_qkv, norm input)       mode 0   (gemv.cuh, baton_gemv1_body)
//   attn = decode attention (RoPE, cache write, split-K combine), work items (gy, part) over
//          the blocks, as baton_paged_attention_decode_hdD's grid (1, ny, max_partitions)
//   resid += gemv(attn, W_o)                    mode 2
//   act  = silu(gemv(resid, W_gate)) * gemv(resid, W_up), norm post   mode 3
//   resid += gemv(act, W_down)                  mode 2
// so each value is computed exactly as the per-kernel fused path computes it (same bodies,
// same roundings; a GEMV row does not depend on the grid): the results are bit-identical.
// A GEMV phase gives block b rows [b r, b r + r), r = ceil(N / gridDim.x); the activation row
// is staged in the attention tile's shared memory (sh.kv), so a row longer than that (K elements)
// takes the generic batch-of-one rows instead.
//
// Shapes: layers [num_layers, 8] u64 (device pointers); resid [hidden], qkv [(num_heads + 2
// num_kv_heads) D], attn [num_heads D], act [inter] elem_t; the attention arguments as in
// baton_paged_attention_decode_hdD for one sequence (row 0 of block_tables, seq_lens,
// slot_mapping; partials and counters for one row); bar: the grid barrier's two words (zero
// before the first launch; the count is left zero, the generation keeps counting).
// Launch: cooperative, grid = (G), G <= resident blocks (at most 3 per SM), block = (128): half
// the GEMV entry points' 256 threads, which baton_gemv1_body's GRID norm statistic relies on.
#define BATON_LAYER_PTRS 8
// Each phase is a call, not inlined: ptxas then allocates registers per phase (168 at
// __launch_bounds__(128, 3), a few bytes spilled around the calls); inlined, the layer loop
// held every phase's values at once and spilled kilobytes per thread.
template <bool SILU>
__device__ __noinline__ void baton_layers_gemv(void* out, const elem_t* x, const elem_t* w,
                                                  const elem_t* norm_w, int N, int K, float eps,
                                                  int mode, baton_vec* xs, int xs_cap,
                                                  unsigned* bar) {
    const int rows = (N + (int)gridDim.x - 1) / (int)gridDim.x;
    if (baton_gemv1_fits(x, w, norm_w, K, xs_cap)) {
        baton_gemv1_body<SILU, BATON_GEMV_T1_U, true>(
            out, x, w, norm_w, N, K, eps, mode, rows, xs, bar);
    } else {
        BATON_GRID_SYNC(bar);  // the host never launches a shape that does not fit
    }
}

// The attention phase of layer (k_cache, v_cache): this block's work items, then the barrier
// if it had none.
template <int D>
__device__ __noinline__ void baton_layers_attention(
    BatonDecodeShared<D>& sh, elem_t* attn, float* part_acc, float* part_m, float* part_l,
    int* counters, const elem_t* qkv, int qkv_w, elem_t* k_cache, elem_t* v_cache,
    const int* block_tables, int max_blocks_per_row, const int* seq_lens, const int* slot_mapping,
    const float* inv_freq, int num_heads, int num_kv_heads, int block_size, float scale,
    int max_partitions, int fill, int min_part, int long_part, int ny, unsigned* bar) {
    const int items = ny * max_partitions;
    __syncthreads();  // every warp is done with xs (sh.kv) before the tile copies into it
    unsigned* wait = bar;  // the phase's barrier, passed to this block's first item only
    for (int i = blockIdx.x; i < items; i += gridDim.x) {
        baton_decode_body<D, true>(attn, part_acc, part_m, part_l, counters, qkv, qkv_w, k_cache,
                                   v_cache, block_tables, max_blocks_per_row, seq_lens,
                                   slot_mapping, inv_freq, num_heads, num_kv_heads, block_size,
                                   scale, max_partitions, fill, min_part, long_part, 0, sh, 0,
                                   i % ny, i / ny, ny, wait);
        wait = nullptr;
        __syncthreads();  // the next item's copies overwrite sh
    }
    if (wait != nullptr) BATON_GRID_SYNC(bar);
}

template <int D>
__device__ __forceinline__ void baton_decode_layers_body(
    const unsigned long long* __restrict__ layers, int num_layers, elem_t* resid, elem_t* qkv,
    elem_t* attn, elem_t* act, float* __restrict__ part_acc, float* __restrict__ part_m,
    float* __restrict__ part_l, int* __restrict__ counters, const int* __restrict__ block_tables,
    int max_blocks_per_row, const int* __restrict__ seq_lens, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, int hidden, int num_heads, int num_kv_heads, int inter,
    int block_size, float scale, float eps, int max_partitions, int fill, int min_part,
    int long_part, unsigned* bar) {
    __shared__ BatonDecodeShared<D> sh;
    baton_vec* xs = reinterpret_cast<baton_vec*>(&sh.kv);
    const int xs_cap = (int)(sizeof(sh.kv) / sizeof(elem_t));
    const int qkv_w = (num_heads + 2 * num_kv_heads) * D;
    const int group = num_heads / num_kv_heads;
    const int ny = num_kv_heads * ((group + BATON_ATTN_MAX_G - 1) / BATON_ATTN_MAX_G);
    for (int l = 0; l < num_layers; ++l) {
        const unsigned long long* L = layers + (size_t)l * BATON_LAYER_PTRS;
        const elem_t* w_qkv = reinterpret_cast<const elem_t*>(L[0]);
        const elem_t* w_o = reinterpret_cast<const elem_t*>(L[1]);
        const elem_t* w_gate_up = reinterpret_cast<const elem_t*>(L[2]);
        const elem_t* w_down = reinterpret_cast<const elem_t*>(L[3]);
        const elem_t* input_norm = reinterpret_cast<const elem_t*>(L[4]);
        const elem_t* post_norm = reinterpret_cast<const elem_t*>(L[5]);
        elem_t* k_cache = reinterpret_cast<elem_t*>(L[6]);
        elem_t* v_cache = reinterpret_cast<elem_t*>(L[7]);
        baton_layers_gemv<false>(qkv, resid, w_qkv, input_norm, qkv_w, hidden, eps, 0, xs,
                                 xs_cap, bar);
        baton_layers_attention<D>(sh, attn, part_acc, part_m, part_l, counters, qkv, qkv_w,
                                  k_cache, v_cache, block_tables, max_blocks_per_row, seq_lens,
                                  slot_mapping, inv_freq, num_heads, num_kv_heads, block_size,
                                  scale, max_partitions, fill, min_part, long_part, ny, bar);
        baton_layers_gemv<false>(resid, attn, w_o, nullptr, hidden, num_heads * D, eps, 2, xs,
                                 xs_cap, bar);
        baton_layers_gemv<true>(act, resid, w_gate_up, post_norm, inter, hidden, eps, 3, xs,
                                xs_cap, bar);
        baton_layers_gemv<false>(resid, act, w_down, nullptr, hidden, inter, eps, 2, xs, xs_cap,
                                 bar);
    }
}

#define BATON_DECODE_LAYERS_ENTRY(D)                                                           \
    BATON_ENTRY void __launch_bounds__(128, 3) baton_decode_layers_hd##D(                      \
        const unsigned long long* __restrict__ layers, int num_layers, elem_t* resid,           \
        elem_t* qkv, elem_t* attn, elem_t* act, float* __restrict__ part_acc,                   \
        float* __restrict__ part_m, float* __restrict__ part_l, int* __restrict__ counters,     \
        const int* __restrict__ block_tables, int max_blocks_per_row,                           \
        const int* __restrict__ seq_lens, const int* __restrict__ slot_mapping,                 \
        const float* __restrict__ inv_freq, int hidden, int num_heads, int num_kv_heads,        \
        int inter, int block_size, float scale, float eps, int max_partitions, int fill,        \
        int min_part, int long_part, unsigned* bar) {                                          \
        BATON_TRACE_SCOPE();                                                                   \
        BATON_PDL_WAIT();                                                                      \
        baton_decode_layers_body<D>(layers, num_layers, resid, qkv, attn, act, part_acc,       \
                                    part_m, part_l, counters, block_tables,                    \
                                    max_blocks_per_row, seq_lens, slot_mapping, inv_freq,      \
                                    hidden, num_heads, num_kv_heads, inter, block_size, scale, \
                                    eps, max_partitions, fill, min_part, long_part, bar);      \
    }
BATON_DECODE_LAYERS_ENTRY(64)
BATON_DECODE_LAYERS_ENTRY(128)

// ---------------------------------------------------------------------------------------------
// Prefill (and mixed prefill/decode): causal attention for variable-length rows.
//
// Query token i of row r (cu_seqlens[r] <= i < cu_seqlens[r + 1]) sits at position
// p = start_pos[r] + (i - cu_seqlens[r]) and attends to keys 0..=p of its row, read from the
// cache through block_tables[r] (keys p + 1 - window..=p under a sliding window, window > 0).
// Rows may be decodes (one token) or prefill chunks continuing an already-cached prefix.
// Shapes: out [num_tokens, num_heads, D] elem_t; q [num_tokens, num_heads, D] elem_t with token
// stride `q_stride`; cu_seqlens [num_rows + 1] int (cu_seqlens[0] = 0); start_pos [num_rows]
// int; block_tables [num_rows, max_blocks_per_row] int. Tokens >= cu_seqlens[num_rows] (graph
// padding) are skipped.
// Launch: grid = (num_tokens, num_kv_heads * ceil(group / 8)), block = (128). The whole
// context of a token is walked by one block in chunks of BATON_ATTN_PART (no split-K).
// Scalar fp32 FMA (no tensor cores): correct first version, not the fast path.
template <int D>
__device__ __forceinline__ void baton_prefill_body(
    elem_t* __restrict__ out, const elem_t* __restrict__ q, int q_stride,
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ cu_seqlens, const int* __restrict__ start_pos, int num_rows,
    const int* __restrict__ block_tables, int max_blocks_per_row, int num_heads,
    int num_kv_heads, int block_size, float scale, int window) {
    __shared__ BatonAttnShared<D> sh;
    const int tok = blockIdx.x;
    if (tok >= cu_seqlens[num_rows]) return;
    // Row of this token: the last r with cu_seqlens[r] <= tok.
    int lo = 0, hi = num_rows - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_seqlens[mid] <= tok) lo = mid; else hi = mid - 1;
    }
    const int row = lo;
    const int ctx = start_pos[row] + (tok - cu_seqlens[row]) + 1;
    const BatonAttnHeads h = baton_attn_heads(num_heads, num_kv_heads);
    float acc[BATON_ATTN_MAX_G][D / 32];
    baton_attn_load_q<D>(sh, q + (size_t)tok * q_stride, h);
    baton_attn_init<D>(sh, acc);
    const float qscale = scale * BATON_LOG2E;
    const int* bt = block_tables + (size_t)row * max_blocks_per_row;
    for (int c0 = baton_window_start(ctx, window); c0 < ctx; c0 += BATON_ATTN_PART)
        baton_attn_chunk<D>(sh, qscale, acc, k_cache, v_cache, bt, block_size, num_kv_heads, h, c0,
                            min(ctx, c0 + BATON_ATTN_PART));
    baton_attn_reduce_warps<D>(sh, acc, h.ng);
    baton_attn_store<D>(out + (size_t)tok * num_heads * D, sh, acc, h);
}

#define BATON_PREFILL_ENTRY(D)                                                                  \
    BATON_ENTRY void __launch_bounds__(128) baton_paged_attention_prefill_hd##D(           \
        elem_t* __restrict__ out, const elem_t* __restrict__ q, int q_stride,                        \
        const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,                      \
        const int* __restrict__ cu_seqlens, const int* __restrict__ start_pos, int num_rows,     \
        const int* __restrict__ block_tables, int max_blocks_per_row, int num_heads,            \
        int num_kv_heads, int block_size, float scale, int window) {                             \
        BATON_TRACE_SCOPE();                                                                     \
        BATON_PDL_WAIT();                                                                   \
        BATON_PDL_LAUNCH();                                                                 \
        baton_prefill_body<D>(out, q, q_stride, k_cache, v_cache, cu_seqlens, start_pos,         \
                              num_rows, block_tables, max_blocks_per_row, num_heads,             \
                              num_kv_heads, block_size, scale, window);                          \
    }
BATON_PREFILL_ENTRY(64)
BATON_PREFILL_ENTRY(128)
BATON_PREFILL_ENTRY(256)

// ---------------------------------------------------------------------------------------------
// Generic paged attention for any head_dim <= 1024 (e.g. 8 for stories260K), decode and
// varlen prefill alike: the inputs of the prefill kernel above (a decode row is a row of one
// token). One block per (token, query head), 128 threads. Per chunk of BATON_ATTN_PART keys:
// thread j scores key j (fp32 dot over head_dim in ascending order, times `scale`), the block
// takes the chunk max and the sum of expf(score - max) (online softmax across chunks, natural
// exp as the CPU reference), then thread d accumulates sum_j p_j v_j[d] in key order.
// Slower than the fast paths; it is the path the f32 golden check runs (head_dim 8).
// Shapes: out [num_tokens, num_heads, head_dim] elem_t; q [num_tokens, num_heads, head_dim]
// elem_t with token stride q_stride; the rest, and `window`, as for the prefill kernel.
// Launch: grid = (num_tokens, num_heads), block = (128).
#define BATON_GEN_THREADS 128
#define BATON_GEN_MAX_D 1024
BATON_ENTRY void __launch_bounds__(BATON_GEN_THREADS) baton_paged_attention_generic(
    elem_t* __restrict__ out, const elem_t* __restrict__ q, int q_stride,
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ cu_seqlens, const int* __restrict__ start_pos, int num_rows,
    const int* __restrict__ block_tables, int max_blocks_per_row, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale, int window) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    __shared__ float p[BATON_ATTN_PART];
    __shared__ float qs[BATON_GEN_MAX_D];
    __shared__ float scratch[33];
    const int tok = blockIdx.x, head = blockIdx.y;
    if (tok >= cu_seqlens[num_rows] || head_dim > BATON_GEN_MAX_D) return;
    int lo = 0, hi = num_rows - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_seqlens[mid] <= tok) lo = mid; else hi = mid - 1;
    }
    const int row = lo;
    const int ctx = start_pos[row] + (tok - cu_seqlens[row]) + 1;
    const int kvh = head / (num_heads / num_kv_heads);
    const int* bt = block_tables + (size_t)row * max_blocks_per_row;
    const size_t tok_stride = (size_t)num_kv_heads * head_dim;
    const elem_t* qh = q + (size_t)tok * q_stride + (size_t)head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = baton_to_f(qh[d]);
    __syncthreads();
    constexpr int PER = BATON_GEN_MAX_D / BATON_GEN_THREADS;
    float acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    float m = BATON_NEG_INF, l = 0.0f;
    for (int c0 = baton_window_start(ctx, window); c0 < ctx; c0 += BATON_ATTN_PART) {
        const int n = min(BATON_ATTN_PART, ctx - c0);
        float cmax = BATON_NEG_INF;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int t = c0 + j;
            const elem_t* kr = k_cache +
                               ((size_t)bt[t / block_size] * block_size + t % block_size) *
                                   tok_stride +
                               (size_t)kvh * head_dim;
            float s = 0.0f;
            for (int d = 0; d < head_dim; ++d) s = fmaf(qs[d], baton_to_f(kr[d]), s);
            s *= scale;
            p[j] = s;
            cmax = fmaxf(cmax, s);
        }
        cmax = baton_block_max(cmax, scratch);
        const float m_new = fmaxf(m, cmax);
        float csum = 0.0f;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float e = expf(p[j] - m_new);
            p[j] = e;
            csum += e;
        }
        csum = baton_block_sum(csum, scratch);  // its __syncthreads publishes p[]
        const float alpha = expf(m - m_new);      // 0 on the first chunk (m = -inf)
        l = l * alpha + csum;
        m = m_new;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = threadIdx.x + i * BATON_GEN_THREADS;
            if (d < head_dim) {
                float a = acc[i] * alpha;
                for (int j = 0; j < n; ++j) {
                    const int t = c0 + j;
                    const elem_t* vr =
                        v_cache +
                        ((size_t)bt[t / block_size] * block_size + t % block_size) * tok_stride +
                        (size_t)kvh * head_dim;
                    a = fmaf(p[j], baton_to_f(vr[d]), a);
                }
                acc[i] = a;
            }
        }
        __syncthreads();  // the next chunk overwrites p[]
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    elem_t* o = out + ((size_t)tok * num_heads + head) * head_dim;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = threadIdx.x + i * BATON_GEN_THREADS;
        if (d < head_dim) o[d] = baton_from_f(acc[i] * inv);
    }
}
