//! The messages that cross Baton's process boundaries (DESIGN.md sections 2 and 3).
//!
//! Contract: a launch record is read-only once published. It names request slots by
//! `(slot, generation)`, positions by range, and the block table by a count of valid entries;
//! it never copies a block table or a prompt. Tokens and block tables live in [`SlotTables`],
//! which only the scheduler writes (append-only per request) and which the worker reads.
//!
//! Everything that travels through a shared-memory ring is `#[repr(C)]` plain data
//! ([`bytemuck::Pod`]). The in-process engine uses the same types over in-process queues.

#[cfg(not(loom))]
pub mod link;
#[cfg(not(loom))]
pub mod plane;
pub mod wire;

use bytemuck::{Pod, Zeroable};
use std::sync::atomic::{AtomicU32, Ordering};

/// Where a request's time went before its first token, in seconds, as the scheduler measured
/// it; carried by the request's first token (vLLM v1's `vllm:request_queue_time_seconds` and
/// `vllm:request_prefill_time_seconds`; the frontend times the decode phase itself).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FirstTokenTimes {
    /// From admission at the scheduler to the request's first launch.
    pub queue: f64,
    /// From its first launch to its first token.
    pub prefill: f64,
}

/// A launch sequence number. Launches are numbered from 1 and only grow; 0 means "none".
pub type LaunchSeq = u64;

/// A request slot with the generation it had when referred to. A stale reference (the slot was
/// reused since) is detected by comparing generations.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable, Default)]
pub struct SlotRef {
    /// Index into the request slot table, `0..max_num_seqs`.
    pub slot: u32,
    /// The slot's generation, bumped on every reuse.
    pub generation: u32,
}

/// Per-request sampling parameters, carried on every launch row that samples.
///
/// Edge values follow the OpenAI meaning: `temperature == 0` is greedy, `top_p == 1` is no
/// filter, `top_k <= 0` is disabled, `min_p == 0` is disabled, penalties of 0 (presence,
/// frequency) and 1 (repetition) are disabled. A repetition penalty `<= 0` is also disabled, so
/// zeroed params are inert; the frontend refuses it.
///
/// Penalties are applied to the logits before temperature and the filters, as vLLM's
/// `apply_penalties` does (see `baton_worker::penalty`); log-probabilities stay those of the raw
/// logits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SamplingParams {
    /// Softmax temperature; `0` selects the argmax.
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; `<= 0` disables.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` times the top probability.
    pub min_p: f32,
    /// Seed of the request's own random stream. Unseeded requests get a random seed at
    /// admission, so every request has one; the stream is indexed by output position
    /// (counter-based), never by row or batch.
    pub seed: u64,
    /// Number of top log-probabilities to return per sampled token (0..=[`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: u32,
    /// 1 if the sampled token's log-probability is wanted.
    pub want_logprob: u32,
    /// OpenAI `presence_penalty`, in `[-2, 2]`: subtracted once from the logit of every token
    /// that occurs among the request's outputs so far.
    pub presence_penalty: f32,
    /// OpenAI `frequency_penalty`, in `[-2, 2]`: subtracted from a token's logit once per
    /// occurrence among the outputs so far.
    pub frequency_penalty: f32,
    /// vLLM `repetition_penalty` (the CTRL penalty, Keskar et al. 2019), `> 0`: a token that
    /// occurs in the prompt or the outputs has a positive logit divided by it and a negative one
    /// multiplied by it. 1 (or `<= 0`) disables.
    pub repetition_penalty: f32,
    /// Entries of the request's logit bias (OpenAI `logit_bias`), at most [`MAX_LOGIT_BIAS`]:
    /// the scheduler writes them into the slot's row of [`SlotTables`] when the request takes
    /// its slot, and the worker reads this many. 0: none. On a launch row the scheduler adds
    /// the `min_tokens` stop-id mask entries while they apply.
    pub logit_bias_len: u32,
    /// 1: vLLM's `allowed_token_ids`. The logit-bias entries are then also an allow-list:
    /// every token without one is excluded from sampling (as if its logit were `-inf`; the
    /// log-probabilities stay the raw ones). 0: off. Requires `logit_bias_len > 0`.
    pub allowed_only: u32,
    /// Prompt log-probabilities (OpenAI `echo` with `logprobs`, vLLM's `prompt_logprobs`):
    /// 0 for none, else one more than the number of top log-probabilities wanted per prompt
    /// position (1..=[`MAX_TOP_LOGPROBS`] + 1). On a launch row it is set only while the row
    /// covers prompt positions whose log-probabilities are still owed (see
    /// [`LaunchRow::scores_prompt`]); the worker then reports a [`PromptLogprob`] for each
    /// position of the row whose next token is known.
    pub prompt_logprobs: u32,
    /// 1: structured output. Only the tokens set in the slot's row of the token-mask table
    /// ([`SlotTables::token_mask`], written by the scheduler before it publishes the row) may
    /// be sampled; every other logit is `-inf` before the draw and the log-probabilities, as
    /// vLLM applies its grammar bitmask to the logits. 0: off. Set only on sampling rows.
    pub token_mask: u32,
    /// Zero (keeps the record free of implicit padding; 64 bytes).
    pub reserved: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding with no log-probabilities.
    pub const fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            top_logprobs: 0,
            want_logprob: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias_len: 0,
            allowed_only: 0,
            prompt_logprobs: 0,
            token_mask: 0,
            reserved: 0,
        }
    }

    /// True when this samples the argmax (of the penalized logits, see
    /// [`SamplingParams::has_penalties`]).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// True when the repetition penalty is in effect (`> 0` and not 1).
    pub fn has_repetition_penalty(&self) -> bool {
        self.repetition_penalty > 0.0 && self.repetition_penalty != 1.0
    }

    /// True when any penalty is in effect: sampling this row then depends on the request's
    /// token history, not only on its logits.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.has_repetition_penalty()
    }

    /// The number of top log-probabilities per prompt position, when prompt log-probabilities
    /// are wanted (see [`SamplingParams::prompt_logprobs`]).
    pub fn prompt_top(&self) -> Option<usize> {
        (self.prompt_logprobs > 0)
            .then(|| (self.prompt_logprobs as usize - 1).min(MAX_TOP_LOGPROBS))
    }

    /// True when the sampler changes logits before drawing: penalties or a logit bias.
    pub fn adjusts_logits(&self) -> bool {
        self.logit_bias_len > 0 || self.has_penalties()
    }
}

