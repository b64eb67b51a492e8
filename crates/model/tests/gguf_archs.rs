//! GGUF files of the `phi3`, `gemma3`, `qwen2moe` and `qwen3moe` architectures and Mixtral
//! (`llama` with experts; stacked, and one tensor per expert as older files have them),
//! written here as llama.cpp's `convert_hf_to_gguf.py` lays them out (`Phi3MiniModel`: fused
//! `attn_qkv` and `ffn_up` = gate and up, LongRoPE factors as `rope_factors_{long,short}.weight`;
//! `Qwen2MoeModel`: each layer's experts stacked into `ffn_{gate,up,down}_exps.weight`, the
//! router as `ffn_gate_inp`, Qwen2-MoE's shared expert as `*_shexp`; `Gemma3Model`: norms plus
//! 1; `--fuse-qkv`: one `attn_qkv` a layer), must serve the Hugging Face checkpoint they came
//! from: the same config, the same tensors bit for bit under the same names (Gemma 3's norms:
//! stored plus 1, served less 1), the same logits. A helper checked files from the real
//! converter the same way (NOTES.md, session 38).

mod common;

use baton_model::gguf::{self, GgufFile, GgufValue};
use baton_model::gguf_quant::GgmlType;
use baton_model::{CpuModel, DType, ModelConfig, WeightSource};
use common::*;
use std::path::{Path, PathBuf};

/// ggml's type id of F32.
const F32: u32 = 0;

