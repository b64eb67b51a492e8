//! f32 CPU reference forward pass of a Llama-family model over a paged KV cache.
//!
//! Contract: numerics follow HF transformers `modeling_llama.py` (RMSNorm, rotate-half RoPE,
//! GQA causal attention with f32 softmax, SwiGLU MLP), and every row's output is bit-identical
//! whatever else is in the batch, whatever its row index, block size or page ids: all per-token
//! arithmetic (including the linear layers, see `crate::linear`) is done in an order that
//! depends only on that token's data and position. Invalid inputs are rejected before anything is written.

use crate::attention::{self, KvElem};
use crate::config::{Activation, ModelConfig};
use crate::error::{ForwardError, ModelError};
use crate::linear::{GgmlRows, Store};
use crate::lora::{LoraAdapter, LoraLinear};
use crate::vmath;
use crate::weights::{
    layer_tensor_shapes, DType, LayerWeights, LlamaWeights, Tensor, WeightSource,
};
use std::sync::Mutex;

/// The K and V arrays of a [`PagedKvCache`], in its dtype.
#[derive(Clone)]
enum KvData {
    F32(Vec<f32>, Vec<f32>),
    Bf16(Vec<half::bf16>, Vec<half::bf16>),
    F16(Vec<half::f16>, Vec<half::f16>),
}

/// Paged KV cache on the host: `num_blocks` pages of `block_size` token slots per layer.
///
/// Layout of both `K` and `V`: `[layer][page][slot][kv_head][head_dim]`, contiguous, in the
/// cache's dtype: f32 (the reference), or bf16 or f16 (vLLM's `--kv-cache-dtype`: half the
/// memory and the bytes a decode step reads; values are rounded to nearest-even when stored
/// and widened exactly when read, see `crate::attention`). Position `p` of a sequence lives
/// in page `block_table[p / block_size]`, slot `p % block_size`. K is stored after RoPE.
/// `Debug` prints the dimensions only.
#[derive(Clone)]
pub struct PagedKvCache {
    data: KvData,
    num_layers: usize,
    num_blocks: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl std::fmt::Debug for PagedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedKvCache")
            .field("dtype", &self.dtype())
            .field("num_layers", &self.num_layers)
            .field("num_blocks", &self.num_blocks)
            .field("block_size", &self.block_size)
            .field("kv_heads", &self.kv_heads)
            .field("head_dim", &self.head_dim)
            .finish()
    }
}

impl PagedKvCache {
    /// Allocates a zeroed f32 cache of `num_blocks` pages of `block_size` tokens for every
    /// layer.
    ///
    /// Memory: `num_blocks * bytes_per_block(cfg, block_size, DType::F32)` bytes. A
    /// `block_size` of 0 is treated as 1.
    ///
    /// # Panics
    /// When the memory cannot be allocated; [`PagedKvCache::try_new`] returns an error instead.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        Self::try_new(cfg, num_blocks, block_size).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`PagedKvCache::new`], failing with a message (the bytes asked for) when the size
    /// overflows or the allocation fails, for caches sized by a user's flags.
    ///
    /// # Errors
    /// The size overflows `usize`, or the allocator refused it.
    pub fn try_new(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, String> {
        Self::try_with_dtype(cfg, num_blocks, block_size, DType::F32)
    }

    /// The KV dtype `--kv-cache-dtype auto` means for `cfg` (vLLM: the model's dtype):
    /// config.json's `torch_dtype` ([`DType::from_name`]), else f32 (absent, or a dtype the
    /// CPU does not store).
    pub fn auto_dtype(cfg: &ModelConfig) -> DType {
        cfg.torch_dtype
            .as_deref()
            .and_then(DType::from_name)
            .unwrap_or(DType::F32)
    }

    /// As [`PagedKvCache::try_new`], storing K and V as `dtype`: memory
    /// `num_blocks * bytes_per_block(cfg, block_size, dtype)` bytes.
    ///
    /// # Errors
    /// The size overflows `usize`, or the allocator refused it.
    pub fn try_with_dtype(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
    ) -> Result<Self, String> {
        let block_size = block_size.max(1);
        let n = [
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        ]
        .iter()
        .try_fold(cfg.num_hidden_layers, |a, &b| a.checked_mul(b));
        fn alloc<E: KvElem>(n: usize) -> Option<Vec<E>> {
            let mut v = Vec::new();
            v.try_reserve_exact(n).ok()?;
            v.resize(n, E::default());
            Some(v)
        }
        let too_big = || {
            format!(
                "the CPU KV cache of {num_blocks} blocks of {block_size} tokens needs {:.1} GiB, \
                 which cannot be allocated; give fewer --num-blocks",
                num_blocks as f64 * Self::bytes_per_block(cfg, block_size, dtype) as f64
                    / (1u64 << 30) as f64
            )
        };
        let n = n.ok_or_else(too_big)?;
        let data = match dtype {
            DType::F32 => KvData::F32(alloc(n).ok_or_else(too_big)?, alloc(n).ok_or_else(too_big)?),
            DType::BF16 => {
                KvData::Bf16(alloc(n).ok_or_else(too_big)?, alloc(n).ok_or_else(too_big)?)
            }
            DType::F16 => KvData::F16(alloc(n).ok_or_else(too_big)?, alloc(n).ok_or_else(too_big)?),
        };
        Ok(PagedKvCache {
            data,
            num_layers: cfg.num_hidden_layers,
            num_blocks,
            block_size,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        })
    }

    /// Tokens per page.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Pages per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The dtype K and V are stored in.
    pub fn dtype(&self) -> DType {
        match self.data {
            KvData::F32(..) => DType::F32,
            KvData::Bf16(..) => DType::BF16,
            KvData::F16(..) => DType::F16,
        }
    }

    /// Bytes one page takes across all layers, K and V, stored as `dtype`:
    /// `2 * layers * block_size * kv_heads * head_dim * dtype.size()`.
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize, dtype: DType) -> usize {
        2 * cfg.num_hidden_layers
            * block_size
            * cfg.num_key_value_heads
            * cfg.head_dim
            * dtype.size()
    }

    /// Offset of (layer, page, slot) in `k`/`v`.
    #[inline]
    fn offset(&self, layer: usize, page: usize, slot: usize) -> usize {
        ((layer * self.num_blocks + page) * self.block_size + slot) * self.kv_heads * self.head_dim
    }

    /// The stored K and V of one position (`[kv_heads * head_dim]` each, widened to f32),
    /// for inspection. `None` if out of range.
    pub fn get(&self, layer: usize, page: usize, slot: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        if layer >= self.num_layers || page >= self.num_blocks || slot >= self.block_size {
            return None;
        }
        let r = self.offset(layer, page, slot)..self.offset(layer, page, slot + 1);
        fn widen<E: KvElem>(x: &[E]) -> Vec<f32> {
            x.iter().map(|e| e.to_f32()).collect()
        }
        Some(match &self.data {
            KvData::F32(k, v) => (widen(&k[r.clone()]), widen(&v[r])),
            KvData::Bf16(k, v) => (widen(&k[r.clone()]), widen(&v[r])),
            KvData::F16(k, v) => (widen(&k[r.clone()]), widen(&v[r])),
        })
    }

    /// Stores one position's K and V rows (`[kv_heads * head_dim]` f32 each) at offset `o`,
    /// rounded to the cache's dtype.
    fn store(&mut self, o: usize, k_row: &[f32], v_row: &[f32]) {
        fn put<E: KvElem>(dst: &mut [E], src: &[f32]) {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = E::from_f32(x);
            }
        }
        let w = k_row.len();
        match &mut self.data {
            KvData::F32(k, v) => {
                put(&mut k[o..o + w], k_row);
                put(&mut v[o..o + w], v_row);
            }
            KvData::Bf16(k, v) => {
                put(&mut k[o..o + w], k_row);
                put(&mut v[o..o + w], v_row);
            }
            KvData::F16(k, v) => {
                put(&mut k[o..o + w], k_row);
                put(&mut v[o..o + w], v_row);
            }
        }
    }
}

/// One layer's attention over the step's tokens: the inputs [`AttentionStep::run`] needs
/// besides the cache.
struct AttentionStep<'a> {
    rows: &'a [ForwardRow<'a>],
    /// `[T][q_heads + 2 * kv_heads][head_dim]`: the step's q, k and v after RoPE.
    qkv: &'a [f32],
    /// Per token: its row and the number of positions it attends to.
    tok_ctx: &'a [(usize, usize)],
    /// Offset of the layer's page 0, slot 0 in the cache.
    layer_off: usize,
    block_size: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    /// The layer's sliding window ([`ModelConfig::sliding_window`]), `None` for full causal
    /// attention.
    window: Option<usize>,
    /// Run the jobs on the current rayon pool (else on this thread; same bits).
    parallel: bool,
}

