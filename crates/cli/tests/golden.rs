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

#[test]
fn greedy_goldens_match_without_prefix_caching() {
    let g = goldens();
    let mut cfg = config(1, 4096, 2);
    cfg.enable_prefix_caching = false;
    let (mut engine, _tok) = engine(cfg);
    let reqs = g
        .iter()
        .enumerate()
        .map(|(i, gp)| {
            request(
                i as u64,
                gp.prompt_ids.clone(),
                64,
                SamplingParams::greedy(),
            )
        })
        .collect();
    let out = run(&mut engine, reqs);
    for (i, gp) in g.iter().enumerate() {
        assert_eq!(out[&(i as u64)].0, gp.greedy_ids);
    }
    // With caching off nothing is queried either (vLLM reports no prefix-cache stats then).
    assert_eq!(engine.stats().prefix_cache_hits, 0);
    assert_eq!(engine.stats().prefix_cache_queries, 0);
    assert_pool_full(&engine);
}

/// The second round of the same prompts takes their full blocks from the prefix cache (the
/// CPU forward pass is batch-invariant, so the cached KV is bit-identical to a recompute) and
/// still reproduces golden.json; so does a round that extends each prompt's history with its
/// own greedy output, which hits the blocks the first round's decodes registered.
#[test]
fn greedy_goldens_match_when_their_prefixes_come_from_the_cache() {
    let g = goldens();
    for bs in [1, 4, 16] {
        let (mut engine, _tok) = engine(config(bs, 8192 / bs, 2));
        let round = |engine: &mut _, base: u64| {
            let reqs = g
                .iter()
                .enumerate()
                .map(|(i, gp)| {
                    let id = base + i as u64;
                    request(id, gp.prompt_ids.clone(), 64, SamplingParams::greedy())
                })
                .collect();
            run(engine, reqs)
        };
        let first = round(&mut engine, 0);
        let hits_before = engine.stats().prefix_cache_hits;
        let second = round(&mut engine, 100);
        let hits = engine.stats().prefix_cache_hits - hits_before;
        let full_blocks: usize = g.iter().map(|gp| (gp.prompt_ids.len() - 1) / bs * bs).sum();
        assert_eq!(
            hits as usize, full_blocks,
            "block {bs}: every full block of the second round's prompts is a hit"
        );
        for (i, gp) in g.iter().enumerate() {
            assert_eq!(first[&(i as u64)].0, gp.greedy_ids, "block {bs}");
            assert_eq!(
                second[&(100 + i as u64)].0,
                gp.greedy_ids,
                "block {bs}, cached"
            );
        }
        // Prompt + the first 32 greedy tokens: the continuation is the rest of the golden.
        let reqs = g
            .iter()
            .enumerate()
            .filter(|(_, gp)| gp.greedy_ids.len() > 40)
            .map(|(i, gp)| {
                let mut p = gp.prompt_ids.clone();
                p.extend_from_slice(&gp.greedy_ids[..32]);
                let rest = (gp.greedy_ids.len() - 32) as u32;
                request(200 + i as u64, p, rest, SamplingParams::greedy())
            })
            .collect::<Vec<_>>();
        assert!(!reqs.is_empty());
        let before = engine.stats().prefix_cache_hits;
        let third = run(&mut engine, reqs);
        assert!(engine.stats().prefix_cache_hits > before);
        for (id, (toks, _)) in &third {
            let gp = &g[(*id - 200) as usize];
            assert_eq!(
                toks[..],
                gp.greedy_ids[32..],
                "block {bs}, history from the cache"
            );
        }
        assert_pool_full(&engine);
    }
}
