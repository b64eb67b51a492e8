// Token embedding gather and on-device resolution of `PendingFrom` input tokens.

// Embedding gather: out[t, :] = table[ids[t], :].
//
// Shapes: ids [num_tokens] u32; table [vocab, hidden] bf16 row-major; out [num_tokens, hidden]
// bf16 row-major. An id >= vocab (which a correct launch never produces) writes a zero row
// instead of reading out of bounds.
// Launch: grid = (num_tokens), block = (256); any hidden size; 16-byte vector copies when
// hidden % 8 == 0 (and the pointers are 16-byte aligned, as cudaMalloc's are).
extern "C" __global__ void baton_embedding_gather_bf16(bf16* __restrict__ out,
                                                       const bf16* __restrict__ table,
                                                       const u32* __restrict__ ids,
                                                       int num_tokens, int hidden, int vocab) {
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const u32 id = ids[t];
    bf16* dst = out + (size_t)t * hidden;
    if (id >= (u32)vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = __float2bfloat16(0.0f);
        return;
    }
    const bf16* src = table + (size_t)id * hidden;
    if ((hidden & 7) == 0) {
        const int n8 = hidden >> 3;
        const baton_bf16x8* s8 = reinterpret_cast<const baton_bf16x8*>(src);
        baton_bf16x8* d8 = reinterpret_cast<baton_bf16x8*>(dst);
        for (int i = threadIdx.x; i < n8; i += blockDim.x) d8[i] = s8[i];
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
    }
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
extern "C" __global__ void baton_gather_pending_ids(u32* __restrict__ input_ids,
                                                    const u32* __restrict__ sampled_ring,
                                                    const u32* __restrict__ dst_token,
                                                    const u32* __restrict__ src_index,
                                                    int num_pending) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < num_pending) input_ids[dst_token[i]] = sampled_ring[src_index[i]];
}
