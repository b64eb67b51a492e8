//! Logit bias and presence, frequency and repetition penalties: the reference both samplers
//! follow.
//!
//! # Semantics (vLLM `apply_penalties`, `vllm/model_executor/layers/utils.py`)
//!
//! For a row sampling output number `output_index` of a request with `prompt_len` prompt tokens,
//! the history is the request's tokens at positions `0 .. prompt_len + output_index`: the prompt,
//! then the outputs so far. For every distinct token `t` of that history, with `c` its number of
//! occurrences among the outputs, and for every token `t` with a logit bias `b` (OpenAI
//! `logit_bias`, applied first as vLLM's logits processor is), its logit `x` becomes, in this
//! order:
//!
//! 0. `x + b` (`b = 0` for a token without a bias);
//! 1. if the repetition penalty `r` is in effect (`r > 0`, `r != 1`): `x / r` when `x > 0`, else
//!    `x * r` (the CTRL penalty, Keskar et al. 2019, applied to prompt and output tokens alike);
//! 2. if `c > 0`: `x - frequency_penalty * c`, then `- presence_penalty`.
//!
//! Tokens that neither occur nor have a bias are untouched. Penalties come before temperature and the top-k /
//! top-p / min-p filters, so a greedy row takes the argmax of the penalized logits. The returned
//! log-probabilities stay those of the raw logits (vLLM's default `raw_logprobs`).
//!
//! The penalty list of a row ([`PenaltyEntry`], one per distinct token, ascending by id) is built
//! on the host from the token table ([`build_penalty_list`]). The CPU sampler applies it with
//! [`penalize`]; the CUDA sampler applies the same arithmetic in `kernels/sampling.cu`, so the two
//! agree bit for bit on the penalized logits.

use baton_proto::SamplingParams;

/// One distinct token of a row's history or logit bias, as the penalty step sees it.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct PenaltyEntry {
    /// Token id.
    pub token: u32,
    /// Occurrences among the request's outputs so far.
    pub output_count: u32,
    /// True if the token occurs in the prompt.
    pub in_prompt: bool,
    /// The request's logit bias for the token (0 when it has none).
    pub bias: f32,
    /// The token has an entry in the slot's logit-bias row (a bias, a `min_tokens` mask, or an
    /// `allowed_token_ids` entry): with `SamplingParams::allowed_only`, the tokens that may be
    /// sampled.
    pub listed: bool,
}

/// Builds the penalty list of a history and a logit bias: one entry per distinct token,
/// ascending by token id.
///
/// `history` holds the request's tokens at positions `0 .. history.len()`; positions
/// `prompt_len ..` are outputs. With `with_prompt == false` (no repetition penalty) prompt
/// tokens are left out, since only outputs are penalized; callers may then pass just the outputs
/// with `prompt_len == 0`. `bias` is the request's logit bias, `(token, bias)` in any order (for
/// a repeated token the last entry counts). `scratch` is reused storage. Cost: one sort of
/// `history.len()` keys and one of the list.
pub fn build_penalty_list(
    history: &[u32],
    prompt_len: usize,
    with_prompt: bool,
    bias: &[(u32, f32)],
    scratch: &mut Vec<u64>,
    out: &mut Vec<PenaltyEntry>,
) {
    out.clear();
    scratch.clear();
    let prompt_len = prompt_len.min(history.len());
    if with_prompt {
        scratch.extend(history[..prompt_len].iter().map(|&t| u64::from(t) << 1));
    }
    scratch.extend(
        history[prompt_len..]
            .iter()
            .map(|&t| (u64::from(t) << 1) | 1),
    );
    scratch.sort_unstable();
    for &k in scratch.iter() {
        let token = (k >> 1) as u32;
        let is_output = k & 1 == 1;
        match out.last_mut() {
            Some(e) if e.token == token => e.output_count += u32::from(is_output),
            _ => out.push(PenaltyEntry {
                token,
                output_count: u32::from(is_output),
                in_prompt: !is_output,
                bias: 0.0,
                listed: false,
            }),
        }
    }
    merge_bias(out, bias);
}

