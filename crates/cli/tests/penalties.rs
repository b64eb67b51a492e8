//! Logit bias, presence, frequency and repetition penalties, `min_tokens` and vLLM's
//! `bad_words` through the whole engine.
//!
//! The oracle decodes one request alone with the model's forward pass over its own KV cache,
//! applying the penalties densely from its own token counts (the formulation of vLLM's
//! `apply_penalties`) and taking the argmax. The engine must give the same greedy tokens
//! whatever the batch, block size, preemption or asynchronous scheduling (where a row's last
//! input is still pending on the worker), so the history the worker penalizes is right.

mod common;
use baton_model::{load_model_dir, CpuModel, ForwardRow, PagedKvCache};
use baton_proto::SamplingParams;
use common::*;
use std::collections::HashMap;

fn penalized(presence: f32, frequency: f32, repetition: f32) -> SamplingParams {
    SamplingParams {
        presence_penalty: presence,
        frequency_penalty: frequency,
        repetition_penalty: repetition,
        ..SamplingParams::greedy()
    }
}

/// Greedy decoding of `prompt` with a dense logit bias and dense penalties; stops after
/// `max_tokens` or at EOS (2).
fn oracle(
    model: &CpuModel,
    prompt: &[u32],
    max_tokens: usize,
    p: &SamplingParams,
    bias: &[(u32, f32)],
) -> Vec<u32> {
    let block_size = 16;
    let len = prompt.len() + max_tokens;
    let pages: Vec<u32> = (0..len.div_ceil(block_size) as u32).collect();
    let mut kv = PagedKvCache::try_new(model.config(), pages.len(), block_size).unwrap();
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    let mut pos = 0;
    while out.len() < max_tokens {
        let row = ForwardRow {
            tokens: &input,
            start_pos: pos,
            block_table: &pages,
            want_logits: true,
            all_logits: false,
            lora: 0,
        };
        let mut logits = model.forward(&mut kv, &[row]).unwrap().remove(0);
        pos += input.len();
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in &out {
            *counts.entry(t).or_default() += 1;
        }
        for &(t, b) in bias {
            logits[t as usize] += b;
        }
        for (i, x) in logits.iter_mut().enumerate() {
            let t = i as u32;
            let c = counts.get(&t).copied().unwrap_or(0);
            if p.repetition_penalty != 1.0 && (c > 0 || prompt.contains(&t)) {
                *x = if *x > 0.0 {
                    *x / p.repetition_penalty
                } else {
                    *x * p.repetition_penalty
                };
            }
            if c > 0 {
                *x -= p.frequency_penalty * c as f32;
                *x -= p.presence_penalty;
            }
        }
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        out.push(best as u32);
        if best == 2 {
            break;
        }
        input = vec![best as u32];
    }
    out
}

/// The settings under test, each strong enough to change the golden continuation: penalties
/// and a logit bias (empty: none; a bias on `GOLDEN_FIRST` marks the golden's first greedy
/// tokens, filled in per prompt).
fn settings() -> Vec<(SamplingParams, Vec<(u32, f32)>)> {
    let plain = |p| (p, Vec::new());
    let mut v: Vec<_> = [
        penalized(0.0, 0.0, 1.3),
        penalized(0.0, 0.0, 0.8),
        penalized(0.0, 0.7, 1.0),
        penalized(1.5, 0.0, 1.0),
        penalized(0.4, 0.3, 1.2),
        penalized(-0.5, -0.5, 1.0),
        // Rewarding repetition makes the latest output (a pending input under asynchronous
        // scheduling) decide the next token.
        penalized(-2.0, -1.0, 1.0),
        penalized(0.0, 0.0, 0.5),
    ]
    .into_iter()
    .map(plain)
    .collect();
    // Ban the golden's first three tokens, and reward two others; with and without penalties.
    v.push((SamplingParams::greedy(), vec![(GOLDEN_FIRST, -100.0)]));
    v.push((
        penalized(0.3, 0.2, 1.1),
        vec![(GOLDEN_FIRST, -100.0), (300, 4.0), (17, 2.5)],
    ));
    v.push((SamplingParams::greedy(), vec![(300, 100.0)]));
    v
}

