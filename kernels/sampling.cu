// On-device sampling: logit bias, presence / frequency / repetition penalties, greedy /
// temperature / top-k / top-p / min-p, plus log-probabilities.
//
// Semantics are those of the CPU reference, `baton_worker::sampling` (crates/worker/src/
// sampling.rs); read its module docs first. In short, per row:
//   - logit bias and penalties first (baton_worker::penalty, crates/worker/src/penalty.rs),
//     applied in place to the logits of the row's history and bias tokens: the host builds the
//     row's list (one entry per distinct token, with its output count, whether it is in the
//     prompt, and its bias) from the token and logit-bias tables; a pending first input (an id an earlier launch sampled, known only on the device)
//     is merged here as one more output occurrence. baton_penalize is the CPU's arithmetic, so
//     the penalized logits are bit for bit the CPU's;
//   - logits are cleaned (NaN -> -inf, +inf -> FLT_MAX, -0 -> +0);
//   - greedy (argmax, ties to the lowest id) when !(temperature > 0), 1/temperature overflows,
//     or top_k == 1;
//   - otherwise candidates are ordered by the 64-bit key (logit descending, id ascending; see
//     baton_sort_key), top-k / top-p / min-p each keep a prefix of that order, and the token is
//     the inverse CDF at u = baton_uniform(seed, output_index) over the kept prefix;
//   - log-probabilities are the raw (temperature 1, unfiltered, unpenalized) log-softmax: the
//     penalized entries are restored before they are computed.
// The RNG is the same Philox4x32-10 and the same 24-bit construction as the CPU, keyed only by
// the row's own seed and output index, so a seeded row never depends on its batchmates.
//
// Device algorithm (no sort of the row): every "first key in order whose running mass exceeds
// T" question (top-k boundary by count, top-p boundary by mass, the draw itself) is answered
// from a histogram of the row's mass over bins of (max - logit) / T plus a sorted list of the
// one bin that holds the answer ("Histogram selection" below; a bin too full to list is
// searched by the radix select over its own tokens), and for allow-list rows by an MSB-first
// radix select over the 64-bit keys, 8 bits per pass, with a 256-bin histogram in shared
// memory, stopping early once the chosen bin holds a single candidate. Both give the same
// answer. Masses are fixed point, w = round(exp((x - max) / T) * 2^40) in u64, summed with
// integer atomics, so the result is bit-deterministic whatever the thread schedule. Deviation from the CPU (which sums f32
// weights in f64): tokens with p / p_max < 2^-41 have zero mass on the device and are never
// drawn, and a draw within rounding distance of a boundary may pick the neighbouring token.
//
// Checked on an H200 by scripts/gpu-check.sh (session 7: goldens, seeded alone vs batched; the
// histogram path not yet, session 37). Both selection paths are modelled line by line on the
// CPU in crates/cuda/tests/sampler_model.rs (checked against each other and a sort-and-scan
// reference); keep them in step.

#define BATON_MAX_TOP_LOGPROBS 20
#define BATON_PHILOX_M0 0xD2511F53u
#define BATON_PHILOX_M1 0xCD9E8D57u
#define BATON_PHILOX_W0 0x9E3779B9u
#define BATON_PHILOX_W1 0xBB67AE85u
#define BATON_FIX_ONE 1099511627776.0f  // 2^40

// Same layout as baton_proto::SamplingParams (#[repr(C)], 64 bytes; checked by a Rust test).
// prompt_logprobs is unused here: the worker scores prompt positions on the host.
struct BatonSamplingParams {
    float temperature;
    float top_p;
    int top_k;
    float min_p;
    u64 seed;
    u32 top_logprobs;
    u32 want_logprob;
    float presence_penalty;
    float frequency_penalty;
    float repetition_penalty;
    u32 logit_bias_len;
    u32 allowed_only;
    u32 prompt_logprobs;
    u32 token_mask;
    u32 reserved;
};

// One distinct token of a row's history or logit bias (baton_cuda::staging::DevicePenaltyEntry,
// 20 bytes): the host's baton_worker::penalty::PenaltyEntry plus room for the logit it replaces.
// flags: bit 0 (BATON_ENTRY_IN_PROMPT) the token occurs in the prompt; bit 1
// (BATON_ENTRY_LISTED) it has a logit-bias entry (with allowed_only: it may be sampled).
#define BATON_ENTRY_IN_PROMPT 1u
#define BATON_ENTRY_LISTED 2u
struct BatonPenaltyEntry {
    u32 token;
    u32 output_count;
    u32 flags;
    float bias;
    float saved;
};

// Where a row's penalty entries are (baton_cuda::staging::PenaltyRow, 16 bytes): entries
// [offset, offset + count) of the launch's table; pending_index >= 0 is the index in the input-id
// buffer of the row's first input, an output sampled by an earlier launch that the host did not
// know (resolved on the device by baton_embedding_gather), which counts as one more output
// occurrence. count == 0 and pending_index < 0: the row is not penalized.
struct BatonPenaltyRow {
    u32 offset;
    u32 count;
    int pending_index;
    u32 reserved;
};

// The penalized logit of one history token: baton_worker::penalty::penalize
// (crates/worker/src/penalty.rs), same operations in the same order. The explicit _rn
// intrinsics keep the compiler from contracting the multiply and subtract into an FMA, which
// would round differently from the CPU.
__device__ __forceinline__ float baton_penalize(float x, float bias, u32 output_count,
                                                bool in_prompt, const BatonSamplingParams& p) {
    x = __fadd_rn(x, bias);
    const float r = p.repetition_penalty;
    if (r > 0.0f && r != 1.0f && (in_prompt || output_count > 0))
        x = x > 0.0f ? __fdiv_rn(x, r) : __fmul_rn(x, r);
    if (output_count > 0) {
        x = __fsub_rn(x, __fmul_rn(p.frequency_penalty, __uint2float_rn(output_count)));
        x = __fsub_rn(x, p.presence_penalty);
    }
    return x;
}

// Philox4x32-10 (Salmon et al., SC'11; Random123 / curand constants).
__device__ __forceinline__ uint4 baton_philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k.x += BATON_PHILOX_W0;
            k.y += BATON_PHILOX_W1;
        }
        const u32 hi0 = __umulhi(BATON_PHILOX_M0, c.x), lo0 = BATON_PHILOX_M0 * c.x;
        const u32 hi1 = __umulhi(BATON_PHILOX_M1, c.z), lo1 = BATON_PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// The top 24 bits of Philox word 0 for key = (seed lo, seed hi), counter = (idx, 0, 0, 0);
// uniform = bits * 2^-24, exactly as the CPU's `uniform`.
__device__ __forceinline__ u32 baton_uniform_bits(u64 seed, u32 idx) {
    const uint4 w = baton_philox4x32_10(make_uint4(idx, 0u, 0u, 0u),
                                        make_uint2((u32)seed, (u32)(seed >> 32)));
    return w.x >> 8;
}

__device__ __forceinline__ float baton_clean(float x) {
    if (isnan(x)) return BATON_NEG_INF;
    if (x == BATON_POS_INF) return BATON_FLT_MAX;
    return x + 0.0f;  // -0 -> +0 (not folded: no fast-math)
}

// Ascending key order == logit descending, then id ascending.
__device__ __forceinline__ u64 baton_sort_key(float x, u32 id) {
    const u32 b = __float_as_uint(x);
    const u32 ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)(~ord) << 32) | (u64)id;
}

// round(e * 2^40); 0 for a NaN weight (exp(-inf * 0), a -inf logit at an infinite temperature,
// which no entry point sends: the hardware converts NaN to 2^63 for a u64, PTX ISA 9.0 cvt).
__device__ __forceinline__ u64 baton_fixed_weight(float e) {
    return e > 0.0f ? __float2ull_rn(e * BATON_FIX_ONE) : 0ull;
}