/// The most top log-probabilities a row may ask for (OpenAI allows 20).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The most logit-bias entries a request may carry.
pub const MAX_LOGIT_BIAS: usize = 300;

/// The most stop ids (EOS included) a request with `min_tokens > 0` may have: while it has
/// fewer outputs than `min_tokens`, the scheduler masks them through `-inf` entries after the
/// request's logit bias in the slot's row of the logit-bias table (vLLM's `min_tokens`).
pub const MAX_MIN_TOKENS_STOP_IDS: usize = 64;

/// Sentinel for [`LaunchRow::pending_launch`]: the row's first input token is in the token table.
pub const NOT_PENDING: LaunchSeq = 0;

/// One row of a launch: a contiguous run of positions of one request.
///
/// The row's input tokens are positions `first_pos .. first_pos + num_tokens` of the request's
/// token table, except when `pending_launch != NOT_PENDING`: then the token at `first_pos` is the
/// one sampled by row `pending_row` of launch `pending_launch`, not yet in the table, and the
/// worker resolves it from the ids it kept.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct LaunchRow {
    /// The request this row computes.
    pub req: SlotRef,
    /// First position computed by this row (equals the request's `computed_len` at preparation).
    pub first_pos: u32,
    /// Number of positions computed (1 for a decode, the chunk length for a prefill chunk).
    pub num_tokens: u32,
    /// How many entries of the request's block table are valid for this launch; they cover
    /// positions `0 .. first_pos + num_tokens`.
    pub num_blocks: u32,
    /// 1 if this row samples a token after its last position (the last prefill chunk or a decode).
    pub sample: u32,
    /// See the type's doc; [`NOT_PENDING`] when the input is in the token table.
    pub pending_launch: LaunchSeq,
    /// Row index within `pending_launch` whose sampled id is this row's first input.
    pub pending_row: u32,
    /// Index of the token this row samples among the request's outputs (the RNG counter).
    pub output_index: u32,
    /// The LoRA adapter the row runs with: 0 for the base model, `i + 1` for the `i`-th
    /// `--lora-modules` entry (the same list in every process: the scheduler publishes its
    /// fingerprint, [`plane::PlaneLimits::lora_fingerprint`]).
    pub lora: u32,
    /// Zero (keeps the record free of implicit padding).
    pub reserved: u32,
    /// Sampling parameters (used when `sample == 1`).
    pub params: SamplingParams,
}

