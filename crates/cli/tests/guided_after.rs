//! Structured output after the reasoning (`Guide::start_after`, what the frontend asks for
//! with `--reasoning-parser` and a constraint): the row samples freely up to and including the
//! token that ends the reasoning, and the constraint holds from the next token on.

mod common;
use baton_grammar::{Constraint, Vocabulary};
use baton_proto::SamplingParams;
use baton_scheduler::FinishReason;
use common::*;

#[test]
fn a_guide_started_after_a_token_leaves_the_output_free_until_it_then_constrains() {
    let g = goldens();
    let prompt = g[0].prompt_ids.clone();
    let (mut plain, tok) = engine(config(16, 256, 2));
    let free = run(
        &mut plain,
        vec![request(1, prompt.clone(), 40, SamplingParams::greedy())],
    );
    let free = &free[&1].0;
    // The "end of reasoning": the 6th free token, not seen before it.
    let end = free[5];
    assert!(!free[..5].contains(&end), "{free:?}");
    let vocab = Vocabulary::from_tokenizer_json(
        &model_dir().join("tokenizer.json"),
        tok.vocab_size(),
        &[2],
    )
    .unwrap();
    let choice = Constraint::Choice(vec![" The end.".into(), " Lily smiled.".into()]);
    for inflight in [1, 2] {
        let (mut e, _) = engine(config(16, 256, inflight));
        let mut after = request(2, prompt.clone(), 40, SamplingParams::greedy());
        after.guide = Some(vocab.compile(&choice).unwrap().start_after(end));
        let mut from_start = request(3, prompt.clone(), 40, SamplingParams::greedy());
        from_start.guide = Some(vocab.compile(&choice).unwrap());
        let out = run(&mut e, vec![after, from_start]);
        let (ids, reason) = &out[&2];
        assert_eq!(
            ids[..6],
            free[..6],
            "free until the end token (inflight {inflight})"
        );
        assert_eq!(*reason, FinishReason::Stop, "{ids:?}");
        // Decoded with what came before it (SentencePiece drops a leading space otherwise).
        let full = tok.decode(&ids[..ids.len() - 1], false).unwrap();
        let head = tok.decode(&ids[..6], false).unwrap();
        let answer = full.strip_prefix(head.as_str()).expect("prefix");
        assert!(
            answer == " The end." || answer == " Lily smiled.",
            "after the end token: {answer:?} (inflight {inflight})"
        );
        // Without start_after the constraint holds from the first token.
        let (ids, _) = &out[&3];
        let text = tok.decode(&ids[..ids.len() - 1], false).unwrap();
        // (At the start of the output SentencePiece's decode drops the leading space.)
        assert!(text == "The end." || text == "Lily smiled.", "{text:?}");
        assert_ne!(ids[..6], free[..6]);
    }
}

/// A structured output whose every first token is a bad word leaves nothing to sample: the
/// request ends as `Abort`, and the token the worker drew from the empty row (which the guide
/// refuses) is not delivered.
#[test]
fn a_guide_the_bad_words_block_aborts_without_delivering_the_refused_token() {
    let g = goldens();
    let prompt = g[0].prompt_ids.clone();
    let (_, tok) = engine(config(16, 256, 2));
    let vocab = Vocabulary::from_tokenizer_json(
        &model_dir().join("tokenizer.json"),
        tok.vocab_size(),
        &[2],
    )
    .unwrap();
    let choice = Constraint::Choice(vec![" The end.".into()]);
    let mut first = vocab.compile(&choice).unwrap();
    let mut mask = vec![0u32; tok.vocab_size().div_ceil(32)];
    first.fill_mask(&mut mask).unwrap();
    let allowed: Vec<Vec<u32>> = (0..tok.vocab_size() as u32)
        .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 != 0)
        .map(|t| vec![t])
        .collect();
    assert!(
        !allowed.is_empty() && !allowed.contains(&vec![2]),
        "{allowed:?}"
    );
    for inflight in [1, 2] {
        let (mut e, _) = engine(config(16, 256, inflight));
        let mut r = request(1, prompt.clone(), 20, SamplingParams::greedy());
        r.guide = Some(vocab.compile(&choice).unwrap());
        r.bad_words = allowed.clone();
        let out = run(&mut e, vec![r]);
        let (ids, reason) = &out[&1];
        assert_eq!(*reason, FinishReason::Abort, "{ids:?}");
        assert!(ids.is_empty(), "a refused token was delivered: {ids:?}");
        assert_pool_full(&e);
    }
}