__device__ __forceinline__ u64 baton_warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(BATON_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ u64 baton_warp_min_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(BATON_FULL_MASK, v, o);
        v = w < v ? w : v;
    }
    return v;
}
// Exclusive prefix of v over the warp's lanes (the sum of the lanes below this one) by an xor
// butterfly, and the whole warp's sum in `total`. Called by all 32 lanes.
__device__ __forceinline__ u64 baton_warp_prefix_u64(u64 v, u64& total) {
    const int lane = threadIdx.x & 31;
    u64 pre = 0, tot = v;
#pragma unroll
    for (int o = 1; o < BATON_WARP; o <<= 1) {
        const u64 other = __shfl_xor_sync(BATON_FULL_MASK, tot, o);
        if (lane & o) pre += other;
        tot += other;
    }
    total = tot;
    return pre;
}

__device__ __forceinline__ u64 baton_block_sum_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = baton_warp_sum_u64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0ull;
    return baton_warp_sum_u64(v);
}
__device__ __forceinline__ u64 baton_block_min_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = baton_warp_min_u64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : ~0ull;
    return baton_warp_min_u64(v);
}

struct BatonSampleShared {
    u64 hist_w[256];
    u32 hist_c[256];
    u64 scratch_u64[32];
    float scratch_f[33];
    u64 below;
    u32 digit;
    u32 count;
    u32 pending_listed;  // the pending token has an entry in the row's list
    float pending_saved;  // its raw logit when it has none
    int last;             // this block combines the row's slices
};

// One slice of a row (split-row pass of baton_sample_f32, 16 bytes): the smallest key
// (baton_sort_key of the cleaned logit: the argmax, ties to the lowest id), the max of the
// cleaned logits, and sum exp(c - max) over the slice (0 when the row wants no
// log-probabilities, or the max is -inf).
struct BatonSamplePartial {
    u64 key;
    float maxv;
    float sum;
};

// A candidate filter: key <= bound and weight >= min_p; `by_count` selects on counts
// (every token counts 1, even a zero-weight one) instead of fixed-point mass. `list`
// (allowed_token_ids, else null): only its BATON_ENTRY_LISTED tokens are candidates, and the
// passes walk its n_list entries instead of the vocabulary (every other token has zero mass).
// bin >= 0: only the tokens of that baton_hist_bin are candidates (the histogram path's radix
// select inside one bin).
struct BatonSelect {
    const float* x;
    int vocab;
    float maxv, inv_t, min_p;
    u64 bound;
    bool by_count;
    const BatonPenaltyEntry* list;
    u32 n_list;
    int bin;
};

// Histogram selection's bins (see "Histogram selection" below): BATON_HIST_SCALE bins per nat
// of (max - logit) / T.
#define BATON_HIST_BINS 1024
#define BATON_HIST_SCALE 32.0f

// The bin of cleaned logit c (maxv finite, inv_t > 0 finite): floor((max - c) / T * scale),
// clamped to the last bin (also for d = inf). Each rounding is monotone, so c1 >= c2 gives
// bin(c1) <= bin(c2); the explicit _rn operations keep every call site's bits the same.
__device__ __forceinline__ int baton_hist_bin(float c, float maxv, float inv_t) {
    const float d = __fmul_rn(__fmul_rn(__fsub_rn(maxv, c), inv_t), BATON_HIST_SCALE);
    return d < (float)(BATON_HIST_BINS - 1) ? (int)d : BATON_HIST_BINS - 1;
}

// The first question's filter over row x: no bound, no min-p, every token of `list` (or of
// the vocabulary when null) a candidate, counted.
__device__ __forceinline__ BatonSelect baton_select_init(const float* x, int vocab, float maxv,
                                                         float inv_t,
                                                         const BatonPenaltyEntry* list,
                                                         u32 n_list) {
    BatonSelect s;
    s.x = x;
    s.vocab = vocab;
    s.maxv = maxv;
    s.inv_t = inv_t;
    s.min_p = 0.0f;
    s.bound = ~0ull;
    s.by_count = true;
    s.list = list;
    s.n_list = n_list;
    s.bin = -1;
    return s;
}

// The token at walk index j, or -1 for an entry that is not a candidate (not listed, or out of
// the vocabulary).
__device__ __forceinline__ int baton_select_token(const BatonSelect& s, int j) {
    if (!s.list) return j;
    const BatonPenaltyEntry e = s.list[j];
    return (e.flags & BATON_ENTRY_LISTED) && e.token < (u32)s.vocab ? (int)e.token : -1;
}

// exp((c - max) / T) of a cleaned logit c: its weight relative to the row's maximum. Every
// selection path computes it here, so all of them see the same bits.
__device__ __forceinline__ float baton_exp_weight(float c, float maxv, float inv_t) {
    return expf((c - maxv) * inv_t);
}
__device__ __forceinline__ float baton_select_e(const BatonSelect& s, float c) {
    return baton_exp_weight(c, s.maxv, s.inv_t);
}

// Metric of token i, whose logit is xi = s.x[i], under `s` (0 = not a candidate) and its key.
__device__ __forceinline__ u64 baton_metric(const BatonSelect& s, int i, float xi, u64& key) {
    const float c = baton_clean(xi);
    key = baton_sort_key(c, (u32)i);
    if (key > s.bound) return 0;
    if (s.bin >= 0 && baton_hist_bin(c, s.maxv, s.inv_t) != s.bin) return 0;
    const float e = baton_select_e(s, c);
    if (e < s.min_p) return 0;
    return s.by_count ? 1ull : baton_fixed_weight(e);
}

// Logits a thread of a selection pass over the vocabulary loads before it uses any of them.
// One load at a time left every pass latency-bound: a temperature-0.8 top-p-0.95 row of a
// 128256-token vocabulary cost 1.58 ms of a 2.58 ms Llama-1B step on an H200 (session 35,
// bench/RESULTS.md), about a dozen passes. Tunable (BATON_KERNEL_DEFINES).
#ifndef BATON_SELECT_U
#define BATON_SELECT_U 4
#endif

// Calls f(i, x[i]) for every i in [0, n), each thread its own indices in ascending order,
// loading BATON_SELECT_U logits (strided by the block) before using any of them. Called by the
// whole block.
template <typename F>
__device__ __forceinline__ void baton_row_walk(const float* x, int n, F&& f) {
    const int step = (int)blockDim.x;
    for (int i0 = (int)threadIdx.x; i0 < n; i0 += step * BATON_SELECT_U) {
        float v[BATON_SELECT_U];
#pragma unroll
        for (int u = 0; u < BATON_SELECT_U; ++u) {
            const int i = i0 + u * step;
            v[u] = i < n ? x[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < BATON_SELECT_U; ++u) {
            const int i = i0 + u * step;
            if (i >= n) break;
            f(i, v[u]);
        }
    }
}

// Calls f(i, key, m) for every token i a selection pass walks (the vocabulary, or the
// allow-list's candidates), with m = baton_metric (0 included: callers skip it) and its key;
// each thread walks its own indices in ascending order. Called by the whole block.
template <typename F>
__device__ __forceinline__ void baton_select_walk(const BatonSelect& s, F&& f) {
    if (s.list) {
        for (int j = threadIdx.x; j < (int)s.n_list; j += blockDim.x) {
            const int i = baton_select_token(s, j);
            if (i < 0) continue;
            u64 key;
            const u64 m = baton_metric(s, i, s.x[i], key);
            f(i, key, m);
        }
        return;
    }
    baton_row_walk(s.x, s.vocab, [&](int i, float xi) {
        u64 key;
        const u64 m = baton_metric(s, i, xi, key);
        f(i, key, m);
    });
}

// Total metric of the candidates. Not inlined, for the same reason as baton_radix_select.
__device__ __noinline__ u64 baton_select_total(const BatonSelect& s, BatonSampleShared& sh) {
    u64 acc = 0;
    baton_select_walk(s, [&](int, u64, u64 m) { acc += m; });
    return baton_block_sum_u64(acc, sh.scratch_u64);
}

// Bins of a radix pass that each thread accumulates in registers before adding them to the
// shared histogram (round-robin eviction; 0: one shared atomic per candidate). In the first
// passes most candidates share a handful of digits (the key's top bytes are the logit's sign
// and exponent), and the same-address atomics of a warp's lanes serialize. Integer sums, so
// the histogram, and every result, are the same whatever this is. Tunable
// (BATON_KERNEL_DEFINES, crates/cuda/src/kernels.rs).
#ifndef BATON_SAMPLE_BIN_CACHE
#define BATON_SAMPLE_BIN_CACHE 2
#endif

// Adds mass w of one candidate to bin d of the shared histogram through the thread's register
// bins: a hit adds in place, a miss evicts bin `next` (round robin) to the histogram. A register
// bin is its mass cw[k] and tag[k] = (candidates << 9) | digit, digit 256 marking a free bin (a
// thread sees fewer than 2^23 candidates a pass: vocab / blockDim).
__device__ __forceinline__ void baton_bin_flush(u32 tag, u64 w, BatonSampleShared& sh) {
    const u32 d = tag & 511u;
    if (d < 256u) {
        atomicAdd(&sh.hist_w[d], w);
        atomicAdd(&sh.hist_c[d], tag >> 9);
    }
}

template <int NC>
__device__ __forceinline__ void baton_bin_add(u32 (&tag)[NC], u64 (&cw)[NC], int& next, u32 d,
                                              u64 w, BatonSampleShared& sh) {
    bool hit = false;
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        if ((tag[k] & 511u) == d) {
            cw[k] += w;
            tag[k] += 512u;
            hit = true;
        }
    }
    if (hit) return;
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        if (k == next) {
            baton_bin_flush(tag[k], cw[k], sh);
            tag[k] = 512u | d;
            cw[k] = w;
        }
    }
    next = next + 1 == NC ? 0 : next + 1;
}