impl LaunchRow {
    /// Positions whose logits score the next prompt token, when this row reports prompt
    /// log-probabilities (`params.prompt_logprobs > 0`): every position of the row except
    /// the last one of a sampling row (its logits sample instead). The token scored by the
    /// logits at position `p` is the one at `p + 1`, in the token table (the prompt is
    /// written at admission). Empty for other rows.
    pub fn scores_prompt(&self) -> std::ops::Range<u32> {
        if self.params.prompt_logprobs == 0 {
            return self.first_pos..self.first_pos;
        }
        let end = self.first_pos + self.num_tokens - self.sample.min(1);
        self.first_pos..end
    }
}

/// The most positions, summed over a launch's rows, that may report prompt log-probabilities
/// ([`LaunchRow::scores_prompt`]); the scheduler shortens such rows to stay within it. It
/// bounds the logits a worker materializes for them (`positions x vocab` f32) and the
/// completion slots they take.
pub const MAX_PROMPT_LOGPROB_POSITIONS: usize = 256;

/// The log-probability of one prompt token given the tokens before it, as a worker reports it
/// for a row with [`SamplingParams::prompt_logprobs`]: from the raw logits at position
/// `pos - 1` (temperature 1, no penalty or bias, as vLLM's `prompt_logprobs`).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    /// Row index within the launch.
    pub row: u32,
    /// The request the row belonged to.
    pub req: SlotRef,
    /// The scored token's position (>= 1; position 0 has no log-probability).
    pub pos: u32,
    /// The token at `pos`.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// Its rank in the vocabulary at `pos`: 1 + the number of tokens strictly more likely
    /// (vLLM's `Logprob.rank`).
    pub rank: u32,
    /// Top log-probabilities at `pos`, `(token, logprob)`, most likely first (ties to the
    /// lower id), as many as the row asked for.
    pub top: Vec<(u32, f32)>,
}

/// A launch record as the in-process engine and the worker see it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Launch {
    /// Sequence number, strictly increasing.
    pub seq: LaunchSeq,
    /// Rows, in the order the worker lays them out.
    pub rows: Vec<LaunchRow>,
}

/// The sampled result of one row.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// Row index within the launch.
    pub row: u32,
    /// The request the row belonged to.
    pub req: SlotRef,
    /// Sampled token id.
    pub token: u32,
    /// Log-probability of `token` under the unmodified (temperature 1) distribution, if asked.
    pub logprob: f32,
    /// Top log-probabilities, `(token, logprob)`, most likely first, if asked.
    pub top: Vec<(u32, f32)>,
}

/// What a worker reports after the fence of one launch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    /// The launch this completes.
    pub seq: LaunchSeq,
    /// One entry per row with `sample == 1`, in row order.
    pub sampled: Vec<Sampled>,
    /// Prompt log-probabilities of the rows that asked for them, in row then position order.
    pub prompt: Vec<PromptLogprob>,
}

impl Completion {
    /// The completion of `launch` in which every sampling row samples `token(row)`, with
    /// log-probability 0, no top entries and no prompt log-probabilities: what the null
    /// backend returns, and what scheduler tests and benchmarks feed back.
    pub fn sampling(launch: &Launch, mut token: impl FnMut(&LaunchRow) -> u32) -> Self {
        Self {
            seq: launch.seq,
            sampled: launch
                .rows
                .iter()
                .enumerate()
                .filter(|(_, r)| r.sample == 1)
                .map(|(i, r)| Sampled {
                    row: i as u32,
                    req: r.req,
                    token: token(r),
                    logprob: 0.0,
                    top: Vec::new(),
                })
                .collect(),
            prompt: Vec::new(),
        }
    }
}

/// Token and block tables, one row per request slot.
///
/// Only the scheduler writes; the worker reads. Entries a published launch refers to are never
/// rewritten while that launch is unreleased (block tables are append-only per request, and a
/// slot is reused only after reclamation), so relaxed atomics suffice here: the ring's
/// Release/Acquire pair on the launch record orders the writes before the worker's reads.
pub struct SlotTables<S: AsRef<[AtomicU32]>> {
    tokens: S,
    blocks: S,
    /// [`MAX_LOGIT_BIAS`] `(token, bias as f32 bits)` pairs per slot.
    bias: S,
    /// `mask_words` words per slot: the token mask of the slot's next guided sampling row.
    mask: S,
    max_model_len: usize,
    max_blocks_per_seq: usize,
    mask_words: usize,
}

/// `u32` words of a token mask over a vocabulary of `vocab_size` ids (bit `t % 32` of word
/// `t / 32` is token `t`; see [`SamplingParams::token_mask`]).
pub const fn token_mask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// `u32` words of one slot's row in the logit-bias table: the request's bias, then its
/// `min_tokens` stop-id mask.
pub const LOGIT_BIAS_WORDS: usize = 2 * (MAX_LOGIT_BIAS + MAX_MIN_TOKENS_STOP_IDS);