/// Merges the logit bias into `out` (distinct tokens, ascending): a bias on a listed token
/// joins its entry, others get their own; `out` stays ascending and distinct, and for a token
/// repeated in `bias` the last entry counts.
fn merge_bias(out: &mut Vec<PenaltyEntry>, bias: &[(u32, f32)]) {
    if bias.is_empty() {
        return;
    }
    let from_history = out.len();
    for &(token, b) in bias {
        match out[..from_history].binary_search_by_key(&token, |e| e.token) {
            Ok(i) => {
                out[i].bias = b;
                out[i].listed = true;
            }
            Err(_) => out.push(PenaltyEntry {
                token,
                bias: b,
                listed: true,
                ..PenaltyEntry::default()
            }),
        }
    }
    // Stable, so that among repeated bias entries the last one stays last; then keep it.
    out.sort_by_key(|e| e.token);
    let mut w = 0;
    for r in 0..out.len() {
        if w > 0 && out[w - 1].token == out[r].token {
            out[w - 1] = out[r];
        } else {
            out[w] = out[r];
            w += 1;
        }
    }
    out.truncate(w);
}

/// The token counts of each slot's history, kept across steps: a penalized row then costs
/// `O(new tokens + distinct tokens)` per step rather than a sort of its whole history
/// (`bench/RESULTS.md`, "Penalties"). Both workers build every row's list through
/// [`PenaltyHistories::row_list`]; [`build_penalty_list`] is its reference.
///
/// Contract: the positions of a slot's row that the cache covers are never rewritten while the
/// slot keeps its generation (the token table is append-only per request, a recompute after
/// preemption or a worker death runs in a new slot generation), and a row's positions
/// `0 .. first_pos` are in the token table when it executes (the scheduler plans a penalized
/// row only once every input but its first is known).
#[derive(Debug, Default)]
pub struct PenaltyHistories {
    slots: std::collections::HashMap<u32, SlotCounts>,
    scratch: Vec<u32>,
}

/// The counted prefix of one slot's history.
#[derive(Debug, Default)]
struct SlotCounts {
    generation: u32,
    prompt_len: usize,
    with_prompt: bool,
    /// Positions `from .. covered` are counted (`from`: 0, or `prompt_len` without prompt).
    covered: usize,
    /// Token -> (occurrences among outputs, occurs in the prompt), ascending by token.
    counts: std::collections::BTreeMap<u32, (u32, bool)>,
}

/// Where a row's history is, for [`PenaltyHistories::row_list`].
#[derive(Clone, Copy, Debug)]
pub struct RowHistory<'a> {
    /// The request's slot and its generation.
    pub slot: baton_proto::SlotRef,
    /// The row's first position: positions `0 .. first_pos` are read from the token table.
    pub first_pos: usize,
    /// Prompt tokens of the request (`first_pos + num_tokens - output_index`).
    pub prompt_len: usize,
    /// Count prompt tokens too (the repetition penalty is in effect).
    pub with_prompt: bool,
    /// The row's inputs the caller knows, at positions `own_start ..`: all of them, or all
    /// but a pending first id that the device merges itself.
    pub own: &'a [u32],
    /// Position of `own[0]` (`first_pos`, or `first_pos + 1` without the pending id).
    pub own_start: usize,
}

impl PenaltyHistories {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The penalty list of a row: equal to [`build_penalty_list`] over the history positions
    /// `0 .. first_pos` and then `own`, with `bias` merged.
    pub fn row_list(
        &mut self,
        h: &RowHistory<'_>,
        tables: &dyn crate::TableReader,
        bias: &[(u32, f32)],
        out: &mut Vec<PenaltyEntry>,
    ) {
        let from = if h.with_prompt { 0 } else { h.prompt_len };
        let c = self.slots.entry(h.slot.slot).or_default();
        if c.generation != h.slot.generation
            || c.prompt_len != h.prompt_len
            || c.with_prompt != h.with_prompt
            || c.covered > h.first_pos.max(from)
        {
            c.generation = h.slot.generation;
            c.prompt_len = h.prompt_len;
            c.with_prompt = h.with_prompt;
            c.covered = from;
            c.counts.clear();
        }
        let count = |counts: &mut std::collections::BTreeMap<u32, (u32, bool)>, pos, t| {
            let e = counts.entry(t).or_insert((0, false));
            if pos < h.prompt_len {
                e.1 = true;
            } else {
                e.0 += 1;
            }
        };
        if c.covered < h.first_pos {
            self.scratch.clear();
            tables.read_tokens(h.slot.slot, c.covered..h.first_pos, &mut self.scratch);
            for (i, &t) in self.scratch.iter().enumerate() {
                count(&mut c.counts, c.covered + i, t);
            }
            c.covered = h.first_pos;
        }
        out.clear();
        out.extend(c.counts.iter().map(|(&token, &(n, p))| PenaltyEntry {
            token,
            output_count: n,
            in_prompt: p,
            bias: 0.0,
            listed: false,
        }));
        // The row's own inputs: one for a decode, a chunk for a prefill.
        let known = out.len();
        for (i, &token) in h.own.iter().enumerate() {
            let pos = h.own_start + i;
            if pos < from {
                continue;
            }
            let (n, p) = if pos < h.prompt_len {
                (0, true)
            } else {
                (1, false)
            };
            match out[..known].binary_search_by_key(&token, |e| e.token) {
                Ok(j) => {
                    out[j].output_count += n;
                    out[j].in_prompt |= p;
                }
                Err(_) => out.push(PenaltyEntry {
                    token,
                    output_count: n,
                    in_prompt: p,
                    bias: 0.0,
                    listed: false,
                }),
            }
        }
        if out.len() > known {
            // Sorted runs: the merge is linear in practice.
            out.sort_by_key(|e| e.token);
            let mut w = 0;
            for r in 0..out.len() {
                if w > 0 && out[w - 1].token == out[r].token {
                    out[w - 1].output_count += out[r].output_count;
                    out[w - 1].in_prompt |= out[r].in_prompt;
                } else {
                    out[w] = out[r];
                    w += 1;
                }
            }
            out.truncate(w);
        }
        merge_bias(out, bias);
    }

