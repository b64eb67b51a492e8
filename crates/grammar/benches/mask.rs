//! What a guided row costs the scheduler per step: `Guide::fill_mask` (llguidance's mask over
//! the whole vocabulary) and `Guide::consume`, on the Llama 2 tokenizer (32000 tokens), for a
//! JSON schema and a regex; and compiling a constraint (paid on the frontend and again on the
//! scheduler per request).
//!
//! Run: `cargo bench -p baton-grammar --bench mask`.

use baton_grammar::{mask_words, Constraint, Guide, Vocabulary};
use criterion::{criterion_group, criterion_main, Criterion};
use std::path::PathBuf;

fn vocab() -> Vocabulary {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models/llama2-tokenizer/tokenizer.json");
    Vocabulary::from_tokenizer_json(&path, 32000, &[2]).expect("the Llama 2 tokenizer")
}

fn schema() -> Constraint {
    Constraint::Json(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    }))
}

/// Walks `g` through the greedy-first allowed token `steps` times (a deterministic path), and
/// returns the tokens it took.
fn path(g: &mut Guide, words: usize, steps: usize) -> Vec<u32> {
    let mut m = vec![0u32; words];
    let mut out = Vec::new();
    for _ in 0..steps {
        g.fill_mask(&mut m).unwrap();
        // The highest allowed id: long pieces, so the path moves through the grammar.
        let Some(t) = (0..words * 32)
            .rev()
            .find(|&t| m[t / 32] >> (t % 32) & 1 == 1)
        else {
            break;
        };
        if g.is_finished() {
            break;
        }
        g.consume(t as u32).unwrap();
        out.push(t as u32);
    }
    out
}

fn bench(c: &mut Criterion) {
    let v = vocab();
    let words = mask_words(v.vocab_size());
    for (name, con) in [
        ("json_schema", schema()),
        (
            "regex",
            Constraint::Regex("[a-z]{3,12}( [a-z]{3,12}){0,8}\\.".into()),
        ),
    ] {
        c.bench_function(&format!("compile/{name}"), |b| {
            b.iter(|| v.compile(&con).unwrap())
        });
        // One step in the middle of an output: fill the mask, take a token.
        let mut g = v.compile(&con).unwrap();
        let warm = path(&mut g, words, 6);
        assert!(!warm.is_empty());
        let mut m = vec![0u32; words];
        c.bench_function(&format!("fill_mask/{name}"), |b| {
            b.iter(|| g.fill_mask(&mut m).unwrap())
        });
        c.bench_function(&format!("step/{name}"), |b| {
            b.iter_batched(
                || g.clone(),
                |mut g| {
                    g.fill_mask(&mut m).unwrap();
                    let t = (0..words * 32)
                        .rev()
                        .find(|&t| m[t / 32] >> (t % 32) & 1 == 1)
                        .unwrap();
                    g.consume(t as u32).unwrap();
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
