//! CPU reference sampler: penalties, greedy, temperature, top-k, top-p, min-p, and
//! log-probabilities.
//!
//! This is the numerical reference the CUDA sampler (`kernels/sampling.cu`) must agree with. Both
//! use the same counter-based RNG ([`philox4x32_10`]) and the same [`uniform`] construction, keyed
//! by the request's seed and indexed by the output position, so a seeded request draws the same
//! numbers whichever batch, row or device it lands on.
//!
//! # Semantics (vLLM / OpenAI)
//!
//! Let `x` be the row's logits after the penalties of [`crate::penalty`] (when the row has any)
//! and cleaning (NaN becomes `-inf`, `+inf` becomes `f32::MAX`, so
//! that tokens with `+inf` share the mass equally and nothing panics).
//!
//! 1. Greedy when `temperature` is not `> 0` (zero, negative or NaN), when `1 / temperature` is
//!    not finite, or when `top_k == 1`: the argmax, ties to the lowest id. Single pass.
//! 2. Otherwise candidates are ordered by cleaned logit descending, ties by id ascending (a
//!    probability-descending order, made total). Every filter keeps a prefix of that order:
//!    - `top_k > 0` keeps the first `top_k` (`top_k <= 0` or `>= vocab` disables it);
//!    - `top_p < 1` keeps the shortest prefix whose cumulative probability (renormalized over the
//!      top-k set) is `>= top_p`, at least one token; `top_p >= 1` (or NaN) disables it;
//!    - `min_p > 0` drops tokens with `p < min_p * p_max` (the top token is always kept).
//!
//!    Probabilities are `e_i = exp((x_i - x_max) * (1 / temperature))` (so `e_max == 1`) with
//!    `f64` sums. Tokens whose `e_i` underflows to 0 are never drawn.
//! 3. The draw is an inverse CDF over the kept prefix, in that order: with `u = uniform(seed,
//!    output_index)` and `Z` the kept mass, the first token whose running sum exceeds `u * Z`.
//!
//! Log-probabilities are those of the raw distribution (temperature 1, no penalties, no
//! filters): the
//! log-softmax of the cleaned logits, computed only when `want_logprob != 0` or
//! `top_logprobs > 0`; otherwise `logprob == 0.0` and `top` is empty. `top` holds the
//! `min(top_logprobs, MAX_TOP_LOGPROBS, vocab)` most likely tokens, descending, ties by id.
//!
//! CPU/GPU agreement: the uniform draw is bit-identical; the chosen token is identical unless
//! `u * Z` lands within rounding of a cumulative boundary (the device sums in another order and
//! in `f32`), which for a 24-bit `u` is a measure-zero-ish event, not a contract.
//!
//! Degenerate rows: if every logit is NaN or `-inf`, the result is token 0 with log-probability
//! `-inf` (and `top` lists the lowest ids, all at `-inf`). Empty logits give token 0, `-inf`,
//! and an empty `top`.

use crate::penalty::{apply_penalties, PenaltyEntry};
use baton_proto::{SamplingParams, MAX_TOP_LOGPROBS};

