//! Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) on the CPU reference.
//!
//! No Qwen checkpoint is at hand, so the forward pass is checked against `dense_reference`:
//! a plain, unpaged transcription of transformers' `modeling_qwen2.py` / `modeling_qwen3.py`
//! (projection with bias, `q_norm(q.view(..., head_dim))` before `apply_rotary_pos_emb`,
//! causal GQA softmax attention, SiLU MLP) written without any of `CpuModel`'s code. The same
//! reference on a Llama config must match `CpuModel`, whose Llama path reproduces the
//! stories260K goldens, so the two can only disagree on the Qwen parts. The reference also
//! checks partial RoPE (Phi-4-mini) and sliding-window attention (Mistral, Phi-3, Qwen's
//! sliding layers; transformers' `sliding_window_overlay` mask).

mod common;

use baton_model::{
    load_model_dir, CpuModel, ForwardRow, LlamaWeights, ModelConfig, ModelDir, ModelError,
    PagedKvCache, RopeScaling,
};
use common::{temp_dir, write_safetensors, OwnedTensor};

fn config(model_type: &str, extra: &str) -> ModelConfig {
    ModelConfig::from_json_str(&config_json(model_type, extra)).expect("config")
}

/// [`config`]'s config.json text.
fn config_json(model_type: &str, extra: &str) -> String {
    let arch = match model_type {
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "phi3" => "Phi3ForCausalLM",
        "mistral" => "MistralForCausalLM",
        "gemma3_text" => "Gemma3ForCausalLM",
        "mixtral" => "MixtralForCausalLM",
        "qwen2_moe" => "Qwen2MoeForCausalLM",
        "qwen3_moe" => "Qwen3MoeForCausalLM",
        _ => "LlamaForCausalLM",
    };
    format!(
        r#"{{"architectures": ["{arch}"], "model_type": "{model_type}", "hidden_size": 48,
        "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0{extra}}}"#
    )
}

fn rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let var = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (var + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| g * (v * r)).collect()
}

/// `y = W x (+ b)` with `W` `[n, k]`.
fn linear(w: &[f32], b: Option<&[f32]>, x: &[f32]) -> Vec<f32> {
    let k = x.len();
    (0..w.len() / k)
        .map(|o| {
            let dot: f32 = w[o * k..(o + 1) * k]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum();
            dot + b.map_or(0.0, |b| b[o])
        })
        .collect()
}

/// HF's `apply_rotary_pos_emb` with `rotate_half`; cos and sin scaled by `att` (HF's
/// `attention_scaling`).
fn rope(head: &mut [f32], pos: usize, inv_freq: &[f32], att: f32) {
    let d = head.len();
    let half = d / 2;
    for (i, &inv) in inv_freq.iter().enumerate().take(half) {
        let (c, s) = (
            (pos as f32 * inv).cos() * att,
            (pos as f32 * inv).sin() * att,
        );
        let (x1, x2) = (head[i], head[i + half]);
        head[i] = x1 * c - x2 * s;
        head[i + half] = x2 * c + x1 * s;
    }
}

