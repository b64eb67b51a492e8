//! Fixed-size ring slots of the control plane (DESIGN.md section 6).
//!
//! Contract: every slot is `#[repr(C)]` plain data with no pointers. A message longer than one
//! slot (a prompt, a launch with many rows, a completion) is a header slot followed by body
//! slots, pushed by one producer into one SPSC ring, so the consumer reads them contiguously.
//! The consumer never acts on a message until its last slot has arrived.

use crate::{LaunchRow, LaunchSeq, SamplingParams, SlotRef, MAX_TOP_LOGPROBS};
use bytemuck::{Pod, Zeroable};

/// Tokens carried by one [`ToScheduler`] slot.
pub const TOKENS_PER_SLOT: usize = 16;

/// Kinds of [`ToScheduler`] slots.
pub mod to_scheduler {
    /// A new request: `req`, `max_tokens`, `flags`, `params`, `prompt_len` and `num_stop`
    /// follow in the fields; [`super::admit_words`] words follow in `Tokens` slots: the prompt,
    /// the stop ids, then `params.logit_bias_len` pairs `(token, bias as f32 bits)`.
    pub const ADMIT: u32 = 1;
    /// Up to [`super::TOKENS_PER_SLOT`] tokens of the request being admitted (`n` valid).
    pub const TOKENS: u32 = 2;
    /// Cancel `req`.
    pub const CANCEL: u32 = 3;
}

/// The words that follow an `ADMIT` slot in `TOKENS` slots: prompt, stop ids, logit-bias pairs,
/// the structured-output constraint's `constraint_len` bytes, four to a word
/// (little-endian, the last word zero-padded), then the `bad_words_len` words of vLLM's
/// `bad_words` ([`pack_bad_words`]).
pub fn admit_words(head: &ToScheduler) -> usize {
    head.prompt_len as usize
        + head.n as usize
        + 2 * head.params.logit_bias_len as usize
        + (head.constraint_len as usize).div_ceil(4)
        + head.bad_words_len as usize
}

/// Most words of an admission's `bad_words` section ([`pack_bad_words`]: one length word per
/// word plus its token ids).
pub const MAX_BAD_WORDS_WORDS: usize = 4096;

/// vLLM's `bad_words` as token sequences, flattened for the wire: for each word its length,
/// then its token ids.
pub fn pack_bad_words(words: &[Vec<u32>]) -> Vec<u32> {
    let mut out = Vec::with_capacity(words.iter().map(|w| 1 + w.len()).sum());
    for w in words {
        out.push(w.len() as u32);
        out.extend_from_slice(w);
    }
    out
}

/// The token sequences [`pack_bad_words`] flattened into `words`.
///
/// # Errors
/// `None` when a length is zero or runs past the end of `words`.
pub fn unpack_bad_words(words: &[u32]) -> Option<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    let mut rest = words;
    while let Some((&n, tail)) = rest.split_first() {
        let n = n as usize;
        if n == 0 || n > tail.len() {
            return None;
        }
        out.push(tail[..n].to_vec());
        rest = &tail[n..];
    }
    Some(out)
}

/// Packs `bytes` four to a `u32` word, little-endian, the last word zero-padded.
pub fn pack_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The first `len` bytes of `words` packed by [`pack_bytes`] (fewer if `words` is short).
pub fn unpack_bytes(words: &[u32], len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(len);
    out
}

/// Admission flag: the model's EOS ids (the last [`ToScheduler::eos_len`] stop ids) end
/// nothing.
pub const FLAG_IGNORE_EOS: u32 = 1;
/// [`ToScheduler::flags`]: the structured-output constraint applies after
/// [`ToScheduler::guide_after`] is sampled (the end of the reasoning).
pub const FLAG_GUIDE_AFTER: u32 = 2;

