//! GGUF weights (llama.cpp's format): stories260K converted by llama.cpp's
//! `convert_hf_to_gguf.py --outtype f32` serves the Hugging Face checkpoint's tensors bit for
//! bit (names mapped, q/k rows un-permuted) and reproduces golden.json; a Q8_0 file written
//! here from those tensors dequantizes within half a quantization step and still predicts
//! golden.json's first token.

mod common;

use baton_model::gguf::{self, GgufFile};
use baton_model::{CpuModel, ModelConfig, WeightSource};
use common::*;
use std::path::PathBuf;

fn gguf_file() -> PathBuf {
    match std::env::var_os("BATON_TEST_MODEL_GGUF") {
        Some(p) => PathBuf::from(p),
        None => model_dir().join("../stories260K-gguf/stories260K-f32.gguf"),
    }
}

#[test]
fn the_f32_gguf_serves_the_checkpoints_tensors_bit_for_bit_and_golden_json() {
    let tmp = temp_dir("gguf-f32");
    let (cfg, src) = open_prepared(&gguf_file(), &tmp);
    let hf_cfg = ModelConfig::from_file(&model_dir().join("config.json")).unwrap();
    let hf = WeightSource::open_for(&model_dir(), &hf_cfg).unwrap();
    assert_same_tensors(&src, &hf, "stories260K");
    src.check_tensor_names(&cfg).unwrap();
    let mut model = CpuModel::from_source(cfg, &src).unwrap();
    // The CLI's default: no matrix of an f32 file takes 8-bit activations, so golden.json
    // holds with it.
    assert_eq!(model.set_int8_activations(true), 0);
    let g = golden();
    for p in &g.prompts {
        let pages: Vec<u32> = (0..8).collect();
        let (ids, _) = greedy_alone(&model, &p.prompt_ids, p.greedy_ids.len(), 16, &pages, 8);
        assert_eq!(ids, p.greedy_ids, "{:?}", p.prompt);
    }
}

#[test]
fn a_q8_0_gguf_dequantizes_within_half_a_step_and_predicts_the_first_golden_token() {
    let tmp = temp_dir("gguf-q8");
    let file = tmp.join("stories260K-Q8_0.gguf");
    write_quantized(&gguf_file(), &file, false, |_| Q8_0);
    let q = GgufFile::open(&file).unwrap();
    let quantized = q.tensors.iter().filter(|t| t.ggml_type == Q8_0).count();
    assert!(quantized >= 20, "{quantized} tensors quantized");
    let (cfg, src) = open_prepared(&file, &tmp.join("cache"));
    assert_eq!(cfg.torch_dtype.as_deref(), Some("float16"));
    let hf_cfg = ModelConfig::from_file(&model_dir().join("config.json")).unwrap();
    let hf = WeightSource::open_for(&model_dir(), &hf_cfg).unwrap();
    let mut checked = 0;
    for n in hf.tensor_names() {
        let want = hf.get(n).unwrap().to_f32();
        let got = src.get(n).unwrap();
        assert_eq!(got.shape, &want.shape[..], "{n}");
        let got = got.to_f32();
        // Per block of 32 along a row: |x - d·q| <= d/2 with d = max|x|/127, plus the f16
        // rounding of d and of the served value.
        for (bw, bg) in want.data.chunks(32).zip(got.data.chunks(32)) {
            let d = bw.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (w, g) in bw.iter().zip(bg) {
                assert!(
                    (w - g).abs() <= 0.5 * d + 2e-3 * w.abs() + 1e-6,
                    "{n}: {w} served as {g} (d {d})"
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, hf.tensor_names().count());
    let model = CpuModel::from_source(cfg, &src).unwrap();
    let g = golden();
    let p = &g.prompts[0];
    let logits = prompt_logits(&model, &p.prompt_ids);
    assert_eq!(argmax(&logits), p.greedy_ids[0]);
}

#[test]
fn processes_preparing_one_file_at_once_share_one_complete_directory() {
    let tmp = temp_dir("gguf-race");
    let cache = tmp.join("cache");
    let dirs: Vec<PathBuf> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    gguf::prepare_dir(&gguf_file(), &cache)
                        .expect("prepare")
                        .dir
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(dirs.windows(2).all(|w| w[0] == w[1]), "{dirs:?}");
    let entries: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        entries.len(),
        1,
        "no temporary directories left: {entries:?}"
    );
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.gguf",
    ] {
        assert!(dirs[0].join(f).exists(), "{f}");
    }
    // Another file version (here: another modification time) gets its own directory.
    let copy = tmp.join("copy.gguf");
    std::fs::copy(gguf_file(), &copy).unwrap();
    let a = gguf::prepare_dir(&copy, &cache).unwrap().dir;
    let f = std::fs::File::options().write(true).open(&copy).unwrap();
    f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1))
        .unwrap();
    drop(f);
    let b = gguf::prepare_dir(&copy, &cache).unwrap().dir;
    assert_ne!(a, b);
    // The earlier version's directory is gone; the other file's stays.
    assert!(!a.exists() && b.join("config.json").is_file());
    assert!(dirs[0].join("config.json").is_file());
    // So is a directory whose file was deleted, once another is made.
    let gone = tmp.join("gone.gguf");
    std::fs::copy(gguf_file(), &gone).unwrap();
    let c = gguf::prepare_dir(&gone, &cache).unwrap().dir;
    std::fs::remove_file(&gone).unwrap();
    assert!(c.exists());
    let f = std::fs::File::options().write(true).open(&copy).unwrap();
    f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(2))
        .unwrap();
    drop(f);
    let d = gguf::prepare_dir(&copy, &cache).unwrap().dir;
    assert!(!c.exists() && !b.exists() && d.exists());
    assert!(dirs[0].join("config.json").is_file());
}

