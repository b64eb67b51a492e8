//! The frontend's view of the engine: submit, cancel, limits, health and stats.
//!
//! Contract: [`EngineClient::submit`] admits one request and returns its id and a receiver of
//! [`EngineEvent`]s; the last event is always [`EngineEvent::Finished`] or
//! [`EngineEvent::Error`]. After [`EngineClient::cancel`] the engine still sends a final
//! `Finished { reason: Cancelled }` (the acknowledgement, DESIGN.md section 5) unless the request
//! had already finished, and the frontend keeps the receiver until that last event arrives.
//! [`EngineClient::limits`] are the same values the scheduler enforces, so the frontend can
//! refuse a request with a 400 before it reaches the engine.

use baton_proto::{FirstTokenTimes, SamplingParams};
use baton_scheduler::FinishReason;
use tokio::sync::mpsc::UnboundedReceiver;

/// Prefix of an [`EngineEvent::Error`] message for an engine that cannot serve for now (no
/// worker attached for too long): the HTTP status is 503, so a client or load balancer retries,
/// rather than 500.
pub const UNAVAILABLE_PREFIX: &str = "engine unavailable: ";

/// A structured output as the frontend submits it: the constraint (what crosses to a
/// scheduler process, which compiles it again) and its compiled guide (what an in-process
/// scheduler takes).
#[derive(Clone, Debug)]
pub struct GuidedRequest {
    /// The constraint.
    pub constraint: baton_grammar::Constraint,
    /// Compiled against the model's vocabulary, at the start of the output (dormant until
    /// `after` when that is set).
    pub guide: baton_grammar::Guide,
    /// The token after which the constraint applies (the end of the reasoning), if any.
    pub after: Option<u32>,
}

impl PartialEq for GuidedRequest {
    fn eq(&self, other: &Self) -> bool {
        self.constraint == other.constraint
    }
}

/// One request as the frontend submits it.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    /// Prompt token ids (BOS included when the model wants it). Non-empty.
    pub prompt: Vec<u32>,
    /// Most new tokens; 0 computes the prompt only (`echo` with `max_tokens: 0`) and ends
    /// with `length` and no token.
    pub max_tokens: u32,
    /// Sampling parameters; `seed` is always set (random when the user gave none).
    pub params: SamplingParams,
    /// Extra ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS ids.
    pub ignore_eos: bool,
    /// OpenAI `logit_bias` as `(token, bias)`; `params.logit_bias_len` equals its length.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `min_tokens` (see `baton_scheduler::NewRequest::min_tokens`).
    pub min_tokens: u32,
    /// vLLM's `cache_salt`, hashed (see `baton_scheduler::NewRequest::cache_salt`).
    pub cache_salt: u64,
    /// Structured output, or `None` (see `baton_scheduler::NewRequest::guide`).
    pub guided: Option<GuidedRequest>,
    /// vLLM's `priority` (see `baton_scheduler::NewRequest::priority`); must be 0 unless
    /// [`EngineLimits::priority_scheduling`].
    pub priority: i32,
    /// vLLM's `bad_words` as token sequences (see `baton_scheduler::NewRequest::bad_words`).
    pub bad_words: Vec<Vec<u32>>,
    /// The LoRA adapter (0: the base model; see `baton_scheduler::NewRequest::lora`).
    pub lora: u32,
}

/// What the engine reports about one request.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// A new output token.
    Token {
        /// Token id.
        token: u32,
        /// Prompt tokens taken from the prefix cache (as in `Finished`).
        cached_tokens: usize,
        /// Its log-probability (0 unless asked for).
        logprob: f32,
        /// Top log-probabilities, most likely first (empty unless asked for).
        top: Vec<(u32, f32)>,
        /// On the request's first token: its queue and prefill times as the scheduler
        /// measured them (`None` on the others, or when the engine does not time them).
        first: Option<FirstTokenTimes>,
    },
    /// The log-probability of prompt token `token` at position `pos` given the tokens before
    /// it, for a request with `params.prompt_logprobs > 0` (OpenAI `echo` with `logprobs`,
    /// vLLM's `prompt_logprobs`).
    /// Positions `1..prompt_len` come once each, in order, before the first `Token`; position
    /// 0 has none. A request that ends early (abort, cancel, error) may not report them all.
    PromptLogprob {
        /// The scored token's position in the prompt (>= 1).
        pos: u32,
        /// The prompt token at `pos`.
        token: u32,
        /// Its log-probability under the raw logits (temperature 1, no penalty or bias).
        logprob: f32,
        /// Its rank in the vocabulary (1: the most likely; vLLM's `Logprob.rank`).
        rank: u32,
        /// Top log-probabilities at `pos`, most likely first (as many as asked, maybe none).
        top: Vec<(u32, f32)>,
    },
    /// The request ended; nothing follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens the engine published.
        output_tokens: usize,
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: usize,
    },
    /// The engine failed the request (for example the worker or scheduler died); nothing
    /// follows.
    Error(String),
}

/// Limits the scheduler enforces; the frontend validates against the same values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Most tokens (prompt plus outputs) a request may hold.
    pub max_model_len: usize,
    /// Vocabulary size: token ids must be below it.
    pub vocab_size: usize,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// The scheduler orders requests by `priority` (vLLM's `--scheduling-policy priority`);
    /// false: a request's `priority` must be 0.
    pub priority_scheduling: bool,
}

/// Load figures for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests holding a slot and pages.
    pub running: usize,
    /// Requests admitted and waiting to run.
    pub waiting: usize,
    /// Fraction of KV pages not free, in `[0, 1]` (pages that only hold cached prefix blocks
    /// count as free: they are evicted on demand).
    pub kv_usage: f64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache so far.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found.
    pub prefix_cache_hits: u64,
}

/// Why a request was not admitted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The request can never run (too long, too large for the pool, bad token): a 400.
    #[error("{0}")]
    Rejected(String),
    /// The engine is not available (no worker, scheduler gone, shutting down): a 503.
    #[error("the engine is unavailable: {0}")]
    Unavailable(String),
}

/// The engine as the HTTP layer sees it: the in-process engine ([`crate::local`]) or the
/// shared-memory rings.
pub trait EngineClient: Send + Sync + 'static {
    /// Admits a request; events arrive on the returned receiver; the last one is `Finished` or
    /// `Error`.
    ///
    /// # Errors
    /// [`SubmitError`] when the request cannot be admitted.
    fn submit(
        &self,
        req: EngineRequest,
    ) -> Result<(u64, UnboundedReceiver<EngineEvent>), SubmitError>;

    /// Cancels a request; the engine acknowledges with `Finished { reason: Cancelled }` on the
    /// request's receiver (unless it had already finished). Unknown ids are ignored.
    fn cancel(&self, id: u64);

    /// The limits the scheduler enforces.
    fn limits(&self) -> EngineLimits;

    /// `Err(reason)` when requests cannot be served now (no worker, scheduler gone): `/health`
    /// answers 503.
    fn health(&self) -> Result<(), String>;

    /// Load figures now.
    fn stats(&self) -> EngineStats;
}

/// A random seed for a request that gave none.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}
