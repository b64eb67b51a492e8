//! LoRA adapters on the CPU forward pass: a row served with an adapter computes what the
//! checkpoint with the adapter merged into its weights (`W + s·B·A`, PEFT's
//! `merge_and_unload`) computes, rows without one are untouched, and bad adapters are refused.

mod common;

use baton_model::lora::{
    dummy_lora_values, dummy_module_shape, write_dummy_adapter, LoraAdapter, LoraModule,
    DUMMY_TARGETS,
};
use baton_model::{load_model_dir, CpuModel, ForwardError, ForwardRow, ModelError, PagedKvCache};
use common::{model_dir, stories_tensors, temp_dir, write_safetensors};

const RANK: usize = 4;
const ALPHA: f64 = 8.0;
const AMP: f32 = 0.25;
const SEED: u64 = 7;

fn base() -> CpuModel {
    load_model_dir(model_dir())
        .expect("loads")
        .into_cpu_model()
        .0
}

/// stories260K with the dummy adapter merged: `W += (alpha / r)·B·A` (f64 sums).
fn merged_dir() -> common::TempDir {
    let d = common::fake_dir("lora-merged");
    let cfg = load_model_dir(model_dir()).unwrap().config;
    let mut tensors = stories_tensors();
    let s = ALPHA / RANK as f64;
    for (name, _, shape, bytes) in &mut tensors {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            continue;
        };
        let (li, module) = rest.split_once('.').unwrap();
        let Some(module) = module.strip_suffix(".weight") else {
            continue;
        };
        if !DUMMY_TARGETS.contains(&module) {
            continue;
        }
        let (k, n) = dummy_module_shape(&cfg, module);
        assert_eq!(shape, &vec![n, k], "{name}");
        let (a, b) = dummy_lora_values(SEED, li.parse().unwrap(), module, RANK, k, n, AMP);
        let mut w: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for i in 0..n {
            for j in 0..k {
                let d: f64 = (0..RANK)
                    .map(|r| b[i * RANK + r] as f64 * a[r * k + j] as f64)
                    .sum();
                w[i * k + j] = (w[i * k + j] as f64 + s * d) as f32;
            }
        }
        *bytes = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    }
    write_safetensors(&d, "model.safetensors", &tensors);
    d
}

fn adapter_dir() -> common::TempDir {
    let d = temp_dir("lora-adapter");
    let cfg = load_model_dir(model_dir()).unwrap().config;
    write_dummy_adapter(&d, &cfg, RANK, ALPHA, AMP, SEED).expect("write adapter");
    d
}

fn with_adapter(dir: &std::path::Path) -> CpuModel {
    let mut m = base();
    let module = LoraModule {
        name: "a".into(),
        path: dir.to_path_buf(),
    };
    let a = LoraAdapter::load(&module, m.config(), 16).expect("adapter loads");
    m.set_lora_adapters(vec![a]).unwrap();
    m
}

/// Logits of every position of `prompt` in one prefill row with adapter `lora`.
fn logits(m: &CpuModel, prompt: &[u32], lora: u32) -> Vec<Vec<f32>> {
    let mut kv = PagedKvCache::new(m.config(), 4, 16);
    m.forward(
        &mut kv,
        &[ForwardRow {
            tokens: prompt,
            start_pos: 0,
            block_table: &[0, 1, 2, 3],
            want_logits: true,
            all_logits: true,
            lora,
        }],
    )
    .expect("forward")
}

fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = b.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

const PROMPT: [u32; 12] = [1, 403, 407, 261, 378, 284, 268, 283, 390, 403, 433, 273];

#[test]
fn an_adapter_row_computes_the_merged_checkpoint() {
    let ad = adapter_dir();
    let merged_d = merged_dir();
    let lora = with_adapter(&ad);
    let merged = load_model_dir(&*merged_d)
        .expect("merged loads")
        .into_cpu_model()
        .0;
    let with = logits(&lora, &PROMPT, 1);
    let want = logits(&merged, &PROMPT, 0);
    let without = logits(&lora, &PROMPT, 0);
    let err = max_rel(&with, &want);
    assert!(err < 1e-4, "adapter vs merged: max relative error {err}");
    // The adapter changes the outputs well beyond that error, and id 0 is the base model
    // bit for bit.
    let moved = max_rel(&without, &want);
    assert!(
        moved > 1e-2,
        "the adapter hardly moves the logits ({moved})"
    );
    assert_eq!(without, logits(&base(), &PROMPT, 0));
}

#[test]
fn rows_with_and_without_the_adapter_share_a_batch_bit_exactly() {
    let ad = adapter_dir();
    let m = with_adapter(&ad);
    let alone: Vec<_> = [0, 1, 0]
        .iter()
        .map(|&l| logits(&m, &PROMPT, l).pop().unwrap())
        .collect();
    let mut kv = PagedKvCache::new(m.config(), 12, 16);
    let tables = [[0u32], [4], [8]];
    let rows: Vec<ForwardRow> = [0u32, 1, 0]
        .iter()
        .zip(&tables)
        .map(|(&lora, t)| ForwardRow {
            tokens: &PROMPT,
            start_pos: 0,
            block_table: t,
            want_logits: true,
            all_logits: false,
            lora,
        })
        .collect();
    let batch = m.forward(&mut kv, &rows).expect("batch");
    assert_eq!(batch, alone);
    assert_ne!(batch[0], batch[1]);
}