/// A frontend-to-scheduler slot (admission and cancels).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ToScheduler {
    /// One of [`to_scheduler`].
    pub kind: u32,
    /// Valid tokens in `tokens` (`TOKENS`), or the number of stop ids (`ADMIT`; the last
    /// `eos_len` of them are the model's EOS ids).
    pub n: u32,
    /// The frontend's request id.
    pub req: u64,
    /// `ADMIT`: prompt tokens.
    pub prompt_len: u32,
    /// `ADMIT`: most new tokens.
    pub max_tokens: u32,
    /// `ADMIT`: [`FLAG_IGNORE_EOS`], [`FLAG_GUIDE_AFTER`].
    pub flags: u32,
    /// `ADMIT`: vLLM's `min_tokens` (stop ids cannot end the request before this many outputs).
    pub min_tokens: u32,
    /// `ADMIT`: bytes of the structured-output constraint (`baton_grammar::Constraint`'s wire
    /// form) at the end of the admission's words; 0: unconstrained.
    pub constraint_len: u32,
    /// `ADMIT` with [`FLAG_GUIDE_AFTER`]: the constraint applies after this token is
    /// sampled (`baton_grammar::Guide::start_after`); else zero.
    pub guide_after: u32,
    /// `ADMIT`: vLLM's `priority` (lower runs first under the scheduler's priority policy;
    /// 0 under first come, first served).
    pub priority: i32,
    /// `ADMIT`: words of the `bad_words` section at the very end of the admission's words
    /// ([`pack_bad_words`]; at most [`MAX_BAD_WORDS_WORDS`]); 0: none.
    pub bad_words_len: u32,
    /// `ADMIT`: how many of the `n` stop ids, at their end, are the model's EOS ids. They end
    /// the request unless [`FLAG_IGNORE_EOS`]; `min_tokens` holds them back either way (vLLM's
    /// `_all_stop_token_ids`).
    pub eos_len: u32,
    /// `ADMIT`: the LoRA adapter the request runs with (0: the base model; `i + 1`: the
    /// `i`-th of the scheduler's `--lora-modules`, at most [`crate::plane::PlaneLimits::lora_count`]).
    pub lora: u32,
    /// `ADMIT`: vLLM's `cache_salt`, hashed by the frontend (0: none).
    pub cache_salt: u64,
    /// `ADMIT`: sampling parameters.
    pub params: SamplingParams,
    /// `TOKENS`: the tokens.
    pub tokens: [u32; TOKENS_PER_SLOT],
}

/// Kinds of [`ToFrontend`] slots.
pub mod to_frontend {
    /// A new token of `req`.
    pub const TOKEN: u32 = 1;
    /// `req` ended with `reason` (see [`super::reason`]).
    pub const FINISHED: u32 = 2;
    /// `req` was refused or failed; `reason` holds an error code (see [`super::error`]).
    pub const ERROR: u32 = 3;
    /// The log-probability of `req`'s prompt token `token` at position `detail`, with its top
    /// entries ([`crate::PromptLogprob`]). A request's prompt entries arrive in position
    /// order, before its first `TOKEN`.
    pub const PROMPT_LOGPROB: u32 = 4;
}

/// Finish reasons on the wire.
pub mod reason {
    /// A stop token.
    pub const STOP: u32 = 1;
    /// `max_tokens` or the model's maximum length.
    pub const LENGTH: u32 = 2;
    /// The engine gave up.
    pub const ABORT: u32 = 3;
    /// The acknowledgement of a cancel.
    pub const CANCELLED: u32 = 4;
}

/// Error codes on the wire.
pub mod error {
    /// The request can never run (empty prompt, too long, too large for the pool, bad token).
    pub const INVALID: u32 = 1;
    /// The scheduler is shutting down.
    pub const SHUTDOWN: u32 = 2;
    /// A malformed admission sequence.
    pub const PROTOCOL: u32 = 3;
    /// A structured-output request to a scheduler started without a tokenizer.json (it has
    /// no vocabulary to compile constraints against).
    pub const NO_GRAMMAR_VOCABULARY: u32 = 4;
}

