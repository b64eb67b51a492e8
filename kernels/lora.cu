// LoRA adapters (Hu et al. 2021, arXiv:2106.09685) served beside the base weights, as vLLM's
// --enable-lora: each token of a launch runs with its row's adapter (id 0: the base model) and
// every fused linear layer an adapter updates (q/k/v, o, gate/up, down; baton_model::lora)
// adds, after the base projection, y[t, off + j] += sum_r B[j, r] * (sum_i A[r, i] * x[t, i])
// for each of the adapter's parts of that layer (s, the scaling, folded into B at load). The
// CPU reference is baton_model::lora::LoraPart::apply_token, applied in LoraStep::add
// (crates/model/src/cpu.rs). Two kernels per updated linear layer, after its GEMM:
//   baton_lora_shrink  v[t, p, r] = A_p[r, :] . x[t, :]        (f32, one warp per rank row)
//   baton_lora_expand  y[t, :] += sum_p B_p (v[t, p, :])        (f32 sums, one rounding)
// Tokens whose adapter id is 0 are skipped by both: their rows of y are not touched, so a base
// row's bits are those of a launch without adapters.
//
// Device tables (baton_cuda::executor, CudaWorker::set_lora_adapters): one BatonLoraPart per
// (adapter, layer, linear kind, part slot), BATON_LORA_MAX_PARTS slots per linear layer, the
// slots of adapter a (1-based) at `parts + (a - 1) * adapter_stride` (the host passes `parts`
// already offset to the layer's and kind's first slot). A slot with rank 0 is empty; used
// slots come first, by ascending out_offset (the CPU's order). A and B are elem_t, row-major.

// Part slots per linear layer (q, k, v and a fused qkv_proj at most) and the largest rank
// (baton_model::lora::MAX_LORA_RANK); the host refuses adapters past either.
#define BATON_LORA_MAX_PARTS 4
#define BATON_LORA_MAX_RANK 512
// Warps (rank rows) per shrink block, output columns per expand block.
#define BATON_LORA_SHRINK_WARPS 4
#define BATON_LORA_COLS 1024

// One part of an adapter's update of a fused linear layer (baton_model::lora::LoraPart), 32
// bytes; the host's copy is baton_cuda::executor::DeviceLoraPart.
struct BatonLoraPart {
    const elem_t* a;  // [rank, k]
    const elem_t* b;  // [n, rank], the scaling folded in
    int out_offset;   // first column of the fused output it updates
    int rank;         // 0: an empty slot
    int k;            // input width (the linear layer's)
    int n;            // output columns
};

// The adapter's slot table of token t for this layer and kind, or null for the base model.
__device__ __forceinline__ const BatonLoraPart* baton_lora_slots(
    const u32* __restrict__ tok_lora, const BatonLoraPart* __restrict__ parts, int adapter_stride,
    int num_adapters, int t) {
    const u32 id = tok_lora[t];
    if (id == 0u || id > (u32)num_adapters) return nullptr;
    return parts + (size_t)(id - 1u) * adapter_stride;
}

// Shrink: v[t, p, r] = sum_i A_p[r, i] * x[t, i] for each token t with an adapter, each used
// slot p of its adapter and r < rank_p (fp32 accumulate; lanes stride over i, then a warp sum).
//
// Shapes: v [num_tokens, BATON_LORA_MAX_PARTS, rank_stride] f32 (entries past a part's rank,
// and the rows of base tokens, are not written); x [num_tokens, x_stride] elem_t, the linear
// layer's input (k = x_stride for every part); tok_lora [num_tokens] u32 adapter ids; parts
// and adapter_stride as above, num_adapters the ids in use (a larger id is skipped).
// Launch: grid = (num_tokens, BATON_LORA_MAX_PARTS, ceil(rank_stride / BATON_LORA_SHRINK_WARPS)),
// block = (32 * BATON_LORA_SHRINK_WARPS); warp w of block (t, p, z) computes rank row
// z * BATON_LORA_SHRINK_WARPS + w of slot p for token t.
BATON_ENTRY void baton_lora_shrink(float* __restrict__ v, const elem_t* __restrict__ x,
                                   const u32* __restrict__ tok_lora,
                                   const BatonLoraPart* __restrict__ parts, int adapter_stride,
                                   int num_adapters, int num_tokens, int x_stride,
                                   int rank_stride) {
    BATON_TRACE_SCOPE();
    // x is the previous kernel's (the GEMM's input producer) output; the ids were uploaded by
    // this step.
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const BatonLoraPart* slots =
        baton_lora_slots(tok_lora, parts, adapter_stride, num_adapters, t);
    if (slots == nullptr) return;
    const int p = blockIdx.y;
    const BatonLoraPart part = slots[p];
    const int lane = threadIdx.x & 31;
    const int r = (int)blockIdx.z * BATON_LORA_SHRINK_WARPS + ((int)threadIdx.x >> 5);
    if (r >= part.rank || r >= rank_stride) return;  // warp-uniform: no shuffle is cut short
    const elem_t* a = part.a + (size_t)r * part.k;
    const elem_t* xt = x + (size_t)t * x_stride;
    float acc = 0.0f;
    for (int i = lane; i < part.k; i += 32) acc += baton_to_f(a[i]) * baton_to_f(xt[i]);
    acc = baton_warp_sum(acc);
    if (lane == 0) v[((size_t)t * BATON_LORA_MAX_PARTS + p) * rank_stride + r] = acc;
}

