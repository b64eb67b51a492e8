// Token embedding gather (with the on-device resolution of `PendingFrom` input tokens) and row
// gather.

// Embedding gather: out[t, :] = table[ids[t], :], resolving `PendingFrom` input ids on the way.
//
// An id with BATON_PENDING_TAG set is a reference into the device ring of ids that earlier
// launches sampled (never round-tripped through the host): the id is
// sampled_ring[ids[t] & ~BATON_PENDING_TAG], and the kernel writes it back to ids[t] for the
// launch's later kernels (the sampler's penalty merge). The worker keeps the ids of its last
// KEPT_LAUNCHES launches in the ring, `max_rows` per launch; stream order after the source
// launch's ring copy is the only synchronization needed.
//
// Shapes: ids [num_tokens] u32 (tagged entries rewritten in place); sampled_ring [any] u32;
// table [vocab, hidden] elem_t row-major; out [num_tokens, hidden] elem_t row-major. An id >=
// vocab (which a correct launch never produces) writes a zero row instead of reading out of
// bounds. scale: 1 copies the row; any other value multiplies it, out = round(row * scale) in
// fp32 (Gemma 3's sqrt(hidden) in the weight dtype, transformers' Gemma3TextScaledWordEmbedding).
// Launch: grid = (num_tokens), block = (256); any hidden size; 16-byte vector copies when
// hidden is a multiple of BATON_VEC and both rows are 16-byte aligned.
BATON_ENTRY void baton_embedding_gather(elem_t* __restrict__ out,
                                        const elem_t* __restrict__ table,
                                        u32* __restrict__ ids,
                                        const u32* __restrict__ sampled_ring, int num_tokens,
                                        int hidden, int vocab, float scale) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const u32 raw = ids[t];
    const u32 id = (raw & BATON_PENDING_TAG) ? sampled_ring[raw & ~BATON_PENDING_TAG] : raw;
    // Every thread has read ids[t] before the barrier, so the write-back races with no read.
    __syncthreads();
    if (threadIdx.x == 0 && id != raw) ids[t] = id;
    elem_t* dst = out + (size_t)t * hidden;
    if (id >= (u32)vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = baton_from_f(0.0f);
        return;
    }
    const elem_t* src = table + (size_t)id * hidden;
    if (scale != 1.0f) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)
            dst[i] = baton_from_f(baton_to_f(src[i]) * scale);
        return;
    }
    if (hidden % BATON_VEC == 0 && baton_aligned16(src) && baton_aligned16(dst)) {
        const int n = hidden / BATON_VEC;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
    }
}

// Row gather: out[r, :] = in[index[r], :] (the last token of each row, before the LM head).
// Shapes: in [*, width] elem_t; index [num_rows] int (a negative index writes zeros);
// out [num_rows, width] elem_t.
// Launch: grid = (num_rows), block = (256).
BATON_ENTRY void baton_gather_rows(elem_t* __restrict__ out,
                                   const elem_t* __restrict__ in,
                                   const int* __restrict__ index, int num_rows,
                                   int width) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int r = blockIdx.x;
    if (r >= num_rows) return;
    const int src_row = index[r];
    elem_t* dst = out + (size_t)r * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        dst[i] = src_row < 0 ? baton_from_f(0.0f) : in[(size_t)src_row * width + i];
}
