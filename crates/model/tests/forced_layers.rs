//! `CpuModel::forward_layers_forced`: each layer starts from the given input, so a layer's
//! output depends on the forced input to it and not on the layers before.

use baton_model::{CpuModel, ForwardError, ForwardRow, LlamaWeights, ModelConfig, PagedKvCache};

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": false}"#;

/// One row prefilling `tokens` from position 0, logits of its last token.
fn prefill<'a>(tokens: &'a [u32], block_table: &'a [u32]) -> ForwardRow<'a> {
    ForwardRow {
        tokens,
        start_pos: 0,
        block_table,
        want_logits: true,
        all_logits: false,
        lora: 0,
    }
}

#[test]
fn forced_inputs_replace_each_layers_input_and_the_final_norms() {
    let cfg = ModelConfig::from_json_str(CONFIG).unwrap();
    let model = CpuModel::new(cfg.clone(), LlamaWeights::dummy(&cfg, 3));
    let toks: Vec<u32> = (0..9).map(|i| (3 + 7 * i) % 50).collect();
    let table = [0u32, 1];
    let rows = [prefill(&toks, &table)];
    let run = |forced: Option<&[Vec<f32>]>| {
        let mut kv = PagedKvCache::new(&cfg, 4, 16);
        match forced {
            None => model.forward_with_layer_outputs(&mut kv, &rows).unwrap(),
            Some(f) => model.forward_layers_forced(&mut kv, &rows, f).unwrap(),
        }
    };
    let (logits, outs) = run(None);
    // Forced with its own outputs: the same pass, bit for bit.
    let (l2, o2) = run(Some(&outs));
    assert_eq!(l2, logits);
    assert_eq!(o2, outs);

    // Layer 1's input replaced: layer 0 is unchanged, layer 1 differs, and layer 2 (forced
    // with the unchanged outs[1]) and the logits (forced with outs[2]) are unchanged.
    let mut forced = outs.clone();
    forced[0].iter_mut().for_each(|x| *x *= 1.5);
    let (l3, o3) = run(Some(&forced));
    assert_eq!(o3[0], outs[0]);
    assert_ne!(o3[1], outs[1]);
    assert_eq!(o3[2], outs[2]);
    assert_eq!(l3, logits);

    // The last input feeds the final norm and LM head.
    let mut forced = outs.clone();
    forced[2].iter_mut().for_each(|x| *x = -*x);
    let (l4, _) = run(Some(&forced));
    assert_ne!(l4, logits);
}

#[test]
fn forced_inputs_of_the_wrong_shape_are_an_error() {
    let cfg = ModelConfig::from_json_str(CONFIG).unwrap();
    let model = CpuModel::new(cfg.clone(), LlamaWeights::dummy(&cfg, 3));
    let toks = [1u32, 2, 3];
    let table = [0u32];
    let rows = [prefill(&toks, &table)];
    let mut kv = PagedKvCache::new(&cfg, 4, 16);
    let short = vec![vec![0.0; 3 * 64]; 2];
    let err = model
        .forward_layers_forced(&mut kv, &rows, &short)
        .unwrap_err();
    assert_eq!(
        err,
        ForwardError::ForcedInputs {
            layers: 3,
            values: 192
        }
    );
    let wrong = vec![vec![0.0; 2 * 64]; 3];
    assert!(model.forward_layers_forced(&mut kv, &rows, &wrong).is_err());
}

/// Qwen3-MoE with a dense first layer and a sparse second and third (`mlp_only_layers`).
const MOE_CONFIG: &str = r#"{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 50,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": true,
    "mlp_only_layers": [0]}"#;

#[test]
fn forced_moe_inputs_replace_each_sparse_mlp_input_and_traces_keep_the_models_own() {
    let cfg = ModelConfig::from_json_str(MOE_CONFIG).unwrap();
    let model = CpuModel::new(cfg.clone(), LlamaWeights::dummy(&cfg, 5));
    let toks: Vec<u32> = (0..9).map(|i| (3 + 7 * i) % 50).collect();
    let table = [0u32, 1];
    let rows = [prefill(&toks, &table)];
    let run = |layers: Option<&[Vec<f32>]>, moe: &[Vec<f32>]| {
        let mut kv = PagedKvCache::new(&cfg, 4, 16);
        let out = match layers {
            None => model.forward_with_layer_outputs(&mut kv, &rows).unwrap(),
            Some(f) => model
                .forward_layers_forced_moe(&mut kv, &rows, f, moe)
                .unwrap(),
        };
        (out, model.last_moe_trace())
    };
    let ((logits, outs), trace) = run(None, &[]);
    // One trace per sparse layer: its MLP input and two ascending experts per token.
    assert_eq!(trace.len(), 2);
    for tr in &trace {
        assert_eq!(tr.input.len(), 9 * 64);
        assert_eq!(tr.routes.len(), 9 * 2);
        assert!(tr.routes.chunks(2).all(|p| p[0] < p[1] && p[1] < 8));
    }
    let own: Vec<Vec<f32>> = trace.iter().map(|t| t.input.clone()).collect();
    // Forced with its own layer outputs and MLP inputs: the same pass, bit for bit.
    let ((l2, o2), t2) = run(Some(&outs), &own);
    assert_eq!((l2, o2), (logits.clone(), outs.clone()));
    assert_eq!(t2, trace);

    // The second sparse layer's (layer 2's) MLP input replaced: layers 0 and 1 unchanged,
    // layer 2's output and routes differ, its trace keeps the model's own input.
    let mut moe = own.clone();
    moe[1].iter_mut().for_each(|x| *x = -*x * 3.0);
    let ((_, o3), t3) = run(Some(&outs), &moe);
    assert_eq!(o3[..2], outs[..2]);
    assert_ne!(o3[2], outs[2]);
    assert_eq!(t3[0], trace[0]);
    assert_eq!(t3[1].input, trace[1].input);
    assert_ne!(t3[1].routes, trace[1].routes);

    // A count other than the sparse layers' is an error naming it.
    let mut kv = PagedKvCache::new(&cfg, 4, 16);
    let err = model
        .forward_layers_forced_moe(&mut kv, &rows, &outs, &own[..1])
        .unwrap_err();
    assert_eq!(
        err,
        ForwardError::ForcedInputs {
            layers: 2,
            values: 9 * 64
        }
    );
}
