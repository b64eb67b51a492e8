// Reshape-and-cache: write this step's K and V rows into their KV-cache pages.
//
// Cache layout, per layer, for K and for V separately:
//   cache[num_blocks][block_size][num_kv_heads][head_dim] bf16
// so a token's slot `slot = page * block_size + offset` addresses the contiguous run
// cache[slot * num_kv_heads * head_dim ..][num_kv_heads * head_dim].
// slot_mapping[t] < 0 marks a padding token (CUDA-graph bucket padding) and is skipped.
//
// Shapes: k [num_tokens, num_kv_heads, head_dim] with token stride `k_stride` elements, v likewise
// with `v_stride` (views into a fused QKV output); slot_mapping [num_tokens] int.
// Launch: grid = (num_tokens), block = (128); 16-byte vector copies when head_dim % 8 == 0.
extern "C" __global__ void baton_reshape_and_cache_bf16(const bf16* __restrict__ k,
                                                        const bf16* __restrict__ v,
                                                        bf16* __restrict__ k_cache,
                                                        bf16* __restrict__ v_cache,
                                                        const int* __restrict__ slot_mapping,
                                                        int num_tokens, int num_kv_heads,
                                                        int head_dim, int k_stride,
                                                        int v_stride) {
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int n = num_kv_heads * head_dim;
    const bf16* ks = k + (size_t)t * k_stride;
    const bf16* vs = v + (size_t)t * v_stride;
    bf16* kd = k_cache + (size_t)slot * n;
    bf16* vd = v_cache + (size_t)slot * n;
    if ((head_dim & 7) == 0 && (k_stride & 7) == 0 && (v_stride & 7) == 0) {
        const int n8 = n >> 3;
        for (int i = threadIdx.x; i < n8; i += blockDim.x) {
            reinterpret_cast<baton_bf16x8*>(kd)[i] = reinterpret_cast<const baton_bf16x8*>(ks)[i];
            reinterpret_cast<baton_bf16x8*>(vd)[i] = reinterpret_cast<const baton_bf16x8*>(vs)[i];
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}