/// The stories260K GGUF's `tokenizer.*` metadata (its SentencePiece vocabulary of 512).
fn tokenizer_meta() -> Vec<(String, GgufValue)> {
    let f = model_dir().join("../stories260K-gguf/stories260K-f32.gguf");
    let g = GgufFile::open(&f).unwrap();
    g.metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// `general.architecture` and `{arch}.{key}` entries, then the tokenizer's.
fn metadata(arch: &str, keys: &[(&str, GgufValue)]) -> Vec<(String, GgufValue)> {
    let mut m = vec![("general.architecture".into(), GgufValue::Str(arch.into()))];
    m.extend(keys.iter().map(|(k, v)| (format!("{arch}.{k}"), v.clone())));
    m.extend(tokenizer_meta());
    m
}

/// An F32 tensor of row-major `shape` (outermost first) as the file stores it.
fn f32_tensor(name: &str, shape: &[usize], bytes: Vec<u8>) -> GgufTensor {
    let dims = shape.iter().rev().map(|&d| d as u64).collect();
    (name.into(), dims, F32, bytes)
}

/// llama.cpp's name of a Hugging Face layer tensor (`tensor_mapping.py`), for the dense and
/// router parts (experts are merged by the callers).
fn gguf_layer_name(hf: &str) -> String {
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let (stem, suffix) = part.rsplit_once('.').unwrap();
    let g = match stem {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" => "ffn_gate_inp",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{g}.{suffix}")
}

// ---------------------------------------------------------------------------------------------
// phi3

/// stories260K as a phi3 GGUF: q, k, v rows fused into `attn_qkv` (unpermuted: Phi-3's RoPE is
/// NeoX-style), gate and up into `ffn_up`, with `keys` added to the architecture's metadata
/// and `extra` tensors.
fn phi3_gguf(path: &Path, keys: &[(&str, GgufValue)], extra: Vec<GgufTensor>) {
    let hf = stories_tensors();
    let get = |n: &str| {
        hf.iter()
            .find(|t| t.0 == n)
            .unwrap_or_else(|| panic!("{n}"))
    };
    let mut tensors = vec![
        f32_tensor(
            "token_embd.weight",
            &[512, 64],
            get("model.embed_tokens.weight").3.clone(),
        ),
        f32_tensor(
            "output_norm.weight",
            &[64],
            get("model.norm.weight").3.clone(),
        ),
    ];
    for i in 0..5 {
        let p = format!("model.layers.{i}.");
        let cat = |parts: &[&str]| -> (usize, Vec<u8>) {
            let ts: Vec<_> = parts.iter().map(|s| get(&format!("{p}{s}"))).collect();
            (
                ts.iter().map(|t| t.2[0]).sum(),
                ts.iter().flat_map(|t| t.3.clone()).collect(),
            )
        };
        let (qkv_rows, qkv) = cat(&[
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ]);
        let (gate_up_rows, gate_up) = cat(&["mlp.gate_proj.weight", "mlp.up_proj.weight"]);
        let one = |s: &str| get(&format!("{p}{s}"));
        let b = format!("blk.{i}.");
        tensors.extend([
            f32_tensor(
                &format!("{b}attn_norm.weight"),
                &[64],
                one("input_layernorm.weight").3.clone(),
            ),
            f32_tensor(&format!("{b}attn_qkv.weight"), &[qkv_rows, 64], qkv),
            f32_tensor(
                &format!("{b}attn_output.weight"),
                &[64, 64],
                one("self_attn.o_proj.weight").3.clone(),
            ),
            f32_tensor(
                &format!("{b}ffn_norm.weight"),
                &[64],
                one("post_attention_layernorm.weight").3.clone(),
            ),
            f32_tensor(&format!("{b}ffn_up.weight"), &[gate_up_rows, 64], gate_up),
            f32_tensor(
                &format!("{b}ffn_down.weight"),
                &[64, 172],
                one("mlp.down_proj.weight").3.clone(),
            ),
        ]);
    }
    tensors.extend(extra);
    let mut all = vec![
        ("context_length", GgufValue::U32(512)),
        ("embedding_length", GgufValue::U32(64)),
        ("feed_forward_length", GgufValue::U32(172)),
        ("block_count", GgufValue::U32(5)),
        ("attention.head_count", GgufValue::U32(8)),
        ("attention.head_count_kv", GgufValue::U32(4)),
        ("attention.layer_norm_rms_epsilon", GgufValue::F32(1e-5)),
        ("rope.freq_base", GgufValue::F32(10000.0)),
        ("rope.dimension_count", GgufValue::U32(8)),
        ("rope.scaling.original_context_length", GgufValue::U32(512)),
        ("attention.sliding_window", GgufValue::U32(0)),
    ];
    for (k, v) in keys {
        all.retain(|(a, _)| a != k);
        all.push((k, v.clone()));
    }
    write_gguf(path, &metadata("phi3", &all), &tensors);
}

#[test]
fn a_phi3_gguf_serves_the_fused_checkpoints_parts_and_the_goldens() {
    let tmp = temp_dir("gguf-phi3");
    let file = tmp.join("phi3.gguf");
    phi3_gguf(&file, &[], vec![]);
    let (cfg, src) = open_prepared(&file, &tmp.join("cache"));
    assert_eq!(cfg.model_type, "phi3");
    assert!(cfg.fused_projections);
    assert_eq!(cfg.sliding_window, vec![None; 5], "0 is no window");
    // Every Hugging Face tensor of stories260K, split back out of the fused ones.
    let hf_cfg = ModelConfig::from_file(&model_dir().join("config.json")).unwrap();
    let hf = WeightSource::open_for(&model_dir(), &hf_cfg).unwrap();
    for n in hf.tensor_names() {
        let (a, b) = (hf.get(n).unwrap(), src.get(n).unwrap());
        assert_eq!(a.shape, b.shape, "{n}");
        assert!(a.bytes == b.bytes, "{n} differs");
    }
    src.check_tensor_names(&cfg).unwrap();
    let model = CpuModel::from_source(cfg, &src).unwrap();
    for p in golden().prompts {
        let pages: Vec<u32> = (0..8).collect();
        let (ids, _) = greedy_alone(&model, &p.prompt_ids, p.greedy_ids.len(), 16, &pages, 8);
        assert_eq!(ids, p.greedy_ids, "{:?}", p.prompt);
    }
}

#[test]
fn a_phi3_ggufs_longrope_partial_rotary_and_window_give_the_hugging_face_config() {
    let tmp = temp_dir("gguf-phi3-rope");
    let (long, short) = ([1.0f32, 4.5], [1.0f32, 1.25]);
    let factors = |name: &str, v: &[f32]| {
        f32_tensor(name, &[2], v.iter().flat_map(|x| x.to_le_bytes()).collect())
    };
    let keys = [
        ("context_length", GgufValue::U32(2048)),
        ("rope.dimension_count", GgufValue::U32(4)),
        ("rope.scaling.attn_factor", GgufValue::F32(1.1)),
        ("attention.sliding_window", GgufValue::U32(256)),
    ];
    let extra = || {
        vec![
            factors("rope_factors_long.weight", &long),
            factors("rope_factors_short.weight", &short),
        ]
    };
    let file = tmp.join("phi3-longrope.gguf");
    phi3_gguf(&file, &keys, extra());
    let p = gguf::prepare_dir(&file, &tmp.join("cache")).unwrap();
    let ours = ModelConfig::from_file(&p.dir.join("config.json")).unwrap();
    // The config.json of such a Phi-3 checkpoint.
    let theirs = ModelConfig::from_json_str(
        &serde_json::json!({
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64,
            "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 2048,
            "original_max_position_embeddings": 512, "vocab_size": 512,
            "rms_norm_eps": 1e-5f32 as f64, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "rope_scaling": {"type": "longrope", "long_factor": long, "short_factor": short,
                             "attention_factor": 1.1f32 as f64},
            "sliding_window": 256, "tie_word_embeddings": true, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "float32"
        })
        .to_string(),
    )
    .unwrap();
    assert_eq!(ours, theirs);
    assert_eq!(ours.rotary_dim, 4);
    assert_eq!(ours.sliding_window, vec![Some(256); 5]);
    // One factor tensor without the other, or factors in another architecture, are refused.
    let lone = tmp.join("lone.gguf");
    phi3_gguf(&lone, &keys, extra().split_off(1));
    let e = gguf::prepare_dir(&lone, &tmp.join("cache"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rope_factors_long.weight") && e.contains("pair"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// qwen2moe / qwen3moe

/// A tensor's Hugging Face name, row-major shape and values.
type Values = (String, Vec<usize>, Vec<f32>);

/// Deterministic values for tensor `name` of `shape`: uniform in ±`scale` (norm weights
/// around 1), from an FNV-seeded xorshift stream.
fn values(name: &str, shape: &[usize]) -> Vec<f32> {
    let mut s = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let n: usize = shape.iter().product();
    let norm = name.contains("norm");
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if norm {
                1.0 + 0.2 * u
            } else {
                0.3 * u
            }
        })
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small mixture-of-experts checkpoint: its config.json value and every tensor (Hugging
/// Face name, shape, values).
fn moe_checkpoint(model_type: &str) -> (serde_json::Value, Vec<Values>) {
    let qwen2 = model_type == "qwen2_moe";
    let arch = match model_type {
        "qwen2_moe" => "Qwen2MoeForCausalLM",
        "qwen3_moe" => "Qwen3MoeForCausalLM",
        _ => "MixtralForCausalLM",
    };
    let mut c = serde_json::json!({
        "architectures": [arch], "model_type": model_type, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "vocab_size": 512, "rms_norm_eps": 1e-6f32 as f64, "rope_theta": 1000000.0,
        "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": !qwen2,
        "mlp_only_layers": if qwen2 { vec![1] } else { vec![] },
    });
    if qwen2 {
        c["shared_expert_intermediate_size"] = 48.into();
    }
    if model_type == "mixtral" {
        let o = c.as_object_mut().unwrap();
        for k in [
            "num_experts",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "norm_topk_prob",
            "mlp_only_layers",
        ] {
            o.remove(k);
        }
        o.insert("num_local_experts".into(), 4.into());
        o.insert("intermediate_size".into(), 32.into());
        o.insert("sliding_window".into(), serde_json::Value::Null);
    }
    checkpoint(c)
}

/// The checkpoint of config.json `c`: every tensor the model reads ([`values`] for each).
fn checkpoint(c: serde_json::Value) -> (serde_json::Value, Vec<Values>) {
    let cfg = ModelConfig::from_json_str(&c.to_string()).unwrap();
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut shapes = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        shapes.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    for i in 0..cfg.num_hidden_layers {
        shapes.extend(baton_model::weights::layer_tensor_shapes(&cfg, i));
    }
    let tensors = shapes
        .into_iter()
        .map(|(n, s)| {
            let v = values(&n, &s);
            (n, s, v)
        })
        .collect();
    (c, tensors)
}

/// The Hugging Face directory of a checkpoint of `tensors` (stories260K's tokenizer).
fn hf_dir(tag: &str, config: &serde_json::Value, tensors: &[Values]) -> TempDir {
    let d = fake_dir(tag);
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    let owned: Vec<OwnedTensor> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), safetensors::Dtype::F32, s.clone(), bytes(v)))
        .collect();
    write_safetensors(&d, "model.safetensors", &owned);
    d
}

/// How [`moe_gguf`] stores the experts.
#[derive(Clone, Copy, PartialEq)]
enum Experts {
    /// Stacked per layer and projection, F32 (`convert_hf_to_gguf.py` today).
    Stacked,
    /// Stacked, Q8_0.
    StackedQ8_0,
    /// One tensor per expert, `blk.{i}.ffn_gate.{e}.weight` (Mixtral files converted before
    /// llama.cpp stacked them).
    Separate,
}

/// llama.cpp's `permute` of q or k rows for its interleaved RoPE (`LlamaModel.permute`):
/// within each head of `d` rows, row `2i + j` holds Hugging Face's row `j d/2 + i`.
fn permute(v: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let d = v.len() / cols / heads;
    let mut out = Vec::with_capacity(v.len());
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let r = h * d + j * d / 2 + i;
                out.extend_from_slice(&v[r * cols..(r + 1) * cols]);
            }
        }
    }
    out
}