/// Philox multiplier for words 0/1 (Random123 `PHILOX_M4x32_0`).
const PHILOX_M0: u32 = 0xD251_1F53;
/// Philox multiplier for words 2/3 (Random123 `PHILOX_M4x32_1`).
const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Key schedule increment, golden ratio (Random123 `PHILOX_W32_0`).
const PHILOX_W0: u32 = 0x9E37_79B9;
/// Key schedule increment, sqrt(3) - 1 (Random123 `PHILOX_W32_1`).
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
/// SC'11; same constants and round structure as curand and Random123).
///
/// A pure function: the same `(counter, key)` always gives the same four words.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    #[inline(always)]
    fn mulhilo(a: u32, b: u32) -> (u32, u32) {
        let p = u64::from(a) * u64::from(b);
        ((p >> 32) as u32, p as u32)
    }
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(PHILOX_W0);
            k[1] = k[1].wrapping_add(PHILOX_W1);
        }
        let (hi0, lo0) = mulhilo(PHILOX_M0, c[0]);
        let (hi1, lo1) = mulhilo(PHILOX_M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Uniform `f32` in `[0, 1)` for `(seed, output_index)`.
///
/// Key = `[seed as u32, (seed >> 32) as u32]`, counter = `[output_index, 0, 0, 0]`; the first
/// output word's top 24 bits times `2^-24` (every value exactly representable, never 1.0). The
/// CUDA sampler implements the same function, so CPU and GPU draw the same number.
#[inline]
pub fn uniform(seed: u64, output_index: u32) -> f32 {
    let w = philox4x32_10([output_index, 0, 0, 0], [seed as u32, (seed >> 32) as u32]);
    (w[0] >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The result of sampling one row.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOut {
    /// Sampled token id, `< vocab` (0 for an empty or all-`-inf` row).
    pub token: u32,
    /// Natural-log probability of `token` under the raw (temperature 1, unfiltered)
    /// distribution; `0.0` when neither `want_logprob` nor `top_logprobs` asked for it.
    pub logprob: f32,
    /// The most likely tokens of the raw distribution, `(token, logprob)`, descending, ties by
    /// id; `min(top_logprobs, MAX_TOP_LOGPROBS, vocab)` entries.
    pub top: Vec<(u32, f32)>,
}

/// Samples tokens from logits; holds scratch buffers reused across calls so the hot path does
/// not allocate once the buffers have grown to the vocabulary size.
#[derive(Debug, Default)]
pub struct Sampler {
    /// Candidates as packed sort keys (see [`sort_key`]).
    keys: Vec<u64>,
    /// The penalized copy of a row's logits (rows with penalties only).
    penalized: Vec<f32>,
}

/// NaN → `-inf`, `+inf` → `f32::MAX`, `-0.0` → `+0.0`, anything else unchanged.
#[inline(always)]
fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        f32::MAX
    } else {
        x + 0.0
    }
}

/// Packs a cleaned logit and a token id into a `u64` whose ascending order is the candidate
/// order: logit descending, then id ascending. (The CUDA sampler sorts the same keys.)
#[inline(always)]
fn sort_key(x: f32, id: u32) -> u64 {
    let b = x.to_bits();
    // Monotone map of f32 onto u32 (ascending), then inverted for descending.
    let ord = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(!ord) << 32) | u64::from(id)
}

/// The logit a [`sort_key`] was built from.
#[inline(always)]
fn key_logit(k: u64) -> f32 {
    let ord = !((k >> 32) as u32);
    f32::from_bits(if ord & 0x8000_0000 != 0 {
        ord & 0x7FFF_FFFF
    } else {
        !ord
    })
}

/// The token id a [`sort_key`] was built from.
#[inline(always)]
fn key_id(k: u64) -> u32 {
    k as u32
}

/// Extends the sorted prefix `keys[..*sorted]` (whose elements all precede the rest) by a
/// doubling chunk, so that index `*sorted` becomes valid. Selection keeps the invariant.
fn extend_sorted(keys: &mut [u64], sorted: &mut usize) {
    let n = keys.len();
    let next = n.min((2 * *sorted).max(64));
    let rest = &mut keys[*sorted..];
    if next < n {
        rest.select_nth_unstable(next - *sorted - 1);
    }
    rest[..next - *sorted].sort_unstable();
    *sorted = next;
}

