//! Every way a model directory can be broken yields a `ModelError` (never a panic) whose text
//! names the file and the field or tensor at fault.

mod common;

use baton_model::{
    load_model_dir, load_model_dir_with, GenerationConfigSource, LoadFormat, ModelConfig, ModelDir,
    ModelError,
};
use common::{
    edit_config, fake_dir, stories_tensors, write_safetensors, write_two_shards, OwnedTensor,
    TempDir, TWO_SHARDS,
};
use std::path::Path;

/// The error of loading `dir` ([`ModelError`]), after checking that the mapped load (what a
/// device backend uses) reports it word for word too.
fn both(dir: &Path) -> ModelError {
    let e = load_model_dir(dir).expect_err("loading should fail");
    let m = ModelDir::new(dir)
        .load_mapped(LoadFormat::Auto)
        .expect_err("the mapped load should fail");
    assert_eq!(
        m.to_string(),
        e.to_string(),
        "mapped and f32 loads disagree"
    );
    e
}

/// The error of loading `dir`, which the mapped load (what a device backend uses) must report
/// word for word too.
fn err(dir: &Path) -> String {
    let e = match load_model_dir(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    };
    match ModelDir::new(dir).load_mapped(LoadFormat::Auto) {
        Ok(_) => panic!("the mapped load of {} should fail", dir.display()),
        Err(m) => assert_eq!(m.to_string(), e, "mapped and f32 loads disagree"),
    }
    e
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    eprintln!("error text: {msg}");
    for p in parts {
        assert!(msg.contains(p), "error {msg:?} should mention {p:?}");
    }
}

/// A fake dir with stories260K's JSON and its tensors after `edit`.
fn dir_with_tensors(tag: &str, edit: impl FnOnce(&mut Vec<OwnedTensor>)) -> TempDir {
    let d = fake_dir(tag);
    let mut t = stories_tensors();
    edit(&mut t);
    write_safetensors(&d, "model.safetensors", &t);
    d
}

#[test]
fn unmodified_copy_loads_so_failures_below_are_caused_by_the_edit() {
    let d = dir_with_tensors("ok", |_| {});
    load_model_dir(&d).expect("an unedited copy loads");
}

#[test]
fn missing_config_json_names_the_file() {
    let d = dir_with_tensors("noconfig", |_| {});
    std::fs::remove_file(d.join("config.json")).unwrap();
    let e = load_model_dir(&d).unwrap_err();
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
    assert_mentions(&e.to_string(), &["config.json"]);
}

#[test]
fn bad_json_names_file_line_and_column() {
    let d = dir_with_tensors("badjson", |_| {});
    std::fs::write(
        d.join("config.json"),
        "{\n  \"hidden_size\": 64,\n  oops\n}",
    )
    .unwrap();
    let e = load_model_dir(&d).unwrap_err();
    match &e {
        ModelError::Json { line, .. } => assert_eq!(*line, 3),
        other => panic!("expected Json, got {other:?}"),
    }
    assert_mentions(&e.to_string(), &["config.json", "line 3"]);
}

#[test]
fn bad_generation_config_json_names_that_file() {
    let d = dir_with_tensors("badgen", |_| {});
    std::fs::write(d.join("generation_config.json"), "{\"eos_token_id\": [2,").unwrap();
    assert_mentions(&err(&d), &["generation_config.json", "line 1"]);
}

#[test]
fn unsupported_architecture_is_named() {
    let d = dir_with_tensors("arch", |_| {});
    edit_config(&d, |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["GPT2LMHeadModel"]),
        );
    });
    assert_mentions(
        &err(&d),
        &["config.json", "architectures", "GPT2LMHeadModel"],
    );
}

#[test]
fn unsupported_model_type_is_named() {
    let d = dir_with_tensors("mtype", |_| {});
    edit_config(&d, |c| {
        c.insert("model_type".into(), serde_json::json!("gpt2"));
    });
    assert_mentions(&err(&d), &["config.json", "model_type", "gpt2"]);
}

