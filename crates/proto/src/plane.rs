//! The control segment of one Baton instance: which rings and tables it holds, sized from the
//! limits the scheduler publishes (DESIGN.md section 6).
//!
//! Contract: the creator (the scheduler) and every attacher build the layout from the same
//! [`PlaneLimits`], which the creator writes into the segment header; an attacher reads them
//! back first ([`baton_ipc::Segment::peek_limits`]) so its layout hash matches by construction.

use crate::wire::{CompletionSlot, LaunchSlot, ToFrontend, ToScheduler};
use crate::SlotTables;
use baton_ipc::topology::{ControlPlaneSpec, RingShape};
use baton_ipc::{Arena, AtomicArray, LayoutSpec, Limits, RegionError};
use std::sync::atomic::AtomicU32;

/// The token table region: `max_num_seqs * max_model_len` u32.
pub const TOKENS: &str = "tables.tokens";
/// The block table region: `max_num_seqs * max_blocks_per_seq` u32.
pub const BLOCKS: &str = "tables.blocks";
/// The logit-bias table region: `max_num_seqs * LOGIT_BIAS_WORDS` u32.
pub const LOGIT_BIAS: &str = "tables.logit_bias";
/// The token-mask table region (structured outputs): `max_num_seqs *
/// token_mask_words(vocab_size)` u32, at least one word.
pub const TOKEN_MASK: &str = "tables.token_mask";
/// Scheduler statistics for `/metrics` and `/health`: see the `STAT_*` indices.
pub const STATS: &str = "scheduler.stats";

/// Index in [`STATS`]: requests running.
pub const STAT_RUNNING: usize = 0;
/// Index in [`STATS`]: requests waiting.
pub const STAT_WAITING: usize = 1;
/// Index in [`STATS`]: KV pages in use or retired (not free).
pub const STAT_PAGES_USED: usize = 2;
/// Index in [`STATS`]: KV pages in the pool.
pub const STAT_PAGES_TOTAL: usize = 3;
/// Index in [`STATS`]: launches published.
pub const STAT_LAUNCHES: usize = 4;
/// Index in [`STATS`]: the scheduler's heartbeat, monotonic ms.
pub const STAT_HEARTBEAT_MS: usize = 5;
/// Index in [`STATS`]: pages retired, waiting for a fence.
pub const STAT_PAGES_RETIRED: usize = 6;
/// Index in [`STATS`]: preemptions so far.
pub const STAT_PREEMPTIONS: usize = 7;
/// Index in [`STATS`]: prompt positions looked up in the prefix cache so far.
pub const STAT_PREFIX_QUERIES: usize = 8;
/// Index in [`STATS`]: of those, positions found in the cache.
pub const STAT_PREFIX_HITS: usize = 9;
/// Number of words in [`STATS`].
pub const STAT_WORDS: usize = 16;

/// Header status bit: a worker is attached and its KV cache is live.
pub const STATUS_WORKER_ATTACHED: u64 = 1;
/// Header status bit: the scheduler is shutting down.
pub const STATUS_SHUTTING_DOWN: u64 = 2;

