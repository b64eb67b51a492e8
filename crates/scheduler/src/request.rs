//! A request as the scheduler sees it: its known history and how much of it is computed.
//!
//! Contract (DESIGN.md section 2): `known_len` is the prompt plus accepted outputs;
//! `computed_len` counts the positions whose KV is written and fenced (those taken from the
//! prefix cache included); `scheduled_len` counts the positions included in published launches
//! or taken from the prefix cache, fenced or not. Always
//! `computed_len <= scheduled_len <= known_len + inflight_samples.len()`.

use baton_kv::BlockKey;
use baton_proto::{LaunchSeq, SamplingParams, SlotRef};
use std::collections::VecDeque;

/// Caller-chosen request id, unique among live requests.
pub type RequestId = u64;

/// What a caller submits.
#[derive(Clone, Debug)]
pub struct NewRequest {
    /// Unique id among live requests.
    pub id: RequestId,
    /// Prompt token ids (BOS included if the model wants it). Must be non-empty.
    pub prompt: Vec<u32>,
    /// Most new tokens to generate. 0: compute the prompt only (for its log-probabilities,
    /// OpenAI `echo` with `max_tokens: 0`), then finish with `Length` and no output.
    pub max_tokens: u32,
    /// Sampling parameters. `seed` is the request's own stream; callers give unseeded requests a
    /// random seed.
    pub params: SamplingParams,
    /// The model's EOS ids; generation stops on them unless `ignore_eos`.
    pub eos_ids: Vec<u32>,
    /// Extra ids that end generation (`stop_token_ids`); `ignore_eos` does not affect them.
    pub stop_token_ids: Vec<u32>,
    /// Do not stop on `eos_ids` (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// OpenAI `logit_bias`, `(token, bias)` added to the logits before penalties (vLLM's
    /// order); at most [`baton_proto::MAX_LOGIT_BIAS`] entries, and `params.logit_bias_len`
    /// must equal its length (checked at admission).
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `min_tokens`: while the request has fewer outputs, its stop ids and EOS ids
    /// (even under `ignore_eos`, as vLLM's `_all_stop_token_ids`: [`min_tokens_ids`]) are
    /// masked from sampling and end nothing; at most
    /// [`baton_proto::MAX_MIN_TOKENS_STOP_IDS`] such ids when non-zero.
    pub min_tokens: u32,
    /// vLLM's `cache_salt`, hashed (0: none): mixed into the prefix-cache key of the first
    /// block, so only requests with the same salt share cached blocks.
    pub cache_salt: u64,
    /// Structured output: the compiled constraint at the start of the output, or `None`. The
    /// scheduler computes the token mask of each sampling row from it and feeds it every
    /// accepted token; a guided request has at most one sampling row in flight. Needs tables
    /// with a token-mask table, `min_tokens == 0` and no `allowed_only`.
    pub guide: Option<baton_grammar::Guide>,
    /// vLLM's `priority`: under [`crate::SchedulingPolicy::Priority`] a lower value starts
    /// earlier and is preempted later; ignored under `Fcfs`.
    pub priority: i32,
    /// vLLM's `bad_words` as token sequences (each non-empty, at most
    /// [`baton_proto::wire::MAX_BAD_WORDS_WORDS`] words once packed): a word's last token is
    /// never sampled right after its other tokens ([`ban_bad_words`]). The scheduler writes
    /// the ban into the slot's token mask; a request with a word of several tokens has at
    /// most one sampling row in flight, as a guided one.
    pub bad_words: Vec<Vec<u32>>,
    /// The LoRA adapter the request runs with: 0 for the base model, `i + 1` for the `i`-th
    /// `--lora-modules` entry. Also mixed into the prefix-cache key ([`lora_salt`]): blocks
    /// computed with one adapter are never reused by another.
    pub lora: u32,
}

