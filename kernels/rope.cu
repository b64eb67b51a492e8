// Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) convention, applied in place,
// fused with the KV-cache write.
//
// For each head vector v of size head_dim = 2h and i < h, with a = position * inv_freq[i]:
//   v'[i]     = v[i]     * cos(a) - v[i + h] * sin(a)
//   v'[i + h] = v[i + h] * cos(a) + v[i]     * sin(a)
// inv_freq [h] f32 is computed on the host (base^(-2i/d), with llama3 / other scaling applied
// there), so this kernel is scaling-agnostic. The angle is formed in fp32 as HF does
// (float(position) * inv_freq) and cos/sin use the accurate sincosf (angles reach ~1e5 rad).
//
// Decode steps on head dims 64, 128 and 256 do not launch this kernel: the decode attention
// kernel (attention.cu, baton_decode_body) applies the same formula and roundings itself and
// writes the step's K and V; keep the two in step (crates/cuda-emu/tests/kernels.rs checks
// that they write the same cache bytes).
//
// baton_rope_and_cache: RoPE on q and k, then the step's K and V written into their KV-cache
// pages (reshape-and-cache), in one launch. q and k are rotated in place; the cache gets the
// rotated k (the same rounded values) and v. slot_mapping[t] < 0 (graph padding) skips the
// cache write.
// Cache layout, per layer, for K and for V separately:
//   cache[num_blocks][block_size][num_kv_heads][head_dim] elem_t
// so a token's slot `slot = page * block_size + offset` addresses the contiguous run
// cache[slot * num_kv_heads * head_dim ..][num_kv_heads * head_dim].
// Shapes: q [num_tokens, num_q_heads, head_dim] with token stride `q_stride`; k and v
// [num_tokens, num_kv_heads, head_dim] with token stride `kv_stride` (views into the fused QKV
// output); positions, slot_mapping [num_tokens] int; inv_freq [head_dim / 2] f32.
// Launch: grid = (num_tokens, Y), block = (any multiple of 32); the Y blocks of a token share
// its (head, i) pairs, then its v elements, strided by Y * blockDim.x. The executor picks Y so
// that every pair has its own thread (a batch of one: 1280 to 2560 pairs, each loop round a
// dependent global round trip; one 512-thread block took 5 to 9 us on an H200).
BATON_ENTRY void baton_rope_and_cache(elem_t* __restrict__ q, elem_t* __restrict__ k,
                                      const elem_t* __restrict__ v, elem_t* __restrict__ k_cache,
                                      elem_t* __restrict__ v_cache,
                                      const int* __restrict__ positions,
                                      const int* __restrict__ slot_mapping,
                                      const float* __restrict__ inv_freq, int num_tokens,
                                      int num_q_heads, int num_kv_heads, int head_dim,
                                      int q_stride, int kv_stride) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int half = head_dim >> 1;
    const float pos = (float)positions[t];
    const int slot = slot_mapping[t];
    const int n = num_kv_heads * head_dim;
    elem_t* kd = slot >= 0 ? k_cache + (size_t)slot * n : nullptr;
    const int total = (num_q_heads + num_kv_heads) * half;
    const int step = gridDim.y * blockDim.x, first = blockIdx.y * blockDim.x + threadIdx.x;
    for (int j = first; j < total; j += step) {
        const int head = j / half, i = j - head * half;
        const bool is_q = head < num_q_heads;
        const int kh = head - num_q_heads;
        elem_t* x = is_q ? q + (size_t)t * q_stride + (size_t)head * head_dim
                         : k + (size_t)t * kv_stride + (size_t)kh * head_dim;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float x1 = baton_to_f(x[i]), x2 = baton_to_f(x[i + half]);
        const elem_t r1 = baton_from_f(x1 * c - x2 * s);
        const elem_t r2 = baton_from_f(x2 * c + x1 * s);
        x[i] = r1;
        x[i + half] = r2;
        if (!is_q && kd != nullptr) {
            kd[(size_t)kh * head_dim + i] = r1;
            kd[(size_t)kh * head_dim + i + half] = r2;
        }
    }
    if (slot < 0) return;
    const elem_t* vs = v + (size_t)t * kv_stride;
    elem_t* vd = v_cache + (size_t)slot * n;
    for (int i = first; i < n; i += step) vd[i] = vs[i];
}
