//! Phi-3 checkpoints (`Phi3ForCausalLM`, also Phi-4): Llama with fused `qkv_proj` and
//! `gate_up_proj` matrices (transformers' `modeling_phi3.py`).
//!
//! No Phi-3 checkpoint is at hand, so stories260K is rewritten in Phi-3's layout: each layer's
//! q, k and v rows stored as one `qkv_proj` (q, then k, then v) and gate and up as one
//! `gate_up_proj` (gate first), config.json saying `phi3`. The model is the same, so it must
//! reproduce stories260K's goldens, through both loads (the whole-f32 one and the mapped,
//! layer-by-layer one the worker uses). A swapped or misplaced part would not.

mod common;

use baton_model::{
    load_model_dir, CpuModel, LoadFormat, ModelDir, ModelError, ModelWeights, WeightSource,
};
use common::{fake_dir, golden, greedy_alone, model_dir, stories_tensors, OwnedTensor, TempDir};

/// Concatenates the named tensors' rows (all `[rows, cols]`, same dtype) into one tensor.
fn fuse(tensors: &[OwnedTensor], names: &[String], fused: String) -> OwnedTensor {
    let parts: Vec<&OwnedTensor> = names
        .iter()
        .map(|n| tensors.iter().find(|t| &t.0 == n).expect("part stored"))
        .collect();
    let rows = parts.iter().map(|t| t.2[0]).sum();
    let cols = parts[0].2[1];
    let bytes = parts.iter().flat_map(|t| t.3.iter().copied()).collect();
    (fused, parts[0].1, vec![rows, cols], bytes)
}

/// stories260K in Phi-3's layout; `edit` may change the fused tensors before they are written.
fn phi3_dir(tag: &str, edit: impl FnOnce(&mut Vec<OwnedTensor>)) -> TempDir {
    let d = fake_dir(tag);
    let llama = stories_tensors();
    let layers = 5;
    let mut out: Vec<OwnedTensor> = llama
        .iter()
        .filter(|t| {
            !["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
                .iter()
                .any(|p| t.0.contains(p))
        })
        .cloned()
        .collect();
    for i in 0..layers {
        let p = format!("model.layers.{i}.");
        let names = |parts: &[&str]| parts.iter().map(|s| format!("{p}{s}")).collect::<Vec<_>>();
        out.push(fuse(
            &llama,
            &names(&[
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ]),
            format!("{p}self_attn.qkv_proj.weight"),
        ));
        out.push(fuse(
            &llama,
            &names(&["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
            format!("{p}mlp.gate_up_proj.weight"),
        ));
    }
    edit(&mut out);
    common::write_safetensors(&d, "model.safetensors", &out);
    common::edit_config(&d, |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["Phi3ForCausalLM"]),
        );
        c.insert("model_type".into(), "phi3".into());
        // Phi-3's config keys that change nothing here.
        c.insert("original_max_position_embeddings".into(), 512.into());
        c.insert("sliding_window".into(), serde_json::Value::Null);
        c.insert("embd_pdrop".into(), 0.0.into());
        c.insert("resid_pdrop".into(), 0.0.into());
    });
    d
}

fn mapped_cpu(dir: &std::path::Path) -> Result<CpuModel, ModelError> {
    let m = ModelDir::new(dir).load_mapped(LoadFormat::Auto)?;
    let ModelWeights::Mapped(src) = &m.weights else {
        panic!("a checkpoint loads mapped")
    };
    CpuModel::from_source(m.config.clone(), src)
}

#[test]
fn stories260k_in_phi3_layout_reproduces_the_goldens_through_both_loads() {
    let d = phi3_dir("phi3", |_| {});
    let whole = load_model_dir(&d).expect("phi3 loads");
    assert!(whole.config.fused_projections);
    assert_eq!(whole.config.model_type, "phi3");
    // The split parts are the Llama checkpoint's tensors.
    assert_eq!(whole.weights, load_model_dir(model_dir()).unwrap().weights);
    let models = [
        ("whole", whole.into_cpu_model().0),
        ("mapped", mapped_cpu(&d).expect("phi3 loads mapped")),
    ];
    for (how, model) in &models {
        for p in golden().prompts {
            let pages: Vec<u32> = (0..32).collect();
            let (ids, _) = greedy_alone(model, &p.prompt_ids, p.greedy_ids.len(), 16, &pages, 32);
            assert_eq!(ids, p.greedy_ids, "{how}: {:?}", p.prompt);
        }
    }
}

