//! `CudaWorker`: the CUDA backend behind `baton_worker::Backend`.
//!
//! One device context and one created stream (never the legacy default stream). Per launch:
//!
//! 1. the host flattens the rows ([`crate::plan_launch`]) and packs every input into the pinned
//!    staging buffer ([`StagingLayout`]), copied to the device with one async copy. Sampling
//!    rows with penalties or a logit bias carry their list, built on the host from the token
//!    and logit-bias tables ([`baton_worker::penalty::PenaltyHistories`], per-slot counts kept
//!    across steps); the lists go, flattened, into a separate growable entry buffer (one more
//!    async copy) whose address the staging buffer carries. Structured-output rows
//!    (`SamplingParams::token_mask`) carry the slot's token mask from the mask table the same
//!    way: the guided rows' masks, compacted, in a growable mask buffer (uploaded only when a
//!    row has one), each row's index into it in the staging buffer;
//! 2. `PendingFrom` rows get their first id on the device: it is staged as its index in the
//!    ring of ids earlier launches sampled, tagged ([`crate::staging::PENDING_TAG`]), and the
//!    embedding kernel reads it from there (never a host round trip);
//! 3. the forward pass: embedding; per layer fused residual-add + RMSNorm, QKV GEMM, for Qwen2 and
//!    Qwen3 the q/k/v biases and per-head q/k RMSNorms (`baton_qkv_post`, launched only when the
//!    config has them), RoPE, KV write by slot, paged attention (decode split-K, varlen prefill, or
//!    the generic kernel for head dims other than 64/128/256), O GEMM, add + RMSNorm, gate/up GEMM,
//!    SiLU-and-mul, down GEMM; final add + RMSNorm, gather of each row's last token, LM-head GEMM
//!    to f32 logits, the guided rows' token masks (`baton_apply_token_mask`: every disallowed logit
//!    becomes `-inf`, as the CPU worker's `apply_token_mask`; eager launches without a guided row
//!    skip it), device sampler (penalties applied to the logits first, a pending input merged into
//!    its row's list on the device). GEMMs are cuBLAS `cublasGemmEx` with `CUBLAS_COMPUTE_32F` on
//!    the stream;
//! 4. the sampled ids are copied into the device ring (for the next launches' pending rows) and
//!    to pinned host memory, then a CUDA event is recorded: the launch's fence. `execute`
//!    returns the completion only after that event completed (`cuEventSynchronize`), so the
//!    caller advances `released` only past fenced launches.
//!
//! **Two launches in flight** (`Backend::submit` / `Backend::finish`, which the worker daemon
//! uses): `submit` does steps 1-4 without the wait and `finish` waits for the oldest launch's
//! fence and reads its ids, so the host stages launch n + 1 while the device runs launch n and
//! the device goes from one to the next without a host round trip. Everything the host writes
//! for a launch or reads back from it lives in that launch's pinned `HostFrame` (one per
//! fence, [`FENCE_FRAMES`]); a frame is written again only after its launch's fence has passed
//! (finished, or waited for before the penalty or mask buffers grow). Device-side buffers
//! (staging, outputs, activations) are shared: the stream orders each launch's use of them
//! after the previous launch's. A launch whose rows score prompt tokens runs only through
//! `execute` (its scoring reads the logits after the fence).
//!
//! Decode-only launches of up to the largest bucket replay a CUDA graph captured at start-up
//! for the smallest bucket that holds them (`--enforce-eager` turns this off). The graphs read
//! the staging buffer's fixed device addresses, so step 1 is all a replay needs.
//!
//! **LoRA adapters** (`Backend::set_lora_adapters`, [`crate::lora`]): a launch with a row whose
//! `lora` is not 0 uploads each token's adapter id (from its frame's pinned buffer; a graph's
//! padding rows get 0) and runs through the per-kernel cuBLAS path (no fused decode GEMV or
//! persistent kernel), with `baton_lora_shrink` and `baton_lora_expand` (`kernels/lora.cu`)
//! after the q/k/v, o, gate/up and down GEMMs of each layer an adapter updates: a decode
//! launch replays the bucket's LoRA graph (`lora_graphs`, captured by `set_lora_adapters`
//! over the adapters' buffers; the kernels read the ids at replay), others run eagerly.
//! Launches without such a row run exactly as without adapters.
//!
//! All device work goes through [`Device`]: [`CudaDevice`] on a GPU, the host emulator of
//! `baton-cuda-emu` in tests. Status: matches the CPU reference on the emulator and on an
//! H200 (see the crate docs).

use crate::device::{Buf, CudaDevice, Device, Gemm, GraphId, Pinned, FENCE_FRAMES};
use crate::kernels::{Dtype, KernelError, GEMV_MAX_TOKENS, SAMPLER_TOP_SLOTS};
use crate::lora::{LoraDevice, LORA_COLS, LORA_EXPAND_BLOCK, LORA_MAX_PARTS, LORA_SHRINK_WARPS};
use crate::memory::{kv_bytes_per_block, kv_num_blocks, KvSizingError, ModelShape, MoeShape};
use crate::plan::{
    default_graph_buckets, gemv_rows_per_block, graph_bucket, plan_launch, LaunchPlan, PlanError,
    GEMV_ASYNC_XS_BYTES,
};
use crate::staging::{
    pack_penalties, CapacityError, DevicePenaltyEntry, PenaltyRow, StagingLayout, StepInputs,
};
use baton_model::lora::LoraLinear;
use baton_model::{
    LlamaWeights, LoraAdapter, ModelConfig, ModelWeights, MoeTrace, RawTensor, Tensor,
};
use baton_proto::{
    Completion, Launch, LaunchSeq, PromptLogprob, Sampled, SamplingParams, NOT_PENDING,
};
use baton_worker::penalty::{PenaltyEntry, PenaltyHistories};
use baton_worker::{Backend, KvCapacity, TableReader, WorkerError};
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::DriverError;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::path::Path;
use std::sync::Arc;

/// How many launches' sampled ids the device ring keeps (the scheduler keeps at most 2 in
/// flight; 8 leaves room).
pub const KEPT_LAUNCHES: usize = 8;

/// Extra device memory kept free beyond the buffers this worker allocates (CUDA graphs,
/// cuBLAS internals, fragmentation), in bytes.
const RESERVE_SLACK: usize = 1 << 30;

/// Errors from bringing the CUDA worker up.
#[derive(Debug, thiserror::Error)]
pub enum CudaWorkerError {
    /// No `libcuda.so*` (no NVIDIA driver).
    #[error(
        "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver on this \
         machine (use --device cpu)"
    )]
    DriverUnavailable,
    /// No `libcublas.so*` on the loader path.
    #[error("cuBLAS (libcublas.so) cannot be loaded: add the CUDA lib dir to LD_LIBRARY_PATH")]
    CublasUnavailable,
    /// A driver call failed.
    #[error("CUDA driver error during {what}: {err:?}")]
    Driver {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        err: DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS error during {what}: {status:?}")]
    Cublas {
        /// What was being done.
        what: &'static str,
        /// The status.
        status: cublas_sys::cublasStatus_t,
    },
    /// NVRTC missing or a kernel failed to compile.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// KV sizing failed.
    #[error(transparent)]
    KvSizing(#[from] KvSizingError),
    /// The model cannot run on this backend.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A failure reported by a non-CUDA [`Device`] (the host emulator).
    #[error("device error during {what}: {msg}")]
    Device {
        /// What was being done.
        what: &'static str,
        /// The device's message.
        msg: String,
    },
}

fn dev_err(e: CudaWorkerError) -> WorkerError {
    WorkerError::Device(e.to_string())
}

/// How many KV pages to allocate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBlocks {
    /// Exactly this many (`--num-blocks`, or the scheduler's count for a daemon worker).
    Fixed(usize),
    /// As many as fit in `total * fraction` after weights and buffers
    /// (`--gpu-memory-utilization`, vLLM's contract; see [`kv_num_blocks`]), but no more than
    /// `max_blocks` (what the scheduler can ever use: every sequence at full length).
    Utilization {
        /// `--gpu-memory-utilization`, in (0, 1].
        fraction: f64,
        /// Upper bound on the page count.
        max_blocks: usize,
    },
}

/// Options of [`CudaWorker::new`].
#[derive(Clone, Debug)]
pub struct CudaWorkerOptions {
    /// Device ordinal.
    pub device: usize,
    /// Element type of weights, activations and KV.
    pub dtype: Dtype,
    /// Directory holding `cuda_bf16.h` for NVRTC.
    pub include_dir: std::path::PathBuf,
    /// Tokens per KV page.
    pub block_size: usize,
    /// KV pages.
    pub kv_blocks: KvBlocks,
    /// Most tokens per launch (sizes the activation buffers).
    pub max_tokens: usize,
    /// Most rows per launch.
    pub max_rows: usize,
    /// Longest sequence (block-table width, decode partitions).
    pub max_model_len: usize,
    /// Run every launch eagerly (no CUDA graphs).
    pub enforce_eager: bool,
    /// Decode batches of at most [`GEMV_MAX_TOKENS`] rows run through `baton_gemv` (fused
    /// RMSNorm prologue, residual-add and SiLU epilogues: 6 kernels per layer instead of 9)
    /// rather than cuBLAS and the separate norm and activation kernels.
    pub fused_decode: bool,
    /// Launch-shape and kernel-constant overrides ([`crate::plan::Tuning::default`] unless a tuning run
    /// sets them, see [`crate::plan::Tuning::from_env`]).
    pub tuning: crate::plan::Tuning,
}

/// Device weights of one layer (raw addresses into [`CudaWorker::weights`]).
#[derive(Clone, Copy, Debug)]
struct LayerPtrs {
    input_norm: u64,
    qkv: u64,
    o: u64,
    post_norm: u64,
    gate_up: u64,
    down: u64,
    /// Fused `[q_bias | k_bias | v_bias]` (Qwen2), or 0 when the model has no biases.
    qkv_bias: u64,
    /// Fused `[q_norm | k_norm]`, `[2 * head_dim]` (Qwen3), or 0 when the model has none.
    qk_norm: u64,
    /// `[hidden]` norms of the attention and MLP outputs (Gemma 3), or 0.
    attn_out_norm: u64,
    mlp_out_norm: u64,
    /// A mixture-of-experts layer's weights (`gate_up` and `down` then hold every expert's,
    /// `[num_experts, 2 * moe_inter, hidden]` and `[num_experts, hidden, moe_inter]`).
    moe: Option<MoePtrs>,
}

/// Device weights of a mixture-of-experts layer beside its experts' (see [`LayerPtrs::moe`]).
#[derive(Clone, Copy, Debug)]
struct MoePtrs {
    /// `[num_experts, hidden]` router.
    router: u64,
    /// Qwen2-MoE's shared expert: fused gate|up `[2 * shared_inter, hidden]`, down `[hidden,
    /// shared_inter]`, and its gate `[1, hidden]`; all 0 without one.
    shared_gate_up: u64,
    shared_down: u64,
    shared_gate: u64,
}

/// Most parameters of a kernel (`baton_decode_layers_hdD` has 27).
const MAX_KERNEL_PARAMS: usize = 32;

/// Kernel arguments with stable addresses, in declaration order.
struct KArgs {
    vals: [u64; MAX_KERNEL_PARAMS],
    n: usize,
}

impl KArgs {
    fn new() -> Self {
        KArgs {
            vals: [0; MAX_KERNEL_PARAMS],
            n: 0,
        }
    }
    /// A device pointer (or any 8-byte value).
    fn p(&mut self, v: u64) -> &mut Self {
        self.vals[self.n] = v;
        self.n += 1;
        self
    }
    /// An `int`: stored in the low 4 bytes (little-endian), which is what the kernel reads.
    fn i(&mut self, v: usize) -> &mut Self {
        self.p(u64::from(v as i32 as u32))
    }
    /// A `float`.
    fn f(&mut self, v: f32) -> &mut Self {
        self.p(u64::from(v.to_bits()))
    }
}

/// Which attention kernel a launch uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AttnMode {
    /// Every row one token: split-K decode (fast head dims) or generic.
    Decode,
    /// Mixed rows: varlen prefill (fast head dims) or generic.
    Prefill,
}

/// Outputs wanted beyond the sampled ids (debug hooks).
#[derive(Default)]
struct Dumps {
    logits: bool,
    layers: bool,
    logits_out: Vec<Vec<f32>>,
    layers_out: Vec<Vec<f32>>,
    /// With `layers`: each mixture-of-experts layer's MLP input and expert ids.
    moe_out: Vec<MoeTrace>,
}

/// Host record of the device ring of sampled ids: which launch occupies which ring slot and
/// which of its rows sampled.
#[derive(Debug, Default)]
struct Ring {
    launches: VecDeque<(LaunchSeq, usize, Vec<bool>)>,
    pushes: usize,
}

impl Ring {
    /// The ring slot the next launch writes its ids into. Whatever launch held it is
    /// forgotten now, before the slot is overwritten (it is at least `KEPT_LAUNCHES`
    /// launches old, more than can be in flight); the new launch is recorded only by
    /// [`Ring::commit`], once all its work is enqueued, and a launch whose fence then fails
    /// is dropped by [`Ring::forget`], so a failed launch is never a source for a launch
    /// staged after the failure.
    fn reserve(&mut self) -> usize {
        let slot = self.pushes % KEPT_LAUNCHES;
        self.pushes += 1;
        self.launches.retain(|l| l.1 != slot);
        slot
    }
    /// Records that launch `seq` was enqueued whole with its ids going to `slot` (from
    /// [`Ring::reserve`]). Later launches' pending rows may name it from now on: they read
    /// the slot after it on the stream.
    fn commit(&mut self, seq: LaunchSeq, slot: usize, sampled: Vec<bool>) {
        self.launches.push_back((seq, slot, sampled));
    }
    /// Drops launch `seq` (its fence failed): no later launch may take ids from it.
    fn forget(&mut self, seq: LaunchSeq) {
        self.launches.retain(|l| l.0 != seq);
    }
    #[cfg(test)]
    fn push(&mut self, seq: LaunchSeq, sampled: Vec<bool>) -> usize {
        let slot = self.reserve();
        self.commit(seq, slot, sampled);
        slot
    }
    /// Ring slot holding the id row `row` of launch `seq` sampled, if kept.
    fn slot_of(&self, seq: LaunchSeq, row: u32) -> Option<usize> {
        let (_, slot, s) = self.launches.iter().find(|l| l.0 == seq)?;
        s.get(row as usize)
            .copied()
            .unwrap_or(false)
            .then_some(*slot)
    }
}

/// One row of work, resolved from a launch record or built by a debug command.
#[derive(Clone, Debug)]
pub struct RowInput {
    /// Input ids; when `pending` is set, `tokens[0]` is a placeholder replaced on the device.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// Pages of the sequence, covering positions `0 .. start_pos + tokens.len()`.
    pub block_table: Vec<u32>,
    /// Ring index (`slot * max_rows + row`) of the pending first id, if any.
    pub pending: Option<u32>,
    /// Whether the row samples.
    pub sample: bool,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Output index (RNG counter).
    pub output_index: u32,
    /// Penalty list of a sampling row with penalties: the request's history as the host knows
    /// it (positions before `start_pos` from the token table, then `tokens` except a pending
    /// first id, which the device merges in as one more output). Empty otherwise.
    pub penalties: Vec<PenaltyEntry>,
    /// Prompt log-probabilities: the prompt token that follows each of the row's first
    /// `scored.len()` positions, whose log-probability the row reports (with
    /// `params.prompt_top()` top entries); see `LaunchRow::scores_prompt`. Empty otherwise. A
    /// launch with such a row runs eagerly.
    pub scored: Vec<u32>,
}

/// Writes `entries` at the start of `buf` (which holds at least as many).
fn put_entries(buf: &mut [u8], entries: &[DevicePenaltyEntry]) {
    let b: &[u8] = bytemuck::cast_slice(entries);
    buf[..b.len()].copy_from_slice(b);
}

/// The token masks of a launch's structured-output rows (`SamplingParams::token_mask`), as
/// [`CudaWorker::resolve`] reads them from the mask table: per row the index of its mask among
/// the launch's masks (`-1` for none), and the masks of the guided rows, compacted
/// (`baton_proto::token_mask_words(vocab)` u32 words each, in row order).
#[derive(Clone, Debug, Default)]
struct TokenMasks {
    rows: Vec<i32>,
    words: Vec<u32>,
}

impl TokenMasks {
    /// Whether some row has a mask.
    fn any(&self) -> bool {
        !self.words.is_empty()
    }
}

/// One scored prompt position of the last launch.
struct PromptScore {
    /// The launch row.
    row: u32,
    /// Index into the row's scored tokens (`RowInput::scored`).
    k: u32,
    logprob: f32,
    /// See `baton_proto::PromptLogprob::rank`.
    rank: u32,
    top: Vec<(u32, f32)>,
}

/// `(sampled id or u32::MAX, log-probability, top entries)` of one row.
pub type RowOutput = (u32, f32, Vec<(u32, f32)>);

/// `(logits per row, residual stream per layer)`, as [`CudaWorker::forward_debug`] returns.
pub type LogitsAndLayers = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// The CUDA worker. See the module docs.
pub struct CudaWorker {
    /// The device. Every buffer below holds its own handle and frees itself through it; the
    /// device (context, cuBLAS, graphs) goes when the last handle is gone.
    dev: Arc<dyn Device>,
    cfg: ModelConfig,
    opts: CudaWorkerOptions,
    dtype: Dtype,
    /// Keeps the weight allocation alive.
    _weights: Buf,
    embed: u64,
    layers: Vec<LayerPtrs>,
    final_norm: u64,
    lm_head: u64,
    inv_freq: Buf,
    /// Gemma 3's local RoPE table (its sliding layers), when the model has one.
    inv_freq_local: Option<Buf>,
    weight_bytes: usize,
    kv: Buf,
    num_blocks: usize,
    acts: Buf,
    act_off: ActOffsets,
    staging_dev: Buf,
    layout: StagingLayout,
    /// The pinned host buffers of each launch in flight, one frame per fence
    /// ([`FENCE_FRAMES`]); see [`HostFrame`].
    frames: Vec<HostFrame>,
    /// Launches enqueued so far: launch `k` uses frame `k % FENCE_FRAMES` and fence frame
    /// of the same index.
    enqueued: usize,
    /// Launches submitted (`Backend::submit`) whose completion has not been
    /// taken (`Backend::finish`), oldest first.
    inflight: VecDeque<InFlight>,
    /// `PendingFrom` inputs staged so far (see [`CudaWorker::pending_inputs`]).
    pending_inputs: u64,
    /// Penalty entries of the current launch (device, and the frames' pinned host buffers,
    /// `pen_cap` entries each; reallocated larger when a launch needs more, see
    /// [`CudaWorker::reserve_penalties`]).
    pen_dev: Buf,
    pen_cap: usize,
    /// Entries the current launch uses.
    pen_used: usize,
    /// Per-slot token counts of penalized requests (host side; see `baton_worker::penalty`).
    histories: PenaltyHistories,
    /// Token masks of the current launch's guided rows, compacted (device and pinned host,
    /// `mask_cap` u32 words each; reallocated larger when a launch needs more, see
    /// [`CudaWorker::reserve_masks`]).
    mask_dev: Buf,
    mask_cap: usize,
    /// Words the current launch uses (0: no row has a mask; nothing is uploaded).
    mask_used: usize,
    /// The last resolved launch's masks (host scratch, see [`CudaWorker::resolve`]).
    masks: TokenMasks,
    /// One row's mask as read from the tables (host scratch).
    mask_row: Vec<u32>,
    out_dev: Buf,
    ring: Buf,
    ring_host: Ring,
    graphs: HashMap<usize, GraphId>,
    /// Decode graphs of launches with adapter rows, per bucket (captured by
    /// `set_lora_adapters` over the adapters' buffers; empty without adapters or graphs).
    lora_graphs: HashMap<usize, GraphId>,
    buckets: Vec<usize>,
    max_partitions: usize,
    /// Rows the attention partials are sized for (`max_rows`).
    part_rows: usize,
    /// The persistent decode kernel, when [`Tuning::persistent_decode`](crate::plan::Tuning)
    /// asked for it.
    persistent: Option<Persistent>,
    /// Time each kernel and GEMM on its own (eager launches only).
    profiling: bool,
    /// Host copy of a chunk of prompt-scoring outputs (`max_rows` positions, see
    /// [`ActOffsets::score_out`]; allocated on first use).
    prompt_out: Vec<u8>,
    /// The last launch's scored prompt positions, in row then position order.
    prompt_scores: Vec<PromptScore>,
    /// LoRA adapters on the device ([`Backend::set_lora_adapters`]), if any.
    lora: Option<LoraDevice>,
    /// The last resolved launch's adapter id per row (see [`CudaWorker::resolve`]).
    lora_rows: Vec<u32>,
    /// The mixture-of-experts traces of the last [`CudaWorker::forward_debug`] with layers
    /// ([`CudaWorker::debug_moe_trace`]).
    debug_moe: Vec<MoeTrace>,
    /// Tokens of the launch being enqueued whose adapter ids are staged in its frame's
    /// [`LoraDevice::host`] buffer; 0 when no row of it has an adapter.
    lora_tokens: usize,
}

