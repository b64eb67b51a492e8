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