/// A scheduler-to-frontend slot (outputs and acknowledgements).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ToFrontend {
    /// One of [`to_frontend`].
    pub kind: u32,
    /// `FINISHED`: one of [`reason`]; `ERROR`: one of [`error`].
    pub reason: u32,
    /// The frontend's request id.
    pub req: u64,
    /// `TOKEN`: the token.
    pub token: u32,
    /// `TOKEN`: its log-probability (0 unless asked).
    pub logprob: f32,
    /// `TOKEN`: valid entries of `top_ids`/`top_logprobs`.
    pub n_top: u32,
    /// `FINISHED`: prompt tokens.
    pub prompt_tokens: u32,
    /// `FINISHED`: output tokens. `PROMPT_LOGPROB`: the token's rank
    /// ([`crate::PromptLogprob::rank`]).
    pub output_tokens: u32,
    /// `ERROR`: a detail, for example the admission error's limit. `FINISHED` and `TOKEN`:
    /// prompt tokens taken from the prefix cache. `PROMPT_LOGPROB`: the position.
    pub detail: u32,
    /// Top token ids.
    pub top_ids: [u32; MAX_TOP_LOGPROBS],
    /// Their log-probabilities.
    pub top_logprobs: [f32; MAX_TOP_LOGPROBS],
    /// `TOKEN`: on a request's first token, its queue and prefill times in seconds
    /// ([`crate::FirstTokenTimes`]); negative on its other tokens. Not read on other kinds.
    /// See [`encode_first`].
    pub first: [f32; 2],
}

/// [`ToFrontend::first`] for `t` (f32 seconds; `None`: -1, not a first token).
pub fn encode_first(t: Option<crate::FirstTokenTimes>) -> [f32; 2] {
    t.map_or([-1.0; 2], |t| {
        [t.queue.max(0.0) as f32, t.prefill.max(0.0) as f32]
    })
}

/// The inverse of [`encode_first`].
pub fn decode_first(w: [f32; 2]) -> Option<crate::FirstTokenTimes> {
    (w[0] >= 0.0 && w[1] >= 0.0).then(|| crate::FirstTokenTimes {
        queue: f64::from(w[0]),
        prefill: f64::from(w[1]),
    })
}

/// Kinds of [`LaunchSlot`].
pub mod launch_kind {
    /// A launch header: `seq` and `n` rows follow.
    pub const HEADER: u32 = 1;
    /// One row of launch `seq`.
    pub const ROW: u32 = 2;
}

/// A scheduler-to-worker slot: a launch header or one row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct LaunchSlot {
    /// One of [`launch_kind`].
    pub kind: u32,
    /// `HEADER`: rows that follow.
    pub n: u32,
    /// The launch.
    pub seq: LaunchSeq,
    /// `ROW`: the row.
    pub row: LaunchRow,
}

/// Kinds of [`CompletionSlot`].
pub mod completion_kind {
    /// A completion header: launch `seq` finished (fenced); `n` body slots follow (`SAMPLED`
    /// then `PROMPT`).
    pub const HEADER: u32 = 1;
    /// One sampled row.
    pub const SAMPLED: u32 = 2;
    /// The worker failed launch `seq`; `n` holds an error code.
    pub const FAILED: u32 = 3;
    /// One prompt log-probability ([`crate::PromptLogprob`]); `n` holds its position.
    pub const PROMPT: u32 = 4;
}

/// A worker-to-scheduler slot: a completion header, one sampled row or one prompt
/// log-probability.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CompletionSlot {
    /// One of [`completion_kind`].
    pub kind: u32,
    /// `HEADER`: body slots that follow. `PROMPT`: the scored position.
    pub n: u32,
    /// The launch.
    pub seq: LaunchSeq,
    /// `SAMPLED`, `PROMPT`: the request of the row.
    pub req: SlotRef,
    /// `SAMPLED`, `PROMPT`: row index.
    pub row: u32,
    /// `SAMPLED`, `PROMPT`: the token.
    pub token: u32,
    /// `SAMPLED`, `PROMPT`: its log-probability.
    pub logprob: f32,
    /// `SAMPLED`, `PROMPT`: valid top entries.
    pub n_top: u32,
    /// Top token ids.
    pub top_ids: [u32; MAX_TOP_LOGPROBS],
    /// Their log-probabilities.
    pub top_logprobs: [f32; MAX_TOP_LOGPROBS],
    /// `PROMPT`: the token's rank ([`crate::PromptLogprob::rank`]).
    pub rank: u32,
    /// Zero (keeps the struct free of padding for [`bytemuck::Pod`]).
    pub reserved: u32,
}

