//! The scheduler core: FCFS continuous batching with chunked prefill over a paged KV cache.
//!
//! Contract: the scheduler is the only writer of request state, block tables and token tables.
//! `schedule` prepares one launch (pages are allocated here, not at admission) and publishes it
//! read-only; `on_completion` accepts sampled tokens of live requests and suppresses the rest;
//! `on_released` reclaims pages and slots retired after launches every consumer has released.
//! A request that ends, is cancelled or is preempted retires its pages and slot after its last
//! launch; they are never reclaimed before that launch's fence.
//!
//! Prefix caching (`enable_prefix_caching`): when a request takes a slot, the leading full
//! blocks of its known history whose whole prefix matches a block computed before are taken
//! from the cache (shared pages, counted as computed) and only the rest is prefilled; at least
//! its last known position is always computed, so its first launch samples. A block is
//! registered once the request's `computed_len` covers it (its KV is written and fenced), and it
//! is never written again. A dead worker takes the cache with it.

use crate::request::{FinishReason, Guided, NewRequest, Request, RequestId, State};
use crate::trace::{Boundary, TraceRecord, Tracer};
use baton_kv::{PagePool, PoolStats, PrefixHasher, SlotAllocator};
use baton_proto::{
    Completion, HeapSlotTables, Launch, LaunchRow, LaunchSeq, SlotRef, SlotTables, MAX_LOGIT_BIAS,
    MAX_MIN_TOKENS_STOP_IDS, MAX_PROMPT_LOGPROB_POSITIONS, MAX_TOP_LOGPROBS, NOT_PENDING,
};
use rustc_hash::FxHashMap as HashMap;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

/// A block-table entry of a request's `blocks` before its `released_blocks` that it never
/// held (a sliding-window prefix hit whose leading blocks were not cached); never read.
const UNHELD_PAGE: u32 = u32::MAX;

/// Limits and policy knobs. The same limits are published to frontends (segment header), so both
/// sides validate against the same values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests running at once (and request slots).
    pub max_num_seqs: usize,
    /// Most positions computed in one launch (prefill chunks plus decodes).
    pub max_num_batched_tokens: usize,
    /// Tokens per KV page.
    pub block_size: usize,
    /// Pages in the KV pool.
    pub num_blocks: usize,
    /// Most tokens (prompt plus outputs) a request may hold.
    pub max_model_len: usize,
    /// Most launches published and not yet completed: 1 is synchronous scheduling, 2 is
    /// asynchronous scheduling (launch `s+1` is prepared before completion `s` arrives).
    pub max_inflight: usize,
    /// Reuse the KV of full blocks whose whole prefix matches a block computed before
    /// (automatic prefix caching, vLLM's `--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// The order waiting requests start in and running requests are preempted in (vLLM's
    /// `--scheduling-policy`).
    pub policy: SchedulingPolicy,
    /// The largest sliding window of the model's layers, in keys, when every layer has one
    /// ([`sliding_window_kv`]); `None` when any layer attends to every key. A row whose first
    /// query is at position `p` reads no key before `p + 1 - w`, and neither does any later
    /// row of the request, so the pages wholly before that are retired then, after the
    /// request's previous launch (the last that may read them), as vLLM's sliding-window KV
    /// manager frees them; a request then holds about a window of pages, not its whole length
    /// ([`SchedulerConfig::request_pages`]). With prefix caching only pages already
    /// registered (or cache hits) are released, so a released page keeps its block key for
    /// later hits, and a cache hit holds only the pages its first row's window reads.
    pub kv_window: Option<usize>,
}

/// How the scheduler orders requests (vLLM's `--scheduling-policy`).
///
/// Either way running requests are planned before waiting ones, and a waiting request never
/// preempts a running one: preemption happens only when a running request needs a page and
/// none is free or coming back. A step that preempted starts no waiting request (vLLM V1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served: waiting requests start in admission order (a preempted one
    /// goes back to the front), and the most recently started running request is preempted
    /// first.
    #[default]
    Fcfs,
    /// By each request's `priority` (lower first), then by admission order, as vLLM's
    /// `priority` policy orders by `(priority, arrival_time)`: waiting requests start in that
    /// order, a preempted one goes back to its place in it, and the running request that
    /// comes last in it (least urgent, latest admitted) is preempted first.
    Priority,
}

impl SchedulingPolicy {
    /// The flag's spelling: `fcfs` or `priority`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fcfs => "fcfs",
            Self::Priority => "priority",
        }
    }
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = String;

    /// Parses `fcfs` or `priority`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            _ => Err(format!(
                "unknown scheduling policy {s:?}: use fcfs or priority"
            )),
        }
    }
}

impl SchedulerConfig {
    /// Block-table entries a request can need.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_model_len.div_ceil(self.block_size)
    }

    /// The most KV pages a request that computes `positions` positions holds at once, which
    /// is what the pool must have for it to run alone (admission refuses more).
    ///
    /// Without a window: every position's page, `ceil(positions / block_size)`. With a
    /// window `w` ([`SchedulerConfig::kv_window`]), a row computing `n <=
    /// max_num_batched_tokens` positions from `first` holds the pages of positions
    /// `first + 1 - w .. first + n` (the earlier ones are retired before its pages are
    /// allocated, and it waits for them to come back rather than preempt itself), at most
    /// `ceil((w - 1 + n) / block_size) + 1` pages, as vLLM's `SlidingWindowSpec` sizes it.
    /// With prefix caching, the pages of rows still in flight are registered (and so
    /// released) only at their completion: with `max_inflight` launches in flight the span is
    /// `max(w - 1, (max_inflight - 1) * max_num_batched_tokens) + n`. Never more than without
    /// a window.
    pub fn request_pages(&self, positions: usize) -> usize {
        let all = positions.max(1).div_ceil(self.block_size);
        let Some(w) = self.kv_window.filter(|&w| w > 0) else {
            return all;
        };
        let span = (w - 1)
            .max(self.unregistered_positions())
            .saturating_add(self.max_num_batched_tokens);
        all.min(span.div_ceil(self.block_size).saturating_add(1))
    }

    /// Positions a request may still hold behind its window because their chunks are in
    /// flight and so not yet registered: with prefix caching, `(max_inflight - 1) *
    /// max_num_batched_tokens`, else 0 (see [`SchedulerConfig::request_pages`]).
    pub fn unregistered_positions(&self) -> usize {
        if self.enable_prefix_caching {
            self.max_inflight
                .saturating_sub(1)
                .saturating_mul(self.max_num_batched_tokens)
        } else {
            0
        }
    }

    /// The first block a query at `pos` reads under the window ([`SchedulerConfig::kv_window`]):
    /// every block before it lies wholly before `pos + 1 - w`; 0 without a window.
    pub fn first_window_block(&self, pos: usize) -> usize {
        self.kv_window
            .filter(|&w| w > 0)
            .map_or(0, |w| (pos + 1).saturating_sub(w) / self.block_size)
    }

    /// [`SchedulerConfig::request_pages`] of the longest request: `max_model_len` computed
    /// positions (a prompt that fills the context, scored with `max_tokens == 0`; one that
    /// samples computes `max_model_len - 1`, the last sampled token's KV never being computed).
    pub fn max_request_pages(&self) -> usize {
        self.request_pages(self.max_model_len)
    }
}

/// Why a request was refused at admission.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdmitError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt leaves no room for one new token.
    #[error("the prompt has {prompt} tokens; this model's maximum context length is {max_model_len} tokens, which leaves no room for a new token")]
    PromptTooLong { prompt: usize, max_model_len: usize },
    /// The request could never fit in the KV pool, even alone.
    #[error("the request needs up to {needed} KV pages but the pool has only {total}")]
    TooLargeForPool { needed: usize, total: usize },
    /// A live request already has this id.
    #[error("request id {0} is already live")]
    DuplicateId(RequestId),
    /// A token id is outside the vocabulary.
    #[error("token id {id} is out of range for a vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    /// The logit bias is too long, disagrees with `params.logit_bias_len`, names a token
    /// outside the vocabulary or has a non-finite bias.
    #[error("bad logit_bias: {0}")]
    BadLogitBias(String),
    /// `min_tokens > 0` with more stop ids (EOS included) than the mask holds.
    #[error("min_tokens is supported with at most {} stop token ids (EOS included), this request has {stops}", MAX_MIN_TOKENS_STOP_IDS)]
    MinTokensStopIds { stops: usize },
    /// `params.prompt_logprobs` asks for more than [`baton_proto::MAX_TOP_LOGPROBS`] top
    /// entries per prompt position.
    #[error("prompt log-probabilities are supported with at most {most} top entries, this request asks for {asked}")]
    TooManyPromptLogprobs { asked: u32, most: usize },
    /// A structured output that cannot run here: the scheduler has no token-mask table (no
    /// vocabulary), it is combined with `min_tokens` or `allowed_only`, or its guide failed.
    #[error("structured output: {0}")]
    Guided(String),
    /// A `priority` other than 0 under [`SchedulingPolicy::Fcfs`] (vLLM refuses it too).
    #[error("got priority {0} but priority scheduling is not enabled (the scheduler runs with --scheduling-policy fcfs)")]
    PriorityNotEnabled(i32),
    /// `bad_words` with an empty word, a token outside the vocabulary, more than
    /// [`baton_proto::wire::MAX_BAD_WORDS_WORDS`] words once packed, or no token-mask table.
    #[error("bad_words: {0}")]
    BadWords(String),
}