/// The persistent decode kernel of a worker (`baton_decode_layers_hdD`, kernels/attention.cu).
struct Persistent {
    /// `[num_layers, 8]` u64 device pointers: qkv, o, gate_up, down, input norm, post norm,
    /// k cache, v cache (the kernel's `layers` argument).
    table: Buf,
    /// Blocks of its cooperative grid ([`crate::plan::decode_layers_grid`]).
    grid: u32,
}

/// Whether the model's layers have what the fused decode GEMV path (and the persistent
/// kernel) do not implement: Gemma 3's norms of the sublayer outputs and GELU (its (1 + w)
/// norms folded at upload are fine everywhere), mixture-of-experts MLPs. Such a model's
/// decode steps take the per-kernel path with cuBLAS (as `--no-fused-decode`).
fn cublas_layers(cfg: &ModelConfig) -> bool {
    cfg.sandwich_norms || cfg.hidden_act != baton_model::Activation::Silu || cfg.moe.is_some()
}

/// Why a model cannot take the persistent decode kernel, or `None` when it can: Llama-style
/// layers (no q/k/v biases, no q/k norms, no sliding windows), head dim 64 or 128, and every GEMV's activation row
/// (hidden size, q width, intermediate size) whole 16-byte vectors that fit the kernel's
/// staging ([`crate::plan::decode_layers_stage_elems`]).
fn persistent_refusal(cfg: &ModelConfig, es: usize) -> Option<String> {
    let hd = cfg.head_dim;
    if !matches!(hd, 64 | 128) {
        return Some(format!("head_dim {hd} (64 or 128 only)"));
    }
    if bias_group(cfg).is_some() || norm_group(cfg).is_some() {
        return Some("q/k/v biases or q/k norms (Llama-style layers only)".into());
    }
    if cfg.sliding_window.iter().any(Option::is_some) {
        return Some("sliding-window attention (full causal attention only)".into());
    }
    if cublas_layers(cfg) {
        return Some("Gemma 3's or mixture-of-experts layers (Llama-style layers only)".into());
    }
    let cap = crate::plan::decode_layers_stage_elems(hd, es);
    let rows = [
        ("hidden_size", cfg.hidden_size),
        ("q width", cfg.num_attention_heads * hd),
        ("intermediate_size", cfg.intermediate_size),
    ];
    for (what, k) in rows {
        if k % (16 / es) != 0 || k > cap {
            return Some(format!(
                "{what} {k}: more than the {cap} elements the kernel stages, or not whole \
                 16-byte vectors"
            ));
        }
    }
    None
}

/// The pinned host side of one launch: what the host writes for the device to read (staging,
/// penalty entries, token masks) and where the device leaves the sampled ids. A launch owns
/// its frame from staging until its fence has passed; only then may the host write the frame
/// again (for a later launch) or trust what it reads there.
struct HostFrame {
    /// Staged inputs (`StagingLayout::total` bytes), uploaded by one async copy.
    staging: Pinned,
    /// Penalty entries (`pen_cap` of them).
    pen: Pinned,
    /// Token-mask words (`mask_cap` of them).
    mask: Pinned,
    /// The sampler outputs ([`OutOffsets`]), copied back before the fence.
    out: Pinned,
}

/// A launch submitted and not yet finished (see `Backend::submit` on `CudaWorker`).
struct InFlight {
    /// Its fence frame (and host frame).
    frame: usize,
    /// The launch record, for the completion.
    launch: Launch,
}

/// What [`CudaWorker::enqueue_rows`] leaves for the wait: the launch's frame and where each
/// row's tokens start (`[rows + 1]`, unpadded).
struct Enqueued {
    frame: usize,
    cu_seqlens: Vec<i32>,
}

/// Byte offsets of the activation buffers inside [`CudaWorker::acts`].
#[derive(Clone, Copy, Debug, Default)]
struct ActOffsets {
    resid: usize,
    xn: usize,
    qkv: usize,
    attn: usize,
    tmp: usize,
    gate_up: usize,
    act: usize,
    last: usize,
    logits: usize,
    part_acc: usize,
    part_m: usize,
    part_l: usize,
    attn_counters: usize,
    sample_partials: usize,
    sample_counters: usize,
    /// The persistent decode kernel's grid barrier: two u32 words, zeroed at allocation and
    /// left at zero by each launch (`BATON_GRID_SYNC`, kernels/common.cuh).
    grid_bar: usize,
    /// Prompt scoring ([`CudaWorker::score_prompts`]): `[max_rows]` u32 tokens in, and out
    /// `[max_rows]` f32 log-probabilities, `[max_rows]` u32 ranks, `[max_rows, 20]` top ids
    /// and `[max_rows, 20]` top log-probabilities, one contiguous block from `score_out`.
    score_tokens: usize,
    score_out: usize,
    /// Mixture-of-experts layers (kernels/moe.cu), all of zero size for a dense model: router
    /// logits `[t, num_experts]` f32, each token's experts `[t, top_k]` i32 and weights f32,
    /// the pairs sorted by expert `[t * top_k]` i32, the tiles `[1 + 3 * moe_max_tiles]` i32,
    /// the pairs' gate|up `[t * top_k, 2 * moe_inter]`, activations `[t * top_k, moe_inter]`
    /// and outputs `[t * top_k, hidden]`, the shared expert's output `[t, hidden]` and gate
    /// logits `[t]` f32.
    moe_logits: usize,
    moe_ids: usize,
    moe_w: usize,
    moe_sorted: usize,
    moe_tiles: usize,
    moe_gate_up: usize,
    moe_act: usize,
    moe_out: usize,
    moe_shared: usize,
    moe_shared_gate: usize,
    total: usize,
}

/// Pairs per tile of `baton_moe_gemm` (kernels/moe.cu's `BATON_MOE_BM`).
const MOE_TILE_PAIRS: usize = 8;
/// Output columns per block of `baton_moe_gemm` (`BATON_MOE_BN`).
const MOE_TILE_COLS: usize = 32;
/// Most experts per token and experts per layer the MoE kernels take (`BATON_MOE_MAX_TOPK`,
/// `BATON_MOE_MAX_EXPERTS`).
const MOE_MAX_TOP_K: usize = 32;
const MOE_MAX_EXPERTS: usize = 1024;

/// Most tiles `baton_moe_align` can cut `pairs` (token, expert) pairs over `experts` experts
/// into: each expert's run adds at most one partial tile.
fn moe_max_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(MOE_TILE_PAIRS) + experts
}

/// Bytes of prompt-scoring output per position: log-probability, rank, and
/// [`SAMPLER_TOP_SLOTS`] top ids and log-probabilities.
const SCORE_OUT_BYTES_PER_ROW: usize = 4 * (2 + 2 * SAMPLER_TOP_SLOTS);

/// Byte offsets of the sampler outputs inside `out_dev` / [`HostFrame::out`].
#[derive(Clone, Copy, Debug)]
struct OutOffsets {
    tokens: usize,
    logprob: usize,
    top_ids: usize,
    top_lp: usize,
    total: usize,
}

fn out_offsets(max_rows: usize) -> OutOffsets {
    let r = max_rows.max(1);
    let a = |x: usize| x.div_ceil(16) * 16;
    let tokens = 0;
    let logprob = a(4 * r);
    let top_ids = logprob + a(4 * r);
    let top_lp = top_ids + a(4 * r * SAMPLER_TOP_SLOTS);
    let total = top_lp + a(4 * r * SAMPLER_TOP_SLOTS);
    OutOffsets {
        tokens,
        logprob,
        top_ids,
        top_lp,
        total,
    }
}

/// The model's shape numbers for the memory accounting.
pub fn model_shape(cfg: &ModelConfig) -> ModelShape {
    ModelShape {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        vocab: cfg.vocab_size,
        moe: cfg.moe.as_ref().map(|m| MoeShape {
            sparse_layers: m.layers.iter().filter(|&&s| s).count(),
            experts: m.num_experts,
            top_k: m.top_k,
            expert_intermediate: m.intermediate_size,
            shared_intermediate: m.shared_expert_intermediate_size,
        }),
    }
}

/// Converts f32 values to the device element type's little-endian bytes (round to nearest
/// even for bf16 and f16).
pub fn to_device_bytes(v: &[f32], dtype: Dtype) -> Vec<u8> {
    use rayon::prelude::*;
    // Chunks of 64 Ki elements over the rayon pool: an 8B model is 8e9 conversions at load.
    const CHUNK: usize = 1 << 16;
    let es = dtype.size();
    let mut out = vec![0u8; v.len() * es];
    out.par_chunks_mut(CHUNK * es)
        .zip(v.par_chunks(CHUNK))
        .for_each(|(o, x)| match dtype {
            Dtype::F32 => o.copy_from_slice(bytemuck::cast_slice(x)),
            Dtype::Bf16 => {
                for (o, &x) in o.chunks_exact_mut(2).zip(x) {
                    o.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            Dtype::F16 => {
                for (o, &x) in o.chunks_exact_mut(2).zip(x) {
                    o.copy_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes());
                }
            }
        });
    out
}

/// One tensor of a device weight group: f32 in host memory, or a stored tensor in the map.
#[derive(Clone, Copy)]
enum WeightPart<'a> {
    F32(&'a Tensor),
    Raw(RawTensor<'a>),
}

impl WeightPart<'_> {
    fn len(&self) -> usize {
        match self {
            WeightPart::F32(t) => t.data.len(),
            WeightPart::Raw(r) => r.bytes.len() / r.dtype.size(),
        }
    }
}

/// The parts of a weight group, back to back, as device `dtype` bytes. A stored tensor of
/// the device's own type is copied as is; anything else goes through f32, exactly as
/// [`to_device_bytes`] rounds (so a checkpoint gives the device the same bits whether it was
/// converted to f32 on the host first or not).
fn group_device_bytes(parts: &[WeightPart<'_>], dtype: Dtype) -> Vec<u8> {
    let es = dtype.size();
    let mut out = vec![0u8; parts.iter().map(|p| p.len() * es).sum()];
    let mut at = 0;
    for p in parts {
        let n = p.len() * es;
        let dst = &mut out[at..at + n];
        match p {
            WeightPart::F32(t) => dst.copy_from_slice(&to_device_bytes(&t.data, dtype)),
            WeightPart::Raw(r) => raw_to_device_bytes(r, dtype, dst),
        }
        at += n;
    }
    out
}

/// Writes stored tensor `r` into `dst` (`r`'s element count times `dtype.size()` bytes) as
/// device `dtype` elements: a plain copy when the types match (NaN payloads kept as stored),
/// else each element through f32 (exact from f16 and bf16) and rounded to nearest even, in
/// parallel chunks.
fn raw_to_device_bytes(r: &RawTensor<'_>, dtype: Dtype, dst: &mut [u8]) {
    use baton_model::DType as S;
    use rayon::prelude::*;
    assert_eq!(
        dst.len(),
        r.bytes.len() / r.dtype.size() * dtype.size(),
        "raw_to_device_bytes: destination size"
    );
    let same = matches!(
        (r.dtype, dtype),
        (S::F32, Dtype::F32) | (S::BF16, Dtype::Bf16) | (S::F16, Dtype::F16)
    );
    if same {
        dst.copy_from_slice(r.bytes);
        return;
    }
    const CHUNK: usize = 1 << 16;
    let (ss, es) = (r.dtype.size(), dtype.size());
    dst.par_chunks_mut(CHUNK * es)
        .zip(r.bytes.par_chunks(CHUNK * ss))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_exact_mut(es).zip(x.chunks_exact(ss)) {
                let f = match r.dtype {
                    S::F32 => f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
                    S::F16 => half::f16::from_le_bytes([x[0], x[1]]).to_f32(),
                    S::BF16 => half::bf16::from_le_bytes([x[0], x[1]]).to_f32(),
                };
                match dtype {
                    Dtype::F32 => o.copy_from_slice(&f.to_le_bytes()),
                    Dtype::Bf16 => o.copy_from_slice(&half::bf16::from_f32(f).to_le_bytes()),
                    Dtype::F16 => o.copy_from_slice(&half::f16::from_f32(f).to_le_bytes()),
                }
            }
        });
}

/// Converts device element bytes back to f32 (for debug dumps).
pub fn from_device_bytes(b: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    }
}

/// Layer `li`'s device weight groups, each a list of indices into
/// `baton_model::weights::layer_tensor_shapes` (and `LayerWeights::tensors`) uploaded back to
/// back: input norm, fused q|k|v, o, post norm, fused gate|up, down; then the fused
/// q|k|v bias when the config has `qkv_bias` (Qwen2), the fused q|k norm when it has
/// `qk_norm` (Qwen3, Gemma 3), and the attention-output and MLP-output norms, one group each,
/// with `sandwich_norms`. In a mixture-of-experts layer the gate|up group is every expert's
/// gate and up, expert by expert (`[num_experts, 2 * moe_inter, hidden]`), the down group every
/// expert's down, and [`moe_groups`] follow: the router, then the shared expert's gate|up,
/// down and gate when it has one.
fn layer_groups(cfg: &ModelConfig, li: usize) -> Vec<Vec<usize>> {
    let moe = cfg.moe.as_ref().filter(|_| cfg.layer_is_moe(li));
    let mut g: Vec<Vec<usize>> = vec![vec![0], vec![1, 2, 3], vec![4], vec![5]];
    let mut next = if moe.is_some() { 6 } else { 9 };
    let mut tail = Vec::new();
    if cfg.qkv_bias {
        tail.push(vec![next, next + 1, next + 2]);
        next += 3;
    }
    if cfg.qk_norm {
        tail.push(vec![next, next + 1]);
        next += 2;
    }
    if cfg.sandwich_norms {
        tail.push(vec![next]);
        tail.push(vec![next + 1]);
        next += 2;
    }
    match moe {
        None => {
            g.push(vec![6, 7]);
            g.push(vec![8]);
            g.extend(tail);
        }
        Some(m) => {
            // The router at `next`, then expert e's gate, up, down at next + 1 + 3e + 0..3.
            let experts = |part: usize| (0..m.num_experts).map(move |e| next + 1 + 3 * e + part);
            g.push(
                experts(0)
                    .zip(experts(1))
                    .flat_map(|(a, b)| [a, b])
                    .collect(),
            );
            g.push(experts(2).collect());
            g.extend(tail);
            g.push(vec![next]);
            if m.shared_expert_intermediate_size > 0 {
                let s = next + 1 + 3 * m.num_experts;
                g.push(vec![s, s + 1]);
                g.push(vec![s + 2]);
                g.push(vec![s + 3]);
            }
        }
    }
    g
}

/// Positions in [`layer_groups`] of a mixture-of-experts layer's router and, when the model
/// has a shared expert, its gate|up, down and gate groups.
fn moe_groups(cfg: &ModelConfig) -> (usize, Option<(usize, usize, usize)>) {
    let router = 6
        + usize::from(cfg.qkv_bias)
        + usize::from(cfg.qk_norm)
        + 2 * usize::from(cfg.sandwich_norms);
    let shared = cfg
        .moe
        .as_ref()
        .filter(|m| m.shared_expert_intermediate_size > 0)
        .map(|_| (router + 1, router + 2, router + 3));
    (router, shared)
}

/// Indices of the attention-output and MLP-output norm groups in [`layer_groups`] (Gemma 3's
/// `post_attention_layernorm` and `post_feedforward_layernorm`), when the config has them.
fn out_norm_groups(cfg: &ModelConfig) -> Option<(usize, usize)> {
    let g = 6 + usize::from(cfg.qkv_bias) + usize::from(cfg.qk_norm);
    cfg.sandwich_norms.then_some((g, g + 1))
}

/// The groups of [`layer_groups`] that hold RMSNorm weights (input and pre-MLP norms, q|k
/// norms, output norms): [`ModelConfig::norm_offset`] is added to them at upload.
fn norm_groups(cfg: &ModelConfig) -> Vec<usize> {
    let mut g = vec![0, 3];
    g.extend(norm_group(cfg));
    if let Some((a, m)) = out_norm_groups(cfg) {
        g.extend([a, m]);
    }
    g
}

/// Index of the fused q|k|v bias group in [`layer_groups`], when the config has one.
fn bias_group(cfg: &ModelConfig) -> Option<usize> {
    cfg.qkv_bias.then_some(6)
}

/// Index of the fused q|k norm group in [`layer_groups`], when the config has one.
fn norm_group(cfg: &ModelConfig) -> Option<usize> {
    cfg.qk_norm.then_some(6 + usize::from(cfg.qkv_bias))
}

/// Byte offsets of the weight tensors inside the one weight allocation (256-byte aligned, in
/// upload order: embedding; per layer the groups of [`layer_groups`]; final norm; LM head).
struct WeightLayout {
    embed: usize,
    /// Per layer, one offset per group of [`layer_groups`]: `[input_norm, qkv, o, post_norm,
    /// gate_up, down]`, then the q|k|v bias and the q|k norm when present.
    layers: Vec<Vec<usize>>,
    norm: usize,
    head: usize,
    total: usize,
}

impl WeightLayout {
    fn new(cfg: &ModelConfig, es: usize) -> Self {
        let h = cfg.hidden_size;
        let mut off = 0usize;
        let mut place = |elems: usize| {
            let o = off;
            off = (off + elems * es).div_ceil(256) * 256;
            o
        };
        // Each layer's group sizes from its own tensors (a mixture-of-experts model may have
        // dense layers too).
        let group_elems = |li: usize| -> Vec<usize> {
            let shapes = baton_model::weights::layer_tensor_shapes(cfg, li);
            layer_groups(cfg, li)
                .iter()
                .map(|g| {
                    g.iter()
                        .map(|&i| shapes[i].1.iter().product::<usize>())
                        .sum()
                })
                .collect()
        };
        let embed = place(cfg.vocab_size * h);
        let layers = (0..cfg.num_hidden_layers)
            .map(|li| group_elems(li).iter().map(|&n| place(n)).collect())
            .collect();
        let norm = place(h);
        let head = place(cfg.vocab_size * h);
        WeightLayout {
            embed,
            layers,
            norm,
            head,
            total: off,
        }
    }
}

/// The activation, staging, sampler-output and ring buffers for a model and options.
struct BufferPlan {
    acts: ActOffsets,
    staging: StagingLayout,
    out: OutOffsets,
    /// Most rows per launch (`max_rows`, at most `max_tokens`).
    rows: usize,
    max_partitions: usize,
    /// Initial capacity of the penalty-entry buffer, in entries.
    penalty_entries: usize,
    /// Initial capacity of the token-mask buffer, in u32 words (one row's mask).
    mask_words: usize,
}