/// Limits that shape the segment; written into the header's [`Limits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneLimits {
    /// Tokens per KV page.
    pub block_size: usize,
    /// Longest sequence, in tokens.
    pub max_model_len: usize,
    /// Most sequences at once (request slots).
    pub max_num_seqs: usize,
    /// KV pages.
    pub num_blocks: usize,
    /// Most tokens per launch.
    pub max_num_batched_tokens: usize,
    /// Vocabulary size the scheduler validates against (0: unknown).
    pub vocab_size: usize,
    /// Frontend slots (ring pairs).
    pub frontends: usize,
    /// Launches in flight at most.
    pub max_inflight: usize,
    /// Fingerprint of the model the scheduler was started for (`baton_model`'s
    /// `ModelConfig::fingerprint`); 0: unknown, nothing to check. A worker or frontend whose
    /// model has another fingerprint refuses to attach.
    pub model_fingerprint: u64,
    /// Fingerprint of the weights the scheduler was started for (`baton_model`'s
    /// `weights_fingerprint` or `dummy_weights_fingerprint`); 0: unknown, nothing to check. A
    /// worker holding other weights refuses to attach (frontends, which load no weights, do
    /// not check it).
    pub weights_fingerprint: u64,
    /// Fingerprint of the tokenizer.json the scheduler's model directory holds (`baton_model`'s
    /// `tokenizer_fingerprint`); 0: unknown, nothing to check. A frontend whose tokenizer
    /// differs refuses to attach: it would send other ids for the same text, and the
    /// scheduler's structured-output masks are of its own tokenizer's tokens.
    pub tokenizer_fingerprint: u64,
    /// The scheduler orders requests by their `priority` (vLLM's `--scheduling-policy
    /// priority`); false: first come, first served, and a request's priority must be 0.
    pub priority_scheduling: bool,
    /// The CPU KV cache's dtype the scheduler sized its pool for (`--kv-cache-dtype`
    /// resolved): [`KV_DTYPE_UNKNOWN`], [`KV_DTYPE_F32`], [`KV_DTYPE_BF16`] or
    /// [`KV_DTYPE_F16`]. A CPU worker given `auto` stores its cache in it; one given another
    /// dtype refuses to attach.
    pub kv_dtype: u8,
    /// The model's sliding window in keys when every layer has one, else 0: the scheduler
    /// releases a running request's pages out of it, so admission (the frontends' checks too)
    /// sizes a request by it (`baton_scheduler::SchedulerConfig::request_pages`). At most
    /// `u32::MAX` (the header packs it in 32 bits).
    pub kv_window: u32,
    /// The scheduler runs with prefix caching (with a window it holds a request's pages a
    /// little longer: `baton_scheduler::SchedulerConfig::request_pages`).
    pub prefix_caching: bool,
    /// LoRA adapters served (`--lora-modules` entries): an admission's adapter id is at most
    /// this. 0: none.
    pub lora_count: u32,
    /// Fingerprint of the scheduler's `--lora-modules` list (`baton_model::lora::
    /// lora_fingerprint`; 0 for none). A worker or frontend with another list refuses to
    /// attach: adapter id `i` must name the same adapter in every process.
    pub lora_fingerprint: u64,
}

/// [`PlaneLimits::kv_dtype`]: not published (nothing to follow or check).
pub const KV_DTYPE_UNKNOWN: u8 = 0;
/// [`PlaneLimits::kv_dtype`]: f32.
pub const KV_DTYPE_F32: u8 = 1;
/// [`PlaneLimits::kv_dtype`]: bf16.
pub const KV_DTYPE_BF16: u8 = 2;
/// [`PlaneLimits::kv_dtype`]: f16.
pub const KV_DTYPE_F16: u8 = 3;