/// What the scheduler tells the request's owner.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A new output token of `id`.
    Token {
        /// The request.
        id: RequestId,
        /// The token.
        token: u32,
        /// Prompt tokens the request took from the prefix cache (fixed when it first took a
        /// slot), so that a sequence ended by a stop string still reports them.
        cached_tokens: usize,
        /// Its log-probability, if asked.
        logprob: f32,
        /// Top log-probabilities, if asked.
        top: Vec<(u32, f32)>,
    },
    /// The log-probability of prompt token `token` at position `pos` of `id` (requests with
    /// `params.prompt_logprobs`). Each position from 1 to `prompt_len - 1` comes once, in
    /// order, before the request's first `Token`.
    PromptLogprob {
        /// The request.
        id: RequestId,
        /// The scored token's position.
        pos: u32,
        /// The token at `pos`.
        token: u32,
        /// Its log-probability given the tokens before it.
        logprob: f32,
        /// Its rank among the vocabulary (1: the most likely).
        rank: u32,
        /// Top log-probabilities at `pos`.
        top: Vec<(u32, f32)>,
    },
    /// The request ended; no further event for `id` follows.
    Finished {
        /// The request.
        id: RequestId,
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens published.
        output_tokens: usize,
        /// Prompt positions taken from the prefix cache when the request first took a slot
        /// (at most `prompt_tokens - 1`).
        cached_tokens: usize,
    },
}

/// Index of a live request in the scheduler's slab. Reused after the request ends, so a
/// reference to it from an earlier launch is checked against the request's slot (whose
/// generation changes on every reuse), as a request id would be.
type Idx = u32;

/// Where `idx` goes in `list`, which is sorted by [`SchedulingPolicy::Priority`]'s key
/// `(priority, arrival)`: after every entry whose key is not greater than its own.
fn priority_position(requests: &Requests, list: &[Idx], idx: Idx) -> usize {
    let key = |i: Idx| {
        let r = &requests[i];
        (r.priority, r.arrival)
    };
    let k = key(idx);
    list.partition_point(|&w| key(w) <= k)
}

/// One row of a launch as the scheduler remembers it until the completion.
#[derive(Clone, Copy, Debug)]
struct RowMeta {
    id: RequestId,
    req: Idx,
    slot: SlotRef,
    first_pos: u32,
    num_tokens: u32,
}

/// Per-launch bookkeeping kept until the launch's completion.
#[derive(Debug)]
struct Inflight {
    seq: LaunchSeq,
    /// One entry per row, in row order.
    rows: Vec<RowMeta>,
}

/// Live requests in a slab (indexed per row without hashing), with an id map for the calls
/// that name a request by id.
#[derive(Debug, Default)]
struct Requests {
    slab: Vec<Option<Request>>,
    /// Free slab indices; the most recently freed is reused first.
    free: Vec<Idx>,
    ids: HashMap<RequestId, Idx>,
}

impl Requests {
    fn insert(&mut self, r: Request) -> Idx {
        let id = r.id;
        let i = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(r);
                i
            }
            None => {
                self.slab.push(Some(r));
                (self.slab.len() - 1) as Idx
            }
        };
        self.ids.insert(id, i);
        i
    }

    fn remove(&mut self, i: Idx) -> Request {
        let r = self.slab[i as usize].take().expect("live request");
        self.ids.remove(&r.id);
        self.free.push(i);
        r
    }

    fn find(&self, id: RequestId) -> Option<Idx> {
        self.ids.get(&id).copied()
    }

    fn get_id(&self, id: RequestId) -> Option<&Request> {
        self.find(id).map(|i| &self[i])
    }

    #[inline]
    fn try_get_mut(&mut self, i: Idx) -> Option<&mut Request> {
        self.slab.get_mut(i as usize).and_then(Option::as_mut)
    }

    fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

impl std::ops::Index<Idx> for Requests {
    type Output = Request;
    #[inline]
    fn index(&self, i: Idx) -> &Request {
        self.slab[i as usize].as_ref().expect("live request")
    }
}

impl std::ops::IndexMut<Idx> for Requests {
    #[inline]
    fn index_mut(&mut self, i: Idx) -> &mut Request {
        self.slab[i as usize].as_mut().expect("live request")
    }
}

/// A live request's lengths as the scheduler counts them (DESIGN.md section 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLengths {
    /// Prompt plus accepted outputs.
    pub known_len: usize,
    /// Positions whose KV is written and fenced.
    pub computed_len: usize,
    /// Positions included in published launches, fenced or not.
    pub scheduled_len: usize,
    /// Tokens being sampled by launches in flight (they take positions `known_len..`).
    pub sampling: usize,
    /// The request's slot while it holds one (running), `None` while it waits.
    pub slot: Option<SlotRef>,
    /// Positions taken from the prefix cache when it last took a slot (part of `computed_len`).
    pub cached_len: usize,
}

/// Counts for `/metrics` and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Requests admitted and not finished, waiting for their first (or next, after preemption) launch.
    pub waiting: usize,
    /// Requests holding a slot and pages.
    pub running: usize,
    /// Launches published and not completed.
    pub inflight: usize,
    /// Page pool counts.
    pub pool: PoolStats,
    /// Request slots retired and not yet reclaimed.
    pub slots_retired: usize,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Launches so far.
    pub launches: u64,
    /// Prompt positions looked up in the prefix cache so far, at requests' first starts
    /// (vLLM's `prefix_cache_queries`: a restart after a preemption or a worker's death is
    /// not counted, as vLLM keeps preempted requests' lookups apart).
    pub prefix_cache_queries: u64,
    /// Of those, positions found (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits: u64,
}

/// The scheduler core. Drive it with [`Scheduler::schedule`], [`Scheduler::on_completion`] and
/// [`Scheduler::on_released`]; it does no I/O besides the optional trace.
pub struct Scheduler<S: AsRef<[AtomicU32]> = Box<[AtomicU32]>> {
    cfg: SchedulerConfig,
    vocab_size: usize,
    pool: PagePool,
    slots: SlotAllocator,
    tables: Arc<SlotTables<S>>,
    requests: Requests,
    /// Waiting requests in the order they start: see [`SchedulingPolicy`].
    waiting: VecDeque<Idx>,
    /// Running requests, the one preempted first last: in the order they took their slot
    /// (`Fcfs`), or by `(priority, arrival)` (`Priority`).
    running: Vec<Idx>,
    /// The next request's arrival number (admission order, for `Priority`).
    next_arrival: u64,
    inflight: VecDeque<Inflight>,
    /// Row lists of completed launches, kept for reuse.
    spare_rows: Vec<Vec<RowMeta>>,
    /// Requests that took their first slot in the latest `schedule()` call.
    started: Vec<RequestId>,
    next_seq: LaunchSeq,
    released: LaunchSeq,
    preemptions: u64,
    trace: Option<Tracer>,
    scratch_pages: Vec<u32>,
    scratch_tokens: Vec<u32>,
    /// A token mask being composed (guide and bad words) before it is written to a slot.
    scratch_mask: Vec<u32>,
    /// The latest outputs of a request with bad words, oldest first.
    scratch_recent: Vec<u32>,
    hasher: PrefixHasher,
    prefix_queries: u64,
    prefix_hits: u64,
    /// Guided requests that accepted a token in the completion being handled: their next
    /// masks are computed together at its end ([`Scheduler::fill_guided_masks`]).
    guided_fill: Vec<Idx>,
    /// Threads for those masks (built on first use; `None` before, or if it could not start).
    guide_pool: Option<rayon::ThreadPool>,
}

