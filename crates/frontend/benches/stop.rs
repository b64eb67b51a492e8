//! The frontend's cost of stop strings per generated token ([`StopMatcher::push`]): a
//! sequence's 480 tokens of text through a matcher of a few short stop strings, of
//! [`MAX_STOP_STRINGS`] strings of 64 bytes (`MAX_STOP_BYTES`), and of one string of
//! `MAX_STOP_BYTES` bytes whose prefixes the text keeps repeating.
//!
//! `cargo bench -p baton-frontend --bench stop`

use baton_frontend::stop::StopMatcher;
use baton_frontend::validate::{MAX_STOP_BYTES, MAX_STOP_STRINGS};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

/// 480 token texts of a story (none of the stop strings below occurs in it).
fn tokens() -> Vec<String> {
    let words = [
        "Once", " upon", " a", " time", ",", " there", " was", " a", " little", " girl",
    ];
    (0..480)
        .map(|i| words[i % words.len()].to_owned())
        .collect()
}

fn run(stops: &[String], tokens: &[String]) -> usize {
    let mut m = StopMatcher::new(stops, false);
    let mut out = 0;
    for t in tokens {
        out += m.push(t).text.len();
    }
    out + m.flush().len()
}

fn bench(c: &mut Criterion) {
    let toks = tokens();
    let few: Vec<String> = ["\n\n", "</s>", "THE END", "<|im_end|>"]
        .map(String::from)
        .into();
    let many: Vec<String> = (0..MAX_STOP_STRINGS)
        .map(|i| format!("{:0>64}", i))
        .collect();
    assert!(many.iter().map(String::len).sum::<usize>() <= MAX_STOP_BYTES);
    // The text's own words, long enough that every token leaves a held-back prefix.
    let long: Vec<String> = vec![toks.concat().repeat(40)[..MAX_STOP_BYTES - 1].to_owned() + "!"];
    let mut g = c.benchmark_group("stop_480_tokens");
    g.bench_function("4_short", |b| b.iter(|| run(black_box(&few), &toks)));
    g.bench_function("1024_of_64_bytes", |b| {
        b.iter(|| run(black_box(&many), &toks))
    });
    g.bench_function("one_of_64_KiB", |b| b.iter(|| run(black_box(&long), &toks)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
