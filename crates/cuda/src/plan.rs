//! Host-side launch planning: flatten a launch's rows into the arrays the kernels take, and pick
//! the CUDA-graph bucket a decode batch is padded to.

/// Largest batch the default graph buckets cover (vLLM's default capture limit).
pub const DEFAULT_MAX_GRAPH_BATCH: usize = 512;

/// vLLM-style CUDA-graph batch sizes: 1, 2, 4, then every multiple of 8 up to the first one
/// `>= min(max_batch, 512)`, so every batch `1..=min(max_batch, 512)` has a bucket.
/// Ascending, no duplicates; empty when `max_batch == 0`.
pub fn default_graph_buckets(max_batch: usize) -> Vec<usize> {
    let cap = max_batch.min(DEFAULT_MAX_GRAPH_BATCH);
    let mut out = Vec::new();
    if cap == 0 {
        return out;
    }
    let mut b = 1;
    loop {
        out.push(b);
        if b >= cap {
            return out;
        }
        b = if b < 8 { b * 2 } else { b + 8 };
    }
}

/// The smallest bucket `>= batch` (the captured graph to replay, padding the batch up to it), or
/// `None` when `batch` is 0 or larger than every bucket (run eagerly). `buckets` must be sorted
/// ascending (as [`default_graph_buckets`] returns them).
pub fn graph_bucket(batch: usize, buckets: &[usize]) -> Option<usize> {
    debug_assert!(
        buckets.windows(2).all(|w| w[0] < w[1]),
        "buckets must ascend"
    );
    if batch == 0 {
        return None;
    }
    let i = buckets.partition_point(|&b| b < batch);
    buckets.get(i).copied()
}

/// Thread blocks a decode attention launch aims for: about four per SM of an H100 or H200 (132
/// SMs), so that the split-K partitions of a small batch keep enough loads in flight (a batch
/// of one sequence with 8 kv heads is otherwise 8 blocks, each walking its whole context).
pub const ATTN_TARGET_BLOCKS: usize = 512;

/// Context length per partition above which [`decode_partitions`] splits further, whatever the
/// batch: one long sequence among short ones should not be walked by one block per kv head.
pub const ATTN_LONG_PARTITION: usize = 16384;

/// Most partitions per sequence of a decode attention launch.
pub const ATTN_MAX_PARTITIONS: usize = 64;

/// Environment variable overriding [`ATTN_TARGET_BLOCKS`] (an integer in 1..=4096): a tuning
/// knob for A/B runs on a GPU (`scripts/gpu-ab.sh`), read by [`Tuning::from_env`].
pub const ATTN_TARGET_BLOCKS_ENV: &str = "BATON_ATTN_TARGET_BLOCKS";

/// Fewest keys in a split-K partition of decode attention (the `min_part` argument of
/// attention.cu's decode kernels): a sequence of at most this many keys is walked by one
/// block per kv head with no combine, a longer one is split into partitions of at least this
/// many. Partition sizes are multiples of 64 keys (the kernel's `BATON_ATTN_PART_ALIGN`).
pub const ATTN_MIN_PARTITION: usize = 64;

/// Environment variable overriding [`ATTN_MIN_PARTITION`] (a multiple of 64 in 64..=16384): a
/// tuning knob for A/B runs, read by [`Tuning::from_env`].
pub const ATTN_MIN_PARTITION_ENV: &str = "BATON_ATTN_MIN_PARTITION";

/// Thread blocks per SM that a batch-of-one decode GEMV's grid aims for
/// ([`gemv_rows_per_block`]): one wave of two, what `__launch_bounds__(256, 2)` allows.
pub const GEMV1_BLOCKS_PER_SM: usize = 2;

/// Environment variable overriding [`GEMV1_BLOCKS_PER_SM`] (1 or 2): a tuning knob for A/B
/// runs, read by [`Tuning::from_env`]. Two blocks of 256 threads at 128 registers fill an
/// SM's register file, so the next kernel's blocks cannot become resident (and issue their
/// weight loads before their PDL wait) until these exit; one block per SM leaves room for
/// them, with half the loads in flight.
pub const GEMV1_BLOCKS_PER_SM_ENV: &str = "BATON_GEMV1_BLOCKS_PER_SM";

/// Environment variable turning on the persistent decode kernel (`1`; `0` or unset: off): a
/// batch-of-one decode step runs every layer in one cooperative launch
/// (`baton_decode_layers_hdD`, kernels/attention.cu) instead of five launches per layer. Off by
/// default until a GPU A/B run (`scripts/gpu-ab.sh`, variant `persistent`) shows it faster.
pub const PERSISTENT_DECODE_ENV: &str = "BATON_PERSISTENT_DECODE";

/// Environment variable choosing the batch-of-one GEMV entries that stream their weights
/// through a shared-memory ring (`1`: `baton_gemv_t1_async` / `baton_gemv_silu_t1_async`,
/// kernels/gemv.cuh, 64 registers, so the next kernel's blocks fit beside them; `0` or unset:
/// the register-buffered `baton_gemv_t1` / `baton_gemv_silu_t1`). Bit-identical outputs; off
/// by default until a GPU A/B run (`scripts/gpu-ab.sh`, variant `gemv-async`) shows it faster.
pub const GEMV_ASYNC_ENV: &str = "BATON_GEMV_ASYNC";

/// Bytes of the activation row buffer of the `_async` GEMV entries
/// (`BATON_GEMV_ASYNC_XS_BYTES`, kernels/gemv.cuh): they take rows of up to this many bytes
/// (4096 16-bit elements); the worker launches the register-buffered entries for longer ones.
pub const GEMV_ASYNC_XS_BYTES: usize = 8192;

/// Thread blocks per SM of the persistent decode kernel's grid at most: its
/// `__launch_bounds__(128, 3)` (168 registers, no spills in its GEMV phases at 4 weight vectors
/// per lane in flight; at 4 blocks, 128 registers, they spilled).
pub const DECODE_LAYERS_BLOCKS_PER_SM: usize = 3;