impl Scheduler<Box<[AtomicU32]>> {
    /// A scheduler with heap-backed token and block tables (the in-process engine).
    pub fn new_local(cfg: SchedulerConfig, vocab_size: usize) -> Self {
        let tables = Arc::new(HeapSlotTables::new_heap_masked(
            cfg.max_num_seqs,
            cfg.max_model_len,
            cfg.max_blocks_per_seq(),
            baton_proto::token_mask_words(vocab_size),
        ));
        Self::with_tables(cfg, vocab_size, tables)
    }
}

impl<S: AsRef<[AtomicU32]>> Scheduler<S> {
    /// A scheduler over existing tables (for example regions of the shared segment), which must
    /// have `cfg.max_num_seqs` slots of `cfg.max_model_len` tokens and
    /// `cfg.max_blocks_per_seq()` entries.
    pub fn with_tables(
        cfg: SchedulerConfig,
        vocab_size: usize,
        tables: Arc<SlotTables<S>>,
    ) -> Self {
        assert!(cfg.block_size > 0 && cfg.max_inflight > 0 && cfg.max_num_seqs > 0);
        let mut cfg = cfg;
        cfg.kv_window = cfg.kv_window.filter(|&w| w > 0);
        Self {
            pool: PagePool::new(cfg.num_blocks),
            slots: SlotAllocator::new(cfg.max_num_seqs),
            vocab_size,
            tables,
            requests: Requests::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival: 0,
            inflight: VecDeque::new(),
            spare_rows: Vec::new(),
            started: Vec::new(),
            next_seq: 1,
            released: 0,
            preemptions: 0,
            trace: None,
            scratch_pages: Vec::new(),
            scratch_tokens: Vec::new(),
            scratch_mask: Vec::new(),
            scratch_recent: Vec::new(),
            hasher: PrefixHasher::new(),
            prefix_queries: 0,
            prefix_hits: 0,
            guided_fill: Vec::new(),
            guide_pool: None,
            cfg,
        }
    }

    /// Writes the lifecycle trace to `tracer`.
    pub fn set_tracer(&mut self, tracer: Tracer) {
        self.trace = Some(tracer);
    }

    /// Flushes the trace, if any.
    pub fn flush_trace(&mut self) {
        if let Some(t) = &mut self.trace {
            t.flush();
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The token and block tables the worker reads.
    pub fn tables(&self) -> &Arc<SlotTables<S>> {
        &self.tables
    }

    /// Requests that took a slot for the first time (not a relaunch after preemption or a
    /// worker's death) in the latest [`Scheduler::schedule`] call: their first launch. Cleared
    /// by the next call; callers that time request phases read it after each call.
    pub fn started(&self) -> &[RequestId] {
        &self.started
    }

    /// Counts now.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            inflight: self.inflight.len(),
            pool: self.pool.stats(),
            slots_retired: self.slots.num_retired(),
            preemptions: self.preemptions,
            launches: self.next_seq - 1,
            prefix_cache_queries: self.prefix_queries,
            prefix_cache_hits: self.prefix_hits,
        }
    }

