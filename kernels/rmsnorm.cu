// RMSNorm and fused residual-add + RMSNorm (Llama / HF `LlamaRMSNorm` numerics).
//
// out = round(round(x * inv) * weight) with inv = 1 / sqrt(mean(x^2) + eps), statistics in fp32
// over the stored (elem_t) values, matching HF (normalize in fp32, round to the activation dtype,
// multiply by the weight). `1.0f / sqrtf` (IEEE, no fast-math) rather than rsqrtf, so the f32
// build follows the CPU reference's arithmetic as closely as a parallel sum allows.

// out[t, :] = rmsnorm(in[t, :]) * weight.
// Shapes: in, out [num_tokens, hidden] elem_t (row stride `hidden`); weight [hidden] elem_t.
// Launch: grid = (num_tokens), block = (1024) or any multiple of 32 up to 1024.
BATON_ENTRY void baton_rmsnorm(elem_t* __restrict__ out, const elem_t* __restrict__ in,
                               const elem_t* __restrict__ weight, int num_tokens,
                               int hidden, float eps) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    __shared__ float scratch[33];
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const elem_t* x = in + (size_t)t * hidden;
    const float ss = baton_row_sumsq(x, hidden, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    elem_t* y = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float n = baton_round(baton_to_f(x[i]) * inv);
        y[i] = baton_from_f(baton_to_f(weight[i]) * n);
    }
}

// Fused residual add + RMSNorm (vLLM `fused_add_rms_norm` contract):
//   residual[t, :] = round(residual[t, :] + x[t, :])        (written in place)
//   out[t, :]      = rmsnorm(residual[t, :]) * weight        (on the rounded residual, as HF)
// Shapes: x, residual, out [num_tokens, hidden] elem_t; weight [hidden] elem_t. `out` may alias
// `x` (each thread reads x[i] before writing out[i], same index).
// Launch: grid = (num_tokens), block = (1024) or any multiple of 32 up to 1024.
BATON_ENTRY void baton_add_rmsnorm(elem_t* out, elem_t* __restrict__ residual,
                                   const elem_t* x, const elem_t* __restrict__ weight,
                                   int num_tokens, int hidden, float eps) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    __shared__ float scratch[33];
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const elem_t* xr = x + (size_t)t * hidden;
    elem_t* r = residual + (size_t)t * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const elem_t s = baton_from_f(baton_to_f(r[i]) + baton_to_f(xr[i]));
        r[i] = s;
        const float v = baton_to_f(s);
        ss = fmaf(v, v, ss);
    }
    // The block sum's __syncthreads also orders each thread's residual writes before the
    // re-reads below (same thread, same indices: no cross-thread dependency).
    ss = baton_block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    elem_t* y = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float n = baton_round(baton_to_f(r[i]) * inv);
        y[i] = baton_from_f(baton_to_f(weight[i]) * n);
    }
}