/// Logits of every position of `tokens`, computed densely from the weights.
fn dense_reference(cfg: &ModelConfig, w: &LlamaWeights, tokens: &[u32]) -> Vec<Vec<f32>> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (nh, kvh) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let eps = cfg.rms_norm_eps;
    // Plain RoPE's and LongRoPE's frequencies are computed here, over the first
    // `rotary_dim` dims of a head (transformers' partial RoPE: the rest pass through); other
    // scaled ones come from the config (its own unit tests check them against transformers'
    // formulas).
    let r = cfg.rotary_dim;
    let base = |i: usize| cfg.rope_theta.powf((2 * i) as f32 / r as f32);
    let inv_freq: Vec<f32> = match &cfg.rope_scaling {
        None => (0..r / 2).map(|i| 1.0 / base(i)).collect(),
        Some(RopeScaling::LongRope {
            short_factor,
            long_factor,
            long,
            ..
        }) => {
            let f = if *long { long_factor } else { short_factor };
            (0..r / 2).map(|i| 1.0 / (f[i] * base(i))).collect()
        }
        Some(_) => cfg.rope_inv_freq(),
    };
    // Gemma 3 (`modeling_gemma3.py`): norms multiply by (1 + w), embeddings by the scale,
    // sliding layers rotate with the local base and no scaling, scores use
    // query_pre_attn_scalar, the sublayer outputs are normalized before the residual adds,
    // and the MLP is GELU(tanh).
    let off = cfg.norm_offset;
    let rms = |x: &[f32], w: &[f32], eps: f32| {
        let w: Vec<f32> = w.iter().map(|v| v + off).collect();
        rms(x, &w, eps)
    };
    let local_inv: Option<Vec<f32>> = cfg.local_rope_theta.map(|b| {
        (0..r / 2)
            .map(|i| 1.0 / b.powf((2 * i) as f32 / r as f32))
            .collect()
    });
    let scale = match cfg.query_pre_attn_scalar {
        Some(s) => 1.0 / s.sqrt(),
        None => 1.0 / (hd as f32).sqrt(),
    };
    let act = |g: f32| match cfg.hidden_act {
        baton_model::Activation::Silu => g / (1.0 + (-g).exp()),
        baton_model::Activation::GeluTanh => {
            let g = g as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            (0.5 * g * (1.0 + (c * (g + 0.044715 * g.powi(3))).tanh())) as f32
        }
    };
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            let e = &w.embed.data[t as usize * h..(t as usize + 1) * h];
            e.iter()
                .map(|v| v * cfg.embed_scale.unwrap_or(1.0))
                .collect()
        })
        .collect();
    for (li, l) in w.layers.iter().enumerate() {
        let sliding = cfg.sliding_window[li].is_some();
        let (layer_inv, layer_att) = match &local_inv {
            Some(inv) if sliding => (inv.clone(), 1.0),
            _ => (inv_freq.clone(), cfg.rope_attention_factor()),
        };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let xn = rms(x, &l.input_layernorm.data, eps);
            let bias = |b: &Option<baton_model::Tensor>| b.as_ref().map(|t| t.data.clone());
            let mut q = linear(&l.q_proj.data, bias(&l.q_bias).as_deref(), &xn);
            let mut k = linear(&l.k_proj.data, bias(&l.k_bias).as_deref(), &xn);
            let v = linear(&l.v_proj.data, bias(&l.v_bias).as_deref(), &xn);
            for (heads, norm) in [(&mut q, &l.q_norm), (&mut k, &l.k_norm)] {
                for head in heads.chunks_exact_mut(hd) {
                    if let Some(n) = norm {
                        let y = rms(head, &n.data, eps);
                        head.copy_from_slice(&y);
                    }
                    rope(&mut head[..r], pos, &layer_inv, layer_att);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            // transformers' sliding-window mask: key j is seen when j > pos - window.
            let first = match cfg.sliding_window[li] {
                Some(w) => (0..=pos)
                    .find(|&j| j as i64 > pos as i64 - w as i64)
                    .unwrap(),
                None => 0,
            };
            let mut ctx = vec![0.0f32; nh * hd];
            for head in 0..nh {
                let g = head / (nh / kvh);
                let q = &qs[pos][head * hd..(head + 1) * hd];
                let scores: Vec<f32> = (first..=pos)
                    .map(|j| {
                        let k = &ks[j][g * hd..(g + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, p) in (first..).zip(&e) {
                    for d in 0..hd {
                        ctx[head * hd + d] += p / z * vs[j][g * hd + d];
                    }
                }
            }
            let mut o = linear(&l.o_proj.data, None, &ctx);
            if let Some(n) = &l.attn_out_norm {
                o = rms(&o, &n.data, eps);
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = rms(x, &l.post_attention_layernorm.data, eps);
            let mlp = |gate: &[f32], up: &[f32], down: &[f32], xn: &[f32]| {
                let gate = linear(gate, None, xn);
                let up = linear(up, None, xn);
                let a: Vec<f32> = gate.iter().zip(&up).map(|(&g, u)| act(g) * u).collect();
                linear(down, None, &a)
            };
            let mut d = match &l.moe {
                None => mlp(&l.gate_proj.data, &l.up_proj.data, &l.down_proj.data, &xn),
                // transformers' sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax
                // of the router logits, the top k, renormalized if `norm_topk_prob`, the
                // experts' outputs times their weights added in ascending expert id; Qwen2-MoE
                // adds `sigmoid(shared_expert_gate(x)) * shared_expert(x)`.
                Some(m) => {
                    let mc = cfg.moe.as_ref().expect("moe config");
                    let logits = linear(&m.router.data, None, &xn);
                    let top = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = logits.iter().map(|v| (v - top).exp()).collect();
                    let z: f32 = e.iter().sum();
                    let p: Vec<f32> = e.iter().map(|v| v / z).collect();
                    let mut ids: Vec<usize> = (0..p.len()).collect();
                    ids.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
                    ids.truncate(mc.top_k);
                    let sum: f32 = ids.iter().map(|&i| p[i]).sum();
                    ids.sort();
                    let mut out = vec![0f32; h];
                    for &i in &ids {
                        let wgt = if mc.norm_topk_prob { p[i] / sum } else { p[i] };
                        let [g, u, dn] = &m.experts[i];
                        let y = mlp(&g.data, &u.data, &dn.data, &xn);
                        out.iter_mut().zip(&y).for_each(|(o, y)| *o += y * wgt);
                    }
                    if let Some([g, u, dn, sg]) = &m.shared {
                        let y = mlp(&g.data, &u.data, &dn.data, &xn);
                        let gl = linear(&sg.data, None, &xn)[0];
                        let gate = 1.0 / (1.0 + (-gl).exp());
                        out.iter_mut().zip(&y).for_each(|(o, y)| *o += gate * y);
                    }
                    out
                }
            };
            if let Some(n) = &l.mlp_out_norm {
                d = rms(&d, &n.data, eps);
            }
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    xs.iter()
        .map(|x| linear(&w.lm_head.data, None, &rms(x, &w.norm.data, eps)))
        .collect()
}

/// `CpuModel`'s logits of every position: the first five tokens as one prefill row (paged in
/// blocks of 4), then one decode row per remaining token.
fn paged_logits(cfg: &ModelConfig, w: &LlamaWeights, tokens: &[u32]) -> Vec<Vec<f32>> {
    let model = CpuModel::new(cfg.clone(), w.clone());
    let mut kv = PagedKvCache::new(cfg, 8, 4);
    let pages = [5u32, 2, 7, 0, 3];
    let mut out = model
        .forward(
            &mut kv,
            &[ForwardRow {
                tokens: &tokens[..5],
                start_pos: 0,
                block_table: &pages,
                want_logits: true,
                all_logits: true,
                lora: 0,
            }],
        )
        .expect("prefill");
    for p in 5..tokens.len() {
        out.extend(
            model
                .forward(
                    &mut kv,
                    &[ForwardRow {
                        tokens: &tokens[p..p + 1],
                        start_pos: p,
                        block_table: &pages,
                        want_logits: true,
                        all_logits: false,
                        lora: 0,
                    }],
                )
                .expect("decode"),
        );
    }
    out
}

fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    worst
}

const TOKENS: [u32; 11] = [3, 91, 14, 15, 92, 65, 35, 89, 79, 32, 38];

#[test]
fn the_reference_matches_the_llama_path_it_shares_with_qwen() {
    let cfg = config("llama", "");
    let w = LlamaWeights::dummy(&cfg, 11);
    let err = max_rel(
        &paged_logits(&cfg, &w, &TOKENS),
        &dense_reference(&cfg, &w, &TOKENS),
    );
    assert!(err < 1e-4, "llama: {err}");
}

#[test]
fn qwen2_biases_and_qwen3_head_norms_match_the_dense_reference() {
    for (ty, extra) in [
        ("qwen2", ""),
        ("qwen3", r#", "head_dim": 8"#),
        // Qwen3Config's default head_dim (128), far above hidden / heads.
        ("qwen3", ""),
        // head_dim larger than hidden / heads, as in Qwen3-0.6B (1024 / 16 heads, head_dim 128).
        ("qwen3", r#", "head_dim": 16"#),
        ("qwen2", r#", "tie_word_embeddings": true"#),
        // YaRN with a visible attention factor (cos and sin scaled by it).
        (
            "qwen3",
            r#", "head_dim": 8, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
               "original_max_position_embeddings": 16, "attention_factor": 1.7}"#,
        ),
    ] {
        let cfg = config(ty, extra);
        let w = LlamaWeights::dummy(&cfg, 11);
        let got = paged_logits(&cfg, &w, &TOKENS);
        let err = max_rel(&got, &dense_reference(&cfg, &w, &TOKENS));
        assert!(err < 1e-4, "{ty}{extra}: {err}");
        // The feature matters: without it the reference is far off.
        let mut plain = w.clone();
        for l in &mut plain.layers {
            l.q_bias = None;
            l.k_bias = None;
            l.v_bias = None;
            l.q_norm = None;
            l.k_norm = None;
        }
        let off = max_rel(&got, &dense_reference(&cfg, &plain, &TOKENS));
        assert!(
            off > 1e-2,
            "{ty}{extra}: the Qwen part changes nothing ({off})"
        );
    }
}

#[test]
fn dummy_qwen_weights_have_the_extra_tensors_and_llama_weights_are_unchanged() {
    let q2 = config("qwen2", "");
    let w = LlamaWeights::dummy(&q2, 3);
    let l = &w.layers[1];
    assert_eq!(l.q_bias.as_ref().unwrap().shape, [48]);
    assert_eq!(l.k_bias.as_ref().unwrap().shape, [16]);
    assert!(l.q_norm.is_none() && l.k_norm.is_none());
    assert_eq!(l.tensors().len(), 12);
    let q3 = config("qwen3", r#", "head_dim": 8"#);
    let w3 = LlamaWeights::dummy(&q3, 3);
    let n = w3.layers[0].q_norm.as_ref().unwrap();
    assert_eq!(n.shape, [8]);
    assert!(n.data.iter().all(|v| (0.5..1.5).contains(v)));
    assert!(n.data.windows(2).any(|p| p[0] != p[1]), "norm weights vary");
    assert_ne!(w3.layers[0].q_norm, w3.layers[0].k_norm);
    // num_parameters counts the extra tensors.
    for (cfg, w) in [(&q2, &w), (&q3, &w3)] {
        let stored: usize = w
            .layers
            .iter()
            .flat_map(|l| l.tensors())
            .chain([&w.embed, &w.norm])
            .map(|t| t.data.len())
            .sum();
        let head = if cfg.tie_word_embeddings {
            0
        } else {
            w.lm_head.data.len()
        };
        assert_eq!(cfg.num_parameters(), stored + head, "{}", cfg.model_type);
    }
    // The Llama tensors of a Qwen config are the Llama config's (drawn first per layer).
    let llama = LlamaWeights::dummy(&config("llama", ""), 3);
    assert_eq!(llama.layers[0].q_proj, w3.layers[0].q_proj);
    assert_eq!(llama.layers[0].down_proj, w.layers[0].down_proj);
}

/// A model directory holding `w` as a bf16-free f32 checkpoint under `cfg`'s config.json.
fn write_checkpoint(
    tag: &str,
    cfg_json: &str,
    w: &LlamaWeights,
    cfg: &ModelConfig,
) -> common::TempDir {
    let d = temp_dir(tag);
    std::fs::write(d.join("config.json"), cfg_json).unwrap();
    let mut tensors: Vec<OwnedTensor> = Vec::new();
    let mut put = |name: String, t: &baton_model::Tensor| {
        let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, safetensors::Dtype::F32, t.shape.clone(), bytes));
    };
    put("model.embed_tokens.weight".into(), &w.embed);
    put("model.norm.weight".into(), &w.norm);
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), &w.lm_head);
    }
    for (i, l) in w.layers.iter().enumerate() {
        for ((name, _), t) in baton_model::weights::layer_tensor_shapes(cfg, i)
            .into_iter()
            .zip(l.tensors())
        {
            put(name, t);
        }
    }
    write_safetensors(&d, "model.safetensors", &tensors);
    // The tokenizer files of the test model (its vocabulary is larger than 97; loading
    // does not compare the two).
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(common::model_dir().join(f), d.join(f)).unwrap();
    }
    d
}

#[test]
fn qwen_checkpoints_load_and_a_missing_qwen_tensor_is_named() {
    for ty in ["qwen2", "qwen3"] {
        let cfg = config(ty, "");
        let json = format!(
            r#"{{"architectures": ["{}"], "model_type": "{ty}", "hidden_size": 48,
            "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6,
            "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}}"#,
            if ty == "qwen2" {
                "Qwen2ForCausalLM"
            } else {
                "Qwen3ForCausalLM"
            }
        );
        let w = LlamaWeights::dummy(&cfg, 5);
        let d = write_checkpoint(ty, &json, &w, &cfg);
        let loaded = load_model_dir(&*d).expect("loads");
        assert_eq!(loaded.weights, w, "{ty}: f32 round trip");
        ModelDir::new(&*d)
            .load_mapped(baton_model::LoadFormat::Auto)
            .expect("mapped load checks the extra tensors");
        // Drop one extra tensor: both loads name it.
        let missing = if ty == "qwen2" {
            "model.layers.1.self_attn.v_proj.bias"
        } else {
            "model.layers.0.self_attn.k_norm.weight"
        };
        refuse_without(&d, missing, ty);
    }
}

/// Rewrites the f32 checkpoint in `d` without tensor `missing`; both loads must then name it.
fn refuse_without(d: &std::path::Path, missing: &str, tag: &str) {
    let src = baton_model::WeightSource::open(d).unwrap();
    let kept: Vec<OwnedTensor> = src
        .tensor_names()
        .filter(|n| *n != missing)
        .map(|n| {
            let t = src.get(n).unwrap();
            (
                n.to_string(),
                safetensors::Dtype::F32,
                t.shape.to_vec(),
                t.bytes.to_vec(),
            )
        })
        .collect();
    drop(src);
    write_safetensors(d, "model.safetensors", &kept);
    for e in [
        load_model_dir(d).map(|_| ()).unwrap_err(),
        ModelDir::new(d)
            .load_mapped(baton_model::LoadFormat::Auto)
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(
            matches!(&e, ModelError::MissingTensor { tensor, .. } if tensor == missing),
            "{tag}: {e}"
        );
    }
}

#[test]
fn weights_without_the_qwen_tensors_are_refused_by_the_cpu_model() {
    let cfg = config("qwen3", r#", "head_dim": 8"#);
    let mut w = LlamaWeights::dummy(&cfg, 1);
    w.layers[1].k_norm = None;
    let e = CpuModel::try_new(cfg, w).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("k_norm"), "{e}");
}

/// Partial RoPE (Phi-4-mini's `partial_rotary_factor`): the loader permutes each head's q and
/// k rows (and biases and head norms) so that the backends' whole-head rotate-half computes
/// transformers' rotation of the first `rotary_dim` dims, with LongRoPE's attention factor on
/// the rotated dims only. Checked through a checkpoint (where the permutation happens)
/// against the dense reference on the checkpoint's own weights.
#[test]
fn partial_rope_matches_the_dense_reference_through_a_checkpoint() {
    let longrope = r#", "original_max_position_embeddings": 32, "rope_scaling": {"rope_type":
        "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2, 3.1, 4.0],
        "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]}"#;
    for (ty, extra) in [
        ("phi3", longrope.to_string()),
        ("phi3", String::new()),
        ("qwen2", String::new()),
        ("qwen3", longrope.to_string()),
    ] {
        let extra = format!(r#", "head_dim": 16, "partial_rotary_factor": 0.75{extra}"#);
        let json = config_json(ty, &extra);
        let cfg = config(ty, &extra);
        assert_eq!(cfg.rotary_dim, 12);
        let w = LlamaWeights::dummy(&cfg, 13);
        let d = write_checkpoint(&format!("partial-{ty}"), &json, &w, &cfg);
        let loaded = load_model_dir(&*d).expect("loads");
        assert_ne!(
            loaded.weights, w,
            "{ty}{extra}: the q and k rows are permuted"
        );
        let want = dense_reference(&cfg, &w, &TOKENS);
        let got = paged_logits(&cfg, &loaded.weights, &TOKENS);
        let err = max_rel(&got, &want);
        assert!(err < 1e-4, "{ty}{extra}: {err}");
        // The mapped, layer-by-layer load (the worker's) gives the same logits.
        let err = max_rel(&mapped_logits(&d), &want);
        assert!(err < 1e-4, "{ty}{extra}, mapped: {err}");
        // Without the permutation the rotation is another one, and the logits far off.
        let off = max_rel(&paged_logits(&cfg, &w, &TOKENS), &want);
        assert!(off > 1e-3, "{ty}{extra}: unpermuted weights agree ({off})");
        // Served past original_max_position_embeddings (32): LongRoPE's long factors, for
        // every position.
        if cfg.rope_note().is_some() {
            let mut long = cfg.clone();
            long.set_max_model_len(64);
            let want_long = dense_reference(&long, &w, &TOKENS);
            let err = max_rel(&paged_logits(&long, &loaded.weights, &TOKENS), &want_long);
            assert!(err < 1e-4, "{ty}{extra}, long factors: {err}");
            let off = max_rel(&want_long, &want);
            assert!(
                off > 1e-3,
                "{ty}{extra}: the long factors change nothing ({off})"
            );
        }
    }
}

/// `CpuModel`'s logits of every position, the tokens prefilled in rows of `chunk` (pages of 16
/// tokens, in reverse order).
fn chunked_logits(
    cfg: &ModelConfig,
    w: &LlamaWeights,
    tokens: &[u32],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let model = CpuModel::new(cfg.clone(), w.clone());
    let pages = tokens.len().div_ceil(16);
    let mut kv = PagedKvCache::new(cfg, pages + 1, 16);
    let table: Vec<u32> = (1..=pages as u32).rev().collect();
    let mut out = Vec::new();
    for start in (0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        let row = ForwardRow {
            tokens: &tokens[start..end],
            start_pos: start,
            block_table: &table,
            want_logits: true,
            all_logits: true,
            lora: 0,
        };
        out.extend(model.forward(&mut kv, &[row]).expect("forward"));
    }
    out
}

/// Sliding-window attention ([`ModelConfig::sliding_window`]) against the dense reference's
/// mask, over 560 positions: windows of a few keys, of more than a 256-position partition
/// (starting mid-partition, so a tile of prefill tokens shares some partitions and not
/// others), on every layer (Mistral, Phi-3) or on Qwen's sliding layers only; prefilled whole,
/// in chunks of 100, and decoded token by token. Without the window, or with it on every
/// layer where one layer slides, the logits are far off.
#[test]
fn sliding_windows_match_the_dense_reference_across_partitions_and_tiles() {
    let tokens: Vec<u32> = (0..560u32).map(|i| (i * 37 + 11) % 97).collect();
    for (ty, extra) in [
        ("mistral", r#", "sliding_window": 300"#),
        ("mistral", r#", "sliding_window": 7"#),
        ("phi3", r#", "sliding_window": 257"#),
        (
            "qwen2",
            r#", "use_sliding_window": true, "sliding_window": 40, "max_window_layers": 1"#,
        ),
    ] {
        let cfg = config(ty, &format!(r#", "max_position_embeddings": 1024{extra}"#));
        assert!(
            cfg.sliding_window.iter().any(Option::is_some),
            "{ty}{extra}"
        );
        let w = LlamaWeights::dummy(&cfg, 17);
        let want = dense_reference(&cfg, &w, &tokens);
        for chunk in [560, 100, 1] {
            let err = max_rel(&chunked_logits(&cfg, &w, &tokens, chunk), &want);
            assert!(err < 1e-4, "{ty}{extra}, rows of {chunk}: {err}");
        }
        let mut full = cfg.clone();
        full.sliding_window.fill(None);
        let off = max_rel(&dense_reference(&full, &w, &tokens), &want);
        assert!(
            off > 1e-2,
            "{ty}{extra}: the window changes nothing ({off})"
        );
        if cfg.sliding_window.contains(&None) {
            let mut every = cfg.clone();
            every.sliding_window.fill(Some(40));
            let off = max_rel(&chunked_logits(&every, &w, &tokens, 100), &want);
            assert!(
                off > 1e-2,
                "{ty}{extra}: every layer sliding agrees ({off})"
            );
        }
    }
}

/// Gemma 3 text (`Gemma3ForCausalLM`) against the dense reference's transcription of
/// `modeling_gemma3.py`: (1 + w) norms, the four norms per layer, GELU(tanh), scaled
/// embeddings, `query_pre_attn_scalar`, q/k norms, and local RoPE on the sliding layers (every
/// third layer full, or `layer_types`), with `linear` RoPE scaling on the full layers. Each of
/// these matters: without it the reference is far off. A checkpoint with Gemma's tensor names
/// (written here by name, not through the loader's own table) loads and gives the same
/// logits through the mapped, layer-by-layer load.
#[test]
fn gemma3_text_matches_the_dense_reference() {
    let types = r#"["sliding_attention", "full_attention"]"#;
    for extra in [
        r#", "head_dim": 8, "num_hidden_layers": 3, "sliding_window": 4,
           "sliding_window_pattern": 3"#
            .to_string(),
        format!(
            r#", "head_dim": 16, "layer_types": {types}, "sliding_window": 6,
               "rope_scaling": {{"rope_type": "linear", "factor": 8.0}},
               "query_pre_attn_scalar": 12, "torch_dtype": "bfloat16",
               "rope_local_base_freq": 100.0"#
        ),
    ] {
        let json = config_json("gemma3_text", &extra);
        let cfg = config("gemma3_text", &extra);
        assert!(cfg.sandwich_norms && cfg.qk_norm && cfg.tie_word_embeddings);
        let w = LlamaWeights::dummy(&cfg, 23);
        let want = dense_reference(&cfg, &w, &TOKENS);
        let got = paged_logits(&cfg, &w, &TOKENS);
        let err = max_rel(&got, &want);
        assert!(err < 1e-4, "{extra}: {err}");
        let mut variants: Vec<(&str, ModelConfig)> = Vec::new();
        let mut v = cfg.clone();
        v.norm_offset = 0.0;
        variants.push(("norm offset", v));
        let mut v = cfg.clone();
        v.hidden_act = baton_model::Activation::Silu;
        variants.push(("activation", v));
        let mut v = cfg.clone();
        v.embed_scale = None;
        variants.push(("embedding scale", v));
        let mut v = cfg.clone();
        v.query_pre_attn_scalar = None;
        if cfg.head_dim != 8 {
            variants.push(("query_pre_attn_scalar", v));
        }
        let mut v = cfg.clone();
        v.local_rope_theta = None;
        variants.push(("local RoPE", v));
        let mut v = cfg.clone();
        v.sliding_window.fill(None);
        variants.push(("sliding windows", v));
        let mut plain = w.clone();
        for l in &mut plain.layers {
            l.attn_out_norm = None;
            l.mlp_out_norm = None;
        }
        variants.push(("output norms", cfg.clone()));
        for (what, v) in variants {
            let weights = if what == "output norms" { &plain } else { &w };
            let off = max_rel(&dense_reference(&v, weights, &TOKENS), &want);
            assert!(off > 1e-3, "{extra}: the {what} changes nothing ({off})");
        }
        // Gemma's checkpoint names: the norm before the MLP is pre_feedforward_layernorm,
        // post_attention_layernorm normalizes the attention output.
        let d = temp_dir("gemma3");
        std::fs::write(d.join("config.json"), &json).unwrap();
        write_safetensors(&d, "model.safetensors", &gemma3_tensors(&w, |n| n));
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(common::model_dir().join(f), d.join(f)).unwrap();
        }
        let loaded = load_model_dir(&*d).expect("a Gemma 3 checkpoint loads");
        assert_eq!(loaded.weights, w);
        let err = max_rel(&mapped_logits(&d), &want);
        assert!(err < 1e-4, "{extra}, mapped: {err}");
    }
}

/// Gemma 3 configs: the real gemma-3-1b-it config.json reads as its model card says (every
/// sixth layer full, the bf16-rounded embedding scale 34.0 of sqrt(1152) = 33.94), and what
/// Baton does not run is refused by name (soft-capping, bidirectional attention, another
/// activation, another RoPE type on the sliding layers).
#[test]
fn gemma3_configs_read_as_transformers_and_unsupported_features_are_named() {
    let real = r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": null, "head_dim": 256, "hidden_activation":
        "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type":
        "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
        "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 262144"#;
    let c = ModelConfig::from_json_str(&format!("{real}}}")).unwrap();
    assert_eq!(c.sliding_window.len(), 26);
    for (i, w) in c.sliding_window.iter().enumerate() {
        assert_eq!(
            *w,
            if (i + 1) % 6 == 0 { None } else { Some(512) },
            "layer {i}"
        );
    }
    assert_eq!(c.embed_scale, Some(34.0));
    assert_eq!((c.rope_theta, c.local_rope_theta), (1e6, Some(1e4)));
    assert_eq!(c.attention_scale(), 1.0 / 16.0);
    assert!(c.tie_word_embeddings && c.qk_norm && c.sandwich_norms);
    assert_eq!(c.eos_token_ids, [1, 106]);
    // Gemma3TextConfig reads `hidden_activation` only: a `hidden_act` beside it is unused.
    for extra in [r#", "hidden_act": "silu""#, r#", "hidden_act": "relu""#] {
        let g = ModelConfig::from_json_str(&format!("{real}{extra}}}")).unwrap();
        assert_eq!(g.hidden_act, baton_model::Activation::GeluTanh, "{extra}");
    }
    // transformers 5's rope_parameters per layer type read the same.
    let v5 = real.replace(
        r#""rope_local_base_freq": 10000, "rope_scaling": null,
        "rope_theta": 1000000,"#,
        r#""rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta":
        1000000}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000}},"#,
    );
    assert_ne!(v5, real);
    let c5 = ModelConfig::from_json_str(&format!("{v5}}}")).unwrap();
    assert_eq!(c5, c);
    for (extra, field) in [
        (
            r#", "final_logit_softcapping": 30.0"#,
            "final_logit_softcapping",
        ),
        (
            r#", "attn_logit_softcapping": 50.0"#,
            "attn_logit_softcapping",
        ),
        (
            r#", "use_bidirectional_attention": true"#,
            "use_bidirectional_attention",
        ),
        (r#", "hidden_activation": "relu""#, "hidden_activation"),
        (r#", "sliding_window_pattern": 0"#, "sliding_window_pattern"),
        (r#", "query_pre_attn_scalar": 0"#, "query_pre_attn_scalar"),
    ] {
        let e = ModelConfig::from_json_str(&format!("{real}{extra}}}")).unwrap_err();
        assert!(
            matches!(&e, ModelError::InvalidField { field: f, .. } if f == field),
            "{extra}: {e}"
        );
    }
    let local_yarn = v5.replace(
        r#""sliding_attention": {"rope_type": "default""#,
        r#""sliding_attention": {"rope_type": "yarn""#,
    );
    let e = ModelConfig::from_json_str(&format!("{local_yarn}}}")).unwrap_err();
    assert!(e.to_string().contains("sliding-window layers"), "{e}");
}

/// Gemma 3's checkpoint tensors of `w` under its own names, each name passed through `name`.
fn gemma3_tensors(w: &LlamaWeights, name: impl Fn(String) -> String) -> Vec<OwnedTensor> {
    let mut tensors: Vec<OwnedTensor> = Vec::new();
    let mut put = |n: String, t: &baton_model::Tensor| {
        let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name(n), safetensors::Dtype::F32, t.shape.clone(), bytes));
    };
    put("model.embed_tokens.weight".into(), &w.embed);
    put("model.norm.weight".into(), &w.norm);
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}.");
        for (n, t) in [
            ("input_layernorm.weight", &l.input_layernorm),
            ("self_attn.q_proj.weight", &l.q_proj),
            ("self_attn.k_proj.weight", &l.k_proj),
            ("self_attn.v_proj.weight", &l.v_proj),
            ("self_attn.o_proj.weight", &l.o_proj),
            ("self_attn.q_norm.weight", l.q_norm.as_ref().unwrap()),
            ("self_attn.k_norm.weight", l.k_norm.as_ref().unwrap()),
            (
                "post_attention_layernorm.weight",
                l.attn_out_norm.as_ref().unwrap(),
            ),
            (
                "pre_feedforward_layernorm.weight",
                &l.post_attention_layernorm,
            ),
            (
                "post_feedforward_layernorm.weight",
                l.mlp_out_norm.as_ref().unwrap(),
            ),
            ("mlp.gate_proj.weight", &l.gate_proj),
            ("mlp.up_proj.weight", &l.up_proj),
            ("mlp.down_proj.weight", &l.down_proj),
        ] {
            put(format!("{p}{n}"), t);
        }
    }
    tensors
}

/// A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, gemma-3-4b and up)
/// serves its text model: the `text_config` (which gives only what differs from
/// Gemma3TextConfig's defaults) with the top level's EOS ids and dtype, the tensors under
/// `language_model.model.` (transformers 4.50) or `model.language_model.` (later versions),
/// the vision tower's and projector's ignored, and the logits those of the text model. A
/// stray tensor outside those is still named.
#[test]
fn a_multimodal_gemma3_checkpoint_serves_its_text_model() {
    let json = r#"{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "mm_tokens_per_image": 256, "torch_dtype": "float32",
        "text_config": {"hidden_size": 48, "intermediate_size": 80, "model_type": "gemma3_text",
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 97, "max_position_embeddings": 64,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 4,
        "sliding_window_pattern": 3},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model",
        "patch_size": 14}}"#;
    let cfg = ModelConfig::from_json_str(json).unwrap();
    assert!(cfg.multimodal_text && cfg.sandwich_norms && cfg.tie_word_embeddings);
    assert_eq!(cfg.eos_token_ids, [1, 106]);
    assert_eq!(cfg.embed_scale, Some(48f32.sqrt()));
    assert_eq!(cfg.sliding_window, [Some(4), Some(4), None]);
    assert!(matches!(cfg.rope_scaling, Some(RopeScaling::Linear { factor }) if factor == 8.0));
    // What the text_config leaves out is Gemma3TextConfig's default.
    let sparse = ModelConfig::from_json_str(
        r#"{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "sliding_window": 1024}}"#,
    )
    .unwrap();
    assert_eq!(
        (
            sparse.num_attention_heads,
            sparse.num_key_value_heads,
            sparse.head_dim
        ),
        (8, 4, 256)
    );
    assert_eq!(
        (sparse.vocab_size, sparse.max_position_embeddings),
        (262208, 131072)
    );
    let w = LlamaWeights::dummy(&cfg, 29);
    let want = dense_reference(&cfg, &w, &TOKENS);
    let vision: OwnedTensor = (
        String::new(),
        safetensors::Dtype::F32,
        vec![2, 2],
        vec![0u8; 16],
    );
    for (tag, prefix, vision_prefix) in [
        ("mm-450", "language_model.model.", ""),
        ("mm-452", "model.language_model.", "model."),
    ] {
        let d = temp_dir(&format!("gemma3-{tag}"));
        std::fs::write(d.join("config.json"), json).unwrap();
        let mut tensors = gemma3_tensors(&w, |n| n.replacen("model.", prefix, 1));
        for v in [
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "multi_modal_projector.mm_input_projection_weight",
        ] {
            let mut t = vision.clone();
            t.0 = format!("{vision_prefix}{v}");
            tensors.push(t);
        }
        write_safetensors(&d, "model.safetensors", &tensors);
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(common::model_dir().join(f), d.join(f)).unwrap();
        }
        let loaded = load_model_dir(&*d).unwrap_or_else(|e| panic!("{tag}: {e}"));
        assert_eq!(loaded.weights, w, "{tag}");
        let err = max_rel(&mapped_logits(&d), &want);
        assert!(err < 1e-4, "{tag}: {err}");
        // A tensor neither the text model's nor the vision tower's is named.
        let mut t = vision.clone();
        t.0 = "audio_tower.weight".into();
        tensors.push(t);
        write_safetensors(&d, "model.safetensors", &tensors);
        let e = load_model_dir(&*d).unwrap_err();
        assert!(e.to_string().contains("audio_tower.weight"), "{tag}: {e}");
    }
}