impl BufferPlan {
    fn new(cfg: &ModelConfig, opts: &CudaWorkerOptions, es: usize) -> Self {
        let h = cfg.hidden_size;
        let q_w = cfg.num_attention_heads * cfg.head_dim;
        let qkv_w = q_w + 2 * cfg.num_key_value_heads * cfg.head_dim;
        let im = cfg.intermediate_size;
        let t = opts.max_tokens.max(1);
        let r = opts.max_rows.max(1).min(t);
        let max_blocks = opts.max_model_len.div_ceil(opts.block_size.max(1)).max(1);
        let max_partitions = crate::plan::decode_partition_slots(
            opts.max_model_len,
            r,
            opts.tuning.attn_target_blocks,
        );
        let nh = cfg.num_attention_heads;
        let mut a = ActOffsets::default();
        let mut off = 0usize;
        let mut take = |bytes: usize| {
            let o = off;
            off = (off + bytes).div_ceil(256) * 256;
            o
        };
        a.resid = take(t * h * es);
        a.xn = take(t * h * es);
        a.qkv = take(t * qkv_w * es);
        a.attn = take(t * q_w * es);
        a.tmp = take(t * h * es);
        // The dense MLPs' and the shared expert's.
        let im = im.max(
            cfg.moe
                .as_ref()
                .map_or(0, |m| m.shared_expert_intermediate_size),
        );
        a.gate_up = take(t * 2 * im * es);
        a.act = take(t * im * es);
        let (ne, k, e_im) = cfg
            .moe
            .as_ref()
            .map_or((0, 0, 0), |m| (m.num_experts, m.top_k, m.intermediate_size));
        let shared = cfg
            .moe
            .as_ref()
            .is_some_and(|m| m.shared_expert_intermediate_size > 0);
        let pairs = t * k;
        a.moe_logits = take(t * ne * 4);
        a.moe_ids = take(pairs * 4);
        a.moe_w = take(pairs * 4);
        a.moe_sorted = take(pairs * 4);
        a.moe_tiles = take(if ne > 0 {
            4 * (1 + 3 * moe_max_tiles(pairs, ne))
        } else {
            0
        });
        a.moe_gate_up = take(pairs * 2 * e_im * es);
        a.moe_act = take(pairs * e_im * es);
        a.moe_out = take(pairs * h * es);
        a.moe_shared = take(if shared { t * h * es } else { 0 });
        a.moe_shared_gate = take(if shared { t * 4 } else { 0 });
        a.last = take(r * h * es);
        a.logits = take(r * cfg.vocab_size * 4);
        a.part_acc = take(r * nh * max_partitions * cfg.head_dim * 4);
        a.part_m = take(r * nh * max_partitions * 4);
        a.part_l = take(r * nh * max_partitions * 4);
        // One split-K arrival counter per (row, kv head, head chunk): zeroed at allocation,
        // and the decode kernel leaves each at 0.
        let head_chunks = (nh / cfg.num_key_value_heads.max(1)).div_ceil(8).max(1);
        a.attn_counters = take(r * cfg.num_key_value_heads * head_chunks * 4);
        // The sampler's split rows: 16-byte partials per (row, slice) and one arrival counter
        // per row, zeroed at allocation and left at 0 by each launch.
        a.sample_partials = take(r * crate::plan::sample_splits(cfg.vocab_size) * 16);
        a.sample_counters = take(r * 4);
        a.grid_bar = take(8);
        a.score_tokens = take(r * 4);
        a.score_out = take(r * SCORE_OUT_BYTES_PER_ROW);
        a.total = off;
        BufferPlan {
            acts: a,
            staging: StagingLayout::new(t, r, max_blocks),
            out: out_offsets(r),
            rows: r,
            max_partitions,
            penalty_entries: initial_penalty_entries(t),
            mask_words: baton_proto::token_mask_words(cfg.vocab_size).max(1),
        }
    }

    /// Device bytes of these buffers (each allocation rounded up to 256 bytes).
    fn device_bytes(&self) -> usize {
        let round = |b: usize| b.max(16).div_ceil(256) * 256;
        round(self.acts.total)
            + round(self.staging.total)
            + round(self.out.total)
            + round(4 * KEPT_LAUNCHES * self.rows)
            + round(PENALTY_ENTRY_BYTES * self.penalty_entries)
            + round(4 * self.mask_words)
    }
}

/// Bytes of one [`DevicePenaltyEntry`].
const PENALTY_ENTRY_BYTES: usize = std::mem::size_of::<DevicePenaltyEntry>();

/// Initial capacity of the penalty-entry buffer: one entry per batched token (`max_tokens`,
/// as vLLM's `max_num_batched_tokens`). A launch whose rows have more distinct history tokens
/// grows it (see [`CudaWorker::reserve_penalties`]).
fn initial_penalty_entries(max_tokens: usize) -> usize {
    max_tokens.max(1)
}

/// What a worker allocates on the device, in bytes, before its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePlan {
    /// The weights in the worker's dtype (q/k/v and gate/up fused, Qwen's q/k/v biases and q/k
    /// norms as two more fused groups per layer, 256-byte aligned tensors).
    pub weight_bytes: usize,
    /// Activations, staging, sampler outputs, the sampled-id ring and the RoPE table.
    pub buffer_bytes: usize,
    /// One KV page across all layers (K and V).
    pub kv_bytes_per_block: usize,
}

/// Whether the CUDA backend runs models of `cfg`'s architecture: checked by
/// [`CudaWorker::new`] and by commands before they open a GPU, so that a model the backend
/// does not run is named first.
///
/// # Errors
/// [`CudaWorkerError::Unsupported`] naming what is not implemented (mixture-of-experts MLPs,
/// some partial-RoPE combinations) or a head layout the kernels do not take.
pub fn check_model(cfg: &ModelConfig) -> Result<(), CudaWorkerError> {
    check_shape(cfg)
}

/// Rejects shapes the kernels do not support (heads not a multiple of the KV heads, head dims
/// over 1024) and architectures not implemented here.
fn check_shape(cfg: &ModelConfig) -> Result<(), CudaWorkerError> {
    if cfg.num_key_value_heads == 0
        || !cfg
            .num_attention_heads
            .is_multiple_of(cfg.num_key_value_heads)
        || cfg.head_dim > 1024
    {
        return Err(CudaWorkerError::Unsupported(format!(
            "heads {} / kv heads {} / head_dim {}",
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        )));
    }
    if let Some(m) = &cfg.moe {
        // (The grouped GEMM's column blocks are its grid's y, at most 65535.)
        let col_blocks = (2 * m.intermediate_size).div_ceil(MOE_TILE_COLS);
        if m.top_k > MOE_MAX_TOP_K || m.num_experts > MOE_MAX_EXPERTS || col_blocks > 65535 {
            return Err(CudaWorkerError::Unsupported(format!(
                "mixture-of-experts layers of {} experts, top {}, width {}: the CUDA kernels \
                 take at most {MOE_MAX_EXPERTS} experts, top {MOE_MAX_TOP_K} and width {}; \
                 --device cpu runs them",
                m.num_experts,
                m.top_k,
                m.intermediate_size,
                65535 * MOE_TILE_COLS / 2
            )));
        }
    }
    // The q rows carry a partial-RoPE attention factor on every layer (`rotated_q_scale`),
    // which Gemma's local RoPE layers do not have.
    if rotated_q_scale(cfg).is_some() && cfg.local_rope_theta.is_some() {
        return Err(CudaWorkerError::Unsupported(
            "partial RoPE with a RoPE attention factor beside local RoPE layers is not \
             implemented on CUDA; --device cpu runs it"
                .into(),
        ));
    }
    // With partial RoPE the attention factor goes into the q rows of the rotated dims
    // ([`rotated_q_scale`]); a per-head q norm after the projection would undo that.
    if rotated_q_scale(cfg).is_some() && cfg.qk_norm {
        return Err(CudaWorkerError::Unsupported(format!(
            "partial RoPE (rotary_dim {} of head_dim {}) with a RoPE attention factor ({}) and \
             q/k head norms is not implemented on CUDA; --device cpu runs it",
            cfg.rotary_dim,
            cfg.head_dim,
            cfg.rope_attention_factor()
        )));
    }
    Ok(())
}

/// The factor the q rows of the rotated dims are multiplied by at upload, for partial RoPE
/// with a RoPE attention factor `a` (LongRoPE's, YaRN's): `a²`, else `None`.
///
/// transformers multiplies cos and sin by `a` for q and k, so each rotated pair's share of
/// q.k by `a²` and the unrotated dims' share not at all. The step applies `a²` to the whole
/// logit when every pair rotates (the attention `scale`); with partial RoPE it cannot, and
/// RoPE is linear in q, so `a² R(W x + b) = R(a² W x + a² b)`: the q projection rows (and
/// bias) of the rotated dims, in the permuted head layout (`ModelConfig::rotary_dim`), are
/// scaled once here, rounded to the device dtype. The KV cache holds unscaled keys, as with
/// full RoPE.
pub(crate) fn rotated_q_scale(cfg: &ModelConfig) -> Option<f32> {
    let a = cfg.rope_attention_factor();
    (cfg.rotary_dim != cfg.head_dim && a != 1.0).then_some(a * a)
}

/// Multiplies the rotated dims' rows of the q part (the first `heads * head_dim` rows of
/// `row_elems` device elements each) of a device-dtype group in place by `factor`: rows
/// `i` and `i + head_dim / 2` of each head for `i < rotary_dim / 2` ([`rotated_q_scale`]).
fn scale_rotated_q_rows(
    bytes: &mut [u8],
    cfg: &ModelConfig,
    dtype: Dtype,
    row_elems: usize,
    factor: f32,
) {
    let (d, es) = (cfg.head_dim, dtype.size());
    let row = row_elems * es;
    for head in 0..cfg.num_attention_heads {
        for i in 0..cfg.rotary_dim / 2 {
            for r in [i, i + d / 2] {
                let at = (head * d + r) * row;
                for e in bytes[at..at + row].chunks_exact_mut(es) {
                    match dtype {
                        Dtype::F32 => {
                            let x = f32::from_le_bytes([e[0], e[1], e[2], e[3]]) * factor;
                            e.copy_from_slice(&x.to_le_bytes());
                        }
                        Dtype::Bf16 => {
                            let x = half::bf16::from_le_bytes([e[0], e[1]]).to_f32() * factor;
                            e.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
                        }
                        Dtype::F16 => {
                            let x = half::f16::from_le_bytes([e[0], e[1]]).to_f32() * factor;
                            e.copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
                        }
                    }
                }
            }
        }
    }
}

/// Head dims with a fast (warp-per-key) attention kernel.
fn fast_head_dim(hd: usize) -> bool {
    matches!(hd, 64 | 128 | 256)
}

impl CudaWorker {
    /// Brings the worker up on `opts.device`: compiles the kernels for the device's
    /// architecture and `opts.dtype`, uploads `weights` (converted to `opts.dtype`, q/k/v and
    /// gate/up fused), allocates activations, staging and the KV pool (sized per
    /// `opts.kv_blocks`), and captures the decode graphs unless `opts.enforce_eager`.
    ///
    /// # Errors
    /// [`CudaWorkerError`]: no driver or cuBLAS, no such device, NVRTC failures, a model
    /// shape the kernels do not support, not enough device memory.
    pub fn new(
        cfg: ModelConfig,
        weights: impl Into<ModelWeights>,
        opts: CudaWorkerOptions,
    ) -> Result<Self, CudaWorkerError> {
        check_shape(&cfg)?;
        let dev = CudaDevice::new(
            opts.device,
            &opts.include_dir,
            opts.dtype,
            &opts.tuning.kernel_defines,
        )?;
        Self::with_device(Arc::new(dev), cfg, weights, opts)
    }

    /// As [`CudaWorker::new`] on a given device whose kernels are those of `opts.dtype`
    /// (`opts.device` and `opts.include_dir` are not used): the host emulator in tests.
    ///
    /// # Errors
    /// As [`CudaWorker::new`], from the device's calls.
    pub fn with_device(
        dev: Arc<dyn Device>,
        cfg: ModelConfig,
        weights: impl Into<ModelWeights>,
        opts: CudaWorkerOptions,
    ) -> Result<Self, CudaWorkerError> {
        check_shape(&cfg)?;
        let dtype = opts.dtype;
        dev.bind()?;
        let (free_before, total_mem) = dev.mem_info()?;
        let alloc = |bytes: usize| Buf::new(&dev, bytes);

        // Weights: one allocation, tensors at 256-byte aligned offsets.
        let es = dtype.size();
        let wl = WeightLayout::new(&cfg, es);
        let (embed_off, norm_off, head_off) = (wl.embed, wl.norm, wl.head);
        let layer_offs = wl.layers;
        let weight_bytes = wl.total;
        let wbuf = alloc(weight_bytes)?;
        // One device group (a tensor, or fused q|k|v and gate|up) at a time: peak host memory
        // is one group in the device dtype, plus the f32 weights when they came that way.
        // Norm weights used as `norm_offset + w` (Gemma 3): folded here, in f32, then rounded
        // once to the device dtype (exact in f32; one rounding of 1 + w in bf16/f16, where
        // transformers keeps 1 + w in f32).
        let norm_offs: Vec<usize> = if cfg.norm_offset != 0.0 {
            let groups = norm_groups(&cfg);
            layer_offs
                .iter()
                .flat_map(|offs| groups.iter().map(|&g| offs[g]).collect::<Vec<_>>())
                .chain([norm_off])
                .collect()
        } else {
            Vec::new()
        };
        let upload = |o: usize, parts: &[WeightPart<'_>]| -> Result<(), CudaWorkerError> {
            let mut bytes = group_device_bytes(parts, dtype);
            if norm_offs.contains(&o) {
                let vals: Vec<f32> = from_device_bytes(&bytes, dtype)
                    .into_iter()
                    .map(|x| x + cfg.norm_offset)
                    .collect();
                bytes = to_device_bytes(&vals, dtype);
            }
            // The q|k|v group and the q|k|v bias group start with q's rows.
            if let Some(f) = rotated_q_scale(&cfg) {
                if layer_offs.iter().any(|offs| offs[1] == o) {
                    scale_rotated_q_rows(&mut bytes, &cfg, dtype, cfg.hidden_size, f);
                }
                if let Some(g) = bias_group(&cfg) {
                    if layer_offs.iter().any(|offs| offs[g] == o) {
                        scale_rotated_q_rows(&mut bytes, &cfg, dtype, 1, f);
                    }
                }
            }
            if o + bytes.len() > weight_bytes {
                return Err(CudaWorkerError::Unsupported(format!(
                    "weight group at byte {o} ({} bytes) overruns the {weight_bytes}-byte layout",
                    bytes.len()
                )));
            }
            // SAFETY: `o + bytes.len()` lies inside the weight allocation (checked above).
            unsafe { dev.copy_htod(wbuf.at(o), &bytes) }
        };
        // Per layer, from its tensors in `layer_tensor_shapes` order (input norm, q, k, v, o,
        // post norm, gate, up, down, then Qwen's biases and norms, the experts'), the fused
        // device groups of `layer_groups`.
        match weights.into() {
            ModelWeights::Host(w) => {
                let LlamaWeights {
                    embed,
                    layers,
                    norm,
                    lm_head,
                } = w;
                upload(embed_off, &[WeightPart::F32(&embed)])?;
                drop(embed);
                for (li, (l, offs)) in layers.into_iter().zip(&layer_offs).enumerate() {
                    let t = l.tensors();
                    let groups = layer_groups(&cfg, li);
                    let shapes_len = baton_model::weights::layer_tensor_shapes(&cfg, li).len();
                    if t.len() != shapes_len {
                        return Err(CudaWorkerError::Unsupported(format!(
                            "a layer has {} weight tensors, the config wants {shapes_len}",
                            t.len()
                        )));
                    }
                    for (g, &o) in groups.iter().zip(offs) {
                        let parts: Vec<_> = g.iter().map(|&i| WeightPart::F32(t[i])).collect();
                        upload(o, &parts)?;
                    }
                }
                upload(norm_off, &[WeightPart::F32(&norm)])?;
                upload(head_off, &[WeightPart::F32(&lm_head)])?;
            }
            ModelWeights::Mapped(src) => {
                let model_err = |e: baton_model::ModelError| {
                    CudaWorkerError::Unsupported(format!("reading weights: {e}"))
                };
                // Against this worker's config, which may not be the checkpoint's own (bench
                // decode --config): every shape, and no extra layers.
                src.check_llama(&cfg).map_err(model_err)?;
                let (h, v) = (cfg.hidden_size, cfg.vocab_size);
                let raw = |n: &str, s: &[usize]| src.get_shaped(n, s).map_err(model_err);
                upload(
                    embed_off,
                    &[WeightPart::Raw(raw("model.embed_tokens.weight", &[v, h])?)],
                )?;
                for (i, offs) in layer_offs.iter().enumerate() {
                    let t = baton_model::weights::layer_tensor_shapes(&cfg, i)
                        .iter()
                        .map(|(n, s)| raw(n, s))
                        .collect::<Result<Vec<_>, _>>()?;
                    for (g, &o) in layer_groups(&cfg, i).iter().zip(offs) {
                        let parts: Vec<_> = g.iter().map(|&i| WeightPart::Raw(t[i])).collect();
                        upload(o, &parts)?;
                    }
                }
                upload(
                    norm_off,
                    &[WeightPart::Raw(raw("model.norm.weight", &[h])?)],
                )?;
                let head = src.lm_head_name(&cfg).map_err(model_err)?;
                upload(head_off, &[WeightPart::Raw(raw(head, &[v, h])?)])?;
            }
        }
        let mut layer_ptrs = Vec::with_capacity(layer_offs.len());
        let (router_group, shared_groups) = moe_groups(&cfg);
        for (li, offs) in layer_offs.iter().enumerate() {
            layer_ptrs.push(LayerPtrs {
                moe: cfg.layer_is_moe(li).then(|| MoePtrs {
                    router: wbuf.at(offs[router_group]),
                    shared_gate_up: shared_groups.map_or(0, |(g, _, _)| wbuf.at(offs[g])),
                    shared_down: shared_groups.map_or(0, |(_, g, _)| wbuf.at(offs[g])),
                    shared_gate: shared_groups.map_or(0, |(_, _, g)| wbuf.at(offs[g])),
                }),
                input_norm: wbuf.at(offs[0]),
                qkv: wbuf.at(offs[1]),
                o: wbuf.at(offs[2]),
                post_norm: wbuf.at(offs[3]),
                gate_up: wbuf.at(offs[4]),
                down: wbuf.at(offs[5]),
                qkv_bias: bias_group(&cfg).map_or(0, |g| wbuf.at(offs[g])),
                qk_norm: norm_group(&cfg).map_or(0, |g| wbuf.at(offs[g])),
                attn_out_norm: out_norm_groups(&cfg).map_or(0, |(g, _)| wbuf.at(offs[g])),
                mlp_out_norm: out_norm_groups(&cfg).map_or(0, |(_, g)| wbuf.at(offs[g])),
            });
        }
        // RoPE tables: the global one, then Gemma 3's local one (its sliding layers).
        let upload_inv = |inv: Vec<f32>| -> Result<Buf, CudaWorkerError> {
            let buf = alloc(4 * inv.len())?;
            let bytes: Vec<u8> = inv.iter().flat_map(|x| x.to_le_bytes()).collect();
            // SAFETY: the allocation holds `4 * inv.len()` bytes.
            unsafe { dev.copy_htod(buf.ptr, &bytes) }?;
            Ok(buf)
        };
        let inv_freq = upload_inv(cfg.rope_inv_freq())?;
        let inv_freq_local =
            match (0..cfg.num_hidden_layers).find(|&li| cfg.layer_rope_is_local(li)) {
                Some(li) => Some(upload_inv(cfg.layer_rope(li).0)?),
                None => None,
            };

        // Activations, staging, sampler outputs.
        let bp = BufferPlan::new(&cfg, &opts, es);
        let (a, layout, oo, r, max_partitions) =
            (bp.acts, bp.staging, bp.out, bp.rows, bp.max_partitions);
        let acts = alloc(a.total)?;
        let staging_dev = alloc(layout.total)?;
        let out_dev = alloc(oo.total)?;
        let ring = alloc(4 * KEPT_LAUNCHES * r)?;
        let pen_cap = bp.penalty_entries;
        let pen_dev = alloc(PENALTY_ENTRY_BYTES * pen_cap)?;
        let mask_cap = bp.mask_words;
        let mask_dev = alloc(4 * mask_cap)?;
        let frames = (0..FENCE_FRAMES)
            .map(|_| {
                Ok(HostFrame {
                    staging: Pinned::new(&dev, layout.total)?,
                    pen: Pinned::new(&dev, PENALTY_ENTRY_BYTES * pen_cap)?,
                    mask: Pinned::new(&dev, 4 * mask_cap)?,
                    out: Pinned::new(&dev, oo.total)?,
                })
            })
            .collect::<Result<Vec<_>, CudaWorkerError>>()?;

        // KV pool.
        let num_blocks = Self::plan_kv_blocks(&cfg, &opts, free_before, total_mem)?;
        let per_block = Self::device_plan(&cfg, &opts)?.kv_bytes_per_block;
        let kv = alloc(num_blocks * per_block)?;

        dev.synchronize()?;

        let mut w = CudaWorker {
            dev,
            cfg,
            dtype,
            _weights: wbuf,
            embed: 0,
            layers: layer_ptrs,
            final_norm: 0,
            lm_head: 0,
            inv_freq,
            inv_freq_local,
            weight_bytes,
            kv,
            num_blocks,
            acts,
            act_off: a,
            staging_dev,
            layout,
            frames,
            enqueued: 0,
            inflight: VecDeque::new(),
            pending_inputs: 0,
            pen_dev,
            pen_cap,
            pen_used: 0,
            histories: PenaltyHistories::new(),
            mask_dev,
            mask_cap,
            mask_used: 0,
            masks: TokenMasks::default(),
            mask_row: Vec::new(),
            prompt_out: Vec::new(),
            prompt_scores: Vec::new(),
            out_dev,
            ring,
            ring_host: Ring::default(),
            graphs: HashMap::new(),
            lora_graphs: HashMap::new(),
            buckets: Vec::new(),
            max_partitions,
            part_rows: r,
            persistent: None,
            profiling: false,
            lora: None,
            lora_rows: Vec::new(),
            debug_moe: Vec::new(),
            lora_tokens: 0,
            opts,
        };
        w.embed = w._weights.at(embed_off);
        w.final_norm = w._weights.at(norm_off);
        w.lm_head = w._weights.at(head_off);
        if w.opts.tuning.persistent_decode {
            w.persistent = Some(w.plan_persistent()?);
        }
        if !w.opts.enforce_eager {
            w.capture_graphs()?;
        }
        Ok(w)
    }

