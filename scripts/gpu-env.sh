# What the GPU scripts (scripts/gpu-check.sh, scripts/gpu-ab.sh) share; they source it with
# repo_root set:
#   BATON      the binary: $BATON if set, else .gpu/baton (scripts/gpu-prepare.sh), else
#              target/release/baton;
#   LD_LIBRARY_PATH gets /usr/local/cuda/lib64, BATON_CUDA_INCLUDE defaults to
#              /usr/local/cuda/include (where NVRTC finds cuda_bf16.h);
#   LLAMA_1B, LLAMA_8B  the dummy Llama shapes of issue 7's benchmarks as config.json text for
#              `--load-format dummy --config` (Llama-3.2-1B widths with tied embeddings, and
#              Llama-3.1-8B).
# shellcheck shell=bash disable=SC2034
if [[ -n "${BATON:-}" ]]; then :
elif [[ -x "$repo_root/.gpu/baton" ]]; then BATON="$repo_root/.gpu/baton"
else BATON="$repo_root/target/release/baton"; fi
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BATON_CUDA_INCLUDE="${BATON_CUDA_INCLUDE:-/usr/local/cuda/include}"

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