/// Encodes `launch` as a header slot followed by one slot per row.
pub fn encode_launch(launch: &crate::Launch, out: &mut Vec<LaunchSlot>) {
    out.push(LaunchSlot {
        kind: launch_kind::HEADER,
        n: launch.rows.len() as u32,
        seq: launch.seq,
        row: LaunchRow::zeroed(),
    });
    out.extend(launch.rows.iter().map(|&row| LaunchSlot {
        kind: launch_kind::ROW,
        n: 0,
        seq: launch.seq,
        row,
    }));
}

/// Encodes a completion as a header slot followed by one slot per sampled row, then one per
/// prompt log-probability.
pub fn encode_completion(c: &crate::Completion, out: &mut Vec<CompletionSlot>) {
    let mut header = CompletionSlot::zeroed();
    header.kind = completion_kind::HEADER;
    header.n = (c.sampled.len() + c.prompt.len()) as u32;
    header.seq = c.seq;
    out.push(header);
    let body = |kind: u32, n: u32, req, row, token, logprob, top: &[(u32, f32)]| {
        let mut slot = CompletionSlot::zeroed();
        slot.kind = kind;
        slot.n = n;
        slot.seq = c.seq;
        slot.req = req;
        slot.row = row;
        slot.token = token;
        slot.logprob = logprob;
        let k = top.len().min(MAX_TOP_LOGPROBS);
        slot.n_top = k as u32;
        for (i, &(id, lp)) in top[..k].iter().enumerate() {
            slot.top_ids[i] = id;
            slot.top_logprobs[i] = lp;
        }
        slot
    };
    for s in &c.sampled {
        let kind = completion_kind::SAMPLED;
        out.push(body(kind, 0, s.req, s.row, s.token, s.logprob, &s.top));
    }
    for p in &c.prompt {
        let kind = completion_kind::PROMPT;
        let mut slot = body(kind, p.pos, p.req, p.row, p.token, p.logprob, &p.top);
        slot.rank = p.rank;
        out.push(slot);
    }
}

fn decode_top(slot: &CompletionSlot) -> Vec<(u32, f32)> {
    let n = (slot.n_top as usize).min(MAX_TOP_LOGPROBS);
    (0..n)
        .map(|i| (slot.top_ids[i], slot.top_logprobs[i]))
        .collect()
}

/// Decodes a sampled row slot.
pub fn decode_sampled(slot: &CompletionSlot) -> crate::Sampled {
    crate::Sampled {
        row: slot.row,
        req: slot.req,
        token: slot.token,
        logprob: slot.logprob,
        top: decode_top(slot),
    }
}

/// Decodes a prompt log-probability slot.
pub fn decode_prompt(slot: &CompletionSlot) -> crate::PromptLogprob {
    crate::PromptLogprob {
        row: slot.row,
        req: slot.req,
        pos: slot.n,
        token: slot.token,
        logprob: slot.logprob,
        rank: slot.rank,
        top: decode_top(slot),
    }
}

/// Reassembles multi-slot messages from a stream of slots: feed slots in ring order, get whole
/// messages out. A header that arrives before the previous message completed is a protocol
/// error (the producer died mid-write); the partial message is dropped and reported.
#[derive(Debug, Default)]
pub struct LaunchAssembler {
    current: Option<(crate::Launch, usize)>,
}

