//! Weight storage variants (sharded index, F16, BF16) load to the same model, and forward-pass
//! input validation rejects bad rows without panicking.

mod common;

use baton_model::{
    load_model_dir, CpuModel, DType, ForwardError, ForwardRow, PagedKvCache, WeightSource,
};
use common::{fake_dir, golden, model_dir, prompt_logits, stories_tensors, write_safetensors};

fn cpu(dir: &std::path::Path) -> CpuModel {
    load_model_dir(dir).expect("loads").into_cpu_model().0
}

#[test]
fn sharded_index_loads_bitwise_identical_logits() {
    let d = fake_dir("sharded");
    let t = stories_tensors();
    let (a, b) = t.split_at(t.len() / 2);
    write_safetensors(&d, "model-00001-of-00002.safetensors", a);
    write_safetensors(&d, "model-00002-of-00002.safetensors", b);
    let mut map = serde_json::Map::new();
    for (x, f) in a
        .iter()
        .map(|x| (x, "model-00001-of-00002.safetensors"))
        .chain(b.iter().map(|x| (x, "model-00002-of-00002.safetensors")))
    {
        map.insert(x.0.clone(), f.into());
    }
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let src = WeightSource::open(&d).unwrap();
    assert_eq!(src.tensor_names().count(), t.len());
    let prompt = &golden().prompts[0].prompt_ids;
    assert_eq!(
        prompt_logits(&cpu(&d), prompt),
        prompt_logits(&cpu(&model_dir()), prompt)
    );
}

fn convert(dtype: safetensors::Dtype) -> common::TempDir {
    let d = fake_dir("half");
    let t: Vec<_> = stories_tensors()
        .into_iter()
        .map(|(n, _, s, b)| {
            let bytes: Vec<u8> = b
                .chunks_exact(4)
                .flat_map(|c| {
                    let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    match dtype {
                        safetensors::Dtype::BF16 => half::bf16::from_f32(x).to_le_bytes(),
                        _ => half::f16::from_f32(x).to_le_bytes(),
                    }
                })
                .collect();
            (n, dtype, s, bytes)
        })
        .collect();
    write_safetensors(&d, "model.safetensors", &t);
    d
}

#[test]
fn bf16_and_f16_weights_load_with_close_logits_report_source_dtype_and_stay_16_bit() {
    let prompt = &golden().prompts[0].prompt_ids;
    let f32_model = cpu(&model_dir());
    let reference = prompt_logits(&f32_model, prompt);
    for (dtype, want, tol) in [
        (safetensors::Dtype::BF16, DType::BF16, 1e-1f32),
        (safetensors::Dtype::F16, DType::F16, 1e-2),
    ] {
        let d = convert(dtype);
        let src = WeightSource::open(&d).unwrap();
        let raw = src.get("model.norm.weight").unwrap();
        assert_eq!(raw.dtype, want);
        assert_eq!(raw.bytes.len(), 64 * 2);
        let model = cpu(&d);
        // The CPU backend keeps a 16-bit checkpoint's matrices at 2 bytes per weight (only
        // the f32 norms keep 4): about half the f32 checkpoint's memory.
        let (half_bytes, full_bytes) = (model.weight_bytes(), f32_model.weight_bytes());
        assert!(
            half_bytes * 100 < full_bytes * 51,
            "{dtype:?}: {half_bytes} bytes of weights against {full_bytes} in f32"
        );
        let got = prompt_logits(&model, prompt);
        let max = got
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{dtype:?}: max |logit diff| vs f32 = {max}");
        assert!(max <= tol, "{dtype:?}: max |logit diff| {max} > {tol}");
        assert_eq!(common::argmax(&got), common::argmax(&reference));
    }
}