/// Heap-backed tables for the in-process engine and tests.
pub type HeapSlotTables = SlotTables<Box<[AtomicU32]>>;

impl HeapSlotTables {
    /// Zeroed tables for `max_seqs` slots of `max_model_len` tokens and `max_blocks_per_seq`
    /// block-table entries each, with no token-mask table (no structured outputs).
    pub fn new_heap(max_seqs: usize, max_model_len: usize, max_blocks_per_seq: usize) -> Self {
        Self::new_heap_masked(max_seqs, max_model_len, max_blocks_per_seq, 0)
    }

    /// As [`HeapSlotTables::new_heap`], with `mask_words` ([`token_mask_words`] of the
    /// vocabulary) words of token mask per slot.
    pub fn new_heap_masked(
        max_seqs: usize,
        max_model_len: usize,
        max_blocks_per_seq: usize,
        mask_words: usize,
    ) -> Self {
        let mk = |n: usize| (0..n).map(|_| AtomicU32::new(0)).collect::<Box<[_]>>();
        Self {
            tokens: mk(max_seqs * max_model_len),
            blocks: mk(max_seqs * max_blocks_per_seq),
            bias: mk(max_seqs * LOGIT_BIAS_WORDS),
            mask: mk(max_seqs * mask_words),
            max_model_len,
            max_blocks_per_seq,
            mask_words,
        }
    }
}

impl<S: AsRef<[AtomicU32]>> SlotTables<S> {
    /// Wraps existing storage (for example regions of the shared segment).
    /// `tokens.len()` must be `max_seqs * max_model_len`, `blocks.len()`
    /// `max_seqs * max_blocks_per_seq`, `bias.len()` `max_seqs * LOGIT_BIAS_WORDS` and
    /// `mask.len()` `max_seqs * mask_words`.
    pub fn from_parts(
        tokens: S,
        blocks: S,
        bias: S,
        mask: S,
        max_model_len: usize,
        max_blocks_per_seq: usize,
        mask_words: usize,
    ) -> Self {
        Self {
            tokens,
            blocks,
            bias,
            mask,
            max_model_len,
            max_blocks_per_seq,
            mask_words,
        }
    }

    /// Words of one slot's token mask (0: the tables have no mask table).
    pub fn mask_words(&self) -> usize {
        self.mask_words
    }

    /// The token-mask row of `slot` ([`SlotTables::mask_words`] words): the scheduler writes
    /// it before publishing a guided sampling row of the slot, and rewrites it only after that
    /// row's completion (a guided request has at most one sampling row in flight).
    pub fn token_mask(&self, slot: u32) -> &[AtomicU32] {
        &self.mask.as_ref()[slot as usize * self.mask_words..][..self.mask_words]
    }

    /// Copies the token-mask row of `slot` into `out` (cleared first).
    pub fn read_token_mask(&self, slot: u32, out: &mut Vec<u32>) {
        out.clear();
        out.extend(
            self.token_mask(slot)
                .iter()
                .map(|w| w.load(Ordering::Relaxed)),
        );
    }

    /// Writes the token-mask row of `slot` (scheduler only); `words.len()` must be
    /// [`SlotTables::mask_words`].
    pub fn set_token_mask(&self, slot: u32, words: &[u32]) {
        for (w, &v) in self.token_mask(slot).iter().zip(words) {
            w.store(v, Ordering::Relaxed);
        }
    }

    /// Sets (`allowed`) or clears the bit of `token` in the token-mask row of `slot`
    /// (scheduler only, under the same rule as [`SlotTables::set_token_mask`]). A token past
    /// the row is ignored.
    pub fn set_token_allowed(&self, slot: u32, token: u32, allowed: bool) {
        if let Some(w) = self.token_mask(slot).get(token as usize / 32) {
            let bit = 1u32 << (token % 32);
            let v = w.load(Ordering::Relaxed);
            w.store(if allowed { v | bit } else { v & !bit }, Ordering::Relaxed);
        }
    }

