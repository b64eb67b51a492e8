// RMSNorm and fused residual-add + RMSNorm (Llama / HF `LlamaRMSNorm` numerics).
//
// out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), statistics in fp32 over the bf16 values,
// matching HF (normalize in fp32, round to bf16, multiply by the bf16 weight).

// out[t, :] = rmsnorm(in[t, :]) * weight.
// Shapes: in, out [num_tokens, hidden] bf16 (row stride `hidden`); weight [hidden] bf16.
// Launch: grid = (num_tokens), block = (1024) or any multiple of 32 up to 1024.
extern "C" __global__ void baton_rmsnorm_bf16(bf16* __restrict__ out, const bf16* __restrict__ in,
                                              const bf16* __restrict__ weight, int num_tokens,
                                              int hidden, float eps) {
    __shared__ float scratch[33];
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const bf16* x = in + (size_t)t * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = __bfloat162float(x[i]);
        ss += v * v;
    }
    ss = baton_block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)hidden + eps);
    bf16* y = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float n = __bfloat162float(__float2bfloat16(__bfloat162float(x[i]) * inv));
        y[i] = __float2bfloat16(n * __bfloat162float(weight[i]));
    }
}

// Fused residual add + RMSNorm (vLLM `fused_add_rms_norm` contract):
//   residual[t, :] = bf16(residual[t, :] + x[t, :])        (written in place)
//   out[t, :]      = rmsnorm(residual[t, :]) * weight       (on the rounded residual, as HF)
// Shapes: x, residual, out [num_tokens, hidden] bf16; weight [hidden] bf16. `out` may alias `x`.
// Launch: grid = (num_tokens), block = (1024) or any multiple of 32 up to 1024.
extern "C" __global__ void baton_add_rmsnorm_bf16(bf16* out, bf16* __restrict__ residual,
                                                  const bf16* x,
                                                  const bf16* __restrict__ weight,
                                                  int num_tokens, int hidden, float eps) {
    __shared__ float scratch[33];
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const bf16* xr = x + (size_t)t * hidden;
    bf16* r = residual + (size_t)t * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const bf16 s = __float2bfloat16(__bfloat162float(r[i]) + __bfloat162float(xr[i]));
        r[i] = s;
        const float v = __bfloat162float(s);
        ss += v * v;
    }
    // The block sum's __syncthreads also orders each thread's residual writes before the
    // re-reads below (same thread, same indices: no cross-thread dependency).
    ss = baton_block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)hidden + eps);
    bf16* y = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float n = __bfloat162float(__float2bfloat16(__bfloat162float(r[i]) * inv));
        y[i] = __float2bfloat16(n * __bfloat162float(weight[i]));
    }
}