/// [`moe_checkpoint`] as llama.cpp writes it: each layer's experts stacked per projection
/// (`[experts, rows, cols]`, expert 0 first) or separate as `experts` says; Qwen2-MoE's
/// shared expert gate as llama.cpp reads it, `{hidden}`; Mixtral as a `llama` file, its q and
/// k rows permuted.
fn moe_gguf(
    path: &Path,
    config: &serde_json::Value,
    tensors: &[Values],
    experts: Experts,
    fuse_qkv: bool,
) {
    let mixtral = config["model_type"] == "mixtral";
    let arch = match config["model_type"].as_str().unwrap() {
        "qwen2_moe" => "qwen2moe",
        "qwen3_moe" => "qwen3moe",
        _ => "llama",
    };
    let get = |n: &str| {
        tensors
            .iter()
            .find(|t| t.0 == n)
            .unwrap_or_else(|| panic!("{n}"))
    };
    let mut out = vec![
        f32_tensor(
            "token_embd.weight",
            &[512, 64],
            bytes(&get("model.embed_tokens.weight").2),
        ),
        f32_tensor(
            "output_norm.weight",
            &[64],
            bytes(&get("model.norm.weight").2),
        ),
        f32_tensor("output.weight", &[512, 64], bytes(&get("lm_head.weight").2)),
    ];
    let heads = |k: &str| config[k].as_u64().unwrap() as usize;
    for (n, s, v) in tensors {
        if !n.starts_with("model.layers.") || n.contains(".experts.") {
            continue;
        }
        let mut shape = s.clone();
        if n.ends_with("shared_expert_gate.weight") {
            shape = vec![s[1]];
        }
        let v = match (mixtral, n.rsplit('.').nth(1)) {
            (true, Some("q_proj")) => permute(v, heads("num_attention_heads"), s[1]),
            (true, Some("k_proj")) => permute(v, heads("num_key_value_heads"), s[1]),
            _ => v.clone(),
        };
        let qkv = [".q_proj.", ".k_proj.", ".v_proj."];
        if fuse_qkv && qkv.iter().any(|p| n.contains(p)) {
            continue;
        }
        let name = gguf_layer_name(&n.replace("block_sparse_moe.gate", "mlp.gate"));
        out.push(f32_tensor(&name, &shape, bytes(&v)));
    }
    // `--fuse-qkv`: each layer's q, k and v rows (and biases) as one `attn_qkv` tensor.
    for i in 0..3 {
        for suffix in ["weight", "bias"] {
            if !fuse_qkv {
                continue;
            }
            let parts: Vec<_> = ["q", "k", "v"]
                .iter()
                .filter_map(|p| {
                    let want = format!("model.layers.{i}.self_attn.{p}_proj.{suffix}");
                    tensors.iter().find(|t| t.0 == want)
                })
                .collect();
            if parts.is_empty() {
                continue;
            }
            let mut shape = parts[0].1.clone();
            shape[0] = parts.iter().map(|t| t.1[0]).sum();
            let all: Vec<f32> = parts.iter().flat_map(|t| t.2.clone()).collect();
            out.push(f32_tensor(
                &format!("blk.{i}.attn_qkv.{suffix}"),
                &shape,
                bytes(&all),
            ));
        }
    }
    for i in 0..3 {
        for (proj, hf) in [
            ("gate", "gate_proj"),
            ("up", "up_proj"),
            ("down", "down_proj"),
        ] {
            let hf = match (mixtral, hf) {
                (false, _) => format!("mlp.experts.{{}}.{hf}"),
                (true, "gate_proj") => "block_sparse_moe.experts.{}.w1".into(),
                (true, "up_proj") => "block_sparse_moe.experts.{}.w3".into(),
                (true, _) => "block_sparse_moe.experts.{}.w2".into(),
            };
            let parts: Vec<_> = (0..4)
                .map_while(|e| {
                    let want = format!(
                        "model.layers.{i}.{}.weight",
                        hf.replace("{}", &e.to_string())
                    );
                    tensors.iter().find(|t| t.0 == want)
                })
                .collect();
            if parts.is_empty() {
                continue;
            }
            let (rows, cols) = (parts[0].1[0], parts[0].1[1]);
            if experts == Experts::Separate {
                for (e, t) in parts.iter().enumerate() {
                    let name = format!("blk.{i}.ffn_{proj}.{e}.weight");
                    out.push(f32_tensor(&name, &[rows, cols], bytes(&t.2)));
                }
                continue;
            }
            let all: Vec<f32> = parts.iter().flat_map(|t| t.2.clone()).collect();
            let name = format!("blk.{i}.ffn_{proj}_exps.weight");
            let dims = vec![cols as u64, rows as u64, parts.len() as u64];
            out.push(if experts == Experts::StackedQ8_0 {
                (name, dims, Q8_0, quantize_q8_0(&all))
            } else {
                (name, dims, F32, bytes(&all))
            });
        }
    }
    let c = |k: &str| GgufValue::U32(config[k].as_u64().unwrap() as u32);
    let mut keys = vec![
        ("context_length", c("max_position_embeddings")),
        ("embedding_length", c("hidden_size")),
        ("feed_forward_length", c("intermediate_size")),
        ("block_count", c("num_hidden_layers")),
        ("attention.head_count", c("num_attention_heads")),
        ("attention.head_count_kv", c("num_key_value_heads")),
        ("attention.key_length", c("head_dim")),
        ("attention.value_length", c("head_dim")),
        ("attention.layer_norm_rms_epsilon", GgufValue::F32(1e-6)),
        ("rope.freq_base", GgufValue::F32(1000000.0)),
        ("expert_used_count", c("num_experts_per_tok")),
    ];
    if mixtral {
        keys.push(("expert_count", c("num_local_experts")));
    } else {
        keys.push(("expert_count", c("num_experts")));
        keys.push(("expert_feed_forward_length", c("moe_intermediate_size")));
    }
    if arch == "qwen2moe" {
        keys.push((
            "expert_shared_feed_forward_length",
            c("shared_expert_intermediate_size"),
        ));
    }
    write_gguf(path, &metadata(arch, &keys), &out);
}

