//! Dummy weights (`LlamaWeights::dummy`) are filled in parallel chunks: the values must not
//! depend on the thread count, and a smaller tensor must be a prefix of a larger one.

use baton_model::weights::DUMMY_CHUNK;
use baton_model::{LlamaWeights, ModelConfig};

fn cfg(vocab: usize) -> ModelConfig {
    ModelConfig::from_json_str(&format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": {vocab},
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false}}"#
    ))
    .unwrap()
}

fn on_threads(n: usize, cfg: &ModelConfig) -> LlamaWeights {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
        .install(|| LlamaWeights::dummy(cfg, 5))
}

#[test]
fn dummy_weights_are_the_same_on_any_thread_count_and_grow_by_prefix() {
    // 600 x 2048 = 1.2M values: the embedding and the LM head span two chunks.
    let big = cfg(600);
    let one = on_threads(1, &big);
    let four = on_threads(4, &big);
    assert!(one.embed.data.len() > DUMMY_CHUNK);
    assert_eq!(one.embed.data, four.embed.data);
    assert_eq!(one.lm_head.data, four.lm_head.data);
    assert_eq!(one.layers[0].gate_proj.data, four.layers[0].gate_proj.data);
    let small = LlamaWeights::dummy(&cfg(8), 5);
    assert_eq!(small.embed.data[..], one.embed.data[..8 * 2048]);
    // Tensors, chunks and seeds get different streams.
    let e = &one.embed.data;
    assert_ne!(e[..1000], one.lm_head.data[..1000]);
    assert_ne!(e[..1000], e[DUMMY_CHUNK..DUMMY_CHUNK + 1000]);
    assert_ne!(LlamaWeights::dummy(&cfg(8), 6).embed.data, small.embed.data);
}