#[test]
fn missing_and_mistyped_config_fields_are_named() {
    let d = dir_with_tensors("field", |_| {});
    edit_config(&d, |c| {
        c.remove("hidden_size");
    });
    let e = load_model_dir(&d).unwrap_err();
    assert!(matches!(e, ModelError::MissingField { .. }), "{e:?}");
    assert_mentions(&e.to_string(), &["config.json", "hidden_size"]);

    edit_config(&d, |c| {
        c.insert("hidden_size".into(), serde_json::json!("sixty-four"));
    });
    let e = load_model_dir(&d).unwrap_err();
    assert!(matches!(e, ModelError::InvalidField { .. }), "{e:?}");
    assert_mentions(&e.to_string(), &["config.json", "hidden_size"]);

    edit_config(&d, |c| {
        c.insert("hidden_size".into(), serde_json::json!(64));
        c.insert("num_key_value_heads".into(), serde_json::json!(3));
    });
    assert_mentions(&err(&d), &["config.json", "num_key_value_heads"]);
}

#[test]
fn unsupported_rope_scaling_type_is_named() {
    let d = dir_with_tensors("rope", |_| {});
    edit_config(&d, |c| {
        c.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "dynamic", "factor": 4.0}),
        );
    });
    assert_mentions(
        &err(&d),
        &["config.json", "rope_scaling.rope_type", "dynamic"],
    );
}

/// A Mistral model's `sliding_window` applies to every layer and leaves the served context
/// whole; a window that covers every position is none, and bad values are refused.
#[test]
fn a_mistral_sliding_window_applies_to_every_layer_and_bad_ones_are_refused() {
    let d = dir_with_tensors("mistral", |_| {});
    edit_config(&d, |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["MistralForCausalLM"]),
        );
        c.insert("model_type".into(), serde_json::json!("mistral"));
        c.insert("sliding_window".into(), serde_json::json!(256));
    });
    let slid = load_model_dir(&d).expect("a sliding window loads").config;
    assert_eq!(slid.max_position_embeddings, 512);
    assert_eq!(slid.sliding_window, vec![Some(256); slid.num_hidden_layers]);
    for (bad, what) in [
        (serde_json::json!("256"), "integer"),
        (serde_json::json!(0), "must be > 0"),
    ] {
        edit_config(&d, |c| {
            c.insert("sliding_window".into(), bad);
        });
        assert_mentions(&err(&d), &["config.json", "sliding_window", what]);
    }
    for window in [serde_json::Value::Null, serde_json::json!(512)] {
        edit_config(&d, |c| {
            c.insert("sliding_window".into(), window.clone());
        });
        let whole = load_model_dir(&d).expect("loads").config;
        assert_eq!(whole.max_position_embeddings, 512, "{window}");
        assert!(whole.sliding_window.iter().all(Option::is_none), "{window}");
    }
}

#[test]
fn missing_tensor_is_named_with_its_file() {
    let d = dir_with_tensors("notensor", |t| {
        t.retain(|x| x.0 != "model.layers.3.mlp.up_proj.weight")
    });
    let e = both(&d);
    assert!(matches!(e, ModelError::MissingTensor { .. }), "{e:?}");
    assert_mentions(
        &e.to_string(),
        &["model.safetensors", "model.layers.3.mlp.up_proj.weight"],
    );
}

#[test]
fn untied_config_without_lm_head_is_a_missing_tensor() {
    let d = dir_with_tensors("untied", |_| {});
    edit_config(&d, |c| {
        c.insert("tie_word_embeddings".into(), serde_json::json!(false));
    });
    assert_mentions(&err(&d), &["model.safetensors", "lm_head.weight"]);
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let d = dir_with_tensors("shape", |t| {
        let k = t
            .iter_mut()
            .find(|x| x.0 == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        k.2 = vec![64, 32];
    });
    let e = both(&d);
    assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e:?}");
    assert_mentions(
        &e.to_string(),
        &[
            "model.safetensors",
            "model.layers.0.self_attn.k_proj.weight",
            "[32, 64]",
            "[64, 32]",
        ],
    );
}

