// Paged attention over the KV cache (elem_t): decode (split-K + reduce), causal varlen prefill,
// and a generic kernel for any head_dim (both cases; the fast paths cover 64, 128 and 256).
//
// KV cache, per layer, for K and for V: [num_blocks][block_size][num_kv_heads][head_dim] elem_t
// (see baton_rope_and_cache in rope.cu). A row's block table [max_blocks_per_row] int maps
// logical block `pos / block_size` to a physical page. Every key/value a query attends to,
// including the query's own position, must already be in the cache (baton_rope_and_cache runs
// first).
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

// Keys of one decode partition of a sequence of `ctx` keys when the launch has `z` partitions
// per sequence (grid.z): ceil(ctx / z) rounded up to a multiple of BATON_ATTN_MIN_PART, so a
// sequence uses at most z partitions and a short one fewer. A partition longer than
// BATON_ATTN_PART is walked in chunks of BATON_ATTN_PART.
#define BATON_ATTN_MIN_PART 64
__device__ __forceinline__ int baton_decode_part_size(int ctx, int z) {
    const int p = (ctx + z - 1) / z;
    return max(BATON_ATTN_MIN_PART, (p + BATON_ATTN_MIN_PART - 1) / BATON_ATTN_MIN_PART *
                                        BATON_ATTN_MIN_PART);
}
__device__ __forceinline__ int baton_decode_num_parts(int ctx, int z) {
    const int p = baton_decode_part_size(ctx, z);
    return (ctx + p - 1) / p;
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

// Which kv head and which query heads this block serves.
struct BatonAttnHeads {
    int kvh, head0, ng;
};
__device__ __forceinline__ BatonAttnHeads baton_attn_heads(int num_heads, int num_kv_heads) {
    const int group = num_heads / num_kv_heads;
    const int chunks = (group + BATON_ATTN_MAX_G - 1) / BATON_ATTN_MAX_G;
    const int kvh = blockIdx.y / chunks, c = blockIdx.y - kvh * chunks;
    BatonAttnHeads h;
    h.kvh = kvh;
    h.head0 = kvh * group + c * BATON_ATTN_MAX_G;
    h.ng = min(BATON_ATTN_MAX_G, group - c * BATON_ATTN_MAX_G);
    return h;
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

    // 2. Online softmax update per query head (one warp per head).
    for (int g = warp; g < h.ng; g += BATON_ATTN_WARPS) {
        float m = BATON_NEG_INF;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sh.logits[g][j]);
        m = baton_warp_max(m);
        const float m_old = sh.m[g];
        const float m_new = fmaxf(m_old, m);
        float l = 0.0f;
        for (int j = lane; j < n; j += 32) {
            const float p = exp2f(sh.logits[g][j] - m_new);
            sh.logits[g][j] = p;
            l += p;
        }
        l = baton_warp_sum(l);
        if (lane == 0) {
            const float alpha = exp2f(m_old - m_new);  // 0 on the first chunk (m_old = -inf)
            sh.alpha[g] = alpha;
            sh.l[g] = sh.l[g] * alpha + l;
            sh.m[g] = m_new;
        }
    }
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
// Decode: one query token per sequence, split-K over up to max_partitions partitions per
// sequence (baton_decode_part_size: at least BATON_ATTN_MIN_PART keys each). The host picks
// max_partitions from the batch so that small batches still fill the GPU (a batch of one
// sequence and 8 kv heads would otherwise be 8 thread blocks).
//
// Shapes: out [num_seqs, num_heads, D] elem_t; q [num_seqs, num_heads, D] elem_t with sequence
// stride `q_stride` elements; block_tables [num_seqs, max_blocks_per_row] int; seq_lens
// [num_seqs] int = context length including the current token (0 for a padding row: its output
// is zeros). Partials: part_acc [num_seqs, num_heads, max_partitions, D] f32 (unnormalized),
// part_m / part_l [num_seqs, num_heads, max_partitions] f32 (log2-domain max, sum).
// max_partitions >= 1 (the partials' stride and grid.z).
// Launch: grid = (num_seqs, num_kv_heads * ceil(group / 8), max_partitions), block = (128);
// then baton_paged_attention_decode_reduce. A sequence with one partition is written directly
// to `out` and skipped by the reduce.
template <int D>
__device__ __forceinline__ void baton_decode_body(
    elem_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_m,
    float* __restrict__ part_l, const elem_t* __restrict__ q, int q_stride,
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks_per_row, const int* __restrict__ seq_lens,
    int num_heads, int num_kv_heads, int block_size, float scale, int max_partitions) {
    __shared__ BatonAttnShared<D> sh;
    const int seq = blockIdx.x, part = blockIdx.z;
    const int ctx = seq_lens[seq];
    const int psize = baton_decode_part_size(ctx, max_partitions);
    const int num_parts = baton_decode_num_parts(ctx, max_partitions);
    if (part >= max(num_parts, 1)) return;
    const BatonAttnHeads h = baton_attn_heads(num_heads, num_kv_heads);
    float acc[BATON_ATTN_MAX_G][D / 32];
    baton_attn_load_q<D>(sh, q + (size_t)seq * q_stride, h);
    baton_attn_init<D>(sh, acc);
    const float qscale = scale * BATON_LOG2E;
    const int c0 = part * psize, c1 = min(ctx, c0 + psize);
    for (int s0 = c0; s0 < c1; s0 += BATON_ATTN_PART)
        baton_attn_chunk<D>(sh, qscale, acc, k_cache, v_cache,
                            block_tables + (size_t)seq * max_blocks_per_row, block_size,
                            num_kv_heads, h, s0, min(c1, s0 + BATON_ATTN_PART));
    baton_attn_reduce_warps<D>(sh, acc, h.ng);
    if (num_parts <= 1) {
        baton_attn_store<D>(out + (size_t)seq * num_heads * D, sh, acc, h);
        return;
    }
    if ((threadIdx.x >> 5) != 0) return;
    const int lane = threadIdx.x & 31;
    for (int g = 0; g < h.ng; ++g) {
        const size_t ph = ((size_t)seq * num_heads + h.head0 + g) * max_partitions + part;
        if (lane == 0) {
            part_m[ph] = sh.m[g];
            part_l[ph] = sh.l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < BATON_ATTN_MAX_G; ++g) {
        if (g < h.ng) {
            const size_t ph = ((size_t)seq * num_heads + h.head0 + g) * max_partitions + part;
#pragma unroll
            for (int i = 0; i < D / 32; ++i) part_acc[ph * D + lane * (D / 32) + i] = acc[g][i];
        }
    }
}

#define BATON_DECODE_ENTRY(D)                                                                  \
    BATON_ENTRY void __launch_bounds__(128) baton_paged_attention_decode_hd##D(           \
        elem_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_m,      \
        float* __restrict__ part_l, const elem_t* __restrict__ q, int q_stride,                   \
        const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,                     \
        const int* __restrict__ block_tables, int max_blocks_per_row,                           \
        const int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int block_size,     \
        float scale, int max_partitions) {                                                      \
        BATON_PDL_WAIT();                                                                   \
        BATON_PDL_LAUNCH();                                                                 \
        baton_decode_body<D>(out, part_acc, part_m, part_l, q, q_stride, k_cache, v_cache,      \
                             block_tables, max_blocks_per_row, seq_lens, num_heads,             \
                             num_kv_heads, block_size, scale, max_partitions);                  \
    }
BATON_DECODE_ENTRY(64)
BATON_DECODE_ENTRY(128)
BATON_DECODE_ENTRY(256)

// Combine the partitions of sequences with more than one: out = sum_p 2^(m_p - M) acc_p /
// sum_p 2^(m_p - M) l_p. Shapes as for the decode kernel; any head_dim.
// Launch: grid = (num_seqs, num_heads), block = (128).
BATON_ENTRY void baton_paged_attention_decode_reduce(
    elem_t* __restrict__ out, const float* __restrict__ part_acc, const float* __restrict__ part_m,
    const float* __restrict__ part_l, const int* __restrict__ seq_lens, int num_heads,
    int head_dim, int max_partitions) {
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int seq = blockIdx.x, head = blockIdx.y;
    const int num_parts = baton_decode_num_parts(seq_lens[seq], max_partitions);
    if (num_parts <= 1) return;
    const size_t base = ((size_t)seq * num_heads + head) * max_partitions;
    float m = BATON_NEG_INF;
    for (int p = 0; p < num_parts; ++p) m = fmaxf(m, part_m[base + p]);
    float l = 0.0f;
    for (int p = 0; p < num_parts; ++p) l += part_l[base + p] * exp2f(part_m[base + p] - m);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    elem_t* o = out + ((size_t)seq * num_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int p = 0; p < num_parts; ++p)
            a += part_acc[(base + p) * head_dim + d] * exp2f(part_m[base + p] - m);
        o[d] = baton_from_f(a * inv);
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill (and mixed prefill/decode): causal attention for variable-length rows.
//
// Query token i of row r (cu_seqlens[r] <= i < cu_seqlens[r + 1]) sits at position
// p = start_pos[r] + (i - cu_seqlens[r]) and attends to keys 0..=p of its row, read from the
// cache through block_tables[r]. Rows may be decodes (one token) or prefill chunks continuing an
// already-cached prefix.
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
    int num_kv_heads, int block_size, float scale) {
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
    for (int c0 = 0; c0 < ctx; c0 += BATON_ATTN_PART)
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
        int num_kv_heads, int block_size, float scale) {                                         \
        BATON_PDL_WAIT();                                                                   \
        BATON_PDL_LAUNCH();                                                                 \
        baton_prefill_body<D>(out, q, q_stride, k_cache, v_cache, cu_seqlens, start_pos,         \
                              num_rows, block_tables, max_blocks_per_row, num_heads,             \
                              num_kv_heads, block_size, scale);                                  \
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
// elem_t with token stride q_stride; the rest as for the prefill kernel.
// Launch: grid = (num_tokens, num_heads), block = (128).
#define BATON_GEN_THREADS 128
#define BATON_GEN_MAX_D 1024
BATON_ENTRY void __launch_bounds__(BATON_GEN_THREADS) baton_paged_attention_generic(
    elem_t* __restrict__ out, const elem_t* __restrict__ q, int q_stride,
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ cu_seqlens, const int* __restrict__ start_pos, int num_rows,
    const int* __restrict__ block_tables, int max_blocks_per_row, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale) {
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
    for (int c0 = 0; c0 < ctx; c0 += BATON_ATTN_PART) {
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
