//! Small KV pools. With a sliding window on every layer (`SchedulerConfig::kv_window`), a
//! request holds about a window of KV pages, so admission and the pool size count
//! `SchedulerConfig::request_pages` rather than the request's length. The invariants: a
//! request admitted into a pool of exactly that many pages runs to its end alone, without
//! preempting itself, however the launches are chunked, overlapped (two in flight) or served
//! from the prefix cache; and in a pool too small for the requests together, a preempted
//! request waits for room rather than restart and be preempted again and again.

use baton_proto::{Completion, Launch, Sampled, SamplingParams};
use baton_scheduler::{
    check_admission, AdmitError, Event, NewRequest, Scheduler, SchedulerConfig, SchedulingPolicy,
};
use std::collections::{HashSet, VecDeque};

const VOCAB: usize = 512;

fn config(
    block_size: usize,
    n: usize,
    window: Option<usize>,
    caching: bool,
    inflight: usize,
) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: n,
        block_size,
        num_blocks: 0,
        max_model_len: 512,
        max_inflight: inflight,
        enable_prefix_caching: caching,
        policy: SchedulingPolicy::Fcfs,
        kv_window: window,
    }
}

fn request(id: u64, prompt_len: usize, max_tokens: u32) -> NewRequest {
    NewRequest {
        priority: 0,
        id,
        prompt: (0..prompt_len).map(|i| 3 + (i * 37 % 500) as u32).collect(),
        max_tokens,
        params: SamplingParams::greedy(),
        eos_ids: vec![2],
        stop_token_ids: vec![],
        ignore_eos: true,
        logit_bias: Vec::new(),
        min_tokens: 0,
        cache_salt: 0,
        guide: None,
        bad_words: Vec::new(),
        lora: 0,
    }
}

/// Runs `reqs` together to their ends, publishing a launch whenever the in-flight limit allows
/// (as the daemon does) and completing and releasing the oldest otherwise. Returns the
/// preemptions.
fn run_all(s: &mut Scheduler, reqs: Vec<NewRequest>) -> u64 {
    let before = s.stats().preemptions;
    let mut live: HashSet<u64> = reqs.iter().map(|r| r.id).collect();
    for r in reqs {
        s.add_request(r).expect("admitted");
    }
    let mut inflight: VecDeque<Launch> = VecDeque::new();
    let mut events = Vec::new();
    for _ in 0..100_000 {
        while inflight.len() < s.config().max_inflight {
            match s.schedule() {
                Some(l) => inflight.push_back(l),
                None => break,
            }
        }
        let Some(l) = inflight.pop_front() else {
            assert!(
                live.is_empty(),
                "stalled with nothing in flight: {:?}",
                s.stats()
            );
            return s.stats().preemptions - before;
        };
        let sampled = l
            .rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.sample != 0)
            .map(|(i, r)| Sampled {
                row: i as u32,
                req: r.req,
                token: 7,
                logprob: 0.0,
                top: vec![],
            })
            .collect();
        let c = Completion {
            seq: l.seq,
            sampled,
            prompt: Vec::new(),
        };
        assert!(s.on_completion(&c, &mut events));
        s.on_released(l.seq);
        for e in events.drain(..) {
            if let Event::Finished { id, .. } = e {
                live.remove(&id);
            }
        }
    }
    panic!(
        "requests {live:?} did not finish in 100000 launches: {:?}",
        s.stats()
    );
}

/// [`run_all`] of one request.
fn run_alone(s: &mut Scheduler, req: NewRequest) -> u64 {
    run_all(s, vec![req])
}