/// The prefix-cache salt of a request with vLLM's `cache_salt` hashed to `salt` running
/// with LoRA adapter `lora`: `salt` itself for the base model (0 stays 0), else a mix of
/// both that is never 0 (vLLM keys cached blocks by the LoRA name as well).
pub fn lora_salt(salt: u64, lora: u32) -> u64 {
    if lora == 0 {
        return salt;
    }
    let mut z = salt ^ u64::from(lora).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).max(1)
}

impl NewRequest {
    /// A request of `prompt` for up to `max_tokens` new tokens with `params`, and nothing
    /// else: no EOS or stop ids, bias, `min_tokens`, salt, guide, priority or bad words (set
    /// those with struct update syntax).
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32, params: SamplingParams) -> Self {
        Self {
            id,
            prompt,
            max_tokens,
            params,
            eos_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logit_bias: Vec::new(),
            min_tokens: 0,
            cache_salt: 0,
            guide: None,
            priority: 0,
            bad_words: Vec::new(),
            lora: 0,
        }
    }
}

/// Clears in `mask` (a token mask, bit `t % 32` of word `t / 32` for token `t`) the last
/// token of every word of `words` whose other tokens are the end of `outputs` (the request's
/// latest outputs, oldest first; only outputs count, not the prompt). A one-token word is
/// always banned; a longer word only once the request has that many outputs before it.
///
/// Source: vLLM's `bad_words` (`vllm/v1/sample/ops/bad_words.py`, `apply_bad_words`, which
/// compares each word's prefix with the request's output token ids).
pub fn ban_bad_words(words: &[Vec<u32>], outputs: &[u32], mask: &mut [u32]) {
    for last in bad_word_bans(words, outputs) {
        if let Some(m) = mask.get_mut(last as usize / 32) {
            *m &= !(1 << (last % 32));
        }
    }
}

/// The tokens [`ban_bad_words`] bans after `outputs`: the last token of each word of `words`
/// whose other tokens end `outputs` (a token may come more than once).
pub fn bad_word_bans<'a>(
    words: &'a [Vec<u32>],
    outputs: &'a [u32],
) -> impl Iterator<Item = u32> + 'a {
    words.iter().filter_map(move |w| {
        let (&last, prefix) = w.split_last()?;
        outputs.ends_with(prefix).then_some(last)
    })
}