    /// Tokens per slot.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Block-table entries per slot.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_blocks_per_seq
    }

    /// Token at `pos` of `slot`. Panics on an out-of-range index (a scheduler bug).
    pub fn token(&self, slot: u32, pos: usize) -> u32 {
        self.tokens.as_ref()[slot as usize * self.max_model_len + pos].load(Ordering::Relaxed)
    }

    /// Writes the token at `pos` of `slot` (scheduler only).
    pub fn set_token(&self, slot: u32, pos: usize, id: u32) {
        self.tokens.as_ref()[slot as usize * self.max_model_len + pos].store(id, Ordering::Relaxed)
    }

    /// Copies tokens `range` of `slot` into `out`.
    pub fn read_tokens(&self, slot: u32, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        let base = slot as usize * self.max_model_len;
        out.extend(
            self.tokens.as_ref()[base + range.start..base + range.end]
                .iter()
                .map(|t| t.load(Ordering::Relaxed)),
        );
    }

    /// Writes the logit-bias row of the request taking `slot` (scheduler only, when the slot is
    /// taken): its bias then its `min_tokens` mask, at most `LOGIT_BIAS_WORDS / 2` entries in
    /// all (admission refuses more).
    pub fn set_logit_bias(&self, slot: u32, bias: &[(u32, f32)]) {
        let row = &self.bias.as_ref()[slot as usize * LOGIT_BIAS_WORDS..][..LOGIT_BIAS_WORDS];
        for (w, &(t, b)) in row.chunks_exact(2).zip(bias) {
            w[0].store(t, Ordering::Relaxed);
            w[1].store(b.to_bits(), Ordering::Relaxed);
        }
    }

    /// Appends the first `n` (at most `LOGIT_BIAS_WORDS / 2`) logit-bias entries of `slot` to
    /// `out`.
    pub fn read_logit_bias(&self, slot: u32, n: usize, out: &mut Vec<(u32, f32)>) {
        let row = &self.bias.as_ref()[slot as usize * LOGIT_BIAS_WORDS..][..LOGIT_BIAS_WORDS];
        out.extend(row.chunks_exact(2).take(n).map(|w| {
            (
                w[0].load(Ordering::Relaxed),
                f32::from_bits(w[1].load(Ordering::Relaxed)),
            )
        }));
    }

    /// Block-table entry `i` (a page id) of `slot`.
    pub fn block(&self, slot: u32, i: usize) -> u32 {
        self.blocks.as_ref()[slot as usize * self.max_blocks_per_seq + i].load(Ordering::Relaxed)
    }

    /// Appends/writes block-table entry `i` of `slot` (scheduler only, append-only per request).
    pub fn set_block(&self, slot: u32, i: usize, page: u32) {
        self.blocks.as_ref()[slot as usize * self.max_blocks_per_seq + i]
            .store(page, Ordering::Relaxed)
    }

    /// Copies the first `n` block-table entries of `slot` into `out`.
    pub fn read_blocks(&self, slot: u32, n: usize, out: &mut Vec<u32>) {
        let base = slot as usize * self.max_blocks_per_seq;
        out.extend(
            self.blocks.as_ref()[base..base + n]
                .iter()
                .map(|b| b.load(Ordering::Relaxed)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_row_is_plain_data_of_stable_size() {
        // The ring slot layout depends on this size; a change must be deliberate.
        assert_eq!(std::mem::size_of::<LaunchRow>(), 112);
        assert_eq!(std::mem::size_of::<SamplingParams>(), 64);
    }

    #[test]
    fn a_row_scores_every_position_but_the_one_it_samples_from() {
        let mut row = LaunchRow::zeroed();
        row.first_pos = 8;
        row.num_tokens = 5;
        assert!(row.scores_prompt().is_empty(), "not asked");
        row.params.prompt_logprobs = 1;
        assert_eq!(row.scores_prompt(), 8..13, "a chunk inside the prompt");
        row.sample = 1;
        assert_eq!(row.scores_prompt(), 8..12, "the last chunk samples at 12");
        assert_eq!(row.params.prompt_top(), Some(0));
        row.params.prompt_logprobs = 1 + 50;
        assert_eq!(row.params.prompt_top(), Some(MAX_TOP_LOGPROBS));
    }

    #[test]
    fn slot_tables_keep_slots_apart() {
        let t = HeapSlotTables::new_heap(3, 8, 2);
        t.set_token(1, 7, 42);
        t.set_block(2, 1, 9);
        assert_eq!(t.token(1, 7), 42);
        assert_eq!(t.token(2, 0), 0);
        assert_eq!(t.block(2, 1), 9);
        let mut v = Vec::new();
        t.read_blocks(2, 2, &mut v);
        assert_eq!(v, vec![0, 9]);
        t.set_logit_bias(1, &[(5, -100.0), (7, 2.5)]);
        let mut b = Vec::new();
        t.read_logit_bias(1, 2, &mut b);
        t.read_logit_bias(2, 1, &mut b);
        assert_eq!(b, vec![(5, -100.0), (7, 2.5), (0, 0.0)]);
    }
}