/// Environment variable lowering the persistent decode kernel's blocks per SM below the
/// driver's occupancy (1 to [`DECODE_LAYERS_BLOCKS_PER_SM`]): a tuning knob for A/B runs, read
/// by [`Tuning::from_env`]. Fewer blocks make each grid barrier cheaper (fewer arrivals on
/// its counter) and give each block more rows per GEMV phase; more blocks keep more weight
/// loads in flight.
pub const DECODE_LAYERS_BLOCKS_PER_SM_ENV: &str = "BATON_PERSISTENT_BLOCKS_PER_SM";

/// Threads per block of the persistent decode kernel (decode attention's 4 warps).
pub const DECODE_LAYERS_BLOCK: u32 = 128;

/// Elements of the activation row the persistent decode kernel can stage for a GEMV phase:
/// the bytes of decode attention's K/V tile in shared memory (`BatonDecodeShared<D>::kv`,
/// kernels/attention.cu: 2 x TK keys x (D / VEC + 1) 16-byte vectors, TK = min(16384 / (D x
/// elem bytes), 128)) over `elem_bytes`. A model whose hidden size, q width (heads x head_dim)
/// or intermediate size exceeds this cannot take the persistent path (the kernel skips such a
/// phase's work).
pub fn decode_layers_stage_elems(head_dim: usize, elem_bytes: usize) -> usize {
    let tk = (16384 / (head_dim * elem_bytes)).min(128);
    let svr = head_dim * elem_bytes / 16 + 1;
    2 * tk * svr * 16 / elem_bytes
}

/// Blocks of the persistent decode kernel's cooperative grid: `resident` blocks per SM (the
/// driver's occupancy for the kernel), at most `per_sm` ([`Tuning::persistent_blocks_per_sm`],
/// itself at most [`DECODE_LAYERS_BLOCKS_PER_SM`]), times `sms`. 0 when none fits.
pub fn decode_layers_grid(sms: usize, resident: usize, per_sm: usize) -> usize {
    sms * resident.min(per_sm).min(DECODE_LAYERS_BLOCKS_PER_SM)
}

/// Launch-shape and kernel-constant overrides for tuning runs. The defaults are what the
/// worker uses; the GPU A/B script sets the rest through the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Thread blocks a decode attention launch aims for ([`decode_partitions`]).
    pub attn_target_blocks: usize,
    /// Fewest keys per decode attention partition ([`ATTN_MIN_PARTITION`]).
    pub attn_min_partition: usize,
    /// Blocks per SM of a batch-of-one GEMV grid ([`GEMV1_BLOCKS_PER_SM`]).
    pub gemv1_blocks_per_sm: usize,
    /// Extra kernel macro definitions, `NAME=VALUE` (NVRTC `-D`), from
    /// [`KERNEL_DEFINES_ENV`](crate::kernels::KERNEL_DEFINES_ENV).
    pub kernel_defines: Vec<String>,
    /// Batch-of-one decode steps through the persistent decode kernel
    /// ([`PERSISTENT_DECODE_ENV`]).
    pub persistent_decode: bool,
    /// Blocks per SM of the persistent decode kernel's grid at most
    /// ([`DECODE_LAYERS_BLOCKS_PER_SM_ENV`]).
    pub persistent_blocks_per_sm: usize,
    /// Batch-of-one GEMVs through the shared-memory ring entries ([`GEMV_ASYNC_ENV`]).
    pub gemv_async: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            attn_target_blocks: ATTN_TARGET_BLOCKS,
            attn_min_partition: ATTN_MIN_PARTITION,
            gemv1_blocks_per_sm: GEMV1_BLOCKS_PER_SM,
            kernel_defines: Vec::new(),
            persistent_decode: false,
            persistent_blocks_per_sm: DECODE_LAYERS_BLOCKS_PER_SM,
            gemv_async: false,
        }
    }
}

impl Tuning {
    /// The defaults, overridden by [`ATTN_TARGET_BLOCKS_ENV`], [`ATTN_MIN_PARTITION_ENV`],
    /// [`GEMV1_BLOCKS_PER_SM_ENV`], [`PERSISTENT_DECODE_ENV`], [`DECODE_LAYERS_BLOCKS_PER_SM_ENV`],
    /// [`GEMV_ASYNC_ENV`] and
    /// [`KERNEL_DEFINES_ENV`](crate::kernels::KERNEL_DEFINES_ENV) where set and non-empty.
    ///
    /// # Errors
    /// A message naming the variable when a value does not parse (see
    /// [`parse_kernel_defines`](crate::kernels::parse_kernel_defines)).
    pub fn from_env() -> Result<Self, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`Tuning::from_env`] over `var` (a variable's value, `None` when unset).
    ///
    /// # Errors
    /// As [`Tuning::from_env`].
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        // An integer knob: `name`'s value where set, checked by `ok`, else `default`.
        let knob =
            |name: &str, default: usize, ok: fn(usize) -> bool, expected: &str| match var(name) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| ok(n))
                    .ok_or_else(|| format!("{name}={v:?}: expected {expected}")),
            };
        let mut t = Tuning {
            attn_target_blocks: knob(
                ATTN_TARGET_BLOCKS_ENV,
                ATTN_TARGET_BLOCKS,
                |n| (1..=4096).contains(&n),
                "an integer in 1..=4096",
            )?,
            attn_min_partition: knob(
                ATTN_MIN_PARTITION_ENV,
                ATTN_MIN_PARTITION,
                |n| (64..=16384).contains(&n) && n % 64 == 0,
                "a multiple of 64 in 64..=16384",
            )?,
            gemv1_blocks_per_sm: knob(
                GEMV1_BLOCKS_PER_SM_ENV,
                GEMV1_BLOCKS_PER_SM,
                |n| (1..=2).contains(&n),
                "1 or 2",
            )?,
            kernel_defines: Vec::new(),
            persistent_decode: knob(PERSISTENT_DECODE_ENV, 0, |n| n <= 1, "0 or 1")? == 1,
            persistent_blocks_per_sm: knob(
                DECODE_LAYERS_BLOCKS_PER_SM_ENV,
                DECODE_LAYERS_BLOCKS_PER_SM,
                |n| (1..=DECODE_LAYERS_BLOCKS_PER_SM).contains(&n),
                "1, 2 or 3",
            )?,
            gemv_async: knob(GEMV_ASYNC_ENV, 0, |n| n <= 1, "0 or 1")? == 1,
        };
        if let Some(v) = var(crate::kernels::KERNEL_DEFINES_ENV) {
            t.kernel_defines = crate::kernels::parse_kernel_defines(&v)
                .map_err(|e| format!("{}: {e}", crate::kernels::KERNEL_DEFINES_ENV))?;
        }
        Ok(t)
    }
}

