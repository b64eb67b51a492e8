// Reshape-and-cache: write this step's K and V rows into their KV-cache pages.
//
// Cache layout, per layer, for K and for V separately:
//   cache[num_blocks][block_size][num_kv_heads][head_dim] elem_t
// so a token's slot `slot = page * block_size + offset` addresses the contiguous run
// cache[slot * num_kv_heads * head_dim ..][num_kv_heads * head_dim].
// slot_mapping[t] < 0 marks a padding token (CUDA-graph bucket padding) and is skipped.
//
// Shapes: k [num_tokens, num_kv_heads, head_dim] with token stride `k_stride` elements, v likewise
// with `v_stride` (views into a fused QKV output); slot_mapping [num_tokens] int.
// Launch: grid = (num_tokens), block = (128); 16-byte vector copies when the rows are 16-byte aligned.
BATON_ENTRY void baton_reshape_and_cache(const elem_t* __restrict__ k,
                                         const elem_t* __restrict__ v,
                                         elem_t* __restrict__ k_cache,
                                         elem_t* __restrict__ v_cache,
                                         const int* __restrict__ slot_mapping,
                                         int num_tokens, int num_kv_heads,
                                         int head_dim, int k_stride,
                                         int v_stride) {
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int n = num_kv_heads * head_dim;
    const elem_t* ks = k + (size_t)t * k_stride;
    const elem_t* vs = v + (size_t)t * v_stride;
    elem_t* kd = k_cache + (size_t)slot * n;
    elem_t* vd = v_cache + (size_t)slot * n;
    if (n % BATON_VEC == 0 && baton_aligned16(ks) && baton_aligned16(vs) &&
        baton_aligned16(kd) && baton_aligned16(vd)) {
        const int nv = n / BATON_VEC;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            reinterpret_cast<uint4*>(kd)[i] = reinterpret_cast<const uint4*>(ks)[i];
            reinterpret_cast<uint4*>(vd)[i] = reinterpret_cast<const uint4*>(vs)[i];
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}