impl AttentionStep<'_> {
    /// Causal GQA attention of every token over the cache `k`/`v`: a job per (unit, KV head),
    /// where a unit is one token or a tile of up to [`attention::TILE`] consecutive tokens of
    /// a prefill chunk that share at least one whole partition ([`attention::attend_tile`]);
    /// a single token's partitions are split over the threads too when the step has fewer
    /// jobs than twice the threads (a small decode batch). Writes `[T][q_heads][head_dim]`
    /// into `attn`; the bits do not depend on the units.
    fn run<E: KvElem>(&self, k: &[E], v: &[E], attn: &mut [f32]) {
        use rayon::prelude::*;
        let (kvh, hd) = (self.kv_heads, self.head_dim);
        let group = self.q_heads / kvh;
        let qkv_w = (self.q_heads + 2 * kvh) * hd;
        let q_w = self.q_heads * hd;
        let kvl = attention::KvLayer {
            k,
            v,
            layer_off: self.layer_off,
            block_size: self.block_size,
            stride: kvh * hd,
            head_dim: hd,
        };
        let job_len = group * hd;
        let threads = rayon::current_num_threads();
        let mut units = self.units(true);
        if self.parallel && units.len() * kvh < 2 * threads {
            // Too few tiles to keep the threads busy (a short chunk late in a long prompt on
            // many threads): single tokens, whose partitions split over the threads.
            units = self.units(false);
        }
        let split = self.parallel && units.len() * kvh < 2 * threads;
        // Job outputs, `[unit][kv head][token of the unit][group][head_dim]`: attn's own
        // layout when every unit is one token, else a buffer scattered into attn below.
        let tiled = units.len() < self.tok_ctx.len();
        let mut buf = if tiled {
            vec![0.0f32; attn.len()]
        } else {
            Vec::new()
        };
        let dst: &mut [f32] = if tiled { &mut buf } else { &mut *attn };
        let mut jobs = Vec::with_capacity(units.len() * kvh);
        let mut rest = dst;
        for &(i0, n) in &units {
            for g in 0..kvh {
                let (o, r) = rest.split_at_mut(n * job_len);
                jobs.push((i0, n, g, o));
                rest = r;
            }
        }
        let run = |scratch: &mut attention::JobScratch,
                   (i0, n, g, out): (usize, usize, usize, &mut [f32])| {
            let (r, n_ctx) = self.tok_ctx[i0];
            let table = self.rows[r].block_table;
            let q = |i: usize| &self.qkv[i * qkv_w + g * job_len..][..job_len];
            if n == 1 {
                let (w, scale) = (self.window, self.scale);
                attention::attend(kvl, table, g, n_ctx, w, q(i0), scale, split, scratch, out);
            } else {
                let mut qt = std::mem::take(&mut scratch.q);
                qt.clear();
                for i in i0..i0 + n {
                    qt.extend_from_slice(q(i));
                }
                let (w, scale) = (self.window, self.scale);
                attention::attend_tile(kvl, table, g, n_ctx, n, w, &qt, scale, scratch, out);
                scratch.q = qt;
            }
        };
        if self.parallel {
            jobs.into_par_iter()
                .for_each_init(|| attention::JobScratch::new(group), run);
        } else {
            let mut scratch = attention::JobScratch::new(group);
            for job in jobs {
                run(&mut scratch, job);
            }
        }
        if tiled {
            let mut off = 0;
            for &(i0, n) in &units {
                for g in 0..kvh {
                    for i in i0..i0 + n {
                        attn[i * q_w + g * job_len..][..job_len]
                            .copy_from_slice(&buf[off..off + job_len]);
                        off += job_len;
                    }
                }
            }
        }
    }

    /// The step's units, `(first token, tokens)`: with `tile`, runs of up to
    /// [`attention::TILE`] consecutive tokens of one row that share a whole partition
    /// ([`attention::tile_shared`]: without a window, those whose first token attends to a
    /// whole partition or more), else single tokens.
    fn units(&self, tile: bool) -> Vec<(usize, usize)> {
        let mut units = Vec::new();
        let mut i = 0;
        while i < self.tok_ctx.len() {
            let (r, n_ctx) = self.tok_ctx[i];
            let mut n = 1;
            let (js, je) = attention::tile_shared(n_ctx, attention::TILE, self.window);
            if tile && js < je {
                while n < attention::TILE && self.tok_ctx.get(i + n).is_some_and(|&(r2, _)| r2 == r)
                {
                    n += 1;
                }
            }
            units.push((i, n));
            i += n;
        }
        units
    }
}

/// `(logits per want_logits row, residual stream [T, hidden] after each layer)`, as returned by
/// [`CpuModel::forward_with_layer_outputs`].
pub type LogitsAndLayers = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// One row of a batch: a prefill chunk or a single decode token of one sequence.
#[derive(Debug, Clone, Copy)]
pub struct ForwardRow<'a> {
    /// Token ids at positions `start_pos..start_pos + tokens.len()`; non-empty.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start_pos` must already be in the cache.
    pub start_pos: usize,
    /// Pages of the sequence, in position order; at least `ceil((start_pos + len) /
    /// block_size)` entries.
    pub block_table: &'a [u32],
    /// Whether to return logits for the row's last token.
    pub want_logits: bool,
    /// Whether to return logits for every position of the row (prompt log-probabilities),
    /// which includes the last one; `want_logits` is then irrelevant.
    pub all_logits: bool,
    /// The LoRA adapter the row runs with: 0 for none, `i + 1` for the `i`-th adapter given
    /// to [`CpuModel::set_lora_adapters`].
    pub lora: u32,
}

/// A linear layer `y = x · Wᵀ` with `W` `[n, k]` row-major, in the narrowest type that holds
/// its values exactly ([`Store::compact`]: bf16 or f16 for a 16-bit checkpoint).
#[derive(Clone)]
struct Linear {
    w: Store,
    n: usize,
    k: usize,
    /// Whether a GGUF file's quantized matrix runs with 8-bit activations
    /// ([`CpuModel::set_int8_activations`]).
    int8: bool,
}

impl Linear {
    /// Concatenates `[n_i, k]` weights along rows into one `[sum n_i, k]` matrix, reusing the
    /// first tensor's allocation.
    fn concat(parts: Vec<Tensor>) -> Self {
        if parts.iter().any(Tensor::is_ggml) {
            // Some part is a GGUF file's quantized blocks: the matrix stays in blocks.
            let k = parts[0].shape[1];
            let n = parts.iter().map(|p| p.shape[0]).sum();
            let rows = parts
                .into_iter()
                .map(|p| {
                    p.ggml
                        .unwrap_or_else(|| GgmlRows::from_f32(p.shape[0], k, &p.data))
                })
                .collect();
            return Linear {
                w: Store::of_parts(rows, k),
                n,
                k,
                int8: false,
            };
        }
        let mut it = parts.into_iter();
        let first = it.next().expect("at least one tensor");
        let k = first.shape[1];
        let mut n = first.shape[0];
        let mut w = first.data;
        for p in it {
            n += p.shape[0];
            w.extend_from_slice(&p.data);
        }
        Linear {
            w: Store::compact(w),
            n,
            k,
            int8: false,
        }
    }

    /// `out[t, n] = x[t, k] · Wᵀ` on the current rayon pool, each element in the fixed order
    /// of [`crate::linear`] (bit-identical whatever `t` and the thread count).
    fn apply(&self, x: &[f32], t: usize, out: &mut [f32]) {
        crate::linear::linear(x, t, &self.w, self.n, self.k, out, self.int8);
    }
}

struct Layer {
    input_norm: Vec<f32>,
    /// Fused q, k, v projections: `[(heads + 2 kv_heads) * head_dim, hidden]`.
    qkv: Linear,
    /// Fused q, k, v biases, `[(heads + 2 kv_heads) * head_dim]` (Qwen2).
    qkv_bias: Option<Vec<f32>>,
    /// Per-head q and k RMSNorm weights, `[head_dim]` each (Qwen3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: Linear,
    post_norm: Vec<f32>,
    mlp: Mlp,
    /// RMSNorm weights of the attention and MLP outputs before their residual adds (Gemma 3's
    /// `post_attention_layernorm` and `post_feedforward_layernorm`).
    out_norms: Option<(Vec<f32>, Vec<f32>)>,
}

/// A layer's MLP.
enum Mlp {
    /// `down(act(gate(x)) * up(x))`: fused gate and up `[2 * intermediate, hidden]`, down
    /// `[hidden, intermediate]`.
    Dense { gate_up: Linear, down: Linear },
    /// A mixture of experts ([`crate::MoeConfig`]).
    Moe(Box<Moe>),
}

/// A mixture-of-experts MLP ([`crate::MoeConfig`] gives the routing).
struct Moe {
    /// `[num_experts, hidden]`.
    router: Linear,
    /// Per expert: fused gate and up `[2 * moe_intermediate, hidden]`, down.
    experts: Vec<(Linear, Linear)>,
    /// Qwen2-MoE's shared expert: fused gate and up, down, and its gate `[1, hidden]`.
    shared: Option<(Linear, Linear, Linear)>,
    top_k: usize,
    norm_topk_prob: bool,
}

/// Scratch of [`Moe::forward`], reused across layers and steps.
#[derive(Default)]
struct MoeScratch {
    /// `[t, num_experts]` router logits, then probabilities.
    probs: Vec<f32>,
    /// Per token, its `top_k` (expert, weight), by ascending expert id.
    chosen: Vec<(usize, f32)>,
    /// One token's expert ids while its top k are chosen.
    order: Vec<usize>,
    /// Per expert, the (token, slot) pairs routed to it, by ascending token.
    routed: Vec<Vec<(usize, usize)>>,
    /// One expert's gathered inputs `[m, hidden]`.
    x: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// One expert's outputs `[m, hidden]`.
    y: Vec<f32>,
    /// Per (token, slot), the chosen expert's output `[t * top_k, hidden]`.
    pair_out: Vec<f32>,
    /// The shared expert's gate logits `[t]`.
    shared_gate: Vec<f32>,
}