#[test]
fn unsupported_dtypes_i32_and_f64_are_named() {
    for (dtype, name, size) in [
        (safetensors::Dtype::I32, "I32", 4usize),
        (safetensors::Dtype::F64, "F64", 8),
    ] {
        let d = dir_with_tensors("dtype", |t| {
            let n = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
            n.1 = dtype;
            n.3 = vec![0u8; 64 * size];
        });
        let e = both(&d);
        assert!(matches!(e, ModelError::UnsupportedDtype { .. }), "{e:?}");
        assert_mentions(
            &e.to_string(),
            &["model.safetensors", "model.norm.weight", name],
        );
    }
}

#[test]
fn truncated_or_garbage_safetensors_is_an_error_not_a_panic() {
    let d = dir_with_tensors("trunc", |_| {});
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    for cut in [0usize, 4, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        assert_mentions(&err(&d), &["model.safetensors"]);
    }
    let mut garbage = vec![0xffu8; 64];
    garbage[..8].copy_from_slice(&40u64.to_le_bytes());
    std::fs::write(&p, &garbage).unwrap();
    assert_mentions(&err(&d), &["model.safetensors"]);
}

/// A header that safetensors refuses for one tensor (a wrong dtype or shape for its bytes, an
/// unknown dtype, overlapping data) names that tensor.
#[test]
fn a_header_fault_names_the_tensor() {
    let d = dir_with_tensors("hdr", |_| {});
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = "model.layers.2.mlp.up_proj.weight";
    let with = |edit: Edit| {
        let mut h = header.clone();
        edit(&mut h[name]);
        // The same header length (padded with spaces), so the data stays where it was.
        let mut text = serde_json::to_vec(&h).unwrap();
        assert!(text.len() <= n, "the edit grew the header");
        text.resize(n, b' ');
        let mut out = bytes[..8].to_vec();
        out.extend_from_slice(&text);
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&p, out).unwrap();
    };
    // The unedited header, rewritten this way, loads.
    with(|_| {});
    let e = load_model_dir(&d);
    assert!(e.is_ok(), "{:?}", e.err());
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit); 5] = [
        ("a 16-bit dtype over f32 bytes", |t| {
            t["dtype"] = "F16".into()
        }),
        ("an unknown dtype", |t| t["dtype"] = "Q7".into()),
        ("a wrong shape", |t| t["shape"][0] = 3.into()),
        ("no shape", |t| {
            t.as_object_mut().unwrap().remove("shape");
        }),
        ("overlapping data", |t| {
            let [s, e] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap());
            t["data_offsets"] = serde_json::json!([s - 4, e - 4]);
        }),
    ];
    for (what, edit) in cases {
        with(edit);
        let e = err(&d);
        eprintln!("{what}");
        assert_mentions(&e, &["model.safetensors", name]);
    }
    std::fs::write(&p, &bytes).unwrap();
}

#[test]
fn missing_weights_file_names_model_safetensors() {
    let d = fake_dir("noweights");
    assert_mentions(&err(&d), &["model.safetensors"]);
}

fn write_index(d: &Path, map: serde_json::Value) {
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
}

#[test]
fn sharded_index_problems_name_the_index_and_shard() {
    let d = fake_dir("shardbad");
    let t = stories_tensors();
    let (a, b) = t.split_at(t.len() / 2);
    write_safetensors(&d, "model-00001-of-00002.safetensors", a);
    let mut map = serde_json::Map::new();
    for x in a {
        map.insert(x.0.clone(), "model-00001-of-00002.safetensors".into());
    }
    for x in b {
        map.insert(x.0.clone(), "model-00002-of-00002.safetensors".into());
    }
    // Shard 2 missing.
    write_index(&d, serde_json::Value::Object(map.clone()));
    assert_mentions(
        &err(&d),
        &[
            "model.safetensors.index.json",
            "model-00002-of-00002.safetensors",
        ],
    );
    // Index assigns a tensor to a shard that lacks it.
    write_safetensors(&d, "model-00002-of-00002.safetensors", &b[1..]);
    assert_mentions(&err(&d), &["model.safetensors.index.json", &b[0].0]);
    // No weight_map.
    std::fs::write(d.join("model.safetensors.index.json"), "{}").unwrap();
    assert_mentions(&err(&d), &["model.safetensors.index.json", "weight_map"]);
    // Path traversal in a shard name.
    let mut m2 = map.clone();
    m2.insert(b[0].0.clone(), "../x.safetensors".into());
    write_index(&d, serde_json::Value::Object(m2));
    assert_mentions(
        &err(&d),
        &["model.safetensors.index.json", "../x.safetensors"],
    );
}