impl PlaneLimits {
    /// Block-table entries per slot.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_model_len.div_ceil(self.block_size.max(1))
    }

    /// The ring shapes and participant slots.
    pub fn control_spec(&self) -> ControlPlaneSpec {
        let launch_slots =
            (2 * (self.max_num_seqs + 1) * self.max_inflight.max(1)).next_power_of_two();
        ControlPlaneSpec {
            frontends: self.frontends,
            workers: 1,
            extra_participants: 2,
            frontend_in: RingShape::of::<ToScheduler>(1024),
            frontend_out: RingShape::of::<ToFrontend>(4096),
            launch: RingShape::of::<LaunchSlot>(launch_slots),
            completion: RingShape::of::<CompletionSlot>(launch_slots),
        }
    }

    /// The full layout: the control plane plus the token and block tables and the stats words.
    pub fn layout_spec(&self) -> LayoutSpec {
        self.control_spec()
            .layout_spec()
            .atomics_u32(TOKENS, self.max_num_seqs * self.max_model_len)
            .atomics_u32(BLOCKS, self.max_num_seqs * self.max_blocks_per_seq())
            .atomics_u32(LOGIT_BIAS, self.max_num_seqs * crate::LOGIT_BIAS_WORDS)
            .atomics_u32(
                TOKEN_MASK,
                (self.max_num_seqs * crate::token_mask_words(self.vocab_size)).max(1),
            )
            .atomics_u64(STATS, STAT_WORDS)
    }

    /// The header limits.
    pub fn to_limits(&self) -> Limits {
        let mut spare = [0u64; 16];
        spare[0] = self.num_blocks as u64;
        spare[1] = self.max_num_batched_tokens as u64;
        spare[2] = self.vocab_size as u64;
        spare[3] = self.frontends as u64;
        spare[4] = self.max_inflight as u64;
        spare[5] = self.model_fingerprint;
        spare[6] = self.weights_fingerprint;
        spare[7] = u64::from(self.priority_scheduling)
            | u64::from(self.prefix_caching) << 1
            | u64::from(self.kv_dtype) << 8
            | u64::from(self.kv_window) << 32;
        spare[8] = self.tokenizer_fingerprint;
        spare[9] = self.lora_fingerprint;
        spare[10] = u64::from(self.lora_count);
        self.control_spec().with_ring_capacities(Limits {
            block_size: self.block_size as u64,
            max_model_len: self.max_model_len as u64,
            max_num_seqs: self.max_num_seqs as u64,
            spare,
            ..Limits::default()
        })
    }

    /// Reads the limits back from a header.
    pub fn from_limits(l: &Limits) -> Self {
        Self {
            block_size: l.block_size as usize,
            max_model_len: l.max_model_len as usize,
            max_num_seqs: l.max_num_seqs as usize,
            num_blocks: l.spare[0] as usize,
            max_num_batched_tokens: l.spare[1] as usize,
            vocab_size: l.spare[2] as usize,
            frontends: l.spare[3] as usize,
            max_inflight: l.spare[4] as usize,
            model_fingerprint: l.spare[5],
            weights_fingerprint: l.spare[6],
            tokenizer_fingerprint: l.spare[8],
            priority_scheduling: l.spare[7] & 1 != 0,
            kv_dtype: (l.spare[7] >> 8) as u8,
            kv_window: (l.spare[7] >> 32) as u32,
            prefix_caching: l.spare[7] & 2 != 0,
            lora_fingerprint: l.spare[9],
            lora_count: l.spare[10] as u32,
        }
    }
}

/// Shared-memory storage for [`SlotTables`].
pub struct SharedU32(pub AtomicArray<AtomicU32>);

impl AsRef<[AtomicU32]> for SharedU32 {
    fn as_ref(&self) -> &[AtomicU32] {
        &self.0
    }
}

/// Token and block tables in the segment.
pub type SharedSlotTables = SlotTables<SharedU32>;

/// Opens the token and block tables of `arena`.
///
/// # Errors
/// A missing or mis-sized region.
pub fn slot_tables(arena: &Arena, l: &PlaneLimits) -> Result<SharedSlotTables, RegionError> {
    Ok(SlotTables::from_parts(
        SharedU32(arena.atomics_u32(TOKENS)?),
        SharedU32(arena.atomics_u32(BLOCKS)?),
        SharedU32(arena.atomics_u32(LOGIT_BIAS)?),
        SharedU32(arena.atomics_u32(TOKEN_MASK)?),
        l.max_model_len,
        l.max_blocks_per_seq(),
        crate::token_mask_words(l.vocab_size),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_round_trip_through_the_header() {
        let l = PlaneLimits {
            block_size: 16,
            max_model_len: 512,
            max_num_seqs: 8,
            num_blocks: 100,
            max_num_batched_tokens: 256,
            vocab_size: 512,
            frontends: 4,
            max_inflight: 2,
            model_fingerprint: 0x1234_5678_9abc_def0,
            weights_fingerprint: 0x0fed_cba9_8765_4321,
            tokenizer_fingerprint: 0x1357_9bdf_0246_8ace,
            priority_scheduling: true,
            kv_dtype: KV_DTYPE_BF16,
            kv_window: 4096,
            prefix_caching: true,
            lora_count: 3,
            lora_fingerprint: 0x2468_ace0_1357_9bdf,
        };
        assert_eq!(PlaneLimits::from_limits(&l.to_limits()), l);
        let arena = Arena::heap(&l.layout_spec()).unwrap();
        let t = slot_tables(&arena, &l).unwrap();
        t.set_token(7, 511, 3);
        assert_eq!(t.token(7, 511), 3);
        assert_eq!(t.mask_words(), 16);
        t.set_token_mask(7, &[5; 16]);
        let mut m = Vec::new();
        t.read_token_mask(7, &mut m);
        assert_eq!(m, [5; 16]);
        t.read_token_mask(6, &mut m);
        assert_eq!(m, [0; 16]);
    }
}
