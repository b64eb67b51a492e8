//! Shared helpers for the integration tests: locating the stories260K test model, reading
//! golden.json, greedy decoding over `CpuModel::forward`, and scratch directories.
#![allow(dead_code)]

use baton_model::{CpuModel, ForwardRow, PagedKvCache};
use std::path::PathBuf;

/// `BATON_TEST_MODEL`, or `/work/shared/models/stories260K` relative to this crate.
pub fn model_dir() -> PathBuf {
    match std::env::var_os("BATON_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
        }
    }
}

pub struct GoldenPrompt {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
    pub first_step_top5: Vec<(u32, f32)>,
}

pub struct Golden {
    pub prompts: Vec<GoldenPrompt>,
    /// (text, ids with BOS)
    pub encode_checks: Vec<(String, Vec<u32>)>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn golden() -> Golden {
    let text = std::fs::read_to_string(model_dir().join("golden.json")).expect("golden.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("golden.json parses");
    let prompts = v["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| GoldenPrompt {
            prompt: p["prompt"].as_str().unwrap().to_string(),
            prompt_ids: ids(&p["prompt_ids"]),
            greedy_ids: ids(&p["greedy_ids"]),
            greedy_text: p["greedy_text"].as_str().unwrap().to_string(),
            first_step_top5: p["first_step_top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
                .collect(),
        })
        .collect();
    let encode_checks = v["encode_checks"]
        .as_array()
        .expect("encode_checks")
        .iter()
        .map(|c| (c["text"].as_str().unwrap().to_string(), ids(&c["ids"])))
        .collect();
    Golden {
        prompts,
        encode_checks,
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of one sequence alone: one prefill row with the whole prompt, then one
/// single-token decode row per step. Pages are `pages` (in position order). Returns the
/// generated ids and the logits of every step.
pub fn greedy_alone(
    model: &CpuModel,
    prompt: &[u32],
    n_new: usize,
    block_size: usize,
    pages: &[u32],
    num_blocks: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut kv = PagedKvCache::new(model.config(), num_blocks, block_size);
    let mut out = Vec::new();
    let mut all_logits = Vec::new();
    let mut logits = model
        .forward(
            &mut kv,
            &[ForwardRow {
                tokens: prompt,
                start_pos: 0,
                block_table: pages,
                want_logits: true,
                all_logits: false,
                lora: 0,
            }],
        )
        .expect("prefill")
        .remove(0);
    for step in 0..n_new {
        let next = argmax(&logits);
        out.push(next);
        all_logits.push(logits);
        if step + 1 == n_new {
            break;
        }
        logits = model
            .forward(
                &mut kv,
                &[ForwardRow {
                    tokens: &[next],
                    start_pos: prompt.len() + step,
                    block_table: pages,
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                }],
            )
            .expect("decode")
            .remove(0);
    }
    (out, all_logits)
}

/// A scratch directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TempDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh, empty scratch directory under the system temp dir.
pub fn temp_dir(tag: &str) -> TempDir {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let p = std::env::temp_dir().join(format!(
        "baton-model-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("create temp dir");
    TempDir(p)
}

/// A stored tensor, owned: (name, dtype, shape, little-endian bytes).
pub type OwnedTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// All tensors of stories260K's model.safetensors, in name order.
pub fn stories_tensors() -> Vec<OwnedTensor> {
    let src = baton_model::WeightSource::open(&model_dir()).expect("open weights");
    src.tensor_names()
        .map(|n| {
            let t = src.get(n).unwrap();
            assert_eq!(t.dtype, baton_model::DType::F32);
            (
                n.to_string(),
                safetensors::Dtype::F32,
                t.shape.to_vec(),
                t.bytes.to_vec(),
            )
        })
        .collect()
}

/// Writes `tensors` as a safetensors file `dir/file`.
pub fn write_safetensors(dir: &std::path::Path, file: &str, tensors: &[OwnedTensor]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("valid view"),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None).expect("serialize");
    std::fs::write(dir.join(file), bytes).expect("write safetensors");
}

/// The shard files [`write_two_shards`] writes.
pub const TWO_SHARDS: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];

/// Writes `tensors` as a sharded checkpoint in `dir`: the first half in [`TWO_SHARDS`]`[0]`,
/// the rest in `[1]`, and `model.safetensors.index.json` mapping each to its shard.
pub fn write_two_shards(dir: &std::path::Path, tensors: &[OwnedTensor]) {
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let mut map = serde_json::Map::new();
    for (shard, part) in TWO_SHARDS.iter().zip([a, b]) {
        write_safetensors(dir, shard, part);
        for t in part {
            map.insert(t.0.clone(), (*shard).into());
        }
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": map }).to_string(),
    )
    .expect("write index");
}

/// A temp copy of stories260K's JSON files (config, generation config, tokenizer) without
/// weights.
pub fn fake_dir(tag: &str) -> TempDir {
    let d = temp_dir(tag);
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(model_dir().join(f), d.join(f)).expect("copy json");
    }
    d
}

/// Edits `dir/config.json` as a JSON object.
pub fn edit_config(
    dir: &std::path::Path,
    f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Logits of the first golden prompt's prefill.
pub fn prompt_logits(model: &CpuModel, prompt: &[u32]) -> Vec<f32> {
    let mut kv = PagedKvCache::new(model.config(), 2, 16);
    model
        .forward(
            &mut kv,
            &[ForwardRow {
                tokens: prompt,
                start_pos: 0,
                block_table: &[0, 1],
                want_logits: true,
                all_logits: false,
                lora: 0,
            }],
        )
        .expect("forward")
        .remove(0)
}
