//! Times `CpuModel::forward` steps on a model directory (default: stories260K).
//!
//! Usage: `cargo run --release -p baton-model --example cpu_step_bench [MODEL_DIR]`.
//! Prints per-step wall time for a 128-token prefill and for decode batches of 1..64 rows at a
//! context of ~128 tokens.

use baton_model::{load_model_dir, ForwardRow, PagedKvCache};
use std::time::Instant;

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/models/stories260K"
        )
        .to_string()
    });
    let (model, _) = match load_model_dir(&dir) {
        Ok(m) => m.into_cpu_model(),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let vocab = model.config().vocab_size as u32;
    let bs = 16usize;
    let ctx = 128usize;
    let per_seq = (ctx + 64) / bs + 1;
    for batch in [1usize, 8, 32, 64] {
        let mut kv = PagedKvCache::new(model.config(), per_seq * batch, bs);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| (0..per_seq).map(|j| (s * per_seq + j) as u32).collect())
            .collect();
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|s| {
                (0..ctx)
                    .map(|i| ((s * 7 + i * 13) as u32) % vocab)
                    .collect()
            })
            .collect();
        let t = Instant::now();
        for s in 0..batch {
            model
                .forward(
                    &mut kv,
                    &[ForwardRow {
                        tokens: &prompts[s],
                        start_pos: 0,
                        block_table: &tables[s],
                        want_logits: true,
                        all_logits: false,
                        lora: 0,
                    }],
                )
                .unwrap();
        }
        let prefill = t.elapsed() / batch as u32;
        let steps = 32;
        let t = Instant::now();
        for step in 0..steps {
            let toks: Vec<[u32; 1]> = (0..batch).map(|s| [((s + step) as u32) % vocab]).collect();
            let rows: Vec<ForwardRow> = (0..batch)
                .map(|s| ForwardRow {
                    tokens: &toks[s],
                    start_pos: ctx + step,
                    block_table: &tables[s],
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                })
                .collect();
            model.forward(&mut kv, &rows).unwrap();
        }
        let per_step = t.elapsed() / steps as u32;
        println!(
            "batch {batch:3}: prefill {ctx} tokens {prefill:?}/seq; decode step {per_step:?} \
             ({:.0} tok/s)",
            batch as f64 / per_step.as_secs_f64()
        );
    }
}
