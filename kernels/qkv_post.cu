// Post-processing of the fused QKV projection for Qwen2 and Qwen3, in place, between the QKV
// projection and RoPE (baton_rope_and_cache, or the decode attention kernel that fuses RoPE and
// the cache write). Llama-family models do not launch it.
//
// - Qwen2 (`qkv_bias`): q_proj, k_proj and v_proj carry biases; each element of every head gets
//   its bias: y = round(x + b). HF's biased projection yields an elem_t tensor, so the biased
//   value is rounded once here; x itself is the projection already rounded by the GEMM/GEMV
//   (one rounding more than a bias fused into cuBLAS' epilogue, within an ulp).
// - Qwen3 (`qk_norm`): every q head and every k head is RMSNorm'd over head_dim, Qwen3RMSNorm
//   numerics as baton_rmsnorm (rmsnorm.cu): inv = 1 / sqrt(mean(y^2) + eps) in fp32 over the
//   stored (rounded) values, out = round(w * round(y * inv)). q heads use q_norm, k heads
//   k_norm (one [head_dim] weight shared by all heads of a kind); v heads are not normalized.
// With both, the bias comes first and the norm reads the biased, rounded values.
//
// Shapes: qkv [num_tokens, stride] elem_t; row t holds the q heads, then the k heads, then the
// v heads, head j (j < num_q_heads + 2 * num_kv_heads) at qkv[t * stride + j * head_dim ..]
// [head_dim]. bias [(num_q_heads + 2 * num_kv_heads) * head_dim] elem_t (q | k | v, the order
// of the fused weight) or null: no bias. norm [2 * head_dim] elem_t (q_norm | k_norm) or null:
// no norm. At least one of them is non-null (the executor launches nothing otherwise).
// Launch: grid = (num_tokens, ceil(H / (blockDim.x / 32))), block = any multiple of 32 (the
// executor uses 128), H = num_q_heads + num_kv_heads, plus num_kv_heads when there is a bias
// (the v heads). One warp per (token, head): lanes strided over head_dim, the sum of squares
// reduced with shuffles (no shared memory, no __syncthreads). Warps past H return at once.
BATON_ENTRY void baton_qkv_post(elem_t* __restrict__ qkv, const elem_t* __restrict__ bias,
                                const elem_t* __restrict__ norm, int num_tokens,
                                int num_q_heads, int num_kv_heads, int head_dim, int stride,
                                float eps) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int normed = num_q_heads + num_kv_heads;
    const int heads = normed + (bias != nullptr ? num_kv_heads : 0);
    if (head >= heads) return;  // the whole warp: `head` is uniform across its lanes
    elem_t* x = qkv + (size_t)t * stride + (size_t)head * head_dim;
    const bool do_norm = norm != nullptr && head < normed;
    // Pass 1: the bias (written back rounded), and the statistic over the stored values. Each
    // lane reads back in pass 2 only the elements it wrote itself.
    float ss = 0.0f;
    if (bias != nullptr) {
        const elem_t* b = bias + (size_t)head * head_dim;
        for (int i = lane; i < head_dim; i += BATON_WARP) {
            const elem_t y = baton_from_f(baton_to_f(x[i]) + baton_to_f(b[i]));
            x[i] = y;
            const float v = baton_to_f(y);
            ss = fmaf(v, v, ss);
        }
    } else if (do_norm) {
        for (int i = lane; i < head_dim; i += BATON_WARP) {
            const float v = baton_to_f(x[i]);
            ss = fmaf(v, v, ss);
        }
    }
    if (!do_norm) return;
    ss = baton_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    const elem_t* w = norm + (head < num_q_heads ? 0 : head_dim);
    for (int i = lane; i < head_dim; i += BATON_WARP) {
        const float n = baton_round(baton_to_f(x[i]) * inv);
        x[i] = baton_from_f(baton_to_f(w[i]) * n);
    }
}