// The digit a radix pass chooses, from the pass's histogram: the first bin d (in digit order)
// with below + sum_{d' <= d} hist_w[d'] > t, with sh.below = below + the bins before it and
// sh.count = its candidates; when no bin qualifies (t >= below + total: unreachable when t is
// below the total of the candidates), the last non-empty bin (0 if none) and sh.below = below.
// Warp 0: lane l owns bins [8 l, 8 l + 8), an exclusive prefix over the lanes' sums (xor
// butterfly) finds the one lane whose range holds t, which scans its 8 bins again (re-read from
// shared memory: keeping them in registers made the 64-register sampler spill). The other warps
// do nothing; the caller publishes sh.digit / sh.below / sh.count with a barrier.
__device__ __forceinline__ void baton_radix_choose(u64 below, u64 t, BatonSampleShared& sh) {
    if (threadIdx.x >= BATON_WARP) return;
    const int lane = threadIdx.x;
    u64 sum = 0;
    int last = -1;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int d = lane * 8 + k;
        sum += sh.hist_w[d];
        if (sh.hist_c[d] != 0u) last = d;
    }
    // pre: the sum of the lanes below this one; tot: of the whole warp.
    u64 tot;
    const u64 pre = baton_warp_prefix_u64(sum, tot);
#pragma unroll
    for (int o = 1; o < BATON_WARP; o <<= 1)
        last = max(last, __shfl_xor_sync(BATON_FULL_MASK, last, o));
    const u64 lo = below + pre;
    if (lo <= t && t < lo + sum) {
        u64 b = lo;
        int chosen = -1;
        u32 count = 0;
        for (int k = 0; k < 8 && chosen < 0; ++k) {
            const int d = lane * 8 + k;
            const u32 ck = sh.hist_c[d];
            if (ck == 0u) continue;
            const u64 wk = sh.hist_w[d];
            if (b + wk > t) {
                chosen = d;
                count = ck;
            } else {
                b += wk;
            }
        }
        sh.digit = (u32)chosen;
        sh.below = b;
        sh.count = count;
    } else if (lane == 0 && !(t < below + tot)) {
        const int d = last < 0 ? 0 : last;
        sh.digit = (u32)d;
        sh.below = below;
        sh.count = sh.hist_c[d];
    }
}

// The smallest candidate key K such that (sum of metric over candidates with key <= K) > t.
// Requires t < baton_select_total(s). MSB-first radix select, 8 bits per pass; stops early
// (one extra pass) once the chosen bin holds a single candidate. Not inlined: with its
// register bins inlined at its three call sites, the 64-register (1024-thread) sampler spilled
// (ptxas -v, sm_90: 2 bins 52 bytes, 4 bins 172); as a call, 2 bins spill 16 bytes around the
// calls and none inside.
__device__ __noinline__ u64 baton_radix_select(const BatonSelect& s, u64 t, BatonSampleShared& sh) {
    constexpr int NC = BATON_SAMPLE_BIN_CACHE > 0 ? BATON_SAMPLE_BIN_CACHE : 1;
    u64 prefix = 0, below = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            sh.hist_w[d] = 0;
            sh.hist_c[d] = 0;
        }
        __syncthreads();
        u32 tag[NC];
        u64 cw[NC];
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            tag[k] = 256u;
            cw[k] = 0;
        }
        int next = 0;
        baton_select_walk(s, [&](int, u64 key, u64 m) {
            if (m == 0) return;
            if (shift < 56 && (key >> (shift + 8)) != (prefix >> (shift + 8))) return;
            const u32 d = (u32)(key >> shift) & 255u;
            if (BATON_SAMPLE_BIN_CACHE > 0) {
                baton_bin_add<NC>(tag, cw, next, d, m, sh);
            } else {
                atomicAdd(&sh.hist_w[d], m);
                atomicAdd(&sh.hist_c[d], 1u);
            }
        });
#pragma unroll
        for (int k = 0; k < NC; ++k) baton_bin_flush(tag[k], cw[k], sh);
        __syncthreads();
        baton_radix_choose(below, t, sh);
        __syncthreads();
        prefix |= (u64)sh.digit << shift;
        below = sh.below;
        const u32 count = sh.count;
        __syncthreads();  // sh.* are rewritten by the next pass
        if (count == 1 && shift > 0) {
            u64 found = ~0ull;
            baton_select_walk(s, [&](int, u64 key, u64 m) {
                if (m != 0 && (key >> shift) == (prefix >> shift))
                    found = key < found ? key : found;
            });
            return baton_block_min_u64(found, sh.scratch_u64);
        }
    }
    return prefix;
}

// ---- Histogram selection -------------------------------------------------------------------
//
// The radix select reads the whole row, recomputing exp() per logit, once per 8-bit digit of
// every question: about a dozen passes for a top-p row (crates/cuda/tests/sampler_model.rs
// counts them), all in the one block that finishes the row. The histogram path answers the
// same questions with the same result in fewer passes:
//   1. one pass builds a histogram of the row's mass and count over BATON_HIST_BINS bins of
//      d = (max - c) / T (BATON_HIST_SCALE bins per nat; the last bin gathers d >= 31.97,
//      where exp(-d) * 2^40 rounds to a zero mass, so its tokens are counted and never
//      weighed). The bin is monotone in the key order (logit descending), so a question's
//      answer lies in the first bin whose running count or mass exceeds t;
//   2. one pass compacts tokens (key, exp weight) into a list in shared memory, sorted by key,
//      where the answer is the first entry whose running metric exceeds t: every bin up to the
//      answer's when they fit in the list (a prefix list: it holds every candidate of every
//      later question too, whose bounds are earlier answers, so the row is never read again),
//      else the answer's bin alone (t less the bins before it). A bin with more tokens than
//      the list holds (near-equal logits: the bins are 1/32 nat wide) is searched instead by
//      the radix select restricted to its tokens, whose passes over the row weigh (exp,
//      atomics) that bin's tokens alone. Without a prefix list, the answer's bin becomes the
//      cut: the next question (whose bound is this answer) takes the bins before the cut
//      whole, the cut bin's candidates up to the bound (from the list, or one restricted
//      pass), and nothing after it; a question whose answer falls in the listed bin needs no
//      pass at all;
//   3. min-p filters weights, not bins: with min_p > 0 and no prefix list, one more pass
//      rebuilds the masses under the final bound and min-p before the draw.
// Reads of a row, the max pass included: 3 with a prefix list for the first question (top-k,
// or top-p or the draw near the head of a peaked row), 4 without (radix select alone: 6 for
// plain temperature, 10-13 for top-k or top-p, 16-17 with all three). Either way the token is
// the radix select's, bit for bit (sampler_model.rs checks both paths against each other and
// against a sort). Not used for allow-list rows (their passes already walk only the list).
// The top log-probabilities use the same parts (baton_top_logprobs_hist). BATON_SAMPLE_HIST=0
// (a kernel tunable) turns both off.
#ifndef BATON_SAMPLE_HIST
#define BATON_SAMPLE_HIST 1
#endif
#define BATON_HIST_LIST 2048
#define BATON_HIST_FREE 2047u  // baton_hist_build's mark of a free register bin