/// The ids that end a request: `stop_token_ids`, plus `eos_ids` unless `ignore_eos`, sorted
/// ascending, each once. These are what `min_tokens` holds back while it applies.
pub fn stop_ids(stop_token_ids: &[u32], eos_ids: &[u32], ignore_eos: bool) -> Vec<u32> {
    let mut ids = stop_token_ids.to_vec();
    if !ignore_eos {
        ids.extend_from_slice(eos_ids);
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The ids `min_tokens` holds back: `stop_token_ids` and `eos_ids`, even under `ignore_eos`,
/// sorted ascending, each once.
///
/// Source: vLLM's `SamplingParams._all_stop_token_ids` (`update_from_generation_config` adds
/// the EOS ids whatever `ignore_eos` says), which its min-tokens logits processor masks.
pub fn min_tokens_ids(stop_token_ids: &[u32], eos_ids: &[u32]) -> Vec<u32> {
    stop_ids(stop_token_ids, eos_ids, false)
}

/// True when `min_tokens` would leave an allow-list (`allowed_token_ids`, as logit-bias
/// entries) with nothing to sample: every allowed token is one of `stops` (sorted, as
/// [`min_tokens_ids`] returns them), which `min_tokens` masks.
pub fn min_tokens_empties_allow_list(allowed: &[(u32, f32)], stops: &[u32]) -> bool {
    allowed
        .iter()
        .all(|&(t, _)| stops.binary_search(&t).is_ok())
}

/// True when `bad_words` leave an allow-list (`allowed_token_ids`, as logit-bias entries)
/// with nothing to sample: every allowed token is a bad word of one token.
pub fn bad_words_empty_allow_list(allowed: &[(u32, f32)], bad_words: &[Vec<u32>]) -> bool {
    allowed
        .iter()
        .all(|&(t, _)| bad_words.iter().any(|w| w[..] == [t]))
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was sampled.
    Stop,
    /// `max_tokens` or the model's maximum length was reached.
    Length,
    /// The engine gave up on the request (for example, it can no longer fit).
    Abort,
    /// The caller cancelled it; this is the cancel's acknowledgement.
    Cancelled,
}

/// The lifecycle state of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Waiting,
    Running,
}

/// Scheduler-private state of a live request.
#[derive(Debug)]
pub(crate) struct Request {
    pub id: RequestId,
    pub slot: Option<SlotRef>,
    /// Known history: prompt followed by accepted outputs, as of the last time the request
    /// took a slot. While it holds one, outputs accepted since then (positions
    /// `tokens.len()..known_len`) are only in the slot's row of the token table, which the
    /// scheduler alone writes; the scheduler copies them back here before it retires the slot
    /// (appending here too would touch one more heap page per running request per step).
    /// `tokens.len() == known_len` whenever the request has no slot.
    pub tokens: Vec<u32>,
    /// Prompt plus accepted outputs.
    pub known_len: usize,
    pub prompt_len: usize,
    pub computed_len: usize,
    pub scheduled_len: usize,
    /// Sampling rows in flight, oldest first: `(launch, row)`. Their tokens take positions
    /// `known_len ..` in order.
    pub inflight_samples: VecDeque<(LaunchSeq, u32)>,
    /// Block table: page ids, append-only while the request holds its slot.
    pub blocks: Vec<u32>,
    /// Leading entries of `blocks` whose pages the request has already let go of: with a
    /// sliding window on every layer ([`crate::SchedulerConfig::kv_window`]) no later query of
    /// the request reads their keys. Their table entries stay and are never read.
    pub released_blocks: usize,
    /// Prefix-cache keys of the full blocks of the known history computed so far (block `i`'s
    /// key at `i`); they depend on the tokens only, so they survive preemption.
    pub keys: Vec<BlockKey>,
    /// Leading entries of `blocks` that are registered in the prefix cache or were hits.
    pub registered: usize,
    /// Positions taken from the prefix cache when the request last took a slot.
    pub cached_len: usize,
    /// Prompt positions taken from the prefix cache when the request first took a slot (what
    /// `usage` reports, as vLLM does; a recompute after preemption or a worker death also
    /// takes generated positions from the cache, which are not prompt tokens).
    pub prompt_cached: Option<usize>,
    /// Last launch that referred to this request's pages and slot (0: none).
    pub last_launch: LaunchSeq,
    pub max_tokens: usize,
    pub params: SamplingParams,
    /// Written into the slot's logit-bias row at every slot take: the request's bias, then
    /// (with `min_tokens > 0`) its stop ids at `-inf`.
    pub logit_bias: Vec<(u32, f32)>,
    /// See [`NewRequest::min_tokens`].
    pub min_tokens: usize,
    /// See [`NewRequest::cache_salt`], mixed with the adapter ([`lora_salt`]).
    pub cache_salt: u64,
    /// See [`NewRequest::lora`].
    pub lora: u32,
    pub stop_ids: Vec<u32>,
    /// Bit `t % 64` is set for every stop id `t`, so most sampled tokens are ruled out
    /// without reading `stop_ids`.
    pub stop_mask: u64,
    pub state: State,
    /// Times this request was preempted.
    pub preemptions: u32,
    /// The next prompt position whose log-probability the request's owner gets (from 1; see
    /// `SamplingParams::prompt_logprobs`). It survives preemption, so a recompute reports
    /// only the positions not yet delivered.
    pub prompt_lp_next: usize,
    /// Structured output: the guide and the mask of the next sampled token (computed when the
    /// previous token was accepted; it survives preemption, which keeps the outputs).
    pub guide: Option<Box<Guided>>,
    /// See [`NewRequest::priority`].
    pub priority: i32,
    /// Admission order among all requests (set by the scheduler), the tie-break of `priority`.
    pub arrival: u64,
    /// See [`NewRequest::bad_words`].
    pub bad_words: Vec<Vec<u32>>,
    /// Tokens of the longest bad word (0: none).
    pub bad_words_longest: usize,
    /// Without a guide: the tokens a bad word of several tokens clears in the slot's mask row
    /// now, on top of the one-token words' fixed bans (written at slot take). The next
    /// sampling row allows them again before it clears its own, so a row costs O(tokens of
    /// the longer words + bans × log one-token words) instead of a whole mask.
    pub bad_words_banned: Vec<u32>,
    /// The bad words of one token, sorted ascending, each once: the bans that stay in the
    /// slot's mask row for the whole request. `plan_row` searches it before it allows a
    /// longer word's previous ban again.
    pub bad_words_one_token: Vec<u32>,
    /// `bad_words` is sorted by length (stably): the words from this index on have several
    /// tokens, the only ones whose bans change from row to row.
    pub bad_words_longer_from: usize,
}

/// A guided request's constraint state.
#[derive(Debug)]
pub(crate) struct Guided {
    pub guide: baton_grammar::Guide,
    /// [`baton_proto::token_mask_words`] words: the tokens allowed next.
    pub mask: Vec<u32>,
}

impl Request {
    pub fn new(r: NewRequest) -> Self {
        // What ends the request, each once (what min_tokens holds back: `min_tokens_ids`).
        let stop_ids = stop_ids(&r.stop_token_ids, &r.eos_ids, r.ignore_eos);
        let stop_mask = stop_ids.iter().fold(0, |m, &t| m | 1 << (t % 64));
        Self {
            id: r.id,
            slot: None,
            known_len: r.prompt.len(),
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            computed_len: 0,
            scheduled_len: 0,
            inflight_samples: VecDeque::new(),
            blocks: Vec::new(),
            released_blocks: 0,
            keys: Vec::new(),
            registered: 0,
            cached_len: 0,
            prompt_cached: None,
            last_launch: 0,
            max_tokens: r.max_tokens as usize,
            params: r.params,
            logit_bias: {
                let mut b = r.logit_bias;
                if r.min_tokens > 0 {
                    let held = min_tokens_ids(&r.stop_token_ids, &r.eos_ids);
                    b.extend(held.iter().map(|&t| (t, f32::NEG_INFINITY)));
                }
                b
            },
            min_tokens: r.min_tokens as usize,
            cache_salt: lora_salt(r.cache_salt, r.lora),
            lora: r.lora,
            stop_ids,
            stop_mask,
            state: State::Waiting,
            preemptions: 0,
            prompt_lp_next: 1,
            guide: r.guide.map(|guide| {
                Box::new(Guided {
                    guide,
                    mask: Vec::new(),
                })
            }),
            priority: r.priority,
            arrival: 0,
            bad_words_longest: r.bad_words.iter().map(Vec::len).max().unwrap_or(0),
            bad_words_banned: Vec::new(),
            bad_words_longer_from: r.bad_words.iter().filter(|w| w.len() < 2).count(),
            bad_words_one_token: {
                let mut ids: Vec<u32> = r
                    .bad_words
                    .iter()
                    .filter_map(|w| match w[..] {
                        [t] => Some(t),
                        _ => None,
                    })
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            },
            bad_words: {
                let mut words = r.bad_words;
                words.sort_by_key(Vec::len);
                words
            },
        }
    }

    /// True when the token mask of the next sampling row depends on the outputs before it (a
    /// guide, or a bad word of several tokens): such a row is planned only once every earlier
    /// sample is accepted, and updates the slot's mask row when planned (a guided row writes
    /// it whole; a row with bad words only changes the bits of its words' last tokens).
    /// Otherwise a request with bad words has a fixed mask, written once at slot take.
    #[inline]
    pub fn mask_follows_outputs(&self) -> bool {
        self.guide.is_some() || self.bad_words_longest > 1
    }

    /// Back to waiting with nothing computed or scheduled (preemption, worker death, or a
    /// first launch that could not get its pages); the known history and the block keys stay.
    /// The caller has already given back the slot and pages.
    pub fn back_to_waiting(&mut self) {
        debug_assert!(self.slot.is_none() && self.blocks.is_empty());
        debug_assert_eq!(self.released_blocks, 0);
        self.state = State::Waiting;
        self.computed_len = 0;
        self.scheduled_len = 0;
        self.registered = 0;
        self.cached_len = 0;
        self.inflight_samples.clear();
    }

    #[inline]
    pub fn known_len(&self) -> usize {
        self.known_len
    }

    #[inline]
    pub fn num_outputs(&self) -> usize {
        self.known_len - self.prompt_len
    }

    /// Outputs accepted plus outputs being sampled.
    #[inline]
    pub fn outputs_promised(&self) -> usize {
        self.num_outputs() + self.inflight_samples.len()
    }

    /// True while prompt log-probabilities are wanted and some are not delivered yet.
    #[inline]
    pub fn owes_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs > 0 && self.prompt_lp_next < self.prompt_len
    }

    /// True if `token` ends generation.
    #[inline]
    pub fn is_stop(&self, token: u32) -> bool {
        self.stop_mask >> (token % 64) & 1 != 0 && self.stop_ids.contains(&token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_salts_keep_the_base_salt_and_separate_adapters() {
        for salt in [0, 1, 0xdead_beef] {
            assert_eq!(lora_salt(salt, 0), salt);
            let per_adapter: Vec<u64> = (1..=64).map(|l| lora_salt(salt, l)).collect();
            assert!(per_adapter.iter().all(|&s| s != 0 && s != salt));
            let mut uniq = per_adapter.clone();
            uniq.sort_unstable();
            uniq.dedup();
            assert_eq!(uniq.len(), per_adapter.len(), "salt {salt}");
        }
        assert_ne!(lora_salt(1, 1), lora_salt(2, 1));
    }

    #[test]
    fn stop_ids_are_found_through_the_mask() {
        let r = Request::new(NewRequest {
            priority: 0,
            id: 1,
            prompt: vec![5],
            max_tokens: 1,
            params: SamplingParams::greedy(),
            eos_ids: vec![2, 66],
            stop_token_ids: vec![1000],
            ignore_eos: false,
            logit_bias: Vec::new(),
            min_tokens: 0,
            cache_salt: 0,
            guide: None,
            bad_words: Vec::new(),
            lora: 0,
        });
        for t in 0..2000 {
            assert_eq!(r.is_stop(t), [2, 66, 1000].contains(&t), "{t}");
        }
    }

    /// The tokens `ban_bad_words` leaves allowed in a 70-token vocabulary.
    fn banned(words: &[Vec<u32>], outputs: &[u32]) -> Vec<u32> {
        let mut mask = vec![u32::MAX; 3];
        ban_bad_words(words, outputs, &mut mask);
        (0..70)
            .filter(|&t| mask[t / 32] >> (t % 32) & 1 == 0)
            .map(|t| t as u32)
            .collect()
    }

    #[test]
    fn bad_words_ban_the_last_token_after_their_prefix() {
        let words = vec![vec![5], vec![1, 2, 40], vec![2, 33], vec![9, 64]];
        // A one-token word is always banned, even before any output.
        assert_eq!(banned(&words, &[]), [5]);
        assert_eq!(banned(&words, &[7]), [5]);
        // A longer word's last token only right after its other tokens, in order.
        assert_eq!(banned(&words, &[7, 2]), [5, 33]);
        assert_eq!(banned(&words, &[1, 2]), [5, 33, 40]);
        assert_eq!(banned(&words, &[2, 1]), [5]);
        assert_eq!(banned(&words, &[1, 2, 7]), [5]);
        assert_eq!(banned(&words, &[9]), [5, 64]);
    }
}