#[test]
fn missing_tokenizer_fails_auto_but_dummy_loads_without_it() {
    let d = fake_dir("notok");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    assert_mentions(&err(&d), &["tokenizer.json"]);
    let m =
        load_model_dir_with(&d, LoadFormat::Dummy { seed: 1 }).expect("dummy needs only config");
    assert!(m.tokenizer.is_none());
    std::fs::write(d.join("tokenizer.json"), "{not json").unwrap();
    let e = load_model_dir_with(&d, LoadFormat::Dummy { seed: 1 }).unwrap_err();
    assert_mentions(&e.to_string(), &["tokenizer.json"]);
}

#[test]
fn bad_tokenizer_config_fields_are_named() {
    let d = dir_with_tensors("tokcfg", |_| {});
    std::fs::write(
        d.join("tokenizer_config.json"),
        r#"{"add_bos_token": "yes"}"#,
    )
    .unwrap();
    assert_mentions(&err(&d), &["tokenizer_config.json", "add_bos_token"]);
    std::fs::write(
        d.join("tokenizer_config.json"),
        r#"{"bos_token": "<nope>"}"#,
    )
    .unwrap();
    assert_mentions(&err(&d), &["tokenizer_config.json", "bos_token", "<nope>"]);
}

/// A config with fewer layers than the checkpoint (an edited `num_hidden_layers`) is refused,
/// naming a tensor of the extra layer, instead of running a truncated model.
#[test]
fn a_checkpoint_with_more_layers_than_the_config_is_refused() {
    let d = dir_with_tensors("extra-layers", |_| {});
    edit_config(&d, |c| {
        let n = c["num_hidden_layers"].as_u64().unwrap();
        c.insert("num_hidden_layers".into(), serde_json::json!(n - 1));
    });
    let e = err(&d);
    assert_mentions(
        &e,
        &[
            "model.safetensors",
            "model.layers.4.",
            "num_hidden_layers = 4",
        ],
    );
}

/// Stories260K's tensors plus `extra` (name, shape, value of every element), f32.
fn with_extra(tag: &str, extra: &[(&str, &[usize], f32)]) -> TempDir {
    dir_with_tensors(tag, |t| {
        for (name, shape, value) in extra {
            let n: usize = shape.iter().product();
            let bytes = std::iter::repeat_n(value.to_le_bytes(), n)
                .flatten()
                .collect();
            t.push((
                (*name).to_string(),
                safetensors::Dtype::F32,
                shape.to_vec(),
                bytes,
            ));
        }
    })
}

/// A tensor the model does not use (a q/k norm in a Llama checkpoint, an o_proj bias) means
/// the checkpoint is of another architecture: both loads refuse it, naming the file and the
/// first few such tensors with their count, as vLLM raises on a weight name it has no
/// parameter for.
#[test]
fn tensors_the_model_does_not_use_are_refused_and_named() {
    let d = with_extra(
        "unused",
        &[
            ("model.layers.0.self_attn.q_norm.weight", &[8], 1.0),
            ("model.layers.0.self_attn.k_norm.weight", &[8], 1.0),
            ("model.layers.1.self_attn.o_proj.bias", &[64], 0.5),
            ("model.vision_tower.weight", &[4], 1.0),
            ("model.layers.2.mlp.gate_proj.scale", &[1], 1.0),
            ("model.layers.3.mlp.up_proj.bias", &[172], 0.5),
            ("model.layers.4.mlp.down_proj.bias", &[64], 0.5),
        ],
    );
    let e = both(&d);
    assert!(
        matches!(&e, ModelError::UnusedTensors { count: 7, tensors, .. } if tensors.len() == 5),
        "{e:?}"
    );
    assert_mentions(
        &e.to_string(),
        &[
            "model.safetensors",
            "`llama`",
            "7 tensor(s)",
            "`model.layers.0.self_attn.k_norm.weight`",
            "`model.layers.0.self_attn.q_norm.weight`",
            "`model.layers.1.self_attn.o_proj.bias`",
            "and 2 more",
        ],
    );
    // One alone.
    let d = with_extra(
        "unused-one",
        &[("model.layers.1.self_attn.o_proj.bias", &[64], 0.5)],
    );
    let e = both(&d).to_string();
    assert_mentions(
        &e,
        &["1 tensor(s)", "`model.layers.1.self_attn.o_proj.bias`"],
    );
    assert!(!e.contains("more"), "{e}");
}