/// Placeholder token in [`settings`]: stands for each of the golden's first three greedy tokens.
const GOLDEN_FIRST: u32 = u32::MAX;

/// `bias` with [`GOLDEN_FIRST`] expanded to the first three tokens of `greedy`.
fn expand(bias: &[(u32, f32)], greedy: &[u32]) -> Vec<(u32, f32)> {
    bias.iter()
        .flat_map(|&(t, b)| {
            if t == GOLDEN_FIRST {
                greedy[..3].iter().map(|&g| (g, b)).collect()
            } else {
                vec![(t, b)]
            }
        })
        .collect()
}

fn check(block_size: usize, num_blocks: usize, max_inflight: usize, fillers: usize) {
    let g = goldens();
    let (model, _) = load_model_dir(model_dir()).unwrap().into_cpu_model();
    let (mut engine, _) = engine(config(block_size, num_blocks, max_inflight));
    let mut reqs = Vec::new();
    let mut want = HashMap::new();
    for (k, (mut p, bias)) in settings().into_iter().enumerate() {
        for (j, gold) in g.iter().enumerate().take(3) {
            let id = (k * 10 + j) as u64;
            let bias = expand(&bias, &gold.greedy_ids);
            p.logit_bias_len = bias.len() as u32;
            let expect = oracle(&model, &gold.prompt_ids, 60, &p, &bias);
            if j == 0 {
                assert_ne!(
                    expect[..],
                    gold.greedy_ids[..expect.len().min(gold.greedy_ids.len())],
                    "{p:?} does not change the golden continuation: a weak test"
                );
            }
            want.insert(id, expect);
            let mut r = request(id, gold.prompt_ids.clone(), 60, p);
            r.logit_bias = bias;
            reqs.push(r);
        }
    }
    for (i, f) in filler_prompts(fillers).into_iter().enumerate() {
        let p = if i % 2 == 0 {
            SamplingParams::greedy()
        } else {
            penalized(0.2, 0.1, 1.1)
        };
        reqs.insert(i * 2 % (reqs.len() + 1), request(1000 + i as u64, f, 30, p));
    }
    let got = run(&mut engine, reqs);
    for (id, expect) in &want {
        assert_eq!(
            &got[id].0, expect,
            "request {id} (block {block_size}, {num_blocks} pages, inflight {max_inflight})"
        );
    }
    assert_pool_full(&engine);
}

#[test]
fn penalized_greedy_matches_the_dense_oracle_alone_and_batched() {
    check(16, 512, 1, 0);
    check(4, 512, 1, 10);
}

#[test]
fn penalized_greedy_matches_with_asynchronous_scheduling() {
    check(16, 512, 2, 10);
}

#[test]
fn penalized_greedy_matches_when_a_small_pool_forces_preemption() {
    check(16, 20, 2, 10);
}

/// Greedy decoding with stop ids masked before `min_tokens` outputs (vLLM's min-tokens
/// processor) and ending the request after; `None` when it ran `max_tokens` without stopping.
fn oracle_min_tokens(
    model: &CpuModel,
    prompt: &[u32],
    max_tokens: usize,
    stops: &[u32],
    min_tokens: usize,
) -> Vec<u32> {
    let bias: Vec<(u32, f32)> = stops.iter().map(|&t| (t, f32::NEG_INFINITY)).collect();
    let mut out = Vec::new();
    // Decode one token at a time so the mask can depend on the output count.
    while out.len() < max_tokens {
        let masked = if out.len() < min_tokens {
            &bias[..]
        } else {
            &[]
        };
        let history = [prompt, &out[..]].concat();
        let next = oracle(model, &history, 1, &SamplingParams::greedy(), masked)[0];
        out.push(next);
        if out.len() > min_tokens && stops.contains(&next) {
            break;
        }
    }
    out
}

