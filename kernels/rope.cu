// Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) convention, applied in place.
//
// For each head vector v of size head_dim = 2h and i < h, with a = position * inv_freq[i]:
//   v'[i]     = v[i]     * cos(a) - v[i + h] * sin(a)
//   v'[i + h] = v[i + h] * cos(a) + v[i]     * sin(a)
// inv_freq [h] f32 is computed on the host (base^(-2i/d), with llama3 / other scaling applied
// there), so this kernel is scaling-agnostic. The angle is formed in fp32 as HF does
// (float(position) * inv_freq) and cos/sin use the accurate sincosf (angles reach ~1e5 rad).
//
// Shapes: q [num_tokens, num_q_heads, head_dim] with token stride `q_stride` elements;
// k [num_tokens, num_kv_heads, head_dim] with token stride `k_stride` (strides let q and k be
// views into a fused QKV projection output); positions [num_tokens] int.
// Launch: grid = (num_tokens), block = (128); threads loop over (head, i) pairs.
BATON_ENTRY void baton_rope(elem_t* __restrict__ q, elem_t* __restrict__ k,
                            const int* __restrict__ positions,
                            const float* __restrict__ inv_freq, int num_tokens,
                            int num_q_heads, int num_kv_heads, int head_dim,
                            int q_stride, int k_stride) {
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int half = head_dim >> 1;
    const float pos = (float)positions[t];
    const int total = (num_q_heads + num_kv_heads) * half;
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
        const int head = j / half, i = j - head * half;
        elem_t* v = head < num_q_heads
                      ? q + (size_t)t * q_stride + (size_t)head * head_dim
                      : k + (size_t)t * k_stride + (size_t)(head - num_q_heads) * head_dim;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float x1 = baton_to_f(v[i]), x2 = baton_to_f(v[i + half]);
        v[i] = baton_from_f(x1 * c - x2 * s);
        v[i + half] = baton_from_f(x2 * c + x1 * s);
    }
}