// 36 KB: with BatonSampleShared (3.5 KB), under the 48 KB of static shared memory a block may
// declare.
struct BatonHistShared {
    u64 w[BATON_HIST_BINS];       // mass per bin (fixed point, as baton_fixed_weight)
    u32 c[BATON_HIST_BINS];       // tokens per bin (the first build's; every token counts)
    u64 key[BATON_HIST_LIST];     // the list: keys of the listed bins' tokens, ascending
    float e[BATON_HIST_LIST];     // and their baton_select_e
    u64 before;                   // baton_hist_scan's answer: running value before `bin`
    int bin;                      // the bin, -1 when t is not below the total
    int cut;                      // bin of the current bound (BATON_HIST_BINS: no bound)
    int list_bin;                 // bin whose tokens the list holds (-1: none)
    bool prefix;                  // the list holds every bin up to list_bin, not just it
    u32 n;                        // entries in the list
    bool fast;                    // the histogram answers (baton_answer)
};

// baton_metric of a list entry (its key and baton_select_e).
__device__ __forceinline__ u64 baton_list_metric(const BatonSelect& s, u64 key, float e) {
    if (key > s.bound || e < s.min_p) return 0;
    return s.by_count ? 1ull : baton_fixed_weight(e);
}

// Exclusive prefix sum of one u64 per thread over the block, and the block's total in `total`:
// the lanes' (baton_warp_prefix_u64), then the warps'.
__device__ __forceinline__ u64 baton_block_prefix_u64(u64 v, u64* scratch, u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    u64 tot;
    const u64 pre = baton_warp_prefix_u64(v, tot);
    __syncthreads();
    if (lane == 0) scratch[warp] = tot;
    __syncthreads();
    u64 below = 0, all = 0;
    for (int w = 0; w < nwarps; ++w) {
        const u64 x = scratch[w];
        if (w < warp) below += x;
        all += x;
    }
    total = all;
    return below + pre;
}

// Step 1 (and 3): hs.w = the mass of each bin's candidates under s's bound and min-p
// (s.by_count is ignored: always mass; without `weigh`, every mass 0 and no exp computed); with
// `first`, also hs.c = every token's bin count, and no list yet. Either way there is no cut
// after it. Ends with a barrier.
__device__ __noinline__ void baton_hist_build(const BatonSelect& s, bool first, bool weigh,
                                              BatonHistShared& hs) {
    for (int b = threadIdx.x; b < BATON_HIST_BINS; b += blockDim.x) {
        hs.w[b] = 0;
        if (first) hs.c[b] = 0;
    }
    if (threadIdx.x == 0) {
        hs.cut = BATON_HIST_BINS;
        if (first) {
            hs.list_bin = -1;
            hs.prefix = false;
        }
    }
    __syncthreads();
    // In registers: read through `s` after a shared atomic, each field would be reloaded from
    // local memory for every token (the atomics may alias it as far as the compiler knows).
    const float maxv = s.maxv, inv_t = s.inv_t, min_p = s.min_p;
    const u64 bound = s.bound;
    u32 tail = 0;  // tokens of the last bin: no mass, one shared add per thread at the end
    // Two register bins in front of the shared ones, as the radix select's
    // (BATON_SAMPLE_BIN_CACHE): a u64 shared atomicAdd is a compare-and-swap loop on sm_90
    // (ATOMS.CAST.SPIN.64 in the SASS), and a row whose logits crowd into few bins would have
    // the lanes of a warp spin on one address. tag = (tokens << 11) | bin, bin
    // BATON_HIST_FREE marking a free register bin (a thread sees fewer than 2^21 tokens).
    u32 tag[2] = {BATON_HIST_FREE, BATON_HIST_FREE};
    u64 cw[2] = {0, 0};
    int next = 0;
    auto flush = [&](u32 t, u64 w) {
        const u32 b = t & 2047u;
        if (b >= (u32)BATON_HIST_BINS) return;
        if (w != 0) atomicAdd(&hs.w[b], w);
        if (first) atomicAdd(&hs.c[b], t >> 11);
    };
    baton_row_walk(s.x, s.vocab, [&](int i, float xi) {
        const float c = baton_clean(xi);
        const u32 b = (u32)baton_hist_bin(c, maxv, inv_t);
        if (b == BATON_HIST_BINS - 1) {
            ++tail;
            return;
        }
        u64 w = 0;
        if (weigh) {
            const float e = baton_exp_weight(c, maxv, inv_t);
            if (baton_sort_key(c, (u32)i) <= bound && !(e < min_p)) w = baton_fixed_weight(e);
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            if ((tag[k] & 2047u) == b) {
                cw[k] += w;
                tag[k] += 2048u;
                return;
            }
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            if (k == next) {
                flush(tag[k], cw[k]);
                tag[k] = 2048u | b;
                cw[k] = w;
            }
        }
        next ^= 1;
    });
#pragma unroll
    for (int k = 0; k < 2; ++k) flush(tag[k], cw[k]);
    if (first && tail != 0u) atomicAdd(&hs.c[BATON_HIST_BINS - 1], tail);
    __syncthreads();
}

// The list's total metric under s. Called by the whole block.
__device__ __noinline__ u64 baton_list_total(const BatonSelect& s, BatonHistShared& hs,
                                             BatonSampleShared& sh) {
    u64 acc = 0;
    for (u32 j = threadIdx.x; j < hs.n; j += blockDim.x) acc += baton_list_metric(s, hs.key[j], hs.e[j]);
    return baton_block_sum_u64(acc, sh.scratch_u64);
}

// The cut bin's total metric under s (its candidates within the bound): from its list, or,
// for a bin too full to list, a pass over the row that weighs only that bin's tokens; 0 with no
// cut. Called by the whole block.
__device__ __noinline__ u64 baton_cut_total(BatonSelect& s, BatonHistShared& hs,
                                            BatonSampleShared& sh) {
    const int cut = hs.cut;
    if (cut >= BATON_HIST_BINS) return 0;
    if (hs.list_bin == cut) return baton_list_total(s, hs, sh);
    s.bin = cut;
    const u64 v = baton_select_total(s, sh);
    s.bin = -1;
    return v;
}

// Total mass of the candidates under s (min-p included only after a rebuild under it, or from a
// prefix list): the bins before the cut and the cut bin's candidates within the bound, or the
// prefix list's. Called by the whole block.
__device__ __noinline__ u64 baton_hist_total(BatonSelect& s, BatonHistShared& hs,
                                             BatonSampleShared& sh) {
    if (hs.prefix) return baton_list_total(s, hs, sh);  // every candidate is listed
    u64 acc = 0;
    for (int b = threadIdx.x; b < hs.cut; b += blockDim.x) acc += hs.w[b];
    const u64 bins = baton_block_sum_u64(acc, sh.scratch_u64);
    return bins + baton_cut_total(s, hs, sh);
}

