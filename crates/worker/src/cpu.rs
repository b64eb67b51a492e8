//! The CPU backend: the f32 reference forward pass of `baton-model` over a paged KV cache, then
//! the reference sampler. A launch is complete, and its fence passed, when `execute` returns.

use crate::penalty::{PenaltyEntry, PenaltyHistories};
use crate::sampling::Sampler;
use crate::{Backend, KeptIds, KvCapacity, TableReader, WorkerError};
use baton_model::{CpuModel, DType, ForwardRow, PagedKvCache};
use baton_proto::{Completion, Launch, PromptLogprob, Sampled, NOT_PENDING};

/// The CPU reference backend.
pub struct CpuBackend {
    model: CpuModel,
    kv: PagedKvCache,
    sampler: Sampler,
    kept: KeptIds,
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    /// Per-slot token counts, the logit-bias scratch and a row's penalty list.
    histories: PenaltyHistories,
    bias: Vec<(u32, f32)>,
    penalties: Vec<PenaltyEntry>,
    /// A token read from the table (the one after a prompt chunk).
    scratch: Vec<u32>,
    /// A structured-output row's token mask and its masked logits.
    mask: Vec<u32>,
    masked: Vec<f32>,
}

impl CpuBackend {
    /// A backend over `model` with a KV pool of `num_blocks` pages of `block_size` tokens, in
    /// the model's dtype ([`PagedKvCache::auto_dtype`]: `--kv-cache-dtype auto`).
    ///
    /// # Panics
    /// When the KV cache cannot be allocated ([`CpuBackend::try_new`] returns an error).
    pub fn new(model: CpuModel, num_blocks: usize, block_size: usize) -> Self {
        let dtype = PagedKvCache::auto_dtype(model.config());
        Self::try_new(model, num_blocks, block_size, dtype).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A backend over `model` with a KV pool of `num_blocks` pages of `block_size` tokens
    /// stored as `kv_dtype`, with an error naming the size when the KV cache cannot be
    /// allocated.
    ///
    /// # Errors
    /// The KV cache's allocation failed.
    pub fn try_new(
        model: CpuModel,
        num_blocks: usize,
        block_size: usize,
        kv_dtype: DType,
    ) -> Result<Self, String> {
        let kv = PagedKvCache::try_with_dtype(model.config(), num_blocks, block_size, kv_dtype)?;
        Ok(Self {
            model,
            kv,
            sampler: Sampler::new(),
            kept: KeptIds::new(8),
            tokens: Vec::new(),
            blocks: Vec::new(),
            histories: PenaltyHistories::new(),
            bias: Vec::new(),
            penalties: Vec::new(),
            scratch: Vec::new(),
            mask: Vec::new(),
            masked: Vec::new(),
        })
    }

    /// The model.
    pub fn model(&self) -> &CpuModel {
        &self.model
    }
}

impl Backend for CpuBackend {
    fn execute(
        &mut self,
        launch: &Launch,
        tables: &dyn TableReader,
    ) -> Result<Completion, WorkerError> {
        // Gather every row's inputs into two flat buffers, then borrow slices of them.
        self.tokens.clear();
        self.blocks.clear();
        let mut spans = Vec::with_capacity(launch.rows.len());
        for r in &launch.rows {
            let (t0, b0) = (self.tokens.len(), self.blocks.len());
            let first = r.first_pos as usize;
            let end = first + r.num_tokens as usize;
            if r.pending_launch != NOT_PENDING {
                let id = self.kept.get(r.pending_launch, r.pending_row).ok_or(
                    WorkerError::MissingPending {
                        launch: launch.seq,
                        from: r.pending_launch,
                        row: r.pending_row,
                    },
                )?;
                self.tokens.push(id);
                tables.read_tokens(r.req.slot, first + 1..end, &mut self.tokens);
            } else {
                tables.read_tokens(r.req.slot, first..end, &mut self.tokens);
            }
            tables.read_blocks(r.req.slot, r.num_blocks as usize, &mut self.blocks);
            spans.push((t0..self.tokens.len(), b0..self.blocks.len()));
        }
        let rows: Vec<ForwardRow> = launch
            .rows
            .iter()
            .zip(&spans)
            .map(|(r, (t, b))| ForwardRow {
                tokens: &self.tokens[t.clone()],
                start_pos: r.first_pos as usize,
                block_table: &self.blocks[b.clone()],
                want_logits: r.sample == 1,
                all_logits: !r.scores_prompt().is_empty(),
                lora: r.lora,
            })
            .collect();
        let logits = self
            .model
            .forward(&mut self.kv, &rows)
            .map_err(|e| WorkerError::Forward(e.to_string()))?;

        let mut ids = vec![u32::MAX; launch.rows.len()];
        let mut sampled = Vec::with_capacity(logits.len());
        let mut prompt = Vec::new();
        // Rows that report prompt log-probabilities got one logits vector per position, the
        // others one for their last position if they sample.
        let mut next = logits.iter();
        let mut per_row = Vec::with_capacity(launch.rows.len());
        for (i, r) in launch.rows.iter().enumerate() {
            let scored = r.scores_prompt();
            if scored.is_empty() {
                per_row.push(if r.sample == 1 { next.next() } else { None });
                continue;
            }
            let first = r.first_pos as usize;
            let row_tokens = &self.tokens[spans[i].0.clone()];
            let n_top = r.params.prompt_top().unwrap_or(0);
            let mut last = None;
            for pos in first..first + r.num_tokens as usize {
                let l = next.next().ok_or_else(|| {
                    WorkerError::Forward(format!("row {i}: no logits at position {pos}"))
                })?;
                last = Some(l);
                if pos >= scored.end as usize {
                    continue;
                }
                // The prompt token scored by position `pos` is the one at `pos + 1`: in this
                // row, or the next in the table for a row that ends before it.
                let token = match row_tokens.get(pos + 1 - first) {
                    Some(&t) => t,
                    None => {
                        self.scratch.clear();
                        tables.read_tokens(r.req.slot, pos + 1..pos + 2, &mut self.scratch);
                        self.scratch[0]
                    }
                };
                let (logprob, top) = self.sampler.score(l, token, n_top);
                prompt.push(PromptLogprob {
                    row: i as u32,
                    req: r.req,
                    pos: pos as u32 + 1,
                    token,
                    logprob,
                    rank: crate::sampling::rank_of(l, token),
                    top,
                });
            }
            per_row.push(last.filter(|_| r.sample == 1));
        }

        for (i, r) in launch.rows.iter().enumerate() {
            let Some(l) = per_row[i] else {
                continue;
            };
            // The row's inputs are all known here (a pending first id is resolved).
            self.histories
                .launch_row(
                    r,
                    &self.tokens[spans[i].0.clone()],
                    r.first_pos as usize,
                    tables,
                    &mut self.bias,
                    &mut self.penalties,
                )
                .map_err(|e| WorkerError::Forward(format!("row {i}: {e}")))?;
            let l = if r.params.token_mask != 0 {
                tables.read_token_mask(r.req.slot, &mut self.mask);
                if self.mask.len() != l.len().div_ceil(32) {
                    return Err(WorkerError::Forward(format!(
                        "row {i} asks for a token mask of {} words but the tables hold {}",
                        l.len().div_ceil(32),
                        self.mask.len()
                    )));
                }
                self.masked.clear();
                self.masked.extend_from_slice(l);
                crate::sampling::apply_token_mask(&mut self.masked, &self.mask);
                &self.masked[..]
            } else {
                l
            };
            let out = self
                .sampler
                .sample_penalized(l, &r.params, r.output_index, &self.penalties);
            ids[i] = out.token;
            sampled.push(Sampled {
                row: i as u32,
                req: r.req,
                token: out.token,
                logprob: out.logprob,
                top: out.top,
            });
        }
        self.kept.push(launch.seq, ids);
        Ok(Completion {
            seq: launch.seq,
            sampled,
            prompt,
        })
    }

    fn kv_capacity(&self) -> KvCapacity {
        KvCapacity {
            num_blocks: self.kv.num_blocks(),
            block_size: self.kv.block_size(),
        }
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn model_fingerprint(&self) -> u64 {
        self.model.config().fingerprint()
    }

    fn max_positions(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    fn set_lora_adapters(
        &mut self,
        adapters: Vec<baton_model::LoraAdapter>,
    ) -> Result<(), WorkerError> {
        self.model
            .set_lora_adapters(adapters)
            .map_err(|e| WorkerError::Device(e.to_string()))
    }

    fn name(&self) -> &'static str {
        "cpu"
    }
}
