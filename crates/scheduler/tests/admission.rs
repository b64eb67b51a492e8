//! `check_admission` on the sampling extras: a logit bias must match its params, and an
//! `allowed_token_ids` list must leave something to sample while `min_tokens` holds the stop ids
//! back.

use baton_proto::SamplingParams;
use baton_scheduler::{check_admission, AdmitError, NewRequest, SchedulerConfig};

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        block_size: 16,
        num_blocks: 64,
        max_model_len: 256,
        max_inflight: 2,
        enable_prefix_caching: true,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    }
}

/// A request allowed only `allowed`, with `min_tokens` and stop ids `stops` (EOS 2).
fn allowed(allowed: &[u32], min_tokens: u32, stops: &[u32]) -> NewRequest {
    NewRequest {
        priority: 0,
        id: 1,
        prompt: vec![1, 5, 6],
        max_tokens: 8,
        params: SamplingParams {
            logit_bias_len: allowed.len() as u32,
            allowed_only: 1,
            ..SamplingParams::greedy()
        },
        eos_ids: vec![2],
        stop_token_ids: stops.to_vec(),
        ignore_eos: false,
        logit_bias: allowed.iter().map(|&t| (t, 0.0)).collect(),
        min_tokens,
        cache_salt: 0,
        guide: None,
        bad_words: Vec::new(),
        lora: 0,
    }
}

#[test]
fn an_allow_list_that_min_tokens_empties_is_refused() {
    let c = cfg();
    let ok = |r: &NewRequest| check_admission(&c, 512, r);
    // Every allowed token is EOS or a stop id while min_tokens holds them back.
    for r in [allowed(&[2], 3, &[]), allowed(&[2, 9], 3, &[9])] {
        assert!(
            matches!(ok(&r), Err(AdmitError::BadLogitBias(_))),
            "{:?}",
            r.logit_bias
        );
    }
    // min_tokens holds EOS back even when it ends nothing (vLLM's `_all_stop_token_ids`).
    let mut r = allowed(&[2], 3, &[]);
    r.ignore_eos = true;
    assert!(matches!(ok(&r), Err(AdmitError::BadLogitBias(_))));
    // Something is left, or min_tokens is off: admitted.
    assert_eq!(ok(&allowed(&[2, 9], 3, &[])), Ok(()));
    assert_eq!(ok(&allowed(&[2], 0, &[])), Ok(()));
    // An allow-list must list something.
    let empty = allowed(&[], 0, &[]);
    assert!(matches!(ok(&empty), Err(AdmitError::BadLogitBias(_))));
}

#[test]
fn an_allow_list_that_bad_words_empty_is_refused_and_bad_words_are_checked() {
    let c = cfg();
    let ok = |r: &NewRequest| check_admission(&c, 512, r);
    let with = |allow: &[u32], words: Vec<Vec<u32>>| {
        let mut r = allowed(allow, 0, &[]);
        r.bad_words = words;
        r
    };
    // Every allowed token is a one-token bad word.
    let r = with(&[7, 9], vec![vec![7], vec![9], vec![3, 4]]);
    assert!(matches!(ok(&r), Err(AdmitError::BadWords(_))), "{r:?}");
    // Something is left (9 is banned only after 3).
    assert_eq!(ok(&with(&[7, 9], vec![vec![7], vec![3, 9]])), Ok(()));
    // An empty word, a token outside the vocabulary, too many words.
    for words in [
        vec![vec![]],
        vec![vec![3, 512]],
        vec![vec![3; baton_proto::wire::MAX_BAD_WORDS_WORDS]],
    ] {
        let r = with(&[7], words);
        assert!(matches!(ok(&r), Err(AdmitError::BadWords(_))), "{r:?}");
    }
}