#[test]
fn min_tokens_masks_stop_ids_until_reached_then_they_stop_again() {
    let g = goldens();
    let (model, _) = load_model_dir(model_dir()).unwrap().into_cpu_model();
    for max_inflight in [1, 2] {
        let (mut engine, _) = engine(config(16, 512, max_inflight));
        let mut reqs = Vec::new();
        let mut want = HashMap::new();
        for (j, gold) in g.iter().enumerate().take(3) {
            // Stop on the golden's 5th token (and EOS 2, the model's).
            let stop = gold.greedy_ids[4];
            for (k, min_tokens) in [0usize, 3, 5, 12].into_iter().enumerate() {
                let id = (j * 10 + k) as u64;
                let expect =
                    oracle_min_tokens(&model, &gold.prompt_ids, 40, &[stop, 2], min_tokens);
                if min_tokens == 0 {
                    assert_eq!(
                        expect.len(),
                        5,
                        "the stop id ends the golden at its 5th token"
                    );
                } else if min_tokens >= 5 {
                    assert!(expect.len() > 5, "a masked stop id still ended the request");
                }
                want.insert(id, expect);
                let mut r = request(id, gold.prompt_ids.clone(), 40, SamplingParams::greedy());
                r.stop_token_ids = vec![stop];
                r.min_tokens = min_tokens as u32;
                reqs.push(r);
            }
        }
        let got = run(&mut engine, reqs);
        for (id, expect) in &want {
            assert_eq!(&got[id].0, expect, "request {id} (inflight {max_inflight})");
        }
        assert_pool_full(&engine);
    }
}

/// vLLM's `min_tokens` holds the EOS ids back even under `ignore_eos` (its
/// `_all_stop_token_ids`): with EOS biased to win every step, the first `min_tokens` outputs
/// are something else, and the rest are EOS, which ends nothing.
#[test]
fn min_tokens_holds_eos_back_under_ignore_eos() {
    let g = goldens();
    for max_inflight in [1, 2] {
        let (mut engine, _) = engine(config(16, 512, max_inflight));
        let mut reqs = Vec::new();
        for (id, min_tokens) in [(0u64, 0u32), (1, 3)] {
            let mut r = request(id, g[0].prompt_ids.clone(), 6, SamplingParams::greedy());
            r.ignore_eos = true;
            r.logit_bias = vec![(2, 100.0)];
            r.params.logit_bias_len = 1;
            r.min_tokens = min_tokens;
            reqs.push(r);
        }
        let got = run(&mut engine, reqs);
        assert_eq!(
            got[&0].0, [2; 6],
            "the bias makes EOS win, and it ends nothing"
        );
        let (held, reason) = &got[&1];
        assert_eq!(held.len(), 6, "{held:?} {reason:?}");
        assert!(
            !held[..3].contains(&2),
            "min_tokens let EOS through: {held:?}"
        );
        assert_eq!(held[3..], [2; 3], "{held:?}");
        assert_pool_full(&engine);
    }
}

/// Greedy decoding with vLLM's `bad_words`: before each token, the last token of every word
/// whose other tokens end the outputs so far is masked; stops after `max_tokens` or at EOS
/// (2).
fn oracle_bad_words(
    model: &CpuModel,
    prompt: &[u32],
    max_tokens: usize,
    words: &[Vec<u32>],
) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    while out.len() < max_tokens {
        let banned: Vec<(u32, f32)> = words
            .iter()
            .filter(|w| out.ends_with(&w[..w.len() - 1]))
            .map(|w| (w[w.len() - 1], f32::NEG_INFINITY))
            .collect();
        let history = [prompt, &out[..]].concat();
        let next = oracle(model, &history, 1, &SamplingParams::greedy(), &banned)[0];
        out.push(next);
        if next == 2 {
            break;
        }
    }
    out
}