impl LaunchAssembler {
    /// Feeds one slot; returns a launch when its last row arrived.
    ///
    /// # Errors
    /// A description of the malformed sequence.
    pub fn feed(&mut self, slot: &LaunchSlot) -> Result<Option<crate::Launch>, String> {
        match slot.kind {
            launch_kind::HEADER => {
                let torn = self.current.take();
                let launch = crate::Launch {
                    seq: slot.seq,
                    rows: Vec::with_capacity(slot.n as usize),
                };
                if slot.n == 0 {
                    return Ok(Some(launch));
                }
                self.current = Some((launch, slot.n as usize));
                if let Some((l, _)) = torn {
                    return Err(format!(
                        "launch {} was torn: a new header arrived before its rows",
                        l.seq
                    ));
                }
                Ok(None)
            }
            launch_kind::ROW => {
                let Some((launch, want)) = &mut self.current else {
                    return Err(format!(
                        "a row of launch {} arrived without its header",
                        slot.seq
                    ));
                };
                if slot.seq != launch.seq {
                    let seq = launch.seq;
                    self.current = None;
                    return Err(format!(
                        "a row of launch {} arrived inside launch {seq}",
                        slot.seq
                    ));
                }
                launch.rows.push(slot.row);
                if launch.rows.len() == *want {
                    return Ok(self.current.take().map(|(l, _)| l));
                }
                Ok(None)
            }
            k => Err(format!("unknown launch slot kind {k}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Completion, Launch, PromptLogprob, Sampled};

    #[test]
    fn bytes_pack_four_to_a_word() {
        for n in 0..9 {
            let b: Vec<u8> = (1..=n).collect();
            let w = pack_bytes(&b);
            assert_eq!(w.len(), (n as usize).div_ceil(4));
            assert_eq!(unpack_bytes(&w, b.len()), b);
        }
        assert_eq!(pack_bytes(&[1, 2, 3, 4, 5]), [0x0403_0201, 5]);
    }

    #[test]
    fn bad_words_round_trip_and_malformed_sections_are_refused() {
        let words = vec![vec![7], vec![1, 2, 3], vec![0, 9]];
        let w = pack_bad_words(&words);
        assert_eq!(w, [1, 7, 3, 1, 2, 3, 2, 0, 9]);
        assert_eq!(unpack_bad_words(&w), Some(words));
        assert_eq!(unpack_bad_words(&[]), Some(Vec::new()));
        // A zero length, and a length past the end.
        assert_eq!(unpack_bad_words(&[1, 7, 0]), None);
        assert_eq!(unpack_bad_words(&[3, 1, 2]), None);
    }

    #[test]
    fn launches_round_trip_through_slots() {
        let mut row = LaunchRow::zeroed();
        row.first_pos = 7;
        row.num_tokens = 3;
        let l = Launch {
            seq: 9,
            rows: vec![row, row],
        };
        let mut slots = Vec::new();
        encode_launch(&l, &mut slots);
        let mut a = LaunchAssembler::default();
        assert_eq!(a.feed(&slots[0]).unwrap(), None);
        assert_eq!(a.feed(&slots[1]).unwrap(), None);
        assert_eq!(a.feed(&slots[2]).unwrap(), Some(l));
    }

    #[test]
    fn a_torn_launch_is_reported_not_merged() {
        let mut slots = Vec::new();
        encode_launch(
            &Launch {
                seq: 1,
                rows: vec![LaunchRow::zeroed(); 2],
            },
            &mut slots,
        );
        encode_launch(
            &Launch {
                seq: 2,
                rows: vec![LaunchRow::zeroed()],
            },
            &mut slots,
        );
        let mut a = LaunchAssembler::default();
        a.feed(&slots[0]).unwrap();
        a.feed(&slots[1]).unwrap();
        assert!(
            a.feed(&slots[3]).is_err(),
            "a header inside a launch must be an error"
        );
        assert_eq!(a.feed(&slots[4]).unwrap().map(|l| l.seq), Some(2));
    }

    #[test]
    fn completions_keep_top_logprobs() {
        let req = SlotRef {
            slot: 2,
            generation: 3,
        };
        let c = Completion {
            seq: 4,
            sampled: vec![Sampled {
                row: 1,
                req,
                token: 5,
                logprob: -0.5,
                top: vec![(5, -0.5), (6, -1.5)],
            }],
            prompt: vec![
                PromptLogprob {
                    row: 0,
                    req,
                    pos: 9,
                    token: 7,
                    logprob: -2.25,
                    rank: 4,
                    top: vec![(3, -0.25)],
                },
                PromptLogprob {
                    row: 0,
                    req,
                    pos: 10,
                    token: 8,
                    logprob: -1.0,
                    rank: 1,
                    top: Vec::new(),
                },
            ],
        };
        let mut slots = Vec::new();
        encode_completion(&c, &mut slots);
        assert_eq!(slots[0].n, 3, "the header counts every body slot");
        assert_eq!(slots[1].kind, completion_kind::SAMPLED);
        assert_eq!(decode_sampled(&slots[1]), c.sampled[0]);
        assert_eq!(slots[2].kind, completion_kind::PROMPT);
        assert_eq!(decode_prompt(&slots[2]), c.prompt[0]);
        assert_eq!(decode_prompt(&slots[3]), c.prompt[1]);
    }
}