/// The unused-tensor and extra-layer errors of a sharded checkpoint name the shard holding
/// the tensor (the index only lists names).
#[test]
fn a_sharded_checkpoints_unused_tensors_are_named_with_their_shard() {
    let d = fake_dir("unused-sharded");
    let mut t = stories_tensors();
    // Last, so in the second shard.
    t.push((
        "model.layers.1.self_attn.o_proj.bias".into(),
        safetensors::Dtype::F32,
        vec![64],
        std::iter::repeat_n(0.5f32.to_le_bytes(), 64)
            .flatten()
            .collect(),
    ));
    write_two_shards(&d, &t);
    let e = both(&d);
    assert!(matches!(e, ModelError::UnusedTensors { .. }), "{e:?}");
    assert_mentions(
        &e.to_string(),
        &[TWO_SHARDS[1], "model.layers.1.self_attn.o_proj.bias"],
    );
    assert!(!e.to_string().contains("index.json"), "{e}");
    // The first tensor of the layer the config lacks, in its shard.
    edit_config(&d, |c| {
        c.insert("num_hidden_layers".into(), serde_json::json!(4));
    });
    let first = t
        .iter()
        .position(|x| x.0.starts_with("model.layers.4."))
        .unwrap();
    let shard = TWO_SHARDS[usize::from(first >= t.len() / 2)];
    let e = both(&d);
    assert!(matches!(e, ModelError::ExtraLayers { .. }), "{e:?}");
    assert_mentions(&e.to_string(), &[shard, &t[first].0]);
}

/// An unused tensor of a dtype the loader does not read is refused as unused, by the loads
/// and by the scheduler's fingerprint step (`checked_weights_fingerprint`), not as a dtype
/// error; a tensor the loader skips (a RoPE table saved as I64) does not stop the loads or
/// the fingerprint, and counts in it.
#[test]
fn an_unused_tensor_of_an_unsupported_dtype_is_refused_as_unused() {
    let with = |tag: &str, name: &str, dtype: safetensors::Dtype| {
        dir_with_tensors(tag, |t| {
            t.push((name.into(), dtype, vec![4], vec![0x11; 32]));
        })
    };
    let d = with(
        "unused-i64",
        "model.layers.0.mlp.gate_proj.qzeros",
        safetensors::Dtype::I64,
    );
    let e = both(&d);
    assert!(matches!(e, ModelError::UnusedTensors { .. }), "{e:?}");
    let cfg = ModelConfig::from_file(&d.join("config.json")).unwrap();
    let e = ModelDir::new(&*d)
        .checked_weights_fingerprint(LoadFormat::Auto, &cfg)
        .expect_err("the fingerprint step refuses it");
    assert!(matches!(e, ModelError::UnusedTensors { .. }), "{e:?}");
    assert_mentions(&e.to_string(), &["model.layers.0.mlp.gate_proj.qzeros"]);

    let d = with(
        "skipped-i64",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        safetensors::Dtype::I64,
    );
    load_model_dir(&d).expect("a skipped I64 tensor loads");
    let m = ModelDir::new(&*d)
        .load_mapped(LoadFormat::Auto)
        .expect("and maps");
    let f = ModelDir::new(&*d)
        .checked_weights_fingerprint(LoadFormat::Auto, &cfg)
        .expect("and is fingerprinted");
    assert_eq!(f, m.weights_fingerprint);
    let plain = ModelDir::new(common::model_dir())
        .weights_fingerprint(LoadFormat::Auto)
        .unwrap();
    assert_ne!(f, plain, "the skipped tensor counts in the fingerprint");
}