/// True when the token sequence `word` occurs in `out`.
fn contains(out: &[u32], word: &[u32]) -> bool {
    out.windows(word.len()).any(|w| w == word)
}

#[test]
fn bad_words_are_never_generated_and_the_rest_follows_the_oracle() {
    let g = goldens();
    let (model, _) = load_model_dir(model_dir()).unwrap().into_cpu_model();
    // Words taken from each golden continuation `t`, so each changes it: one token, two and
    // three tokens (their last token is banned only right after the others), and a mix.
    let sets = |t: &[u32]| -> Vec<Vec<Vec<u32>>> {
        vec![
            vec![vec![t[2]]],
            vec![vec![t[4], t[5]]],
            vec![vec![t[6], t[7], t[8]], vec![t[1]]],
            vec![vec![t[3], t[4]], vec![t[9], t[10]], vec![t[0]]],
        ]
    };
    // Alone; batched with fillers under asynchronous scheduling (a multi-token word's mask
    // needs the output still being sampled); a small pool that forces preemption.
    for (num_blocks, max_inflight, fillers) in [(512, 1, 0), (512, 2, 10), (20, 2, 10)] {
        let (mut engine, _) = engine(config(16, num_blocks, max_inflight));
        let mut reqs = Vec::new();
        let mut want = HashMap::new();
        for (j, gold) in g.iter().enumerate().take(3) {
            for (k, words) in sets(&gold.greedy_ids).into_iter().enumerate() {
                let id = (j * 10 + k) as u64;
                let expect = oracle_bad_words(&model, &gold.prompt_ids, 40, &words);
                assert_ne!(
                    expect[..],
                    gold.greedy_ids[..expect.len()],
                    "{words:?} does not change the golden continuation: a weak test"
                );
                let mut r = request(id, gold.prompt_ids.clone(), 40, SamplingParams::greedy());
                r.bad_words = words.clone();
                reqs.push(r);
                want.insert(id, (expect, words));
            }
        }
        for (i, f) in filler_prompts(fillers).into_iter().enumerate() {
            let r = request(1000 + i as u64, f, 30, SamplingParams::greedy());
            reqs.insert(i * 2 % (reqs.len() + 1), r);
        }
        let got = run(&mut engine, reqs);
        for (id, (expect, words)) in &want {
            let out = &got[id].0;
            let at = format!("request {id} ({num_blocks} pages, inflight {max_inflight})");
            for w in words {
                assert!(
                    !contains(out, w),
                    "{at}: generated the bad word {w:?}: {out:?}"
                );
            }
            assert_eq!(out, expect, "{at}");
        }
        assert_pool_full(&engine);
    }
}

#[test]
fn seeded_penalized_request_gives_the_same_tokens_alone_and_batched() {
    let g = goldens();
    let p = SamplingParams {
        presence_penalty: 0.6,
        frequency_penalty: 0.4,
        repetition_penalty: 1.2,
        ..seeded(77)
    };
    let (mut alone, _) = engine(config(16, 512, 2));
    let a = run(&mut alone, vec![request(1, g[1].prompt_ids.clone(), 48, p)]);
    let (mut batch, _) = engine(config(16, 512, 2));
    let mut reqs: Vec<_> = filler_prompts(8)
        .into_iter()
        .enumerate()
        .map(|(i, f)| request(100 + i as u64, f, 40, seeded(i as u64)))
        .collect();
    reqs.insert(3, request(1, g[1].prompt_ids.clone(), 48, p));
    let b = run(&mut batch, reqs);
    assert_eq!(
        a[&1].0, b[&1].0,
        "a seeded penalized row depends on its batch"
    );
    let (mut plain, _) = engine(config(16, 512, 2));
    let c = run(
        &mut plain,
        vec![request(1, g[1].prompt_ids.clone(), 48, seeded(77))],
    );
    assert_ne!(a[&1].0, c[&1].0, "the penalties changed nothing");
}