    /// Sets up the persistent decode kernel (its layer table and grid).
    ///
    /// # Errors
    /// [`CudaWorkerError::Unsupported`] when the model, the options (`--no-fused-decode`) or
    /// the device cannot take it (it was asked for explicitly, so never a silent fallback), or
    /// a device error.
    fn plan_persistent(&self) -> Result<Persistent, CudaWorkerError> {
        let refuse = |why: String| {
            Err(CudaWorkerError::Unsupported(format!(
                "{}=1: the persistent decode kernel cannot run {why}",
                crate::plan::PERSISTENT_DECODE_ENV
            )))
        };
        if !self.opts.fused_decode {
            return refuse("with --no-fused-decode".into());
        }
        if let Some(why) = persistent_refusal(&self.cfg, self.dtype.size()) {
            return refuse(format!("this model: {why}"));
        }
        let name = format!("baton_decode_layers_hd{}", self.cfg.head_dim);
        let resident = self
            .dev
            .max_resident_blocks(&name, crate::plan::DECODE_LAYERS_BLOCK)?;
        let grid = crate::plan::decode_layers_grid(
            self.dev.multiprocessor_count(),
            resident,
            self.opts.tuning.persistent_blocks_per_sm,
        );
        if grid == 0 {
            return refuse(format!("on this device: no block of {name} fits on an SM"));
        }
        let mut bytes = Vec::with_capacity(self.layers.len() * 64);
        for (li, lw) in self.layers.iter().enumerate() {
            let (kc, vc) = self.kv_layer(li);
            for p in [
                lw.qkv,
                lw.o,
                lw.gate_up,
                lw.down,
                lw.input_norm,
                lw.post_norm,
                kc,
                vc,
            ] {
                bytes.extend_from_slice(&p.to_le_bytes());
            }
        }
        let table = Buf::new(&self.dev, bytes.len())?;
        // SAFETY: the allocation holds `bytes.len()` bytes.
        unsafe { self.dev.copy_htod(table.ptr, &bytes) }?;
        self.dev.synchronize()?;
        Ok(Persistent {
            table,
            grid: grid as u32,
        })
    }

    /// The persistent decode kernel's grid (blocks) when batch-of-one decode steps run
    /// through it ([`crate::plan::PERSISTENT_DECODE_ENV`]), else `None`.
    pub fn persistent_decode(&self) -> Option<u32> {
        self.persistent.as_ref().map(|p| p.grid)
    }

    /// What a worker for `cfg` and `opts` allocates besides its KV cache (no device needed).
    ///
    /// # Errors
    /// [`CudaWorkerError::Unsupported`] for a shape the kernels do not support or a KV page
    /// size that overflows.
    pub fn device_plan(
        cfg: &ModelConfig,
        opts: &CudaWorkerOptions,
    ) -> Result<DevicePlan, CudaWorkerError> {
        check_shape(cfg)?;
        let es = opts.dtype.size();
        let kv_bytes_per_block = kv_bytes_per_block(
            cfg.num_hidden_layers,
            opts.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            es,
        )
        .ok_or_else(|| CudaWorkerError::Unsupported("KV block size overflows".into()))?;
        let tables =
            1 + usize::from((0..cfg.num_hidden_layers).any(|li| cfg.layer_rope_is_local(li)));
        let rope = tables * (4 * cfg.rope_inv_freq().len()).max(16).div_ceil(256) * 256;
        Ok(DevicePlan {
            weight_bytes: WeightLayout::new(cfg, es).total,
            buffer_bytes: BufferPlan::new(cfg, opts, es).device_bytes() + rope,
            kv_bytes_per_block,
        })
    }

    /// The KV page count a worker for `cfg` and `opts` allocates on a device that reports
    /// `free` and `total` bytes (`cuMemGetInfo`) before the worker's weights: `opts.kv_blocks`
    /// when fixed, else [`kv_num_blocks`] under the utilization with [`DevicePlan`]'s weights
    /// and buffers plus a fixed slack (graphs, cuBLAS, fragmentation) as the reserve, capped
    /// at `max_blocks`. The worker calls this itself, so a caller that probes the same device
    /// (e.g. `baton serve` sizing the scheduler's pool) gets the count the worker will use.
    ///
    /// # Errors
    /// As [`CudaWorker::device_plan`], and [`CudaWorkerError::KvSizing`].
    pub fn plan_kv_blocks(
        cfg: &ModelConfig,
        opts: &CudaWorkerOptions,
        free: usize,
        total: usize,
    ) -> Result<usize, CudaWorkerError> {
        let p = Self::device_plan(cfg, opts)?;
        Ok(match opts.kv_blocks {
            KvBlocks::Fixed(n) => n.max(1),
            KvBlocks::Utilization {
                fraction,
                max_blocks,
            } => kv_num_blocks(
                free,
                total,
                fraction,
                p.weight_bytes,
                p.kv_bytes_per_block,
                p.buffer_bytes + RESERVE_SLACK,
            )?
            .min(max_blocks.max(1)),
        })
    }

