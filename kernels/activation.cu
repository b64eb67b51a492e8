// SiLU-and-mul (SwiGLU MLP): out = silu(gate) * up, in fp32, rounded once to bf16.
//
// Shapes: in [num_tokens, 2 * inter] bf16, the gate half first then the up half (the layout of a
// fused gate_up projection); out [num_tokens, inter] bf16. silu(x) = x / (1 + exp(-x)).
// Launch: grid = (num_tokens), block = (256); 8-wide vectors when inter % 8 == 0.
__device__ __forceinline__ float baton_silu(float x) { return x / (1.0f + __expf(-x)); }

extern "C" __global__ void baton_silu_and_mul_bf16(bf16* __restrict__ out,
                                                   const bf16* __restrict__ in, int num_tokens,
                                                   int inter) {
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const bf16* gate = in + (size_t)t * 2 * inter;
    const bf16* up = gate + inter;
    bf16* o = out + (size_t)t * inter;
    if ((inter & 7) == 0) {
        const int n8 = inter >> 3;
        for (int i = threadIdx.x; i < n8; i += blockDim.x) {
            const baton_bf16x8 g = reinterpret_cast<const baton_bf16x8*>(gate)[i];
            const baton_bf16x8 u = reinterpret_cast<const baton_bf16x8*>(up)[i];
            baton_bf16x8 r;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 gf = __bfloat1622float2(g.h[j]);
                const float2 uf = __bfloat1622float2(u.h[j]);
                r.h[j] = __floats2bfloat162_rn(baton_silu(gf.x) * uf.x, baton_silu(gf.y) * uf.y);
            }
            reinterpret_cast<baton_bf16x8*>(o)[i] = r;
        }
    } else {
        for (int i = threadIdx.x; i < inter; i += blockDim.x)
            o[i] = __float2bfloat16(baton_silu(__bfloat162float(gate[i])) *
                                    __bfloat162float(up[i]));
    }
}