    /// The list of sampling launch row `r` (empty when its params adjust no logit): its logit
    /// bias from the slot's logit-bias row and, with penalties, its history. `own` are the
    /// row's inputs the caller knows, from position `own_start` on (see [`RowHistory::own`]);
    /// `bias` is scratch.
    ///
    /// # Errors
    /// The row's `output_index` exceeds its positions (a malformed launch record).
    pub fn launch_row(
        &mut self,
        r: &baton_proto::LaunchRow,
        own: &[u32],
        own_start: usize,
        tables: &dyn crate::TableReader,
        bias: &mut Vec<(u32, f32)>,
        out: &mut Vec<PenaltyEntry>,
    ) -> Result<(), String> {
        out.clear();
        if r.sample != 1 || !r.params.adjusts_logits() {
            return Ok(());
        }
        bias.clear();
        tables.read_logit_bias(r.req.slot, r.params.logit_bias_len as usize, bias);
        if !r.params.has_penalties() {
            merge_bias(out, bias);
            return Ok(());
        }
        let first_pos = r.first_pos as usize;
        let end = first_pos + r.num_tokens as usize;
        let prompt_len = end.checked_sub(r.output_index as usize).ok_or_else(|| {
            format!(
                "output index {} exceeds the row's {end} positions",
                r.output_index
            )
        })?;
        let h = RowHistory {
            slot: r.req,
            first_pos,
            prompt_len,
            with_prompt: r.params.has_repetition_penalty(),
            own,
            own_start,
        };
        self.row_list(&h, tables, bias, out);
        Ok(())
    }

    /// Forgets every slot (a new scheduler, or a cleared segment).
    pub fn clear(&mut self) {
        self.slots.clear();
    }
}

/// The penalized logit of one history token (see the module docs for the order of operations).
/// `kernels/sampling.cu` (`baton_penalize`) computes the same in the same order.
#[inline]
pub fn penalize(x: f32, e: &PenaltyEntry, p: &SamplingParams) -> f32 {
    let mut x = x + e.bias;
    if p.has_repetition_penalty() && (e.in_prompt || e.output_count > 0) {
        x = if x > 0.0 {
            x / p.repetition_penalty
        } else {
            x * p.repetition_penalty
        };
    }
    if e.output_count > 0 {
        x -= p.frequency_penalty * e.output_count as f32;
        x -= p.presence_penalty;
    }
    x
}