    /// Starts (`true`, discarding earlier timings) or stops timing every kernel and GEMM of
    /// each launch on its own; launches run eagerly (no graph replay) meanwhile. A diagnostic:
    /// the timing adds an event pair per call.
    pub fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
        self.dev.set_profiling(on);
    }

    /// Starts (`true`) or stops step timing: each launch's device work, from its upload to
    /// its fence, is bracketed by a pair of timing events (see
    /// [`CudaWorker::last_step_device_ms`]). For benchmarks; off by default.
    ///
    /// # Errors
    /// The timing events cannot be created.
    pub fn set_step_timing(&mut self, on: bool) -> Result<(), WorkerError> {
        self.dev.set_step_timing(on).map_err(dev_err)
    }

    /// Milliseconds on the stream from the last launch's upload to its fence (the GPU's share
    /// of the step, including any gap while the host was still submitting), or `None` when
    /// step timing is off. The rest of a step's wall time is host work (resolving rows,
    /// staging, the wait's wake-up, the completion) that pipelined launches could hide.
    pub fn last_step_device_ms(&self) -> Option<f64> {
        self.dev.step_device_ms()
    }

    /// The launch trace of the last launch ([`crate::trace`]; read after its fence), or `None`
    /// unless the kernels were compiled with `BATON_TRACE=1` in
    /// [`Tuning::kernel_defines`](crate::plan::Tuning::kernel_defines). A diagnostic for
    /// one launch in flight at a time.
    ///
    /// # Errors
    /// Device errors.
    pub fn take_launch_trace(&self) -> Result<Option<crate::trace::StepTrace>, WorkerError> {
        self.dev.take_launch_trace().map_err(dev_err)
    }

    /// The calls timed since [`CudaWorker::set_profiling`]: `(kernel name or GEMM label,
    /// milliseconds)` in launch order.
    ///
    /// # Errors
    /// Device errors.
    pub fn take_profile(&self) -> Result<Vec<(String, f64)>, WorkerError> {
        self.dev.take_profile().map_err(dev_err)
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Debug hook: the whole weight allocation copied back ([`CudaWorker::weight_bytes`]
    /// bytes: every tensor in the device dtype at its layout offset, padding zeroed), to check
    /// that two ways of loading a model put the same bits on the device.
    ///
    /// # Errors
    /// Device errors.
    pub fn download_weights(&self) -> Result<Vec<u8>, WorkerError> {
        self.bind().map_err(dev_err)?;
        let mut host = vec![0u8; self.weight_bytes];
        // SAFETY: the weight allocation holds `weight_bytes` bytes; the stream is idle after
        // construction or a completed launch, and nothing writes weights after start-up.
        unsafe { self.dev.copy_dtoh(&mut host, self._weights.ptr) }.map_err(dev_err)?;
        Ok(host)
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Capacity of the token-mask buffer, in u32 words (one row's mask at first; it grows when
    /// a launch has more guided rows).
    pub fn token_mask_capacity(&self) -> usize {
        self.mask_cap
    }

    /// Capacity of the penalty-entry buffer, in entries (it grows when a launch needs more).
    pub fn penalty_capacity(&self) -> usize {
        self.pen_cap
    }

    /// Batch sizes with a captured decode graph (empty under `enforce_eager`).
    pub fn graph_buckets(&self) -> &[usize] {
        &self.buckets
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn bind(&self) -> Result<(), CudaWorkerError> {
        self.dev.bind()
    }

    fn kv_layer(&self, layer: usize) -> (u64, u64) {
        let per = self.num_blocks
            * self.opts.block_size
            * self.cfg.num_key_value_heads
            * self.cfg.head_dim
            * self.dtype.size();
        let k = self.kv.at(2 * layer * per);
        (k, k + per as u64)
    }

    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut KArgs,
    ) -> Result<(), CudaWorkerError> {
        self.launch_as(name, grid, block, args, false)
    }

    /// [`Self::launch`], or a cooperative launch (`Device::launch_cooperative`, for a kernel
    /// with grid barriers; the grid at most the resident blocks).
    fn launch_as(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut KArgs,
        cooperative: bool,
    ) -> Result<(), CudaWorkerError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let n = args.n;
        let mut ptrs: Vec<*mut c_void> = args.vals[..n]
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: every call site passes the argument list of `name`'s C signature in order
        // (documented next to each call, checked against kernels/*.cu and exercised under the
        // host emulator, which checks the count): device pointers as u64, ints in the low 4
        // bytes of their slot, floats as their bits. Each slot stays alive (in `args`) until
        // the launch has read the parameters, which it does before returning. All pointers
        // address live allocations of this worker sized for the launch's token and row counts.
        // A cooperative launch's grid is at most the resident blocks the driver reported (a
        // larger one fails the launch instead of hanging at a grid barrier).
        unsafe {
            if cooperative {
                self.dev.launch_cooperative(name, grid, block, &mut ptrs)
            } else {
                self.dev.launch(name, grid, block, &mut ptrs)
            }
        }
    }

    /// `out[t, n] = x[t, k] · W[n, k]ᵀ`, row-major, through `cublasGemmEx` (fp32 accumulate);
    /// `out` is f32 when `out_f32`, else the element type.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        what: &'static str,
        out: u64,
        x: u64,
        w: u64,
        t: usize,
        n: usize,
        k: usize,
        out_f32: bool,
    ) -> Result<(), CudaWorkerError> {
        if t == 0 {
            return Ok(());
        }
        let ct = if out_f32 { Dtype::F32 } else { self.dtype };
        // Column-major view of the row-major product: C[n x t] = W[k x n]ᵀ · X[k x t] with
        // lda = ldb = k and ldc = n.
        let g = Gemm {
            what,
            trans_a: true,
            trans_b: false,
            m: n,
            n: t,
            k,
            a: w,
            lda: k,
            b: x,
            ldb: k,
            ab_type: self.dtype,
            c: out,
            ldc: n,
            c_type: ct,
        };
        // SAFETY: `w` holds n*k elements, `x` t*k, `out` t*n of the stated types (allocations
        // sized for max_tokens / max_rows).
        unsafe { self.dev.gemm(&g) }
    }

    /// Enqueues the forward pass and the sampler for `t` tokens in `r` rows whose inputs are
    /// already in the device staging buffer. With `dumps`, synchronizes after each layer and
    /// copies the residual stream back (never under graph capture). With `token_masks`, the
    /// token masks the staging buffer names are applied to the logits before the sampler
    /// (always under graph capture: a replay may carry guided rows; rows without a mask cost
    /// their blocks one load). With `lora`, the tokens' adapter ids are in the LoRA id buffer
    /// and each linear layer an adapter updates gets its update after its GEMM
    /// ([`CudaWorker::lora_update`]); such a launch always takes the per-kernel cuBLAS path
    /// (never the fused decode GEMVs, the persistent kernel or a graph).
    fn enqueue_forward(
        &self,
        t: usize,
        r: usize,
        mode: AttnMode,
        mut dumps: Option<&mut Dumps>,
        token_masks: bool,
        lora: bool,
    ) -> Result<(), CudaWorkerError> {
        let c = &self.cfg;
        let (h, hd, nh, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let es = self.dtype.size() as u64;
        let q_w = nh * hd;
        let kv_w = kvh * hd;
        let qkv_w = q_w + 2 * kv_w;
        let im = c.intermediate_size;
        let eps = c.rms_norm_eps;
        // YaRN's attention factor scales cos and sin in HF, so every q.k logit by its square:
        // applied here instead (the KV cache holds unscaled keys; only this worker reads them).
        // (With partial RoPE the q rows of the rotated dims carry it instead: rotated_q_scale.)
        let att = match rotated_q_scale(c) {
            Some(_) => 1.0,
            None => c.rope_attention_factor(),
        };
        // Scores scale by head_dim^-0.5 (Gemma 3: query_pre_attn_scalar^-0.5); Gemma's local
        // layers have plain RoPE, so no RoPE factor.
        let local_scale = c.attention_scale();
        let scale = local_scale * att * att;
        let layer_scale = |li: usize| {
            if c.layer_rope_is_local(li) {
                local_scale
            } else {
                scale
            }
        };
        let a = &self.act_off;
        let act = |o: usize| self.acts.at(o);
        let st = |o: usize| self.staging_dev.at(o);
        let l = &self.layout;
        let norm_block = if h >= 4096 { 1024 } else { 256 };
        // add_rmsnorm(out, residual, x, weight, num_tokens, hidden, eps): resid += tmp, then
        // xn = rmsnorm(resid) * weight. With Gemma 3's output norms the sublayer output was
        // normalized into xn first (`out_norm`), and xn is what is added.
        let sub_out = if c.sandwich_norms { a.xn } else { a.tmp };
        let add_rmsnorm = |weight: u64| {
            self.launch(
                "baton_add_rmsnorm",
                (t as u32, 1, 1),
                norm_block,
                KArgs::new()
                    .p(act(a.xn))
                    .p(act(a.resid))
                    .p(act(sub_out))
                    .p(weight)
                    .i(t)
                    .i(h)
                    .f(eps),
            )
        };
        // rmsnorm(out, in, weight, num_tokens, hidden, eps): xn = rmsnorm(input) * weight.
        let rmsnorm = |input: usize, weight: u64| {
            self.launch(
                "baton_rmsnorm",
                (t as u32, 1, 1),
                norm_block,
                KArgs::new()
                    .p(act(a.xn))
                    .p(act(input))
                    .p(weight)
                    .i(t)
                    .i(h)
                    .f(eps),
            )
        };
        // The norm of a sublayer's output (tmp) before its residual add (Gemma 3); nothing
        // without one.
        let out_norm = |weight: u64| match weight {
            0 => Ok(()),
            w => rmsnorm(a.tmp, w),
        };

        // embedding(out, table, ids, sampled_ring, num_tokens, hidden, vocab, scale): resolves
        // the pending ids from the ring too; Gemma 3 scales the rows.
        self.launch(
            "baton_embedding_gather",
            (t as u32, 1, 1),
            256,
            KArgs::new()
                .p(act(a.resid))
                .p(self.embed)
                .p(st(l.ids))
                .p(self.ring.ptr)
                .i(t)
                .i(h)
                .i(c.vocab_size)
                .f(c.embed_scale.unwrap_or(1.0)),
        )?;
        // Decode batches of at most GEMV_MAX_TOKENS rows: the fused GEMV path. Every row is
        // one token (t == r), so the LM head reads the residual rows directly. (Not for Gemma
        // 3's or mixture-of-experts layers: `cublas_layers`.)
        let fused = self.opts.fused_decode
            && mode == AttnMode::Decode
            && t == r
            && t <= GEMV_MAX_TOKENS
            && !cublas_layers(c)
            && !lora;
        // The LoRA update of linear `kind` of layer `li` (input `x` `[t, k]`, output `y`
        // `[t, n]`); nothing for a launch without adapter rows.
        let lora_update = |li: usize, kind: LoraLinear, x: usize, k: usize, y: usize, n: usize| {
            if lora {
                self.lora_update(li, kind, t, act(x), k, act(y), n)
            } else {
                Ok(())
            }
        };
        if fused {
            // gemv(out, x, w, norm_w, T, N, K, eps, mode, rows_per_block); modes: 0 store,
            // 1 f32, 2 residual add, 3 SiLU-and-mul (kernels/gemv.cu).
            // A batch of one takes the entries specialized for it (gemv.cu).
            let sms = self.dev.multiprocessor_count();
            let gemv = |out: u64, x: u64, w: u64, norm: u64, n: usize, k: usize, m: usize| {
                let rows = gemv_rows_per_block(t, n, sms, self.opts.tuning.gemv1_blocks_per_sm);
                // The ring entries hold rows of up to GEMV_ASYNC_XS_BYTES.
                let ring = self.opts.tuning.gemv_async && k * es as usize <= GEMV_ASYNC_XS_BYTES;
                let entry = match (t, m, ring) {
                    (1, 3, false) => "baton_gemv_silu_t1",
                    (1, 3, true) => "baton_gemv_silu_t1_async",
                    (1, _, false) => "baton_gemv_t1",
                    (1, _, true) => "baton_gemv_t1_async",
                    _ => "baton_gemv",
                };
                self.launch(
                    entry,
                    (n.div_ceil(rows) as u32, 1, 1),
                    256,
                    KArgs::new()
                        .p(out)
                        .p(x)
                        .p(w)
                        .p(norm)
                        .i(t)
                        .i(n)
                        .i(k)
                        .f(eps)
                        .i(m)
                        .i(rows),
                )
            };
            let persistent = self
                .persistent
                .as_ref()
                .filter(|_| t == 1 && dumps.is_none());
            // The layers one launch each, or all in the persistent kernel's one launch.
            let per_kernel = match persistent {
                Some(p) => {
                    self.decode_layers(p, scale)?;
                    &self.layers[..0]
                }
                None => &self.layers[..],
            };
            for (li, lw) in per_kernel.iter().enumerate() {
                gemv(act(a.qkv), act(a.resid), lw.qkv, lw.input_norm, qkv_w, h, 0)?;
                self.qkv_post(t, lw)?;
                let q = act(a.qkv);
                let k = q + q_w as u64 * es;
                let v = k + kv_w as u64 * es;
                let (kc, vc) = self.kv_layer(li);
                if !self.decode_fuses_rope(mode) {
                    self.rope_and_cache(t, q, k, v, kc, vc, qkv_w, self.layer_inv_freq(li))?;
                }
                self.attention(li, t, r, mode, q, qkv_w, kc, vc, layer_scale(li))?;
                gemv(act(a.resid), act(a.attn), lw.o, 0, h, q_w, 2)?;
                gemv(act(a.act), act(a.resid), lw.gate_up, lw.post_norm, im, h, 3)?;
                gemv(act(a.resid), act(a.act), lw.down, 0, h, im, 2)?;
                if let Some(d) = dumps.as_deref_mut() {
                    self.dump_resid(d, t)?;
                }
            }
            gemv(
                act(a.logits),
                act(a.resid),
                self.lm_head,
                self.final_norm,
                c.vocab_size,
                h,
                1,
            )?;
        } else {
            for (li, lw) in self.layers.iter().enumerate() {
                if li == 0 {
                    rmsnorm(a.resid, lw.input_norm)?;
                } else {
                    add_rmsnorm(lw.input_norm)?;
                    if let Some(d) = dumps.as_deref_mut() {
                        self.dump_resid(d, t)?;
                    }
                }
                self.gemm(
                    "gemm qkv",
                    act(a.qkv),
                    act(a.xn),
                    lw.qkv,
                    t,
                    qkv_w,
                    h,
                    false,
                )?;
                lora_update(li, LoraLinear::Qkv, a.xn, h, a.qkv, qkv_w)?;
                self.qkv_post(t, lw)?;
                let q = act(a.qkv);
                let k = q + q_w as u64 * es;
                let v = k + kv_w as u64 * es;
                let (kc, vc) = self.kv_layer(li);
                if !self.decode_fuses_rope(mode) {
                    self.rope_and_cache(t, q, k, v, kc, vc, qkv_w, self.layer_inv_freq(li))?;
                }
                self.attention(li, t, r, mode, q, qkv_w, kc, vc, layer_scale(li))?;
                self.gemm("gemm o", act(a.tmp), act(a.attn), lw.o, t, h, q_w, false)?;
                lora_update(li, LoraLinear::O, a.attn, q_w, a.tmp, h)?;
                out_norm(lw.attn_out_norm)?;
                add_rmsnorm(lw.post_norm)?;
                if let Some(m) = &lw.moe {
                    self.moe_mlp(t, lw, m)?;
                    if let Some(d) = dumps.as_deref_mut() {
                        self.dump_moe(d, t)?;
                    }
                    out_norm(lw.mlp_out_norm)?;
                    continue;
                }
                self.gemm(
                    "gemm gate_up",
                    act(a.gate_up),
                    act(a.xn),
                    lw.gate_up,
                    t,
                    2 * im,
                    h,
                    false,
                )?;
                lora_update(li, LoraLinear::GateUp, a.xn, h, a.gate_up, 2 * im)?;
                // silu_and_mul(out, in, num_tokens, inter), or Gemma's GELU(tanh) the same way
                self.launch(
                    self.mlp_act(),
                    (t as u32, 1, 1),
                    256,
                    KArgs::new().p(act(a.act)).p(act(a.gate_up)).i(t).i(im),
                )?;
                self.gemm(
                    "gemm down",
                    act(a.tmp),
                    act(a.act),
                    lw.down,
                    t,
                    h,
                    im,
                    false,
                )?;
                lora_update(li, LoraLinear::Down, a.act, im, a.tmp, h)?;
                out_norm(lw.mlp_out_norm)?;
            }
            add_rmsnorm(self.final_norm)?;
            if let Some(d) = dumps.as_deref_mut() {
                self.dump_resid(d, t)?;
            }
            // gather_rows(out, in, index, num_rows, width)
            self.launch(
                "baton_gather_rows",
                (r as u32, 1, 1),
                256,
                KArgs::new()
                    .p(act(a.last))
                    .p(act(a.xn))
                    .p(st(l.last_index))
                    .i(r)
                    .i(h),
            )?;
            self.gemm(
                "gemm lm_head",
                act(a.logits),
                act(a.last),
                self.lm_head,
                r,
                c.vocab_size,
                h,
                true,
            )?;
        }
        if let Some(d) = dumps {
            if d.logits {
                let mut host = vec![0u8; 4 * r * c.vocab_size];
                // SAFETY: the logits region holds r * vocab f32 (sized for max_rows).
                unsafe { self.dev.copy_dtoh(&mut host, act(a.logits)) }?;
                d.logits_out = from_device_bytes(&host, Dtype::F32)
                    .chunks_exact(c.vocab_size)
                    .map(<[f32]>::to_vec)
                    .collect();
            }
        }
        if token_masks {
            // apply_token_mask(logits, logits_stride, mask_rows, mask_table, vocab)
            self.launch(
                "baton_apply_token_mask",
                (
                    r as u32,
                    crate::plan::token_mask_splits(c.vocab_size) as u32,
                    1,
                ),
                crate::plan::TOKEN_MASK_BLOCK as u32,
                KArgs::new()
                    .p(act(a.logits))
                    .i(c.vocab_size)
                    .p(st(l.mask_rows))
                    .p(st(l.mask_table))
                    .i(c.vocab_size),
            )?;
        }
        let o = out_offsets(self.layout.max_rows);
        let od = |x: usize| self.out_dev.at(x);
        // sample_f32(tokens, logprob, top_ids, top_lp, logits, logits_stride, params,
        //            output_index, penalty_table, penalty_rows, input_ids, partials, counters,
        //            vocab)
        self.launch(
            "baton_sample_f32",
            (r as u32, crate::plan::sample_splits(c.vocab_size) as u32, 1),
            crate::plan::SAMPLE_BLOCK as u32,
            KArgs::new()
                .p(od(o.tokens))
                .p(od(o.logprob))
                .p(od(o.top_ids))
                .p(od(o.top_lp))
                .p(act(a.logits))
                .i(c.vocab_size)
                .p(st(l.params))
                .p(st(l.output_index))
                .p(st(l.penalty_table))
                .p(st(l.penalty_rows))
                .p(st(l.ids))
                .p(act(a.sample_partials))
                .p(act(a.sample_counters))
                .i(c.vocab_size),
        )
    }

    /// Adds the LoRA update of linear layer `kind` of layer `li` for the step's `t` tokens
    /// (`kernels/lora.cu`): `x` `[t, k]` is the layer's input and `y` `[t, n]` its fused
    /// output (the GEMM's, updated in place). Two launches, `baton_lora_shrink` then
    /// `baton_lora_expand`, reading the tokens' adapter ids uploaded for this launch; tokens
    /// of the base model (id 0) are left alone. Nothing when no adapter updates this layer
    /// and kind, or none is loaded.
    #[allow(clippy::too_many_arguments)]
    fn lora_update(
        &self,
        li: usize,
        kind: LoraLinear,
        t: usize,
        x: u64,
        k: usize,
        y: u64,
        n: usize,
    ) -> Result<(), CudaWorkerError> {
        let Some(l) = &self.lora else {
            return Ok(());
        };
        if !l.updates[li][kind as usize] {
            return Ok(());
        }
        // lora_shrink(v, x, tok_lora, parts, adapter_stride, num_adapters, num_tokens,
        //             x_stride, rank_stride)
        self.launch(
            "baton_lora_shrink",
            (
                t as u32,
                LORA_MAX_PARTS as u32,
                l.max_rank.div_ceil(LORA_SHRINK_WARPS) as u32,
            ),
            32 * LORA_SHRINK_WARPS as u32,
            KArgs::new()
                .p(l.v.ptr)
                .p(x)
                .p(l.tok.ptr)
                .p(l.slots(li, kind))
                .i(l.adapter_stride)
                .i(l.count)
                .i(t)
                .i(k)
                .i(l.max_rank),
        )?;
        // lora_expand(y, v, tok_lora, parts, adapter_stride, num_adapters, num_tokens,
        //             y_stride, rank_stride)
        self.launch(
            "baton_lora_expand",
            (t as u32, n.div_ceil(LORA_COLS) as u32, 1),
            LORA_EXPAND_BLOCK,
            KArgs::new()
                .p(y)
                .p(l.v.ptr)
                .p(l.tok.ptr)
                .p(l.slots(li, kind))
                .i(l.adapter_stride)
                .i(l.count)
                .i(t)
                .i(n)
                .i(l.max_rank),
        )
    }

    /// Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorms on the step's `t` QKV rows, in
    /// place, right after the QKV projection and before RoPE (`kernels/qkv_post.cu`). A model
    /// with neither (Llama, Mistral) launches nothing.
    /// The MLP activation-and-mul kernel: SiLU, or Gemma's GELU(tanh).
    fn mlp_act(&self) -> &'static str {
        match self.cfg.hidden_act {
            baton_model::Activation::Silu => "baton_silu_and_mul",
            baton_model::Activation::GeluTanh => "baton_gelu_tanh_and_mul",
        }
    }

    /// A mixture-of-experts MLP for the step's `t` tokens (kernels/moe.cu): `tmp` = the
    /// mixture of `xn`. The router's GEMM (f32 logits), the routing, the pairs grouped by
    /// expert, each pair's gate|up and down through its expert's weights, the weighted sum
    /// per token; Qwen2-MoE's shared expert through cuBLAS beside it. Every grid depends on
    /// `t` only, so graphs capture it.
    fn moe_mlp(&self, t: usize, lw: &LayerPtrs, m: &MoePtrs) -> Result<(), CudaWorkerError> {
        let c = &self.cfg;
        let Some(mc) = c.moe.as_ref() else {
            return Err(CudaWorkerError::Unsupported(
                "a mixture-of-experts layer in a dense config".into(),
            ));
        };
        let (h, ne, k, e_im) = (
            c.hidden_size,
            mc.num_experts,
            mc.top_k,
            mc.intermediate_size,
        );
        let a = &self.act_off;
        let act = |o: usize| self.acts.at(o);
        let pairs = t * k;
        self.gemm(
            "gemm router",
            act(a.moe_logits),
            act(a.xn),
            m.router,
            t,
            ne,
            h,
            true,
        )?;
        // moe_route(topk_ids, topk_w, logits, num_tokens, num_experts, top_k, renorm)
        self.launch(
            "baton_moe_route",
            (t as u32, 1, 1),
            32,
            KArgs::new()
                .p(act(a.moe_ids))
                .p(act(a.moe_w))
                .p(act(a.moe_logits))
                .i(t)
                .i(ne)
                .i(k)
                .i(usize::from(mc.norm_topk_prob)),
        )?;
        // moe_align(sorted_pairs, tiles, topk_ids, num_pairs, num_experts)
        self.launch(
            "baton_moe_align",
            (1, 1, 1),
            1024,
            KArgs::new()
                .p(act(a.moe_sorted))
                .p(act(a.moe_tiles))
                .p(act(a.moe_ids))
                .i(pairs)
                .i(ne),
        )?;
        let tiles = moe_max_tiles(pairs, ne) as u32;
        // moe_gemm(out, in, w, sorted_pairs, tiles, n_out, k_in, top_k, gather_tokens)
        let experts_gemm = |out: u64, input: u64, w: u64, n: usize, k_in: usize, gather: bool| {
            self.launch(
                "baton_moe_gemm",
                (tiles, n.div_ceil(MOE_TILE_COLS) as u32, 1),
                256,
                KArgs::new()
                    .p(out)
                    .p(input)
                    .p(w)
                    .p(act(a.moe_sorted))
                    .p(act(a.moe_tiles))
                    .i(n)
                    .i(k_in)
                    .i(k)
                    .i(usize::from(gather)),
            )
        };
        experts_gemm(act(a.moe_gate_up), act(a.xn), lw.gate_up, 2 * e_im, h, true)?;
        self.launch(
            self.mlp_act(),
            (pairs as u32, 1, 1),
            256,
            KArgs::new()
                .p(act(a.moe_act))
                .p(act(a.moe_gate_up))
                .i(pairs)
                .i(e_im),
        )?;
        experts_gemm(act(a.moe_out), act(a.moe_act), lw.down, h, e_im, false)?;
        let (shared, shared_gate) = if m.shared_gate_up != 0 {
            let s_im = mc.shared_expert_intermediate_size;
            self.gemm(
                "gemm shared gate_up",
                act(a.gate_up),
                act(a.xn),
                m.shared_gate_up,
                t,
                2 * s_im,
                h,
                false,
            )?;
            self.launch(
                self.mlp_act(),
                (t as u32, 1, 1),
                256,
                KArgs::new().p(act(a.act)).p(act(a.gate_up)).i(t).i(s_im),
            )?;
            self.gemm(
                "gemm shared down",
                act(a.moe_shared),
                act(a.act),
                m.shared_down,
                t,
                h,
                s_im,
                false,
            )?;
            self.gemm(
                "gemm shared gate",
                act(a.moe_shared_gate),
                act(a.xn),
                m.shared_gate,
                t,
                1,
                h,
                true,
            )?;
            (act(a.moe_shared), act(a.moe_shared_gate))
        } else {
            (0, 0)
        };
        // moe_combine(out, y, topk_w, shared, shared_gate, num_tokens, top_k, hidden)
        self.launch(
            "baton_moe_combine",
            (t as u32, 1, 1),
            256,
            KArgs::new()
                .p(act(a.tmp))
                .p(act(a.moe_out))
                .p(act(a.moe_w))
                .p(shared)
                .p(shared_gate)
                .i(t)
                .i(k)
                .i(h),
        )
    }

    fn qkv_post(&self, t: usize, lw: &LayerPtrs) -> Result<(), CudaWorkerError> {
        if lw.qkv_bias == 0 && lw.qk_norm == 0 {
            return Ok(());
        }
        let c = &self.cfg;
        let (hd, nh, kvh) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        // A warp per (token, head): q and k heads, and the v heads when there is a bias.
        const WARPS: usize = 4;
        let heads = nh + kvh + if lw.qkv_bias != 0 { kvh } else { 0 };
        // qkv_post(qkv, bias, norm, num_tokens, nq, nkv, head_dim, stride, eps); a 0 pointer
        // is the kernel's null (no bias / no norm).
        self.launch(
            "baton_qkv_post",
            (t as u32, heads.div_ceil(WARPS) as u32, 1),
            (32 * WARPS) as u32,
            KArgs::new()
                .p(self.acts.at(self.act_off.qkv))
                .p(lw.qkv_bias)
                .p(lw.qk_norm)
                .i(t)
                .i(nh)
                .i(kvh)
                .i(hd)
                .i((nh + 2 * kvh) * hd)
                .f(c.rms_norm_eps),
        )
    }

    /// RoPE on the step's q and k (in place, strided rows of `qkv_w`) and the k and v rows
    /// written to their KV slots.
    #[allow(clippy::too_many_arguments)]
    fn rope_and_cache(
        &self,
        t: usize,
        q: u64,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        qkv_w: usize,
        inv_freq: u64,
    ) -> Result<(), CudaWorkerError> {
        let c = &self.cfg;
        let st = |o: usize| self.staging_dev.at(o);
        let l = &self.layout;
        // rope_and_cache(q, k, v, k_cache, v_cache, positions, slots, inv_freq,
        //                num_tokens, nq, nkv, head_dim, q_stride, kv_stride)
        // One thread per (head, i) pair: `y` blocks of 256 per token (rope.cu).
        let pairs = (c.num_attention_heads + c.num_key_value_heads) * (c.head_dim / 2);
        let y = pairs.div_ceil(256).max(1) as u32;
        self.launch(
            "baton_rope_and_cache",
            (t as u32, y, 1),
            256,
            KArgs::new()
                .p(q)
                .p(k)
                .p(v)
                .p(kc)
                .p(vc)
                .p(st(l.positions))
                .p(st(l.slots))
                .p(inv_freq)
                .i(t)
                .i(c.num_attention_heads)
                .i(c.num_key_value_heads)
                .i(c.head_dim)
                .i(qkv_w)
                .i(qkv_w),
        )
    }

    /// Layer `li`'s RoPE table on the device: Gemma 3's local one on its sliding layers
    /// ([`ModelConfig::layer_rope_is_local`]), else the global one.
    fn layer_inv_freq(&self, li: usize) -> u64 {
        match &self.inv_freq_local {
            Some(local) if self.cfg.layer_rope_is_local(li) => local.ptr,
            _ => self.inv_freq.ptr,
        }
    }

    /// Whether a `mode` launch's attention kernel applies RoPE and writes the step's K and V
    /// to the cache itself (the decode kernels of the fast head dims), so that no
    /// `baton_rope_and_cache` launch precedes it.
    fn decode_fuses_rope(&self, mode: AttnMode) -> bool {
        mode == AttnMode::Decode && fast_head_dim(self.cfg.head_dim)
    }

    /// Decode attention's grid for `r` rows: (grid.y = kv heads x head chunks, partitions per
    /// sequence = grid.z, fill). The partials hold `part_rows * max_partitions` per head,
    /// shared out among the launch's rows.
    fn decode_split(&self, r: usize) -> (u32, usize, usize) {
        let c = &self.cfg;
        let (nh, kvh) = (c.num_attention_heads, c.num_key_value_heads);
        let gy = kvh * (nh / kvh).div_ceil(8);
        let z = crate::plan::decode_partitions(
            r,
            gy,
            self.opts.max_model_len,
            self.part_rows * self.max_partitions / r.max(1),
            self.opts.tuning.attn_target_blocks,
            self.opts.tuning.attn_min_partition,
        );
        let fill = crate::plan::decode_fill(r, gy, self.opts.tuning.attn_target_blocks).min(z);
        (gy as u32, z, fill)
    }

    /// Layer `li`'s attention of the step over the KV cache, into the `attn` activations. `q`
    /// is the QKV projection's output (row stride `q_stride` elements): rotated and already in
    /// the cache unless [`Self::decode_fuses_rope`], in which case the decode kernel does both.
    /// Each kernel takes the layer's sliding window (`ModelConfig::sliding_window`, 0 for
    /// none) as its last argument.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        li: usize,
        t: usize,
        r: usize,
        mode: AttnMode,
        q: u64,
        q_stride: usize,
        kc: u64,
        vc: u64,
        scale: f32,
    ) -> Result<(), CudaWorkerError> {
        let c = &self.cfg;
        let (hd, nh, kvh) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let a = &self.act_off;
        let out = self.acts.at(a.attn);
        let l = &self.layout;
        let st = |o: usize| self.staging_dev.at(o);
        let bs = self.opts.block_size;
        let window = c.sliding_window[li].map_or(0, |w| w.min(i32::MAX as usize));
        if !fast_head_dim(hd) {
            // generic(out, q, q_stride, k_cache, v_cache, cu_seqlens, start_pos, num_rows,
            //         block_tables, max_blocks_per_row, nh, nkv, head_dim, block_size, scale,
            //         window)
            return self.launch(
                "baton_paged_attention_generic",
                (t as u32, nh as u32, 1),
                128,
                KArgs::new()
                    .p(out)
                    .p(q)
                    .i(q_stride)
                    .p(kc)
                    .p(vc)
                    .p(st(l.cu_seqlens))
                    .p(st(l.start_pos))
                    .i(r)
                    .p(st(l.block_tables))
                    .i(l.max_blocks)
                    .i(nh)
                    .i(kvh)
                    .i(hd)
                    .i(bs)
                    .f(scale)
                    .i(window),
            );
        }
        let (gy, z, fill) = self.decode_split(r);
        match mode {
            AttnMode::Decode => {
                // decode_hdD(out, part_acc, part_m, part_l, counters, qkv, qkv_stride,
                //            k_cache, v_cache, block_tables, max_blocks_per_row, seq_lens,
                //            slot_mapping, inv_freq, nh, nkv, block_size, scale,
                //            max_partitions, fill, min_part, long_part, window)
                // RoPE and the cache write of the step's token are fused in; the last block of
                // a split sequence combines its partitions (no reduce launch).
                self.launch(
                    &format!("baton_paged_attention_decode_hd{hd}"),
                    (r as u32, gy, z as u32),
                    128,
                    KArgs::new()
                        .p(out)
                        .p(self.acts.at(a.part_acc))
                        .p(self.acts.at(a.part_m))
                        .p(self.acts.at(a.part_l))
                        .p(self.acts.at(a.attn_counters))
                        .p(q)
                        .i(q_stride)
                        .p(kc)
                        .p(vc)
                        .p(st(l.block_tables))
                        .i(l.max_blocks)
                        .p(st(l.seq_lens))
                        .p(st(l.slots))
                        .p(self.layer_inv_freq(li))
                        .i(nh)
                        .i(kvh)
                        .i(bs)
                        .f(scale)
                        .i(z)
                        .i(fill)
                        .i(self.opts.tuning.attn_min_partition)
                        .i(crate::plan::ATTN_LONG_PARTITION)
                        .i(window),
                )
            }
            AttnMode::Prefill => {
                // prefill_hdD(out, q, q_stride, k_cache, v_cache, cu_seqlens, start_pos,
                //             num_rows, block_tables, max_blocks_per_row, nh, nkv, block_size,
                //             scale, window)
                self.launch(
                    &format!("baton_paged_attention_prefill_hd{hd}"),
                    (t as u32, gy, 1),
                    128,
                    KArgs::new()
                        .p(out)
                        .p(q)
                        .i(q_stride)
                        .p(kc)
                        .p(vc)
                        .p(st(l.cu_seqlens))
                        .p(st(l.start_pos))
                        .i(r)
                        .p(st(l.block_tables))
                        .i(l.max_blocks)
                        .i(nh)
                        .i(kvh)
                        .i(bs)
                        .f(scale)
                        .i(window),
                )
            }
        }
    }

    /// Every decoder layer of a batch-of-one decode step in one cooperative launch of the
    /// persistent decode kernel: what the fused path's per-layer GEMVs and decode attention
    /// compute, bit for bit (kernels/attention.cu, "Persistent decode").
    fn decode_layers(&self, p: &Persistent, scale: f32) -> Result<(), CudaWorkerError> {
        let c = &self.cfg;
        let a = &self.act_off;
        let act = |o: usize| self.acts.at(o);
        let st = |o: usize| self.staging_dev.at(o);
        let l = &self.layout;
        let (_, z, fill) = self.decode_split(1);
        // decode_layers_hdD(layers, num_layers, resid, qkv, attn, act, part_acc, part_m,
        //     part_l, counters, block_tables, max_blocks_per_row, seq_lens, slot_mapping,
        //     inv_freq, hidden, nh, nkv, inter, block_size, scale, eps, max_partitions, fill,
        //     min_part, long_part, bar)
        self.launch_as(
            &format!("baton_decode_layers_hd{}", c.head_dim),
            (p.grid, 1, 1),
            crate::plan::DECODE_LAYERS_BLOCK,
            KArgs::new()
                .p(p.table.ptr)
                .i(c.num_hidden_layers)
                .p(act(a.resid))
                .p(act(a.qkv))
                .p(act(a.attn))
                .p(act(a.act))
                .p(act(a.part_acc))
                .p(act(a.part_m))
                .p(act(a.part_l))
                .p(act(a.attn_counters))
                .p(st(l.block_tables))
                .i(l.max_blocks)
                .p(st(l.seq_lens))
                .p(st(l.slots))
                .p(self.inv_freq.ptr)
                .i(c.hidden_size)
                .i(c.num_attention_heads)
                .i(c.num_key_value_heads)
                .i(c.intermediate_size)
                .i(self.opts.block_size)
                .f(scale)
                .f(c.rms_norm_eps)
                .i(z)
                .i(fill)
                .i(self.opts.tuning.attn_min_partition)
                .i(crate::plan::ATTN_LONG_PARTITION)
                .p(act(a.grid_bar)),
            true,
        )
    }

    fn dump_resid(&self, d: &mut Dumps, t: usize) -> Result<(), CudaWorkerError> {
        if !d.layers {
            return Ok(());
        }
        let n = t * self.cfg.hidden_size * self.dtype.size();
        let mut host = vec![0u8; n];
        // SAFETY: the residual region holds max_tokens * hidden elements >= t * hidden.
        unsafe {
            self.dev
                .copy_dtoh(&mut host, self.acts.at(self.act_off.resid))
        }?;
        d.layers_out.push(from_device_bytes(&host, self.dtype));
        Ok(())
    }

    /// With `d.layers`, after a mixture-of-experts MLP: appends its input (the residual
    /// stream, which the MLP does not touch: its output is in `tmp` until the next layer's
    /// add) and its expert ids (`moe_ids`: `[t * top_k]`, each token's ascending) to
    /// `d.moe_out`.
    fn dump_moe(&self, d: &mut Dumps, t: usize) -> Result<(), CudaWorkerError> {
        let Some(mc) = self.cfg.moe.as_ref().filter(|_| d.layers) else {
            return Ok(());
        };
        let mut ids = vec![0u8; t * mc.top_k * 4];
        let mut input = vec![0u8; t * self.cfg.hidden_size * self.dtype.size()];
        // SAFETY: the moe_ids region holds max_tokens * top_k i32 >= t * top_k, the residual
        // region max_tokens * hidden elements >= t * hidden.
        unsafe {
            self.dev
                .copy_dtoh(&mut ids, self.acts.at(self.act_off.moe_ids))?;
            self.dev
                .copy_dtoh(&mut input, self.acts.at(self.act_off.resid))
        }?;
        d.moe_out.push(MoeTrace {
            input: from_device_bytes(&input, self.dtype),
            routes: ids
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        });
        Ok(())
    }

    /// Waits for the fence of every launch in flight (their completions stay to be taken:
    /// the wait only makes their buffers free to replace).
    fn wait_in_flight(&self) -> Result<(), CudaWorkerError> {
        for f in &self.inflight {
            self.dev.wait_fence(f.frame)?;
        }
        Ok(())
    }

    /// Makes room for `n` penalty entries: when the buffers hold fewer, replaces them (the
    /// device buffer and every frame's host buffer) with buffers of `max(n, 2 * capacity)`
    /// entries. Called before the launch is staged, after waiting for the launches in flight,
    /// so no copy or kernel still uses the old buffers; captured graphs read the new address
    /// from the staging buffer.
    ///
    /// # Errors
    /// Allocation failures (out of device or pinned memory); a failed fence wait.
    fn reserve_penalties(&mut self, n: usize) -> Result<(), CudaWorkerError> {
        if n <= self.pen_cap {
            return Ok(());
        }
        self.wait_in_flight()?;
        let cap = n.max(2 * self.pen_cap);
        let dev = Buf::new(&self.dev, PENALTY_ENTRY_BYTES * cap)?;
        for f in &mut self.frames {
            f.pen = Pinned::new(&self.dev, PENALTY_ENTRY_BYTES * cap)?;
        }
        self.pen_dev = dev;
        self.pen_cap = cap;
        Ok(())
    }

    /// Makes room for `n` token-mask words, as [`CudaWorker::reserve_penalties`] does for
    /// penalty entries (captured graphs read the new address from the staging buffer).
    ///
    /// # Errors
    /// Allocation failures (out of device or pinned memory).
    fn reserve_masks(&mut self, n: usize) -> Result<(), CudaWorkerError> {
        if n <= self.mask_cap {
            return Ok(());
        }
        self.wait_in_flight()?;
        let cap = n.max(2 * self.mask_cap);
        let dev = Buf::new(&self.dev, 4 * cap)?;
        for f in &mut self.frames {
            f.mask = Pinned::new(&self.dev, 4 * cap)?;
        }
        self.mask_dev = dev;
        self.mask_cap = cap;
        Ok(())
    }

    /// Uploads the staged inputs of a launch of `num_rows` rows (after padding) from frame
    /// `frame`: the prefix of the staging buffer those rows use (async, on the stream).
    fn upload_staging(&self, frame: usize, num_rows: usize) -> Result<(), CudaWorkerError> {
        // SAFETY: both buffers are `layout.total` >= `used_bytes` bytes; the host side is
        // pinned and belongs to this launch until its fence has passed (HostFrame). The
        // device side is read only by work enqueued after this copy, and the next launch's
        // upload is ordered after it on the stream.
        unsafe {
            self.dev.copy_htod_async(
                self.staging_dev.ptr,
                self.frames[frame].staging.ptr,
                self.layout.used_bytes(num_rows),
            )
        }
    }

    /// The frame the next enqueued launch uses, or an error when its previous launch is
    /// still in flight (more than `FENCE_FRAMES - 1` launches unfinished).
    fn next_frame(&self) -> Result<usize, CudaWorkerError> {
        let frame = self.enqueued % FENCE_FRAMES;
        if self.inflight.iter().any(|f| f.frame == frame) {
            return Err(CudaWorkerError::Device {
                what: "launch",
                msg: format!(
                    "{} launches in flight; finish one before enqueuing another",
                    self.inflight.len()
                ),
            });
        }
        Ok(frame)
    }

    /// Captures one decode graph per bucket, largest first, after an eager warm-up.
    fn capture_graphs(&mut self) -> Result<(), CudaWorkerError> {
        self.bind()?;
        let buckets: Vec<usize> = default_graph_buckets(self.layout.max_rows)
            .into_iter()
            .filter(|&b| b <= self.layout.max_rows && b <= self.layout.max_tokens)
            .collect();
        self.graphs = self.capture_buckets(&buckets, false)?;
        self.buckets = buckets;
        Ok(())
    }

    /// One decode graph per bucket of `buckets` (largest first, each after an eager
    /// warm-up) over inert inputs; `lora`: the per-kernel path with the LoRA updates of
    /// `self.lora` (every token's adapter id 0 while capturing: the kernels read the ids
    /// from `LoraDevice::tok` at replay).
    fn capture_buckets(
        &mut self,
        buckets: &[usize],
        lora: bool,
    ) -> Result<HashMap<usize, GraphId>, CudaWorkerError> {
        let mut graphs = HashMap::new();
        for &b in buckets.iter().rev() {
            // Inert inputs: b padding rows (slot -1, seq_len 0, page 0).
            let pages = [0u32];
            let rows: Vec<(u32, u32, &[u32])> = (0..b).map(|_| (0, 1, &pages[..])).collect();
            let mut plan = plan_launch(&rows, self.opts.block_size.max(1))
                .map_err(|e| CudaWorkerError::Unsupported(e.to_string()))?;
            plan.slot_mapping.iter_mut().for_each(|s| *s = -1);
            plan.seq_lens.iter_mut().for_each(|s| *s = 0);
            let inputs = StepInputs {
                ids: vec![0; b],
                pending: vec![],
                output_index: vec![0; b],
                params: vec![SamplingParams::greedy(); b],
                plan,
                penalty_rows: Vec::new(),
                penalty_table: self.pen_dev.ptr,
                mask_rows: Vec::new(),
                mask_table: self.mask_dev.ptr,
            };
            let layout = self.layout;
            let frame = self.next_frame()?;
            layout
                .fill(self.frames[frame].staging.bytes_mut(), &inputs)
                .map_err(|e| CudaWorkerError::Unsupported(e.to_string()))?;
            self.upload_staging(frame, b)?;
            if let Some(l) = self.lora.as_mut().filter(|_| lora) {
                l.host[frame].bytes_mut()[..4 * b].fill(0);
                // SAFETY: both buffers hold max_tokens >= b u32; synchronized below before
                // the pinned side is reused.
                unsafe {
                    self.dev
                        .copy_htod_async(l.tok.ptr, l.host[frame].ptr, 4 * b)
                }?;
            }
            // Warm-up (cuBLAS picks and loads its kernels outside the capture).
            self.enqueue_forward(b, b, AttnMode::Decode, None, true, lora)?;
            self.dev.synchronize()?;
            self.dev.begin_capture()?;
            let enq = self.enqueue_forward(b, b, AttnMode::Decode, None, true, lora);
            // Always end the capture (even after an enqueue error) so the stream leaves
            // capture mode.
            let graph = self.dev.end_capture();
            enq?;
            graphs.insert(b, graph?);
        }
        Ok(graphs)
    }

    /// Runs `rows` as launch `seq` through its fence ([`CudaWorker::enqueue_rows`], then the
    /// wait, then the prompt scores of rows that ask for them). Returns the sampled id per
    /// row (`u32::MAX` for rows that do not sample) and each row's log-probability and top
    /// entries. `masks` holds the token masks of the guided rows (empty: none), `lora` the
    /// adapter id of each row (empty: every row runs the base model).
    fn run_rows(
        &mut self,
        seq: LaunchSeq,
        rows: &[RowInput],
        masks: &TokenMasks,
        lora: &[u32],
        dumps: Option<&mut Dumps>,
    ) -> Result<Vec<RowOutput>, WorkerError> {
        let e = self.enqueue_rows(seq, rows, masks, lora, dumps)?;
        if let Err(err) = self.dev.wait_fence(e.frame) {
            self.ring_host.forget(seq);
            return Err(dev_err(err));
        }
        self.prompt_scores.clear();
        if rows.iter().any(|r| !r.scored.is_empty()) {
            self.score_prompts(rows, &e.cu_seqlens).map_err(dev_err)?;
        }
        Ok(self.read_outputs(
            e.frame,
            rows.iter().map(|r| (r.sample, r.params.top_logprobs)),
        ))
    }

    /// Enqueues `rows` as launch `seq` without waiting: stages the inputs in the next host
    /// frame, resolves pending ids on the device, runs the forward pass (a graph replay for
    /// decode batches with a bucket), samples, copies the ids back and records the frame's
    /// fence. The launch's ids are in the device ring from here on (later launches' pending
    /// rows may name it: they read it in stream order); until its fence has passed, its
    /// frame is not touched. `lora` holds each row's adapter id (empty: none); a decode launch
    /// with an adapter row replays a LoRA graph (`lora_graphs`).
    fn enqueue_rows(
        &mut self,
        seq: LaunchSeq,
        rows: &[RowInput],
        masks: &TokenMasks,
        lora: &[u32],
        dumps: Option<&mut Dumps>,
    ) -> Result<Enqueued, WorkerError> {
        self.bind().map_err(dev_err)?;
        let frame = self.next_frame().map_err(dev_err)?;
        let n_rows = rows.len();
        assert!(
            lora.is_empty() || lora.len() == n_rows,
            "one adapter id per row"
        );
        let with_lora = lora.iter().any(|&l| l != 0);
        let loaded = self.lora.as_ref().map_or(0, |l| l.count);
        if let Some((i, &l)) = lora.iter().enumerate().find(|(_, &l)| l as usize > loaded) {
            return Err(WorkerError::Forward(format!(
                "row {i} asks for LoRA adapter {l}, but {loaded} are loaded"
            )));
        }
        let vocab = self.cfg.vocab_size;
        for (i, r) in rows.iter().enumerate() {
            if let Some(&bad) = r.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(WorkerError::Forward(format!(
                    "row {i}: token {bad} >= vocab size {vocab}"
                )));
            }
            if let Some(&p) = r
                .block_table
                .iter()
                .find(|&&p| p as usize >= self.num_blocks)
            {
                return Err(WorkerError::Forward(format!(
                    "row {i}: page {p} >= num_blocks {}",
                    self.num_blocks
                )));
            }
        }
        let spans: Vec<(u32, u32, &[u32])> = rows
            .iter()
            .map(|r| {
                (
                    r.start_pos as u32,
                    r.tokens.len() as u32,
                    &r.block_table[..],
                )
            })
            .collect();
        let mut plan = plan_launch(&spans, self.opts.block_size)
            .map_err(|e: PlanError| WorkerError::Forward(e.to_string()))?;
        // Prompt scoring reads every position's final hidden state, which only the eager
        // prefill path leaves in `xn`.
        let decode = rows
            .iter()
            .all(|r| r.tokens.len() == 1 && r.scored.is_empty());
        let graphs = if with_lora {
            &self.lora_graphs
        } else {
            &self.graphs
        };
        let bucket = if decode && dumps.is_none() && !self.profiling {
            graph_bucket(n_rows, &self.buckets).filter(|b| graphs.contains_key(b))
        } else {
            None
        };
        let mut ids: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let mut pending = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if let Some(src) = r.pending {
                let at = plan.cu_seqlens[i] as u32;
                ids[at as usize] = 0;
                pending.push((at, src));
            }
        }
        self.pending_inputs += pending.len() as u64;
        let mut output_index: Vec<u32> = rows.iter().map(|r| r.output_index).collect();
        let mut params: Vec<SamplingParams> = rows.iter().map(|r| r.params).collect();
        let mut penalty_rows = Vec::new();
        let mut entries = Vec::new();
        let penalized = |r: &RowInput| r.sample && r.params.adjusts_logits();
        if rows.iter().any(penalized) {
            pack_penalties(
                rows.iter().enumerate().map(|(i, r)| {
                    if penalized(r) {
                        // A pending input is an output occurrence only for the penalties; a
                        // row with just a logit bias needs no history.
                        let pending_at = r
                            .pending
                            .filter(|_| r.params.has_penalties())
                            .map(|_| plan.cu_seqlens[i] as u32);
                        (&r.penalties[..], pending_at)
                    } else {
                        (&[][..], None)
                    }
                }),
                &mut penalty_rows,
                &mut entries,
            )
            .map_err(|e| WorkerError::Forward(e.to_string()))?;
        }
        self.reserve_penalties(entries.len()).map_err(dev_err)?;
        put_entries(self.frames[frame].pen.bytes_mut(), &entries);
        self.pen_used = entries.len();
        // Structured outputs: upload only the guided rows' masks, and none when no row has one.
        let mut mask_rows = Vec::new();
        self.mask_used = 0;
        if masks.any() {
            assert_eq!(masks.rows.len(), n_rows, "one mask index per row");
            self.reserve_masks(masks.words.len()).map_err(dev_err)?;
            let b: &[u8] = bytemuck::cast_slice(&masks.words);
            self.frames[frame].mask.bytes_mut()[..b.len()].copy_from_slice(b);
            self.mask_used = masks.words.len();
            mask_rows.clone_from(&masks.rows);
        }
        let run_rows = match bucket {
            Some(b) => {
                plan.pad_decode_rows(b);
                ids.resize(b, 0);
                output_index.resize(b, 0);
                params.resize(b, SamplingParams::greedy());
                if !penalty_rows.is_empty() {
                    penalty_rows.resize(b, PenaltyRow::NONE);
                }
                if !mask_rows.is_empty() {
                    mask_rows.resize(b, -1);
                }
                b
            }
            None => n_rows,
        };
        let inputs = StepInputs {
            plan,
            ids,
            pending,
            output_index,
            params,
            penalty_rows,
            penalty_table: self.pen_dev.ptr,
            mask_rows,
            mask_table: self.mask_dev.ptr,
        };
        let layout = self.layout;
        layout
            .fill(self.frames[frame].staging.bytes_mut(), &inputs)
            .map_err(|e: CapacityError| WorkerError::Forward(e.to_string()))?;
        // The tokens' adapter ids (the fill above checked the token count against
        // `max_tokens`, the size of each frame's id buffer).
        self.lora_tokens = 0;
        if let Some(l) = self.lora.as_mut().filter(|_| with_lora) {
            let ids = rows
                .iter()
                .zip(lora)
                .flat_map(|(r, &id)| std::iter::repeat_n(id, r.tokens.len()));
            let host = l.host[frame].bytes_mut();
            // A graph's padding rows (past the rows' tokens) take no adapter.
            let n = inputs.plan.num_tokens();
            for (dst, id) in host[..4 * n]
                .chunks_exact_mut(4)
                .zip(ids.chain(std::iter::repeat(0)))
            {
                dst.copy_from_slice(&id.to_le_bytes());
            }
            self.lora_tokens = n;
        }
        let slot = self.ring_host.reserve();
        self.enqueued += 1;
        let done = self.run_staged(&inputs, rows, bucket, run_rows, decode, frame, slot, dumps);
        if done.is_err() {
            // Drain what was queued before the failure, so no later launch refills a pinned
            // buffer under a copy still in flight.
            let _ = self.dev.synchronize();
        }
        done.map_err(dev_err)?;
        self.ring_host
            .commit(seq, slot, rows.iter().map(|r| r.sample).collect());
        let mut cu_seqlens = inputs.plan.cu_seqlens;
        cu_seqlens.truncate(n_rows + 1);
        Ok(Enqueued { frame, cu_seqlens })
    }

    /// The sampler outputs of a launch whose fence (frame `frame`) has passed: per row,
    /// given `(samples, top_logprobs)`, the sampled id (`u32::MAX` for a row that does not
    /// sample), its log-probability and its top entries.
    fn read_outputs(
        &self,
        frame: usize,
        rows: impl Iterator<Item = (bool, u32)>,
    ) -> Vec<RowOutput> {
        let o = out_offsets(self.layout.max_rows);
        let host = self.frames[frame].out.bytes();
        let rd_u32 =
            |at: usize| u32::from_le_bytes([host[at], host[at + 1], host[at + 2], host[at + 3]]);
        let rd_f32 = |at: usize| f32::from_bits(rd_u32(at));
        rows.enumerate()
            .map(|(i, (sample, top_logprobs))| {
                if !sample {
                    return (u32::MAX, 0.0, Vec::new());
                }
                let n_top = (top_logprobs as usize).min(SAMPLER_TOP_SLOTS);
                let top = (0..n_top)
                    .map(|j| {
                        let k = i * SAMPLER_TOP_SLOTS + j;
                        (rd_u32(o.top_ids + 4 * k), rd_f32(o.top_lp + 4 * k))
                    })
                    .filter(|&(id, _)| id != u32::MAX)
                    .collect();
                (rd_u32(o.tokens + 4 * i), rd_f32(o.logprob + 4 * i), top)
            })
            .collect()
    }

    /// Prompt log-probabilities of the rows that score prompt tokens (`RowInput::scored`),
    /// after the launch's fence: the LM head over those positions' final hidden states (the
    /// eager prefill path leaves every position's in `xn`, `[tokens, hidden]`, rows at
    /// `cu_seqlens`), at most `max_rows` positions per GEMM into the logits buffer (free once
    /// the sampler ran), then `baton_score_rows` (kernels/sampling.cu) per chunk: each
    /// position's log-probability of the prompt token that follows it, its rank and the top
    /// entries, as the CPU worker's `Sampler::score` and `sampling::rank_of` give them. Only
    /// those (168 bytes a position) come back to the host. Fills `self.prompt_scores`.
    ///
    /// Cost: one GEMM and one scoring launch per `max_rows` positions; the scheduler caps a
    /// launch at `baton_proto::MAX_PROMPT_LOGPROB_POSITIONS` such positions. Only requests
    /// that ask for prompt log-probabilities pay it.
    fn score_prompts(
        &mut self,
        rows: &[RowInput],
        cu_seqlens: &[i32],
    ) -> Result<(), CudaWorkerError> {
        let v = self.cfg.vocab_size;
        let h = self.cfg.hidden_size;
        let es = self.dtype.size();
        let max_rows = self.layout.max_rows;
        let logits = self.acts.at(self.act_off.logits);
        let xn = self.acts.at(self.act_off.xn);
        let tokens_dev = self.acts.at(self.act_off.score_tokens);
        let out_dev = self.acts.at(self.act_off.score_out);
        let top = SAMPLER_TOP_SLOTS;
        let mut host = std::mem::take(&mut self.prompt_out);
        host.resize(max_rows * SCORE_OUT_BYTES_PER_ROW, 0);
        for (i, r) in rows.iter().enumerate() {
            let n_top = r.params.prompt_top().unwrap_or(0);
            let base = cu_seqlens[i] as usize;
            for c0 in (0..r.scored.len()).step_by(max_rows) {
                let m = (r.scored.len() - c0).min(max_rows);
                let x = xn + ((base + c0) * h * es) as u64;
                self.gemm(
                    "gemm prompt lm_head",
                    logits,
                    x,
                    self.lm_head,
                    m,
                    v,
                    h,
                    true,
                )?;
                let toks: &[u8] = bytemuck::cast_slice(&r.scored[c0..c0 + m]);
                // SAFETY: score_tokens holds max_rows >= m u32; the copy is stream-ordered
                // and synchronous, and the previous chunk's scoring launch finished with its
                // read-back below.
                unsafe { self.dev.copy_htod(tokens_dev, toks) }?;
                // Outputs at out_dev: logprob [m], rank [m], top ids [m, 20], top lps [m, 20].
                let (lp_at, rank_at) = (0usize, 4 * m);
                let (ids_at, tlp_at) = (8 * m, 8 * m + 4 * m * top);
                // score_rows(out_logprob, out_rank, out_top_ids, out_top_logprobs, logits,
                //            tokens, vocab, n_top)
                self.launch(
                    "baton_score_rows",
                    (m as u32, 1, 1),
                    crate::plan::SAMPLE_BLOCK as u32,
                    KArgs::new()
                        .p(out_dev + lp_at as u64)
                        .p(out_dev + rank_at as u64)
                        .p(out_dev + ids_at as u64)
                        .p(out_dev + tlp_at as u64)
                        .p(logits)
                        .p(tokens_dev)
                        .i(v)
                        .i(n_top),
                )?;
                let got = &mut host[..m * SCORE_OUT_BYTES_PER_ROW];
                // SAFETY: score_out holds max_rows * SCORE_OUT_BYTES_PER_ROW bytes; the copy
                // waits for the stream, so the launch above has finished.
                unsafe { self.dev.copy_dtoh(got, out_dev) }?;
                let rd = |at: usize| {
                    u32::from_le_bytes([got[at], got[at + 1], got[at + 2], got[at + 3]])
                };
                for j in 0..m {
                    let top = (0..n_top.min(top))
                        .map(|t| {
                            let k = j * top + t;
                            (rd(ids_at + 4 * k), f32::from_bits(rd(tlp_at + 4 * k)))
                        })
                        .filter(|&(id, _)| id != u32::MAX)
                        .collect();
                    self.prompt_scores.push(PromptScore {
                        row: i as u32,
                        k: (c0 + j) as u32,
                        logprob: f32::from_bits(rd(lp_at + 4 * j)),
                        rank: rd(rank_at + 4 * j),
                        top,
                    });
                }
            }
        }
        self.prompt_out = host;
        Ok(())
    }

    /// The device part of [`CudaWorker::enqueue_rows`] once the inputs are staged in host
    /// frame `frame`: upload, the forward pass (graph replay or eager; its embedding kernel
    /// resolves the pending ids), sampled ids into ring `slot` and to the frame's pinned
    /// output buffer, then the frame's fence (recorded, not waited on).
    #[allow(clippy::too_many_arguments)]
    fn run_staged(
        &mut self,
        inputs: &StepInputs,
        rows: &[RowInput],
        bucket: Option<usize>,
        run_rows: usize,
        decode: bool,
        frame: usize,
        slot: usize,
        dumps: Option<&mut Dumps>,
    ) -> Result<(), CudaWorkerError> {
        let t = inputs.plan.num_tokens();
        self.dev.mark_step_start()?;
        self.upload_staging(frame, inputs.plan.num_rows())?;
        let f = &self.frames[frame];
        if self.pen_used > 0 {
            // SAFETY: both buffers hold `pen_cap >= pen_used` entries; the pinned side
            // belongs to this launch until its fence (as the staging buffer); the device side
            // is rewritten only by a later launch's copy, ordered after this launch's sampler.
            unsafe {
                self.dev.copy_htod_async(
                    self.pen_dev.ptr,
                    f.pen.ptr,
                    PENALTY_ENTRY_BYTES * self.pen_used,
                )
            }?;
        }
        if self.mask_used > 0 {
            // SAFETY: both buffers hold `mask_cap >= mask_used` words; as for the penalties.
            unsafe {
                self.dev
                    .copy_htod_async(self.mask_dev.ptr, f.mask.ptr, 4 * self.mask_used)
            }?;
        }
        let lora = match &self.lora {
            Some(l) if self.lora_tokens > 0 => {
                // SAFETY: both buffers hold `max_tokens >= lora_tokens` u32; the pinned side
                // is this frame's and belongs to this launch until its fence (as the staging
                // buffer); the device side is rewritten only by a later launch's copy,
                // ordered after this launch's kernels on the stream.
                unsafe {
                    self.dev
                        .copy_htod_async(l.tok.ptr, l.host[frame].ptr, 4 * self.lora_tokens)
                }?;
                true
            }
            _ => false,
        };
        match bucket {
            Some(b) => {
                let exec = if lora {
                    self.lora_graphs[&b]
                } else {
                    self.graphs[&b]
                };
                // SAFETY: the graph was captured over buffers that live as long as `self` (a
                // LoRA graph's adapter buffers as long as `self.lora`, and `set_lora_adapters`
                // drops those graphs with them); its inputs were just staged at the captured
                // addresses.
                unsafe { self.dev.launch_graph(exec) }?;
            }
            None => {
                let mode = if decode {
                    AttnMode::Decode
                } else {
                    AttnMode::Prefill
                };
                let masked = !inputs.mask_rows.is_empty();
                self.enqueue_forward(t, run_rows, mode, dumps, masked, lora)?;
            }
        }
        // Keep the sampled ids on the device for later PendingFrom rows.
        let n_rows = rows.len();
        let max_rows = self.layout.max_rows;
        let o = out_offsets(max_rows);
        // SAFETY: the ring holds KEPT_LAUNCHES * max_rows u32 and slot < KEPT_LAUNCHES; the
        // source holds max_rows u32 >= n_rows. Stream-ordered after the sampler.
        unsafe {
            self.dev.copy_dtod_async(
                self.ring.at(4 * slot * max_rows),
                self.out_dev.at(o.tokens),
                4 * n_rows,
            )
        }?;
        // SAFETY: the frame's pinned output buffer has the same layout and size as out_dev;
        // it is not read before the fence below has passed, and no other launch in flight
        // uses this frame.
        unsafe {
            self.dev
                .copy_dtoh_async(self.frames[frame].out.ptr, self.out_dev.ptr, o.total)
        }?;
        // The fence: the launch is complete (KV written, ids in host memory) when it passes.
        self.dev.record_fence(frame)?;
        Ok(())
    }

    /// Debug hook: runs `rows` (fresh ids, no pending) once and returns the logits of every
    /// row (`[rows][vocab]` f32, the last token of each) and, with `layers`, the residual
    /// stream after every decoder layer (`[layers][tokens * hidden]`, as
    /// `CpuModel::forward_with_layer_outputs`). Eager; writes the KV of the rows' positions.
    ///
    /// # Errors
    /// As [`Backend::execute`].
    pub fn forward_debug(
        &mut self,
        rows: &[RowInput],
        layers: bool,
    ) -> Result<LogitsAndLayers, WorkerError> {
        let mut d = Dumps {
            logits: true,
            layers,
            ..Dumps::default()
        };
        self.run_rows(0, rows, &TokenMasks::default(), &[], Some(&mut d))?;
        self.debug_moe = d.moe_out;
        Ok((d.logits_out, d.layers_out))
    }

    /// Each mixture-of-experts layer's input (the residual stream after its attention half,
    /// `[T, hidden]` f32) and expert ids (`[T * top_k]`, each token's ascending:
    /// `baton_moe_route`) in the last [`CudaWorker::forward_debug`] with `layers`, in layer
    /// order, as `baton_model::CpuModel::last_moe_trace` gives them. Empty for a dense model.
    pub fn debug_moe_trace(&self) -> &[MoeTrace] {
        &self.debug_moe
    }

    /// Device-to-device copy bandwidth in bytes/s: copies of `bytes` timed with events, each
    /// counted as `2 * bytes` (read + write), the best of `iters`.
    ///
    /// # Errors
    /// Driver errors (including out of memory).
    pub fn measure_copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64, WorkerError> {
        self.bind().map_err(dev_err)?;
        self.dev.copy_bandwidth(bytes, iters).map_err(dev_err)
    }

    /// Resolves a launch record into [`RowInput`]s, reading tables and checking pending ids;
    /// also reads the guided rows' token masks into `self.masks` and each row's LoRA adapter
    /// id into `self.lora_rows` (checked against the adapters loaded when enqueued).
    fn resolve(
        &mut self,
        launch: &Launch,
        tables: &dyn TableReader,
    ) -> Result<Vec<RowInput>, WorkerError> {
        let mut histories = std::mem::take(&mut self.histories);
        let rows = self.resolve_with(&mut histories, launch, tables);
        self.histories = histories;
        let rows = rows?;
        self.resolve_masks(launch, tables)?;
        self.lora_rows.clear();
        self.lora_rows.extend(launch.rows.iter().map(|r| r.lora));
        Ok(rows)
    }

    /// Reads the token masks of the launch's guided sampling rows into `self.masks` (as the
    /// CPU worker: a row's mask must be `token_mask_words(vocab)` words).
    fn resolve_masks(
        &mut self,
        launch: &Launch,
        tables: &dyn TableReader,
    ) -> Result<(), WorkerError> {
        let words = baton_proto::token_mask_words(self.cfg.vocab_size);
        let m = &mut self.masks;
        m.rows.clear();
        m.words.clear();
        if !launch
            .rows
            .iter()
            .any(|r| r.sample == 1 && r.params.token_mask != 0)
        {
            return Ok(());
        }
        let mut n = 0i32;
        for (i, r) in launch.rows.iter().enumerate() {
            if r.sample != 1 || r.params.token_mask == 0 {
                m.rows.push(-1);
                continue;
            }
            tables.read_token_mask(r.req.slot, &mut self.mask_row);
            if self.mask_row.len() != words {
                return Err(WorkerError::Forward(format!(
                    "row {i} asks for a token mask of {words} words but the tables hold {}",
                    self.mask_row.len()
                )));
            }
            m.words.extend_from_slice(&self.mask_row);
            m.rows.push(n);
            n += 1;
        }
        Ok(())
    }

    /// [`CudaWorker::resolve`] with the per-slot penalty counts borrowed apart from `self`.
    fn resolve_with(
        &self,
        histories: &mut PenaltyHistories,
        launch: &Launch,
        tables: &dyn TableReader,
    ) -> Result<Vec<RowInput>, WorkerError> {
        let max_rows = self.layout.max_rows;
        let mut bias = Vec::new();
        launch
            .rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let first = r.first_pos as usize;
                let end = first + r.num_tokens as usize;
                let mut tokens = Vec::with_capacity(r.num_tokens as usize);
                let pending = if r.pending_launch != NOT_PENDING {
                    let slot = self
                        .ring_host
                        .slot_of(r.pending_launch, r.pending_row)
                        .ok_or(WorkerError::MissingPending {
                            launch: launch.seq,
                            from: r.pending_launch,
                            row: r.pending_row,
                        })?;
                    tokens.push(0);
                    tables.read_tokens(r.req.slot, first + 1..end, &mut tokens);
                    Some((slot * max_rows + r.pending_row as usize) as u32)
                } else {
                    tables.read_tokens(r.req.slot, first..end, &mut tokens);
                    None
                };
                let mut block_table = Vec::with_capacity(r.num_blocks as usize);
                tables.read_blocks(r.req.slot, r.num_blocks as usize, &mut block_table);
                let mut penalties = Vec::new();
                if r.sample == 1 && r.params.has_penalties() && pending.is_some() {
                    let prompt_len = end.saturating_sub(r.output_index as usize);
                    if first < prompt_len {
                        return Err(WorkerError::Forward(format!(
                            "row {i}: pending input at position {first} lies in the prompt \
                             ({prompt_len} tokens)"
                        )));
                    }
                }
                // As the CPU worker, except that a pending first id is left to the device,
                // which merges it into the list.
                let known = usize::from(pending.is_some());
                histories
                    .launch_row(
                        r,
                        &tokens[known.min(tokens.len())..],
                        first + known,
                        tables,
                        &mut bias,
                        &mut penalties,
                    )
                    .map_err(|e| WorkerError::Forward(format!("row {i}: {e}")))?;
                // The token after each scored position: in the row, then (for a row that
                // ends before the prompt does) the next one in the table.
                let n_scored = r.scores_prompt().len();
                let mut scored = Vec::with_capacity(n_scored);
                if n_scored > 0 {
                    scored.extend_from_slice(&tokens[1.min(tokens.len())..]);
                    if scored.len() < n_scored {
                        tables.read_tokens(r.req.slot, end..end + 1, &mut scored);
                    }
                    scored.truncate(n_scored);
                }
                Ok(RowInput {
                    tokens,
                    start_pos: first,
                    block_table,
                    pending,
                    sample: r.sample == 1,
                    params: r.params,
                    output_index: r.output_index,
                    penalties,
                    scored,
                })
            })
            .collect()
    }

    /// The flattened plan of `rows` (for tests of the host side).
    pub fn plan_rows(rows: &[RowInput], block_size: usize) -> Result<LaunchPlan, PlanError> {
        let spans: Vec<(u32, u32, &[u32])> = rows
            .iter()
            .map(|r| {
                (
                    r.start_pos as u32,
                    r.tokens.len() as u32,
                    &r.block_table[..],
                )
            })
            .collect();
        plan_launch(&spans, block_size)
    }

    /// Bytes of one KV page across all layers.
    pub fn kv_bytes_per_block(&self) -> usize {
        kv_bytes_per_block(
            self.cfg.num_hidden_layers,
            self.opts.block_size,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            self.dtype.size(),
        )
        .unwrap_or(0)
    }

    /// `PendingFrom` inputs staged so far: first ids the embedding kernel took from the ring
    /// of earlier launches' sampled ids.
    pub fn pending_inputs(&self) -> u64 {
        self.pending_inputs
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), WorkerError> {
        self.dev.mem_info().map_err(dev_err)
    }

    /// LoRA adapters loaded ([`Backend::set_lora_adapters`]) and the device bytes they and
    /// their per-step buffers take; `(0, 0)` without adapters.
    pub fn lora_usage(&self) -> (usize, usize) {
        self.lora
            .as_ref()
            .map_or((0, 0), |l| (l.count, l.device_bytes))
    }

    /// Where the kernels' include directory is expected (for error messages).
    pub fn include_dir(&self) -> &Path {
        &self.opts.include_dir
    }
}

