// Structured outputs (guided decoding): the grammar's token mask applied to the logits before
// the sampler, as vLLM applies its grammar bitmask to the logits before sampling. CPU
// reference: baton_worker::sampling::apply_token_mask (crates/worker/src/sampling.rs) and its
// use in crates/worker/src/cpu.rs.

// logits[row, t] = -inf for every token t whose bit is clear in the row's mask; rows without a
// mask are left alone. Everything the sampler computes afterwards (selection, penalties, the
// log-probabilities) sees the masked logits, as on the CPU.
//
// Shapes: logits [rows, logits_stride] f32 (the LM head's output; vocab <= logits_stride);
// mask_rows [rows] int: the row's index among the launch's masks, or -1 for a row without one
// (baton_cuda::staging::StagingLayout::mask_rows); *mask_table: the device address of the
// launch's masks, [masks, words] u32 with words = ceil(vocab / 32), mask i at word i * words
// (read through the staging buffer, so a captured graph follows a reallocated mask buffer).
// Bit t % 32 of word t / 32 is token t (set: allowed); bits past vocab in the last word are
// ignored.
// Launch: grid = (rows, splits) with splits = baton_cuda::plan::token_mask_splits(vocab),
// block = (baton_cuda::plan::TOKEN_MASK_BLOCK = 256); block (r, s) covers words
// [s * per, (s + 1) * per) of row r, per = ceil(words / splits), one token per thread per
// step: the 32 threads of a warp read one mask word (a broadcast) and write 32 consecutive
// logits (coalesced). A row without a mask costs each of its blocks one load.
BATON_ENTRY void baton_apply_token_mask(float* __restrict__ logits, int logits_stride,
                                        const int* __restrict__ mask_rows,
                                        const u32* const* __restrict__ mask_table, int vocab) {
    BATON_TRACE_SCOPE();
    // The logits are the previous kernel's output, and the masks were uploaded by this step.
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int row = blockIdx.x;
    const int index = mask_rows[row];
    if (index < 0 || vocab <= 0) return;
    const int words = (vocab + 31) / 32;
    const int per = (words + (int)gridDim.y - 1) / (int)gridDim.y;
    const int w0 = (int)blockIdx.y * per;
    const int t0 = w0 * 32;
    const int t1 = min(vocab, min(words, w0 + per) * 32);
    const u32* mask = *mask_table + (size_t)index * words;
    float* x = logits + (size_t)row * logits_stride;
    for (int t = t0 + (int)threadIdx.x; t < t1; t += blockDim.x) {
        if (((mask[t >> 5] >> (t & 31)) & 1u) == 0u) x[t] = BATON_NEG_INF;
    }
}