/// What vLLM skips loads: saved RoPE tables, an all-zero bias (what GPTQ exports store;
/// adding it changes nothing) and, with tied embeddings, `lm_head.weight`, which is then not
/// the head: the embedding is (as vLLM and transformers tie them). A non-zero bias is refused.
#[test]
fn harmless_unused_tensors_are_skipped_and_a_tied_lm_head_is_the_embedding() {
    let d = with_extra(
        "harmless",
        &[
            ("model.layers.0.self_attn.rotary_emb.inv_freq", &[4], 1.0),
            (
                "model.layers.1.self_attn.rotary_emb.cos_cached",
                &[2, 4],
                1.0,
            ),
            (
                "model.layers.1.self_attn.rotary_emb.sin_cached",
                &[2, 4],
                1.0,
            ),
            ("model.rotary_pos_emb.inv_freq", &[4], 1.0),
            ("model.layers.2.self_attn.o_proj.bias", &[64], -0.0),
            ("model.layers.2.mlp.down_proj.bias", &[64], 0.0),
            ("lm_head.weight", &[512, 64], 0.25),
        ],
    );
    let m = load_model_dir(&d).expect("harmless extras load");
    assert_eq!(
        m.weights.lm_head, m.weights.embed,
        "a tied head is the embedding"
    );
    ModelDir::new(&*d)
        .load_mapped(LoadFormat::Auto)
        .expect("the mapped load skips them too");
    // Untied, the stored head is used (and is no longer unused).
    edit_config(&d, |c| {
        c.insert("tie_word_embeddings".into(), serde_json::json!(false));
    });
    let m = load_model_dir(&d).expect("untied loads");
    assert!(m.weights.lm_head.data.iter().all(|&x| x == 0.25));
    let d = with_extra(
        "nonzero-bias",
        &[("model.layers.2.mlp.down_proj.bias", &[64], 1e-30)],
    );
    assert!(matches!(
        both(&d),
        ModelError::UnusedTensors { count: 1, .. }
    ));
}

/// `--generation-config vllm` must start with a malformed generation_config.json: the
/// lenient reads ignore it, return its error (naming the file) for the caller to report, and
/// take the stop ids from config.json. The strict ones still refuse it.
#[test]
fn lenient_reads_ignore_a_malformed_generation_config_and_use_config_json_stop_ids() {
    let d = dir_with_tensors("badgen-lenient", |_| {});
    std::fs::write(d.join("generation_config.json"), "{\"eos_token_id\": [2,").unwrap();
    edit_config(&d, |c| {
        c.insert("eos_token_id".into(), serde_json::json!(7));
    });
    let dir = ModelDir::new(&*d);
    let (ids, e) = dir.eos_token_ids_lenient().expect("lenient stop ids");
    assert_eq!(
        ids,
        vec![2, 7],
        "the tokenizer's EOS, then config.json's eos_token_id"
    );
    assert_mentions(
        &e.expect("the ignored error").to_string(),
        &["generation_config.json"],
    );
    let m = dir
        .load_mapped_lenient(LoadFormat::Auto)
        .expect("lenient load");
    assert_eq!(m.eos_token_ids(), vec![2, 7]);
    assert!(m.generation_config_error.is_some());
    assert_mentions(
        &dir.eos_token_ids().unwrap_err().to_string(),
        &["generation_config.json"],
    );
    // A well-formed file is read by both, with no error.
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [2, 3]}"#,
    )
    .unwrap();
    let (ids, e) = dir.eos_token_ids_lenient().unwrap();
    assert_eq!(ids, vec![2, 3]);
    assert!(e.is_none(), "{e:?}");
    let m = dir.load_mapped_lenient(LoadFormat::Auto).unwrap();
    assert!(m.generation_config_error.is_none());
    assert_eq!(m.eos_token_ids(), vec![2, 3]);
}

