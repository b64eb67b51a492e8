//! FP8 checkpoints (`quantization_config` with `quant_method` `fp8` or `compressed-tensors`)
//! load by dequantizing their float8 weights: stories260K's linear weights are quantized here
//! to E4M3 with power-of-two scales (so each dequantized value is exact in every dtype), and
//! the FP8 checkpoint must give bit for bit the logits and greedy tokens of an unquantized
//! checkpoint holding those dequantized values. The quantizer below computes the E4M3 codes
//! and their values from the format's definition (OCP OFP8 v1.0), not from the loader's table.

mod common;

use baton_model::{load_model_dir, CpuModel, ModelConfig, ModelError, WeightSource};
use common::{edit_config, fake_dir, golden, prompt_logits, stories_tensors, write_safetensors};
use safetensors::Dtype;
use serde_json::json;

type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// The linear weights of a layer, the ones FP8 checkpoints quantize.
const LINEAR: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Rounds `x` (already divided by its scale) to the nearest E4M3 value, saturating at ±448:
/// its code and the value the code means, computed as `m * 2^(e - 3)` over the integer
/// significand `m` (8..=15 for normals, 0..=7 scaled by 2^-9 for subnormals).
fn e4m3(x: f32) -> (u8, f32) {
    let sign = if x < 0.0 { 0x80u8 } else { 0 };
    let s = if x < 0.0 { -1.0 } else { 1.0 };
    let a = x.abs().min(448.0);
    if a < 2f32.powi(-6) {
        let m = (a / 2f32.powi(-9)).round() as u8; // 0..=8; 8 is the smallest normal.
        return (sign | m, s * f32::from(m) * 2f32.powi(-9));
    }
    let mut e = a.log2().floor() as i32;
    let mut m = (a / 2f32.powi(e - 3)).round() as u32; // 8..=16
    if m == 16 {
        m = 8;
        e += 1;
    }
    let code = sign | (((e + 7) as u8) << 3) | (m as u8 - 8);
    (code, s * m as f32 * 2f32.powi(e - 3))
}

/// The power of two that maps a group's largest magnitude to at most 448.
fn pow2_scale(values: impl Iterator<Item = f32>) -> f32 {
    let max = values.fold(0.0f32, |m, x| m.max(x.abs()));
    if max == 0.0 {
        1.0
    } else {
        2f32.powi((max / 448.0).log2().ceil() as i32)
    }
}

/// How a test checkpoint scales each weight.
#[derive(Clone, Copy)]
enum Scales {
    Tensor,
    Channel,
    Block(usize, usize),
}

/// Quantizes a `[rows, cols]` f32 weight: its E4M3 codes, its scale tensor (shape, values)
/// and the dequantized values `code value * scale`.
fn quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    how: Scales,
) -> (Vec<u8>, Vec<usize>, Vec<f32>, Vec<f32>) {
    let (bn, bk) = match how {
        Scales::Tensor => (rows, cols),
        Scales::Channel => (1, cols),
        Scales::Block(bn, bk) => (bn, bk),
    };
    let (sr, sc) = (rows.div_ceil(bn), cols.div_ceil(bk));
    let mut scales = vec![0.0f32; sr * sc];
    for (i, s) in scales.iter_mut().enumerate() {
        let (br, bc) = (i / sc, i % sc);
        *s = pow2_scale(
            (br * bn..((br + 1) * bn).min(rows))
                .flat_map(|r| (bc * bk..((bc + 1) * bk).min(cols)).map(move |c| w[r * cols + c])),
        );
    }
    let mut codes = Vec::with_capacity(w.len());
    let mut deq = Vec::with_capacity(w.len());
    for r in 0..rows {
        for c in 0..cols {
            let s = scales[(r / bn) * sc + c / bk];
            let (code, v) = e4m3(w[r * cols + c] / s);
            codes.push(code);
            deq.push(v * s);
        }
    }
    let shape = match how {
        Scales::Tensor => vec![],
        Scales::Channel => vec![rows, 1],
        Scales::Block(..) => vec![sr, sc],
    };
    (codes, shape, scales, deq)
}

fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| match dtype {
            Dtype::F32 => x.to_le_bytes().to_vec(),
            Dtype::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
            _ => half::f16::from_f32(x).to_le_bytes().to_vec(),
        })
        .collect()
}

