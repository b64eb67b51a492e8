//! The worker: executes launch records on a backend, samples, and reports completions at the
//! fence (DESIGN.md sections 2 to 4).
//!
//! Contract: a [`Backend`] returns from [`Backend::execute`] only after the device work of the
//! launch has completed (the CPU backend: the end of the step; the CUDA backend: the event
//! recorded after the launch's last kernel and the copy of the sampled ids). Only then may the
//! caller advance the worker's `released` counter, so the scheduler never reclaims a page a
//! running launch can still touch. A row whose input is `PendingFrom { launch, row }` takes the
//! id that launch sampled, from the ids the backend kept ([`KeptIds`]), never from the table.

pub mod cpu;
pub mod daemon;
pub mod kept;
pub mod null;
pub mod penalty;
pub mod sampling;

pub use cpu::CpuBackend;
pub use kept::KeptIds;
pub use null::NullBackend;

use baton_proto::{Completion, Launch, LaunchSeq, SlotTables};
use std::ops::Range;
use std::sync::atomic::AtomicU32;

/// Read access to the token and block tables (the scheduler writes them).
pub trait TableReader {
    /// Appends tokens `range` of `slot` to `out`.
    fn read_tokens(&self, slot: u32, range: Range<usize>, out: &mut Vec<u32>);
    /// Appends the first `n` block-table entries of `slot` to `out`.
    fn read_blocks(&self, slot: u32, n: usize, out: &mut Vec<u32>);
    /// Appends the first `n` (at most `MAX_LOGIT_BIAS`) logit-bias entries of `slot` to `out`.
    fn read_logit_bias(&self, slot: u32, n: usize, out: &mut Vec<(u32, f32)>);
    /// Replaces `out` with the token-mask row of `slot` (`baton_proto::token_mask_words` of
    /// the vocabulary; empty when the tables have no mask table).
    fn read_token_mask(&self, slot: u32, out: &mut Vec<u32>);
}

impl<S: AsRef<[AtomicU32]>> TableReader for SlotTables<S> {
    fn read_tokens(&self, slot: u32, range: Range<usize>, out: &mut Vec<u32>) {
        SlotTables::read_tokens(self, slot, range, out)
    }
    fn read_blocks(&self, slot: u32, n: usize, out: &mut Vec<u32>) {
        SlotTables::read_blocks(self, slot, n, out)
    }
    fn read_logit_bias(&self, slot: u32, n: usize, out: &mut Vec<(u32, f32)>) {
        SlotTables::read_logit_bias(self, slot, n.min(baton_proto::MAX_LOGIT_BIAS), out)
    }
    fn read_token_mask(&self, slot: u32, out: &mut Vec<u32>) {
        SlotTables::read_token_mask(self, slot, out)
    }
}

/// Why a launch could not execute.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A row refers to a launch whose sampled ids were not kept (too old, or never seen: for
    /// example a launch published before this worker attached).
    #[error("launch {launch} row refers to ids of launch {from} row {row}, which this worker does not hold")]
    MissingPending {
        /// The launch being executed.
        launch: u64,
        /// The launch referred to.
        from: u64,
        /// The row referred to.
        row: u32,
    },
    /// The forward pass rejected its input.
    #[error("forward pass failed: {0}")]
    Forward(String),
    /// A device error.
    #[error("device error: {0}")]
    Device(String),
}

/// KV capacity a backend offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCapacity {
    /// Pages.
    pub num_blocks: usize,
    /// Tokens per page.
    pub block_size: usize,
}

/// A device that executes launches: the CPU reference, the null backend, CUDA.
pub trait Backend: Send {
    /// Executes `launch` through its fence and returns the sampled tokens, one per row with
    /// `sample == 1`, in row order.
    ///
    /// # Errors
    /// [`WorkerError`] for a row the backend cannot resolve or a device failure.
    fn execute(
        &mut self,
        launch: &Launch,
        tables: &dyn TableReader,
    ) -> Result<Completion, WorkerError>;

    /// Launches this backend can hold between [`Backend::submit`] and [`Backend::finish`]:
    /// how many the worker may keep in flight so that the device never waits for the host
    /// between two launches. 1 (the default): the backend only runs launches to their fence,
    /// in [`Backend::execute`], and `submit` is never called.
    fn max_in_flight(&self) -> usize {
        1
    }

    /// Enqueues `launch` without waiting for its fence. The caller has fewer than
    /// [`Backend::max_in_flight`] launches unfinished and publishes nothing of this one (and
    /// releases nothing) before [`Backend::finish`] returns it. A later launch's pending rows
    /// may name a submitted launch. `Ok(false)`: this launch cannot overlap others (for
    /// example it scores prompt tokens after its fence) and nothing was done: finish the
    /// earlier launches, then [`Backend::execute`] it.
    ///
    /// # Errors
    /// As [`Backend::execute`]; nothing of this launch is in flight then, while the launches
    /// submitted before it still are (finish them first, to keep completions in order).
    fn submit(&mut self, _launch: &Launch, _tables: &dyn TableReader) -> Result<bool, WorkerError> {
        Ok(false)
    }

    /// Whether the oldest launch submitted and not yet finished has passed its fence (so
    /// [`Backend::finish`] would not wait), or nothing is in flight. `true` by default; an
    /// error counts as passed (`finish` reports it).
    fn oldest_done(&mut self) -> bool {
        true
    }

    /// Waits for the fence of the oldest launch submitted and not yet finished, and returns
    /// its sequence number with its completion (or the device error its fence reported);
    /// `None` when nothing is in flight.
    fn finish(&mut self) -> Option<(LaunchSeq, Result<Completion, WorkerError>)> {
        None
    }

    /// The KV pool this backend holds.
    fn kv_capacity(&self) -> KvCapacity;

    /// Vocabulary size of the model (the range of sampled ids).
    fn vocab_size(&self) -> usize;

    /// The model's `ModelConfig::fingerprint`, checked against the scheduler's at attach;
    /// 0 for a backend without a model (the null backend), which is not checked.
    fn model_fingerprint(&self) -> u64;

    /// The most positions the model computes (its `max_position_embeddings`): a scheduler
    /// that serves longer sequences (`max_model_len`) is refused at attach, since the
    /// fingerprint leaves the length out (the served length is the scheduler's choice).
    /// Unbounded by default (a backend without a model).
    fn max_positions(&self) -> usize {
        usize::MAX
    }

    /// Serves `adapters` beside the base weights: a launch row with `lora == i + 1` runs
    /// with `adapters[i]` (vLLM's `--lora-modules`; see `baton_model::lora`). Called once,
    /// before the worker attaches.
    ///
    /// # Errors
    /// [`WorkerError::Device`] when this backend serves no adapters (the default) or cannot
    /// hold these.
    fn set_lora_adapters(
        &mut self,
        adapters: Vec<baton_model::LoraAdapter>,
    ) -> Result<(), WorkerError> {
        if adapters.is_empty() {
            return Ok(());
        }
        Err(WorkerError::Device(format!(
            "the {} backend does not serve LoRA adapters",
            self.name()
        )))
    }

    /// A short name for logs (`cpu`, `null`, `cuda`).
    fn name(&self) -> &'static str;
}
