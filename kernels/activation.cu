// SiLU-and-mul (SwiGLU MLP): out = silu(gate) * up, in fp32, rounded once to elem_t; and
// GELU(tanh)-and-mul (Gemma's GeGLU MLP, below).
//
// Shapes: in [num_tokens, 2 * inter] elem_t, the gate half first then the up half (the layout of
// a fused gate_up projection); out [num_tokens, inter] elem_t. silu(x) = x / (1 + exp(-x)), with
// the accurate expf (the f32 build follows the CPU reference).
// Launch: grid = (num_tokens), block = (256); 16-byte vectors when inter % BATON_VEC == 0 and the
// rows are aligned.
__device__ __forceinline__ float baton_silu(float x) { return x / (1.0f + expf(-x)); }

// GELU(tanh) (Gemma 3's MLP, `gelu_pytorch_tanh`): PyTorch's tanh formula
// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x^3 as x * x * x (the CPU
// reference's order, crates/model/src/vmath.rs gelu_tanh_mul).
__device__ __forceinline__ float baton_gelu_tanh(float x) {
    const float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
    const float inner = kBeta * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
}

// out = act(gate) * up for one token's row; GELU picks the activation.
template <bool GELU>
__device__ __forceinline__ void baton_act_and_mul(elem_t* __restrict__ out,
                                                  const elem_t* __restrict__ in, int num_tokens,
                                                  int inter) {
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const elem_t* gate = in + (size_t)t * 2 * inter;
    const elem_t* up = gate + inter;
    elem_t* o = out + (size_t)t * inter;
    auto act = [](float x) { return GELU ? baton_gelu_tanh(x) : baton_silu(x); };
    if (inter % BATON_VEC == 0 && baton_aligned16(gate) && baton_aligned16(up) &&
        baton_aligned16(o)) {
        const int n = inter / BATON_VEC;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const baton_vec g = reinterpret_cast<const baton_vec*>(gate)[i];
            const baton_vec u = reinterpret_cast<const baton_vec*>(up)[i];
            baton_vec r;
#pragma unroll
            for (int j = 0; j < BATON_VEC; ++j)
                r.e[j] = baton_from_f(act(baton_to_f(g.e[j])) * baton_to_f(u.e[j]));
            reinterpret_cast<baton_vec*>(o)[i] = r;
        }
    } else {
        for (int i = threadIdx.x; i < inter; i += blockDim.x)
            o[i] = baton_from_f(act(baton_to_f(gate[i])) * baton_to_f(up[i]));
    }
}

BATON_ENTRY void baton_silu_and_mul(elem_t* __restrict__ out,
                                    const elem_t* __restrict__ in, int num_tokens,
                                    int inter) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    baton_act_and_mul<false>(out, in, num_tokens, inter);
}

// GELU(tanh)-and-mul (Gemma 3's MLP): shapes and launch as baton_silu_and_mul.
BATON_ENTRY void baton_gelu_tanh_and_mul(elem_t* __restrict__ out,
                                         const elem_t* __restrict__ in, int num_tokens,
                                         int inter) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    baton_act_and_mul<true>(out, in, num_tokens, inter);
}