/// An FP8 copy of stories260K and the unquantized checkpoint of its dequantized values, both
/// in `dtype` (the unquantized tensors and the scales) with config.json's `torch_dtype` and
/// `quantization_config` set. Layers in `skip` stay unquantized (vLLM's `ignored_layers`).
/// `scale_name` is `weight_scale` or `weight_scale_inv`.
fn checkpoints(
    tag: &str,
    how: Scales,
    scale_name: &str,
    dtype: Dtype,
    quantization_config: serde_json::Value,
    skip: &[usize],
) -> (common::TempDir, common::TempDir) {
    let (fp8, reference) = (
        fake_dir(&format!("{tag}-fp8")),
        fake_dir(&format!("{tag}-ref")),
    );
    let mut q: Vec<Owned> = Vec::new();
    let mut r: Vec<Owned> = Vec::new();
    for (name, _, shape, bytes) in stories_tensors() {
        let w = f32s(&bytes);
        let layer: Option<usize> = name
            .strip_prefix("model.layers.")
            .and_then(|x| x.split('.').next())
            .and_then(|i| i.parse().ok());
        let linear = LINEAR
            .iter()
            .any(|l| name.ends_with(&format!("{l}.weight")));
        if !linear || layer.is_some_and(|l| skip.contains(&l)) {
            q.push((name.clone(), dtype, shape.clone(), encode(&w, dtype)));
            r.push((name, dtype, shape, encode(&w, dtype)));
            continue;
        }
        let (codes, scale_shape, scales, deq) = quantize(&w, shape[0], shape[1], how);
        let base = name.strip_suffix(".weight").unwrap();
        q.push((name.clone(), Dtype::F8_E4M3, shape.clone(), codes));
        q.push((
            format!("{base}.{scale_name}"),
            dtype,
            scale_shape,
            encode(&scales, dtype),
        ));
        // A static activation scale, which the dequantized model does not use.
        q.push((
            format!("{base}.input_scale"),
            Dtype::F32,
            vec![],
            1f32.to_le_bytes().to_vec(),
        ));
        r.push((name, dtype, shape, encode(&deq, dtype)));
    }
    write_safetensors(&fp8, "model.safetensors", &q);
    write_safetensors(&reference, "model.safetensors", &r);
    let torch_dtype = match dtype {
        Dtype::F32 => "float32",
        Dtype::BF16 => "bfloat16",
        _ => "float16",
    };
    edit_config(&fp8, |c| {
        c.insert("torch_dtype".into(), torch_dtype.into());
        c.insert("quantization_config".into(), quantization_config);
    });
    edit_config(&reference, |c| {
        c.insert("torch_dtype".into(), torch_dtype.into());
    });
    (fp8, reference)
}

fn cpu(dir: &std::path::Path) -> CpuModel {
    load_model_dir(dir).expect("loads").into_cpu_model().0
}

fn bits(v: Vec<f32>) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The FP8 checkpoint gives the reference's logits bit for bit through both loads (whole
/// model, and layer by layer from the mapped source as the worker does), and the same
/// greedy tokens for every golden prompt; and quantizing changed the model (its logits are
/// not the original's), so the comparison is not between two unquantized models.
fn assert_same_model(fp8: &std::path::Path, reference: &std::path::Path) {
    let g = golden();
    let (q, r) = (cpu(fp8), cpu(reference));
    let cfg =
        ModelConfig::from_json_str(&std::fs::read_to_string(fp8.join("config.json")).unwrap())
            .unwrap();
    assert!(cfg.quantization.is_some());
    let mapped =
        CpuModel::from_source(cfg.clone(), &WeightSource::open_for(fp8, &cfg).unwrap()).unwrap();
    for p in &g.prompts {
        let want = bits(prompt_logits(&r, &p.prompt_ids));
        assert!(
            bits(prompt_logits(&q, &p.prompt_ids)) == want,
            "{fp8:?}: logits differ"
        );
        assert!(
            bits(prompt_logits(&mapped, &p.prompt_ids)) == want,
            "{fp8:?}: mapped differs"
        );
        let pages: Vec<u32> = (0..16).collect();
        let (a, _) = common::greedy_alone(&q, &p.prompt_ids, 32, 16, &pages, 16);
        let (b, _) = common::greedy_alone(&r, &p.prompt_ids, 32, 16, &pages, 16);
        assert_eq!(a, b, "{fp8:?}: greedy tokens differ");
    }
    let original = cpu(&common::model_dir());
    let p = &g.prompts[0].prompt_ids;
    assert_ne!(prompt_logits(&q, p), prompt_logits(&original, p));
}

#[test]
fn block_scaled_fp8_checkpoints_load_as_their_dequantized_values() {
    // DeepSeek-V3 / Qwen3-FP8 layout: `weight_scale_inv` per [32, 32] block (172 columns and
    // rows leave partial blocks), f32 model.
    let (fp8, reference) = checkpoints(
        "block",
        Scales::Block(32, 32),
        "weight_scale_inv",
        Dtype::F32,
        json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [32, 32]}),
        &[],
    );
    assert_same_model(&fp8, &reference);
}