impl Sampler {
    /// An empty sampler; scratch grows on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples one token from `logits` (length = vocab) per `params`; `output_index` is the RNG
    /// counter (the index of this token among the request's outputs). See the module docs for
    /// the exact semantics; a pure function of `(logits, params, output_index)`.
    ///
    /// Cost: greedy without log-probs is one pass; the filtered path is one pass plus a
    /// selection/sort of only the prefix of the order it walks (lazily, in doubling chunks);
    /// log-probs add one pass plus a selection of `top_logprobs` entries.
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        output_index: u32,
    ) -> SampleOut {
        self.sample_penalized(logits, params, output_index, &[])
    }

    /// As [`Sampler::sample`], with the row's penalty list (logit bias and penalties, see
    /// [`crate::penalty`]): the token is drawn from the adjusted logits, the log-probabilities
    /// stay those of the raw `logits`. An empty `penalties`, or params that adjust nothing, is
    /// exactly [`Sampler::sample`]. With `params.allowed_only` only tokens whose entry is
    /// `listed` can be drawn (the rest count as `-inf`; an all-`-inf` row gives token 0).
    pub fn sample_penalized(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        output_index: u32,
        penalties: &[PenaltyEntry],
    ) -> SampleOut {
        if logits.is_empty() {
            return SampleOut {
                token: 0,
                logprob: f32::NEG_INFINITY,
                top: Vec::new(),
            };
        }
        let inv_t = 1.0 / params.temperature;
        let greedy = params.is_greedy() || params.temperature.is_nan() || !inv_t.is_finite();
        let mut penalized = std::mem::take(&mut self.penalized);
        let sel = if penalties.is_empty() || !params.adjusts_logits() {
            logits
        } else {
            penalized.clear();
            penalized.extend_from_slice(logits);
            apply_penalties(&mut penalized, penalties, params);
            if params.allowed_only != 0 {
                mask_unlisted(&mut penalized, penalties);
            }
            &penalized[..]
        };
        let token = if greedy {
            argmax(sel)
        } else {
            self.sample_filtered(sel, params, inv_t, uniform(params.seed, output_index))
        };
        self.penalized = penalized;

        let n_top = (params.top_logprobs as usize)
            .min(MAX_TOP_LOGPROBS)
            .min(logits.len());
        if params.want_logprob == 0 && n_top == 0 {
            return SampleOut {
                token,
                logprob: 0.0,
                top: Vec::new(),
            };
        }
        let (logprob, top) = self.score(logits, token, n_top);
        SampleOut {
            token,
            logprob,
            top,
        }
    }

    /// The log-probability of `token` under the raw `logits` (log-softmax at temperature 1,
    /// the sum in f64 after cleaning NaN to `-inf` and `+inf` to `f32::MAX`) and the `n_top`
    /// (at most [`MAX_TOP_LOGPROBS`]) most likely entries `(token, logprob)`, most likely
    /// first, ties to the lower id. What a sampled token reports as its log-probabilities,
    /// and what a prompt position reports for the prompt token that follows it. `token` must
    /// be below `logits.len()`; an empty row gives `-inf` and no entries.
    pub fn score(&mut self, logits: &[f32], token: u32, n_top: usize) -> (f32, Vec<(u32, f32)>) {
        let n_top = n_top.min(MAX_TOP_LOGPROBS).min(logits.len());
        let Some(&x) = logits.get(token as usize) else {
            return (f32::NEG_INFINITY, Vec::new());
        };
        let (max, ln_sum) = log_sum_exp_shifted(logits);
        let logprob_of = |x: f32| -> f32 {
            if max == f32::NEG_INFINITY {
                f32::NEG_INFINITY
            } else {
                (f64::from(x) - f64::from(max) - ln_sum) as f32
            }
        };
        let logprob = logprob_of(clean(x));
        let mut top = Vec::with_capacity(n_top);
        if n_top > 0 {
            self.keys.clear();
            self.keys.extend(
                logits
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| sort_key(clean(x), i as u32)),
            );
            if n_top < self.keys.len() {
                self.keys.select_nth_unstable(n_top - 1);
            }
            let head = &mut self.keys[..n_top];
            head.sort_unstable();
            top.extend(head.iter().map(|&k| (key_id(k), logprob_of(key_logit(k)))));
        }
        (logprob, top)
    }

    /// The non-greedy path: filters then inverse-CDF draw with `u` in `[0, 1)`.
    fn sample_filtered(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        inv_t: f32,
        u: f32,
    ) -> u32 {
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(clean(x)));
        if max == f32::NEG_INFINITY {
            return 0;
        }
        // Unnormalized probability; exactly 1 for the top token.
        let weight = |x: f32| ((x - max) * inv_t).exp();
        let vocab = logits.len();
        let top_k = if params.top_k > 0 && (params.top_k as usize) < vocab {
            Some(params.top_k as usize)
        } else {
            None
        };
        // Clamped to 1 so the top token (weight exactly 1) always survives.
        let min_p = if params.min_p > 0.0 {
            params.min_p.min(1.0)
        } else {
            0.0
        };
        let top_p_on = params.top_p < 1.0;

        // Fill candidates (tokens with non-zero weight) and the mass top-p renormalizes over.
        let keys = &mut self.keys;
        keys.clear();
        let mut z = 0.0f64;
        let mut cand_mass = 0.0f64;
        let mut sorted;
        match top_k {
            None => {
                // Without top-k, top-p renormalizes over the whole vocabulary, and min-p can
                // prune candidates up front (it only ever cuts the tail of the order).
                for (i, &x) in logits.iter().enumerate() {
                    let x = clean(x);
                    let e = weight(x);
                    z += f64::from(e);
                    if e > 0.0 && e >= min_p {
                        keys.push(sort_key(x, i as u32));
                        cand_mass += f64::from(e);
                    }
                }
                sorted = 0;
            }
            Some(k) => {
                // No weights needed to select: zero-weight tokens that make it into the top-k
                // set add no mass and, since the walk and the draw sum the same prefix in the
                // same order, can never be drawn.
                keys.extend(
                    logits
                        .iter()
                        .enumerate()
                        .map(|(i, &x)| sort_key(clean(x), i as u32)),
                );
                if k < keys.len() {
                    keys.select_nth_unstable(k - 1);
                    keys.truncate(k);
                }
                keys.sort_unstable();
                z = keys.iter().map(|&k| f64::from(weight(key_logit(k)))).sum();
                sorted = keys.len();
            }
        }
        let n = keys.len();
        debug_assert!(n > 0, "the top token always has weight 1");

        // The kept prefix of the order and its mass.
        let (kept, kept_mass) = if top_k.is_none() && !top_p_on {
            // Every candidate is kept (min-p was applied while filling): no sort needed yet.
            (n, cand_mass)
        } else {
            let p_target = f64::from(params.top_p) * z;
            let mut mass = 0.0f64;
            let mut i = 0;
            while i < n {
                if i == sorted {
                    extend_sorted(keys, &mut sorted);
                }
                let e = weight(key_logit(keys[i]));
                if i > 0 && e < min_p {
                    break;
                }
                mass += f64::from(e);
                i += 1;
                if top_p_on && mass >= p_target {
                    break;
                }
            }
            (i, mass)
        };

        // Inverse CDF over the kept prefix, sorting lazily only as deep as the draw goes.
        let target = f64::from(u) * kept_mass;
        let mut acc = 0.0f64;
        for j in 0..kept {
            if j == sorted {
                extend_sorted(keys, &mut sorted);
            }
            acc += f64::from(weight(key_logit(keys[j])));
            if acc > target {
                return key_id(keys[j]);
            }
        }
        // Only reachable through rounding: the last kept token (sorted by the loop above).
        key_id(keys[kept - 1])
    }
}

