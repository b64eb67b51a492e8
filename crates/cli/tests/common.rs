//! Helpers shared by the engine tests: the test model and its golden outputs.
#![allow(dead_code)]

use baton::engine::LocalEngine;
use baton_model::{load_model_dir, Tokenizer};
use baton_proto::SamplingParams;
use baton_scheduler::{Event, FinishReason, NewRequest, SchedulerConfig};
use baton_worker::CpuBackend;
use std::collections::HashMap;
use std::path::PathBuf;

/// The model directory: `BATON_TEST_MODEL`, or the shared stories260K.
pub fn model_dir() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
        })
}

/// One golden prompt.
#[derive(Clone, Debug)]
pub struct Golden {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
    pub top5: Vec<(u32, f32)>,
}

/// Reads golden.json.
pub fn goldens() -> Vec<Golden> {
    let text = std::fs::read_to_string(model_dir().join("golden.json")).expect("golden.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("golden.json parses");
    let ids = |x: &serde_json::Value| {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    };
    v["prompts"]
        .as_array()
        .expect("prompts array")
        .iter()
        .map(|p| Golden {
            prompt: p["prompt"].as_str().unwrap().to_owned(),
            prompt_ids: ids(&p["prompt_ids"]),
            greedy_ids: ids(&p["greedy_ids"]),
            greedy_text: p["greedy_text"].as_str().unwrap().to_owned(),
            top5: p["first_step_top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
                .collect(),
        })
        .collect()
}

/// A scheduler configuration for tests.
pub fn config(block_size: usize, num_blocks: usize, max_inflight: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        block_size,
        num_blocks,
        max_model_len: 512,
        max_inflight,
    }
}

/// An engine on the test model.
pub fn engine(cfg: SchedulerConfig) -> (LocalEngine<CpuBackend>, Tokenizer) {
    let loaded = load_model_dir(model_dir()).expect("test model loads");
    let (model, tok) = loaded.into_cpu_model();
    let backend = CpuBackend::new(model, cfg.num_blocks, cfg.block_size);
    (LocalEngine::new(cfg, backend), tok.expect("tokenizer"))
}

/// A request.
pub fn request(id: u64, prompt: Vec<u32>, max_tokens: u32, params: SamplingParams) -> NewRequest {
    NewRequest {
        id,
        prompt,
        max_tokens,
        params,
        eos_ids: vec![2],
        stop_token_ids: Vec::new(),
        ignore_eos: false,
    }
}

/// Runs every request to the end; returns each request's tokens and finish reason.
pub fn run(
    engine: &mut LocalEngine<CpuBackend>,
    reqs: Vec<NewRequest>,
) -> HashMap<u64, (Vec<u32>, FinishReason)> {
    for r in reqs {
        engine.add_request(r).expect("admitted");
    }
    let mut events = Vec::new();
    engine.run_until_idle(&mut events).expect("runs");
    collect(events)
}

/// Groups events by request.
pub fn collect(events: Vec<Event>) -> HashMap<u64, (Vec<u32>, FinishReason)> {
    let mut out: HashMap<u64, (Vec<u32>, FinishReason)> = HashMap::new();
    for e in events {
        match e {
            Event::Token { id, token, .. } => out
                .entry(id)
                .or_insert((Vec::new(), FinishReason::Abort))
                .0
                .push(token),
            Event::Finished { id, reason, .. } => {
                let e = out.entry(id).or_insert((Vec::new(), FinishReason::Abort));
                assert_eq!(e.1, FinishReason::Abort, "request {id} finished twice");
                e.1 = reason;
            }
        }
    }
    out
}

/// Asserts the pool and the slots are all back.
pub fn assert_pool_full(engine: &LocalEngine<CpuBackend>) {
    let s = engine.stats();
    assert_eq!(s.pool.free, s.pool.total, "pool not back to full: {s:?}");
    assert_eq!(s.slots_retired, 0, "slots still retired: {s:?}");
    assert_eq!((s.running, s.waiting, s.inflight), (0, 0, 0), "{s:?}");
}

/// Prompts of mixed lengths (token ids), deterministic.
pub fn filler_prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7) % 40;
            let mut p = vec![1u32];
            p.extend((0..len).map(|j| 3 + ((i * 31 + j * 17) % 500) as u32));
            p
        })
        .collect()
}