/// The sampled rows of `launch` from its per-row outputs (see [`CudaWorker::read_outputs`]).
fn sampled_rows(launch: &Launch, out: Vec<RowOutput>) -> Vec<Sampled> {
    launch
        .rows
        .iter()
        .zip(out)
        .enumerate()
        .filter(|(_, (r, _))| r.sample == 1)
        .map(|(i, (r, (token, logprob, top)))| Sampled {
            row: i as u32,
            req: r.req,
            token,
            logprob,
            top,
        })
        .collect()
}

impl Backend for CudaWorker {
    fn execute(
        &mut self,
        launch: &Launch,
        tables: &dyn TableReader,
    ) -> Result<Completion, WorkerError> {
        if !self.inflight.is_empty() {
            // Its completion would overtake theirs; refuse before anything changes state.
            return Err(WorkerError::Forward(format!(
                "launch {} executed with {} launches in flight (finish them first)",
                launch.seq,
                self.inflight.len()
            )));
        }
        let rows = self.resolve(launch, tables)?;
        let masks = std::mem::take(&mut self.masks);
        let lora = std::mem::take(&mut self.lora_rows);
        let out = self.run_rows(launch.seq, &rows, &masks, &lora, None);
        self.masks = masks;
        self.lora_rows = lora;
        let sampled = sampled_rows(launch, out?);
        let prompt = self
            .prompt_scores
            .drain(..)
            .map(|s| {
                let r = &launch.rows[s.row as usize];
                PromptLogprob {
                    row: s.row,
                    req: r.req,
                    pos: r.first_pos + s.k + 1,
                    token: rows[s.row as usize].scored[s.k as usize],
                    logprob: s.logprob,
                    rank: s.rank,
                    top: s.top,
                }
            })
            .collect();
        Ok(Completion {
            seq: launch.seq,
            sampled,
            prompt,
        })
    }

