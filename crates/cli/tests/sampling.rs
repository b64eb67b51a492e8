//! Seeded sampling is a function of the request alone: the same tokens alone and inside a
//! batch of seeded and unseeded requests, whatever its row or arrival order.

mod common;
use baton_proto::SamplingParams;
use common::*;

#[test]
fn seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch() {
    let g = goldens();
    let prompt = g[0].prompt_ids.clone();
    let (mut alone, _) = engine(config(16, 512, 2));
    let a = run(
        &mut alone,
        vec![request(7, prompt.clone(), 48, seeded(1234))],
    );
    assert_pool_full(&alone);

    let (mut batch, _) = engine(config(16, 512, 2));
    let mut reqs = Vec::new();
    for (i, p) in filler_prompts(12).into_iter().enumerate() {
        let params = if i % 2 == 0 {
            seeded(99 + i as u64)
        } else {
            SamplingParams {
                temperature: 1.0,
                seed: 555 + i as u64,
                ..SamplingParams::greedy()
            }
        };
        reqs.push(request(100 + i as u64, p, 40, params));
    }
    reqs.insert(5, request(7, prompt, 48, seeded(1234)));
    let b = run(&mut batch, reqs);
    assert_eq!(
        a[&7].0, b[&7].0,
        "a seeded request depends on its batchmates"
    );
    assert_pool_full(&batch);

    // A different seed gives a different stream (so the test can fail).
    let (mut other, _) = engine(config(16, 512, 1));
    let c = run(
        &mut other,
        vec![request(7, g[0].prompt_ids.clone(), 48, seeded(4321))],
    );
    assert_ne!(a[&7].0, c[&7].0, "different seeds gave identical samples");
}

/// Prompt log-probabilities (`echo` with `logprobs`) against the sampler's own. For every
/// prefix of every golden prompt, the next prompt token is forced through
/// `allowed_token_ids` (its log-probability stays the raw one), and a greedy request gives
/// the first token after the prompt. Then the prompt extended by that token is scored: each
/// position must give the same log-probability as the forced sample of its prefix, the last
/// one the greedy token as its top entry, and every position must come once, in order, with
/// the prompt's own tokens. Prompts are chunked (8 tokens per launch), so rows that end
/// inside the prompt score the token after them from the table.
#[test]
fn prompt_logprobs_agree_with_the_sampled_log_probability_of_the_same_context() {
    let cfg = baton_scheduler::SchedulerConfig {
        max_num_batched_tokens: 8,
        ..config(16, 256, 2)
    };
    let g = goldens();
    let asked = SamplingParams {
        want_logprob: 1,
        ..SamplingParams::greedy()
    };
    // Request `1000 * i + k`: prompt `i`'s first `k` tokens, forced to token `k` (k < n),
    // or greedy after the whole prompt (k == n).
    let (mut e, _) = engine(cfg.clone());
    for (i, x) in g.iter().enumerate() {
        let n = x.prompt_ids.len();
        for k in 1..=n {
            let id = 1000 * i as u64 + k as u64;
            let mut r = request(id, x.prompt_ids[..k].to_vec(), 1, asked);
            if k < n {
                r.params.logit_bias_len = 1;
                r.params.allowed_only = 1;
                r.logit_bias = vec![(x.prompt_ids[k], 0.0)];
            }
            e.add_request(r).unwrap();
        }
    }
    let mut ev = Vec::new();
    e.run_until_idle(&mut ev).unwrap();
    assert!(prompt_logprobs(&ev).is_empty(), "nobody asked for them");
    let sampled: std::collections::HashMap<u64, (u32, f32)> = ev
        .iter()
        .filter_map(|x| match x {
            baton_scheduler::Event::Token {
                id, token, logprob, ..
            } => Some((*id, (*token, *logprob))),
            _ => None,
        })
        .collect();

    let (mut e, _) = engine(cfg);
    let mut firsts = Vec::new();
    for (i, x) in g.iter().enumerate() {
        let first = sampled[&(1000 * i as u64 + x.prompt_ids.len() as u64)].0;
        firsts.push(first);
        let mut prompt = x.prompt_ids.clone();
        prompt.push(first);
        let params = SamplingParams {
            prompt_logprobs: 1 + 2,
            ..SamplingParams::greedy()
        };
        e.add_request(request(i as u64, prompt, 1, params)).unwrap();
    }
    let mut ev = Vec::new();
    e.run_until_idle(&mut ev).unwrap();
    let got = prompt_logprobs(&ev);
    for (i, x) in g.iter().enumerate() {
        let entries = &got[&(i as u64)];
        let n = x.prompt_ids.len();
        let positions: Vec<u32> = entries.iter().map(|p| p.0).collect();
        assert_eq!(positions, (1..=n as u32).collect::<Vec<_>>(), "request {i}");
        for (pos, token, lp, top, rank) in entries {
            let k = *pos as usize;
            let want = x.prompt_ids.get(k).copied().unwrap_or(firsts[i]);
            assert_eq!(*token, want, "request {i} position {pos}");
            let (forced, forced_lp) = sampled[&(1000 * i as u64 + k as u64)];
            assert_eq!(
                forced, want,
                "request {i} position {pos}: the forced sample"
            );
            assert!(
                (lp - forced_lp).abs() < 1e-5,
                "request {i} position {pos}: prompt logprob {lp} vs sampled {forced_lp}"
            );
            assert_eq!(top.len(), 2, "request {i} position {pos}");
            assert!(top[0].1 >= top[1].1 && *lp <= top[0].1 + 1e-6);
            // The rank agrees with the top entries: the j-th of them has rank j + 1, a token
            // outside them ranks below.
            match top.iter().position(|t| t.0 == *token) {
                Some(j) => assert_eq!(*rank, j as u32 + 1, "request {i} position {pos}"),
                None => assert!(*rank > 2, "request {i} position {pos}: rank {rank}"),
            }
        }
        let last = entries.last().unwrap();
        assert_eq!(last.3[0].0, firsts[i], "request {i}: greedy is the argmax");
    }
}
