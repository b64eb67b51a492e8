//! The stories260K goldens through the scheduler while the worker's completions reach it
//! several launches late and its releases lag its completions, with four launches in flight and
//! a pool so small that pages are recycled constantly (DESIGN.md sections 3 and 4). Around the
//! goldens, fillers stop early with later launches in flight and clients disconnect. The greedy
//! outputs still match golden.json exactly, everything comes back, and `check_trace` accepts
//! the lifecycle trace.

mod common;
use baton_scheduler::{check_trace, Tracer};
use common::delayed::{golden_mix, DelayedEngine, Delays};
use common::*;
use std::io::Write;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn goldens_match_with_late_reports(block_size: usize, num_blocks: usize, delays: Delays) {
    let g = goldens();
    let mut engine = DelayedEngine::new(config(block_size, num_blocks, 4), delays);
    let trace = Buf::default();
    engine.set_tracer(Tracer::new(Box::new(trace.clone())));
    let reqs = golden_mix(&mut engine, 20);
    let out = collect(engine.run(reqs));
    for (i, gp) in g.iter().enumerate() {
        assert_eq!(
            out[&(i as u64)].0,
            gp.greedy_ids,
            "golden {:?} differs (block {block_size}, pages {num_blocks}, {delays:?})",
            gp.prompt
        );
    }
    let s = engine.sched.stats();
    assert_eq!(s.pool.free, s.pool.total, "pool not back to full: {s:?}");
    assert_eq!(s.slots_retired, 0, "slots still retired: {s:?}");
    assert!(
        s.preemptions > 0,
        "the small pool was meant to preempt: {s:?}"
    );
    assert_eq!(
        engine.stats.max_unreported, 4,
        "four launches were meant to be in flight at once"
    );
    let trace = trace.0.lock().unwrap().clone();
    let summary = check_trace(trace.as_slice()).expect("the trace passes the checker");
    assert!(
        summary.reclaimed_pages > 5 * num_blocks,
        "pages were meant to be recycled constantly: {summary:?}"
    );
    assert!(summary.cancels > 0, "{summary:?}");
    assert!(
        summary.finished_with_launch_in_flight > 0,
        "some request was meant to finish with a later launch in flight: {summary:?}"
    );
}

/// The worker executes each launch when it is published; the scheduler hears of completion `s`
/// only once launch `s + 3` is published, and of release `s` two completions after that.
#[test]
fn greedy_goldens_match_with_completions_three_launches_late_and_a_recycling_pool() {
    let delays = Delays {
        completion_lag: 3,
        release_lag: 2,
        execute_late: false,
    };
    goldens_match_with_late_reports(4, 48, delays);
    goldens_match_with_late_reports(16, 12, delays);
}

/// The worker lags behind the scheduler: it executes launch `s` only when its completion is
/// reported, three launches later, reading the token and block tables as they are then, so
/// every table entry a launch refers to must still hold its value when the launch runs.
#[test]
fn greedy_goldens_match_with_a_worker_lagging_three_launches_behind_the_scheduler() {
    let delays = Delays {
        completion_lag: 3,
        release_lag: 2,
        execute_late: true,
    };
    goldens_match_with_late_reports(4, 48, delays);
    goldens_match_with_late_reports(16, 12, delays);
}

/// stories260K run with a 16-key sliding window on every layer (as a Mistral): a running
/// request's pages wholly before its next query's window go back to the pool mid-request
/// (`SchedulerConfig::kv_window`). With the worker executing three launches late (reading the
/// tables as they are then) and releases lagging, six requests of up to 141 tokens (36 pages
/// each) share a pool of 64 pages without a preemption; their outputs are those of a roomy
/// pool that releases nothing early, log-probabilities bit for bit; every page comes back; and
/// the trace checker, which
/// tracks the last launch referring to each page, accepts the lifecycle. The same small pool
/// without the early release preempts.
#[test]
fn sliding_window_pages_come_back_mid_request_under_late_reports() {
    use baton_proto::SamplingParams;
    use baton_scheduler::NewRequest;
    let window = 16;
    let reqs = || -> Vec<NewRequest> {
        filler_prompts(6)
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let params = SamplingParams {
                    want_logprob: 1,
                    ..SamplingParams::greedy()
                };
                NewRequest::new(i as u64, p, 100, params)
            })
            .collect()
    };
    // Per request, each token with its log-probability's bits: a key read from a page that
    // another request overwrote changes them even when the greedy token survives.
    let outputs = |events: Vec<baton_scheduler::Event>| {
        let mut out: std::collections::BTreeMap<u64, Vec<(u32, u32)>> = Default::default();
        for e in events {
            if let baton_scheduler::Event::Token {
                id, token, logprob, ..
            } = e
            {
                out.entry(id).or_default().push((token, logprob.to_bits()));
            }
        }
        out
    };
    let late = Delays {
        completion_lag: 3,
        release_lag: 2,
        execute_late: true,
    };
    // Reports at once: a released page is reclaimed and reused soonest, so a page let go of
    // while still in the window is overwritten before the window leaves it.
    let prompt = Delays {
        completion_lag: 0,
        release_lag: 0,
        execute_late: false,
    };
    let run = |num_blocks: usize, release: bool, caching: bool, delays: Delays| {
        let cfg = baton_scheduler::SchedulerConfig {
            enable_prefix_caching: caching,
            ..config(4, num_blocks, 4)
        };
        let mut engine = DelayedEngine::windowed(cfg, delays, window, release);
        let trace = Buf::default();
        engine.set_tracer(Tracer::new(Box::new(trace.clone())));
        let out = outputs(engine.run(reqs()));
        let s = engine.sched.stats();
        assert_eq!(s.pool.free, s.pool.total, "pool not back to full: {s:?}");
        assert_eq!(s.slots_retired, 0, "slots still retired: {s:?}");
        let trace = trace.0.lock().unwrap().clone();
        let summary = check_trace(trace.as_slice()).expect("the trace passes the checker");
        (out, s.preemptions, summary)
    };
    let (roomy, _, _) = run(4096, false, true, late);
    assert!(roomy.values().all(|ids| ids.len() == 100));
    // With prefix caching a released page keeps its block until the pool evicts it; without,
    // it is reused as soon as it is reclaimed.
    for (caching, delays) in [(true, late), (false, late), (false, prompt)] {
        let (small, preemptions, summary) = run(64, true, caching, delays);
        assert_eq!(
            small, roomy,
            "releasing pages out of the window changed outputs (caching {caching}, {delays:?})"
        );
        assert_eq!(preemptions, 0, "caching {caching}: {summary:?}");
        assert!(summary.reclaimed_pages > 2 * 64, "{summary:?}");
        let (control, preemptions, _) = run(64, false, caching, delays);
        assert_eq!(control, roomy);
        assert!(
            preemptions > 0,
            "the small pool was meant to preempt without the release (caching {caching})"
        );
    }
}

