// Token embedding gather, row gather, and on-device resolution of `PendingFrom` input tokens.

// Embedding gather: out[t, :] = table[ids[t], :].
//
// Shapes: ids [num_tokens] u32; table [vocab, hidden] elem_t row-major; out [num_tokens, hidden]
// elem_t row-major. An id >= vocab (which a correct launch never produces) writes a zero row
// instead of reading out of bounds.
// Launch: grid = (num_tokens), block = (256); any hidden size; 16-byte vector copies when
// hidden is a multiple of BATON_VEC and both rows are 16-byte aligned.
BATON_ENTRY void baton_embedding_gather(elem_t* __restrict__ out,
                                        const elem_t* __restrict__ table,
                                        const u32* __restrict__ ids, int num_tokens,
                                        int hidden, int vocab) {
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const u32 id = ids[t];
    elem_t* dst = out + (size_t)t * hidden;
    if (id >= (u32)vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = baton_from_f(0.0f);
        return;
    }
    const elem_t* src = table + (size_t)id * hidden;
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
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int r = blockIdx.x;
    if (r >= num_rows) return;
    const int src_row = index[r];
    elem_t* dst = out + (size_t)r * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        dst[i] = src_row < 0 ? baton_from_f(0.0f) : in[(size_t)src_row * width + i];
}

// Resolve `PendingFrom { launch, row }` inputs: copy ids sampled by earlier launches (still on the
// device, never round-tripped through the host) into this launch's input ids.
//
// The worker keeps the sampled ids of the last `depth` launches in one device ring,
// `sampled_ring[depth * max_rows]`, launch `s` at offset `(s % depth) * max_rows`. For pending
// entry i: input_ids[dst_token[i]] = sampled_ring[src_index[i]], where src_index is
// `(launch % depth) * max_rows + row`, computed by the host.
// Shapes: input_ids [num_tokens] u32 (written in place); dst_token, src_index [num_pending] u32.
// Launch: grid = (ceil(num_pending / 256)), block = (256). Run on the same stream after the
// sampling kernel of the source launch (stream order is the only synchronization needed).
BATON_ENTRY void baton_gather_pending_ids(u32* __restrict__ input_ids,
                                          const u32* __restrict__ sampled_ring,
                                          const u32* __restrict__ dst_token,
                                          const u32* __restrict__ src_index,
                                          int num_pending) {
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < num_pending) input_ids[dst_token[i]] = sampled_ring[src_index[i]];
}