/// Threads per block of the sampler (`baton_sample_f32` in `kernels/sampling.cu`).
pub const SAMPLE_BLOCK: usize = 1024;

/// Logits per slice of a split sampler row: one round of 8 loads per thread of a
/// [`SAMPLE_BLOCK`]-thread block.
pub const SAMPLE_SLICE: usize = SAMPLE_BLOCK * 8;

/// Most slices (thread blocks) per sampler row; the partial buffer holds this many per row.
pub const SAMPLE_MAX_SPLITS: usize = 64;

/// Thread blocks per row of a sampler launch (grid.y of `baton_sample_f32`) for a vocabulary
/// of `vocab` tokens: one per [`SAMPLE_SLICE`] logits, at least 1 and at most
/// [`SAMPLE_MAX_SPLITS`]. An unpenalized row is read by that many blocks at once and combined
/// by the last to finish (one block reading a 128256-token row took 30 us on an H200, one
/// SM's bandwidth); a penalized row is done by one block whatever this says.
pub fn sample_splits(vocab: usize) -> usize {
    vocab.div_ceil(SAMPLE_SLICE).clamp(1, SAMPLE_MAX_SPLITS)
}

/// Threads per block of `baton_apply_token_mask` (`kernels/token_mask.cu`).
pub const TOKEN_MASK_BLOCK: usize = 256;

/// Mask words (32 tokens each) per block of `baton_apply_token_mask`: one per thread, walked a
/// token per thread per step (32 steps of a [`TOKEN_MASK_BLOCK`]-thread block).
pub const TOKEN_MASK_WORDS_PER_BLOCK: usize = 256;

/// Most blocks per row of a `baton_apply_token_mask` launch.
pub const TOKEN_MASK_MAX_SPLITS: usize = 64;

/// Thread blocks per row of a `baton_apply_token_mask` launch (its grid.y) for a vocabulary
/// of `vocab` tokens: one per [`TOKEN_MASK_WORDS_PER_BLOCK`] mask words, at least 1 and at
/// most [`TOKEN_MASK_MAX_SPLITS`] (16 for 128256 tokens, the sampler's split). A row without
/// a mask costs each of its blocks one load, so the decode graphs, which always run the
/// kernel, pay `rows * splits` near-empty blocks when no row is guided.
pub fn token_mask_splits(vocab: usize) -> usize {
    baton_proto::token_mask_words(vocab)
        .div_ceil(TOKEN_MASK_WORDS_PER_BLOCK)
        .clamp(1, TOKEN_MASK_MAX_SPLITS)
}

/// Output rows per thread block of a fused decode GEMV (`kernels/gemv.cu`) of `tokens` tokens
/// and `n` output rows on a device with `sms` multiprocessors; always a multiple of 8 (the
/// block's warps take every 8th row).
///
/// A batch of one streams its weights with one wave of about `per_sm` blocks per SM
/// ([`GEMV1_BLOCKS_PER_SM`], two, is what `__launch_bounds__(256, 2)` allows), each warp
/// pipelining across its rows, so the per-block prologue (norm statistics, staging the
/// activation row) is paid about `per_sm` x `sms` times, not once per 8 rows. Larger batches
/// keep 8 rows per block (64 past 32768 rows, the LM head).
pub fn gemv_rows_per_block(tokens: usize, n: usize, sms: usize, per_sm: usize) -> usize {
    if tokens == 1 {
        n.div_ceil(per_sm.max(1) * sms.max(1)).div_ceil(8).max(1) * 8
    } else if n >= 32768 {
        64
    } else {
        8
    }
}

/// Split-K partial slots per row to allocate for decode attention (the partials hold
/// `rows * slots` partitions per head, which a launch shares out among its rows): enough for
/// a `max_model_len` context in partitions of [`ATTN_PARTITION`](crate::kernels::ATTN_PARTITION)
/// keys, and enough that [`decode_partitions`] can fill the GPU at any batch size up to `rows`
/// (a batch of `k` rows asks for at most `k * min(64, ceil(512 / k))` <= `512 + k` slots in
/// all). Without the second term a short model at batch 1 (a benchmark's 256 tokens) got one
/// partition: 8 attention blocks per layer on a 132-SM GPU.
///
/// `target` is the block target of [`decode_partitions`] ([`ATTN_TARGET_BLOCKS`] unless tuned).
pub fn decode_partition_slots(max_model_len: usize, rows: usize, target: usize) -> usize {
    let rows = rows.max(1);
    max_model_len
        .div_ceil(crate::kernels::ATTN_PARTITION)
        .max((target + rows).div_ceil(rows))
        .max(1)
}