/// The logits of every position of [`TOKENS`] from the model directory `d` through the mapped,
/// layer-by-layer load (the worker's).
fn mapped_logits(d: &std::path::Path) -> Vec<Vec<f32>> {
    let m = ModelDir::new(d)
        .load_mapped(baton_model::LoadFormat::Auto)
        .unwrap();
    let baton_model::ModelWeights::Mapped(src) = &m.weights else {
        panic!("mapped")
    };
    let mapped = CpuModel::from_source(m.config.clone(), src).unwrap();
    let mut kv = PagedKvCache::new(&m.config, 4, 4);
    let row = ForwardRow {
        tokens: &TOKENS,
        start_pos: 0,
        block_table: &[0, 1, 2],
        want_logits: true,
        all_logits: true,
        lora: 0,
    };
    mapped.forward(&mut kv, &[row]).unwrap()
}

/// Mixtral, Qwen2-MoE (shared expert, a dense first layer) and Qwen3-MoE (renormalized top-k,
/// every second layer sparse) configs of [`config`]'s widths, with their config.json text.
fn moe_configs() -> Vec<(ModelConfig, String)> {
    [
        (
            "mixtral",
            r#", "num_local_experts": 5, "num_experts_per_tok": 2"#,
        ),
        (
            "qwen2_moe",
            r#", "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40, "mlp_only_layers": [0]"#,
        ),
        (
            "qwen3_moe",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "norm_topk_prob": true, "decoder_sparse_step": 2, "head_dim": 8"#,
        ),
    ]
    .into_iter()
    .map(|(ty, extra)| (config(ty, extra), config_json(ty, extra)))
    .collect()
}