/// `out[t, hidden] = down(act(gate(x)) * up(x))` for `x` `[t, hidden]`, `gate_up` holding the
/// gate rows then the up rows; `gu` and `a` are scratch.
#[allow(clippy::too_many_arguments)]
fn gated_mlp(
    gate_up: &Linear,
    down: &Linear,
    act: Activation,
    x: &[f32],
    t: usize,
    gu: &mut Vec<f32>,
    a: &mut Vec<f32>,
    out: &mut [f32],
    lora: &LoraStep,
) {
    use rayon::prelude::*;
    let im = down.k;
    resize(gu, t * 2 * im);
    resize(a, t * im);
    gate_up.apply(x, t, gu);
    lora.add(
        LoraLinear::GateUp,
        x,
        gate_up.k,
        &mut gu[..t * 2 * im],
        2 * im,
    );
    a[..t * im]
        .par_chunks_mut(im)
        .zip(gu[..t * 2 * im].par_chunks(2 * im))
        .for_each(|(out, gu)| {
            let (g, u) = gu.split_at(im);
            match act {
                Activation::Silu => vmath::silu_mul(g, u, out),
                Activation::GeluTanh => vmath::gelu_tanh_mul(g, u, out),
            }
        });
    down.apply(&a[..t * im], t, out);
    lora.add(LoraLinear::Down, &a[..t * im], im, out, down.n);
}

/// Output columns per job of a LoRA update's expansion.
const LORA_EXPAND_COLS: usize = 256;

/// The LoRA updates of one layer of a forward step: the adapters, the layer, and each token's
/// adapter id (0: none).
struct LoraStep<'a> {
    adapters: &'a [LoraAdapter],
    layer: usize,
    tok: &'a [u32],
}

impl LoraStep<'_> {
    /// No update (no adapter in the step, or a mixture-of-experts MLP).
    const NONE: LoraStep<'static> = LoraStep {
        adapters: &[],
        layer: 0,
        tok: &[],
    };

    /// `out[i, ..] += ` token `i`'s adapter's update of `kind`, for `x` `[t, k]` and `out`
    /// `[t, n]` (the fused layer's full output). Per adapter in the step, per part: jobs over
    /// A's rows, then over blocks of B's rows, each over the adapter's tokens (so the
    /// adapter is read once per step, not once per token); each value is the sum
    /// [`crate::lora::LoraPart::apply_token`] makes, so a token's bits depend only on its own
    /// row.
    fn add(&self, kind: LoraLinear, x: &[f32], k: usize, out: &mut [f32], n: usize) {
        use rayon::prelude::*;
        if self.tok.iter().all(|&a| a == 0) {
            return;
        }
        let t = self.tok.len();
        let mut ids: Vec<u32> = self.tok.iter().copied().filter(|&a| a != 0).collect();
        ids.sort_unstable();
        ids.dedup();
        for a in ids {
            let adapter = &self.adapters[a as usize - 1];
            let toks: Vec<usize> = (0..t).filter(|&i| self.tok[i] == a).collect();
            let m = toks.len();
            for part in &adapter.layers[self.layer][kind as usize] {
                let r = part.rank;
                // Shrink: a job per rank row of A, over the adapter's tokens (each row read
                // once). `vt` is [r, m].
                let mut vt = vec![0f32; r * m];
                vt.par_chunks_mut(m).enumerate().for_each(|(i, col)| {
                    for (c, &tok) in col.iter_mut().zip(&toks) {
                        *c = part.shrink_row(i, &x[tok * k..(tok + 1) * k]);
                    }
                });
                let mut v = vec![0f32; m * r];
                for (ti, vr) in v.chunks_exact_mut(r).enumerate() {
                    for (i, x) in vr.iter_mut().enumerate() {
                        *x = vt[i * m + ti];
                    }
                }
                // Expand: a job per block of output columns (each row of B read once), then
                // added in place. Every value is `LoraPart::apply_token`'s, whatever the
                // batch or the threads.
                let blocks: Vec<Vec<f32>> = (0..part.n.div_ceil(LORA_EXPAND_COLS))
                    .into_par_iter()
                    .map(|b| {
                        let j0 = b * LORA_EXPAND_COLS;
                        let w = LORA_EXPAND_COLS.min(part.n - j0);
                        let mut e = vec![0f32; m * w];
                        for jj in 0..w {
                            for ti in 0..m {
                                e[ti * w + jj] = part.expand_row(j0 + jj, &v[ti * r..(ti + 1) * r]);
                            }
                        }
                        e
                    })
                    .collect();
                for (b, e) in blocks.iter().enumerate() {
                    let j0 = part.out_offset + b * LORA_EXPAND_COLS;
                    let w = e.len() / m;
                    for (ti, &tok) in toks.iter().enumerate() {
                        let o = &mut out[tok * n + j0..tok * n + j0 + w];
                        for (o, e) in o.iter_mut().zip(&e[ti * w..(ti + 1) * w]) {
                            *o += e;
                        }
                    }
                }
            }
        }
    }
}

impl Moe {
    /// `out[t, hidden]` = the mixture's output for the normalized MLP inputs `x` `[t,
    /// hidden]`, as [`crate::MoeConfig`] describes. Each token's experts, weights and sums
    /// depend on that token alone (the linear layers compute each output element in one
    /// fixed order), so the bits do not depend on the batch.
    fn forward(&self, act: Activation, x: &[f32], t: usize, s: &mut MoeScratch, out: &mut [f32]) {
        let ne = self.experts.len();
        let k = self.top_k;
        let h = self.router.k;
        resize(&mut s.probs, t * ne);
        self.router.apply(x, t, &mut s.probs);
        s.chosen.clear();
        let order = &mut s.order;
        for p in s.probs[..t * ne].chunks_exact_mut(ne) {
            // softmax in f32 (transformers: `F.softmax(router_logits, dim=1, dtype=torch.float)`).
            let m = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for v in p.iter_mut() {
                *v = (*v - m).exp();
                sum += *v;
            }
            p.iter_mut().for_each(|v| *v /= sum);
            // The top k, ties to the lower expert id, in descending order (torch.topk's, whose
            // order the renormalizing sum follows).
            order.clear();
            order.extend(0..ne);
            let by_prob = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
            if k < ne {
                order.select_nth_unstable_by(k, by_prob);
            }
            let top = &mut order[..k];
            top.sort_by(by_prob);
            let norm = if self.norm_topk_prob {
                top.iter().map(|&e| p[e]).sum::<f32>()
            } else {
                1.0
            };
            top.sort_unstable();
            s.chosen.extend(top.iter().map(|&e| (e, p[e] / norm)));
        }
        s.routed.resize_with(ne, Vec::new);
        s.routed.iter_mut().for_each(Vec::clear);
        for (i, c) in s.chosen.iter().enumerate() {
            s.routed[c.0].push((i / k, i % k));
        }
        resize(&mut s.pair_out, t * k * h);
        for (e, (gate_up, down)) in self.experts.iter().enumerate() {
            let m = s.routed[e].len();
            if m == 0 {
                continue;
            }
            resize(&mut s.x, m * h);
            for (j, &(tok, _)) in s.routed[e].iter().enumerate() {
                s.x[j * h..(j + 1) * h].copy_from_slice(&x[tok * h..(tok + 1) * h]);
            }
            resize(&mut s.y, m * h);
            gated_mlp(
                gate_up,
                down,
                act,
                &s.x[..m * h],
                m,
                &mut s.gate_up,
                &mut s.act,
                &mut s.y[..m * h],
                &LoraStep::NONE,
            );
            for (j, &(tok, slot)) in s.routed[e].iter().enumerate() {
                let pair = tok * k + slot;
                s.pair_out[pair * h..(pair + 1) * h].copy_from_slice(&s.y[j * h..(j + 1) * h]);
            }
        }
        // transformers: `final += expert(x) * weight` per expert in ascending id, from zero.
        for i in 0..t {
            let o = &mut out[i * h..(i + 1) * h];
            o.fill(0.0);
            for slot in 0..k {
                let (_, w) = s.chosen[i * k + slot];
                let pair = i * k + slot;
                for (o, y) in o.iter_mut().zip(&s.pair_out[pair * h..(pair + 1) * h]) {
                    *o += y * w;
                }
            }
        }
        if let Some((gate_up, down, gate)) = &self.shared {
            // Qwen2-MoE: `final + sigmoid(shared_expert_gate(x)) * shared_expert(x)`.
            resize(&mut s.shared_gate, t);
            gate.apply(x, t, &mut s.shared_gate);
            resize(&mut s.y, t * h);
            gated_mlp(
                gate_up,
                down,
                act,
                x,
                t,
                &mut s.gate_up,
                &mut s.act,
                &mut s.y[..t * h],
                &LoraStep::NONE,
            );
            for i in 0..t {
                let g = 1.0 / (1.0 + (-s.shared_gate[i]).exp());
                for (o, y) in out[i * h..(i + 1) * h]
                    .iter_mut()
                    .zip(&s.y[i * h..(i + 1) * h])
                {
                    *o += g * y;
                }
            }
        }
    }
}