/// Partitions per sequence (grid.z, the `max_partitions` argument of attention.cu's decode
/// kernels) for a decode launch of `rows` sequences and `blocks_per_row` thread blocks each (kv
/// heads times head chunks), on a model of `max_model_len` tokens, with partial buffers of
/// `capacity` partitions per sequence and head. The kernel splits a sequence of `ctx` keys into
/// partitions of [`decode_partition_size`] keys (from this grid, [`decode_fill`] and
/// `min_partition`), so a short one uses fewer.
///
/// At least 1 and at most `min(capacity, ATTN_MAX_PARTITIONS)`; otherwise enough for `target`
/// blocks ([`ATTN_TARGET_BLOCKS`] unless tuned), and enough that a `max_model_len` context has
/// partitions of at most [`ATTN_LONG_PARTITION`] keys, but no more than a `max_model_len`
/// context can use at `min_partition` keys each ([`ATTN_MIN_PARTITION`] unless tuned): the
/// blocks of partitions no sequence can reach would only start and exit. A function of the
/// batch size only, so a captured graph's choice holds for every replay.
pub fn decode_partitions(
    rows: usize,
    blocks_per_row: usize,
    max_model_len: usize,
    capacity: usize,
    target: usize,
    min_partition: usize,
) -> usize {
    let fill = decode_fill(rows, blocks_per_row, target);
    let long = max_model_len.div_ceil(ATTN_LONG_PARTITION);
    let usable = max_model_len.div_ceil(min_partition.max(1));
    fill.max(long)
        .min(usable)
        .min(ATTN_MAX_PARTITIONS)
        .min(capacity)
        .max(1)
}

/// Partitions per sequence that a decode attention launch of `rows` sequences and
/// `blocks_per_row` thread blocks each would like, to have about `target` blocks in all
/// ([`ATTN_TARGET_BLOCKS`] unless tuned): the `fill` argument of attention.cu's decode kernels,
/// in `1..=ATTN_MAX_PARTITIONS`. The kernel sizes a sequence's partitions from it (at least
/// `min_partition` keys, at most [`ATTN_LONG_PARTITION`] when that is enough), so a batch that
/// fills the GPU on its own (fill 1) splits only its long sequences, however long the model's
/// `max_model_len` makes the grid ([`decode_partitions`]). The executor passes
/// `min(decode_fill, grid z)`.
pub fn decode_fill(rows: usize, blocks_per_row: usize, target: usize) -> usize {
    target
        .div_ceil((rows * blocks_per_row).max(1))
        .clamp(1, ATTN_MAX_PARTITIONS)
}

/// Keys in one decode partition of a sequence of `ctx` keys, as attention.cu's
/// `baton_decode_part_size` computes it from the launch's grid `z`, `fill`, `min_partition`
/// and `long_partition` (a host copy, for tests and planning): `max(min_partition,
/// min(align(ceil(ctx / fill)), long_partition), align(ceil(ctx / z)))`, align = up to a
/// multiple of 64.
pub fn decode_partition_size(
    ctx: usize,
    z: usize,
    fill: usize,
    min_partition: usize,
    long_partition: usize,
) -> usize {
    let align = |k: usize| k.div_ceil(64) * 64;
    let by_fill = align(ctx.div_ceil(fill.max(1))).min(long_partition);
    let by_grid = align(ctx.div_ceil(z.max(1)));
    min_partition.max(by_fill).max(by_grid)
}

/// A launch's rows flattened into the kernel inputs.
///
/// Token arrays are indexed by flattened token `t` (rows back to back, in row order); row arrays
/// by row `r`. Every value fits the kernels' `int` parameters (checked by [`plan_launch`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchPlan {
    /// `[num_tokens]` position of each token (RoPE input).
    pub positions: Vec<i32>,
    /// `[num_tokens]` KV-cache slot `page * block_size + offset` of each token; `-1` = padding.
    pub slot_mapping: Vec<i32>,
    /// `[num_rows + 1]` prefix sums of row lengths; `cu_seqlens[0] == 0`.
    pub cu_seqlens: Vec<i32>,
    /// `[num_rows]` first position of each row (tokens already in the cache).
    pub start_pos: Vec<i32>,
    /// `[num_rows]` context length after this launch, `start_pos + num_tokens`.
    pub seq_lens: Vec<i32>,
    /// `[num_rows]` flattened index of each row's last token (whose logits are sampled).
    pub last_token_index: Vec<i32>,
    /// `[num_rows * max_blocks_per_row]` block tables, each row padded with 0.
    pub block_tables: Vec<i32>,
    /// Row stride of [`Self::block_tables`]; at least 1.
    pub max_blocks_per_row: usize,
    /// Largest `seq_lens` entry (sizes the decode split-K partitions).
    pub max_seq_len: usize,
}

impl LaunchPlan {
    /// Flattened token count.
    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }

    /// Row count.
    pub fn num_rows(&self) -> usize {
        self.seq_lens.len()
    }

    /// Pads a decode plan (every row one token) with empty rows up to `bucket` rows, for graph
    /// replay: padding rows have position 0, slot `-1` (not cached), `seq_len` 0 (attention
    /// writes zeros) and an all-zero block table. Panics if the plan has more than `bucket`
    /// rows or a row with more than one token.
    pub fn pad_decode_rows(&mut self, bucket: usize) {
        assert!(
            self.num_rows() <= bucket,
            "plan has more rows than the bucket"
        );
        assert_eq!(self.num_tokens(), self.num_rows(), "not a decode plan");
        for _ in self.num_rows()..bucket {
            let t = self.positions.len() as i32;
            self.positions.push(0);
            self.slot_mapping.push(-1);
            self.cu_seqlens.push(t + 1);
            self.start_pos.push(0);
            self.seq_lens.push(0);
            self.last_token_index.push(t);
            self.block_tables
                .extend(std::iter::repeat_n(0, self.max_blocks_per_row));
        }
    }
}