#[test]
fn a_fused_tensor_of_the_wrong_shape_or_a_missing_one_is_named() {
    // One v row short: q and k would still fit, but the tensor is not `[q + 2 kv, hidden]`.
    let qkv = "model.layers.2.self_attn.qkv_proj.weight";
    let short = phi3_dir("phi3-short", |t| {
        let x = t.iter_mut().find(|x| x.0 == qkv).unwrap();
        x.2[0] -= 1;
        let keep = x.2[0] * x.2[1] * 4;
        x.3.truncate(keep);
    });
    let missing = phi3_dir("phi3-missing", |t| {
        t.retain(|x| x.0 != "model.layers.4.mlp.gate_up_proj.weight")
    });
    for e in [
        load_model_dir(&short).map(|_| ()).unwrap_err(),
        mapped_cpu(&short).map(|_| ()).unwrap_err(),
    ] {
        assert!(
            matches!(&e, ModelError::ShapeMismatch { tensor, expected, found, .. }
                if tensor == qkv && expected == &[128, 64] && found == &[127, 64]),
            "{e}"
        );
    }
    for e in [
        load_model_dir(&missing).map(|_| ()).unwrap_err(),
        mapped_cpu(&missing).map(|_| ()).unwrap_err(),
    ] {
        assert!(
            matches!(&e, ModelError::MissingTensor { tensor, .. }
                if tensor == "model.layers.4.mlp.gate_up_proj.weight"),
            "{e}"
        );
    }
}

/// A fused checkpoint that also stores one of the parts is ambiguous (which rows are meant?):
/// refused, naming both, by both loads and by the scheduler's name check.
#[test]
fn a_part_stored_beside_its_fused_tensor_is_refused() {
    let q = "model.layers.0.self_attn.q_proj.weight";
    let d = phi3_dir("phi3-both", |t| {
        t.push((
            q.into(),
            safetensors::Dtype::F32,
            vec![64, 64],
            vec![0; 64 * 64 * 4],
        ))
    });
    let cfg = baton_model::ModelConfig::from_json_str(
        &std::fs::read_to_string(d.join("config.json")).unwrap(),
    )
    .unwrap();
    for e in [
        load_model_dir(&d).map(|_| ()).unwrap_err(),
        mapped_cpu(&d).map(|_| ()).unwrap_err(),
        ModelDir::new(&*d)
            .checked_weights_fingerprint(LoadFormat::Auto, &cfg)
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(
            matches!(&e, ModelError::FusedAndPart { part, fused, .. }
                if part == q && fused == "model.layers.0.self_attn.qkv_proj.weight"),
            "{e}"
        );
    }
}

#[test]
fn a_llama_layout_under_a_phi3_config_loads_and_a_fused_tensor_under_llama_is_refused() {
    // Parts stored whole are read as they are (a converted checkpoint).
    let d = fake_dir("phi3-unfused");
    common::write_safetensors(&d, "model.safetensors", &stories_tensors());
    common::edit_config(&d, |c| {
        c.insert("model_type".into(), "phi3".into());
    });
    assert_eq!(
        load_model_dir(&d).unwrap().weights,
        load_model_dir(model_dir()).unwrap().weights
    );
    // A Phi-3 checkpoint under a Llama config: its fused tensors are not Llama's.
    let fused = phi3_dir("phi3-as-llama", |_| {});
    common::edit_config(&fused, |c| {
        c.insert("model_type".into(), "llama".into());
        c.insert(
            "architectures".into(),
            serde_json::json!(["LlamaForCausalLM"]),
        );
    });
    let e = load_model_dir(&fused).map(|_| ()).unwrap_err();
    assert!(matches!(&e, ModelError::UnusedTensors { .. }), "{e}");
    assert!(e.to_string().contains("qkv_proj"), "{e}");
    // The fused view serves the part only through a phi3 config.
    let cfg = load_model_dir(&d).unwrap().config;
    let src = WeightSource::open_for(&fused, &cfg).unwrap();
    let plain = WeightSource::open(&fused).unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(src.get(q).unwrap().shape, &[64, 64]);
    assert!(matches!(
        plain.get(q),
        Err(ModelError::MissingTensor { .. })
    ));
}