    /// Two ([`FENCE_FRAMES`]): while the device runs one launch the host stages the next.
    fn max_in_flight(&self) -> usize {
        FENCE_FRAMES
    }

    /// Resolves and enqueues `launch` in the next host frame (see
    /// `CudaWorker::enqueue_rows`). Refuses (`Ok(false)`) a launch that scores prompt
    /// tokens (its scoring runs after the fence) and any launch while every frame is taken.
    fn submit(&mut self, launch: &Launch, tables: &dyn TableReader) -> Result<bool, WorkerError> {
        if self.inflight.len() >= FENCE_FRAMES
            || launch.rows.iter().any(|r| !r.scores_prompt().is_empty())
        {
            return Ok(false);
        }
        let rows = self.resolve(launch, tables)?;
        let masks = std::mem::take(&mut self.masks);
        let lora = std::mem::take(&mut self.lora_rows);
        let e = self.enqueue_rows(launch.seq, &rows, &masks, &lora, None);
        self.masks = masks;
        self.lora_rows = lora;
        let e = e?;
        self.inflight.push_back(InFlight {
            frame: e.frame,
            launch: launch.clone(),
        });
        Ok(true)
    }

    fn oldest_done(&mut self) -> bool {
        self.inflight
            .front()
            .is_none_or(|f| self.dev.fence_passed(f.frame).unwrap_or(true))
    }

    fn finish(&mut self) -> Option<(LaunchSeq, Result<Completion, WorkerError>)> {
        let f = self.inflight.pop_front()?;
        let seq = f.launch.seq;
        let waited = self.bind().and_then(|()| self.dev.wait_fence(f.frame));
        if let Err(e) = waited {
            // The caller releases the launch on an error: make sure nothing of it still runs
            // (a failed bind means a context that runs no more work).
            let _ = self.dev.synchronize();
            self.ring_host.forget(seq);
            return Some((seq, Err(dev_err(e))));
        }
        let out = self.read_outputs(
            f.frame,
            f.launch
                .rows
                .iter()
                .map(|r| (r.sample == 1, r.params.top_logprobs)),
        );
        Some((
            seq,
            Ok(Completion {
                seq,
                sampled: sampled_rows(&f.launch, out),
                prompt: Vec::new(),
            }),
        ))
    }