/// A norm weight as used: `offset + w` in f32 ([`ModelConfig::norm_offset`]; what
/// `Gemma3RMSNorm` computes as `1.0 + weight.float()` before each multiply).
fn norm_weight(t: Tensor, offset: f32) -> Vec<f32> {
    let mut w = t.data;
    if offset != 0.0 {
        w.iter_mut().for_each(|x| *x += offset);
    }
    w
}

impl Layer {
    /// Fuses q/k/v and gate/up (each expert's too), keeping each matrix in its narrowest
    /// exact type; norm weights get `norm_offset` added.
    fn new(l: LayerWeights, cfg: &ModelConfig) -> Self {
        let nw = |t: Tensor| norm_weight(t, cfg.norm_offset);
        let mlp = match (l.moe, &cfg.moe) {
            (Some(m), Some(mc)) => Mlp::Moe(Box::new(Moe {
                router: Linear::concat(vec![m.router]),
                experts: m
                    .experts
                    .into_iter()
                    .map(|[g, u, d]| (Linear::concat(vec![g, u]), Linear::concat(vec![d])))
                    .collect(),
                shared: m.shared.map(|[g, u, d, sg]| {
                    (
                        Linear::concat(vec![g, u]),
                        Linear::concat(vec![d]),
                        Linear::concat(vec![sg]),
                    )
                }),
                top_k: mc.top_k,
                norm_topk_prob: mc.norm_topk_prob,
            })),
            _ => Mlp::Dense {
                gate_up: Linear::concat(vec![l.gate_proj, l.up_proj]),
                down: Linear::concat(vec![l.down_proj]),
            },
        };
        Layer {
            mlp,
            qkv_bias: match (l.q_bias, l.k_bias, l.v_bias) {
                (Some(q), Some(k), Some(v)) => Some([q.data, k.data, v.data].concat()),
                _ => None,
            },
            qk_norm: l.q_norm.zip(l.k_norm).map(|(q, k)| (nw(q), nw(k))),
            qkv: Linear::concat(vec![l.q_proj, l.k_proj, l.v_proj]),
            o: Linear::concat(vec![l.o_proj]),
            input_norm: nw(l.input_layernorm),
            post_norm: nw(l.post_attention_layernorm),
            out_norms: l
                .attn_out_norm
                .zip(l.mlp_out_norm)
                .map(|(a, m)| (nw(a), nw(m))),
        }
    }
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    tmp: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    moe: MoeScratch,
    cos: Vec<f32>,
    sin: Vec<f32>,
    last: Vec<f32>,
    logits: Vec<f32>,
    /// Per token of the batch: (row index, positions attended).
    tok_ctx: Vec<(usize, usize)>,
    /// Per token of the batch: its row's LoRA adapter id (0: none).
    tok_lora: Vec<u32>,
    /// Each mixture-of-experts layer's trace in the last forward pass that returned layer
    /// outputs ([`CpuModel::last_moe_trace`]).
    moe_trace: Vec<MoeTrace>,
}

/// Inputs a forced forward pass takes from another backend: every layer's input (the
/// previous layer's output; [`CpuModel::forward_layers_forced`]) and every sparse layer's MLP
/// input (empty: none; [`CpuModel::forward_layers_forced_moe`]), `[T, hidden]` each.
type Forced<'a> = (&'a [Vec<f32>], &'a [Vec<f32>]);

/// What one mixture-of-experts layer saw and chose in a forward pass that returned layer
/// outputs ([`CpuModel::last_moe_trace`]), for comparing another backend half a layer at a
/// time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeTrace {
    /// `[T, hidden]`: the residual stream entering the MLP block (after the attention half),
    /// as this model computed it.
    pub input: Vec<f32>,
    /// `[T * top_k]`: each token's experts, ascending (as the CUDA worker's `baton_moe_route`
    /// writes them), chosen from the MLP block's actual input (the forced one, if any).
    pub routes: Vec<u32>,
}

/// Attention multiply-adds (`Σ positions x query width` over the step's tokens) below which
/// the attention runs on the calling thread.
const ATTN_PAR_MIN_MACS: usize = 1 << 16;

fn resize(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

fn thread_pool(n: usize) -> Result<rayon::ThreadPool, String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("baton-cpu-{i}"))
        .build()
        .map_err(|e| format!("starting {n} CPU threads: {e}"))
}

/// The CPU model: config, weights (q/k/v and gate/up fused; the embedding and the linear layers
/// kept as bf16 or f16 when every value of the matrix is one, a GGUF file's quantized ones in
/// their ggml blocks, the rest f32; arithmetic in f32) and RoPE tables.
pub struct CpuModel {
    cfg: ModelConfig,
    /// The token embedding; `None` when it is the LM head's matrix (tied embeddings, or equal
    /// values), which then serves both.
    embed: Option<Store>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    /// `[head_dim / 2]` RoPE inverse frequencies and the attention factor of the global
    /// layers, then of the local ones when the config has any ([`ModelConfig::layer_rope`]).
    ropes: Vec<(Vec<f32>, f32)>,
    scratch: Mutex<Scratch>,
    /// The threads a forward pass runs on (one by default; [`CpuModel::set_threads`]).
    pool: rayon::ThreadPool,
    /// LoRA adapters; [`ForwardRow::lora`] `i + 1` is `lora[i]`.
    lora: Vec<LoraAdapter>,
}

impl std::fmt::Debug for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuModel").field("cfg", &self.cfg).finish()
    }
}

/// The config's head layout and sizes are ones the forward pass runs.
fn check_config(cfg: &ModelConfig) -> Result<(), ModelError> {
    let bad = |field: &str, reason: String| ModelError::InvalidField {
        file: "config.json".into(),
        field: field.into(),
        reason,
    };
    let c = cfg;
    if c.hidden_size == 0 || c.vocab_size == 0 || c.intermediate_size == 0 {
        return Err(bad("hidden_size", "sizes must be > 0".into()));
    }
    if c.num_key_value_heads == 0
        || c.num_attention_heads == 0
        || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
    {
        return Err(bad(
            "num_key_value_heads",
            "must be > 0 and divide num_attention_heads".into(),
        ));
    }
    if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
        return Err(bad("head_dim", "must be even and > 0".into()));
    }
    Ok(())
}