/// Bit-equal configs, tensors and logits between the checkpoint and its GGUF.
fn check_moe_gguf(model_type: &str, experts: Experts, fuse_qkv: bool) {
    let (config, tensors) = moe_checkpoint(model_type);
    let hf_dir = hf_dir(&format!("gguf-{model_type}-hf"), &config, &tensors);
    let tmp = temp_dir(&format!("gguf-{model_type}"));
    let file = tmp.join("moe.gguf");
    moe_gguf(&file, &config, &tensors, experts, fuse_qkv);
    let (cfg, src) = open_prepared(&file, &tmp.join("cache"));
    let hf_cfg = ModelConfig::from_file(&hf_dir.join("config.json")).unwrap();
    assert_eq!(cfg, hf_cfg, "{model_type}: the same config");
    let moe = cfg.moe.as_ref().expect("experts");
    assert_eq!(moe.norm_topk_prob, model_type != "qwen2_moe");
    let hf = WeightSource::open_for(&hf_dir, &hf_cfg).unwrap();
    assert_same_tensors(&src, &hf, model_type);
    src.check_tensor_names(&cfg).unwrap();
    let prompt = [1u32, 403, 407, 261, 378, 60, 9, 287];
    let ours = prompt_logits(&CpuModel::from_source(cfg, &src).unwrap(), &prompt);
    let theirs = prompt_logits(&CpuModel::from_source(hf_cfg, &hf).unwrap(), &prompt);
    assert!(ours == theirs, "{model_type}: the same logits");
}