// The value of bin b in a scan: its count (by_count) or mass before the cut, cutv at the cut,
// nothing after it.
__device__ __forceinline__ u64 baton_hist_value(const BatonHistShared& hs, int b, bool by_count,
                                                u64 cutv) {
    if (b < hs.cut) return by_count ? (u64)hs.c[b] : hs.w[b];
    return b == hs.cut ? cutv : 0ull;
}

// Tokens in bins [0, b] (hs.c). Called by the whole block.
__device__ __forceinline__ u64 baton_hist_count_through(int b, const BatonHistShared& hs,
                                                        BatonSampleShared& sh) {
    u64 acc = 0;
    for (int k = threadIdx.x; k <= b; k += blockDim.x) acc += hs.c[k];
    return baton_block_sum_u64(acc, sh.scratch_u64);
}

// The first bin whose running value exceeds t: hs.bin and hs.before (the values of the bins
// before it), or hs.bin = -1 when t is not below the total. Warp 0: lane l owns bins
// [32 l, 32 l + 32), an exclusive prefix over the lanes' sums finds the one lane whose range
// holds t, which scans its bins again. The caller publishes the answer with a barrier.
__device__ __forceinline__ void baton_hist_scan(u64 t, bool by_count, u64 cutv,
                                                BatonHistShared& hs) {
    if (threadIdx.x >= BATON_WARP) return;
    constexpr int per = BATON_HIST_BINS / BATON_WARP;
    const int lane = threadIdx.x;
    u64 sum = 0;
    for (int k = 0; k < per; ++k) sum += baton_hist_value(hs, lane * per + k, by_count, cutv);
    u64 tot;
    const u64 pre = baton_warp_prefix_u64(sum, tot);
    if (pre <= t && t < pre + sum) {
        u64 b = pre;
        for (int k = 0; k < per; ++k) {
            const int d = lane * per + k;
            const u64 v = baton_hist_value(hs, d, by_count, cutv);
            if (b + v > t) {
                hs.bin = d;
                hs.before = b;
                break;
            }
            b += v;
        }
    } else if (lane == 0 && !(t < tot)) {
        hs.bin = -1;
    }
}

// Step 2's pass: the list = the tokens of bins [lo, bin] (at most BATON_HIST_LIST of them,
// checked by the caller against hs.c), sorted by key (bitonic, padded to a power of two with
// key ~0, which no cleaned logit has); lo is 0 (a prefix list) or bin.
__device__ __noinline__ void baton_hist_compact(const BatonSelect& s, int lo, int bin,
                                                BatonHistShared& hs) {
    if (threadIdx.x == 0) hs.n = 0;
    __syncthreads();
    const float maxv = s.maxv, inv_t = s.inv_t;  // in registers, as in baton_hist_build
    baton_row_walk(s.x, s.vocab, [&](int i, float xi) {
        const float c = baton_clean(xi);
        const int b = baton_hist_bin(c, maxv, inv_t);
        if (b < lo || b > bin) return;
        const u32 j = atomicAdd(&hs.n, 1u);
        if (j >= BATON_HIST_LIST) return;  // unreachable: hs.c[bin] tokens, checked to fit
        hs.key[j] = baton_sort_key(c, (u32)i);
        hs.e[j] = baton_exp_weight(c, maxv, inv_t);
    });
    __syncthreads();
    const u32 n = min(hs.n, (u32)BATON_HIST_LIST);
    u32 np = 1;
    while (np < n) np <<= 1;
    for (u32 j = n + threadIdx.x; j < np; j += blockDim.x) {
        hs.key[j] = ~0ull;
        hs.e[j] = 0.0f;
    }
    __syncthreads();
    for (u32 k = 2; k <= np; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < np; i += blockDim.x) {
                const u32 l = i ^ j;
                if (l <= i) continue;
                const u64 a = hs.key[i], b = hs.key[l];
                if ((a > b) == ((i & k) == 0u)) {
                    hs.key[i] = b;
                    hs.key[l] = a;
                    const float ea = hs.e[i];
                    hs.e[i] = hs.e[l];
                    hs.e[l] = ea;
                }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) {
        hs.list_bin = bin;
        hs.prefix = lo == 0;
        hs.n = n;
    }
    __syncthreads();
}