/// Why a launch cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// `block_size` was 0.
    #[error("block size must be positive")]
    ZeroBlockSize,
    /// A row computes no tokens.
    #[error("row {row} has no tokens")]
    EmptyRow {
        /// Row index.
        row: usize,
    },
    /// A row's block table does not cover its last position.
    #[error("row {row}: block table has {have} entries, positions up to {last_pos} need {need}")]
    BlockTableTooShort {
        /// Row index.
        row: usize,
        /// Entries given.
        have: usize,
        /// Entries needed.
        need: usize,
        /// Last position of the row.
        last_pos: u64,
    },
    /// A position, slot, or token count does not fit the kernels' 32-bit `int`.
    #[error("row {row}: {what} exceeds i32::MAX")]
    Overflow {
        /// Row index.
        row: usize,
        /// What overflowed.
        what: &'static str,
    },
}

/// Flattens `rows` (`(first_pos, num_tokens, block_table)` each, the block table covering at
/// least positions `0 .. first_pos + num_tokens`) into the arrays the embedding, RoPE, cache,
/// attention and sampling kernels take, for KV pages of `block_size` tokens.
///
/// Errors: [`PlanError`] for a zero block size, an empty row, a block table too short for the
/// row, or a value beyond `i32::MAX`. Cost: O(tokens + rows * max_blocks_per_row).
pub fn plan_launch(
    rows: &[(u32, u32, &[u32])],
    block_size: usize,
) -> Result<LaunchPlan, PlanError> {
    if block_size == 0 {
        return Err(PlanError::ZeroBlockSize);
    }
    let fit = |v: u64, row: usize, what: &'static str| {
        i32::try_from(v).map_err(|_| PlanError::Overflow { row, what })
    };
    let num_tokens: u64 = rows.iter().map(|r| u64::from(r.1)).sum();
    let mut plan = LaunchPlan {
        max_blocks_per_row: rows.iter().map(|r| r.2.len()).max().unwrap_or(0).max(1),
        ..LaunchPlan::default()
    };
    let nt = usize::try_from(num_tokens).unwrap_or(usize::MAX);
    plan.positions.reserve(nt);
    plan.slot_mapping.reserve(nt);
    plan.cu_seqlens.reserve(rows.len() + 1);
    plan.cu_seqlens.push(0);
    plan.block_tables
        .reserve(rows.len() * plan.max_blocks_per_row);
    let bs = block_size as u64;
    let mut total = 0u64;
    for (row, &(first_pos, n, table)) in rows.iter().enumerate() {
        if n == 0 {
            return Err(PlanError::EmptyRow { row });
        }
        let end = u64::from(first_pos) + u64::from(n);
        let need = end.div_ceil(bs);
        if (table.len() as u64) < need {
            return Err(PlanError::BlockTableTooShort {
                row,
                have: table.len(),
                need: need as usize,
                last_pos: end - 1,
            });
        }
        fit(end, row, "position")?;
        for pos in u64::from(first_pos)..end {
            let page = u64::from(table[(pos / bs) as usize]);
            plan.positions.push(pos as i32);
            plan.slot_mapping
                .push(fit(page * bs + pos % bs, row, "slot")?);
        }
        for &page in table {
            plan.block_tables
                .push(fit(u64::from(page), row, "page id")?);
        }
        plan.block_tables.extend(std::iter::repeat_n(
            0,
            plan.max_blocks_per_row - table.len(),
        ));
        total += u64::from(n);
        let cu = fit(total, row, "token count")?;
        plan.cu_seqlens.push(cu);
        plan.start_pos.push(first_pos as i32);
        plan.seq_lens.push(end as i32);
        plan.last_token_index.push(cu - 1);
        plan.max_seq_len = plan.max_seq_len.max(end as usize);
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_slots_let_every_batch_size_fill_the_gpu() {
        for (len, rows) in [(256, 1), (256, 4), (144, 128), (131_072, 256), (4096, 7)] {
            for target in [ATTN_TARGET_BLOCKS, 128, 1] {
                let slots = decode_partition_slots(len, rows, target);
                assert!(slots >= len.div_ceil(512), "{len} {rows}");
                for k in 1..=rows {
                    for bpr in [1, 2, 8, 32] {
                        let min = ATTN_MIN_PARTITION;
                        let unbounded = decode_partitions(k, bpr, len, usize::MAX, target, min);
                        let got = decode_partitions(k, bpr, len, rows * slots / k, target, min);
                        assert_eq!(
                            got, unbounded,
                            "len {len} rows {rows} batch {k} bpr {bpr} target {target}"
                        );
                    }
                }
            }
        }
        // A batch of one on a 4096-token model: 64 partitions (session 8 found it at 1), 16
        // with a target of 128 blocks.
        let slots = decode_partition_slots(4096, 1, ATTN_TARGET_BLOCKS);
        let min = ATTN_MIN_PARTITION;
        assert_eq!(
            decode_partitions(1, 8, 4096, slots, ATTN_TARGET_BLOCKS, min),
            64
        );
        let slots = decode_partition_slots(4096, 1, 128);
        assert_eq!(decode_partitions(1, 8, 4096, slots, 128, min), 16);
    }

    #[test]
    fn a_full_batch_on_a_long_model_splits_only_its_long_sequences() {
        // Llama-3.1 at 131072 tokens, batch 256, 8 kv heads: the grid keeps 8 partitions per
        // sequence (16384 keys each for the longest), but the batch fills the GPU alone.
        let (mml, rows) = (131_072, 256);
        let slots = decode_partition_slots(mml, rows, ATTN_TARGET_BLOCKS);
        let z = decode_partitions(rows, 8, mml, slots, ATTN_TARGET_BLOCKS, 64);
        assert_eq!(z, 8);
        let fill = decode_fill(rows, 8, ATTN_TARGET_BLOCKS).min(z);
        assert_eq!(fill, 1);
        let parts = |ctx: usize| ctx.div_ceil(decode_partition_size(ctx, z, fill, 64, 16384));
        // A 2000-token sequence is one partition (it was 8 of 256 keys), a 100000-token one
        // 7 of 16384.
        assert_eq!(parts(2000), 1);
        assert_eq!(parts(100_000), 7);
        // Every context fits the grid, whatever the sizes.
        for ctx in [1, 63, 64, 65, 16384, 16385, 65_536, 131_072] {
            for (fill, min) in [(1, 64), (8, 64), (1, 16384), (3, 512)] {
                let p = decode_partition_size(ctx, z, fill, min, 16384);
                assert!(ctx.div_ceil(p) <= z, "ctx {ctx} fill {fill} min {min}: {p}");
                assert!(p.is_multiple_of(64) && p >= min);
            }
        }
        // Batch 1 on the same model: fill 64, so a 2000-token sequence is 32 partitions.
        let z1 = decode_partitions(1, 8, mml, slots, ATTN_TARGET_BLOCKS, 64);
        let f1 = decode_fill(1, 8, ATTN_TARGET_BLOCKS).min(z1);
        assert_eq!((z1, f1), (64, 64));
        assert_eq!(
            2000usize.div_ceil(decode_partition_size(2000, z1, f1, 64, 16384)),
            32
        );
    }

    #[test]
    fn decode_partitions_stop_at_what_the_longest_context_can_use() {
        // A benchmark's 257-token model at batch 1: 5 partitions of 64 keys can cover any
        // context, so the other 59 of the fill target's 64 would only start and exit.
        let slots = decode_partition_slots(257, 1, ATTN_TARGET_BLOCKS);
        assert_eq!(
            decode_partitions(1, 8, 257, slots, ATTN_TARGET_BLOCKS, 64),
            5
        );
        // Partitions of at least 256 keys: 2; of at least 512: 1 (no combine).
        assert_eq!(
            decode_partitions(1, 8, 257, slots, ATTN_TARGET_BLOCKS, 256),
            2
        );
        assert_eq!(
            decode_partitions(1, 8, 257, slots, ATTN_TARGET_BLOCKS, 512),
            1
        );
        // Long models keep their long-context split whatever the minimum.
        let slots = decode_partition_slots(131_072, 256, ATTN_TARGET_BLOCKS);
        assert_eq!(
            decode_partitions(256, 8, 131_072, slots, ATTN_TARGET_BLOCKS, 1024),
            8
        );
    }

    #[test]
    fn tuning_reads_its_variables_and_refuses_bad_values() {
        let env3 = |a: &'static str, m: &'static str, k: &'static str| {
            move |name: &str| match name {
                ATTN_TARGET_BLOCKS_ENV => Some(a.to_string()),
                ATTN_MIN_PARTITION_ENV => Some(m.to_string()),
                crate::kernels::KERNEL_DEFINES_ENV => Some(k.to_string()),
                _ => None,
            }
        };
        let env = |a: &'static str, k: &'static str| env3(a, "", k);
        assert_eq!(Tuning::from_lookup(|_| None).unwrap(), Tuning::default());
        assert_eq!(
            Tuning::from_lookup(env(" ", "")).unwrap(),
            Tuning::default()
        );
        let t = Tuning::from_lookup(env("128", "BATON_GEMV_T1_U=2")).unwrap();
        assert_eq!(t.attn_target_blocks, 128);
        assert_eq!(t.kernel_defines, vec!["BATON_GEMV_T1_U=2".to_string()]);
        for (a, k) in [
            ("0", ""),
            ("-3", ""),
            ("many", ""),
            ("4097", ""),
            ("", "T1_U=2"),
        ] {
            let e = Tuning::from_lookup(env(a, k)).unwrap_err();
            assert!(e.starts_with("BATON_"), "{a:?} {k:?}: {e}");
        }
        let t = Tuning::from_lookup(env3("", "256", "")).unwrap();
        assert_eq!(t.attn_min_partition, 256);
        assert_eq!(t.attn_target_blocks, ATTN_TARGET_BLOCKS);
        for m in ["0", "32", "100", "16448", "-64", "x"] {
            let e = Tuning::from_lookup(env3("", m, "")).unwrap_err();
            assert!(e.starts_with(ATTN_MIN_PARTITION_ENV), "{m:?}: {e}");
        }
        let gemv = |v: &'static str| {
            Tuning::from_lookup(move |name: &str| {
                (name == GEMV1_BLOCKS_PER_SM_ENV).then(|| v.to_string())
            })
        };
        assert_eq!(gemv("1").unwrap().gemv1_blocks_per_sm, 1);
        assert_eq!(gemv(" 2 ").unwrap(), Tuning::default());
        for v in ["0", "3", "x", "-1"] {
            let e = gemv(v).unwrap_err();
            assert!(e.starts_with(GEMV1_BLOCKS_PER_SM_ENV), "{v:?}: {e}");
        }
        let ring = |v: &'static str| {
            Tuning::from_lookup(move |name: &str| (name == GEMV_ASYNC_ENV).then(|| v.to_string()))
        };
        assert!(ring("1").unwrap().gemv_async);
        assert_eq!(ring("0").unwrap(), Tuning::default());
        for v in ["2", "yes"] {
            let e = ring(v).unwrap_err();
            assert!(e.starts_with(GEMV_ASYNC_ENV), "{v:?}: {e}");
        }
        let persistent = |v: &'static str| {
            Tuning::from_lookup(move |name: &str| {
                (name == PERSISTENT_DECODE_ENV).then(|| v.to_string())
            })
        };
        assert!(persistent("1").unwrap().persistent_decode);
        assert!(!persistent("0").unwrap().persistent_decode);
        assert!(!Tuning::default().persistent_decode);
        for v in ["2", "yes", "-1"] {
            let e = persistent(v).unwrap_err();
            assert!(e.starts_with(PERSISTENT_DECODE_ENV), "{v:?}: {e}");
        }
        let per_sm = |v: &'static str| {
            Tuning::from_lookup(move |name: &str| {
                (name == DECODE_LAYERS_BLOCKS_PER_SM_ENV).then(|| v.to_string())
            })
        };
        assert_eq!(per_sm("1").unwrap().persistent_blocks_per_sm, 1);
        assert_eq!(per_sm("3").unwrap(), Tuning::default());
        for v in ["0", "4", "x"] {
            let e = per_sm(v).unwrap_err();
            assert!(e.starts_with(DECODE_LAYERS_BLOCKS_PER_SM_ENV), "{v:?}: {e}");
        }
    }

    #[test]
    fn the_persistent_kernel_stages_what_the_attention_tile_holds() {
        // BatonDecodeShared<D>::kv: 2 x TK x (D / VEC + 1) vectors of 16 bytes.
        assert_eq!(decode_layers_stage_elems(64, 2), 2 * 128 * 9 * 16 / 2);
        assert_eq!(decode_layers_stage_elems(128, 2), 2 * 64 * 17 * 16 / 2);
        assert_eq!(decode_layers_stage_elems(64, 4), 2 * 64 * 17 * 16 / 4);
        // Llama-3.2-1B (hidden 2048, intermediate 8192) and Llama-3.1-8B (4096, 14336) fit in
        // bf16; 8B's down projection does not in f32.
        assert!(decode_layers_stage_elems(64, 2) >= 8192);
        assert!(decode_layers_stage_elems(128, 2) >= 14336);
        assert!(decode_layers_stage_elems(128, 4) < 14336);
        assert_eq!(decode_layers_grid(132, 4, 3), 396);
        assert_eq!(decode_layers_grid(132, 2, 3), 264);
        assert_eq!(decode_layers_grid(132, 4, 1), 132);
        assert_eq!(decode_layers_grid(132, 4, 5), 396);
        assert_eq!(decode_layers_grid(132, 0, 3), 0);
    }

    #[test]
    fn sampler_slices_cover_the_row_in_one_round_each_up_to_the_cap() {
        for vocab in [0, 1, 512, 8192, 8193, 32_000, 128_256, 152_064, 1 << 20] {
            let s = sample_splits(vocab);
            assert!((1..=SAMPLE_MAX_SPLITS).contains(&s), "vocab {vocab}: {s}");
            // The kernel's slices of ceil(vocab / s) logits cover the row.
            assert!(vocab.div_ceil(s) * s >= vocab, "vocab {vocab}");
            if s < SAMPLE_MAX_SPLITS {
                assert!(vocab.div_ceil(s) <= SAMPLE_SLICE, "vocab {vocab}: {s}");
            }
            if vocab > SAMPLE_SLICE {
                assert!(s > 1, "vocab {vocab} left on one block");
            }
        }
        assert_eq!(sample_splits(128_256), 16);
        assert_eq!(sample_splits(512), 1);
    }

    #[test]
    fn token_mask_splits_cover_the_mask_words_of_a_row() {
        for vocab in [
            0,
            1,
            31,
            32,
            33,
            1000,
            8192,
            8193,
            32_000,
            128_256,
            1 << 20,
            1 << 24,
        ] {
            let s = token_mask_splits(vocab);
            assert!(
                (1..=TOKEN_MASK_MAX_SPLITS).contains(&s),
                "vocab {vocab}: {s}"
            );
            let words = baton_proto::token_mask_words(vocab);
            if s < TOKEN_MASK_MAX_SPLITS {
                assert!(
                    words.div_ceil(s) <= TOKEN_MASK_WORDS_PER_BLOCK,
                    "vocab {vocab}"
                );
            }
        }
        assert_eq!(token_mask_splits(128_256), 16);
        assert_eq!(token_mask_splits(1000), 1);
    }

    #[test]
    fn batch_of_one_gemv_grids_are_one_wave_of_two_blocks_per_sm() {
        for (n, sms) in [
            (3072, 132),
            (128_256, 132),
            (2048, 132),
            (20, 4),
            (1, 1),
            (7, 0),
        ] {
            for per_sm in [1, 2] {
                let rows = gemv_rows_per_block(1, n, sms, per_sm);
                assert_eq!(rows % 8, 0, "n {n}");
                let blocks = n.div_ceil(rows);
                assert!(
                    blocks <= per_sm * sms.max(1),
                    "n {n}: {blocks} blocks on {sms} SMs, {per_sm} per SM"
                );
                // No fewer blocks than 8-row blocks would give, up to the wave: one wave, full.
                assert!(
                    blocks >= n.div_ceil(8).min(per_sm * sms.max(1)) / 2,
                    "n {n}: {blocks}"
                );
            }
        }
        // The Llama-1B LM head on an H200: 488 rows, 263 blocks; 976 rows, 132 at one per SM.
        assert_eq!(gemv_rows_per_block(1, 128_256, 132, 2), 488);
        assert_eq!(gemv_rows_per_block(1, 128_256, 132, 1), 976);
        // Larger batches keep 8 rows per block (64 for the LM head).
        assert_eq!(gemv_rows_per_block(4, 3072, 132, 2), 8);
        assert_eq!(gemv_rows_per_block(8, 128_256, 132, 1), 64);
    }

    #[test]
    fn decode_partitions_fill_the_gpu_at_small_batches_and_respect_the_buffers() {
        let p = |rows, bpr, len, cap| {
            decode_partitions(rows, bpr, len, cap, ATTN_TARGET_BLOCKS, ATTN_MIN_PARTITION)
        };
        // One sequence, 8 kv heads, a 4096-token model: 64 partitions (512 blocks).
        assert_eq!(p(1, 8, 4096, 256), 64);
        // Batch 32: 256 blocks, so two partitions; batch 128 or more: one.
        assert_eq!(p(32, 8, 257, 8), 2);
        assert_eq!(p(128, 8, 257, 2), 1);
        assert_eq!(p(512, 8, 257, 1), 1);
        // The partial buffers bound it.
        assert_eq!(p(1, 8, 257, 3), 3);
        assert_eq!(p(4, 8, 257, 0), 1);
        // A long model splits even a large batch (partitions of at most 16384 keys).
        assert_eq!(p(256, 8, 131_072, 256), 8);
        assert_eq!(p(1, 1, 1 << 24, 10_000), ATTN_MAX_PARTITIONS);
        // The grid never reaches zero.
        assert_eq!(p(0, 0, 0, 0), 1);
        assert_eq!(decode_partitions(1, 8, 257, 5, ATTN_TARGET_BLOCKS, 0), 5);
    }

    #[test]
    fn default_buckets_are_vllm_style_and_cover_every_batch() {
        let b = default_graph_buckets(512);
        assert_eq!(&b[..6], &[1, 2, 4, 8, 16, 24]);
        assert_eq!(*b.last().unwrap(), 512);
        assert_eq!(b.len(), 3 + 64);
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(default_graph_buckets(100).last(), Some(&104));
        assert_eq!(default_graph_buckets(3), vec![1, 2, 4]);
        assert_eq!(default_graph_buckets(1), vec![1]);
        assert_eq!(default_graph_buckets(0), Vec::<usize>::new());
        assert_eq!(default_graph_buckets(4096).last(), Some(&512));
        for max in [1, 5, 8, 9, 100, 512] {
            let b = default_graph_buckets(max);
            for batch in 1..=max {
                assert!(graph_bucket(batch, &b).is_some(), "max {max} batch {batch}");
            }
        }
    }

    #[test]
    fn graph_bucket_picks_smallest_bucket_not_below_batch() {
        let b = default_graph_buckets(512);
        assert_eq!(graph_bucket(1, &b), Some(1));
        assert_eq!(graph_bucket(3, &b), Some(4));
        assert_eq!(graph_bucket(5, &b), Some(8));
        assert_eq!(graph_bucket(8, &b), Some(8));
        assert_eq!(graph_bucket(9, &b), Some(16));
        assert_eq!(graph_bucket(505, &b), Some(512));
        assert_eq!(graph_bucket(513, &b), None);
        assert_eq!(graph_bucket(0, &b), None);
        assert_eq!(graph_bucket(1, &[]), None);
    }

    #[test]
    fn plan_flattens_prefill_and_decode_rows() {
        // Row 0: prefill of 5 tokens from position 0, pages [7, 3], block size 4.
        // Row 1: decode at position 9, pages [1, 2, 6].
        let t0 = [7u32, 3];
        let t1 = [1u32, 2, 6];
        let p = plan_launch(&[(0, 5, &t0), (9, 1, &t1)], 4).unwrap();
        assert_eq!(p.positions, vec![0, 1, 2, 3, 4, 9]);
        assert_eq!(p.slot_mapping, vec![28, 29, 30, 31, 12, 6 * 4 + 1]);
        assert_eq!(p.cu_seqlens, vec![0, 5, 6]);
        assert_eq!(p.start_pos, vec![0, 9]);
        assert_eq!(p.seq_lens, vec![5, 10]);
        assert_eq!(p.last_token_index, vec![4, 5]);
        assert_eq!(p.max_blocks_per_row, 3);
        assert_eq!(p.block_tables, vec![7, 3, 0, 1, 2, 6]);
        assert_eq!(p.max_seq_len, 10);
        assert_eq!((p.num_tokens(), p.num_rows()), (6, 2));
    }

    #[test]
    fn plan_handles_chunked_prefill_continuing_a_cached_prefix() {
        let t = [5u32, 8, 2];
        let p = plan_launch(&[(6, 4, &t)], 4).unwrap();
        assert_eq!(p.positions, vec![6, 7, 8, 9]);
        assert_eq!(p.slot_mapping, vec![8 * 4 + 2, 8 * 4 + 3, 2 * 4, 2 * 4 + 1]);
        assert_eq!(p.start_pos, vec![6]);
        assert_eq!(p.seq_lens, vec![10]);
        assert_eq!(p.last_token_index, vec![3]);
    }

    #[test]
    fn plan_rejects_short_tables_empty_rows_zero_block_size_and_overflow() {
        let t = [1u32];
        assert_eq!(
            plan_launch(&[(3, 2, &t)], 4),
            Err(PlanError::BlockTableTooShort {
                row: 0,
                have: 1,
                need: 2,
                last_pos: 4
            })
        );
        assert_eq!(
            plan_launch(&[(0, 1, &t), (0, 0, &t)], 4),
            Err(PlanError::EmptyRow { row: 1 })
        );
        assert_eq!(plan_launch(&[(0, 1, &t)], 0), Err(PlanError::ZeroBlockSize));
        let big = [u32::MAX];
        assert!(matches!(
            plan_launch(&[(0, 1, &big)], 16),
            Err(PlanError::Overflow { what: "slot", .. })
        ));
        assert_eq!(plan_launch(&[], 16).unwrap().cu_seqlens, vec![0]);
    }

    #[test]
    fn pad_decode_rows_appends_inert_rows() {
        let t = [4u32];
        let mut p = plan_launch(&[(2, 1, &t), (0, 1, &t)], 16).unwrap();
        p.pad_decode_rows(4);
        assert_eq!(p.num_rows(), 4);
        assert_eq!(p.slot_mapping, vec![66, 64, -1, -1]);
        assert_eq!(p.cu_seqlens, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.seq_lens, vec![3, 1, 0, 0]);
        assert_eq!(p.last_token_index, vec![0, 1, 2, 3]);
        assert_eq!(p.block_tables.len(), 4 * p.max_blocks_per_row);
    }
}