#[test]
fn rslora_scales_by_alpha_over_the_square_root_of_the_rank() {
    let cfg = load_model_dir(model_dir()).unwrap().config;
    let load = |rslora: bool| {
        let d = adapter_dir();
        edit_adapter_config(&d, |v| v["use_rslora"] = serde_json::json!(rslora));
        let m = LoraModule {
            name: "a".into(),
            path: d.to_path_buf(),
        };
        LoraAdapter::load(&m, &cfg, 16).unwrap()
    };
    let (plain, rs) = (load(false), load(true));
    let (p, r) = (&plain.layers[2][1][0], &rs.layers[2][1][0]);
    assert_eq!(p.a, r.a);
    // alpha / sqrt(4) = 2 · (alpha / 4).
    for (x, y) in p.b.iter().zip(&r.b) {
        assert_eq!(2.0 * x, *y);
    }
}

#[test]
fn an_unknown_adapter_id_is_an_error_not_a_panic() {
    let m = base();
    let mut kv = PagedKvCache::new(m.config(), 4, 16);
    let e = m
        .forward(
            &mut kv,
            &[ForwardRow {
                tokens: &PROMPT,
                start_pos: 0,
                block_table: &[0],
                want_logits: true,
                all_logits: false,
                lora: 1,
            }],
        )
        .unwrap_err();
    assert!(
        matches!(e, ForwardError::UnknownLora { lora: 1, .. }),
        "{e}"
    );
}

fn load_err(dir: &std::path::Path, max_rank: usize) -> String {
    let cfg = load_model_dir(model_dir()).unwrap().config;
    let m = LoraModule {
        name: "x".into(),
        path: dir.to_path_buf(),
    };
    let e: ModelError = LoraAdapter::load(&m, &cfg, max_rank).unwrap_err();
    e.to_string()
}

/// The load error of an adapter with `ad`'s config and one zero f32 tensor `name` of `shape`.
fn one_tensor(ad: &std::path::Path, name: &str, shape: &[usize]) -> String {
    let d = temp_dir("lora-one");
    std::fs::copy(
        ad.join("adapter_config.json"),
        d.join("adapter_config.json"),
    )
    .unwrap();
    let bytes = vec![0u8; 4 * shape.iter().product::<usize>()];
    let t = (
        name.to_string(),
        safetensors::Dtype::F32,
        shape.to_vec(),
        bytes,
    );
    write_safetensors(&d, "adapter_model.safetensors", &[t]);
    load_err(&d, 16)
}

fn edit_adapter_config(dir: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("adapter_config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn adapters_it_cannot_serve_are_refused_naming_the_cause() {
    let ad = adapter_dir();
    let e = load_err(&ad, 2);
    assert!(e.contains("rank 4 is above --max-lora-rank 2"), "{e}");

    let missing = temp_dir("lora-missing");
    let e = load_err(&missing, 16);
    assert!(e.contains("adapter_config.json"), "{e}");

    for (field, value, says) in [
        ("r", serde_json::json!(8), "adapter_config.json's r is 8"),
        ("r", serde_json::json!(0), "positive integer"),
        ("r", serde_json::json!("4"), "positive integer"),
        (
            "rank_pattern",
            serde_json::json!({"q_proj": 2}),
            "per-module ranks",
        ),
        ("use_rslora", serde_json::json!("true"), "true or false"),
        ("use_dora", serde_json::json!(true), "DoRA"),
        ("bias", serde_json::json!("all"), "only \"none\""),
        (
            "modules_to_save",
            serde_json::json!(["lm_head"]),
            "replace whole modules",
        ),
        ("peft_type", serde_json::json!("IA3"), "only LORA"),
    ] {
        let d = adapter_dir();
        edit_adapter_config(&d, |v| v[field] = value);
        let e = load_err(&d, 16);
        assert!(e.contains(field) && e.contains(says), "{field}: {e}");
    }

    let d = adapter_dir();
    std::fs::write(d.join("adapter_config.json"), "[1, 2]").unwrap();
    assert!(load_err(&d, 16).contains("JSON object"));
    let d = adapter_dir();
    edit_adapter_config(&d, |v| {
        v.as_object_mut().unwrap().remove("r");
    });
    assert!(load_err(&d, 16).contains("`r`"));
    // A NaN weight.
    let d = adapter_dir();
    let st = d.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let at = bytes.len() - 4;
    bytes[at..].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&st, bytes).unwrap();
    let e = load_err(&d, 16);
    assert!(e.contains("NaN") && e.contains("corrupt"), "{e}");

    // A tensor of a module that is not served (an embedding update).
    let e = one_tensor(
        &ad,
        "base_model.model.model.embed_tokens.lora_embedding_A",
        &[4, 512],
    );
    assert!(
        e.contains("embed_tokens") && e.contains("not served"),
        "{e}"
    );
    // lora_A without its lora_B.
    let q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let e = one_tensor(&ad, q_a, &[4, 64]);
    assert!(e.contains("lora_B"), "{e}");
    // A shape of another model.
    let e = one_tensor(&ad, q_a, &[4, 128]);
    assert!(e.contains("shape") || e.contains("[4, 64]"), "{e}");

    // Only a pickle.
    let d = temp_dir("lora-bin");
    std::fs::copy(
        ad.join("adapter_config.json"),
        d.join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(d.join("adapter_model.bin"), b"pickle").unwrap();
    let e = load_err(&d, 16);
    assert!(e.contains("adapter_model.bin"), "{e}");
}