// The key of the first list entry whose running metric under s exceeds t (requires t below the
// list's total). Each thread owns a contiguous run of entries. Called by the whole block.
__device__ __noinline__ u64 baton_list_select(const BatonSelect& s, u64 t, BatonHistShared& hs,
                                              BatonSampleShared& sh) {
    const u32 n = hs.n;
    const u32 chunk = (n + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(threadIdx.x * chunk, n), hi = min(lo + chunk, n);
    u64 own = 0;
    for (u32 j = lo; j < hi; ++j) own += baton_list_metric(s, hs.key[j], hs.e[j]);
    u64 total;
    u64 run = baton_block_prefix_u64(own, sh.scratch_u64, total);
    u64 found = ~0ull;
    if (run <= t && t < run + own) {
        for (u32 j = lo; j < hi; ++j) {
            run += baton_list_metric(s, hs.key[j], hs.e[j]);
            if (run > t) {
                found = hs.key[j];
                break;
            }
        }
    }
    return baton_block_min_u64(found, sh.scratch_u64);
}

// baton_radix_select(s, t) through the histogram. With a prefix list the answer is read from
// it (every candidate is listed: the list was made for an earlier question, whose answer bounds
// this one's). Otherwise the scan finds the answer's bin b, and: when bins [0, b] hold at most
// a list of tokens, they are listed (a prefix list: this question and every later one are
// answered from it, with no further pass); else, when b alone fits, b is listed and the answer
// read from it (t less the bins before b); else (near-equal logits) the radix select over b's
// tokens alone finds it, whose passes weigh no other token. ok = false (nothing changed) when t
// is not below the total (unreachable for the sampler's questions): the caller asks the radix
// select instead. A count question (top-k) whose answer is in the last bin returns no bound
// (~0): the tokens it would cut have no mass, so no later answer changes.
__device__ __noinline__ u64 baton_hist_select(BatonSelect& s, u64 t, BatonHistShared& hs,
                                              BatonSampleShared& sh, bool& ok) {
    ok = true;
    if (hs.prefix) return baton_list_select(s, t, hs, sh);
    const u64 cutv = baton_cut_total(s, hs, sh);
    baton_hist_scan(t, s.by_count, cutv, hs);
    __syncthreads();
    const int b = hs.bin;
    const u64 before = hs.before;
    ok = b >= 0;
    if (!ok) return 0;
    if (s.by_count && b == BATON_HIST_BINS - 1) return ~0ull;
    u64 key;
    if (baton_hist_count_through(b, hs, sh) <= BATON_HIST_LIST) {
        baton_hist_compact(s, 0, b, hs);
        key = baton_list_select(s, t, hs, sh);
    } else if (hs.c[b] <= BATON_HIST_LIST) {
        if (hs.list_bin != b) baton_hist_compact(s, b, b, hs);
        key = baton_list_select(s, t - before, hs, sh);
    } else {
        s.bin = b;
        key = baton_radix_select(s, t - before, sh);
        s.bin = -1;
    }
    __syncthreads();  // every thread has read hs.cut (baton_cut_total) before it moves
    if (threadIdx.x == 0) hs.cut = b;
    __syncthreads();
    return key;
}

// A question's answer (baton_radix_select(s, t)): through the histogram while hs.fast, else
// (from the first question it could not answer on) the radix select over the row.
__device__ __noinline__ u64 baton_answer(BatonSelect& s, u64 t, BatonHistShared& hs,
                                         BatonSampleShared& sh) {
    if (hs.fast) {
        bool ok;
        const u64 k = baton_hist_select(s, t, hs, sh, ok);
        if (ok) return k;
        __syncthreads();  // every thread has read hs.fast
        if (threadIdx.x == 0) hs.fast = false;
        __syncthreads();
    }
    return baton_radix_select(s, t, sh);
}

// The candidates' total metric under s, as baton_answer answers.
__device__ __noinline__ u64 baton_answer_total(BatonSelect& s, BatonHistShared& hs,
                                               BatonSampleShared& sh) {
    return hs.fast ? baton_hist_total(s, hs, sh) : baton_select_total(s, sh);
}

// The sampled token of a row (not greedy, maxv finite): top-k, top-p and min-p prefixes of the
// key order, then the inverse CDF at u = baton_uniform(seed, *idx) over the kept prefix (the
// row's parameters at pp: read here, not passed in registers); `list`
// (allowed_token_ids, else null) restricts the candidates. The histogram path while it can
// answer (see "Histogram selection"), else the radix select: the same answers. Not inlined, so
// that the kernel's values stay out of the selection's registers (inlined, the 64-register
// sampler spilled 52 bytes, ptxas -v, sm_90).
__device__ __noinline__ u32 baton_sample_token(const float* x, int vocab, float maxv, float inv_t,
                                               const BatonSamplingParams* pp, const u32* idx,
                                               const BatonPenaltyEntry* list, u32 n_list,
                                               BatonSampleShared& sh, BatonHistShared& hs) {
    BatonSelect s = baton_select_init(x, vocab, maxv, inv_t, list, n_list);
    // Candidates before top-k: the vocabulary, or the listed tokens.
    const u64 n_cand = list ? baton_select_total(s, sh) : (u64)vocab;
    if (threadIdx.x == 0) hs.fast = BATON_SAMPLE_HIST != 0 && !list;
    __syncthreads();
    if (hs.fast) baton_hist_build(s, true, true, hs);
    if (pp->top_k > 0 && (u64)pp->top_k < n_cand)
        s.bound = baton_answer(s, (u64)(pp->top_k - 1), hs, sh);
    s.by_count = false;
    if (pp->top_p < 1.0f) {
        const u64 z = baton_answer_total(s, hs, sh);
        const double target = ceil((double)pp->top_p * (double)z);
        u64 t = target > 0.0 ? (u64)target - 1 : 0;
        if (t >= z) t = z - 1;
        s.bound = baton_answer(s, t, hs, sh);
    }
    s.min_p = pp->min_p > 0.0f ? fminf(pp->min_p, 1.0f) : 0.0f;
    if (hs.fast && !hs.prefix && s.min_p > 0.0f) baton_hist_build(s, false, true, hs);
    const u64 m = baton_answer_total(s, hs, sh);
    // floor(u * m) exactly, u = bits / 2^24, m < 2^58.
    const u64 bits = baton_uniform_bits(pp->seed, *idx);
    const u64 t = (m >> 24) * bits + (((m & 0xFFFFFFull) * bits) >> 24);
    return (u32)baton_answer(s, t, hs, sh);
}

#define BATON_SAMPLE_U 8

// v[u] = x[i0 + u * blockDim.x] for the indices below n (the rest left unset): all loads issued
// before any is used.
__device__ __forceinline__ void baton_load_strided(const float* x, int i0, int n,
                                                   float (&v)[BATON_SAMPLE_U]) {
#pragma unroll
    for (int u = 0; u < BATON_SAMPLE_U; ++u) {
        const int i = i0 + u * (int)blockDim.x;
        if (i < n) v[u] = x[i];
    }
}

// Smallest key and max of the cleaned logits x[lo, hi) (key ~0 and -inf when empty), each
// thread loading BATON_SAMPLE_U logits before using them (one load at a time per thread left a
// greedy step latency-bound: 57 us on an H200 for a 128256-token vocabulary in one block).
__device__ float baton_slice_argmax(const float* x, int lo, int hi, BatonSampleShared& sh,
                                    u64& key_out) {
    float best = BATON_NEG_INF;
    u64 best_key = ~0ull;
    for (int i0 = lo + (int)threadIdx.x; i0 < hi; i0 += blockDim.x * BATON_SAMPLE_U) {
        float v[BATON_SAMPLE_U];
        baton_load_strided(x, i0, hi, v);
#pragma unroll
        for (int u = 0; u < BATON_SAMPLE_U; ++u) {
            const int i = i0 + u * (int)blockDim.x;
            if (i >= hi) break;
            const float c = baton_clean(v[u]);
            const u64 k = baton_sort_key(c, (u32)i);
            if (k < best_key) {
                best_key = k;
                best = c;
            }
        }
    }
    key_out = baton_block_min_u64(best_key, sh.scratch_u64);
    return baton_block_max(best, sh.scratch_f);
}

// Smallest key and max of the cleaned logits of the BATON_ENTRY_LISTED tokens of list[0, n)
// (allowed_token_ids), as baton_slice_argmax over a row whose other logits are -inf.
__device__ float baton_list_argmax(const float* x, const BatonPenaltyEntry* list, u32 n,
                                   int vocab, BatonSampleShared& sh, u64& key_out) {
    float best = BATON_NEG_INF;
    u64 best_key = ~0ull;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const BatonPenaltyEntry e = list[j];
        if (!(e.flags & BATON_ENTRY_LISTED) || e.token >= (u32)vocab) continue;
        const float c = baton_clean(x[e.token]);
        const u64 k = baton_sort_key(c, e.token);
        if (k < best_key) {
            best_key = k;
            best = c;
        }
    }
    key_out = baton_block_min_u64(best_key, sh.scratch_u64);
    return baton_block_max(best, sh.scratch_f);
}

// sum exp(clean(x[i]) - maxv) over [lo, hi), maxv finite.
__device__ float baton_slice_expsum(const float* x, int lo, int hi, float maxv,
                                    BatonSampleShared& sh) {
    float acc = 0.0f;
    for (int i0 = lo + (int)threadIdx.x; i0 < hi; i0 += blockDim.x * BATON_SAMPLE_U) {
        float v[BATON_SAMPLE_U];
        baton_load_strided(x, i0, hi, v);
#pragma unroll
        for (int u = 0; u < BATON_SAMPLE_U; ++u)
            if (i0 + u * (int)blockDim.x < hi) acc += expf(baton_clean(v[u]) - maxv);
    }
    return baton_block_sum(acc, sh.scratch_f);
}

// baton_top_logprobs' n_top smallest keys in two reads of the row instead of n_top: a count
// histogram of the raw row (the selection's bins at temperature 1) finds the bin holding the
// n_top-th, and a prefix list of the bins up to it (baton_hist_compact, sorted by key) starts
// with them. Returns false, having written nothing, when those bins hold more tokens than the
// list or the n_top-th is in the last bin (fewer than n_top tokens within 32 nats of the max);
// the caller then takes n_top passes. n_top >= 1, maxv finite. Called by the whole block.
__device__ __noinline__ bool baton_top_logprobs_hist(const float* x, int vocab, int n_top,
                                                     float maxv, float ln_sum, u32* ids,
                                                     float* lps, BatonHistShared& hs,
                                                     BatonSampleShared& sh) {
    const BatonSelect s = baton_select_init(x, vocab, maxv, 1.0f, nullptr, 0u);
    baton_hist_build(s, true, false, hs);  // counts only
    baton_hist_scan((u64)(n_top - 1), true, 0ull, hs);
    __syncthreads();
    const int bin = hs.bin;
    if (bin < 0 || bin == BATON_HIST_BINS - 1) return false;
    if (baton_hist_count_through(bin, hs, sh) > BATON_HIST_LIST) return false;
    baton_hist_compact(s, 0, bin, hs);
    for (int j = threadIdx.x; j < n_top; j += blockDim.x) {
        const u32 id = (u32)hs.key[j];
        ids[j] = id;
        lps[j] = (baton_clean(x[id]) - maxv) - ln_sum;
    }
    return true;
}