#[test]
fn a_files_recommended_sampling_and_end_of_turn_token_become_generation_config_json() {
    use baton_model::gguf::GgufValue;
    let tmp = temp_dir("gguf-sampling");
    let from = GgufFile::open(&gguf_file()).unwrap();
    let tensors: Vec<GgufTensor> = from
        .tensors
        .iter()
        .map(|t| {
            let b = from.tensor_bytes(t).unwrap().to_vec();
            (t.name.clone(), t.dims.clone(), t.ggml_type, b)
        })
        .collect();
    let with = |extra: &[(&str, GgufValue)], file: &str| {
        let mut meta: Vec<_> = from
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        meta.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let path = tmp.join(file);
        write_gguf(&path, &meta, &tensors);
        path
    };
    let file = with(
        &[
            ("general.sampling.temp", GgufValue::F32(0.6)),
            ("general.sampling.top_k", GgufValue::I32(20)),
            ("general.sampling.top_p", GgufValue::F32(0.95)),
            ("general.sampling.min_p", GgufValue::F32(0.0)),
            ("general.sampling.penalty_repeat", GgufValue::F32(1.1)),
            ("tokenizer.ggml.eot_token_id", GgufValue::U32(7)),
        ],
        "sampling.gguf",
    );
    let p = gguf::prepare_dir(&file, &tmp.join("cache")).unwrap();
    let g =
        baton_model::GenerationConfig::from_file(&p.dir.join("generation_config.json")).unwrap();
    assert_eq!(g.temperature, Some(0.6));
    assert_eq!(g.top_k, Some(20));
    assert_eq!(g.top_p, Some(0.95));
    assert_eq!(g.min_p, Some(0.0));
    assert_eq!(
        g.repetition_penalty, None,
        "llama.cpp's penalty is over a window"
    );
    assert_eq!(
        g.eos_token_ids,
        vec![2, 7],
        "EOS, then the end-of-turn token"
    );
    // A file without them gets none; a malformed one is refused, naming the key.
    let plain = gguf::prepare_dir(&gguf_file(), &tmp.join("cache")).unwrap();
    assert!(!plain.dir.join("generation_config.json").exists());
    let bad = with(
        &[("general.sampling.top_k", GgufValue::I32(-5))],
        "bad.gguf",
    );
    let e = gguf::prepare_dir(&bad, &tmp.join("cache"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("general.sampling.top_k"), "{e}");
    // Metadata that makes a config.json Baton refuses is refused here, naming the file.
    let mut meta: Vec<_> = from
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != "llama.attention.head_count_kv")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.push(("llama.attention.head_count_kv".into(), GgufValue::U32(3)));
    let odd = tmp.join("odd-kv-heads.gguf");
    write_gguf(&odd, &meta, &tensors);
    let e = gguf::prepare_dir(&odd, &tmp.join("cache"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("odd-kv-heads.gguf (its metadata") && e.contains("num_key_value_heads"),
        "{e}"
    );
}

/// The type of each matrix in the mixed-type test files: Q4_0 for every k projection, IQ4_NL
/// for every v projection (so the fused q/k/v mixes three types), Q8_0 for the rest.
fn mixed_type(name: &str) -> u32 {
    if name.ends_with("attn_k.weight") {
        Q4_0
    } else if name.ends_with("attn_v.weight") {
        IQ4_NL
    } else {
        Q8_0
    }
}

/// The CPU backend keeps a quantized GGUF file's matrices in their blocks (Q8_0, Q4_0 for every
/// k projection and IQ4_NL for every v projection, so the fused q/k/v mixes three types) and
/// computes with ggml's dequantized
/// values: its logits are bit for bit those of a checkpoint holding each matrix quantized and
/// dequantized in Hugging Face's layout (q/k rows un-permuted, the tied embedding), and it
/// holds fewer bytes than the f32 model.
#[test]
fn a_quantized_gguf_runs_on_the_cpu_in_its_blocks_with_ggmls_values() {
    let tmp = temp_dir("gguf-kept");
    let file = tmp.join("stories260K-Q8_0-Q4_0-IQ4_NL.gguf");
    write_quantized(&gguf_file(), &file, false, mixed_type);
    let (cfg, src) = open_prepared(&file, &tmp.join("cache"));
    let model = CpuModel::from_source(cfg, &src).unwrap();

    // The same values in Hugging Face's layout, quantized row by row here.
    let expected: Vec<OwnedTensor> = stories_tensors()
        .into_iter()
        .map(|(n, d, shape, bytes)| {
            if shape.len() != 2 || !shape[1].is_multiple_of(32) {
                return (n, d, shape, bytes);
            }
            let ty = if n.ends_with("k_proj.weight") {
                Q4_0
            } else if n.ends_with("v_proj.weight") {
                IQ4_NL
            } else {
                Q8_0
            };
            let values = round_trip(ty, &f32s(&bytes));
            (
                n,
                d,
                shape,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let dir = fake_dir("gguf-kept-expected");
    write_safetensors(&dir, "model.safetensors", &expected);
    let hf_cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let dense = CpuModel::from_source(
        hf_cfg.clone(),
        &WeightSource::open_for(&dir, &hf_cfg).unwrap(),
    )
    .unwrap();
    let f32_model =
        CpuModel::from_source(hf_cfg, &WeightSource::open(&model_dir()).unwrap()).unwrap();

    let g = golden();
    for p in &g.prompts {
        let (a, b) = (
            prompt_logits(&model, &p.prompt_ids),
            prompt_logits(&dense, &p.prompt_ids),
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&a) == bits(&b), "{:?}", p.prompt);
    }
    // Q8_0 is 34 bytes a block of 32 against 128 for f32 (Q4_0: 18): the matrices of 64
    // columns shrink; the f32 down projections and norms do not.
    assert!(
        model.weight_bytes() * 2 < f32_model.weight_bytes(),
        "{} bytes quantized, {} f32",
        model.weight_bytes(),
        f32_model.weight_bytes()
    );
}

/// With 8-bit activations (`set_int8_activations`, llama.cpp's scheme) the same quantized
/// file's logits move (the mode is wired through every projection) but stay within a few
/// percent of the f32-activation logits, and a row's logits do not depend on its batchmates.
#[test]
fn int8_activations_stay_close_to_f32_activations_and_batch_invariant() {
    use baton_model::{ForwardRow, PagedKvCache};
    let tmp = temp_dir("gguf-int8");
    let file = tmp.join("stories260K-Q8_0-Q4_0-IQ4_NL.gguf");
    write_quantized(&gguf_file(), &file, false, mixed_type);
    let (cfg, src) = open_prepared(&file, &tmp.join("cache"));
    let exact = CpuModel::from_source(cfg.clone(), &src).unwrap();
    let mut int8 = CpuModel::from_source(cfg, &src).unwrap();
    let n = int8.set_int8_activations(true);
    assert!(
        n > 0,
        "no matrix of {} takes 8-bit activations",
        file.display()
    );
    let g = golden();
    let mut alone = Vec::new();
    for p in &g.prompts {
        let (a, b) = (
            prompt_logits(&exact, &p.prompt_ids),
            prompt_logits(&int8, &p.prompt_ids),
        );
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff > 0.0,
            "int8 activations changed nothing: {:?}",
            p.prompt
        );
        assert!(
            diff < 0.05 * scale,
            "{:?}: {diff} against {scale}",
            p.prompt
        );
        alone.push(b);
    }
    // Two prompts in one forward pass: each row's logits are its logits alone, bit for bit.
    let (p0, p1) = (&g.prompts[0].prompt_ids, &g.prompts[1].prompt_ids);
    let mut kv = PagedKvCache::new(int8.config(), 4, 16);
    let rows = [(p0, [0u32, 1]), (p1, [2, 3])];
    let rows: Vec<ForwardRow> = rows
        .iter()
        .map(|(tokens, table)| ForwardRow {
            tokens,
            start_pos: 0,
            block_table: table,
            want_logits: true,
            all_logits: false,
            lora: 0,
        })
        .collect();
    let both = int8.forward(&mut kv, &rows).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&both[0]) == bits(&alone[0]) && bits(&both[1]) == bits(&alone[1]));
}