/// Building the CPU model straight from the mapped checkpoint, layer by layer
/// (`CpuModel::from_source`, what `baton worker` and `baton generate` do), gives the model
/// that the whole-f32 path (`LlamaWeights::load` then `CpuModel::try_new`) gives: the same
/// logits bit for bit and the same bytes held, for f32, bf16 and f16 checkpoints and for an
/// untied LM head.
#[test]
fn the_layer_by_layer_load_builds_the_same_model() {
    let prompt = &golden().prompts[0].prompt_ids;
    let untied = fake_dir("untied");
    let mut t = stories_tensors();
    let embed = t
        .iter()
        .find(|x| x.0 == "model.embed_tokens.weight")
        .unwrap()
        .clone();
    // A different head: the embedding's values, halved.
    let halved: Vec<u8> = embed
        .3
        .chunks_exact(4)
        .flat_map(|c| (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * 0.5).to_le_bytes())
        .collect();
    t.push(("lm_head.weight".into(), embed.1, embed.2.clone(), halved));
    write_safetensors(&untied, "model.safetensors", &t);
    common::edit_config(&untied, |c| {
        c.insert("tie_word_embeddings".into(), false.into());
    });
    let bf16 = convert(safetensors::Dtype::BF16);
    let f16 = convert(safetensors::Dtype::F16);
    for d in [&*model_dir(), &*bf16, &*f16, &*untied] {
        let whole = cpu(d);
        let cfg = baton_model::ModelConfig::from_json_str(
            &std::fs::read_to_string(d.join("config.json")).unwrap(),
        )
        .unwrap();
        let direct = CpuModel::from_source(cfg, &WeightSource::open(d).unwrap()).unwrap();
        assert_eq!(direct.weight_bytes(), whole.weight_bytes(), "{d:?}");
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(prompt_logits(&direct, prompt)) == bits(prompt_logits(&whole, prompt)),
            "{d:?}: the logits differ"
        );
    }
    // The untied head is used (its logits are not the tied model's).
    assert_ne!(
        prompt_logits(&cpu(&untied), prompt),
        prompt_logits(&cpu(&model_dir()), prompt)
    );
}

#[test]
fn invalid_forward_rows_are_errors_and_write_nothing() {
    let model = cpu(&model_dir());
    let mut kv = PagedKvCache::new(model.config(), 4, 4);
    let ok = ForwardRow {
        tokens: &[1, 2, 3],
        start_pos: 0,
        block_table: &[0],
        want_logits: true,
        all_logits: false,
        lora: 0,
    };
    type Check = fn(&ForwardError) -> bool;
    let cases: Vec<(ForwardRow, Check)> = vec![
        (ForwardRow { tokens: &[], ..ok }, |e| {
            matches!(e, ForwardError::EmptyRow { row: 1 })
        }),
        (
            ForwardRow {
                tokens: &[1, 512],
                ..ok
            },
            |e| {
                matches!(
                    e,
                    ForwardError::TokenOutOfRange {
                        row: 1,
                        index: 1,
                        token: 512,
                        ..
                    }
                )
            },
        ),
        (ForwardRow { start_pos: 2, ..ok }, |e| {
            matches!(
                e,
                ForwardError::BlockTableTooShort {
                    row: 1,
                    needed: 2,
                    ..
                }
            )
        }),
        (
            ForwardRow {
                block_table: &[4],
                ..ok
            },
            |e| {
                matches!(
                    e,
                    ForwardError::PageOutOfRange {
                        row: 1,
                        page: 4,
                        ..
                    }
                )
            },
        ),
        (
            ForwardRow {
                start_pos: 510,
                block_table: &[0; 200],
                ..ok
            },
            |e| {
                matches!(
                    e,
                    ForwardError::PositionOutOfRange {
                        row: 1,
                        end: 513,
                        max: 512
                    }
                )
            },
        ),
    ];
    for (bad, check) in cases {
        let before = format!("{:?}", kv.get(0, 0, 0));
        let e = model.forward(&mut kv, &[ok, bad]).unwrap_err();
        assert!(check(&e), "unexpected error {e:?}");
        assert!(!e.to_string().is_empty());
        assert_eq!(
            before,
            format!("{:?}", kv.get(0, 0, 0)),
            "cache written on error"
        );
    }
    let other = baton_model::ModelConfig {
        num_hidden_layers: 2,
        ..model.config().clone()
    };
    let mut wrong = PagedKvCache::new(&other, 4, 4);
    assert!(matches!(
        model.forward(&mut wrong, &[ok]),
        Err(ForwardError::CacheMismatch { .. })
    ));
    // Valid rows still work, and a batch with no logits wanted returns none.
    assert_eq!(model.forward(&mut kv, &[ok]).unwrap().len(), 1);
    let quiet = ForwardRow {
        want_logits: false,
        all_logits: false,
        ..ok
    };
    assert!(model.forward(&mut kv, &[quiet]).unwrap().is_empty());
    assert!(model.forward(&mut kv, &[]).unwrap().is_empty());
}