#[test]
fn a_qwen3moe_gguf_serves_its_checkpoints_config_experts_and_logits() {
    check_moe_gguf("qwen3_moe", Experts::Stacked, false);
}

#[test]
fn a_qwen2moe_gguf_serves_its_shared_expert_dense_layer_and_biases() {
    check_moe_gguf("qwen2_moe", Experts::Stacked, false);
}

/// `convert_hf_to_gguf.py --fuse-qkv`: q, k and v (and Qwen2's biases) in one `attn_qkv`
/// tensor a layer, served as their row ranges; refused in a file whose q/k rows llama.cpp
/// permutes (Mixtral), where the order of permutation and fusion is not pinned down.
#[test]
fn fused_qkv_tensors_are_served_as_q_k_and_v() {
    check_moe_gguf("qwen2_moe", Experts::Stacked, true);
    check_moe_gguf("qwen3_moe", Experts::Stacked, true);
    let (config, tensors) = moe_checkpoint("mixtral");
    let tmp = temp_dir("gguf-fused-mixtral");
    let file = tmp.join("fused.gguf");
    moe_gguf(&file, &config, &tensors, Experts::Stacked, true);
    let p = gguf::prepare_dir(&file, &tmp.join("cache")).unwrap();
    let cfg = ModelConfig::from_file(&p.dir.join("config.json")).unwrap();
    let e = WeightSource::open_for(&p.dir, &cfg)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--fuse-qkv"), "{e}");
}