/// The rank of `token` under `logits`: 1 + the number of tokens whose cleaned logit is
/// strictly larger (ties share a rank, as vLLM's `Logprob.rank` counts them); 0 for a token
/// outside the row.
pub fn rank_of(logits: &[f32], token: u32) -> u32 {
    let Some(&x) = logits.get(token as usize) else {
        return 0;
    };
    let x = clean(x);
    1 + logits.iter().filter(|&&y| clean(y) > x).count() as u32
}

/// Structured outputs (`SamplingParams::token_mask`): every logit whose bit in `mask` is clear
/// becomes `-inf` (bit `t % 32` of word `t / 32` is token `t`; tokens past the mask count as
/// clear). Applied before everything else, as vLLM applies its grammar bitmask to the logits
/// before the sampler, so the log-probabilities are those of the masked logits.
pub fn apply_token_mask(logits: &mut [f32], mask: &[u32]) {
    for (t, v) in logits.iter_mut().enumerate() {
        if mask.get(t / 32).is_none_or(|w| w >> (t % 32) & 1 == 0) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// `allowed_token_ids`: every logit whose token has no listed entry becomes `-inf` (`list`
/// ascending by token, as the penalty lists are).
fn mask_unlisted(x: &mut [f32], list: &[PenaltyEntry]) {
    let mut allowed = list
        .iter()
        .filter(|e| e.listed)
        .map(|e| e.token as usize)
        .peekable();
    for (i, v) in x.iter_mut().enumerate() {
        if allowed.peek() == Some(&i) {
            allowed.next();
        } else {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Index of the largest cleaned logit, ties to the lowest id (so `+inf` ties with `f32::MAX`,
/// exactly like the candidate order and the device); an all-NaN / `-inf` row gives 0.
#[inline]
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_x = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        let x = clean(x);
        if x > best_x {
            best_x = x;
            best = i;
        }
    }
    best as u32
}

/// `(max, ln(sum(exp(x - max))))` of the cleaned logits, the sum in `f64`, so that
/// `log_softmax(x) = (x - max) - ln_sum` stays exact even when `max` is `f32::MAX` (a cleaned
/// `+inf`). `max` is `-inf` when every logit is NaN / `-inf` (and `ln_sum` is then meaningless).
fn log_sum_exp_shifted(logits: &[f32]) -> (f32, f64) {
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(clean(x)));
    if max == f32::NEG_INFINITY {
        return (max, 0.0);
    }
    let s: f64 = logits
        .iter()
        .map(|&x| f64::from((clean(x) - max).exp()))
        .sum();
    (max, s.ln())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: i32, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            top_logprobs: 0,
            want_logprob: 0,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn allowed_only_draws_from_listed_entries_and_keeps_raw_logprobs() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let entry = |token, listed| PenaltyEntry {
            token,
            listed,
            ..PenaltyEntry::default()
        };
        // 7 is in the history only (not listed): never drawn.
        let list = [
            entry(3, true),
            entry(7, false),
            entry(11, true),
            entry(40, true),
        ];
        let allowed = |p: SamplingParams| SamplingParams {
            logit_bias_len: 3,
            allowed_only: 1,
            want_logprob: 1,
            ..p
        };
        let mut s = Sampler::new();
        let g = s.sample_penalized(&logits, &allowed(SamplingParams::greedy()), 0, &list);
        let best = [3u32, 11, 40]
            .into_iter()
            .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]))
            .unwrap();
        assert_eq!(g.token, best);
        // The log-probability is the raw one, over the whole row.
        let raw = s.sample(
            &logits,
            &SamplingParams {
                want_logprob: 1,
                ..SamplingParams::greedy()
            },
            0,
        );
        let (m, ln) = log_sum_exp_shifted(&logits);
        let want = (f64::from(logits[best as usize]) - f64::from(m) - ln) as f32;
        assert_eq!(g.logprob, want);
        assert!(
            raw.logprob > g.logprob,
            "the unrestricted argmax is more likely"
        );
        for i in 0..200 {
            let t = s
                .sample_penalized(
                    &logits,
                    &allowed(params(1.5, 0, 1.0, 0.0, i)),
                    i as u32,
                    &list,
                )
                .token;
            assert!([3, 11, 40].contains(&t), "drew {t}");
        }
        // Every listed logit -inf: token 0, as for an all -inf row.
        let mut dead = logits.clone();
        for t in [3, 11, 40] {
            dead[t] = f32::NEG_INFINITY;
        }
        for p in [SamplingParams::greedy(), params(1.0, 0, 1.0, 0.0, 1)] {
            assert_eq!(s.sample_penalized(&dead, &allowed(p), 0, &list).token, 0);
        }
    }

    fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = logits
            .iter()
            .map(|&x| ((x as f64 - m) / t as f64).exp())
            .collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    /// A pseudo-random but fixed logit vector (deterministic, no RNG crate).
    fn test_logits(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let w = philox4x32_10([i, salt, 0, 0], [7, 9])[0];
                (w >> 8) as f32 / 16_777_216.0 * 8.0 - 4.0
            })
            .collect()
    }

    #[test]
    fn rank_counts_strictly_larger_logits_with_ties_sharing_a_rank() {
        let l = [0.5, 2.0, f32::NAN, 2.0, -1.0, f32::INFINITY];
        // +inf cleans to f32::MAX (rank 1); NaN to -inf (last).
        assert_eq!(rank_of(&l, 5), 1);
        assert_eq!((rank_of(&l, 1), rank_of(&l, 3)), (2, 2));
        assert_eq!(rank_of(&l, 0), 4);
        assert_eq!(rank_of(&l, 4), 5);
        assert_eq!(rank_of(&l, 2), 6);
        assert_eq!(rank_of(&l, 6), 0, "outside the row");
    }

    #[test]
    fn philox_matches_random123_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_is_in_unit_interval_and_uses_first_word_top_24_bits() {
        for seed in [0u64, 1, u64::MAX, 0x1234_5678_9abc_def0] {
            for idx in [0u32, 1, 17, u32::MAX] {
                let u = uniform(seed, idx);
                assert!((0.0..1.0).contains(&u), "{u}");
                let w = philox4x32_10([idx, 0, 0, 0], [seed as u32, (seed >> 32) as u32])[0];
                assert_eq!(u, (w >> 8) as f32 / 16_777_216.0);
            }
        }
        // Key is split low word first: swapping the halves changes the draw.
        assert_ne!(uniform(1, 0), uniform(1 << 32, 0));
        // Mean over many outputs is about 1/2.
        let mean: f64 = (0..10_000).map(|i| uniform(42, i) as f64).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
    }

    #[test]
    fn sort_key_orders_logit_desc_then_id_and_round_trips() {
        let xs = [
            f32::MAX,
            3.5,
            1.0,
            f32::MIN_POSITIVE,
            0.0,
            -f32::MIN_POSITIVE,
            -1.0,
            -3.5,
            f32::MIN,
            f32::NEG_INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(
                sort_key(w[0], 9) < sort_key(w[1], 0),
                "{} vs {}",
                w[0],
                w[1]
            );
        }
        assert!(sort_key(2.0, 3) < sort_key(2.0, 4));
        assert_eq!(sort_key(clean(-0.0), 1), sort_key(0.0, 1));
        for &x in &xs {
            assert_eq!(key_logit(sort_key(x, 7)).to_bits(), x.to_bits());
            assert_eq!(key_id(sort_key(x, 7)), 7);
        }
    }

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id() {
        let mut s = Sampler::new();
        let logits = test_logits(1000, 1);
        let want = (0..logits.len())
            .max_by(|&a, &b| logits[a].partial_cmp(&logits[b]).unwrap().then(b.cmp(&a)))
            .unwrap() as u32;
        assert_eq!(
            s.sample(&logits, &params(0.0, 0, 1.0, 0.0, 3), 0).token,
            want
        );
        let tied = [1.0, 5.0, 2.0, 5.0, 5.0];
        assert_eq!(s.sample(&tied, &SamplingParams::greedy(), 0).token, 1);
        // Negative temperature is greedy too.
        assert_eq!(s.sample(&tied, &params(-1.0, 0, 1.0, 0.0, 3), 9).token, 1);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_equal_greedy() {
        let mut s = Sampler::new();
        for salt in 0..20 {
            let logits = test_logits(500, salt);
            let g = s.sample(&logits, &SamplingParams::greedy(), 0).token;
            for idx in 0..10 {
                let p = params(1.5, 1, 1.0, 0.0, salt as u64 * 31 + 1);
                assert_eq!(s.sample(&logits, &p, idx).token, g);
                let p = params(1.5, 0, 1e-6, 0.0, salt as u64 * 31 + 1);
                assert_eq!(s.sample(&logits, &p, idx).token, g);
                let p = params(1.5, 50, 0.0, 0.0, salt as u64 * 31 + 1);
                assert_eq!(s.sample(&logits, &p, idx).token, g);
            }
        }
    }

    #[test]
    fn seeded_draw_is_a_pure_function_of_logits_params_and_output_index() {
        let logits = test_logits(4096, 5);
        let p = params(0.9, 0, 0.95, 0.0, 1234);
        let mut reused = Sampler::new();
        // Dirty the scratch with another vocabulary size and filter set first.
        reused.sample(&test_logits(77, 6), &params(1.0, 10, 0.5, 0.1, 8), 3);
        for idx in 0..50 {
            let a = Sampler::new().sample(&logits, &p, idx);
            let b = reused.sample(&logits, &p, idx);
            assert_eq!(a, b);
        }
        // Different output indices and seeds do give different draws.
        let draws: std::collections::HashSet<u32> = (0..50)
            .map(|i| reused.sample(&logits, &p, i).token)
            .collect();
        assert!(draws.len() > 10, "{}", draws.len());
    }

    /// Pearson chi-square of observed counts against expected probabilities, merging tiny bins.
    fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> (f64, usize) {
        let mut chi = 0.0;
        let mut dof = 0usize;
        let (mut oc, mut ep) = (0.0, 0.0);
        for (&c, &p) in counts.iter().zip(probs) {
            oc += c as f64;
            ep += p * n as f64;
            if ep >= 20.0 {
                chi += (oc - ep) * (oc - ep) / ep;
                dof += 1;
                oc = 0.0;
                ep = 0.0;
            }
        }
        if ep > 0.0 {
            chi += (oc - ep) * (oc - ep) / ep.max(1e-9);
            dof += 1;
        }
        (chi, dof.saturating_sub(1))
    }

    #[test]
    fn empirical_frequencies_match_softmax_over_seeds() {
        let logits = [2.0f32, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 3.0];
        let mut s = Sampler::new();
        for t in [0.7f32, 1.0, 1.6] {
            let probs = softmax(&logits, t);
            let n = 40_000u64;
            let mut counts = [0u64; 8];
            for seed in 0..n {
                counts[s.sample(&logits, &params(t, 0, 1.0, 0.0, seed), 0).token as usize] += 1;
            }
            let (chi, dof) = chi_square(&counts, &probs, n);
            // dof = 7: the 99.99th percentile of chi-square(7) is about 29.9.
            assert_eq!(dof, 7);
            assert!(chi < 29.9, "t={t} chi={chi} counts={counts:?}");
        }
    }

    #[test]
    fn empirical_frequencies_follow_top_k_renormalization_over_output_indices() {
        let logits = test_logits(300, 11);
        let mut s = Sampler::new();
        let k = 5;
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
        let kept: Vec<f32> = order[..k].iter().map(|&i| logits[i]).collect();
        let probs = softmax(&kept, 0.5);
        let n = 20_000u32;
        let mut counts = vec![0u64; k];
        for idx in 0..n {
            let tok = s
                .sample(&logits, &params(0.5, k as i32, 1.0, 0.0, 99), idx)
                .token;
            let pos = order[..k].iter().position(|&i| i as u32 == tok);
            counts[pos.expect("sampled outside the top-k set")] += 1;
        }
        let (chi, dof) = chi_square(&counts, &probs, n as u64);
        assert!(dof >= 2);
        assert!(chi < 25.0, "chi={chi} counts={counts:?} probs={probs:?}");
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_mass() {
        // probs at t=1 = [0.5, 0.25, 0.125, 0.125] (logits = ln p).
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
        let mut s = Sampler::new();
        let seen = |s: &mut Sampler, top_p: f32| {
            let mut seen = [false; 4];
            for seed in 0..2000 {
                seen[s
                    .sample(&logits, &params(1.0, 0, top_p, 0.0, seed), 0)
                    .token as usize] = true;
            }
            seen
        };
        assert_eq!(seen(&mut s, 0.5), [true, false, false, false]);
        assert_eq!(seen(&mut s, 0.6), [true, true, false, false]);
        // 0.875 reached by {0, 1, 2}; the 0.125 tie keeps id 2, not 3.
        assert_eq!(seen(&mut s, 0.8), [true, true, true, false]);
        assert_eq!(seen(&mut s, 1.0), [true, true, true, true]);
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_top_probability() {
        // probs relative to the max: 1, 0.5, 0.2, 0.05.
        let logits = [0.0f32, 0.5f32.ln(), 0.2f32.ln(), 0.05f32.ln()];
        let mut s = Sampler::new();
        let mut seen = [false; 4];
        for seed in 0..4000 {
            seen[s.sample(&logits, &params(1.0, 0, 1.0, 0.1, seed), 0).token as usize] = true;
        }
        assert_eq!(seen, [true, true, true, false]);
        // Also with top-k active (the other code path).
        let mut seen = [false; 4];
        for seed in 0..4000 {
            seen[s.sample(&logits, &params(1.0, 3, 1.0, 0.3, seed), 0).token as usize] = true;
        }
        assert_eq!(seen, [true, true, false, false]);
        // min_p above 1 still keeps the top token.
        assert_eq!(s.sample(&logits, &params(1.0, 0, 1.0, 5.0, 1), 0).token, 0);
    }

    #[test]
    fn logprobs_are_raw_log_softmax_and_sum_to_one() {
        let logits = test_logits(64, 3);
        let mut p = params(0.3, 4, 0.9, 0.0, 5);
        p.want_logprob = 1;
        p.top_logprobs = 64; // capped at MAX_TOP_LOGPROBS
        let out = Sampler::new().sample(&logits, &p, 0);
        let raw = softmax(&logits, 1.0);
        assert!((out.logprob as f64 - raw[out.token as usize].ln()).abs() < 1e-5);
        assert_eq!(out.top.len(), MAX_TOP_LOGPROBS);
        for w in out.top.windows(2) {
            assert!(w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0));
        }
        for &(id, lp) in &out.top {
            assert!((lp as f64 - raw[id as usize].ln()).abs() < 1e-5);
        }
        // All log-probs (top_logprobs = vocab when vocab is small) sum to 1 in prob space.
        let small = [1.0f32, -2.0, 0.5, 3.0, 0.0];
        p.top_logprobs = 5;
        let out = Sampler::new().sample(&small, &p, 0);
        let total: f64 = out.top.iter().map(|&(_, lp)| (lp as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert_eq!(out.top[0].0, 3);
    }

    #[test]
    fn logprobs_are_zero_and_empty_unless_asked() {
        let logits = test_logits(100, 8);
        let out = Sampler::new().sample(&logits, &params(1.0, 0, 1.0, 0.0, 1), 0);
        assert_eq!(out.logprob, 0.0);
        assert!(out.top.is_empty());
        let mut p = SamplingParams::greedy();
        p.top_logprobs = 2;
        let out = Sampler::new().sample(&logits, &p, 0);
        assert!(out.logprob < 0.0);
        assert_eq!(out.top.len(), 2);
        assert_eq!(out.top[0].0, out.token);
    }

    #[test]
    fn edge_values_disable_filters() {
        let logits = test_logits(200, 21);
        let mut s = Sampler::new();
        for idx in 0..30 {
            let base = s.sample(&logits, &params(1.0, 0, 1.0, 0.0, 77), idx);
            // top_k = -1, top_k >= vocab, top_p > 1 are all "no filter".
            assert_eq!(s.sample(&logits, &params(1.0, -1, 1.0, 0.0, 77), idx), base);
            assert_eq!(
                s.sample(&logits, &params(1.0, 200, 1.0, 0.0, 77), idx),
                base
            );
            assert_eq!(
                s.sample(&logits, &params(1.0, 1000, 1.0, 0.0, 77), idx),
                base
            );
            assert_eq!(s.sample(&logits, &params(1.0, 0, 1.5, 0.0, 77), idx), base);
            assert_eq!(s.sample(&logits, &params(1.0, 0, 1.0, -0.5, 77), idx), base);
        }
        // Temperature 0 ignores the seed and other filters.
        let g = s.sample(&logits, &SamplingParams::greedy(), 0).token;
        for seed in 0..10 {
            assert_eq!(
                s.sample(&logits, &params(0.0, 7, 0.3, 0.2, seed), 3).token,
                g
            );
        }
        // A temperature so small that 1/t overflows is greedy, not NaN.
        assert_eq!(
            s.sample(&logits, &params(1e-45, 0, 1.0, 0.0, 1), 0).token,
            g
        );
        assert_eq!(
            s.sample(&logits, &params(f32::NAN, 0, 1.0, 0.0, 1), 0)
                .token,
            g
        );
    }

    #[test]
    fn non_finite_logits_do_not_panic() {
        let mut s = Sampler::new();
        let mut p = params(1.0, 0, 0.9, 0.05, 4);
        p.want_logprob = 1;
        p.top_logprobs = 3;
        // NaN is -inf: never chosen while a finite token exists.
        let logits = [f32::NAN, 0.0, f32::NAN, -1.0];
        for idx in 0..200 {
            let out = s.sample(&logits, &p, idx);
            assert!(out.token == 1 || out.token == 3);
            assert!(out.logprob.is_finite());
        }
        // +inf tokens share the mass; everything else has probability 0.
        let logits = [1.0, f32::INFINITY, 2.0, f32::INFINITY];
        let mut seen = [0u32; 4];
        for idx in 0..400 {
            let out = s.sample(&logits, &params(1.0, 0, 1.0, 0.0, 4), idx);
            seen[out.token as usize] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0));
        assert!(seen[1] > 100 && seen[3] > 100, "{seen:?}");
        let out = s.sample(&logits, &p, 0);
        assert!((out.logprob - 0.5f32.ln()).abs() < 1e-6, "{}", out.logprob);
        // All -inf / NaN: token 0, logprob -inf, on both paths.
        let dead = [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        for q in [p, SamplingParams::greedy()] {
            let mut q = q;
            q.want_logprob = 1;
            let out = s.sample(&dead, &q, 0);
            assert_eq!(out.token, 0);
            assert_eq!(out.logprob, f32::NEG_INFINITY);
        }
        // Empty logits.
        let out = s.sample(&[], &p, 0);
        assert_eq!((out.token, out.logprob), (0, f32::NEG_INFINITY));
    }

    #[test]
    fn large_vocab_without_top_k_matches_full_sort_reference() {
        // Exercises the lazy doubling sort: the kept prefix spans several chunks.
        let logits = test_logits(5000, 12);
        let mut s = Sampler::new();
        for (top_p, min_p) in [(0.9f32, 0.0f32), (1.0, 0.0), (0.99, 0.01), (0.3, 0.0)] {
            let p = params(2.0, 0, top_p, min_p, 55);
            // Reference: full sort, explicit prefix, same f64 sums in the same order.
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let w = |x: f32| ((x - m) * (1.0 / 2.0f32)).exp();
            let z: f64 = logits.iter().map(|&x| w(x) as f64).sum();
            let mut order: Vec<(f32, u32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &x)| (x, i as u32))
                .collect();
            order.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
            let mut kept = Vec::new();
            let mut mass = 0.0f64;
            for &(x, id) in &order {
                let e = w(x);
                if !kept.is_empty() && e < min_p {
                    break;
                }
                kept.push((id, e));
                mass += e as f64;
                if top_p < 1.0 && mass >= top_p as f64 * z {
                    break;
                }
            }
            for idx in 0..40 {
                let target = uniform(55, idx) as f64 * mass;
                let mut acc = 0.0;
                let want = kept
                    .iter()
                    .find(|&&(_, e)| {
                        acc += e as f64;
                        acc > target
                    })
                    .unwrap()
                    .0;
                assert_eq!(s.sample(&logits, &p, idx).token, want, "top_p={top_p}");
            }
        }
    }
}