    /// True when no request is live and no launch is in flight.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty() && self.inflight.is_empty()
    }

    /// True when `id` is live.
    pub fn contains(&self, id: RequestId) -> bool {
        self.requests.find(id).is_some()
    }

    /// The last launch released by every consumer, as last reported to `on_released`.
    pub fn released(&self) -> LaunchSeq {
        self.released
    }

    /// The last launch published (0 before the first).
    pub fn last_launch(&self) -> LaunchSeq {
        self.next_seq - 1
    }

    /// The lengths and slot of live request `id`, as the scheduler counts them (for invariant
    /// checks in tests and for debugging).
    pub fn request_lengths(&self, id: RequestId) -> Option<RequestLengths> {
        self.requests.get_id(id).map(|r| RequestLengths {
            known_len: r.known_len(),
            computed_len: r.computed_len,
            scheduled_len: r.scheduled_len,
            sampling: r.inflight_samples.len(),
            slot: r.slot,
            cached_len: r.cached_len,
        })
    }

    fn emit(&mut self, f: impl FnOnce() -> TraceRecord) {
        if let Some(t) = &mut self.trace {
            t.emit(&f());
        }
    }

    fn req_record(b: Boundary, r: &Request) -> TraceRecord {
        TraceRecord {
            req: Some(r.id),
            known_len: Some(r.known_len()),
            computed_len: Some(r.computed_len),
            pending: Some(r.known_len().saturating_sub(r.computed_len)),
            ..TraceRecord::new(b)
        }
    }

    /// Admits a request. It waits for a slot and pages; nothing is allocated yet.
    pub fn add_request(&mut self, r: NewRequest) -> Result<(), AdmitError> {
        check_admission(&self.cfg, self.vocab_size, &r)?;
        if self.requests.find(r.id).is_some() {
            return Err(AdmitError::DuplicateId(r.id));
        }
        let words = self.tables.mask_words();
        if words != baton_proto::token_mask_words(self.vocab_size) {
            let no_table = "this scheduler has no token-mask table for the model's vocabulary";
            if r.guide.is_some() {
                return Err(AdmitError::Guided(no_table.into()));
            }
            if !r.bad_words.is_empty() {
                return Err(AdmitError::BadWords(no_table.into()));
            }
        }
        let mut req = Request::new(r);
        req.arrival = self.next_arrival;
        self.next_arrival += 1;
        if let Some(g) = &mut req.guide {
            g.mask.resize(words, 0);
            g.guide
                .fill_mask(&mut g.mask)
                .map_err(|e| AdmitError::Guided(e.to_string()))?;
        }
        self.emit(|| TraceRecord {
            owner: Some("scheduler".into()),
            ..Self::req_record(Boundary::Admission, &req)
        });
        let i = self.requests.insert(req);
        self.enqueue_waiting(i, false);
        Ok(())
    }

    /// Prepares and publishes the next launch, or `None` when nothing can run now (no work, the
    /// in-flight limit is reached, or the pages needed are coming back and the scheduler waits
    /// for their fence).
    pub fn schedule(&mut self) -> Option<Launch> {
        self.started.clear();
        if self.inflight.len() >= self.cfg.max_inflight {
            return None;
        }
        let seq = self.next_seq;
        let cap = self.running.len() + self.waiting.len().min(self.cfg.max_num_seqs);
        let mut rows: Vec<LaunchRow> = Vec::with_capacity(cap);
        let mut meta = self.spare_rows.pop().unwrap_or_default();
        meta.clear();
        meta.reserve(cap);
        let mut budget = self.cfg.max_num_batched_tokens;
        // Positions that may still report prompt log-probabilities in this launch.
        let mut lp_budget = MAX_PROMPT_LOGPROB_POSITIONS;

        // Running requests first, in admission order: decodes and prefill continuations.
        let mut waiting_for_fence = false;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let idx = self.running[i];
            match self.plan_row(idx, seq, budget, &mut lp_budget, &mut rows, &mut meta) {
                Plan::Row(n) => {
                    budget -= n;
                    i += 1;
                }
                Plan::Nothing => i += 1,
                Plan::NeedPages(deficit) => {
                    if self.pool.num_retired() >= deficit {
                        // Enough pages are coming back: wait for their fence rather than
                        // preempt (avoids a preemption cascade).
                        waiting_for_fence = true;
                        break;
                    }
                    // Preempt from the back (the most recently admitted), never a request
                    // that already has a row in this launch.
                    let victim = *self.running.last().expect("running is not empty");
                    if meta.iter().any(|m| m.req == victim) {
                        break;
                    }
                    self.preempt(victim);
                    preempted = true;
                    // `i` now indexes the next request, or the victim was `idx` itself.
                }
            }
        }

        // Then waiting requests, first come first served (by priority under `Priority`). A
        // step that preempted starts none, as vLLM V1's scheduler (`vllm/v1/core/sched/
        // scheduler.py`: waiting requests are scheduled only `if not preempted_reqs`): the pool
        // is short, and the pages a preemption freed are for the running requests' growth, not
        // for a new request that the next decode step would preempt again. A step with no row
        // yet still starts one, so a scheduler never returns `None` with work it could launch.
        let hold_waiting = preempted && !rows.is_empty();
        while !waiting_for_fence
            && !hold_waiting
            && budget > 0
            && self.running.len() < self.cfg.max_num_seqs
        {
            let Some(&idx) = self.waiting.front() else {
                break;
            };
            if self.restart_would_thrash(idx) {
                break;
            }
            let Some(slot) = self.slots.alloc() else {
                break;
            };
            {
                let r = &mut self.requests[idx];
                debug_assert!(r.blocks.is_empty() && r.inflight_samples.is_empty());
                debug_assert_eq!(r.tokens.len(), r.known_len);
                for (pos, &t) in r.tokens.iter().enumerate() {
                    self.tables.set_token(slot.slot, pos, t);
                }
                self.tables.set_logit_bias(slot.slot, &r.logit_bias);
                if !r.bad_words.is_empty() && r.guide.is_none() {
                    // The one-token words' bans, fixed for every sampling row (a longer
                    // word's bans come and go on top: `plan_row`).
                    let m = &mut self.scratch_mask;
                    m.clear();
                    m.resize(self.tables.mask_words(), u32::MAX);
                    crate::request::ban_bad_words(&r.bad_words, &[], m);
                    self.tables.set_token_mask(slot.slot, m);
                    r.bad_words_banned.clear();
                }
                r.slot = Some(slot);
                r.state = State::Running;
            }
            // A request that still owes prompt log-probabilities computes its prompt: cached
            // positions have no logits (as in vLLM, which skips the cache for them). It makes
            // no lookup, so it counts as no query either.
            let lookup =
                self.cfg.enable_prefix_caching && !self.requests[idx].owes_prompt_logprobs();
            if lookup {
                self.take_cached_prefix(idx, slot.slot);
            }
            match self.plan_row(idx, seq, budget, &mut lp_budget, &mut rows, &mut meta) {
                Plan::Row(n) => {
                    budget -= n;
                    self.waiting.pop_front();
                    self.push_running(idx);
                    let r = &mut self.requests[idx];
                    let first_start = r.prompt_cached.is_none();
                    if first_start {
                        self.started.push(r.id);
                    }
                    r.prompt_cached
                        .get_or_insert(r.cached_len.min(r.prompt_len - 1));
                    let r = &self.requests[idx];
                    // As vLLM's `PrefixCacheStats::record`, a restart's lookup (after a
                    // preemption or a worker's death) is not a new query: counting it would
                    // let a thrashing pool inflate the hit rate with its own recomputes.
                    if lookup && first_start {
                        self.prefix_queries += r.known_len as u64;
                        self.prefix_hits += r.cached_len as u64;
                    }
                    if r.cached_len > 0 && self.trace.is_some() {
                        let rec = TraceRecord {
                            owner: Some("scheduler".into()),
                            pages: Some(
                                r.blocks[r.released_blocks..r.cached_len / self.cfg.block_size]
                                    .to_vec(),
                            ),
                            evidence: Some(format!("prefix_cache_hit={}", r.cached_len)),
                            ..Self::req_record(Boundary::CacheHit, r)
                        };
                        self.emit(|| rec);
                    }
                }
                Plan::Nothing | Plan::NeedPages(_) => {
                    // Not enough pages to start it: give the slot and any cache hits back
                    // (never launched) and wait; new requests do not preempt running ones.
                    let r = &mut self.requests[idx];
                    r.slot = None;
                    let mut hits = std::mem::take(&mut r.blocks);
                    // Hits left in the cache before the window were never held.
                    hits.drain(..std::mem::take(&mut r.released_blocks));
                    r.back_to_waiting();
                    // A hit page's own last use is kept by the pool, so `after = 0` here
                    // cannot let it back before another holder's launch is released.
                    self.pool.retire(&hits, 0);
                    self.slots.retire(slot, 0);
                    break;
                }
            }
        }

        if rows.is_empty() {
            self.spare_rows.push(meta);
            return None;
        }
        self.next_seq += 1;
        if self.trace.is_some() {
            for (row, m) in rows.iter().zip(&meta) {
                let r = &self.requests[m.req];
                let rec = TraceRecord {
                    owner: Some("worker".into()),
                    launch: Some(seq),
                    positions: Some((m.first_pos as usize, m.num_tokens as usize)),
                    // The pages the launch may read: not those let go of (`kv_window`).
                    pages: Some(r.blocks[r.released_blocks..row.num_blocks as usize].to_vec()),
                    evidence: (row.pending_launch != NOT_PENDING).then(|| {
                        format!("pending_from={}:{}", row.pending_launch, row.pending_row)
                    }),
                    ..Self::req_record(Boundary::BatchPreparation, r)
                };
                self.emit(|| rec);
            }
        }
        self.inflight.push_back(Inflight { seq, rows: meta });
        Some(Launch { seq, rows })
    }

    /// Plans one row for request `idx` in launch `seq`, allocating its pages, and appends it
    /// to `rows` and `meta`. On success the request's `last_launch`, `scheduled_len` and
    /// in-flight samples already account for the row. A row that reports prompt
    /// log-probabilities takes its positions from `lp_budget` too (and waits when it is 0).
    ///
    /// Inlined into the per-row loop (with `on_sampled`, a quarter of the instructions per
    /// decode step at 1024 sequences were calls, spills and reloads around these two).
    #[inline(always)]
    fn plan_row(
        &mut self,
        idx: Idx,
        seq: LaunchSeq,
        budget: usize,
        lp_budget: &mut usize,
        rows: &mut Vec<LaunchRow>,
        meta: &mut Vec<RowMeta>,
    ) -> Plan {
        let row_idx = rows.len() as u32;
        let max_model_len = self.cfg.max_model_len;
        let block_size = self.cfg.block_size;
        let r = &mut self.requests[idx];
        let slot = r.slot.expect("running request has a slot");
        let known = r.known_len();
        let frontier = known + r.inflight_samples.len();
        // A guided row's mask depends on every earlier output, and so does the mask of a
        // request with a bad word of several tokens, so the row waits until they are accepted
        // (it never reads a pending input).
        if r.mask_follows_outputs() && !r.inflight_samples.is_empty() {
            return Plan::Nothing;
        }
        // `max_tokens == 0`: compute the prompt (for its log-probabilities) and sample nothing.
        let prompt_only = r.max_tokens == 0;
        if r.scheduled_len >= frontier || (!prompt_only && r.outputs_promised() >= r.max_tokens) {
            return Plan::Nothing;
        }
        let first = r.scheduled_len;
        let (n, pending) = if first >= known {
            // The input is a token still being sampled: a decode from `PendingFrom`. A row
            // with penalties reads its history from the token table up to its first position,
            // so it waits until every earlier sample is in the table (with two launches in
            // flight, the most this policy allows, that never holds it back).
            if first > known && r.params.has_penalties() {
                return Plan::Nothing;
            }
            (1, r.inflight_samples.get(first - known).copied())
        } else {
            ((known - first).min(budget), None)
        };
        // Prompt log-probabilities: the row's logits at positions `first..` score prompt
        // tokens `first + 1..`; only rows that reach an owed one report them.
        let scores_prompt = r.owes_prompt_logprobs() && first + 1 < r.prompt_len;
        let n = if scores_prompt {
            if *lp_budget == 0 {
                return Plan::Nothing;
            }
            n.min(*lp_budget)
        } else {
            n
        };
        let end = first + n;
        // A row that reaches the frontier samples the next token, if it has room for one.
        let sample = end == frontier && end < max_model_len && !prompt_only;
        if end == frontier && !sample && !prompt_only {
            return Plan::Nothing;
        }
        // Pages wholly before the window of the row's first query: no query of this row or a
        // later one reads them (`SchedulerConfig::kv_window`). They retire after the request's
        // previous launch; this one does not read them. Before this row's pages are allocated,
        // so that a long prompt's next chunk can wait for its own released pages rather than
        // preempt itself. (Not at the first row of a slot tenure: its cache hits before the
        // window were never held, `take_cached_prefix`.)
        let mut reclaim_now = false;
        if self.cfg.kv_window.is_some() && first > r.cached_len {
            let mut upto = self.cfg.first_window_block(first).min(r.blocks.len());
            if self.cfg.enable_prefix_caching {
                upto = upto.min(r.registered);
            }
            if upto > r.released_blocks {
                let pages = &r.blocks[r.released_blocks..upto];
                self.pool.retire(pages, r.last_launch);
                if let Some(t) = &mut self.trace {
                    t.emit(&TraceRecord {
                        req: Some(r.id),
                        launch: Some(r.last_launch),
                        pages: Some(pages.to_vec()),
                        owner: Some("pool".into()),
                        ..TraceRecord::new(Boundary::Retire)
                    });
                }
                r.released_blocks = upto;
                reclaim_now = r.last_launch <= self.released;
            }
        }
        // Pages whose launch is already released come back now: no later release would
        // reclaim them when nothing is in flight.
        if reclaim_now {
            self.on_released(self.released);
        }
        let r = &mut self.requests[idx];
        // The block table covers `scheduled_len` exactly (`div_ceil(scheduled_len,
        // block_size)` entries), so a row that stays within it needs no division.
        let blocks_needed = if end <= r.blocks.len() * block_size {
            r.blocks.len()
        } else {
            end.div_ceil(block_size)
        };
        debug_assert_eq!(blocks_needed, end.div_ceil(block_size));
        if blocks_needed > r.blocks.len() {
            let extra = blocks_needed - r.blocks.len();
            self.scratch_pages.clear();
            if !self.pool.alloc(extra, &mut self.scratch_pages) {
                return Plan::NeedPages(extra - self.pool.num_free());
            }
            for &p in &self.scratch_pages {
                self.tables.set_block(slot.slot, r.blocks.len(), p);
                r.blocks.push(p);
            }
        }
        let (pending_launch, pending_row) = pending.unwrap_or((NOT_PENDING, 0));
        debug_assert!(pending_launch == NOT_PENDING || pending_launch < seq);
        let output_index = r.outputs_promised();
        let mut params = r.params;
        if scores_prompt {
            *lp_budget -= n;
        } else {
            params.prompt_logprobs = 0;
        }
        if output_index < r.min_tokens {
            // The stop-id mask follows the bias in the slot's logit-bias row.
            params.logit_bias_len = r.logit_bias.len() as u32;
        }
        // A dormant guide (structured output after the reasoning, `Guide::start_after`)
        // constrains nothing yet; the row still waits for its earlier samples above, so the
        // token that wakes the guide is accepted before the next row is planned.
        let guide_mask = r
            .guide
            .as_ref()
            .filter(|g| g.guide.is_active())
            .map(|g| &g.mask);
        if sample && (guide_mask.is_some() || !r.bad_words.is_empty()) {
            // No launch still reads this slot's mask row: the request's previous sampling row
            // completed before this one could be planned (`mask_follows_outputs`). A request
            // with only one-token bad words has a fixed mask, written at slot take.
            // The outputs a bad word's prefix can match: the latest `bad_words_longest - 1`,
            // all accepted (none is in flight).
            let recent_from = known
                .saturating_sub(r.bad_words_longest.saturating_sub(1))
                .max(r.prompt_len);
            match guide_mask {
                Some(g) if r.bad_words.is_empty() => self.tables.set_token_mask(slot.slot, g),
                // Bad words without a guide: the fixed mask of slot take, with the bans of
                // the longer words updated in place.
                None if r.guide.is_none() && r.bad_words_longest > 1 => {
                    for t in r.bad_words_banned.drain(..) {
                        if r.bad_words_one_token.binary_search(&t).is_err() {
                            self.tables.set_token_allowed(slot.slot, t, true);
                        }
                    }
                    self.scratch_recent.clear();
                    self.scratch_recent
                        .extend((recent_from..known).map(|p| self.tables.token(slot.slot, p)));
                    let longer = &r.bad_words[r.bad_words_longer_from..];
                    for t in crate::request::bad_word_bans(longer, &self.scratch_recent) {
                        self.tables.set_token_allowed(slot.slot, t, false);
                        r.bad_words_banned.push(t);
                    }
                }
                _ if r.mask_follows_outputs() => {
                    let m = &mut self.scratch_mask;
                    m.clear();
                    match guide_mask {
                        Some(g) => m.extend_from_slice(g),
                        None => m.resize(self.tables.mask_words(), u32::MAX),
                    }
                    self.scratch_recent.clear();
                    self.scratch_recent
                        .extend((recent_from..known).map(|p| self.tables.token(slot.slot, p)));
                    crate::request::ban_bad_words(&r.bad_words, &self.scratch_recent, m);
                    self.tables.set_token_mask(slot.slot, m);
                }
                _ => {}
            }
            params.token_mask = 1;
        }
        rows.push(LaunchRow {
            req: slot,
            first_pos: first as u32,
            num_tokens: n as u32,
            num_blocks: blocks_needed as u32,
            sample: sample as u32,
            pending_launch,
            pending_row,
            output_index: output_index as u32,
            lora: r.lora,
            reserved: 0,
            params,
        });
        meta.push(RowMeta {
            id: r.id,
            req: idx,
            slot,
            first_pos: first as u32,
            num_tokens: n as u32,
        });
        r.last_launch = seq;
        r.scheduled_len = end;
        if sample {
            r.inflight_samples.push_back((seq, row_idx));
        }
        Plan::Row(n)
    }

    /// Whether waiting request `idx`, preempted before, should wait rather than restart now:
    /// while other requests run, it restarts only when the pool (free pages and those coming
    /// back) holds the pages its known history needs at once
    /// ([`SchedulerConfig::request_pages`]) plus one page of growth per running request.
    /// Otherwise a request in a pool too small to hold it beside the running ones is started,
    /// computes a chunk or two, and is preempted again as they grow, over and over: its
    /// recompute is thrown away each time (hundreds of times per request in a pool near the
    /// smallest admitted). vLLM V0 admitted a prompt only when its whole block count was
    /// free (`can_allocate`); here that holds for restarts, and a request's first start
    /// still needs only its first chunk's pages. With nothing running it always restarts
    /// (admission guarantees it fits alone), so it never waits forever.
    fn restart_would_thrash(&self, idx: Idx) -> bool {
        let r = &self.requests[idx];
        if r.preemptions == 0 || self.running.is_empty() {
            return false;
        }
        let need = self.cfg.request_pages(r.known_len) + self.running.len();
        self.pool.num_free() + self.pool.num_retired() < need
    }

    /// Takes the longest prefix of full blocks of waiting request `idx`'s known history that
    /// the prefix cache can serve, into its block table in slot `slot`, and counts it as
    /// computed. At most `known_len - 1` positions are taken, so the request's first row
    /// computes at least its last known position and samples.
    ///
    /// Without a window every block of the prefix must be cached. With one
    /// ([`SchedulerConfig::kv_window`]), the first row (its first query at the prefix's end
    /// `l * bs`) and every later one read no key before `l * bs + 1 - w`, so only the blocks
    /// from there on must be cached (as vLLM's sliding-window prefix hit): they are taken, and
    /// the ones before count as released, held or not, so a hit holds about a window of pages
    /// however long the prefix (`SchedulerConfig::request_pages`). A block's key covers every
    /// token before it, so a cached block's KV is right whatever became of the earlier ones.
    fn take_cached_prefix(&mut self, idx: Idx, slot: u32) {
        let bs = self.cfg.block_size;
        let window = self.cfg.kv_window;
        // The first block a prefix of `l` blocks must have cached: the first its first row
        // (a query at `l * bs`) reads.
        let cfg = &self.cfg;
        let keep = |l: usize| cfg.first_window_block(l * bs).min(l);
        let r = &mut self.requests[idx];
        debug_assert!(r.blocks.is_empty() && r.computed_len == 0);
        let most = (r.known_len - 1) / bs;
        // `run`: cached blocks in a row ending at block `i`.
        let (mut hits, mut run) = (0, 0);
        for i in 0..most {
            if r.keys.len() == i {
                let parent = i.checked_sub(1).map(|j| r.keys[j]);
                let key =
                    self.hasher
                        .block_key(parent, r.cache_salt, &r.tokens[i * bs..(i + 1) * bs]);
                r.keys.push(key);
            }
            if self.pool.lookup(r.keys[i]).is_some() {
                run += 1;
            } else if window.is_none() {
                break;
            } else {
                run = 0;
            }
            if run >= i + 1 - keep(i + 1) {
                hits = i + 1;
            }
        }
        let keep = keep(hits);
        // Entries before `keep` are released and never read (`released_blocks`).
        r.blocks.resize(keep, UNHELD_PAGE);
        for i in keep..hits {
            let p = self
                .pool
                .lookup(r.keys[i])
                .expect("a cached block of the hit");
            self.pool.share(p);
            self.tables.set_block(slot, i, p);
            r.blocks.push(p);
        }
        r.released_blocks = keep;
        r.registered = hits;
        r.cached_len = hits * bs;
        r.computed_len = r.cached_len;
        r.scheduled_len = r.cached_len;
    }

    /// Puts `idx` in the waiting queue: under `Fcfs` at the back, or at the front when it
    /// `returns` (preempted, or its worker died: it was admitted before everything waiting);
    /// under `Priority` at its place by `(priority, arrival)`, after its equals.
    fn enqueue_waiting(&mut self, idx: Idx, returns: bool) {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs if returns => self.waiting.push_front(idx),
            SchedulingPolicy::Fcfs => self.waiting.push_back(idx),
            SchedulingPolicy::Priority => {
                let at = priority_position(&self.requests, self.waiting.make_contiguous(), idx);
                self.waiting.insert(at, idx);
            }
        }
    }

    /// Adds `idx` to the running list: at the end under `Fcfs`, at its place by
    /// `(priority, arrival)` under `Priority`, so that the last one is always the one to
    /// preempt first.
    fn push_running(&mut self, idx: Idx) {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => self.running.push(idx),
            SchedulingPolicy::Priority => {
                let at = priority_position(&self.requests, &self.running, idx);
                self.running.insert(at, idx);
            }
        }
    }

    /// Preempts `idx` by recompute: its pages and slot retire after its last launch, its history
    /// stays, and it goes back to the front of the waiting queue.
    fn preempt(&mut self, idx: Idx) {
        self.preemptions += 1;
        self.running.retain(|&x| x != idx);
        self.release_resources(idx);
        // Pages whose last launch is already released come back at once.
        self.on_released(self.released);
        let r = &mut self.requests[idx];
        r.back_to_waiting();
        r.preemptions += 1;
        self.enqueue_waiting(idx, true);
        let rec = Self::req_record(Boundary::Preempt, &self.requests[idx]);
        self.emit(|| rec);
    }

    /// Retires the request's pages and slot after its last launch. The outputs accepted while
    /// it held the slot are copied from the slot's token-table row into its history first
    /// (see `Request::tokens`).
    fn release_resources(&mut self, idx: Idx) {
        let r = &mut self.requests[idx];
        let after = r.last_launch;
        let mut pages = std::mem::take(&mut r.blocks);
        // Pages already let go of (`kv_window`) are not the request's any more.
        pages.drain(..std::mem::take(&mut r.released_blocks));
        let slot = r.slot.take();
        // The tail first: cached blocks are evicted in the order they come back, and a later
        // block is useless without the ones before it.
        pages.reverse();
        self.pool.retire(&pages, after);
        if let Some(slot) = slot {
            self.tables
                .read_tokens(slot.slot, r.tokens.len()..r.known_len, &mut r.tokens);
            self.slots.retire(slot, after);
        }
        debug_assert_eq!(r.tokens.len(), r.known_len);
        if !pages.is_empty() && self.trace.is_some() {
            let rec = TraceRecord {
                req: Some(r.id),
                launch: Some(after),
                pages: Some(pages),
                owner: Some("pool".into()),
                ..TraceRecord::new(Boundary::Retire)
            };
            self.emit(|| rec);
        }
    }

    /// Ends `idx`: retires its resources and reports it.
    fn finish(&mut self, idx: Idx, reason: FinishReason, events: &mut Vec<Event>) {
        self.running.retain(|&x| x != idx);
        self.waiting.retain(|&x| x != idx);
        self.release_resources(idx);
        self.on_released(self.released);
        let r = self.requests.remove(idx);
        if self.trace.is_some() {
            let rec = TraceRecord {
                evidence: Some(format!("{reason:?}").to_lowercase()),
                ..Self::req_record(Boundary::Finish, &r)
            };
            self.emit(|| rec);
        }
        events.push(Event::Finished {
            id: r.id,
            reason,
            prompt_tokens: r.prompt_len,
            output_tokens: r.num_outputs(),
            cached_tokens: r.prompt_cached.unwrap_or(0),
        });
    }

    /// Cancels `id` (client disconnect, stop string, frontend death). No new launch includes
    /// it, outputs of launches in flight are suppressed, and its pages come back after the fence
    /// of its last launch. Pushes the acknowledgement (`Finished { reason: Cancelled }`) unless
    /// the request is already gone.
    pub fn cancel(&mut self, id: RequestId, events: &mut Vec<Event>) {
        if let Some(idx) = self.requests.find(id) {
            let rec = Self::req_record(Boundary::Cancel, &self.requests[idx]);
            self.emit(|| rec);
            self.finish(idx, FinishReason::Cancelled, events);
        }
    }

    /// Ends every live request with `reason` (shutdown).
    pub fn abort_all(&mut self, reason: FinishReason, events: &mut Vec<Event>) {
        let mut ids: Vec<_> = self.requests.ids.iter().map(|(&id, &i)| (id, i)).collect();
        ids.sort_unstable();
        for (_, idx) in ids {
            self.finish(idx, reason, events);
        }
    }

    /// Accepts the completion of a launch: marks its positions computed, accepts the sampled
    /// tokens of live requests (in row order) and suppresses the others.
    ///
    /// Completions arrive in launch order (one worker, one stream). An unknown `seq` is ignored
    /// and reported as `false`.
    pub fn on_completion(&mut self, c: &Completion, events: &mut Vec<Event>) -> bool {
        let Some(idx) = self.inflight.iter().position(|l| l.seq == c.seq) else {
            return false;
        };
        let launch = self.inflight.remove(idx).expect("index is valid");
        self.emit(|| TraceRecord {
            launch: Some(c.seq),
            owner: Some("scheduler".into()),
            evidence: Some("completion".into()),
            ..TraceRecord::new(Boundary::ForwardExecution)
        });
        // Prompt log-probabilities first: a request's come before its first token. Each owed
        // position is taken once, in order (a recompute after preemption reports some again).
        for p in &c.prompt {
            let Some(m) = launch.rows.get(p.row as usize) else {
                continue;
            };
            let Some(r) = self.requests.try_get_mut(m.req) else {
                continue;
            };
            if r.slot != Some(m.slot)
                || p.req != m.slot
                || p.pos as usize != r.prompt_lp_next
                || !r.owes_prompt_logprobs()
            {
                continue;
            }
            r.prompt_lp_next += 1;
            events.push(Event::PromptLogprob {
                id: m.id,
                pos: p.pos,
                token: p.token,
                logprob: p.logprob,
                rank: p.rank,
                top: p.top.clone(),
            });
        }
        // One pass over the rows: a row's positions are marked computed, then its sampled
        // entries (in row order, as workers send them) are handled while the request is hot.
        // A launch has at most one row per request, and handling a sample touches no other
        // request's lengths, so this matches marking every row first. Entries out of row order
        // are handled after the pass, in the order they came.
        let mut next = 0;
        // Samples live requests expect from this launch, and how many arrived.
        let (mut expected, mut accepted) = (0usize, 0usize);
        let mut prompt_done = false;
        let bs = self.cfg.block_size;
        for (row, m) in launch.rows.iter().enumerate() {
            if let Some(r) = self.requests.try_get_mut(m.req) {
                if r.slot == Some(m.slot) {
                    r.computed_len = r.computed_len.max((m.first_pos + m.num_tokens) as usize);
                    prompt_done = r.max_tokens == 0 && r.computed_len >= r.known_len;
                    expected +=
                        usize::from(r.inflight_samples.front() == Some(&(c.seq, row as u32)));
                    if self.cfg.enable_prefix_caching && r.computed_len >= (r.registered + 1) * bs {
                        register_full_blocks(
                            r,
                            m.slot.slot,
                            &mut self.pool,
                            &self.tables,
                            &self.hasher,
                            bs,
                            &mut self.scratch_tokens,
                        );
                    }
                }
            }
            while let Some(s) = c.sampled.get(next).filter(|s| s.row as usize == row) {
                accepted += usize::from(self.on_sampled(c.seq, s, m, events));
                next += 1;
            }
            if std::mem::take(&mut prompt_done) {
                // A `max_tokens == 0` request ends once its prompt is computed.
                self.finish(m.req, FinishReason::Length, events);
            }
        }
        for s in &c.sampled[next..] {
            if let Some(m) = launch.rows.get(s.row as usize) {
                accepted += usize::from(self.on_sampled(c.seq, s, m, events));
            }
        }
        if accepted < expected {
            // The worker left out a sampling row (a protocol violation). Samples are accepted
            // in launch order, so that request could never take another: it ends with Abort
            // instead of waiting forever.
            for (row, m) in launch.rows.iter().enumerate() {
                let missing = self.requests.try_get_mut(m.req).is_some_and(|r| {
                    r.slot == Some(m.slot)
                        && r.inflight_samples.front() == Some(&(c.seq, row as u32))
                });
                if missing {
                    tracing::warn!(launch = c.seq, row, "completion without the row's sample");
                    self.finish(m.req, FinishReason::Abort, events);
                }
            }
        }
        self.fill_guided_masks(events);
        self.spare_rows.push(launch.rows);
        true
    }

    /// Computes the next token mask of every guided request that accepted a token in this
    /// completion, in parallel on [`Scheduler::guide_pool`] when there are several (a mask is
    /// tens of microseconds for a JSON schema on a 32000-token vocabulary, and up to llguidance's
    /// per-step fuel, about 15 ms, for a costly grammar; one after another they held up the
    /// whole step). A failure (llguidance's limits) ends that request with `Abort`.
    fn fill_guided_masks(&mut self, events: &mut Vec<Event>) {
        if self.guided_fill.is_empty() {
            return;
        }
        let mut jobs: Vec<(Idx, Box<Guided>)> = Vec::with_capacity(self.guided_fill.len());
        for i in std::mem::take(&mut self.guided_fill) {
            if let Some(g) = self.requests.try_get_mut(i).and_then(|r| r.guide.take()) {
                jobs.push((i, g));
            }
        }
        let fill = |g: &mut Box<Guided>| {
            let Guided { guide, mask } = &mut **g;
            guide.fill_mask(mask).err()
        };
        if jobs.len() > 1 && self.guide_pool.is_none() {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
            self.guide_pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("baton-guide-{i}"))
                // Masks recurse as deep as the grammar nests (see the constant).
                .stack_size(baton_grammar::GRAMMAR_STACK_BYTES)
                .build()
                .ok();
        }
        let errors: Vec<Option<baton_grammar::GrammarError>> = match &self.guide_pool {
            Some(pool) if jobs.len() > 1 => {
                use rayon::prelude::*;
                pool.install(|| jobs.par_iter_mut().map(|(_, g)| fill(g)).collect())
            }
            _ => jobs.iter_mut().map(|(_, g)| fill(g)).collect(),
        };
        for ((i, g), e) in jobs.into_iter().zip(errors) {
            let Some(r) = self.requests.try_get_mut(i) else {
                continue;
            };
            r.guide = Some(g);
            if let Some(e) = e {
                tracing::warn!(req = r.id, "structured output failed: {e}");
                self.finish(i, FinishReason::Abort, events);
            }
        }
    }

    /// Accepts sampled entry `s` of row `m` of launch `seq` if the request is live and this is
    /// its oldest sampling row in flight (returns true); otherwise suppresses it. (Inlined: see
    /// `plan_row`.)
    #[inline(always)]
    fn on_sampled(
        &mut self,
        seq: LaunchSeq,
        s: &baton_proto::Sampled,
        m: &RowMeta,
        events: &mut Vec<Event>,
    ) -> bool {
        let max_model_len = self.cfg.max_model_len;
        let accepted = match self.requests.try_get_mut(m.req) {
            Some(r)
                if r.slot == Some(m.slot) && r.inflight_samples.front() == Some(&(seq, s.row)) =>
            {
                r.inflight_samples.pop_front();
                self.tables.set_token(m.slot.slot, r.known_len, s.token);
                r.known_len += 1;
                let stop = r.num_outputs() > r.min_tokens && r.is_stop(s.token);
                let length = r.num_outputs() >= r.max_tokens || r.known_len >= max_model_len;
                // The guide takes the token (not needed after the last one); its next mask is
                // computed at the end of the completion with the other guided rows'. A
                // failure ends the request.
                let guide_failed = match &mut r.guide {
                    Some(g) if !stop && !length => {
                        let e = g.guide.consume(s.token).err();
                        // A dormant guide needs no mask (its rows are unconstrained).
                        if e.is_none() && g.guide.is_active() {
                            self.guided_fill.push(m.req);
                        }
                        e
                    }
                    _ => None,
                };
                if let Some(e) = &guide_failed {
                    tracing::warn!(req = r.id, "structured output failed: {e}");
                    // The guide refused the token (an empty mask, e.g. one the bad words
                    // emptied, or a grammar past llguidance's limits): it is not an output.
                    r.known_len -= 1;
                }
                Some((
                    stop,
                    length,
                    guide_failed.is_some(),
                    r.prompt_cached.unwrap_or(0),
                ))
            }
            _ => None,
        };
        let Some((stop, length, guide_failed, cached_tokens)) = accepted else {
            self.emit(|| TraceRecord {
                req: Some(m.id),
                launch: Some(seq),
                token: Some(s.token),
                ..TraceRecord::new(Boundary::Suppressed)
            });
            return false;
        };
        if guide_failed {
            self.finish(m.req, FinishReason::Abort, events);
            return true;
        }
        if self.trace.is_some() {
            let r = &self.requests[m.req];
            let mut sampled = Self::req_record(Boundary::Sampling, r);
            sampled.launch = Some(seq);
            sampled.token = Some(s.token);
            sampled.owner = Some("scheduler".into());
            let mut published = Self::req_record(Boundary::Publication, r);
            published.launch = Some(seq);
            published.token = Some(s.token);
            published.owner = Some("frontend".into());
            self.emit(|| sampled);
            self.emit(|| published);
        }
        events.push(Event::Token {
            id: m.id,
            token: s.token,
            cached_tokens,
            logprob: s.logprob,
            // (Cloning an empty vector still costs a call.)
            top: if s.top.is_empty() {
                Vec::new()
            } else {
                s.top.clone()
            },
        });
        if stop {
            self.finish(m.req, FinishReason::Stop, events);
        } else if length {
            self.finish(m.req, FinishReason::Length, events);
        }
        true
    }

    /// The worker could not execute launch `seq` (for example a token outside its vocabulary):
    /// the launch counts as completed with no output, and every request it included ends with
    /// `Abort`. Its pages still come back only after the launch's release.
    pub fn on_failed_launch(&mut self, seq: LaunchSeq, events: &mut Vec<Event>) {
        let Some(idx) = self.inflight.iter().position(|l| l.seq == seq) else {
            return;
        };
        let launch = self.inflight.remove(idx).expect("index is valid");
        for m in &launch.rows {
            if self
                .requests
                .try_get_mut(m.req)
                .is_some_and(|r| r.slot == Some(m.slot))
            {
                self.finish(m.req, FinishReason::Abort, events);
            }
        }
        self.spare_rows.push(launch.rows);
    }

    /// Reports that every live consumer has released launches up to `released`; reclaims the
    /// pages and slots retired after them. Returns the number of pages reclaimed.
    pub fn on_released(&mut self, released: LaunchSeq) -> usize {
        if released > self.released {
            self.released = released;
            self.emit(|| TraceRecord {
                launch: Some(released),
                evidence: Some(format!("min_released={released}")),
                ..TraceRecord::new(Boundary::Release)
            });
        }
        let got = self.pool.reclaim(self.released);
        self.slots.reclaim(self.released);
        let n = got.len();
        if self.trace.is_some() {
            for (after, pages) in got.groups {
                let rel = self.released;
                self.emit(|| TraceRecord {
                    launch: Some(after),
                    pages: Some(pages),
                    owner: Some("pool".into()),
                    evidence: Some(format!("min_released={rel}")),
                    ..TraceRecord::new(Boundary::Reclaim)
                });
            }
        }
        n
    }

    /// A worker died, taking its device memory: every launch in flight is lost, every page is
    /// invalid, and running requests go back to the waiting queue to recompute from their known
    /// history. With no live consumer left, everything retired is reclaimed at once.
    pub fn on_worker_death(&mut self) {
        let last = self.next_seq - 1;
        self.emit(|| TraceRecord {
            launch: Some(last),
            evidence: Some("worker lock released by the kernel".into()),
            ..TraceRecord::new(Boundary::WorkerDeath)
        });
        for l in self.inflight.drain(..) {
            self.spare_rows.push(l.rows);
        }
        let running = std::mem::take(&mut self.running);
        for &id in running.iter().rev() {
            self.release_resources(id);
            self.requests[id].back_to_waiting();
            self.enqueue_waiting(id, true);
            // The trace must say the request recomputes: its computed KV died with the worker.
            if self.trace.is_some() {
                let rec = TraceRecord {
                    evidence: Some("worker_death".into()),
                    ..Self::req_record(Boundary::Preempt, &self.requests[id])
                };
                self.emit(|| rec);
            }
        }
        // No launch can touch the pool any more: the device memory is gone.
        self.released = self.next_seq - 1;
        let got = self.pool.reclaim_all();
        // The cached blocks were in that memory too.
        self.pool.clear_cache();
        self.slots.reclaim(LaunchSeq::MAX);
        if self.trace.is_some() {
            let rel = self.released;
            for (after, pages) in got.groups {
                self.emit(|| TraceRecord {
                    launch: Some(after),
                    pages: Some(pages),
                    owner: Some("pool".into()),
                    evidence: Some(format!("worker_dead;min_released={rel}")),
                    ..TraceRecord::new(Boundary::Reclaim)
                });
            }
        }
    }
}