// The n_top (<= BATON_MAX_TOP_LOGPROBS) most likely entries of the raw row x[0, vocab) into
// ids / lps [BATON_MAX_TOP_LOGPROBS] (most likely first, ties to the lower id; log-probability
// (clean(x) - maxv) - ln_sum, -inf when maxv is), the rest (0xffffffff, -inf): from a histogram
// and a list (baton_top_logprobs_hist) where it can, else n_top passes, each the smallest key
// after the previous one. Called by the whole block.
__device__ __noinline__ void baton_top_logprobs(const float* x, int vocab, int n_top,
                                                   float maxv, float ln_sum, u32* ids,
                                                   float* lps, BatonSampleShared& sh,
                                                   BatonHistShared& hs) {
    const bool listed = BATON_SAMPLE_HIST != 0 && n_top > 0 && maxv != BATON_NEG_INF &&
                        baton_top_logprobs_hist(x, vocab, n_top, maxv, ln_sum, ids, lps, hs, sh);
    u64 prev = 0;
    for (int j = 0; j < (listed ? 0 : n_top); ++j) {
        u64 found = ~0ull;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const u64 k = baton_sort_key(baton_clean(x[i]), (u32)i);
            if ((j == 0 || k > prev) && k < found) found = k;
        }
        found = baton_block_min_u64(found, sh.scratch_u64);
        prev = found;
        if (threadIdx.x == 0) {
            const u32 id = (u32)found;
            ids[j] = id;
            lps[j] = maxv == BATON_NEG_INF ? BATON_NEG_INF : (baton_clean(x[id]) - maxv) - ln_sum;
        }
    }
    if (threadIdx.x == 0) {
        for (int j = n_top; j < BATON_MAX_TOP_LOGPROBS; ++j) {
            ids[j] = 0xffffffffu;
            lps[j] = BATON_NEG_INF;
        }
    }
}

// One row per block, or, for a row with no penalties, gridDim.y blocks per row.
//
// Split rows: with gridDim.y = S > 1 an unpenalized row is cut into S slices of ceil(vocab / S)
// logits rounded up to a multiple of 32 (the last slices may be short or empty); block (row, s) writes its slice's BatonSamplePartial to partials[row, s], fences, and
// counts itself in counters[row]; the block that brings the count to S combines the partials
// in slice order (argmax = smallest key, max, sum of sum_s exp(max_s - max), so the result does
// not depend on which block arrives last), resets the counter to 0 and finishes the row alone
// (selection passes, top log-probs, outputs). A penalized row is done by block (row, 0) alone
// as with S = 1; its other blocks exit. This keeps a greedy row off a single SM: one block
// reading a 128256-token row took 30 us on an H200 (session 9's Nsight table), S blocks read
// a slice each at once.
//
// Shapes: logits [num_rows, vocab] f32 with row stride `logits_stride` elements; params
// [num_rows] BatonSamplingParams; output_index [num_rows] u32 (the RNG counter); penalty_table:
// the address of this launch's BatonPenaltyEntry array (read through a pointer so that the array
// can be reallocated without recapturing CUDA graphs; only read for penalized rows), whose
// `saved` fields the kernel overwrites; penalty_rows [num_rows] BatonPenaltyRow; input_ids: the
// launch's input-id buffer, read at penalty_rows[row].pending_index. The logits of penalized
// rows are modified during the launch and restored (bit for bit) before it ends. Outputs:
// out_tokens [num_rows] u32 (may point into the worker's sampled-id ring, see
// baton_embedding_gather); out_logprob [num_rows] f32 (0 unless asked); out_top_ids /
// out_top_logprobs [num_rows, 20], the first min(top_logprobs, 20, vocab) entries valid, the
// rest (0xffffffff, -inf). Split rows: partials [num_rows, gridDim.y] BatonSamplePartial
// (scratch); counters [num_rows] int, all 0 before the launch and left 0 after it.
// Launch: grid = (num_rows, S), block = (1024) (any multiple of 32 up to 1024 works); the host
// picks S from the vocabulary (baton_cuda::plan::sample_splits: one slice of 8 logits per
// thread), S = 1 needs neither partials nor counters.
// Cost: 1 pass over the row for greedy (spread over S blocks for an unpenalized row); for sampling, one pass per radix digit actually needed
// (typically 3-5 per select) plus one per mass total, all served from L2 after the first. A
// penalized row adds a pass over its entries before and after selection (plus one over the row
// for the raw max when log-probabilities are wanted).
BATON_ENTRY void __launch_bounds__(1024) baton_sample_f32(
    u32* __restrict__ out_tokens, float* __restrict__ out_logprob, u32* __restrict__ out_top_ids,
    float* __restrict__ out_top_logprobs, float* __restrict__ logits, int logits_stride,
    const BatonSamplingParams* __restrict__ params, const u32* __restrict__ output_index,
    BatonPenaltyEntry* const* __restrict__ penalty_table,
    const BatonPenaltyRow* __restrict__ penalty_rows, const u32* __restrict__ input_ids,
    BatonSamplePartial* __restrict__ partials, int* __restrict__ counters, int vocab) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    __shared__ BatonSampleShared sh;
    __shared__ BatonHistShared hs;
    const int row = blockIdx.x;
    const int splits = (int)gridDim.y;
    float* x = logits + (size_t)row * logits_stride;
    const BatonSamplingParams p = params[row];
    // Clamped as u32 first: (int) of a count >= 2^31 would be negative (the host sends <= 20).
    const int n_top = min((int)min(p.top_logprobs, (u32)BATON_MAX_TOP_LOGPROBS), vocab);
    const bool want = p.want_logprob != 0 || n_top > 0;

    const BatonPenaltyRow pr = penalty_rows[row];
    const bool penalized = pr.count > 0 || pr.pending_index >= 0;
    const bool allow = penalized && p.allowed_only != 0;  // allowed_token_ids: walk the list
    BatonPenaltyEntry* pe = nullptr;
    u32 pend = 0xffffffffu;
    u64 best_key;
    float maxv;  // of the penalized row (selection), later of the raw row (log-probabilities)
    float ln_sum = 0.0f;
    bool have_ln_sum = false;
    if (!penalized && splits > 1) {
        // Split row: this block's slice, published and counted.
        // ceil(vocab / S) rounded up to 32 logits, so every slice starts on a 128-byte line.
        const int chunk = ((vocab + splits - 1) / splits + 31) / 32 * 32;
        const int lo = min((int)blockIdx.y * chunk, vocab), hi = min(lo + chunk, vocab);
        u64 k;
        const float m = baton_slice_argmax(x, lo, hi, sh, k);
        const float sum = want && m != BATON_NEG_INF ? baton_slice_expsum(x, lo, hi, m, sh) : 0.0f;
        BatonSamplePartial* part = partials + (size_t)row * splits;
        if (threadIdx.x == 0) {
            part[blockIdx.y].key = k;
            part[blockIdx.y].maxv = m;
            part[blockIdx.y].sum = sum;
            __threadfence();  // the partial is visible device-wide before the count
            sh.last = atomicAdd(counters + row, 1) == splits - 1;
        }
        __syncthreads();
        if (!sh.last) return;
        __threadfence();  // every other slice's partial is visible to this block's reads
        // Combine in slice order (L2 reads, past L1): the same result whichever block is last.
        u64 kk = ~0ull;
        float mm = BATON_NEG_INF;
        for (int i = threadIdx.x; i < splits; i += blockDim.x) {
            const u64 ki = __ldcg(&part[i].key);
            kk = ki < kk ? ki : kk;
            mm = fmaxf(mm, __ldcg(&part[i].maxv));
        }
        best_key = baton_block_min_u64(kk, sh.scratch_u64);
        maxv = baton_block_max(mm, sh.scratch_f);
        if (want && maxv != BATON_NEG_INF) {
            float acc = 0.0f;
            for (int i = threadIdx.x; i < splits; i += blockDim.x) {
                const float mi = __ldcg(&part[i].maxv);
                if (mi != BATON_NEG_INF) acc += __ldcg(&part[i].sum) * expf(mi - maxv);
            }
            ln_sum = logf(baton_block_sum(acc, sh.scratch_f));
            have_ln_sum = true;
        }
        if (threadIdx.x == 0) counters[row] = 0;  // ready for the next launch
    } else if (blockIdx.y != 0) {
        return;  // a penalized row (or S = 1): block 0 does it all
    } else {
        if (penalized) {
            // Penalties, in place (entries are distinct tokens: no two threads write one
            // logit).
            pe = *penalty_table + pr.offset;
            if (pr.pending_index >= 0) pend = input_ids[pr.pending_index];
            if (threadIdx.x == 0) sh.pending_listed = 0;
            __syncthreads();
            for (u32 i = threadIdx.x; i < pr.count; i += blockDim.x)
                if (pe[i].token == pend) sh.pending_listed = 1;  // one entry at most: one writer
            __syncthreads();
            for (u32 i = threadIdx.x; i < pr.count; i += blockDim.x) {
                const BatonPenaltyEntry e = pe[i];
                if (e.token >= (u32)vocab) continue;
                const float v = x[e.token];
                pe[i].saved = v;
                x[e.token] = baton_penalize(v, e.bias, e.output_count + (e.token == pend ? 1u : 0u),
                                            (e.flags & BATON_ENTRY_IN_PROMPT) != 0, p);
            }
            if (threadIdx.x == 0 && pend < (u32)vocab && !sh.pending_listed) {
                // A fresh entry: one output occurrence, not in the prompt.
                sh.pending_saved = x[pend];
                x[pend] = baton_penalize(sh.pending_saved, 0.0f, 1u, false, p);
            }
            __syncthreads();
        }
        // Pass 1: max of the cleaned logits and the argmax (ties to the lowest id, NaN never
        // wins); with allowed_token_ids, of the listed tokens only.
        if (allow) {
            maxv = baton_list_argmax(x, pe, pr.count, vocab, sh, best_key);
            if (maxv == BATON_NEG_INF) best_key = 0;  // as an all -inf row: token 0
        } else {
            maxv = baton_slice_argmax(x, 0, vocab, sh, best_key);
        }
    }
    const u32 argmax = vocab > 0 ? (u32)best_key : 0u;

    const float inv_t = 1.0f / p.temperature;
    const bool greedy = !(p.temperature > 0.0f) || p.top_k == 1 || isinf(inv_t);
    u32 token = argmax;
    if (!greedy && maxv != BATON_NEG_INF) {
        token = baton_sample_token(x, vocab, maxv, inv_t, params + row, output_index + row,
                                   allow ? pe : nullptr, allow ? pr.count : 0u, sh, hs);
    } else if (!greedy) {
        token = 0;  // every logit is -inf / NaN
    }

    if (penalized) {
        // Restore the raw logits (every read of the penalized row is done), then the raw max.
        __syncthreads();
        for (u32 i = threadIdx.x; i < pr.count; i += blockDim.x) {
            const u32 t = pe[i].token;
            if (t < (u32)vocab) x[t] = pe[i].saved;
        }
        if (threadIdx.x == 0 && pend < (u32)vocab && !sh.pending_listed) x[pend] = sh.pending_saved;
        __syncthreads();
        if (want) {
            u64 unused;
            maxv = baton_slice_argmax(x, 0, vocab, sh, unused);
        }
    }
    if (want && !have_ln_sum && maxv != BATON_NEG_INF)
        ln_sum = logf(baton_slice_expsum(x, 0, vocab, maxv, sh));
    baton_top_logprobs(x, vocab, n_top, maxv, ln_sum,
                       out_top_ids + (size_t)row * BATON_MAX_TOP_LOGPROBS,
                       out_top_logprobs + (size_t)row * BATON_MAX_TOP_LOGPROBS, sh, hs);
    if (threadIdx.x == 0) {
        out_tokens[row] = token;
        float lp = 0.0f;
        if (want)
            lp = (maxv == BATON_NEG_INF || vocab == 0)
                     ? BATON_NEG_INF
                     : (baton_clean(x[token]) - maxv) - ln_sum;
        out_logprob[row] = lp;
    }
}

