// Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE; baton_model::MoeConfig): routing,
// grouping the (token, expert) pairs by expert, the experts' grouped GEMMs, and the weighted
// sum. One MoE layer on the device, after the router's cuBLAS GEMM gives f32 logits
// [num_tokens, num_experts]:
//   baton_moe_route    top-k experts and weights per token (softmax, ties to the lower id,
//                      optional renormalization; ids ascending)
//   baton_moe_align    the pairs p = token * top_k + slot sorted by expert, cut into tiles of
//                      at most BATON_MOE_BM pairs of one expert
//   baton_moe_gemm     per tile: out[p, :] = W_e · in[row(p), :] (gate|up, then down)
//   baton_silu_and_mul on [num_pairs, 2 * moe_inter] (activation.cu)
//   baton_moe_combine  out[t, :] = sum_j w[t, j] * y[t * top_k + j, :] (+ the shared expert)
// Every launch has a grid fixed by num_tokens (a tile index past the step's tile count exits),
// so the sequence is captured in CUDA graphs like the dense layers. The numerics follow the CPU
// reference (crates/model/src/cpu.rs, Moe::forward) and transformers' sparse MoE blocks: f32
// softmax, weights applied to each expert's output, summed from zero in ascending expert id.

// Most experts per token (num_experts_per_tok) and experts per layer the kernels take.
#define BATON_MOE_MAX_TOPK 32
#define BATON_MOE_MAX_EXPERTS 1024
// Pairs per grouped-GEMM tile, output columns per block (BATON_MOE_BN / 8 per warp), and the
// K chunk staged in shared memory (f32).
#define BATON_MOE_BM 8
#define BATON_MOE_BN 32
#define BATON_MOE_KC 512

// Per token, its top_k experts and routing weights.
//
// logits [num_tokens, num_experts] f32 (the router GEMM's); out topk_ids [num_tokens, top_k] int
// and topk_w [num_tokens, top_k] f32, each row by ascending expert id. p = softmax(logits) with
// exp(l - max) / sum; the top_k largest p, ties to the lower expert id; weights p, or p / (sum
// of the chosen p, in rank order) when renorm != 0.
// Launch: grid = (num_tokens), block = (32): one warp per token. top_k <= BATON_MOE_MAX_TOPK.
BATON_ENTRY void baton_moe_route(int* __restrict__ topk_ids, float* __restrict__ topk_w,
                                 const float* __restrict__ logits, int num_tokens,
                                 int num_experts, int top_k, int renorm) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)t * num_experts;
    float m = -3.402823466e38f;
    for (int e = lane; e < num_experts; e += 32) m = fmaxf(m, l[e]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float s = 0.0f;
    for (int e = lane; e < num_experts; e += 32) s += expf(l[e] - m);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    __shared__ int chosen[BATON_MOE_MAX_TOPK];
    __shared__ float chosen_p[BATON_MOE_MAX_TOPK];
    for (int j = 0; j < top_k; ++j) {
        float best = -1.0f;
        int best_id = num_experts;
        for (int e = lane; e < num_experts; e += 32) {
            bool taken = false;
            for (int q = 0; q < j; ++q) taken |= chosen[q] == e;
            if (taken) continue;
            const float p = expf(l[e] - m) / s;
            if (p > best) {
                best = p;
                best_id = e;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, off);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, off);
            if (ob > best || (ob == best && oi < best_id)) {
                best = ob;
                best_id = oi;
            }
        }
        if (lane == 0) {
            chosen[j] = best_id;
            chosen_p[j] = best;
        }
        __syncthreads();
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) sum += chosen_p[j];
        const float norm = renorm ? sum : 1.0f;
        // Insertion sort by expert id (top_k is small).
        for (int j = 1; j < top_k; ++j) {
            const int id = chosen[j];
            const float p = chosen_p[j];
            int q = j - 1;
            while (q >= 0 && chosen[q] > id) {
                chosen[q + 1] = chosen[q];
                chosen_p[q + 1] = chosen_p[q];
                --q;
            }
            chosen[q + 1] = id;
            chosen_p[q + 1] = p;
        }
        for (int j = 0; j < top_k; ++j) {
            topk_ids[(size_t)t * top_k + j] = chosen[j];
            topk_w[(size_t)t * top_k + j] = chosen_p[j] / norm;
        }
    }
}

// Sorts the pairs p in [0, num_pairs) (p = token * top_k + slot) by their expert topk_ids[p] and
// cuts each expert's run into tiles of at most BATON_MOE_BM pairs.
//
// Out sorted_pairs [num_pairs] int: the pairs of expert 0, then of expert 1, ... (within an
// expert in no set order: each pair's GEMM rows do not depend on the others'); tiles [1 + 3 *
// max_tiles] int: the tile count, then per tile (expert, first index into sorted_pairs, end of
// the expert's run). max_tiles >= ceil(num_pairs / BATON_MOE_BM) + num_experts, which no
// routing exceeds.
// Launch: grid = (1), block = (1024). num_experts <= BATON_MOE_MAX_EXPERTS.
BATON_ENTRY void baton_moe_align(int* __restrict__ sorted_pairs, int* __restrict__ tiles,
                                 const int* __restrict__ topk_ids, int num_pairs,
                                 int num_experts) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    __shared__ int cursor[BATON_MOE_MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) cursor[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) atomicAdd(&cursor[topk_ids[p] + 1], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = 0;
        for (int e = 0; e < num_experts; ++e) {
            const int start = cursor[e];
            const int end = start + cursor[e + 1];
            for (int s = start; s < end; s += BATON_MOE_BM) {
                tiles[1 + 3 * n] = e;
                tiles[2 + 3 * n] = s;
                tiles[3 + 3 * n] = end;
                ++n;
            }
            cursor[e + 1] = end;  // counts become run ends: cursor[e] is expert e's start
        }
        tiles[0] = n;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int pos = atomicAdd(&cursor[topk_ids[p]], 1);
        sorted_pairs[pos] = p;
    }
}