/// Registers in `pool` every full block of running request `r` (in slot `slot`) that its
/// `computed_len` now covers and that is not registered yet, computing the missing keys from
/// the slot's token-table row.
fn register_full_blocks<S: AsRef<[AtomicU32]>>(
    r: &mut Request,
    slot: u32,
    pool: &mut PagePool,
    tables: &SlotTables<S>,
    hasher: &PrefixHasher,
    bs: usize,
    scratch: &mut Vec<u32>,
) {
    let full = (r.computed_len / bs).min(r.blocks.len());
    while r.registered < full {
        let i = r.registered;
        debug_assert!(r.keys.len() >= i);
        if r.keys.len() == i {
            scratch.clear();
            tables.read_tokens(slot, i * bs..(i + 1) * bs, scratch);
            let parent = i.checked_sub(1).map(|j| r.keys[j]);
            r.keys.push(hasher.block_key(parent, r.cache_salt, scratch));
        }
        // `false`: another page already holds this block; this one stays unshared.
        pool.register(r.blocks[i], r.keys[i]);
        r.registered += 1;
    }
}

enum Plan {
    /// A row of this many positions was appended.
    Row(usize),
    Nothing,
    /// Pages short by this many.
    NeedPages(usize),
}

/// The window [`SchedulerConfig::kv_window`] takes from a model's per-layer sliding windows
/// (`baton_model::ModelConfig::sliding_window`): the largest, when every layer has one;
/// `None` when any layer attends to every key (Gemma 3's global layers) or there are none.
///
/// ```
/// use baton_scheduler::sliding_window_kv;
/// assert_eq!(sliding_window_kv(&[Some(4096); 32]), Some(4096)); // Mistral 7B v0.1
/// assert_eq!(sliding_window_kv(&[Some(512), Some(1024)]), Some(1024));
/// assert_eq!(sliding_window_kv(&[Some(512), None]), None); // Gemma 3
/// assert_eq!(sliding_window_kv(&[None, None]), None);
/// assert_eq!(sliding_window_kv(&[]), None);
/// ```
pub fn sliding_window_kv(windows: &[Option<usize>]) -> Option<usize> {
    if windows.is_empty() {
        return None;
    }
    windows.iter().try_fold(0usize, |m, w| w.map(|w| m.max(w)))
}