#[test]
fn request_pages_count_the_window_and_a_chunk() {
    // Mistral 7B's window, 16-token pages, 2048-token chunks, one launch in flight: the
    // window's 4095 keys before a query plus the chunk, and one page for the alignment.
    let c = SchedulerConfig {
        max_model_len: 32768,
        ..config(16, 2048, Some(4096), false, 1)
    };
    assert_eq!(c.max_request_pages(), (4095 + 2048_usize).div_ceil(16) + 1);
    // Two launches in flight with prefix caching: the previous chunk's pages are released only
    // once registered, at its completion.
    let c2 = SchedulerConfig {
        enable_prefix_caching: true,
        max_inflight: 2,
        ..c.clone()
    };
    assert_eq!(c2.max_request_pages(), c.max_request_pages());
    let c3 = SchedulerConfig {
        kv_window: Some(100),
        ..c2.clone()
    };
    assert_eq!(c3.max_request_pages(), (2048_usize + 2048).div_ceil(16) + 1);
    // Never more than the request's own pages; without a window exactly those.
    assert_eq!(c.request_pages(100), 7);
    let none = SchedulerConfig {
        kv_window: None,
        ..c
    };
    assert_eq!(none.max_request_pages(), 32767_usize.div_ceil(16));
}

#[test]
fn admission_refuses_by_the_window_bound_not_the_length() {
    let mut c = config(4, 8, Some(16), false, 1);
    // (16 - 1 + 8) / 4 rounded up, plus one: 7 pages for any length.
    assert_eq!(c.max_request_pages(), 7);
    c.num_blocks = 7;
    assert_eq!(check_admission(&c, VOCAB, &request(1, 200, 50)), Ok(()));
    c.num_blocks = 6;
    assert_eq!(
        check_admission(&c, VOCAB, &request(1, 200, 50)),
        Err(AdmitError::TooLargeForPool {
            needed: 7,
            total: 6
        })
    );
    // A short request needs only its own pages.
    assert_eq!(check_admission(&c, VOCAB, &request(1, 10, 2)), Ok(()));
    c.kv_window = None;
    assert!(matches!(
        check_admission(&c, VOCAB, &request(1, 200, 50)),
        Err(AdmitError::TooLargeForPool { needed: 63, .. })
    ));
}