/// `--generation-config`'s sources (`ModelDir::generation_config_from`, `load_mapped_from`):
/// `auto` reads the model's file whole, `vllm` only its stop ids (a malformed file ignored,
/// its error returned), DIR its own file whole, stop ids included, without reading the
/// model's.
#[test]
fn generation_config_sources_give_their_sampling_defaults_and_stop_ids() {
    let d = dir_with_tensors("gensrc", |_| {});
    let gen = d.join("generation_config.json");
    std::fs::write(&gen, r#"{"eos_token_id": [2, 3], "temperature": 0.5}"#).unwrap();
    let other = fake_dir("gensrc-dir");
    std::fs::write(
        other.join("generation_config.json"),
        r#"{"eos_token_id": 9, "top_k": 4}"#,
    )
    .unwrap();
    let dir = ModelDir::new(&*d);
    let src = |s: &str| s.parse::<GenerationConfigSource>().unwrap();
    let other_src = src(other.to_str().unwrap());
    assert_eq!(other_src, GenerationConfigSource::Dir(other.to_path_buf()));
    assert_eq!(
        src(&other_src.to_string()),
        other_src,
        "Display is the flag"
    );
    assert!("".parse::<GenerationConfigSource>().is_err());
    let read = |s: &GenerationConfigSource| dir.generation_config_from(s).unwrap();
    let (g, e) = read(&src("auto"));
    assert_eq!((g.eos_token_ids, g.temperature), (vec![2, 3], Some(0.5)));
    assert!(e.is_none());
    let (g, e) = read(&src("vllm"));
    assert_eq!((g.eos_token_ids, g.temperature), (vec![2, 3], None));
    assert!(e.is_none());
    let (g, _) = read(&other_src);
    assert_eq!(
        (g.eos_token_ids, g.top_k, g.temperature),
        (vec![9], Some(4), None)
    );
    let m = dir.load_mapped_from(LoadFormat::Auto, &other_src).unwrap();
    assert_eq!(
        m.eos_token_ids(),
        vec![2, 9],
        "the tokenizer's EOS, then DIR's stop ids"
    );
    // A malformed model file: `auto` refuses it, `vllm` ignores it (config.json's stop ids),
    // DIR does not read it.
    std::fs::write(&gen, "{\"eos_token_id\": [2,").unwrap();
    assert_mentions(
        &dir.generation_config_from(&src("auto"))
            .unwrap_err()
            .to_string(),
        &["generation_config.json", "line 1"],
    );
    assert!(dir
        .load_mapped_from(LoadFormat::Auto, &src("auto"))
        .is_err());
    let m = dir
        .load_mapped_from(LoadFormat::Auto, &src("vllm"))
        .unwrap();
    assert_eq!(m.eos_token_ids(), vec![2], "config.json's");
    assert!(m.generation_config_error.is_some());
    let m = dir.load_mapped_from(LoadFormat::Auto, &other_src).unwrap();
    assert_eq!(m.eos_token_ids(), vec![2, 9]);
    assert!(m.generation_config_error.is_none());
    // A DIR without the file is named.
    let none = src(d.join("nope").to_str().unwrap());
    assert_mentions(
        &dir.generation_config_from(&none).unwrap_err().to_string(),
        &["nope/generation_config.json"],
    );
}

/// A NaN or an infinity in a norm weight or a bias is refused at load, naming the tensor and
/// the index (it would make every logit NaN, and the sampler emit garbage silently).
#[test]
fn a_non_finite_norm_weight_is_refused_and_named() {
    for (tag, tensor, at, bad) in [
        ("nan-norm", "model.norm.weight", 5, f32::NAN),
        (
            "inf-ln",
            "model.layers.1.input_layernorm.weight",
            63,
            f32::NEG_INFINITY,
        ),
    ] {
        let d = dir_with_tensors(tag, |t| {
            let x = t.iter_mut().find(|x| x.0 == tensor).unwrap();
            assert_eq!(x.1, safetensors::Dtype::F32);
            x.3[4 * at..4 * at + 4].copy_from_slice(&bad.to_le_bytes());
        });
        let e = both(&d);
        assert!(
            matches!(e, ModelError::NonFinite { index, .. } if index == at),
            "{e:?}"
        );
        assert_mentions(
            &e.to_string(),
            &["model.safetensors", tensor, &format!("index {at}")],
        );
    }
}
