//! Host cost of penalties per sampling row per step: building the row's penalty list from its
//! whole history (`build_penalty_list`, the reference), from the per-slot counts the workers
//! keep (`PenaltyHistories::row_list`, what they do every step), and the CPU sampler with and
//! without a list.
//!
//! `cargo bench -p baton-worker --bench penalties`. Results: `bench/RESULTS.md`.

use baton_proto::{HeapSlotTables, SamplingParams, SlotRef};
use baton_worker::penalty::{build_penalty_list, PenaltyHistories, RowHistory};
use baton_worker::sampling::Sampler;
use criterion::{black_box, BenchmarkId, Criterion, Throughput};
use std::time::Duration;

/// A history of `len` tokens over a 32000-token vocabulary with natural-text-like repetition:
/// a third of the tokens come from a pool of 300 frequent ones.
fn history(len: usize) -> Vec<u32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if s.is_multiple_of(3) {
                (s >> 8) as u32 % 300
            } else {
                (s >> 8) as u32 % 32000
            }
        })
        .collect()
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
        .configure_from_args();
    let mut g = c.benchmark_group("build_penalty_list");
    for len in [128usize, 2048, 8192] {
        let h = history(len);
        g.throughput(Throughput::Elements(len as u64));
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        g.bench_with_input(BenchmarkId::new("with_prompt", len), &h, |b, h| {
            b.iter(|| {
                build_penalty_list(h, len / 2, true, &[], &mut scratch, &mut out);
                black_box(out.len())
            })
        });
        g.bench_with_input(BenchmarkId::new("outputs_only", len), &h, |b, h| {
            b.iter(|| {
                build_penalty_list(&h[len / 2..], 0, false, &[], &mut scratch, &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();

    // What the workers do per step since the per-slot counts: a decode row of a request whose
    // history is `len` tokens (half prompt), the counts already cached, one new input.
    let mut g = c.benchmark_group("row_list_cached_decode");
    for len in [128usize, 2048, 8192] {
        let h = history(len + 1);
        let tables = HeapSlotTables::new_heap(1, len + 1, 1);
        for (p, &t) in h.iter().enumerate() {
            tables.set_token(0, p, t);
        }
        g.throughput(Throughput::Elements(len as u64));
        for with_prompt in [true, false] {
            let mut cache = PenaltyHistories::new();
            let out = &mut Vec::new();
            let row = RowHistory {
                slot: SlotRef::default(),
                first_pos: len,
                prompt_len: len / 2,
                with_prompt,
                own: &h[len..],
                own_start: len,
            };
            cache.row_list(&row, &tables, &[], out);
            let name = if with_prompt {
                "with_prompt"
            } else {
                "outputs_only"
            };
            g.bench_with_input(BenchmarkId::new(name, len), &row, |b, row| {
                b.iter(|| {
                    cache.row_list(row, &tables, &[], out);
                    black_box(out.len())
                })
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("sample_vocab_32000");
    let logits: Vec<f32> = history(32000)
        .iter()
        .map(|&t| (t % 1000) as f32 / 100.0)
        .collect();
    let p = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.2,
        ..SamplingParams::greedy()
    };
    let (mut scratch, mut list) = (Vec::new(), Vec::new());
    build_penalty_list(&history(2048), 1024, true, &[], &mut scratch, &mut list);
    let mut sampler = Sampler::new();
    g.bench_function("greedy", |b| {
        b.iter(|| black_box(sampler.sample(&logits, &SamplingParams::greedy(), 0).token))
    });
    g.bench_function("greedy_penalized_2048_history", |b| {
        b.iter(|| black_box(sampler.sample_penalized(&logits, &p, 0, &list).token))
    });
    g.finish();
    c.final_summary();
}