/// [`check_config`], then every weight has the shape the config implies.
fn check_shapes(cfg: &ModelConfig, w: &LlamaWeights) -> Result<(), ModelError> {
    check_config(cfg)?;
    let bad = |field: &str, reason: String| ModelError::InvalidField {
        file: "config.json".into(),
        field: field.into(),
        reason,
    };
    let c = cfg;
    let mismatch = |name: &str, t: &Tensor, want: &[usize]| -> Result<(), ModelError> {
        if t.shape != want || t.data.len() != want.iter().product::<usize>() {
            return Err(ModelError::ShapeMismatch {
                file: "<weights>".into(),
                tensor: name.into(),
                expected: want.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(())
    };
    let (v, h) = (c.vocab_size, c.hidden_size);
    mismatch("model.embed_tokens.weight", &w.embed, &[v, h])?;
    mismatch("model.norm.weight", &w.norm, &[h])?;
    mismatch("lm_head.weight", &w.lm_head, &[v, h])?;
    if w.layers.len() != c.num_hidden_layers {
        return Err(bad(
            "num_hidden_layers",
            format!("{} layers of weights given", w.layers.len()),
        ));
    }
    for (i, l) in w.layers.iter().enumerate() {
        let shapes = layer_tensor_shapes(c, i);
        let tensors = l.tensors();
        if tensors.len() != shapes.len() {
            return Err(bad(
                "model_type",
                format!(
                    "layer {i} has {} weight tensors; a {:?} layer has {} ({})",
                    tensors.len(),
                    c.model_type,
                    shapes.len(),
                    shapes
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        for ((name, want), t) in shapes.iter().zip(tensors) {
            mismatch(name, t, want)?;
        }
    }
    Ok(())
}

/// `x += y`, each `[T, hidden]` token of `y` first RMS-normalized with `norm` when given
/// (Gemma 3's norms of the sublayer outputs); `y` is scratch afterwards.
fn add_residual(x: &mut [f32], y: &mut [f32], norm: Option<&[f32]>, eps: f32) {
    if let Some(w) = norm {
        for tok in y.chunks_exact_mut(w.len()) {
            rms_norm_in_place(tok, w, eps);
        }
    }
    for (x, &a) in x.iter_mut().zip(y.iter()) {
        *x += a;
    }
}

/// HF `LlamaRMSNorm`: `x * rsqrt(mean(x²) + eps) * w`, computed in f32 (sum in f64).
#[inline]
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let r = rms_scale(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * r);
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the sum of squares in f64.
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let var = (ss / x.len() as f64) as f32;
    1.0 / (var + eps).sqrt()
}

/// [`rms_norm`] in place (Qwen3's per-head q/k norm).
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let r = rms_scale(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = g * (*v * r);
    }
}

impl CpuModel {
    /// Builds the model; see [`CpuModel::try_new`].
    ///
    /// # Panics
    /// If [`CpuModel::try_new`] fails, i.e. the weights do not have the shapes `cfg` implies
    /// (never the case for [`LlamaWeights::load`] / [`LlamaWeights::dummy`] with the same
    /// config).
    pub fn new(cfg: ModelConfig, w: LlamaWeights) -> Self {
        match Self::try_new(cfg, w) {
            Ok(m) => m,
            Err(e) => panic!("CpuModel::new: {e}"),
        }
    }

    /// Builds the model, fusing q/k/v and gate/up weights, after checking the config's head
    /// layout and every weight's shape.
    ///
    /// RoPE angles are `pos * inv_freq[i]` in f32 as in HF's `LlamaRotaryEmbedding`; cos/sin
    /// are evaluated in f64 and rounded to f32.
    ///
    /// # Errors
    /// [`ModelError::InvalidField`] for an unusable config (zero sizes, heads not divisible by
    /// KV heads, odd head_dim), [`ModelError::ShapeMismatch`] for a weight of the wrong shape
    /// (file `<weights>`).
    pub fn try_new(cfg: ModelConfig, w: LlamaWeights) -> Result<Self, ModelError> {
        check_shapes(&cfg, &w)?;
        let LlamaWeights {
            embed,
            layers,
            norm,
            lm_head,
        } = w;
        // Tied embeddings (LlamaWeights holds two equal copies): one matrix serves both when
        // they are equal bit for bit.
        let tied = embed
            .data
            .iter()
            .map(|v| v.to_bits())
            .eq(lm_head.data.iter().map(|v| v.to_bits()));
        let layers = layers.into_iter().map(|l| Layer::new(l, &cfg)).collect();
        let norm = norm_weight(norm, cfg.norm_offset);
        Self::assemble(
            cfg,
            (!tied).then(|| Store::compact(embed.data)),
            layers,
            norm,
            lm_head,
        )
    }

    /// Builds the model from a checkpoint's mapped tensors one layer at a time, so that host
    /// memory peaks at the built model plus one layer (or the embedding) in f32: a bf16
    /// checkpoint is held at 2 bytes per weight ([`CpuModel`]) and never exists whole as f32
    /// (`LlamaWeights::load` then [`CpuModel::try_new`] peaks at 4 bytes per weight). The
    /// result is the same model, bit for bit. A GGUF file's quantized matrices (the embedding
    /// and LM head too) stay in their blocks (`WeightSource::load_kept`: a Q4_K_M 8B model
    /// holds about 4.9 GB, not 16 GB), each dequantized a column block at a time as a linear
    /// layer runs, to the values `LlamaWeights::load` gives (ggml's, in f32).
    ///
    /// # Errors
    /// As [`LlamaWeights::load`] (missing, misshapen, unused or unsupported tensors, naming
    /// the file and tensor) and [`CpuModel::try_new`] (an unusable config).
    pub fn from_source(cfg: ModelConfig, src: &WeightSource) -> Result<Self, ModelError> {
        check_config(&cfg)?;
        src.check_tensor_names(&cfg)?;
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let lm_head_name = src.lm_head_name(&cfg)?;
        let embed = src.load_kept("model.embed_tokens.weight", &[v, h])?;
        let (embed, lm_head) = if lm_head_name == "lm_head.weight" {
            let embed = Linear::concat(vec![embed]).w;
            (Some(embed), src.load_kept("lm_head.weight", &[v, h])?)
        } else {
            (None, embed)
        };
        // Each layer's f32 tensors are dropped once the layer is built.
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| LayerWeights::load(&cfg, src, i, true).map(|l| Layer::new(l, &cfg)))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = norm_weight(src.load_f32("model.norm.weight", &[h])?, cfg.norm_offset);
        Self::assemble(cfg, embed, layers, norm, lm_head)
    }

    /// The model from built layers; `embed` is `None` when the LM head's matrix serves the
    /// embedding lookup (tied embeddings).
    fn assemble(
        cfg: ModelConfig,
        embed: Option<Store>,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: Tensor,
    ) -> Result<Self, ModelError> {
        Ok(CpuModel {
            embed,
            layers,
            norm,
            lm_head: Linear::concat(vec![lm_head]),
            ropes: {
                let mut r = vec![(cfg.rope_inv_freq(), cfg.rope_attention_factor())];
                if let Some(li) = (0..cfg.num_hidden_layers).find(|&li| cfg.layer_rope_is_local(li))
                {
                    r.push(cfg.layer_rope(li));
                }
                r
            },
            cfg,
            scratch: Mutex::new(Scratch::default()),
            pool: thread_pool(1).map_err(|reason| ModelError::InvalidField {
                file: "<cpu threads>".into(),
                field: "threads".into(),
                reason,
            })?,
            lora: Vec::new(),
        })
    }

    /// Serves `adapters` beside the base weights: [`ForwardRow::lora`] `i + 1` runs with
    /// `adapters[i]` (each linear layer it updates adds `(x·Aᵀ)·(s·B)ᵀ` per token, after the
    /// base layer; see [`crate::lora`]). Replaces the adapters set before.
    ///
    /// # Errors
    /// An adapter loaded for another layer count, or of a rank above
    /// [`crate::lora::MAX_LORA_RANK`].
    pub fn set_lora_adapters(&mut self, adapters: Vec<LoraAdapter>) -> Result<(), ModelError> {
        for a in &adapters {
            if a.layers.len() != self.cfg.num_hidden_layers
                || a.max_rank > crate::lora::MAX_LORA_RANK
            {
                return Err(ModelError::InvalidField {
                    file: a.path.display().to_string(),
                    field: "lora".into(),
                    reason: format!(
                        "adapter of {} layers and rank {} for a model of {} layers",
                        a.layers.len(),
                        a.max_rank,
                        self.cfg.num_hidden_layers
                    ),
                });
            }
        }
        self.lora = adapters;
        Ok(())
    }

    /// The LoRA adapters served ([`CpuModel::set_lora_adapters`]).
    pub fn lora_adapters(&self) -> &[LoraAdapter] {
        &self.lora
    }

    /// Runs forward passes on `n` threads (at least 1): attention is split into (token, KV
    /// head, softmax partition) tasks (`crate::attention`), the linear layers into (row
    /// chunk, column block) tasks (`crate::linear`), the MLP activation over tokens. Every
    /// value is computed by the same operations in the same order whatever `n` is and
    /// whichever thread runs it, so the outputs are bit-identical for every thread count
    /// and batch.
    ///
    /// # Errors
    /// The operating system refused to start the threads.
    pub fn set_threads(&mut self, n: usize) -> Result<(), String> {
        self.pool = thread_pool(n.max(1))?;
        Ok(())
    }

    /// The number of threads a forward pass runs on.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Weights held: the values [`CpuModel::weight_bytes`] counts the bytes of (a tied
    /// embedding once).
    pub fn weight_values(&self) -> usize {
        self.weight_sum(Store::len, 1)
    }

    /// Host bytes the weights take: the embedding and linear layers as stored (2 bytes per
    /// weight for a bf16 or f16 checkpoint, a GGUF file's blocks for its quantized ones, 4
    /// otherwise; see [`CpuModel`]), norms and biases as f32.
    pub fn weight_bytes(&self) -> usize {
        self.weight_sum(Store::bytes, 4)
    }

    /// Runs a GGUF file's quantized matrices with each token's activations quantized to 8
    /// bits (blocks of 32 with an f32 scale) and integer dot products, as llama.cpp's CPU
    /// backend does, instead of f32 activations over ggml's dequantized values: less vector
    /// work per weight for steps of few tokens, each product off by at most what rounding
    /// the activations costs (`crate::linear_q8`). Every other matrix (f32, 16-bit, a
    /// quantized matrix with a float part) is unchanged. Outputs stay the same whatever the
    /// batch and the thread count.
    ///
    /// Returns how many matrices now take 8-bit activations: 0 when `on` is false or the
    /// model has no quantized matrix that the int8 path reads.
    pub fn set_int8_activations(&mut self, on: bool) -> usize {
        let mut n = 0;
        let mut set = |l: &mut Linear| {
            l.int8 = on;
            n += usize::from(on && l.w.int8_reads());
        };
        set(&mut self.lm_head);
        for l in &mut self.layers {
            set(&mut l.qkv);
            set(&mut l.o);
            match &mut l.mlp {
                Mlp::Dense { gate_up, down } => {
                    set(gate_up);
                    set(down);
                }
                Mlp::Moe(m) => {
                    set(&mut m.router);
                    for (gu, d) in &mut m.experts {
                        set(gu);
                        set(d);
                    }
                    if let Some((gu, d, g)) = &mut m.shared {
                        set(gu);
                        set(d);
                        set(g);
                    }
                }
            }
        }
        n
    }

    /// `store` summed over the embedding and every linear layer's matrix, plus
    /// `per_f32` times the values of the norms and biases (held as f32).
    fn weight_sum(&self, store: impl Fn(&Store) -> usize, per_f32: usize) -> usize {
        let linear = |l: &Linear| store(&l.w);
        let f32s = |v: &[f32]| per_f32 * v.len();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let mlp = match &l.mlp {
                    Mlp::Dense { gate_up, down } => linear(gate_up) + linear(down),
                    Mlp::Moe(m) => {
                        linear(&m.router)
                            + m.experts
                                .iter()
                                .map(|(gu, d)| linear(gu) + linear(d))
                                .sum::<usize>()
                            + m.shared
                                .as_ref()
                                .map_or(0, |(gu, d, g)| linear(gu) + linear(d) + linear(g))
                    }
                };
                linear(&l.qkv)
                    + linear(&l.o)
                    + mlp
                    + f32s(&l.input_norm)
                    + f32s(&l.post_norm)
                    + l.out_norms.as_ref().map_or(0, |(a, m)| f32s(a) + f32s(m))
                    + l.qkv_bias.as_deref().map_or(0, f32s)
                    + l.qk_norm.as_ref().map_or(0, |(q, k)| f32s(q) + f32s(k))
            })
            .sum();
        self.embed.as_ref().map_or(0, &store) + layers + f32s(&self.norm) + linear(&self.lm_head)
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn validate(&self, kv: &PagedKvCache, rows: &[ForwardRow]) -> Result<(), ForwardError> {
        let c = &self.cfg;
        let model = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim);
        let cache = (kv.num_layers, kv.kv_heads, kv.head_dim);
        if model != cache {
            return Err(ForwardError::CacheMismatch { cache, model });
        }
        for (r, row) in rows.iter().enumerate() {
            if row.tokens.is_empty() {
                return Err(ForwardError::EmptyRow { row: r });
            }
            if row.lora as usize > self.lora.len() {
                return Err(ForwardError::UnknownLora {
                    row: r,
                    lora: row.lora,
                    loaded: self.lora.len(),
                });
            }
            if let Some((index, &token)) = row
                .tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= c.vocab_size)
            {
                return Err(ForwardError::TokenOutOfRange {
                    row: r,
                    index,
                    token,
                    vocab_size: c.vocab_size,
                });
            }
            let end = row.start_pos.saturating_add(row.tokens.len());
            if end > c.max_position_embeddings {
                return Err(ForwardError::PositionOutOfRange {
                    row: r,
                    end,
                    max: c.max_position_embeddings,
                });
            }
            let needed = end.div_ceil(kv.block_size);
            if row.block_table.len() < needed {
                return Err(ForwardError::BlockTableTooShort {
                    row: r,
                    len: row.block_table.len(),
                    needed,
                    end,
                });
            }
            if let Some((index, &page)) = row.block_table[..needed]
                .iter()
                .enumerate()
                .find(|(_, &p)| p as usize >= kv.num_blocks)
            {
                return Err(ForwardError::PageOutOfRange {
                    row: r,
                    index,
                    page,
                    num_blocks: kv.num_blocks,
                });
            }
        }
        Ok(())
    }

    /// Runs one batched forward step.
    ///
    /// Rows may mix prefill chunks of any length and single-token decodes. Row `r`'s tokens
    /// occupy positions `start_pos..start_pos + len`; their K/V are written into the pages its
    /// block table gives (position `p` -> page `block_table[p / block_size]`, slot
    /// `p % block_size`) and attention reads positions `0..start_pos + len` from those pages
    /// (earlier positions were written by earlier calls). All rows' tokens go through the
    /// linear layers together as one `[T, hidden]` matrix.
    ///
    /// Returns one logits vector (`vocab_size` f32) per row with `want_logits`, for the row's
    /// last token, and one per position (in position order) for a row with `all_logits`, in
    /// row order. Rows must not share pages they write.
    ///
    /// # Errors
    /// [`ForwardError`] for an empty row, a token `>= vocab_size`, positions beyond
    /// `max_position_embeddings`, a block table too short or naming a page `>= num_blocks`, or
    /// a cache of another model's shape. Nothing is written when an error is returned.
    pub fn forward(
        &self,
        kv: &mut PagedKvCache,
        rows: &[ForwardRow],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_impl(kv, rows, None)
    }

    /// As [`CpuModel::forward`], also returning the residual stream after every decoder layer:
    /// element `l` is `[T, hidden]` row-major for all tokens of all rows in batch order (for
    /// comparing another backend layer by layer).
    ///
    /// # Errors
    /// As [`CpuModel::forward`].
    pub fn forward_with_layer_outputs(
        &self,
        kv: &mut PagedKvCache,
        rows: &[ForwardRow],
    ) -> Result<LogitsAndLayers, ForwardError> {
        let mut outs = Vec::with_capacity(self.cfg.num_hidden_layers);
        let logits = self.forward_impl(kv, rows, Some(&mut outs))?;
        Ok((logits, outs))
    }

    /// Each mixture-of-experts layer's [`MoeTrace`] (in layer order) of the last
    /// [`CpuModel::forward_with_layer_outputs`], [`CpuModel::forward_layers_forced`] or
    /// [`CpuModel::forward_layers_forced_moe`] call. Empty for a dense model or before such a
    /// call.
    pub fn last_moe_trace(&self) -> Vec<MoeTrace> {
        self.scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .moe_trace
            .clone()
    }

    /// As [`CpuModel::forward_with_layer_outputs`], but layer `l > 0` (and the final norm and
    /// LM head, after the last layer) starts from `inputs[l - 1]` instead of this model's own
    /// residual stream: `inputs` are another backend's layer outputs, `[T, hidden]` each, as
    /// `forward_with_layer_outputs` returns them. Layer 0 starts from the embedding. So each
    /// returned layer output is what this model computes from the other backend's input to
    /// that layer: the difference measures one layer's error, not the drift accumulated over
    /// the layers before it. The KV cache gets the keys and values of those forced inputs.
    ///
    /// # Errors
    /// As [`CpuModel::forward`], and [`ForwardError::ForcedInputs`] when `inputs` is not one
    /// `[T, hidden]` buffer per layer.
    pub fn forward_layers_forced(
        &self,
        kv: &mut PagedKvCache,
        rows: &[ForwardRow],
        inputs: &[Vec<f32>],
    ) -> Result<LogitsAndLayers, ForwardError> {
        self.forward_layers_forced_moe(kv, rows, inputs, &[])
    }

    /// As [`CpuModel::forward_layers_forced`], and the MLP block of the `j`-th
    /// mixture-of-experts layer also starts from `moe_inputs[j]` (`[T, hidden]`: another
    /// backend's residual stream after that layer's attention half) instead of this model's
    /// own. A router turns a small difference in its input into a different expert or a
    /// different weight, so a layer's error is only the MLP kernels' own when both halves
    /// start from the other backend's values; [`CpuModel::last_moe_trace`] keeps this
    /// model's own attention-half output for comparing that half. Empty `moe_inputs`: as
    /// `forward_layers_forced`.
    ///
    /// # Errors
    /// As [`CpuModel::forward_layers_forced`], and [`ForwardError::ForcedInputs`] when
    /// `moe_inputs` is neither empty nor one `[T, hidden]` buffer per sparse layer.
    pub fn forward_layers_forced_moe(
        &self,
        kv: &mut PagedKvCache,
        rows: &[ForwardRow],
        inputs: &[Vec<f32>],
        moe_inputs: &[Vec<f32>],
    ) -> Result<LogitsAndLayers, ForwardError> {
        let t: usize = rows.iter().map(|r| r.tokens.len()).sum();
        let h = self.cfg.hidden_size;
        let sparse = self
            .layers
            .iter()
            .filter(|l| matches!(l.mlp, Mlp::Moe(_)))
            .count();
        let bad = |v: &[Vec<f32>], n: usize| v.len() != n || v.iter().any(|x| x.len() != t * h);
        if bad(inputs, self.cfg.num_hidden_layers) {
            return Err(ForwardError::ForcedInputs {
                layers: self.cfg.num_hidden_layers,
                values: t * h,
            });
        }
        if !moe_inputs.is_empty() && bad(moe_inputs, sparse) {
            return Err(ForwardError::ForcedInputs {
                layers: sparse,
                values: t * h,
            });
        }
        let mut outs = Vec::with_capacity(self.cfg.num_hidden_layers);
        self.validate(kv, rows)?;
        let logits = self.pool.install(|| {
            self.forward_in_pool(kv, rows, Some(&mut outs), Some((inputs, moe_inputs)))
        })?;
        Ok((logits, outs))
    }

    fn forward_impl(
        &self,
        kv: &mut PagedKvCache,
        rows: &[ForwardRow],
        layer_outs: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.validate(kv, rows)?;
        self.pool
            .install(|| self.forward_in_pool(kv, rows, layer_outs, None))
    }

    /// The forward pass proper, run inside `self.pool`. `forced`: see [`Forced`].
    fn forward_in_pool(
        &self,
        kv: &mut PagedKvCache,
        rows: &[ForwardRow],
        mut layer_outs: Option<&mut Vec<Vec<f32>>>,
        forced: Option<Forced<'_>>,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let nh = c.num_attention_heads;
        let kvh = c.num_key_value_heads;
        let hd = c.head_dim;
        let half = hd / 2;
        let q_w = nh * hd;
        let kv_w = kvh * hd;
        let qkv_w = q_w + 2 * kv_w;
        let eps = c.rms_norm_eps;
        // HF: `scaling = head_dim**-0.5` (Gemma 3: `query_pre_attn_scalar**-0.5`; a Python
        // float), applied to the f32 scores.
        let scale = c.attention_scale();
        let t: usize = rows.iter().map(|r| r.tokens.len()).sum();

        let mut guard = self
            .scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let s = &mut *guard;
        if layer_outs.is_some() {
            s.moe_trace.clear();
        }
        let (forced, forced_moe) = match forced {
            Some((layers, moe)) => (Some(layers), moe),
            None => (None, &[][..]),
        };
        resize(&mut s.x, t * h);
        resize(&mut s.xn, t * h);
        resize(&mut s.qkv, t * qkv_w);
        resize(&mut s.attn, t * q_w);
        resize(&mut s.tmp, t * h);
        let n_ropes = self.ropes.len();
        resize(&mut s.cos, n_ropes * t * half);
        resize(&mut s.sin, n_ropes * t * half);
        // Per token: its row and the number of positions it attends to.
        s.tok_ctx.clear();
        s.tok_lora.clear();
        for (r, row) in rows.iter().enumerate() {
            s.tok_ctx
                .extend((0..row.tokens.len()).map(|j| (r, row.start_pos + j + 1)));
            s.tok_lora
                .extend(std::iter::repeat_n(row.lora, row.tokens.len()));
        }
        let attn_macs: usize = s.tok_ctx.iter().map(|&(_, n_ctx)| n_ctx * q_w).sum();
        // Forking costs a few µs: a small step's attention runs on this thread (same bits).
        let parallel_attention = attn_macs >= ATTN_PAR_MIN_MACS;

        // RoPE cos/sin per token (HF: freqs = inv_freq * position in f32), times YaRN's
        // attention factor (HF's `attention_scaling`; 1 otherwise).
        // With partial RoPE only the rotated pairs are scaled (`rotary_dim`: the pairs past
        // it have frequency 0 and stay as they are).
        // Gemma 3's local layers have their own table, after the global one.
        let rotated = c.rotary_dim / 2;
        for (ri, (inv_freq, att)) in self.ropes.iter().enumerate() {
            let mut i = ri * t;
            for row in rows {
                for j in 0..row.tokens.len() {
                    let pos = (row.start_pos + j) as f32;
                    for (d, &f) in inv_freq.iter().enumerate() {
                        let a = (pos * f) as f64;
                        let att = if d < rotated { *att } else { 1.0 };
                        s.cos[i * half + d] = a.cos() as f32 * att;
                        s.sin[i * half + d] = a.sin() as f32 * att;
                    }
                    i += 1;
                }
            }
        }

        // Embedding.
        let mut i = 0;
        for row in rows {
            for &tok in row.tokens {
                let e = tok as usize * h;
                let table = self.embed.as_ref().unwrap_or(&self.lm_head.w);
                let x = &mut s.x[i * h..(i + 1) * h];
                table.read(e, x);
                // Gemma 3: times sqrt(hidden_size) in the checkpoint's dtype.
                if let Some(k) = c.embed_scale {
                    x.iter_mut().for_each(|v| *v *= k);
                }
                i += 1;
            }
        }

        for (li, layer) in self.layers.iter().enumerate() {
            if let (Some(f), Some(prev)) = (forced, li.checked_sub(1)) {
                s.x[..t * h].copy_from_slice(&f[prev]);
            }
            // Attention block.
            for i in 0..t {
                rms_norm(
                    &s.x[i * h..(i + 1) * h],
                    &layer.input_norm,
                    eps,
                    &mut s.xn[i * h..(i + 1) * h],
                );
            }
            let lora = LoraStep {
                adapters: &self.lora,
                layer: li,
                tok: &s.tok_lora,
            };
            layer.qkv.apply(&s.xn, t, &mut s.qkv);
            lora.add(LoraLinear::Qkv, &s.xn, h, &mut s.qkv, qkv_w);
            if let Some(b) = &layer.qkv_bias {
                for tok in s.qkv[..t * qkv_w].chunks_exact_mut(qkv_w) {
                    tok.iter_mut().zip(b).for_each(|(x, &bb)| *x += bb);
                }
            }

            // Qwen3, Gemma 3: RMSNorm of each q and k head (before RoPE); then RoPE on q and k
            // (HF rotate_half: pairs (j, j + hd/2)), then store k and v.
            let rope_off = if c.layer_rope_is_local(li) {
                t * half
            } else {
                0
            };
            let mut i = 0;
            for row in rows {
                for (j, _) in row.tokens.iter().enumerate() {
                    let pos = row.start_pos + j;
                    let cs = &s.cos[rope_off + i * half..rope_off + (i + 1) * half];
                    let sn = &s.sin[rope_off + i * half..rope_off + (i + 1) * half];
                    let tok = &mut s.qkv[i * qkv_w..(i + 1) * qkv_w];
                    if let Some((qn, kn)) = &layer.qk_norm {
                        for (hi, head) in tok[..q_w + kv_w].chunks_exact_mut(hd).enumerate() {
                            rms_norm_in_place(head, if hi < nh { qn } else { kn }, eps);
                        }
                    }
                    for head in tok[..q_w + kv_w].chunks_exact_mut(hd) {
                        let (a, b) = head.split_at_mut(half);
                        for d in 0..half {
                            let (x1, x2) = (a[d], b[d]);
                            a[d] = x1 * cs[d] - x2 * sn[d];
                            b[d] = x2 * cs[d] + x1 * sn[d];
                        }
                    }
                    let page = row.block_table[pos / kv.block_size] as usize;
                    let o = kv.offset(li, page, pos % kv.block_size);
                    kv.store(o, &tok[q_w..q_w + kv_w], &tok[q_w + kv_w..]);
                    i += 1;
                }
            }

            // Causal GQA attention (`crate::attention`): a job per (token or tile of a
            // prefill chunk's tokens, KV head), a token's softmax partitions split over the
            // threads too when the step has few jobs (a small decode batch); bits independent
            // of the batch, the tiles and the threads.
            let step = AttentionStep {
                rows,
                qkv: &s.qkv,
                tok_ctx: &s.tok_ctx,
                layer_off: kv.offset(li, 0, 0),
                block_size: kv.block_size,
                q_heads: nh,
                kv_heads: kvh,
                head_dim: hd,
                scale,
                window: c.sliding_window[li],
                parallel: parallel_attention,
            };
            let attn = &mut s.attn[..t * q_w];
            match &kv.data {
                KvData::F32(k, v) => step.run(k, v, attn),
                KvData::Bf16(k, v) => step.run(k, v, attn),
                KvData::F16(k, v) => step.run(k, v, attn),
            }
            layer.o.apply(&s.attn, t, &mut s.tmp);
            lora.add(LoraLinear::O, &s.attn, q_w, &mut s.tmp, h);
            add_residual(
                &mut s.x[..t * h],
                &mut s.tmp[..t * h],
                layer.out_norms.as_ref().map(|n| &n.0[..]),
                eps,
            );

            // MLP block: down(silu(gate(x)) * up(x)).
            if matches!(layer.mlp, Mlp::Moe(_)) && layer_outs.is_some() {
                let j = s.moe_trace.len();
                s.moe_trace.push(MoeTrace {
                    input: s.x[..t * h].to_vec(),
                    routes: Vec::new(),
                });
                if let Some(f) = forced_moe.get(j) {
                    s.x[..t * h].copy_from_slice(f);
                }
            }
            for i in 0..t {
                rms_norm(
                    &s.x[i * h..(i + 1) * h],
                    &layer.post_norm,
                    eps,
                    &mut s.xn[i * h..(i + 1) * h],
                );
            }
            match &layer.mlp {
                Mlp::Dense { gate_up, down } => gated_mlp(
                    gate_up,
                    down,
                    c.hidden_act,
                    &s.xn[..t * h],
                    t,
                    &mut s.gate_up,
                    &mut s.act,
                    &mut s.tmp[..t * h],
                    &lora,
                ),
                Mlp::Moe(m) => {
                    m.forward(
                        c.hidden_act,
                        &s.xn[..t * h],
                        t,
                        &mut s.moe,
                        &mut s.tmp[..t * h],
                    );
                    if let Some(tr) = s.moe_trace.last_mut().filter(|_| layer_outs.is_some()) {
                        tr.routes = s.moe.chosen.iter().map(|&(e, _)| e as u32).collect();
                    }
                }
            }
            add_residual(
                &mut s.x[..t * h],
                &mut s.tmp[..t * h],
                layer.out_norms.as_ref().map(|n| &n.1[..]),
                eps,
            );
            if let Some(outs) = layer_outs.as_mut() {
                outs.push(s.x[..t * h].to_vec());
            }
        }
        if let Some(last) = forced.and_then(|f| f.last()) {
            s.x[..t * h].copy_from_slice(last);
        }

        // Final norm + LM head for the last token of each row that wants logits (every token
        // of a row with `all_logits`).
        let mut sel = 0;
        let mut end = 0;
        let wanted: usize = rows
            .iter()
            .map(|r| match (r.all_logits, r.want_logits) {
                (true, _) => r.tokens.len(),
                (false, w) => usize::from(w),
            })
            .sum();
        resize(&mut s.last, wanted * h);
        for row in rows {
            let start = end;
            end += row.tokens.len();
            let picked = if row.all_logits {
                start..end
            } else if row.want_logits {
                end - 1..end
            } else {
                end..end
            };
            for i in picked {
                rms_norm(
                    &s.x[i * h..(i + 1) * h],
                    &self.norm,
                    eps,
                    &mut s.last[sel * h..(sel + 1) * h],
                );
                sel += 1;
            }
        }
        let v = c.vocab_size;
        resize(&mut s.logits, sel * v);
        self.lm_head.apply(&s.last, sel, &mut s.logits);
        Ok(s.logits[..sel * v]
            .chunks_exact(v)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched LoRA update gives each token exactly `LoraPart::apply_token`'s values,
    /// with several adapters, base tokens and parts at offsets in one step, on 1 and 3
    /// threads.
    #[test]
    fn lora_step_matches_the_per_token_reference_bit_for_bit() {
        use crate::lora::{dummy_lora_values, LoraPart};
        let (k, n) = (37, 600);
        let part = |seed: u64, off: usize, w: usize, rank: usize| {
            let (a, b) = dummy_lora_values(seed, 0, "m", rank, k, w, 0.5);
            LoraPart {
                out_offset: off,
                rank,
                k,
                n: w,
                a,
                b,
            }
        };
        let adapter = |seed: u64, parts: Vec<LoraPart>| LoraAdapter {
            name: format!("a{seed}"),
            path: "x".into(),
            max_rank: parts.iter().map(|p| p.rank).max().unwrap_or(0),
            layers: vec![[parts, Vec::new(), Vec::new(), Vec::new()]],
        };
        let adapters = vec![
            adapter(1, vec![part(1, 0, 300, 5), part(2, 300, 300, 3)]),
            adapter(2, vec![part(3, 10, 513, 16)]),
        ];
        let tok = [2u32, 0, 1, 2, 1, 1, 0];
        let t = tok.len();
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let base: Vec<f32> = (0..t * n)
            .map(|i| ((i * 104_729) % 97) as f32 / 40.0)
            .collect();
        let mut want = base.clone();
        for (i, &a) in tok.iter().enumerate() {
            if a == 0 {
                continue;
            }
            let mut v = vec![0f32; 16];
            for p in &adapters[a as usize - 1].layers[0][0] {
                p.apply_token(
                    &x[i * k..(i + 1) * k],
                    &mut want[i * n..(i + 1) * n],
                    &mut v,
                );
            }
        }
        for threads in [1, 3] {
            let pool = thread_pool(threads).unwrap();
            let mut got = base.clone();
            pool.install(|| {
                LoraStep {
                    adapters: &adapters,
                    layer: 0,
                    tok: &tok,
                }
                .add(LoraLinear::Qkv, &x, k, &mut got, n)
            });
            assert_eq!(got, want, "{threads} threads");
        }
        assert_ne!(want, base);
    }

    /// A context spanning several softmax partitions gives the same bits whatever the batch
    /// around it, the prefill chunking, the block size, the page ids and the thread count
    /// (the attention tasks split by partition and run in parallel only for large steps: a
    /// decode step alone here runs on the calling thread, beside a filler chunk in parallel),
    /// over f32, bf16 and f16 caches. The 16-bit caches give other bits than f32's, within
    /// a small distance of them.
    #[test]
    fn long_contexts_are_batch_invariant_across_partitions() {
        let [f32_ref, bf16_ref, f16_ref] =
            [DType::F32, DType::BF16, DType::F16].map(long_context_reference);
        let max_diff = |a: &[Vec<f32>], b: &[Vec<f32>]| {
            a.iter()
                .flatten()
                .zip(b.iter().flatten())
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max)
        };
        let scale = f32_ref.iter().flatten().fold(0.0f32, |a, x| a.max(x.abs()));
        for (name, other) in [("bf16", &bf16_ref), ("f16", &f16_ref)] {
            let d = max_diff(&f32_ref, other);
            assert!(
                d > 0.0 && d < 0.05 * scale,
                "{name}: {d} (logits up to {scale})"
            );
        }
    }

    /// [`long_contexts_are_batch_invariant_across_partitions`] over a `dtype` cache: asserts
    /// the invariance, returns the reference logits (the last prompt position's, then each
    /// decode step's).
    fn long_context_reference(dtype: DType) -> Vec<Vec<f32>> {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,
            "intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":8,"vocab_size":300,
            "max_position_embeddings":2048}"#,
        )
        .unwrap();
        let mut model = CpuModel::try_new(cfg.clone(), LlamaWeights::dummy(&cfg, 7)).unwrap();
        let prompt: Vec<u32> = (0..700u32).map(|i| (i * 37 + 11) % 300).collect();
        let filler: Vec<u32> = (0..620u32).map(|i| (i * 53 + 2) % 300).collect();
        let steps = [5u32, 77, 123];
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        // Alone, one thread, block size 16, the prompt in one row: the last prompt logits,
        // then each decode step's.
        let alone = |model: &CpuModel| {
            let mut kv = PagedKvCache::try_with_dtype(&cfg, 64, 16, dtype).unwrap();
            let table: Vec<u32> = (0..64).collect();
            let row = |tokens, start_pos| ForwardRow {
                tokens,
                start_pos,
                block_table: &table,
                want_logits: true,
                all_logits: false,
                lora: 0,
            };
            let mut out = vec![bits(
                &model.forward(&mut kv, &[row(&prompt, 0)]).unwrap()[0],
            )];
            for (i, tok) in steps.iter().enumerate() {
                let l = model.forward(&mut kv, &[row(std::slice::from_ref(tok), 700 + i)]);
                out.push(bits(&l.unwrap()[0]));
            }
            out
        };
        model.set_threads(1).unwrap();
        let reference = alone(&model);
        // Beside a filler, three threads, block size 7, pages in reverse order, the prompt in
        // chunks of 250, 250 and 200.
        model.set_threads(3).unwrap();
        let mut kv = PagedKvCache::try_with_dtype(&cfg, 200, 7, dtype).unwrap();
        assert_eq!(kv.dtype(), dtype);
        let table: Vec<u32> = (0..110).rev().collect();
        let ftable: Vec<u32> = (110..200).collect();
        let mut got = Vec::new();
        let mut pos = 0;
        for (chunk, (f0, f1)) in [250, 250, 200]
            .into_iter()
            .zip([(0, 250), (250, 400), (400, 500)])
        {
            let rows = [
                ForwardRow {
                    tokens: &filler[f0..f1],
                    start_pos: f0,
                    block_table: &ftable,
                    want_logits: false,
                    all_logits: false,
                    lora: 0,
                },
                ForwardRow {
                    tokens: &prompt[pos..pos + chunk],
                    start_pos: pos,
                    block_table: &table,
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                },
            ];
            let l = model.forward(&mut kv, &rows).unwrap();
            pos += chunk;
            if pos == 700 {
                got.push(bits(&l[0]));
            }
        }
        for (i, tok) in steps.iter().enumerate() {
            let rows = [
                ForwardRow {
                    tokens: std::slice::from_ref(tok),
                    start_pos: 700 + i,
                    block_table: &table,
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                },
                ForwardRow {
                    tokens: &filler[500 + 40 * i..540 + 40 * i],
                    start_pos: 500 + 40 * i,
                    block_table: &ftable,
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                },
            ];
            got.push(bits(&model.forward(&mut kv, &rows).unwrap()[0]));
        }
        assert!(
            got == reference,
            "{dtype:?}: a long context's logits changed with the batch"
        );
        // And on three threads alone (parallel partitions of one token).
        assert!(alone(&model) == reference, "{dtype:?}");
        reference
            .iter()
            .map(|b| b.iter().map(|&x| f32::from_bits(x)).collect())
            .collect()
    }

    /// Tied embeddings are held once (the LM head's matrix serves the embedding lookup) and
    /// give the logits of the same matrix held twice; different matrices are both held.
    #[test]
    fn tied_embeddings_are_held_once() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":32,
            "intermediate_size":48,"num_hidden_layers":1,"num_attention_heads":4,
            "vocab_size":200,"max_position_embeddings":64,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let w = LlamaWeights::dummy(&cfg, 3);
        let tied = CpuModel::try_new(cfg.clone(), w.clone()).unwrap();
        assert!(tied.embed.is_none());
        let mut held_twice = CpuModel::try_new(cfg.clone(), w.clone()).unwrap();
        held_twice.embed = Some(held_twice.lm_head.w.clone());
        let logits = |m: &CpuModel| {
            let mut kv = PagedKvCache::new(&cfg, 4, 16);
            let table = [0u32, 1];
            let row = ForwardRow {
                tokens: &[5, 17, 199, 0],
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                all_logits: false,
                lora: 0,
            };
            m.forward(&mut kv, &[row]).unwrap()
        };
        let bits = |v: Vec<Vec<f32>>| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(logits(&tied)), bits(logits(&held_twice)));
        let mut other = w;
        other.lm_head.data[0] += 1.0;
        let separate = CpuModel::try_new(cfg.clone(), other).unwrap();
        assert!(separate.embed.is_some());
        assert_eq!(
            separate.weight_bytes(),
            tied.weight_bytes() + 200 * 32 * 4,
            "a second [vocab, hidden] f32 matrix"
        );
        assert_ne!(bits(logits(&separate)), bits(logits(&tied)));
    }
}