#[test]
fn a_mixtral_gguf_serves_its_checkpoint_from_stacked_and_from_separate_experts() {
    check_moe_gguf("mixtral", Experts::Stacked, false);
    check_moe_gguf("mixtral", Experts::Separate, false);
}

#[test]
fn quantized_stacked_experts_are_served_one_dequantized_slice_per_expert() {
    let (config, tensors) = moe_checkpoint("qwen3_moe");
    let tmp = temp_dir("gguf-moe-q8");
    let file = tmp.join("moe-q8.gguf");
    moe_gguf(&file, &config, &tensors, Experts::StackedQ8_0, false);
    let (cfg, src) = open_prepared(&file, &tmp.join("cache"));
    assert_eq!(cfg.torch_dtype.as_deref(), Some("float16"));
    let mut checked = 0;
    for (n, s, v) in tensors.iter().filter(|t| t.0.contains(".mlp.experts.")) {
        // Q8_0 blocks never span rows, so expert e's slice is its own matrix quantized.
        let mut want = vec![0f32; v.len()];
        GgmlType::Q8_0
            .dequantize(&quantize_q8_0(v), &mut want)
            .unwrap();
        let got = src.get(n).unwrap();
        assert_eq!(got.dtype, DType::F16);
        assert_eq!(got.shape, &s[..], "{n}");
        let got = got.to_f32().data;
        let want: Vec<f32> = want
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        assert!(got == want, "{n}: not expert's own dequantized slice");
        checked += 1;
    }
    assert_eq!(checked, 3 * 3 * 4);
}