#[test]
fn compressed_tensors_channel_and_tensor_scales_load_as_their_dequantized_values() {
    // llm-compressor's FP8-dynamic (per output row, bf16 scales) and FP8 (per tensor, static
    // input scales) schemes; layer 1 left unquantized as an `ignore` entry would.
    for (tag, how, strategy) in [
        ("channel", Scales::Channel, "channel"),
        ("tensor", Scales::Tensor, "tensor"),
    ] {
        let (fp8, reference) = checkpoints(
            tag,
            how,
            "weight_scale",
            Dtype::BF16,
            json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                   "quantization_status": "compressed", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"],
                       "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                   "symmetric": true, "dynamic": false},
                       "input_activations": {"num_bits": 8, "type": "float",
                                             "strategy": "token", "dynamic": true}}}}),
            &[1],
        );
        assert_same_model(&fp8, &reference);
    }
}

#[test]
fn f16_models_dequantize_to_f16_and_others_to_f32() {
    let (fp8, reference) = checkpoints(
        "f16",
        Scales::Tensor,
        "weight_scale",
        Dtype::F16,
        json!({"quant_method": "fp8", "activation_scheme": "static"}),
        &[],
    );
    let cfg =
        ModelConfig::from_json_str(&std::fs::read_to_string(fp8.join("config.json")).unwrap())
            .unwrap();
    let src = WeightSource::open_for(&fp8, &cfg).unwrap();
    let t = src.get("model.layers.0.mlp.down_proj.weight").unwrap();
    assert_eq!(t.dtype, baton_model::DType::F16);
    assert_same_model(&fp8, &reference);
    // A torch_dtype that names no 16-bit dtype dequantizes to f32 (as such a checkpoint's
    // unquantized weights are computed).
    for dtype in [Some("float64"), None] {
        edit_config(&fp8, |c| match dtype {
            Some(d) => {
                c.insert("torch_dtype".into(), d.into());
            }
            None => {
                c.remove("torch_dtype");
            }
        });
        let cfg = cfg_of(&fp8);
        let src = WeightSource::open_for(&fp8, &cfg).unwrap();
        let t = src.get("model.layers.0.mlp.down_proj.weight").unwrap();
        assert_eq!(t.dtype, baton_model::DType::F32, "{dtype:?}");
    }
}