/// Every combination of page size, chunk size, window, caching and in-flight limit: a long
/// request alone in a pool of exactly `max_request_pages` pages finishes without a preemption,
/// and so does the same request again.
#[test]
fn a_long_request_runs_alone_in_the_smallest_pool_admission_allows() {
    let mut cases = 0;
    for block_size in [1, 4, 16] {
        for n in [1, 5, 16, 40] {
            for window in [1, 2, 7, 16, 33, 100] {
                for caching in [false, true] {
                    for inflight in [1, 2] {
                        let mut c = config(block_size, n, Some(window), caching, inflight);
                        c.num_blocks = c.max_request_pages();
                        let mut s = Scheduler::new_local(c.clone(), VOCAB);
                        for id in 1..=2 {
                            let preempted = run_alone(&mut s, request(id, 150, 60));
                            assert_eq!(preempted, 0, "run {id} of {c:?}");
                        }
                        let st = s.stats();
                        assert_eq!(st.pool.free, st.pool.total, "{c:?}: {st:?}");
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 3 * 4 * 6 * 2 * 2);
}

/// Runs a `first`-token prompt alone under `c` (prefix caching on), then the same prompt
/// extended by two chunks and 5 tokens: neither is preempted and every page comes back.
/// Returns the positions the second took from the prefix cache.
fn extended_after(c: SchedulerConfig, first: usize) -> usize {
    let more = 2 * c.max_num_batched_tokens + 5;
    let mut s = Scheduler::new_local(c.clone(), VOCAB);
    assert_eq!(run_alone(&mut s, request(1, first, 1)), 0, "{c:?}");
    assert_eq!(run_alone(&mut s, request(2, first + more, 20)), 0, "{c:?}");
    let st = s.stats();
    assert_eq!(st.pool.free, st.pool.total, "{c:?}: {st:?}");
    st.prefix_cache_hits as usize
}

/// A prefix cache hit as long as the pool (a request that filled the pool and finished, then
/// one that extends its prompt) takes only the hit pages its first row's window reads: taking
/// them all would leave no page for the rest of its prompt, with nothing in flight to free one.
#[test]
fn a_cache_hit_as_long_as_the_pool_holds_only_its_window() {
    let mut cases = 0;
    for block_size in [1, 4, 16] {
        for n in [1, 5, 16, 40] {
            for window in [1, 2, 7, 16, 33, 100] {
                for inflight in [1, 2] {
                    let mut c = config(block_size, n, Some(window), true, inflight);
                    c.num_blocks = c.max_request_pages();
                    let cached = (c.num_blocks - 1) * block_size;
                    let hits = extended_after(c, cached);
                    assert!(hits >= cached - block_size, "{hits} hits");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 3 * 4 * 6 * 2);
}

/// A prompt far longer than the pool, run once (its leading blocks are released mid-request and
/// evicted by its own later pages), then extended: the extension is served from the cache up
/// to about the first prompt's end, because with a window only the blocks the first row reads
/// must be cached, not the whole chain from the first block (vLLM's sliding-window hit).
#[test]
fn a_windowed_prefix_hit_needs_only_the_window_blocks_cached() {
    let mut cases = 0;
    for block_size in [1, 4, 16] {
        for n in [1, 5, 16, 40] {
            for window in [2, 7, 16, 33, 100] {
                for inflight in [1, 2] {
                    let mut c = config(block_size, n, Some(window), true, inflight);
                    c.num_blocks = c.max_request_pages();
                    let first = (3 * c.num_blocks * block_size).min(300);
                    let hits = extended_after(c, first);
                    // The first prompt's last window and chunk were held at its end, so at
                    // least that far is served.
                    let served = first.saturating_sub(window + 2 * n + 2 * block_size);
                    assert!(hits >= served.max(1), "{hits} hits");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 3 * 4 * 5 * 2);
}

/// Without a window: a long decode beside a long prompt in a pool that holds one 512-token
/// request and little more. The prompt is started, then preempted when the decode needs its
/// pages; after that it waits for room (`Scheduler::restart_would_thrash`) instead of
/// restarting and being preempted again at every chunk, so preemptions stay at the first and
/// the positions computed stay near the requests' own. With prefix caching, the prefix cache
/// counters count each request's first lookup only (vLLM's `PrefixCacheStats::record` keeps
/// a preempted request's apart): the restart's lookup of its own recomputed blocks is not
/// cache traffic.
#[test]
fn a_preempted_request_waits_for_room_instead_of_thrashing() {
    for (caching, inflight, n) in [(false, 2, 256), (true, 2, 64), (false, 1, 32)] {
        let mut c = config(4, n, None, caching, inflight);
        c.max_model_len = 512;
        c.num_blocks = 130;
        let mut s = Scheduler::new_local(c.clone(), VOCAB);
        let mut decode = request(1, 60, 440);
        decode
            .prompt
            .iter_mut()
            .for_each(|t| *t = 3 + (*t * 7) % 400);
        let preempted = run_all(&mut s, vec![decode, request(2, 500, 11)]);
        assert!(
            (1..=2).contains(&preempted),
            "{preempted} preemptions: {c:?}"
        );
        let st = s.stats();
        assert!(st.launches < 700, "{c:?}: {st:?}");
        if caching {
            assert_eq!(st.prefix_cache_queries, 60 + 500, "{c:?}: {st:?}");
        }
    }
}

/// With the 16-key window in the smallest pool it admits (5 pages of 16 with 32-token chunks):
/// eight requests of 4 to 200 prompt tokens generating 300 each, together. Each is preempted
/// at most about once (a first start that the running ones outgrow), not hundreds of times.
#[test]
fn requests_in_the_smallest_windowed_pool_are_not_preempted_over_and_over() {
    for (caching, inflight) in [(true, 2), (false, 2), (false, 1)] {
        let mut c = config(16, 32, Some(16), caching, inflight);
        c.num_blocks = c.max_request_pages();
        let mut s = Scheduler::new_local(c.clone(), VOCAB);
        let reqs = [4, 200, 5, 180, 20, 180, 4, 7]
            .iter()
            .enumerate()
            .map(|(i, &len)| request(i as u64 + 1, len, 300))
            .collect();
        let preempted = run_all(&mut s, reqs);
        assert!(preempted <= 16, "{preempted} preemptions: {c:?}");
        let st = s.stats();
        assert_eq!(st.pool.free, st.pool.total, "{c:?}: {st:?}");
    }
}
