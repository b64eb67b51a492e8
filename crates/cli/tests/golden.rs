//! The CPU reference engine reproduces golden.json (greedy ids and texts) through the same
//! scheduler and worker code the daemons run, alone, batched, at several block sizes, under
//! preemption and with asynchronous scheduling.

mod common;
use baton_proto::SamplingParams;
use common::*;

fn greedy_goldens_match(block_size: usize, num_blocks: usize, max_inflight: usize, fillers: usize) {
    let g = goldens();
    let (mut engine, _tok) = engine(config(block_size, num_blocks, max_inflight));
    let mut reqs = Vec::new();
    for (i, p) in filler_prompts(fillers).into_iter().enumerate() {
        reqs.push(request(
            100 + i as u64,
            p,
            24 + (i as u32 % 5) * 9,
            SamplingParams::greedy(),
        ));
    }
    // Interleave the goldens among the fillers so their rows move around.
    for (i, gp) in g.iter().enumerate() {
        let at = (i * 7).min(reqs.len());
        reqs.insert(
            at,
            request(
                i as u64,
                gp.prompt_ids.clone(),
                64,
                SamplingParams::greedy(),
            ),
        );
    }
    let out = run(&mut engine, reqs);
    for (i, gp) in g.iter().enumerate() {
        assert_eq!(out[&(i as u64)].0, gp.greedy_ids, "golden {:?} differs (block {block_size}, pages {num_blocks}, inflight {max_inflight}, fillers {fillers})", gp.prompt);
    }
    assert_pool_full(&engine);
    if num_blocks < 40 {
        assert!(
            engine.stats().preemptions > 0,
            "the small pool was meant to force preemption"
        );
    }
}

#[test]
fn greedy_goldens_alone_match_golden_json() {
    let g = goldens();
    for (i, gp) in g.iter().enumerate() {
        let (mut engine, tok) = engine(config(16, 256, 1));
        let out = run(
            &mut engine,
            vec![request(
                i as u64,
                gp.prompt_ids.clone(),
                64,
                SamplingParams::greedy(),
            )],
        );
        assert_eq!(out[&(i as u64)].0, gp.greedy_ids);
        let enc = tok.encode(&gp.prompt, true).unwrap();
        assert_eq!(enc, gp.prompt_ids);
        assert_pool_full(&engine);
    }
}

#[test]
fn greedy_goldens_together_match() {
    greedy_goldens_match(16, 256, 1, 0);
}

#[test]
fn greedy_goldens_with_twenty_mixed_prompts_match_at_block_sizes_1_16_32() {
    for bs in [1, 16, 32] {
        greedy_goldens_match(bs, 4096 / bs, 1, 20);
    }
}

#[test]
fn greedy_goldens_match_with_asynchronous_scheduling() {
    greedy_goldens_match(16, 256, 2, 20);
}

#[test]
fn greedy_goldens_match_when_a_small_pool_forces_preemption() {
    // 23 requests of up to ~110 tokens in 24 pages of 16: at most a few fit at once.
    greedy_goldens_match(16, 24, 1, 20);
    greedy_goldens_match(16, 24, 2, 20);
}