#[test]
fn a_stacked_experts_tensor_of_the_wrong_rank_and_lone_experts_are_refused() {
    let (config, tensors) = moe_checkpoint("qwen3_moe");
    let tmp = temp_dir("gguf-moe-bad");
    // Experts in a dense architecture.
    let file = tmp.join("bad.gguf");
    moe_gguf(&file, &config, &tensors, Experts::Stacked, false);
    let g = GgufFile::open(&file).unwrap();
    let mut meta: Vec<_> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let ts: Vec<GgufTensor> = g
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ggml_type,
                g.tensor_bytes(t).unwrap().to_vec(),
            )
        })
        .collect();
    for (k, v) in &mut meta {
        if k == "general.architecture" {
            *v = GgufValue::Str("qwen3".into());
        }
        *k = k.replace("qwen3moe.", "qwen3.");
    }
    let dense = tmp.join("dense.gguf");
    write_gguf(&dense, &meta, &ts);
    let e = gguf::prepare_dir(&dense, &tmp.join("c1"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("qwen3.expert_count"), "{e}");
    // A stacked tensor flattened to two dims.
    let mut flat = ts.clone();
    let t = flat
        .iter_mut()
        .find(|t| t.0 == "blk.0.ffn_up_exps.weight")
        .unwrap();
    t.1 = vec![t.1[0], t.1[1] * t.1[2]];
    let bad: PathBuf = tmp.join("flat.gguf");
    write_gguf(
        &bad,
        &g.metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>(),
        &flat,
    );
    let p = gguf::prepare_dir(&bad, &tmp.join("c2")).unwrap();
    let cfg = ModelConfig::from_file(&p.dir.join("config.json")).unwrap();
    let e = WeightSource::open_for(&p.dir, &cfg)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.ffn_up_exps.weight") && e.contains("[experts, rows, cols]"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// gemma3

/// A small Gemma 3 text checkpoint (sliding layers, a 4-key window, linear RoPE scaling on the
/// full layers, heads wider than hidden / heads as in Gemma 3 1B, tied embeddings):
/// config.json and every tensor.
fn gemma3_checkpoint() -> (serde_json::Value, Vec<Values>) {
    let c = serde_json::json!({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
        "vocab_size": 512, "rms_norm_eps": 1e-6f32 as f64, "rope_theta": 1000000.0,
        "rope_local_base_freq": 20000.0, "sliding_window": 4, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 32, "rope_scaling": {"type": "linear", "factor": 8.0},
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"
    });
    checkpoint(c)
}

#[test]
fn a_gemma3_gguf_serves_its_checkpoints_config_norms_and_logits() {
    let (config, tensors) = gemma3_checkpoint();
    let hf = hf_dir("gguf-gemma3-hf", &config, &tensors);
    let tmp = temp_dir("gguf-gemma3");
    // As `Gemma3Model` converts: every norm weight stored plus 1.
    let plus_one = |n: &str, v: &[f32]| -> Vec<f32> {
        if n.ends_with("norm.weight") {
            v.iter().map(|x| x + 1.0).collect()
        } else {
            v.to_vec()
        }
    };
    let mut out = vec![];
    for (n, s, v) in &tensors {
        let name = match n.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_string(),
            "model.norm.weight" => "output_norm.weight".to_string(),
            _ if n.ends_with("post_attention_layernorm.weight") => {
                gguf_layer_name(n).replace("ffn_norm", "post_attention_norm")
            }
            _ => gguf_layer_name(n),
        };
        out.push(f32_tensor(&name, s, bytes(&plus_one(n, v))));
    }
    let u = GgufValue::U32;
    let keys = [
        ("context_length", u(512)),
        ("embedding_length", u(64)),
        ("feed_forward_length", u(96)),
        ("block_count", u(6)),
        ("attention.head_count", u(4)),
        ("attention.head_count_kv", u(2)),
        ("attention.key_length", u(32)),
        ("attention.value_length", u(32)),
        ("attention.layer_norm_rms_epsilon", GgufValue::F32(1e-6)),
        ("rope.freq_base", GgufValue::F32(1000000.0)),
        ("rope.scaling.type", GgufValue::Str("linear".into())),
        ("rope.scaling.factor", GgufValue::F32(8.0)),
        ("attention.sliding_window", u(4)),
        ("rope.freq_base_swa", GgufValue::F32(20000.0)),
    ];
    let file = tmp.join("gemma3.gguf");
    write_gguf(&file, &metadata("gemma3", &keys), &out);
    // The sliding layers as llama.cpp reads them: no window (every layer full), a period, or
    // a flag per layer.
    let windows = |extra: Vec<(&str, GgufValue)>, drop_window: bool| -> Vec<Option<usize>> {
        let mut k: Vec<_> = keys
            .iter()
            .filter(|(n, _)| !(drop_window && *n == "attention.sliding_window"))
            .cloned()
            .collect();
        k.extend(extra);
        let f = tmp.join(format!(
            "gemma3-{}.gguf",
            k.len() * 2 + drop_window as usize
        ));
        write_gguf(&f, &metadata("gemma3", &k), &out);
        let p = gguf::prepare_dir(&f, &tmp.join("cache")).unwrap();
        ModelConfig::from_file(&p.dir.join("config.json"))
            .unwrap()
            .sliding_window
    };
    assert_eq!(windows(vec![], true), vec![None; 6], "no window");
    let pattern = ("attention.sliding_window_pattern", u(3));
    let w = Some(4);
    assert_eq!(windows(vec![pattern], false), vec![w, w, None, w, w, None]);
    let flags = [true, false, false, true, true, false]
        .map(GgufValue::Bool)
        .to_vec();
    let per_layer = ("attention.sliding_window_pattern", GgufValue::Array(flags));
    assert_eq!(
        windows(vec![per_layer], false),
        vec![w, None, None, w, w, None]
    );
    let p = gguf::prepare_dir(&file, &tmp.join("cache")).unwrap();
    let why = p.tokenizer_error.expect("the tokenizer is not converted");
    assert!(why.contains("--tokenizer"), "{why}");
    let cfg = ModelConfig::from_file(&p.dir.join("config.json")).unwrap();
    let hf_cfg = ModelConfig::from_file(&hf.join("config.json")).unwrap();
    assert_eq!(cfg, hf_cfg);
    let src = WeightSource::open_for(&p.dir, &cfg).unwrap();
    let theirs = WeightSource::open_for(&hf, &hf_cfg).unwrap();
    let names: Vec<_> = theirs.tensor_names().map(str::to_owned).collect();
    assert_eq!(src.tensor_names().collect::<Vec<_>>(), names);
    let mut norms = 0;
    for n in &names {
        let (a, b) = (theirs.get(n).unwrap(), src.get(n).unwrap());
        assert_eq!(a.shape, b.shape, "{n}");
        if n.ends_with("norm.weight") {
            // (w + 1) - 1 in f32: w to within its rounding at 2, and 1 + it is w + 1 exactly.
            let (w, got) = (a.to_f32().data, b.to_f32().data);
            for (x, y) in w.iter().zip(&got) {
                assert_eq!(1.0 + y, x + 1.0, "{n}");
                assert!((x - y).abs() <= 2.5e-7, "{n}: {x} served as {y}");
            }
            norms += 1;
        } else {
            assert!(a.bytes == b.bytes, "{n} differs");
        }
    }
    assert_eq!(
        norms,
        1 + 6 * 6,
        "every norm weight, the q/k norms included"
    );
    src.check_tensor_names(&cfg).unwrap();
    let prompt = [1u32, 403, 407, 261, 378, 60, 9, 287];
    let ours = prompt_logits(&CpuModel::from_source(cfg, &src).unwrap(), &prompt);
    let want = prompt_logits(&CpuModel::from_source(hf_cfg, &theirs).unwrap(), &prompt);
    assert!(ours == want, "the same logits");
}