// The experts' grouped GEMM: for each pair p of a tile of expert e,
// out[p, n] = sum_k in[row(p), k] * w[e, n, k], row(p) = p / top_k when gather_tokens (the
// layer's normalized input [num_tokens, k_in]) else p (the activations [num_pairs, k_in]).
//
// w [num_experts, n_out, k_in] elem_t (each expert's matrix row-major); out [num_pairs, n_out]
// elem_t; sorted_pairs and tiles from baton_moe_align. Each output is one fp32 sum in a fixed
// order (lane l of a warp adds k = l, l + 32, ... over the K chunks in order, then a xor-shuffle
// tree), rounded once: it depends on k_in alone, never on which pairs share its tile.
// Launch: grid = (max_tiles, ceil(n_out / BATON_MOE_BN)), block = (256): a block computes
// BATON_MOE_BN columns for the tile's pairs, warp w the columns n0 + w + 8 c. (Tiles on x,
// whose limit is 2^31 - 1: a long prefill's pairs make more than y's 65535.)
BATON_ENTRY void baton_moe_gemm(elem_t* __restrict__ out, const elem_t* __restrict__ in,
                                const elem_t* __restrict__ w,
                                const int* __restrict__ sorted_pairs,
                                const int* __restrict__ tiles, int n_out, int k_in, int top_k,
                                int gather_tokens) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int tile = blockIdx.x;
    if (tile >= tiles[0]) return;
    const int e = tiles[1 + 3 * tile];
    const int start = tiles[2 + 3 * tile];
    const int end = tiles[3 + 3 * tile];
    const int rows = end - start < BATON_MOE_BM ? end - start : BATON_MOE_BM;
    __shared__ float a[BATON_MOE_BM][BATON_MOE_KC];
    __shared__ int src[BATON_MOE_BM];
    __shared__ int dst[BATON_MOE_BM];
    if (threadIdx.x < BATON_MOE_BM) {
        const int p = (int)threadIdx.x < rows ? sorted_pairs[start + threadIdx.x] : 0;
        dst[threadIdx.x] = p;
        src[threadIdx.x] = gather_tokens ? p / top_k : p;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n0 = blockIdx.y * BATON_MOE_BN;
    const elem_t* we = w + (size_t)e * n_out * k_in;
    constexpr int COLS = BATON_MOE_BN / 8;
    float acc[COLS][BATON_MOE_BM];
#pragma unroll
    for (int c = 0; c < COLS; ++c)
#pragma unroll
        for (int r = 0; r < BATON_MOE_BM; ++r) acc[c][r] = 0.0f;
    for (int k0 = 0; k0 < k_in; k0 += BATON_MOE_KC) {
        const int kc = k_in - k0 < BATON_MOE_KC ? k_in - k0 : BATON_MOE_KC;
        __syncthreads();
        for (int i = threadIdx.x; i < BATON_MOE_BM * BATON_MOE_KC; i += blockDim.x) {
            const int r = i / BATON_MOE_KC;
            const int kk = i % BATON_MOE_KC;
            a[r][kk] = r < rows && kk < kc ? baton_to_f(in[(size_t)src[r] * k_in + k0 + kk])
                                           : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = n0 + warp + 8 * c;
            if (n >= n_out) continue;
            const elem_t* wr = we + (size_t)n * k_in + k0;
            for (int kk = lane; kk < kc; kk += 32) {
                const float wv = baton_to_f(wr[kk]);
#pragma unroll
                for (int r = 0; r < BATON_MOE_BM; ++r) acc[c][r] += wv * a[r][kk];
            }
        }
    }
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int n = n0 + warp + 8 * c;
#pragma unroll
        for (int r = 0; r < BATON_MOE_BM; ++r) {
            float v = acc[c][r];
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0 && r < rows && n < n_out)
                out[(size_t)dst[r] * n_out + n] = baton_from_f(v);
        }
    }
}

// The mixture's output per token: out[t, i] = sum_j y[t * top_k + j, i] * topk_w[t * top_k + j]
// from zero in slot order (ascending expert id), plus sigmoid(shared_gate[t]) * shared[t, i]
// when shared is not null (Qwen2-MoE's shared expert); fp32, rounded once.
//
// y [num_tokens * top_k, hidden] elem_t; topk_w as baton_moe_route's; shared [num_tokens,
// hidden] elem_t and shared_gate [num_tokens] f32, or both null; out [num_tokens, hidden].
// Launch: grid = (num_tokens), block = (256).
BATON_ENTRY void baton_moe_combine(elem_t* __restrict__ out, const elem_t* __restrict__ y,
                                   const float* __restrict__ topk_w,
                                   const elem_t* __restrict__ shared,
                                   const float* __restrict__ shared_gate, int num_tokens,
                                   int top_k, int hidden) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const float* wt = topk_w + (size_t)t * top_k;
    const float g = shared ? 1.0f / (1.0f + expf(-shared_gate[t])) : 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j)
            acc += baton_to_f(y[((size_t)t * top_k + j) * hidden + i]) * wt[j];
        if (shared) acc += g * baton_to_f(shared[(size_t)t * hidden + i]);
        out[(size_t)t * hidden + i] = baton_from_f(acc);
    }
}
