# The dummy Llama shapes of issue 7's benchmarks, as config.json text for `--load-format dummy
# --config`: LLAMA_1B (Llama-3.2-1B widths, tied embeddings) and LLAMA_8B (Llama-3.1-8B).
# Sourced by scripts/gpu-check.sh and scripts/gpu-ab.sh.
# shellcheck shell=bash disable=SC2034
LLAMA_1B='{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":2048,
"intermediate_size":8192,"num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,
"head_dim":64,"vocab_size":128256,"max_position_embeddings":131072,"rms_norm_eps":1e-05,
"rope_theta":500000.0,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
"original_max_position_embeddings":8192,"rope_type":"llama3"},"tie_word_embeddings":true,
"bos_token_id":128000,"eos_token_id":128001}'
LLAMA_8B='{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
"head_dim":128,"vocab_size":128256,"max_position_embeddings":131072,"rms_norm_eps":1e-05,
"rope_theta":500000.0,"rope_scaling":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
"original_max_position_embeddings":8192,"rope_type":"llama3"},"tie_word_embeddings":false,
"bos_token_id":128000,"eos_token_id":128001}'