    fn kv_capacity(&self) -> KvCapacity {
        KvCapacity {
            num_blocks: self.num_blocks,
            block_size: self.opts.block_size,
        }
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn model_fingerprint(&self) -> u64 {
        self.cfg.fingerprint()
    }

    fn max_positions(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    /// Uploads `adapters` in the worker's element type (see [`crate::lora`]), replacing
    /// those set before (an empty list removes them). Launches with an adapter row then run
    /// eagerly through the per-kernel path; the others are unchanged.
    ///
    /// # Errors
    /// [`WorkerError::Device`] naming the adapter and what is wrong: an adapter for another
    /// model (layer count, a part's widths), a rank above [`crate::lora::LORA_MAX_RANK`],
    /// more than [`crate::lora::LORA_MAX_PARTS`] parts of one linear layer, a part of a
    /// mixture-of-experts MLP, not enough free device memory; or a device error. On error
    /// the worker serves no adapters.
    fn set_lora_adapters(&mut self, adapters: Vec<LoraAdapter>) -> Result<(), WorkerError> {
        self.bind().map_err(dev_err)?;
        // No launch may still read the old tables or ids.
        self.dev.synchronize().map_err(dev_err)?;
        self.lora = None;
        // The old graphs read the old adapters' buffers: destroy them.
        for (_, g) in self.lora_graphs.drain() {
            self.dev.destroy_graph(g).map_err(dev_err)?;
        }
        if adapters.is_empty() {
            return Ok(());
        }
        let l = LoraDevice::new(
            &self.dev,
            &self.cfg,
            self.dtype,
            self.layout.max_tokens,
            &adapters,
        )
        .map_err(|e| match e {
            CudaWorkerError::Unsupported(msg) => WorkerError::Device(msg),
            e => dev_err(e),
        })?;
        self.lora = Some(l);
        if !self.buckets.is_empty() {
            let buckets = self.buckets.clone();
            self.lora_graphs = self.capture_buckets(&buckets, true).map_err(dev_err)?;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "cuda"
    }
}

impl Drop for CudaWorker {
    fn drop(&mut self) {
        // Finish every launch before the buffers free themselves.
        if self.dev.bind().is_ok() {
            let _ = self.dev.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_slots_follow_push_order_and_forget_old_launches() {
        let mut r = Ring::default();
        assert_eq!(r.push(5, vec![true, false]), 0);
        assert_eq!(r.push(9, vec![true]), 1);
        assert_eq!(r.slot_of(5, 0), Some(0));
        assert_eq!(r.slot_of(5, 1), None, "row 1 did not sample");
        assert_eq!(r.slot_of(9, 0), Some(1));
        assert_eq!(r.slot_of(7, 0), None);
        for s in 10..10 + KEPT_LAUNCHES as u64 - 1 {
            r.push(s, vec![true]);
        }
        assert_eq!(r.slot_of(5, 0), None, "launch 5 fell out of the window");
        assert_eq!(r.slot_of(9, 0), Some(1));
        // The next push reuses launch 9's slot only after forgetting it.
        assert_eq!(r.push(100, vec![true]), 1);
        assert_eq!(r.slot_of(9, 0), None);
        assert_eq!(r.slot_of(100, 0), Some(1));
    }

    #[test]
    fn a_launch_that_fails_is_never_a_pending_source_and_its_slot_holds_no_stale_launch() {
        let mut r = Ring::default();
        for s in 0..KEPT_LAUNCHES as u64 {
            r.push(s, vec![true]);
        }
        // Launch 50 reserves launch 0's slot (its ids get overwritten), then fails.
        let slot = r.reserve();
        assert_eq!(
            r.slot_of(0, 0),
            None,
            "launch 0's ids are being overwritten"
        );
        assert_eq!(
            r.slot_of(50, 0),
            None,
            "not committed: failed launches are no source"
        );
        // The next launch takes the following slot, and launch 1 is forgotten before it.
        let next = r.reserve();
        assert_ne!(next, slot);
        assert_eq!(r.slot_of(1, 0), None);
        r.commit(51, next, vec![true]);
        assert_eq!(r.slot_of(51, 0), Some(next));
        assert_eq!(r.slot_of(2, 0), Some(2 % KEPT_LAUNCHES));
    }

    #[test]
    fn device_bytes_are_the_same_across_parallel_chunks() {
        // Three chunks and a partial one, every element converted on its own for reference.
        let v: Vec<f32> = (0..(3 << 16) + 77)
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        for d in Dtype::ALL {
            let want: Vec<u8> = v
                .iter()
                .flat_map(|&x| match d {
                    Dtype::F32 => x.to_le_bytes().to_vec(),
                    Dtype::Bf16 => half::bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                    Dtype::F16 => half::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                })
                .collect();
            assert!(to_device_bytes(&v, d) == want, "{d:?}");
        }
    }

    #[test]
    fn device_bytes_round_trip() {
        let v = [1.0f32, -2.5, 0.1, 65504.0];
        for d in Dtype::ALL {
            let b = to_device_bytes(&v, d);
            assert_eq!(b.len(), v.len() * d.size());
            let back = from_device_bytes(&b, d);
            for (x, y) in v.iter().zip(&back) {
                let tol = match d {
                    Dtype::F32 => 0.0,
                    Dtype::F16 => 1e-3,
                    Dtype::Bf16 => 8e-3,
                };
                assert!((x - y).abs() <= tol * x.abs(), "{d:?}: {x} -> {y}");
            }
        }
        // bf16 rounds to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7.
        assert_eq!(
            to_device_bytes(&[1.0 + 1.0 / 256.0], Dtype::Bf16),
            vec![0x80, 0x3f]
        );
    }

    #[test]
    fn out_offsets_are_aligned_and_disjoint() {
        let o = out_offsets(5);
        assert_eq!(o.tokens, 0);
        assert!(o.logprob >= 20 && o.logprob.is_multiple_of(16));
        assert!(o.top_ids >= o.logprob + 20 && o.top_ids.is_multiple_of(16));
        assert!(o.top_lp >= o.top_ids + 4 * 5 * SAMPLER_TOP_SLOTS);
        assert!(o.total >= o.top_lp + 4 * 5 * SAMPLER_TOP_SLOTS);
    }

    #[test]
    fn kargs_store_ints_and_floats_in_the_low_bytes() {
        let mut a = KArgs::new();
        a.p(0xdead_beef_0000_0010).i(7).f(1.5);
        assert_eq!(a.n, 3);
        assert_eq!(a.vals[0], 0xdead_beef_0000_0010);
        assert_eq!(a.vals[1] as u32 as i32, 7);
        assert_eq!(f32::from_bits(a.vals[2] as u32), 1.5);
        let mut b = KArgs::new();
        b.i(usize::MAX); // -1 as int
        assert_eq!(b.vals[0] as u32 as i32, -1);
    }

    fn llama_1b() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":2048,
            "intermediate_size":8192,"num_hidden_layers":16,"num_attention_heads":32,
            "num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":131072}"#,
        )
        .unwrap()
    }

    fn opts(kv_blocks: KvBlocks) -> CudaWorkerOptions {
        CudaWorkerOptions {
            device: 0,
            dtype: Dtype::Bf16,
            include_dir: "/nonexistent".into(),
            block_size: 16,
            kv_blocks,
            max_tokens: 2048,
            max_rows: 256,
            max_model_len: 4096,
            enforce_eager: false,
            fused_decode: true,
            tuning: Default::default(),
        }
    }

    #[test]
    fn llama_1b_and_8b_take_the_persistent_kernel_in_bf16_and_qwen_sliding_or_odd_shapes_do_not() {
        let mut cfg = llama_1b();
        assert_eq!(persistent_refusal(&cfg, 2), None);
        assert_eq!(persistent_refusal(&cfg, 4), None);
        cfg.head_dim = 128;
        cfg.num_attention_heads = 32;
        cfg.hidden_size = 4096;
        cfg.intermediate_size = 14336;
        assert_eq!(persistent_refusal(&cfg, 2), None);
        // 14336 f32 elements are more than the hd128 tile stages.
        assert!(persistent_refusal(&cfg, 4)
            .unwrap()
            .contains("intermediate_size"));
        let mut odd = llama_1b();
        odd.intermediate_size = 8200 + 4;
        assert!(persistent_refusal(&odd, 2).unwrap().contains("16-byte"));
        let mut hd = llama_1b();
        hd.head_dim = 256;
        assert!(persistent_refusal(&hd, 2).unwrap().contains("head_dim"));
        let mut qwen = llama_1b();
        qwen.qkv_bias = true;
        assert!(persistent_refusal(&qwen, 2).unwrap().contains("biases"));
        let mut mistral = llama_1b();
        mistral.sliding_window[3] = Some(4096);
        assert!(persistent_refusal(&mistral, 2)
            .unwrap()
            .contains("sliding-window"));
    }

    #[test]
    fn device_plan_counts_every_weight_once_in_the_dtype() {
        let cfg = llama_1b();
        let p = CudaWorker::device_plan(&cfg, &opts(KvBlocks::Fixed(1))).unwrap();
        let (h, v, l, im) = (2048usize, 128256usize, 16usize, 8192usize);
        let (q, kv) = (32 * 64, 8 * 64);
        // Embedding and LM head stored separately; per layer two norms, qkv, o, gate/up, down.
        let params = 2 * v * h + h + l * (2 * h + (q + 2 * kv) * h + h * q + 3 * im * h);
        assert!(p.weight_bytes >= 2 * params, "{p:?}");
        assert!(p.weight_bytes < 2 * params + 256 * (3 + 6 * l), "{p:?}");
        // K and V, 16 layers, 16 tokens, 8 heads of 64, 2 bytes.
        assert_eq!(p.kv_bytes_per_block, 2 * 16 * 16 * 8 * 64 * 2);
        assert!(
            p.buffer_bytes > 2048 * 2 * 8192 * 2,
            "gate/up activations at least"
        );
    }

    #[test]
    fn qwen_biases_and_norms_are_two_more_groups_per_layer() {
        // A Llama 1B shape as Qwen2 (q|k|v biases) and as Qwen3 (q|k norms; head_dim 128, so
        // the query width is not the hidden size).
        let base = r#""hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,
            "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
            "max_position_embeddings":131072"#;
        let llama = CudaWorker::device_plan(&llama_1b(), &opts(KvBlocks::Fixed(1)))
            .unwrap()
            .weight_bytes;
        let qwen2 = ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2",{base}}}"#
        ))
        .unwrap();
        assert!(qwen2.qkv_bias && !qwen2.qk_norm);
        let groups = layer_groups(&qwen2, 0);
        assert_eq!(groups.len(), 7);
        assert_eq!(groups[bias_group(&qwen2).unwrap()], [9, 10, 11]);
        assert_eq!(norm_group(&qwen2), None);
        let p = CudaWorker::device_plan(&qwen2, &opts(KvBlocks::Fixed(1))).unwrap();
        // One 256-byte aligned group of (32 + 2 * 8) * 64 bf16 biases per layer.
        let bias = ((32 + 2 * 8) * 64 * 2usize).div_ceil(256) * 256;
        assert_eq!(p.weight_bytes, llama + 16 * bias);

        let qwen3 = ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","head_dim":128,
            {base}}}"#
        ))
        .unwrap();
        assert!(!qwen3.qkv_bias && qwen3.qk_norm);
        let groups = layer_groups(&qwen3, 0);
        assert_eq!(groups.len(), 7);
        assert_eq!(groups[norm_group(&qwen3).unwrap()], [9, 10]);
        let shapes = baton_model::weights::layer_tensor_shapes(&qwen3, 3);
        assert!(
            shapes[9].0.ends_with("self_attn.q_norm.weight"),
            "{shapes:?}"
        );
        assert!(
            shapes[10].0.ends_with("self_attn.k_norm.weight"),
            "{shapes:?}"
        );
        let wl = WeightLayout::new(&qwen3, 2);
        let (h, q, kv, im) = (2048usize, 32 * 128usize, 8 * 128usize, 8192usize);
        let layer = [h, (q + 2 * kv) * h, h * q, h, 2 * im * h, h * im, 2 * 128];
        let per_layer: usize = layer.iter().map(|n| (n * 2).div_ceil(256) * 256).sum();
        assert_eq!(wl.layers[1][0] - wl.layers[0][0], per_layer);
        assert_eq!(wl.layers[0].len(), 7);

        // Both at once: the bias group, then the norm group.
        let mut both = qwen2.clone();
        both.qk_norm = true;
        assert_eq!(layer_groups(&both, 0)[6], [9, 10, 11]);
        assert_eq!(layer_groups(&both, 0)[7], [12, 13]);
        assert_eq!(norm_group(&both), Some(7));
    }

    #[test]
    fn planned_kv_blocks_fill_the_budget_and_no_more() {
        let cfg = llama_1b();
        let gib = 1usize << 30;
        let (free, total) = (139 * gib, 140 * gib);
        let o = opts(KvBlocks::Utilization {
            fraction: 0.9,
            max_blocks: usize::MAX,
        });
        let p = CudaWorker::device_plan(&cfg, &o).unwrap();
        let n = CudaWorker::plan_kv_blocks(&cfg, &o, free, total).unwrap();
        let budget = (total as f64 * 0.9) as usize;
        let used = |blocks: usize| {
            p.weight_bytes + p.buffer_bytes + RESERVE_SLACK + blocks * p.kv_bytes_per_block
        };
        assert!(used(n) <= budget, "over budget");
        assert!(used(n + 1) > budget, "a page more would still fit");
        // The cap, a fixed count, and a GPU too small for the weights.
        let capped = opts(KvBlocks::Utilization {
            fraction: 0.9,
            max_blocks: 100,
        });
        assert_eq!(
            CudaWorker::plan_kv_blocks(&cfg, &capped, free, total).unwrap(),
            100
        );
        assert_eq!(
            CudaWorker::plan_kv_blocks(&cfg, &opts(KvBlocks::Fixed(7)), 0, 0).unwrap(),
            7
        );
        assert!(matches!(
            CudaWorker::plan_kv_blocks(&cfg, &o, 2 * gib, 2 * gib),
            Err(CudaWorkerError::KvSizing(_))
        ));
    }

    /// With partial RoPE the attention factor goes into the rotated dims' q rows (not the
    /// logits): `a²` on rows `i` and `i + head_dim/2` of each head for `i < rotary_dim/2`, no
    /// other row; with q/k head norms (which would undo it) the config is refused.
    #[test]
    fn partial_rope_scales_the_rotated_q_rows_by_the_attention_factor() {
        let phi = |extra: &str| {
            baton_model::ModelConfig::from_json_str(&format!(
                r#"{{"architectures":["Phi3ForCausalLM"],"model_type":"phi3","hidden_size":64,
                "intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":2,
                "num_key_value_heads":1,"vocab_size":32,"max_position_embeddings":64,
                "partial_rotary_factor":0.5{extra}}}"#
            ))
            .unwrap()
        };
        let plain = phi("");
        check_shape(&plain).expect("partial RoPE alone runs");
        assert_eq!(rotated_q_scale(&plain), None);
        let longrope = r#","original_max_position_embeddings":32,"rope_scaling":{"type":
            "longrope","short_factor":[1,1,1,1,1,1,1,1],"long_factor":[1,1,1,1,1,1,1,1],
            "attention_factor":1.5}"#;
        let cfg = phi(longrope);
        check_shape(&cfg).expect("partial RoPE with a factor runs");
        assert_eq!(rotated_q_scale(&cfg), Some(2.25));
        // head_dim 32, rotary 16: rows 0..8 and 16..24 of each of the 2 heads, 3 values each.
        let (d, n) = (32, 3);
        let rows = 2 * d + 2 * 16; // q, then k's rows, untouched
        let vals: Vec<f32> = (0..rows * n).map(|i| i as f32 + 1.0).collect();
        let mut bytes = to_device_bytes(&vals, Dtype::F32);
        scale_rotated_q_rows(&mut bytes, &cfg, Dtype::F32, n, 2.25);
        let got: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for (i, (&g, &v)) in got.iter().zip(&vals).enumerate() {
            let r = i / n;
            let rotated = r < 2 * d && (r % d < 8 || (16..24).contains(&(r % d)));
            assert_eq!(g, if rotated { v * 2.25 } else { v }, "row {r}");
        }
        let mut qwen3 = cfg.clone();
        qwen3.qk_norm = true;
        let e = check_shape(&qwen3).unwrap_err().to_string();
        assert!(
            e.contains("partial RoPE") && e.contains("--device cpu"),
            "{e}"
        );
    }

    /// Gemma 3 on CUDA: its device groups add the two output norms after the q|k norms, its
    /// decode steps take the per-kernel path (not the fused GEMVs nor the persistent kernel),
    /// and partial RoPE with an attention factor is refused beside its local RoPE layers.
    #[test]
    fn gemma3_groups_and_paths() {
        let gemma = baton_model::ModelConfig::from_json_str(
            r#"{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text",
            "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":2,"num_key_value_heads":1,"head_dim":32,"vocab_size":32,
            "max_position_embeddings":64,"sliding_window":8,"sliding_window_pattern":2}"#,
        )
        .unwrap();
        check_shape(&gemma).expect("Gemma 3 runs");
        let shapes = baton_model::weights::layer_tensor_shapes(&gemma, 0);
        let groups = layer_groups(&gemma, 0);
        assert_eq!(groups.len(), 9);
        let (a, m) = out_norm_groups(&gemma).unwrap();
        assert!(shapes[groups[a][0]]
            .0
            .ends_with("post_attention_layernorm.weight"));
        assert!(shapes[groups[m][0]]
            .0
            .ends_with("post_feedforward_layernorm.weight"));
        assert!(shapes[groups[3][0]]
            .0
            .ends_with("pre_feedforward_layernorm.weight"));
        let norms = norm_groups(&gemma);
        for g in 0..groups.len() {
            let is_norm = shapes[groups[g][0]].0.contains("norm");
            assert_eq!(norms.contains(&g), is_norm, "group {g}");
        }
        assert!(cublas_layers(&gemma));
        assert!(persistent_refusal(&gemma, 2).is_some());
        let llama = llama_1b();
        assert!(!cublas_layers(&llama) && out_norm_groups(&llama).is_none());
        assert_eq!(norm_groups(&llama), [0, 3]);
        let mut partial = gemma.clone();
        partial.rotary_dim = 16;
        partial.rope_scaling = Some(baton_model::RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 16,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.5,
            truncate: true,
        });
        let e = check_shape(&partial).unwrap_err().to_string();
        assert!(e.contains("local RoPE"), "{e}");
    }

    #[test]
    fn mixture_of_experts_groups_upload_every_expert_and_past_the_kernels_limits_are_refused() {
        let qwen2 = ModelConfig::from_json_str(
            r#"{"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "max_position_embeddings": 256, "num_experts": 3, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
            "mlp_only_layers": [0]}"#,
        )
        .expect("config");
        check_shape(&qwen2).expect("mixture-of-experts models run");
        assert!(cublas_layers(&qwen2) && persistent_refusal(&qwen2, 2).is_some());
        // Layer 0 is dense: Qwen2's groups.
        let dense = layer_groups(&qwen2, 0);
        assert_eq!(dense[4], [6, 7]);
        assert_eq!(dense[6], [9, 10, 11]);
        assert_eq!(dense.len(), 7);
        // Layer 1: attention, biases at 6..9, the router at 9, expert e's gate, up, down at
        // 10 + 3e, the shared expert's after them.
        let shapes = baton_model::weights::layer_tensor_shapes(&qwen2, 1);
        let g = layer_groups(&qwen2, 1);
        assert_eq!(g[4], [10, 11, 13, 14, 16, 17]);
        assert_eq!(g[5], [12, 15, 18]);
        assert_eq!(g[6], [6, 7, 8]);
        let (router, shared) = moe_groups(&qwen2);
        let (sgu, sd, sg) = shared.expect("a shared expert");
        assert_eq!(g[router], [9]);
        assert_eq!(
            (g[sgu].clone(), g[sd].clone(), g[sg].clone()),
            (vec![19, 20], vec![21], vec![22])
        );
        assert_eq!(g.iter().map(Vec::len).sum::<usize>(), shapes.len());
        assert!(shapes[9].0.ends_with("mlp.gate.weight"), "{}", shapes[9].0);
        assert!(shapes[22].0.ends_with("shared_expert_gate.weight"));
        for (part, name) in [
            (10, "experts.0.gate_proj"),
            (14, "experts.1.up_proj"),
            (18, "experts.2.down_proj"),
        ] {
            assert!(shapes[part].0.contains(name), "{}", shapes[part].0);
        }
        let mut wide = qwen2.clone();
        wide.moe.as_mut().unwrap().top_k = MOE_MAX_TOP_K + 1;
        let e = check_shape(&wide).unwrap_err().to_string();
        assert!(
            e.contains("mixture-of-experts") && e.contains("--device cpu"),
            "{e}"
        );
    }

    #[test]
    fn new_without_a_driver_is_a_clean_error() {
        if crate::backend::driver_available() {
            return;
        }
        let cfg = baton_model::ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":16,
            "intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":2,
            "num_key_value_heads":1,"vocab_size":32,"max_position_embeddings":64}"#,
        )
        .unwrap();
        let w = LlamaWeights::dummy(&cfg, 0);
        let e = CudaWorker::new(
            cfg,
            w,
            CudaWorkerOptions {
                device: 0,
                dtype: Dtype::Bf16,
                include_dir: "/nonexistent".into(),
                block_size: 16,
                kv_blocks: KvBlocks::Utilization {
                    fraction: 0.9,
                    max_blocks: 16,
                },
                max_tokens: 64,
                max_rows: 4,
                max_model_len: 64,
                enforce_eager: true,
                fused_decode: true,
                tuning: Default::default(),
            },
        )
        .err()
        .expect("no driver here");
        assert!(matches!(e, CudaWorkerError::DriverUnavailable), "{e}");
        assert!(e.to_string().contains("--device cpu"));
    }
}