#[test]
fn mixture_of_experts_configs_read_as_transformers() {
    let cfgs = moe_configs();
    let m = cfgs[0].0.moe.as_ref().expect("mixtral is sparse");
    assert_eq!((m.num_experts, m.top_k, m.intermediate_size), (5, 2, 80));
    assert!(m.norm_topk_prob && m.layers == [true, true]);
    assert_eq!(m.naming, baton_model::MoeNaming::Mixtral);
    let q2 = &cfgs[1].0;
    let m = q2.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k, m.intermediate_size), (6, 3, 24));
    assert_eq!(m.shared_expert_intermediate_size, 40);
    assert!(!m.norm_topk_prob && m.layers == [false, true] && q2.qkv_bias);
    let q3 = &cfgs[2].0;
    let m = q3.moe.as_ref().unwrap();
    assert!(m.norm_topk_prob && m.layers == [false, true] && q3.qk_norm && !q3.qkv_bias);
    assert_eq!(m.shared_expert_intermediate_size, 0);
    // Defaults: MixtralConfig (8 experts, top 2, eps 1e-5), Qwen3MoeConfig (128, top 8,
    // width 768, no renormalization, head_dim hidden / heads).
    let mx = ModelConfig::from_json_str(
        r#"{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 48,
        "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6,
        "vocab_size": 97, "max_position_embeddings": 64}"#,
    )
    .unwrap();
    let m = mx.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k, mx.rms_norm_eps), (8, 2, 1e-5));
    assert!(mx.sliding_window.iter().all(Option::is_none));
    let q3d = config("qwen3_moe", "");
    let m = q3d.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k, m.intermediate_size), (128, 8, 768));
    assert!(!m.norm_topk_prob && q3d.head_dim == 8);
    // Qwen with no experts is dense; a dense-layer index past the last layer names none
    // (transformers ignores it).
    assert!(config("qwen3_moe", r#", "num_experts": 0"#).moe.is_none());
    let past = config("qwen3_moe", r#", "mlp_only_layers": [1, 7]"#);
    assert_eq!(past.moe.as_ref().unwrap().layers, [true, false]);
    // The defaults of the fields config.json may leave out: MixtralConfig's rope_theta 1e6
    // and intermediate_size 14336, Qwen3MoeConfig's 6144 and Qwen2MoeConfig's 5632 (the
    // dense layers' width).
    let bare = |ty: &str, arch: &str| {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures": ["{arch}"], "model_type": "{ty}", "hidden_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 6, "vocab_size": 97,
            "max_position_embeddings": 64}}"#
        ))
        .unwrap()
    };
    let mx = bare("mixtral", "MixtralForCausalLM");
    assert_eq!((mx.rope_theta, mx.intermediate_size), (1e6, 14336));
    assert_eq!(mx.moe.as_ref().unwrap().intermediate_size, 14336);
    let q3 = bare("qwen3_moe", "Qwen3MoeForCausalLM");
    assert_eq!((q3.rope_theta, q3.intermediate_size), (10000.0, 6144));
    let q2 = bare("qwen2_moe", "Qwen2MoeForCausalLM");
    assert_eq!((q2.rope_theta, q2.intermediate_size), (10000.0, 5632));
    // The fingerprint covers the routing.
    let fp = |extra: &str| config("qwen3_moe", extra).fingerprint();
    assert_ne!(fp(""), fp(r#", "norm_topk_prob": true"#));
    assert_ne!(fp(""), fp(r#", "num_experts_per_tok": 4"#));
    assert_ne!(fp(""), fp(r#", "mlp_only_layers": [1]"#));
    assert_ne!(fp(""), fp(r#", "moe_intermediate_size": 64"#));
    // What cannot run is refused naming the field.
    for (ty, extra, field) in [
        (
            "mixtral",
            r#", "num_local_experts": 4, "num_experts_per_tok": 5"#,
            "num_experts_per_tok",
        ),
        (
            "mixtral",
            r#", "num_experts_per_tok": 0"#,
            "num_experts_per_tok",
        ),
        (
            "mixtral",
            r#", "num_local_experts": 0"#,
            "num_local_experts",
        ),
        ("qwen3_moe", r#", "num_experts": 5000"#, "num_experts"),
        (
            "qwen3_moe",
            r#", "mlp_only_layers": "0""#,
            "mlp_only_layers",
        ),
        (
            "qwen3_moe",
            r#", "decoder_sparse_step": 0"#,
            "decoder_sparse_step",
        ),
        (
            "qwen2_moe",
            r#", "moe_intermediate_size": 0"#,
            "moe_intermediate_size",
        ),
        (
            "qwen2_moe",
            r#", "use_sliding_window": true"#,
            "use_sliding_window",
        ),
    ] {
        let e = ModelConfig::from_json_str(&config_json(ty, extra)).unwrap_err();
        assert!(
            matches!(&e, ModelError::InvalidField { field: f, .. } if f == field),
            "{ty} {extra}: {e}"
        );
    }
}

#[test]
fn mixture_of_experts_models_match_the_dense_reference() {
    for (cfg, _) in moe_configs() {
        let w = LlamaWeights::dummy(&cfg, 9);
        let want = dense_reference(&cfg, &w, &TOKENS);
        let got = paged_logits(&cfg, &w, &TOKENS);
        let err = max_rel(&got, &want);
        assert!(err < 1e-4, "{}: max rel err {err}", cfg.model_type);
        // The routing matters: the same weights with the top-k renormalization flipped, or
        // one expert fewer per token, give other logits.
        for change in [0, 1] {
            let mut other = cfg.clone();
            let m = other.moe.as_mut().unwrap();
            if change == 0 {
                m.norm_topk_prob = !m.norm_topk_prob;
            } else {
                m.top_k -= 1;
            }
            let err = max_rel(&paged_logits(&other, &w, &TOKENS), &want);
            assert!(err > 1e-3, "{} change {change}: {err}", cfg.model_type);
        }
    }
}

#[test]
fn mixture_of_experts_logits_do_not_depend_on_the_batch() {
    for (cfg, _) in moe_configs() {
        let w = LlamaWeights::dummy(&cfg, 4);
        let model = CpuModel::new(cfg.clone(), w);
        let prompts: [&[u32]; 3] = [&TOKENS, &[7, 8, 9, 10, 11, 12], &[50, 3, 91]];
        let tables: [&[u32]; 3] = [&[0, 1, 2], &[3, 4], &[5]];
        let rows: Vec<ForwardRow> = prompts
            .iter()
            .zip(tables)
            .map(|(p, b)| ForwardRow {
                tokens: p,
                start_pos: 0,
                block_table: b,
                want_logits: true,
                all_logits: true,
                lora: 0,
            })
            .collect();
        let mut kv = PagedKvCache::new(&cfg, 6, 4);
        let together = model.forward(&mut kv, &rows).unwrap();
        let mut alone = Vec::new();
        for r in &rows {
            let mut kv = PagedKvCache::new(&cfg, 6, 4);
            alone.extend(model.forward(&mut kv, std::slice::from_ref(r)).unwrap());
        }
        let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
            v.iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&together), bits(&alone), "{}", cfg.model_type);
    }
}

#[test]
fn mixture_of_experts_checkpoints_load_by_their_names() {
    for (cfg, json) in moe_configs() {
        let ty = cfg.model_type.clone();
        let w = LlamaWeights::dummy(&cfg, 6);
        let d = write_checkpoint(&ty, &json, &w, &cfg);
        let src = baton_model::WeightSource::open(&d).unwrap();
        let names: Vec<String> = src.tensor_names().map(str::to_string).collect();
        drop(src);
        let (expert, router) = if ty == "mixtral" {
            (
                "model.layers.1.block_sparse_moe.experts.4.w2.weight",
                "model.layers.0.block_sparse_moe.gate.weight",
            )
        } else {
            (
                "model.layers.1.mlp.experts.5.down_proj.weight",
                "model.layers.1.mlp.gate.weight",
            )
        };
        assert!(names.iter().any(|n| n == expert), "{ty}: {names:?}");
        assert!(names.iter().any(|n| n == router), "{ty}");
        assert_eq!(
            names.iter().any(|n| n.contains("shared_expert_gate")),
            ty == "qwen2_moe"
        );
        assert_eq!(load_model_dir(&*d).expect("loads").weights, w, "{ty}");
        let want = dense_reference(&cfg, &w, &TOKENS);
        let err = max_rel(&mapped_logits(&d), &want);
        assert!(err < 1e-4, "{ty}: mapped load, max rel err {err}");
        // Without one expert's tensor both loads name it.
        refuse_without(&d, expert, &ty);
    }
}

#[test]
fn mixture_of_experts_dummy_weights_count_every_expert() {
    for (cfg, _) in moe_configs() {
        let w = LlamaWeights::dummy(&cfg, 2);
        let stored: usize = w
            .layers
            .iter()
            .flat_map(|l| l.tensors())
            .chain([&w.embed, &w.norm, &w.lm_head])
            .map(|t| t.data.len())
            .sum();
        assert_eq!(cfg.num_parameters(), stored, "{}", cfg.model_type);
        let m = cfg.moe.as_ref().unwrap();
        for (i, l) in w.layers.iter().enumerate() {
            assert_eq!(l.moe.is_some(), m.layers[i]);
            if let Some(moe) = &l.moe {
                assert_eq!(moe.experts.len(), m.num_experts);
                assert_ne!(moe.experts[0], moe.experts[1], "experts differ");
                assert!(l.gate_proj.data.is_empty());
            }
        }
        // A layer without its experts is refused.
        let mut bad = w.clone();
        let li = m.layers.iter().position(|&s| s).unwrap();
        bad.layers[li].moe.as_mut().unwrap().experts.pop();
        let e = CpuModel::try_new(cfg.clone(), bad).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("weight tensors"), "{e}");
    }
}