/// A long prompt with prompt log-probabilities (chunks of at most 256 scored positions) beside
/// a long decode, in a pool that holds one 512-token request (128 pages of 4) and little more,
/// on the 16-key windowed model without prefix caching: the prompt's second chunk waits for the
/// pages its first chunk let go of (released before the chunk's own pages are allocated)
/// instead of preempting itself again and again (220 preemptions when the release came after
/// the allocation). Outputs do not depend on when reports arrive.
#[test]
fn a_long_scored_prompt_reuses_its_own_released_pages_instead_of_preempting_itself() {
    use baton_proto::SamplingParams;
    use baton_scheduler::NewRequest;
    let mut first = None;
    for (completion_lag, release_lag) in [(0u64, 0u64), (1, 1), (3, 2)] {
        let delays = Delays {
            completion_lag,
            release_lag,
            execute_late: false,
        };
        let cfg = baton_scheduler::SchedulerConfig {
            enable_prefix_caching: false,
            max_num_batched_tokens: 2048,
            ..config(4, 128, 2)
        };
        let mut engine = DelayedEngine::windowed(cfg, delays, 16, true);
        let decode: Vec<u32> = (0..60u32).map(|i| 3 + i * 7 % 400).collect();
        let long: Vec<u32> = (0..500u32).map(|i| 3 + (i * 37) % 500).collect();
        let scored = SamplingParams {
            prompt_logprobs: 1,
            ..SamplingParams::greedy()
        };
        let reqs = vec![
            NewRequest::new(1, decode, 440, SamplingParams::greedy()),
            NewRequest::new(2, long, 12, scored),
        ];
        let out = collect(engine.run(reqs));
        assert_eq!((out[&1].0.len(), out[&2].0.len()), (440, 12));
        let s = engine.sched.stats();
        assert!(s.preemptions <= 2, "{delays:?}: {s:?}");
        assert_eq!(s.pool.free, s.pool.total, "pool not back to full: {s:?}");
        assert_eq!(first.get_or_insert_with(|| out.clone()), &out, "{delays:?}");
    }
}

/// Prefix caching on the 16-key windowed model in the smallest pool it admits (with 32-token
/// chunks): a 300-token prompt runs first (its leading blocks released mid-request and evicted
/// by its own later pages), then the same prompt extended by 40 tokens. The second is served
/// from the cache past its first 250 positions, though the first blocks are gone (only the
/// blocks its first row's window reads must be cached), and its tokens and log-probability
/// bits equal those of the same request alone in a roomy pool without caching.
#[test]
fn a_windowed_prefix_hit_without_its_leading_blocks_gives_the_same_bits() {
    use baton_proto::SamplingParams;
    use baton_scheduler::{Event, NewRequest};
    let first: Vec<u32> = (0..300u32).map(|i| 3 + (i * 37) % 500).collect();
    let mut second = first.clone();
    second.extend((0..40u32).map(|i| 3 + (i * 11) % 500));
    let params = SamplingParams {
        want_logprob: 1,
        ..SamplingParams::greedy()
    };
    let bits = |events: Vec<Event>, id: u64| -> Vec<(u32, u32)> {
        events
            .into_iter()
            .filter_map(|e| match e {
                Event::Token {
                    id: i,
                    token,
                    logprob,
                    ..
                } if i == id => Some((token, logprob.to_bits())),
                _ => None,
            })
            .collect()
    };
    let delays = Delays {
        completion_lag: 1,
        release_lag: 1,
        execute_late: true,
    };
    let cfg = |caching: bool, num_blocks: usize| baton_scheduler::SchedulerConfig {
        enable_prefix_caching: caching,
        max_num_batched_tokens: 32,
        kv_window: Some(16),
        ..config(4, num_blocks, 2)
    };
    let mut roomy = DelayedEngine::windowed(cfg(false, 512), delays, 16, true);
    let want = bits(
        roomy.run(vec![NewRequest::new(2, second.clone(), 30, params)]),
        2,
    );
    assert_eq!(want.len(), 30);
    let small = cfg(true, 0).max_request_pages();
    let mut engine = DelayedEngine::windowed(cfg(true, small), delays, 16, true);
    engine.run(vec![NewRequest::new(1, first, 1, params)]);
    let got = bits(engine.run(vec![NewRequest::new(2, second, 30, params)]), 2);
    let s = engine.sched.stats();
    assert!(s.prefix_cache_hits >= 250, "{s:?}");
    assert_eq!(s.preemptions, 0, "{s:?}");
    assert_eq!(got, want, "a cached window's KV differs from recomputed KV");
}