// Prompt scoring (prompt log-probabilities, `echo` with `logprobs` and vLLM's
// `prompt_logprobs`): for row r of logits [num_rows, vocab] f32 (row stride `vocab`), the
// position's distribution, and tokens[r], the prompt token that follows it, what the CPU
// worker's Sampler::score and sampling::rank_of give (crates/worker/src/sampling.rs):
//   out_logprob[r] = (clean(x[token]) - max) - ln(sum_i exp(clean(x[i]) - max)) (f32 here, the
//                    CPU sums in f64: within float rounding), -inf for an all -inf row or a
//                    token outside the vocabulary;
//   out_rank[r]    = 1 + #{i : clean(x[i]) > clean(x[token])} (ties share a rank), 0 for a
//                    token outside the vocabulary;
//   out_top_ids / out_top_logprobs [num_rows, 20]: the min(n_top, 20, vocab) most likely
//                    entries as the sampler's top log-probabilities, the rest (0xffffffff, -inf).
// Replaces a 4 * vocab byte copy and a host pass per scored position.
// Launch: grid = (num_rows), block = (1024) (any multiple of 32 up to 1024 works).
BATON_ENTRY void __launch_bounds__(1024) baton_score_rows(
    float* __restrict__ out_logprob, u32* __restrict__ out_rank, u32* __restrict__ out_top_ids,
    float* __restrict__ out_top_logprobs, const float* __restrict__ logits,
    const u32* __restrict__ tokens, int vocab, int n_top) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    __shared__ BatonSampleShared sh;
    __shared__ BatonHistShared hs;
    const int row = blockIdx.x;
    const float* x = logits + (size_t)row * vocab;
    const u32 token = tokens[row];
    const int nt = max(min(min(n_top, BATON_MAX_TOP_LOGPROBS), vocab), 0);
    u64 unused;
    const float maxv = baton_slice_argmax(x, 0, vocab, sh, unused);
    const float ln_sum =
        maxv == BATON_NEG_INF ? 0.0f : logf(baton_slice_expsum(x, 0, vocab, maxv, sh));
    const bool inside = token < (u32)vocab;
    const float xt = inside ? baton_clean(x[token]) : BATON_NEG_INF;
    u32 above = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) above += baton_clean(x[i]) > xt;
    const u64 n_above = baton_block_sum_u64((u64)above, sh.scratch_u64);
    baton_top_logprobs(x, vocab, nt, maxv, ln_sum,
                       out_top_ids + (size_t)row * BATON_MAX_TOP_LOGPROBS,
                       out_top_logprobs + (size_t)row * BATON_MAX_TOP_LOGPROBS, sh, hs);
    if (threadIdx.x == 0) {
        out_logprob[row] =
            (!inside || maxv == BATON_NEG_INF) ? BATON_NEG_INF : (xt - maxv) - ln_sum;
        out_rank[row] = inside ? (u32)(1 + n_above) : 0u;
    }
}

// RNG probe for CPU/GPU agreement tests: out[i] = top 24 bits of Philox word 0 for
// (seeds[i], output_index[i]), i.e. uniform * 2^24. Launch: grid = (ceil(n / 256)), block = 256.
BATON_ENTRY void baton_sampling_uniform_bits(u32* __restrict__ out,
                                             const u64* __restrict__ seeds,
                                             const u32* __restrict__ output_index,
                                             int n) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = baton_uniform_bits(seeds[i], output_index[i]);
}

// Philox probe for known-answer tests: out[i] = philox4x32_10(ctr[i], key[i]).
// Launch: grid = (ceil(n / 256)), block = 256.
BATON_ENTRY void baton_philox4x32_10_probe(uint4* __restrict__ out,
                                           const uint4* __restrict__ ctr,
                                           const uint2* __restrict__ key, int n) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = baton_philox4x32_10(ctr[i], key[i]);
}