/// The stateless admission checks of [`Scheduler::add_request`], for a frontend that wants to
/// refuse a request before it reaches the scheduler: a non-empty prompt, a
/// prompt shorter than `max_model_len`, token ids below `vocab_size`, and a request whose pages
/// fit in the pool at all.
///
/// # Errors
/// The first check that fails.
pub fn check_admission(
    cfg: &SchedulerConfig,
    vocab_size: usize,
    r: &NewRequest,
) -> Result<(), AdmitError> {
    if r.prompt.is_empty() {
        return Err(AdmitError::EmptyPrompt);
    }
    if r.priority != 0 && cfg.policy == SchedulingPolicy::Fcfs {
        return Err(AdmitError::PriorityNotEnabled(r.priority));
    }
    // `max_tokens == 0` samples nothing, so its prompt may fill the context.
    if r.prompt.len() > cfg.max_model_len
        || (r.prompt.len() == cfg.max_model_len && r.max_tokens != 0)
    {
        return Err(AdmitError::PromptTooLong {
            prompt: r.prompt.len(),
            max_model_len: cfg.max_model_len,
        });
    }
    if let Some(&id) = r.prompt.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(AdmitError::BadToken {
            id,
            vocab: vocab_size,
        });
    }
    let bias = &r.logit_bias;
    if bias.len() > MAX_LOGIT_BIAS || bias.len() != r.params.logit_bias_len as usize {
        return Err(AdmitError::BadLogitBias(format!(
            "{} entries (params say {}, at most {MAX_LOGIT_BIAS})",
            bias.len(),
            r.params.logit_bias_len
        )));
    }
    if r.params.prompt_logprobs > MAX_TOP_LOGPROBS as u32 + 1 {
        return Err(AdmitError::TooManyPromptLogprobs {
            asked: r.params.prompt_logprobs - 1,
            most: MAX_TOP_LOGPROBS,
        });
    }
    let bad_words_words: usize = r.bad_words.iter().map(|w| 1 + w.len()).sum();
    if bad_words_words > baton_proto::wire::MAX_BAD_WORDS_WORDS {
        return Err(AdmitError::BadWords(format!(
            "{bad_words_words} words once packed, at most {}",
            baton_proto::wire::MAX_BAD_WORDS_WORDS
        )));
    }
    if r.bad_words.iter().any(Vec::is_empty) {
        return Err(AdmitError::BadWords("a word has no tokens".into()));
    }
    if let Some(&id) = r
        .bad_words
        .iter()
        .flatten()
        .find(|&&t| t as usize >= vocab_size)
    {
        return Err(AdmitError::BadWords(format!(
            "token id {id} is out of range for a vocabulary of {vocab_size}"
        )));
    }
    if r.params.allowed_only != 0
        && !bias.is_empty()
        && crate::request::bad_words_empty_allow_list(bias, &r.bad_words)
    {
        return Err(AdmitError::BadWords(
            "every allowed token is a bad word of one token".into(),
        ));
    }
    if r.guide.is_some() && (r.min_tokens > 0 || r.params.allowed_only != 0) {
        return Err(AdmitError::Guided(
            "a structured output cannot be combined with min_tokens or allowed_token_ids".into(),
        ));
    }
    if r.params.allowed_only != 0 && bias.is_empty() {
        return Err(AdmitError::BadLogitBias(
            "allowed_only with no entries would allow no token".into(),
        ));
    }
    if r.min_tokens > 0 {
        let ids = crate::request::min_tokens_ids(&r.stop_token_ids, &r.eos_ids);
        let stops = ids.len();
        if stops > MAX_MIN_TOKENS_STOP_IDS {
            return Err(AdmitError::MinTokensStopIds { stops });
        }
        if r.params.allowed_only != 0 && crate::request::min_tokens_empties_allow_list(bias, &ids) {
            return Err(AdmitError::BadLogitBias(
                "min_tokens holds back every allowed token (all are stop ids)".into(),
            ));
        }
    }
    if let Some(&(t, b)) = bias
        .iter()
        .find(|&&(t, b)| t as usize >= vocab_size || !b.is_finite())
    {
        return Err(AdmitError::BadLogitBias(format!(
            "token {t} with bias {b} (vocabulary of {vocab_size})"
        )));
    }
    // The last sampled token's KV is never computed, so the request computes at most
    // `min(prompt + max_tokens, max_model_len) - 1` positions (the prompt alone when
    // `max_tokens == 0`).
    let most = match r.max_tokens {
        0 => r.prompt.len(),
        m => (r.prompt.len() + m as usize).min(cfg.max_model_len) - 1,
    };
    // With a sliding window the request holds only about a window of those pages at once.
    let needed = cfg.request_pages(most);
    if needed > cfg.num_blocks {
        return Err(AdmitError::TooLargeForPool {
            needed,
            total: cfg.num_blocks,
        });
    }
    Ok(())
}
