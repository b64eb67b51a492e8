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

/// Writes a GGUF value (types as [`baton_model::gguf::GgufValue`]).
pub fn put_value(b: &mut Vec<u8>, v: &baton_model::gguf::GgufValue) {
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    match v {
        baton_model::gguf::GgufValue::U8(x) => b.push(*x),
        baton_model::gguf::GgufValue::I8(x) => b.push(*x as u8),
        baton_model::gguf::GgufValue::U16(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::I16(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::U32(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::I32(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::F32(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::Bool(x) => b.push(*x as u8),
        baton_model::gguf::GgufValue::Str(x) => s(b, x),
        baton_model::gguf::GgufValue::Array(a) => {
            b.extend(a.first().map_or(4, type_id).to_le_bytes());
            b.extend((a.len() as u64).to_le_bytes());
            for x in a {
                put_value(b, x);
            }
        }
        baton_model::gguf::GgufValue::U64(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::I64(x) => b.extend(x.to_le_bytes()),
        baton_model::gguf::GgufValue::F64(x) => b.extend(x.to_le_bytes()),
    }
}

pub fn type_id(v: &baton_model::gguf::GgufValue) -> u32 {
    match v {
        baton_model::gguf::GgufValue::U8(_) => 0,
        baton_model::gguf::GgufValue::I8(_) => 1,
        baton_model::gguf::GgufValue::U16(_) => 2,
        baton_model::gguf::GgufValue::I16(_) => 3,
        baton_model::gguf::GgufValue::U32(_) => 4,
        baton_model::gguf::GgufValue::I32(_) => 5,
        baton_model::gguf::GgufValue::F32(_) => 6,
        baton_model::gguf::GgufValue::Bool(_) => 7,
        baton_model::gguf::GgufValue::Str(_) => 8,
        baton_model::gguf::GgufValue::Array(_) => 9,
        baton_model::gguf::GgufValue::U64(_) => 10,
        baton_model::gguf::GgufValue::I64(_) => 11,
        baton_model::gguf::GgufValue::F64(_) => 12,
    }
}

/// ggml's `quantize_row_q8_0_ref`: per 32 values, d = max|x| / 127 (stored f16),
/// q = round(x / d).
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}

/// ggml's type id of Q8_0.
pub const Q8_0: u32 = 8;

/// ggml's type id of Q4_0.
pub const Q4_0: u32 = 2;

/// The value of `blk` with the largest magnitude, signed (the first of equals; 0 when empty):
/// the scale reference of ggml's symmetric 4-bit quantizers.
fn largest_magnitude(blk: &[f32]) -> f32 {
    blk.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// ggml's `quantize_row_q4_0_ref`: per 32 values, `d = max / -8` with `max` the value of
/// largest magnitude (stored f16), `q = min(15, trunc(x / d + 8.5))`, element `j` in the low
/// nibble of byte `j` and element `j + 16` in its high nibble.
pub fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks_exact(32) {
        let max = largest_magnitude(blk);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
    }
    out
}

/// ggml's type id of IQ4_NL.
pub const IQ4_NL: u32 = 20;

/// IQ4_NL's 16 levels (ggml's `kvalues_iq4nl`).
const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// IQ4_NL blocks of `x`, by nearest level: per 32 values, `d = max / -127` with `max` the value
/// of largest magnitude (stored f16), each value the index of the level nearest `x / d`, laid
/// out as Q4_0's nibbles. (ggml's `quantize_row_iq4_nl_ref` also searches nearby scales; any
/// valid blocks serve the tests, which compare against the blocks' dequantized values.)
pub fn quantize_iq4_nl(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks_exact(32) {
        let max = largest_magnitude(blk);
        let d = half::f16::from_f32(max / -127.0);
        let id = if d.to_f32() != 0.0 {
            1.0 / d.to_f32()
        } else {
            0.0
        };
        out.extend(d.to_le_bytes());
        let q = |v: f32| {
            let t = v * id;
            (0..16u8)
                .min_by(|&a, &b| {
                    let e = |i: u8| (f32::from(IQ4_LEVELS[usize::from(i)]) - t).abs();
                    e(a).total_cmp(&e(b))
                })
                .unwrap_or(0)
        };
        out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
    }
    out
}

/// `x` quantized as ggml type `ty` (Q8_0, Q4_0 or IQ4_NL) by ggml's reference quantizers
/// (IQ4_NL's by nearest level, [`quantize_iq4_nl`]).
pub fn quantize(ty: u32, x: &[f32]) -> Vec<u8> {
    match ty {
        Q8_0 => quantize_q8_0(x),
        Q4_0 => quantize_q4_0(x),
        IQ4_NL => quantize_iq4_nl(x),
        _ => panic!("type {ty}"),
    }
}

/// `x` quantized as ggml type `ty` (Q8_0, Q4_0 or IQ4_NL) and dequantized again (ggml's values).
pub fn round_trip(ty: u32, x: &[f32]) -> Vec<f32> {
    let t = baton_model::gguf_quant::GgmlType::from_u32(ty).expect("a ggml type");
    let mut out = vec![0f32; x.len()];
    t.dequantize(&quantize(ty, x), &mut out)
        .expect("whole blocks");
    out
}

/// The GGUF file `from` written to `to` with every F32 tensor of two or more dimensions
/// whose rows are whole blocks of 32 stored as the type `ty_of` gives its llama.cpp name
/// (Q8_0, Q4_0 or IQ4_NL; llama.cpp's quantizer also leaves the others F32), or with `round_trip` as
/// F32 holding the values those blocks dequantize to.
pub fn write_quantized(
    from: &std::path::Path,
    to: &std::path::Path,
    round_trip: bool,
    ty_of: impl Fn(&str) -> u32,
) {
    let from = baton_model::gguf::GgufFile::open(from).expect("open gguf");
    let mut tensors = Vec::new();
    for t in &from.tensors {
        let bytes = from.tensor_bytes(t).unwrap();
        let blocks = t.dims.len() >= 2 && t.dims[0].is_multiple_of(32) && t.ggml_type == 0;
        let (ty, stored) = match (blocks, round_trip) {
            (false, _) => (t.ggml_type, bytes.to_vec()),
            (true, false) => (ty_of(&t.name), quantize(ty_of(&t.name), &f32s(bytes))),
            (true, true) => {
                let v = self::round_trip(ty_of(&t.name), &f32s(bytes));
                (0, v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
        };
        tensors.push((t.name.clone(), t.dims.clone(), ty, stored));
    }
    let metadata: Vec<_> = from
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    write_gguf(to, &metadata, &tensors);
}

/// Little-endian f32 bytes as values.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A tensor to write into a GGUF file: (llama.cpp's name, ggml dims (innermost first, as the
/// file stores them), ggml type id, data bytes).
pub type GgufTensor = (String, Vec<u64>, u32, Vec<u8>);

/// Writes a GGUF version 3 file at `path`: `metadata` in order, then the tensors' directory
/// and their data, each tensor 32-byte aligned (llama.cpp's default alignment).
pub fn write_gguf(
    path: &std::path::Path,
    metadata: &[(String, baton_model::gguf::GgufValue)],
    tensors: &[GgufTensor],
) {
    use baton_model::gguf::GgufValue;
    let mut data = Vec::new();
    let mut offsets = Vec::new();
    for t in tensors {
        while !data.len().is_multiple_of(32) {
            data.push(0);
        }
        offsets.push(data.len() as u64);
        data.extend(&t.3);
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_value(&mut b, &GgufValue::Str(k.clone()));
        b.extend(type_id(v).to_le_bytes());
        put_value(&mut b, v);
    }
    for ((name, dims, ty, _), off) in tensors.iter().zip(offsets) {
        put_value(&mut b, &GgufValue::Str(name.clone()));
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(off.to_le_bytes());
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(data);
    std::fs::write(path, b).unwrap();
}

/// Prepares the GGUF `file` under `cache` ([`baton_model::gguf::prepare_dir`], whose
/// tokenizer must convert) and opens its directory's config and weights.
pub fn open_prepared(
    file: &std::path::Path,
    cache: &std::path::Path,
) -> (baton_model::ModelConfig, baton_model::WeightSource) {
    let p = baton_model::gguf::prepare_dir(file, cache).expect("prepare");
    assert!(p.tokenizer_error.is_none(), "{:?}", p.tokenizer_error);
    let cfg = baton_model::ModelConfig::from_file(&p.dir.join("config.json")).expect("config.json");
    let src = baton_model::WeightSource::open_for(&p.dir, &cfg).expect("weights");
    (cfg, src)
}

/// `ours` serves exactly `theirs`' tensors: the same names, shapes and bytes.
pub fn assert_same_tensors(
    ours: &baton_model::WeightSource,
    theirs: &baton_model::WeightSource,
    what: &str,
) {
    let names: Vec<_> = theirs.tensor_names().collect();
    assert_eq!(
        ours.tensor_names().collect::<Vec<_>>(),
        names,
        "{what}: the same tensor names"
    );
    for n in names {
        let (a, b) = (theirs.get(n).unwrap(), ours.get(n).unwrap());
        assert_eq!(a.shape, b.shape, "{what}: {n}");
        assert!(a.bytes == b.bytes, "{what}: {n} differs");
    }
}
