//! The CPU reference forward pass on a SmolLM-135M-shaped model (hidden 576, 30 layers, 9
//! heads of 64, 3 KV heads, intermediate 1536, vocabulary 49152, tied embeddings; seeded
//! random weights): one decode step at batch 1, 16 and 64 (each sequence 128 tokens in), a
//! 256-token prefill, and one decode step at batch 1 and 4 and a 256-token prefill chunk with
//! 2048 tokens in (where the attention's share grows), on `BATON_BENCH_THREADS` threads (default 2).
//!
//! `cargo bench -p baton-model --bench forward`. Results: `bench/RESULTS.md`.

use baton_model::{CpuModel, DType, ForwardRow, LlamaWeights, ModelConfig, PagedKvCache};
use criterion::{BenchmarkId, Criterion, Throughput};
use std::time::Duration;

const SMOL: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
    "hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,
    "num_key_value_heads":3,"head_dim":64,"vocab_size":49152,"max_position_embeddings":4096,
    "rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":true}"#;

const BLOCK: usize = 16;

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    let cfg = ModelConfig::from_json_str(SMOL).expect("config");
    let mut model = CpuModel::try_new(cfg.clone(), LlamaWeights::dummy(&cfg, 1)).expect("model");
    let threads = std::env::var("BATON_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    model.set_threads(threads).expect("threads");
    let ctx: usize = 128;
    let max_batch = 64;
    let pages_per_seq = (ctx + 1).div_ceil(BLOCK);
    let mut kv = PagedKvCache::new(&cfg, max_batch * pages_per_seq + 32, BLOCK);
    let tables: Vec<Vec<u32>> = (0..max_batch)
        .map(|s| ((s * pages_per_seq) as u32..((s + 1) * pages_per_seq) as u32).collect())
        .collect();
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| (i * 7919 + 13) % 49152).collect();
    // Every sequence's first `ctx` positions in the cache.
    for table in &tables {
        let row = ForwardRow {
            tokens: &prompt,
            start_pos: 0,
            block_table: table,
            want_logits: false,
            all_logits: false,
            lora: 0,
        };
        model.forward(&mut kv, &[row]).expect("prefill");
    }
    let mut g = c.benchmark_group("cpu_forward");
    let step = [42u32];
    for batch in [1usize, 16, 64] {
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::new("decode", batch), &batch, |b, &batch| {
            b.iter(|| {
                // Position `ctx` of each sequence, rewritten every iteration.
                let rows: Vec<ForwardRow> = tables[..batch]
                    .iter()
                    .map(|t| ForwardRow {
                        tokens: &step,
                        start_pos: ctx,
                        block_table: t,
                        want_logits: true,
                        all_logits: false,
                        lora: 0,
                    })
                    .collect();
                model.forward(&mut kv, &rows).expect("decode")
            })
        });
    }
    let long: Vec<u32> = (0..256u32).map(|i| (i * 104_729 + 5) % 49152).collect();
    let table: Vec<u32> =
        ((max_batch * pages_per_seq) as u32..(max_batch * pages_per_seq + 16) as u32).collect();
    g.throughput(Throughput::Elements(long.len() as u64));
    g.bench_function("prefill/256", |b| {
        b.iter(|| {
            let row = ForwardRow {
                tokens: &long,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                all_logits: false,
                lora: 0,
            };
            model.forward(&mut kv, &[row]).expect("prefill")
        })
    });
    g.finish();

    // Long contexts: decode at position 2048 (attention reads 2048 positions per layer),
    // over an f32 and a bf16 KV cache (`--kv-cache-dtype`).
    drop(kv);
    let long_ctx: usize = 2048;
    let long_batch = 4;
    let long_pages = (long_ctx + 1).div_ceil(BLOCK);
    let long_tables: Vec<Vec<u32>> = (0..long_batch)
        .map(|s| ((s * long_pages) as u32..((s + 1) * long_pages) as u32).collect())
        .collect();
    let long_prompt: Vec<u32> = (0..long_ctx as u32)
        .map(|i| (i * 7919 + 3) % 49152)
        .collect();
    let mut g = c.benchmark_group("cpu_forward_ctx2048");
    for dtype in [DType::F32, DType::BF16] {
        let mut kv =
            PagedKvCache::try_with_dtype(&cfg, long_batch * long_pages, BLOCK, dtype).unwrap();
        for table in &long_tables {
            let row = ForwardRow {
                tokens: &long_prompt,
                start_pos: 0,
                block_table: table,
                want_logits: false,
                all_logits: false,
                lora: 0,
            };
            model.forward(&mut kv, &[row]).expect("prefill");
        }
        // The last 256 prompt tokens again, as a prefill chunk: each attends to 1793..2048
        // positions (a long prompt's later chunks; `--max-num-batched-tokens` chunking).
        let tail = long_ctx - 256;
        g.throughput(Throughput::Elements(256));
        let id = format!("prefill_tail256_kv_{dtype:?}").to_lowercase();
        g.bench_function(id, |b| {
            b.iter(|| {
                let row = ForwardRow {
                    tokens: &long_prompt[tail..],
                    start_pos: tail,
                    block_table: &long_tables[0],
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                };
                model.forward(&mut kv, &[row]).expect("prefill")
            })
        });
        for batch in [1usize, long_batch] {
            g.throughput(Throughput::Elements(batch as u64));
            let id = BenchmarkId::new(format!("decode_kv_{dtype:?}").to_lowercase(), batch);
            g.bench_with_input(id, &batch, |b, &batch| {
                b.iter(|| {
                    let rows: Vec<ForwardRow> = long_tables[..batch]
                        .iter()
                        .map(|t| ForwardRow {
                            tokens: &step,
                            start_pos: long_ctx,
                            block_table: t,
                            want_logits: true,
                            all_logits: false,
                            lora: 0,
                        })
                        .collect();
                    model.forward(&mut kv, &rows).expect("decode")
                })
            });
        }
    }
    g.finish();
    c.final_summary();
}