/// A quantized block whose scale is NaN is refused, naming the tensor and the element (its
/// position in the file's tensor, also for a q projection, whose rows are served
/// un-permuted: GGUF row 1 is Hugging Face row 4 there), when the CPU backend keeps the
/// blocks (`CpuModel::from_source`), when the CUDA backend asks for the dequantized copy
/// (`WeightSource::get`) and when it is loaded as f32; no panic.
#[test]
fn a_quantized_value_that_is_not_finite_is_refused_by_either_backend() {
    let tmp = temp_dir("gguf-nan");
    let good = tmp.join("q8.gguf");
    write_quantized(&gguf_file(), &good, false, |_| Q8_0);
    for (gguf_name, name, shape) in [
        (
            "blk.2.ffn_up.weight",
            "model.layers.2.mlp.up_proj.weight",
            [172, 64],
        ),
        (
            "blk.2.attn_q.weight",
            "model.layers.2.self_attn.q_proj.weight",
            [64, 64],
        ),
    ] {
        let bad = tmp.join(format!("nan-{gguf_name}"));
        write_with_scale(&good, &bad, gguf_name, 0x7e00);
        let (cfg, src) = open_prepared(&bad, &tmp.join(format!("cache-{gguf_name}")));
        let cpu = CpuModel::from_source(cfg.clone(), &src)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        let cuda = src.get(name).map(|_| ()).unwrap_err().to_string();
        let f32s = src
            .load_f32(name, &shape)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        for e in [cpu, cuda, f32s] {
            assert!(
                e.contains(gguf_name) && e.contains("[1, 32]") && e.contains("NaN"),
                "{e}"
            );
            assert!(e.contains("corrupt"), "{e}");
        }
    }
    // The healthy file loads both ways.
    let (cfg, src) = open_prepared(&good, &tmp.join("cache"));
    src.get("model.layers.2.self_attn.q_proj.weight").unwrap();
    CpuModel::from_source(cfg, &src).unwrap();
}