// Expand: y[t, c] += sum over the used slots p of token t's adapter with out_offset_p <= c <
// out_offset_p + n_p of sum_r B_p[c - out_offset_p, r] * v[t, p, r]. Each column's parts are
// summed in slot order in f32 onto the f32 value of y and rounded to elem_t once (for f32, the
// CPU's `out += part` in order), so overlapping parts (q_proj beside a fused qkv_proj) need no
// atomics: a column belongs to one thread.
//
// Shapes: y [num_tokens, y_stride] elem_t, the fused layer's output (every part within
// y_stride); v as baton_lora_shrink writes it; the rest as there.
// Launch: grid = (num_tokens, ceil(y_stride / BATON_LORA_COLS)), block = (256); block (t, z)
// covers columns [z * BATON_LORA_COLS, (z + 1) * BATON_LORA_COLS) of token t, after staging the
// token's v rows in shared memory.
BATON_ENTRY void baton_lora_expand(elem_t* __restrict__ y, const float* __restrict__ v,
                                   const u32* __restrict__ tok_lora,
                                   const BatonLoraPart* __restrict__ parts, int adapter_stride,
                                   int num_adapters, int num_tokens, int y_stride,
                                   int rank_stride) {
    BATON_TRACE_SCOPE();
    // v and y are earlier kernels' outputs.
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const BatonLoraPart* slots =
        baton_lora_slots(tok_lora, parts, adapter_stride, num_adapters, t);
    if (slots == nullptr) return;  // block-uniform, before any barrier
    __shared__ float vs[BATON_LORA_MAX_PARTS * BATON_LORA_MAX_RANK];
    const float* vt = v + (size_t)t * BATON_LORA_MAX_PARTS * rank_stride;
    for (int p = 0; p < BATON_LORA_MAX_PARTS; ++p) {
        const int rank = slots[p].rank;
        for (int r = threadIdx.x; r < rank; r += blockDim.x)
            vs[p * BATON_LORA_MAX_RANK + r] = vt[p * rank_stride + r];
    }
    __syncthreads();
    const int c0 = (int)blockIdx.y * BATON_LORA_COLS;
    const int c1 = min(y_stride, c0 + BATON_LORA_COLS);
    elem_t* yt = y + (size_t)t * y_stride;
    for (int c = c0 + (int)threadIdx.x; c < c1; c += blockDim.x) {
        float out = baton_to_f(yt[c]);
        bool touched = false;
        for (int p = 0; p < BATON_LORA_MAX_PARTS; ++p) {
            const BatonLoraPart& part = slots[p];
            const int j = c - part.out_offset;
            if (part.rank == 0 || j < 0 || j >= part.n) continue;
            const elem_t* b = part.b + (size_t)j * part.rank;
            const float* vp = vs + p * BATON_LORA_MAX_RANK;
            float acc = 0.0f;
            for (int r = 0; r < part.rank; ++r) acc += baton_to_f(b[r]) * vp[r];
            out += acc;
            touched = true;
        }
        if (touched) yt[c] = baton_from_f(out);
    }
}
