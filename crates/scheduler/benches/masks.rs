//! Scheduler CPU time per decode step (`schedule` + `on_completion` + `on_released`) for 128
//! running requests over a 128256-token vocabulary (Llama 3's): without bad words, with
//! one-token bad words (a fixed token mask written at slot take), and with a two-token bad
//! word (the mask follows the outputs, so it is written for every sampling row), and with a
//! list near the wire's limit.
//!
//! `cargo bench -p baton-scheduler --bench masks`. Results: `bench/RESULTS.md`.

use baton_proto::{Completion, SamplingParams};
use baton_scheduler::{Event, NewRequest, Scheduler, SchedulerConfig, SchedulingPolicy};
use criterion::{black_box, Criterion};
use std::time::Duration;

const VOCAB: usize = 128_256;
const ROWS: usize = 128;

fn request(id: u64, bad_words: &[Vec<u32>]) -> NewRequest {
    let prompt = (0..16).map(|i| 100 + (id as u32 * 31 + i) % 1000).collect();
    NewRequest {
        bad_words: bad_words.to_vec(),
        ..NewRequest::new(id, prompt, 256, SamplingParams::greedy())
    }
}

/// A scheduler with [`ROWS`] requests decoding; finished requests are replaced by new ones.
struct Bench {
    s: Scheduler,
    words: Vec<Vec<u32>>,
    next_id: u64,
    events: Vec<Event>,
}

impl Bench {
    fn new(words: Vec<Vec<u32>>) -> Self {
        let cfg = SchedulerConfig {
            max_num_seqs: ROWS,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_blocks: ROWS * 32,
            max_model_len: 512,
            max_inflight: 1,
            enable_prefix_caching: false,
            policy: SchedulingPolicy::Fcfs,
            kv_window: None,
        };
        let mut b = Bench {
            s: Scheduler::new_local(cfg, VOCAB),
            words,
            next_id: 0,
            events: Vec::new(),
        };
        for _ in 0..ROWS {
            b.add();
        }
        // Past the prefills.
        for _ in 0..4 {
            b.step();
        }
        b
    }

    fn add(&mut self) {
        self.s
            .add_request(request(self.next_id, &self.words))
            .expect("admitted");
        self.next_id += 1;
    }

    /// One launch: planned, completed (every sampling row samples token 9, then 10, ...),
    /// released.
    fn step(&mut self) {
        let l = self.s.schedule().expect("work");
        let c = Completion::sampling(&l, |r| 9 + r.output_index % 4);
        self.s.on_completion(&c, &mut self.events);
        self.s.on_released(l.seq);
        let finished = self
            .events
            .drain(..)
            .filter(|e| matches!(e, Event::Finished { .. }))
            .count();
        for _ in 0..finished {
            self.add();
        }
    }
}

/// An adversarial list near `MAX_BAD_WORDS_WORDS`: 800 one-token words, and 800 two-token
/// words after token 9, so every row that follows a 9 bans 800 tokens and allows them again
/// at its next row.
fn near_the_wire_limit() -> Vec<Vec<u32>> {
    let one = (0..800).map(|i| vec![2000 + i]);
    let two = (0..800).map(|i| vec![9, 5000 + i]);
    let words: Vec<Vec<u32>> = one.chain(two).collect();
    let packed: usize = words.iter().map(|w| 1 + w.len()).sum();
    assert!(packed <= baton_proto::wire::MAX_BAD_WORDS_WORDS);
    words
}

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    let mut g = c.benchmark_group("decode_step_128_rows_vocab_128256");
    for (name, words) in [
        ("no_bad_words", Vec::new()),
        ("one_token_bad_words", vec![vec![11], vec![500]]),
        ("two_token_bad_word", vec![vec![9, 10], vec![500]]),
        ("near_the_wire_limit", near_the_wire_limit()),
    ] {
        let mut b = Bench::new(words);
        g.bench_function(name, |bench| {
            bench.iter(|| {
                b.step();
                black_box(b.next_id)
            })
        });
    }
    g.finish();
    c.final_summary();
}