/// Quantized files on the CPU backend, whose matrices stay in their blocks: a file quantized
/// (Q8_0, and Q4_0 for every k projection) gives bit for bit the logits of the same file
/// holding the dequantized values as F32, through every way a served matrix is cut from the
/// stored ones: Phi-3's fused q/k/v and gate/up (row views) with partial RoPE (q/k rows
/// reordered per head), stacked experts (one slice each), a `--fuse-qkv` q/k/v, Mixtral's
/// permuted q/k rows and per-expert tensors. Each holds fewer bytes than the F32 model.
#[test]
fn quantized_files_run_in_their_blocks_with_the_values_they_dequantize_to() {
    let tmp = temp_dir("gguf-kept-archs");
    let ty_of = |n: &str| if n.contains("attn_k.") { Q4_0 } else { Q8_0 };
    let check = |f32_file: &Path, what: &str| {
        let (q, r) = (
            tmp.join(format!("{what}-q.gguf")),
            tmp.join(format!("{what}-r.gguf")),
        );
        write_quantized(f32_file, &q, false, ty_of);
        write_quantized(f32_file, &r, true, ty_of);
        let model = |file: &Path| {
            let (cfg, src) = open_prepared(file, &tmp.join(format!("cache-{what}")));
            CpuModel::from_source(cfg, &src).unwrap()
        };
        let (quantized, dense) = (model(&q), model(&r));
        let prompt = [1u32, 403, 407, 261, 378, 60, 9, 287];
        let (a, b) = (
            prompt_logits(&quantized, &prompt),
            prompt_logits(&dense, &prompt),
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&a) == bits(&b),
            "{what}: the logits of the dequantized values"
        );
        assert!(
            quantized.weight_bytes() * 2 < dense.weight_bytes(),
            "{what}: {} bytes in blocks, {} as f32",
            quantized.weight_bytes(),
            dense.weight_bytes()
        );
    };
    let phi3 = tmp.join("phi3.gguf");
    phi3_gguf(
        &phi3,
        &[("rope.dimension_count", GgufValue::U32(4))],
        vec![],
    );
    check(&phi3, "phi3-partial-rope");
    for (i, (model_type, experts, fuse_qkv)) in [
        ("qwen3_moe", Experts::Stacked, false),
        ("qwen2_moe", Experts::Stacked, true),
        ("mixtral", Experts::Separate, false),
        ("mixtral", Experts::Stacked, false),
    ]
    .into_iter()
    .enumerate()
    {
        let (config, tensors) = moe_checkpoint(model_type);
        let file = tmp.join(format!("{model_type}-{i}.gguf"));
        moe_gguf(&file, &config, &tensors, experts, fuse_qkv);
        check(&file, &format!("{model_type}-{i}"));
    }
}