fn load_error(dir: &std::path::Path) -> String {
    match load_model_dir(dir) {
        Ok(_) => panic!("{dir:?} loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_fp8_checkpoints_are_refused_naming_the_tensor_or_field() {
    let block = json!({"quant_method": "fp8", "weight_block_size": [32, 32]});
    let (fp8, _) = checkpoints(
        "bad",
        Scales::Block(32, 32),
        "weight_scale_inv",
        Dtype::F32,
        block,
        &[],
    );
    let tensors = || -> Vec<Owned> {
        let bytes = std::fs::read(fp8.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors()
            .into_iter()
            .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
            .collect()
    };
    let rewrite = |f: &dyn Fn(&mut Vec<Owned>)| {
        let d = fake_dir("bad-variant");
        let mut t = tensors();
        f(&mut t);
        write_safetensors(&d, "model.safetensors", &t);
        std::fs::copy(fp8.join("config.json"), d.join("config.json")).unwrap();
        d
    };
    let down = "model.layers.2.mlp.down_proj";
    let (weight, scale) = (format!("{down}.weight"), format!("{down}.weight_scale_inv"));
    // The load error of the checkpoint with tensor `name` changed by `f`.
    let broken = |name: &str, f: &dyn Fn(&mut Owned)| {
        load_error(&rewrite(&|t| {
            f(t.iter_mut().find(|x| x.0 == name).expect("the tensor"))
        }))
    };

    // A weight without its scales.
    let e = load_error(&rewrite(&|t| t.retain(|x| x.0 != scale)));
    assert!(
        e.contains(&format!("`{weight}`")) && e.contains("weight_scale"),
        "{e}"
    );

    // Scales of a shape that fits no layout (down_proj is [64, 172]: blocks are [2, 6]).
    let e = broken(&scale, &|s| {
        s.2 = vec![2, 3];
        s.3.truncate(6 * 4);
    });
    assert!(e.contains("[2, 6]") && e.contains("[2, 3]"), "{e}");

    // A scale of zero (or NaN) would silently zero (or poison) the weight.
    let e = broken(&scale, &|s| s.3[..4].copy_from_slice(&0f32.to_le_bytes()));
    assert!(e.contains("finite and positive"), "{e}");

    // A NaN code (0x7f) in a weight, or a scale whose product overflows f32 (448 * 3e38),
    // would run as NaN logits.
    let e = broken(&weight, &|w| w.3[5] = 0x7f);
    assert!(
        e.contains("[0, 5]") && e.contains("NaN") && e.contains("corrupt"),
        "{e}"
    );
    let e = broken(&scale, &|s| {
        s.3[..4].copy_from_slice(&3e38f32.to_le_bytes())
    });
    assert!(e.contains("inf") && e.contains("cannot hold"), "{e}");

    // Both scale names: which one applies is ambiguous.
    let e = load_error(&rewrite(&|t| {
        let s = t.iter().find(|x| x.0 == scale).unwrap().clone();
        t.push((format!("{down}.weight_scale"), s.1, s.2, s.3));
    }));
    assert!(e.contains("both") && e.contains("ambiguous"), "{e}");

    // A 3-D float8 weight takes one scale, and says so.
    let e = broken(&weight, &|w| w.2 = vec![64, 172, 1]);
    assert!(e.contains("[64, 172, 1] takes one scale"), "{e}");

    // A float8 tensor that is not a weight (a scale stored as F8) is named as such, not as a
    // checkpoint without a quantization_config.
    let e = broken(&scale, &|s| {
        s.1 = Dtype::F8_E4M3;
        s.3 = vec![0x38; 12];
    });
    assert!(e.contains("float8 is read only as the `*.weight`"), "{e}");

    // Float8 tensors without a quantization_config.
    edit_config(&fp8, |c| {
        c.remove("quantization_config");
    });
    let e = load_error(&fp8);
    assert!(
        e.contains("quantization_config") && e.contains("F8_E4M3"),
        "{e}"
    );
    // The check of the names alone (the scheduler's) says the same, not "unused tensors".
    let src = WeightSource::open_for(&fp8, &cfg_of(&fp8)).unwrap();
    let e = src
        .check_tensor_names(&cfg_of(&fp8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("quantization_config"), "{e}");
}

fn cfg_of(dir: &std::path::Path) -> ModelConfig {
    ModelConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn quantization_methods_other_than_fp8_are_refused_at_config() {
    let base = std::fs::read_to_string(common::model_dir().join("config.json")).unwrap();
    let with = |q: serde_json::Value| {
        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["quantization_config"] = q;
        ModelConfig::from_json_str(&v.to_string())
    };
    let refused = |q: serde_json::Value, field: &str| match with(q.clone()) {
        Err(ModelError::InvalidField {
            field: f, reason, ..
        }) => {
            assert_eq!(f, field, "{q}: {reason}");
            reason
        }
        other => panic!("{q}: {other:?}"),
    };
    let r = refused(
        json!({"quant_method": "gptq", "bits": 4}),
        "quantization_config.quant_method",
    );
    assert!(r.contains("\"gptq\"") && r.contains("FP8"), "{r}");
    refused(
        json!({"quant_method": "awq"}),
        "quantization_config.quant_method",
    );
    assert!(matches!(
        with(json!({"weight_block_size": [128, 128]})),
        Err(ModelError::MissingField { field, .. }) if field == "quantization_config.quant_method"
    ));
    refused(
        json!({"quant_method": "fp8", "fmt": "e5m2"}),
        "quantization_config.fmt",
    );
    refused(
        json!({"quant_method": "fp8", "weight_block_size": [128]}),
        "quantization_config.weight_block_size",
    );
    let int4 = json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}});
    refused(int4, "quantization_config.format");
    let int8 = json!({"quant_method": "compressed-tensors",
                      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}});
    let r = refused(int8, "quantization_config.config_groups.g.weights");
    assert!(r.contains("8 bits of type int"), "{r}");
    let group = json!({"quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}});
    refused(
        group,
        "quantization_config.config_groups.g.weights.strategy",
    );
    // Accepted: FP8 configs, and a null quantization_config (no quantization).
    let block = with(json!({"quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                            "block_structure": [128, 128]}}}}))
    .unwrap();
    assert_eq!(block.quantization.unwrap().block, Some([128, 128]));
    assert!(with(serde_json::Value::Null)
        .unwrap()
        .quantization
        .is_none());
    assert!(with(json!({"quant_method": "fp8"}))
        .unwrap()
        .quantization
        .unwrap()
        .block
        .is_none());
    assert!(with(json!({"quant_method": "fp8", "fmt": "E4M3"})).is_ok());
}