/// `from` written to `to` with the scale of block 3 of tensor `name` (row 1's second Q8_0
/// block: 64 values a row, 34 bytes a block) set to the f16 bits `scale`.
fn write_with_scale(from: &std::path::Path, to: &std::path::Path, name: &str, scale: u16) {
    let g = GgufFile::open(from).unwrap();
    let tensors: Vec<GgufTensor> = g
        .tensors
        .iter()
        .map(|t| {
            let mut bytes = g.tensor_bytes(t).unwrap().to_vec();
            if t.name == name {
                bytes[3 * 34..3 * 34 + 2].copy_from_slice(&scale.to_le_bytes());
            }
            (t.name.clone(), t.dims.clone(), t.ggml_type, bytes)
        })
        .collect();
    let meta: Vec<_> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    write_gguf(to, &meta, &tensors);
}

/// A large but finite scale (60000: values past f16's range) is what ggml computes with in
/// f32: the CPU backend, which keeps the blocks, loads it after the load's checks
/// (`check_llama`, which reads shapes only); only the 16-bit copy the CUDA backend uploads
/// refuses it.
#[test]
fn a_large_finite_scale_loads_on_the_cpu_and_is_refused_only_in_16_bits() {
    let tmp = temp_dir("gguf-big-scale");
    let good = tmp.join("q8.gguf");
    write_quantized(&gguf_file(), &good, false, |_| Q8_0);
    let big = tmp.join("big.gguf");
    write_with_scale(
        &good,
        &big,
        "blk.2.ffn_up.weight",
        half::f16::from_f32(60000.0).to_bits(),
    );
    let (cfg, src) = open_prepared(&big, &tmp.join("cache"));
    src.check_llama(&cfg).unwrap();
    CpuModel::from_source(cfg, &src).unwrap();
    let e = src
        .get("model.layers.2.mlp.up_proj.weight")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("F16 cannot hold") && e.contains("[1, 32]"),
        "{e}"
    );
}