/// Applies `list` to a row's `logits` in place (entries with an id outside the vocabulary are
/// skipped).
pub fn apply_penalties(logits: &mut [f32], list: &[PenaltyEntry], p: &SamplingParams) {
    for e in list {
        if let Some(x) = logits.get_mut(e.token as usize) {
            *x = penalize(*x, e, p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(presence: f32, frequency: f32, repetition: f32) -> SamplingParams {
        SamplingParams {
            presence_penalty: presence,
            frequency_penalty: frequency,
            repetition_penalty: repetition,
            ..SamplingParams::greedy()
        }
    }

    /// A direct transcription of vLLM's tensor formulation over dense counts, as the oracle.
    fn dense_reference(
        logits: &[f32],
        history: &[u32],
        prompt_len: usize,
        bias: &[(u32, f32)],
        p: &SamplingParams,
    ) -> Vec<f32> {
        let v = logits.len();
        let mut prompt_mask = vec![false; v];
        let mut counts = vec![0u32; v];
        for (i, &t) in history.iter().enumerate() {
            if i < prompt_len {
                prompt_mask[t as usize] = true;
            } else {
                counts[t as usize] += 1;
            }
        }
        let mut dense_bias = vec![0.0f32; v];
        for &(t, b) in bias {
            dense_bias[t as usize] = b;
        }
        (0..v)
            .map(|i| {
                let mut x = logits[i] + dense_bias[i];
                if p.has_repetition_penalty() && (prompt_mask[i] || counts[i] > 0) {
                    x = if x > 0.0 {
                        x / p.repetition_penalty
                    } else {
                        x * p.repetition_penalty
                    };
                }
                x -= p.frequency_penalty * counts[i] as f32;
                if counts[i] > 0 {
                    x -= p.presence_penalty;
                }
                x
            })
            .collect()
    }

    #[test]
    fn list_counts_outputs_and_marks_prompt_tokens() {
        let history = [5, 3, 5, 9, 3, 3, 7, 5];
        let (mut scratch, mut list) = (Vec::new(), Vec::new());
        build_penalty_list(&history, 4, true, &[], &mut scratch, &mut list);
        let e = |token, output_count, in_prompt| PenaltyEntry {
            token,
            output_count,
            in_prompt,
            bias: 0.0,
            listed: false,
        };
        assert_eq!(
            list,
            vec![e(3, 2, true), e(5, 1, true), e(7, 1, false), e(9, 0, true)]
        );
        build_penalty_list(&history, 4, false, &[], &mut scratch, &mut list);
        assert_eq!(list, vec![e(3, 2, false), e(5, 1, false), e(7, 1, false)]);
        build_penalty_list(&history, 100, true, &[], &mut scratch, &mut list);
        assert!(list.iter().all(|e| e.output_count == 0 && e.in_prompt));
        // A bias on a history token joins its entry; others get their own, in id order; the
        // last of repeated entries counts. Every entry with a bias is listed.
        let bias = [(8, 1.5), (5, -2.0), (1, 3.0), (8, -4.0)];
        build_penalty_list(&history, 4, false, &bias, &mut scratch, &mut list);
        let b = |mut x: PenaltyEntry, bias| {
            x.bias = bias;
            x.listed = true;
            x
        };
        assert_eq!(
            list,
            vec![
                b(e(1, 0, false), 3.0),
                e(3, 2, false),
                b(e(5, 1, false), -2.0),
                e(7, 1, false),
                b(e(8, 0, false), -4.0),
            ]
        );
    }

    #[test]
    fn applying_the_list_matches_the_dense_formulation() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..200 {
            let vocab = 1 + (next() % 64) as usize;
            let len = (next() % 40) as usize;
            let history: Vec<u32> = (0..len).map(|_| (next() % vocab as u64) as u32).collect();
            let prompt_len = (next() % (len as u64 + 1)) as usize;
            let logits: Vec<f32> = (0..vocab)
                .map(|_| ((next() % 2001) as f32 - 1000.0) / 100.0)
                .collect();
            let pick = |n: u64| [0.0f32, 0.5, -1.25, 2.0][(n % 4) as usize];
            let p = params(
                pick(next()),
                pick(next()),
                [1.0f32, 1.3, 0.7, 2.0][(next() % 4) as usize],
            );
            let bias: Vec<(u32, f32)> = (0..next() % 4)
                .map(|_| ((next() % vocab as u64) as u32, pick(next()) * 10.0))
                .collect();
            let (mut scratch, mut list) = (Vec::new(), Vec::new());
            build_penalty_list(
                &history,
                prompt_len,
                p.has_repetition_penalty(),
                &bias,
                &mut scratch,
                &mut list,
            );
            assert!(list.windows(2).all(|w| w[0].token < w[1].token));
            let mut got = logits.clone();
            apply_penalties(&mut got, &list, &p);
            let want = dense_reference(&logits, &history, prompt_len, &bias, &p);
            assert_eq!(
                got, want,
                "case {case}: {p:?} history {history:?}/{prompt_len}"
            );
        }
    }

    #[test]
    fn the_cache_gives_the_reference_list_across_chunks_decodes_and_slot_reuse() {
        use baton_proto::{HeapSlotTables, SlotRef};
        let mut state = 0x1234_5678_9abc_def1u64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let tables = HeapSlotTables::new_heap(3, 256, 1);
        let mut cache = PenaltyHistories::new();
        let (mut scratch, mut want, mut got) = (Vec::new(), Vec::new(), Vec::new());
        let mut generation = [0u32; 3];
        let mut checked = 0;
        for _request in 0..60 {
            let slot = next(3) as u32;
            generation[slot as usize] += 1;
            let sref = SlotRef {
                slot,
                generation: generation[slot as usize],
            };
            let vocab = 1 + next(40);
            let prompt_len = 1 + next(30) as usize;
            let total = prompt_len + 1 + next(40) as usize;
            let tokens: Vec<u32> = (0..total).map(|_| next(vocab) as u32).collect();
            let with_prompt = next(2) == 0;
            let bias: Vec<(u32, f32)> = (0..next(3)).map(|_| (next(vocab) as u32, 1.5)).collect();
            // Rows: prefill chunks up to the prompt, then decodes; each writes its inputs to
            // the table only once "computed", as the scheduler does.
            let mut pos = 0;
            while pos < total {
                let n = if pos < prompt_len {
                    (1 + next(12) as usize).min(prompt_len - pos)
                } else {
                    1
                };
                let end = pos + n;
                let pending = pos >= prompt_len && next(2) == 0;
                let own_start = pos + usize::from(pending);
                let h = RowHistory {
                    slot: sref,
                    first_pos: pos,
                    prompt_len,
                    with_prompt,
                    own: &tokens[own_start..end],
                    own_start,
                };
                if end >= prompt_len {
                    // A sampling row (the last prefill chunk or a decode).
                    cache.row_list(&h, &tables, &bias, &mut got);
                    let from = if with_prompt {
                        0
                    } else {
                        prompt_len.min(own_start)
                    };
                    let known: Vec<u32> = (from..end)
                        .filter(|&p| p != pos || !pending)
                        .map(|p| tokens[p])
                        .collect();
                    // `known` skips the pending position: recount its prompt length.
                    let p_len = (from..prompt_len).filter(|&p| p != pos || !pending).count();
                    build_penalty_list(&known, p_len, with_prompt, &bias, &mut scratch, &mut want);
                    assert_eq!(
                        got, want,
                        "slot {slot} rows up to {end}, prompt {prompt_len}"
                    );
                    checked += 1;
                }
                for (p, &t) in tokens.iter().enumerate().take(end).skip(pos) {
                    tables.set_token(slot, p, t);
                }
                pos = end;
            }
        }
        assert!(checked > 500, "{checked}");
    }

    #[test]
    fn disabled_penalties_change_nothing() {
        let p = params(0.0, 0.0, 1.0);
        assert!(!p.has_penalties());
        assert!(
            !params(0.0, 0.0, 0.0).has_penalties(),
            "zeroed params are inert"
        );
        assert!(params(0.1, 0.0, 1.0).has_penalties());
        assert!(params(0.0, -0.1, 1.0).has_penalties());
        assert!(params(0.0, 0.0, 1.1).has_penalties());
        let e = PenaltyEntry {
            token: 0,
            output_count: 3,
            in_prompt: true,
            bias: 0.0,
            listed: false,
        };
        for x in [-3.5f32, 0.0, 2.25] {
            assert_eq!(penalize(x, &e, &p).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits() {
        let p = params(0.0, 0.0, 2.0);
        let prompt_only = PenaltyEntry {
            token: 0,
            output_count: 0,
            in_prompt: true,
            bias: 0.0,
            listed: false,
        };
        assert_eq!(penalize(3.0, &prompt_only, &p), 1.5);
        assert_eq!(penalize(-3.0, &prompt_only, &p), -6.0);
        let p = params(0.5, 0.25, 1.0);
        let twice = PenaltyEntry {
            token: 0,
            output_count: 2,
            in_prompt: false,
            bias: 0.0,
            listed: false,
        };
        assert_eq!(penalize(1.0, &twice, &p), 0.0);
        assert_eq!(
            penalize(1.0, &prompt_only, &p),
            1.0,
            "prompt tokens: no presence"
        );
    }
}
