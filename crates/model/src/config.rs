//! Parsing of a Hugging Face model directory's JSON configs.
//!
//! Contract: [`ModelConfig`] accepts only what the CPU forward pass implements exactly (Llama /
//! Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm), Phi-3 (fused projections),
//! Gemma 3 text (its norms, GeLU, scaled embeddings and local RoPE), the mixture-of-experts
//! MLPs of Mixtral, Qwen2-MoE and Qwen3-MoE ([`MoeConfig`]); no other biases, default, `llama3`, `yarn` or `longrope` RoPE, full or
//! sliding-window attention per layer) and rejects anything else with a [`ModelError`] naming
//! the file and field. What depends on the served context length (LongRoPE's choice of
//! factors) is set by [`ModelConfig::set_max_model_len`]. [`GenerationConfig`] and
//! [`TokenizerConfig`] are lenient: unknown keys are ignored, known keys must be well-typed.

use crate::error::ModelError;
use serde_json::{Map, Value};
use std::path::Path;

/// Largest `hidden_size` accepted (4x Llama 3.1 405B's).
pub const MAX_HIDDEN_SIZE: usize = 1 << 16;
/// Largest `intermediate_size` accepted.
pub const MAX_INTERMEDIATE_SIZE: usize = 1 << 20;
/// Largest `num_hidden_layers` accepted.
pub const MAX_LAYERS: usize = 1 << 10;
/// Largest `num_attention_heads` accepted.
pub const MAX_HEADS: usize = 1 << 10;
/// Largest `head_dim` accepted.
pub const MAX_HEAD_DIM: usize = 1 << 10;
/// Largest number of experts per mixture-of-experts layer accepted (Qwen3-MoE has 128,
/// DeepSeek-V3 256).
pub const MAX_EXPERTS: usize = 1 << 10;
/// Largest `vocab_size` accepted (16x Gemma's): the scheduler's per-slot token-mask table
/// holds `vocab_size / 8` bytes per sequence.
pub const MAX_VOCAB_SIZE: usize = 1 << 22;
/// The MLP's activation of the gate projection (`hidden_act`; Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (`silu`, Llama's): `x sigmoid(x)`.
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`, Gemma's; PyTorch's
    /// `gelu(approximate="tanh")`): `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
    GeluTanh,
}

/// RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Linear position interpolation (`linear`; Chen et al. 2023, arXiv:2306.15595): every
    /// inverse frequency divided by `factor` (transformers' `_compute_linear_scaling_rope_parameters`).
    Linear {
        /// The divisor, > 0.
        factor: f32,
    },
    /// Llama 3.1 style scaling, see [`ModelConfig::rope_inv_freq`].
    Llama3 {
        /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
        /// divided by this factor.
        factor: f32,
        /// Low-frequency cutoff divisor.
        low_freq_factor: f32,
        /// High-frequency cutoff divisor.
        high_freq_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
    /// YaRN (Peng et al. 2023, arXiv:2309.00071), as Qwen2.5 and Qwen3 enable it for long
    /// contexts; see [`ModelConfig::rope_inv_freq`] and [`ModelConfig::rope_attention_factor`].
    Yarn {
        /// Context extension factor (`factor`).
        factor: f32,
        /// Context length the model was pre-trained with (`original_max_position_embeddings`,
        /// else `max_position_embeddings`).
        original_max_position_embeddings: usize,
        /// Rotations at which the ramp ends in pure extrapolation (`beta_fast`, default 32).
        beta_fast: f32,
        /// Rotations at which the ramp starts from pure interpolation (`beta_slow`, default 1).
        beta_slow: f32,
        /// The factor cos and sin are multiplied by (`attention_factor`, else
        /// `0.1 ln(factor) + 1` for `factor > 1`, else 1).
        attention_factor: f32,
        /// Whether the correction range is rounded outwards to whole dimensions (`truncate`,
        /// default true).
        truncate: bool,
    },
    /// LongRoPE (Ding et al. 2024, arXiv:2402.13753) as Phi-3 configures it (`longrope`, or
    /// the older name `su`). transformers' Phi-3 switches from the short to the long factors
    /// once a sequence is longer than `original_max_position_embeddings`, which would change
    /// the RoPE of keys already in a KV cache; Baton, as vLLM, chooses once for every position
    /// by the served context length ([`ModelConfig::set_max_model_len`]: the long factors when
    /// it exceeds `original_max_position_embeddings`). See [`ModelConfig::rope_inv_freq`] and
    /// [`ModelConfig::rope_attention_factor`].
    LongRope {
        /// Per-frequency divisors for short contexts (`short_factor`), `rotary_dim / 2` of
        /// them.
        short_factor: Vec<f32>,
        /// Per-frequency divisors for long contexts (`long_factor`), `rotary_dim / 2` of them.
        long_factor: Vec<f32>,
        /// Whether `long_factor` applies (else `short_factor`): false as parsed, set by
        /// [`ModelConfig::set_max_model_len`].
        long: bool,
        /// The factor cos and sin are multiplied by (`attention_factor`, else
        /// `sqrt(1 + ln(s) / ln(original_max_position_embeddings))` for
        /// `s = max_position_embeddings / original_max_position_embeddings > 1`, else 1;
        /// transformers' `_compute_longrope_parameters`).
        attention_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
}

/// How a mixture-of-experts checkpoint names a layer's router and experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeNaming {
    /// Mixtral (`modeling_mixtral.py` as saved before transformers 5):
    /// `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w1|w3|w2.weight`
    /// (gate, up, down).
    Mixtral,
    /// Qwen2-MoE and Qwen3-MoE: `mlp.gate.weight` and
    /// `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`; Qwen2-MoE's shared expert
    /// `mlp.shared_expert.*_proj.weight` and `mlp.shared_expert_gate.weight`.
    Qwen,
}

/// The mixture-of-experts MLPs of Mixtral, Qwen2-MoE and Qwen3-MoE (transformers'
/// `MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`; vLLM's
/// `fused_topk`).
///
/// For each token `x` (the MLP input after its RMSNorm): router logits `g = W_r x`
/// (`[num_experts]`), `p = softmax(g)` in f32, the `top_k` largest `p_e` (ties to the lower
/// expert id), divided by their sum when [`MoeConfig::norm_topk_prob`]; the output is
/// `Σ p_e · expert_e(x)` over the chosen experts in ascending expert id (transformers' loop
/// order), where each expert is a SiLU MLP of width [`MoeConfig::intermediate_size`]; plus,
/// with a shared expert (Qwen2-MoE), `sigmoid(w_s · x) · shared(x)`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_local_experts`, Qwen's `num_experts`), 1..=[`MAX_EXPERTS`].
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`), 1..=`num_experts`.
    pub top_k: usize,
    /// Each expert's MLP inner width (Qwen's `moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub intermediate_size: usize,
    /// Whether the top-k routing weights are renormalized to sum to 1 (Mixtral always;
    /// Qwen's `norm_topk_prob`, default false).
    pub norm_topk_prob: bool,
    /// The shared expert's inner width (Qwen2-MoE's `shared_expert_intermediate_size`), 0
    /// for none.
    pub shared_expert_intermediate_size: usize,
    /// Per layer (`num_hidden_layers` entries): whether its MLP is the mixture of experts;
    /// else a dense MLP of [`ModelConfig::intermediate_size`] (Qwen's `mlp_only_layers` and
    /// `decoder_sparse_step`: layer `i` is sparse when `(i + 1) % step == 0` and `i` is not
    /// listed).
    pub layers: Vec<bool>,
    /// The checkpoint's tensor names.
    pub naming: MoeNaming,
}

/// A Llama-family model's architecture, from `config.json`.
///
/// Defaults follow transformers' `LlamaConfig`: `num_key_value_heads = num_attention_heads`,
/// `head_dim = hidden_size / num_attention_heads` (`Qwen3Config`: 128), `rope_theta = 10000`,
/// `tie_word_embeddings = false`.
///
/// Qwen2 and Qwen3 are Llama with two additions, each a flag here so that every backend
/// tests the flag rather than the name (transformers' `modeling_qwen2.py` /
/// `modeling_qwen3.py`): [`ModelConfig::qkv_bias`] and [`ModelConfig::qk_norm`]. Phi-3
/// (`modeling_phi3.py`, also Phi-4) is Llama with fused projection matrices in the
/// checkpoint, which the loader splits ([`ModelConfig::fused_projections`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `architectures` as found (may be empty when the key is absent).
    pub architectures: Vec<String>,
    /// `model_type`: `llama`, `mistral`, `mixtral`, `qwen2`, `qwen2_moe`, `qwen3`, `qwen3_moe`,
    /// `phi3` or `gemma3_text` (also for
    /// the text model of a multimodal `gemma3` checkpoint, [`ModelConfig::multimodal_text`]).
    pub model_type: String,
    /// The q, k and v projections add a bias (`self_attn.{q,k,v}_proj.bias`, shapes
    /// `[heads * head_dim]`, `[kv_heads * head_dim]` twice): Qwen2, always. The output
    /// projection never has one here.
    pub qkv_bias: bool,
    /// Each query head and each key head is RMS-normalized over `head_dim` after the
    /// projection and before RoPE, with `self_attn.q_norm.weight` / `k_norm.weight`
    /// (`[head_dim]`, shared by the heads) and `rms_norm_eps`: Qwen3 (`Qwen3RMSNorm`).
    pub qk_norm: bool,
    /// The checkpoint stores each layer's q, k and v projections as one
    /// `self_attn.qkv_proj.weight` (`[(heads + 2 kv_heads) * head_dim, hidden]`: the q rows,
    /// then k, then v) and gate and up as one `mlp.gate_up_proj.weight`
    /// (`[2 * intermediate, hidden]`: gate rows, then up): Phi-3 (transformers'
    /// `Phi3Attention` / `Phi3MLP`). The model is Llama's; [`crate::WeightSource`] serves the
    /// row ranges under the Llama names.
    pub fused_projections: bool,
    /// The MLP activation: SiLU, or Gemma's tanh GELU.
    pub hidden_act: Activation,
    /// Every RMSNorm weight is used as `norm_offset + w`: 1 for Gemma 3 (`Gemma3RMSNorm`:
    /// `x * rsqrt(mean(x²) + eps) * (1 + w)`, all in f32, its weights stored around 0), 0
    /// elsewhere. Backends fold it into their f32 copies of the norm weights.
    pub norm_offset: f32,
    /// Gemma 3's four norms per layer (`Gemma3DecoderLayer`): besides the norms before
    /// attention and before the MLP (checkpoint names `input_layernorm` and
    /// `pre_feedforward_layernorm`), `post_attention_layernorm` normalizes the attention
    /// output and `post_feedforward_layernorm` the MLP output, each before its residual add.
    /// (In Llama `post_attention_layernorm` is the norm before the MLP.) See
    /// [`crate::weights::layer_tensor_shapes`].
    pub sandwich_norms: bool,
    /// The factor token embeddings are multiplied by after the lookup: Gemma 3's
    /// `sqrt(hidden_size)`, rounded to the checkpoint's dtype (`torch_dtype`) as transformers'
    /// `Gemma3TextScaledWordEmbedding` does (`embed_scale.to(weight.dtype)`: 55.4256 becomes
    /// 55.5 in bf16); `None` elsewhere.
    pub embed_scale: Option<f32>,
    /// Attention scores are `q.k * query_pre_attn_scalar^-0.5` where given (Gemma 3's
    /// `query_pre_attn_scalar`), else `head_dim^-0.5`; see [`ModelConfig::attention_scale`].
    pub query_pre_attn_scalar: Option<f32>,
    /// RoPE base of the sliding-window layers (Gemma 3's `rope_local_base_freq`), which use
    /// plain RoPE; the other layers use `rope_theta` and `rope_scaling`. `None`: every layer
    /// uses those. See [`ModelConfig::layer_rope`].
    pub local_rope_theta: Option<f32>,
    /// The text model of a multimodal checkpoint (`Gemma3ForConditionalGeneration`): its
    /// tensors are stored as `language_model.model.*` (or `model.language_model.*` by newer
    /// transformers) and read under the text model's names, and the vision tower's are
    /// ignored ([`crate::WeightSource::open_for`]).
    pub multimodal_text: bool,
    /// Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE), `None` for a dense model.
    pub moe: Option<MoeConfig>,
    /// Residual stream width (elements).
    pub hidden_size: usize,
    /// MLP inner width (elements) of the dense MLPs (with [`ModelConfig::moe`], of the layers
    /// that are not sparse; Mixtral has none).
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Per-head width (elements); even.
    pub head_dim: usize,
    /// How many leading dims of each q and k head RoPE rotates (transformers'
    /// `int(head_dim * partial_rotary_factor)`, as Phi-4-mini gives; else `head_dim`); even.
    /// Every backend rotates the whole head (pairs `(i, i + head_dim / 2)`), so for a smaller
    /// value [`crate::WeightSource::open_for`] permutes each head's q and k rows (and their
    /// biases and norms) so that the rotated pairs `(i, i + rotary_dim / 2)` land on
    /// `(i, i + head_dim / 2)` and the other dims on pairs that
    /// [`ModelConfig::rope_inv_freq`] gives frequency 0 (cos 1, sin 0: left as they are).
    /// q.k is a sum over the head's dims, so the permutation changes no score.
    pub rotary_dim: usize,
    /// Rows of the embedding and LM-head matrices.
    pub vocab_size: usize,
    /// Largest number of positions the model accepts (config.json's value).
    pub max_position_embeddings: usize,
    /// Sliding-window attention, per layer (`num_hidden_layers` entries): `Some(w)` when the
    /// layer's query at position `p` attends only to positions `p + 1 - w ..= p` (its last `w`
    /// keys, itself included: transformers' `sliding_window_overlay`, `kv_idx > q_idx - w`, and
    /// FlashAttention's `window_size = (w - 1, 0)` as vLLM passes it); `None` for full causal
    /// attention. Mistral and Phi-3 slide on every layer when `sliding_window` is set; Qwen2
    /// and Qwen3 only with `use_sliding_window`, from `max_window_layers` on, or where
    /// `layer_types` says `sliding_attention`. A window of `max_position_embeddings` or more
    /// is `None` (it covers every position).
    pub sliding_window: Vec<Option<usize>>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling, `None` for plain RoPE.
    pub rope_scaling: Option<RopeScaling>,
    /// When true (or when `lm_head.weight` is absent) the LM head reuses `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// `bos_token_id`, if given.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (an int or a list in HF configs), empty if absent.
    pub eos_token_ids: Vec<u32>,
    /// `torch_dtype` (or transformers 5's `dtype`), e.g. `"bfloat16"`, if given.
    pub torch_dtype: Option<String>,
    /// `quantization_config` of an FP8 checkpoint ([`crate::quant`]): its float8 weights are
    /// dequantized to the model's dtype at load. `None` for an unquantized checkpoint.
    pub quantization: Option<crate::quant::Fp8Quant>,
}

/// Whether `x` stays a positive, finite number as f32 (what the RoPE tables compute in):
/// `1e-300` would become 0 and `1e300` infinity, and either NaN logits.
fn positive_f32(x: f64) -> bool {
    let y = x as f32;
    y > 0.0 && y.is_finite()
}

/// Reads typed fields from one JSON object, producing errors that name file and field.
pub(crate) struct Fields<'a> {
    pub(crate) file: &'a str,
    pub(crate) obj: &'a Map<String, Value>,
    pub(crate) prefix: &'a str,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(file: &'a str, v: &'a Value) -> Result<Self, ModelError> {
        match v.as_object() {
            Some(obj) => Ok(Fields {
                file,
                obj,
                prefix: "",
            }),
            None => Err(ModelError::InvalidField {
                file: file.to_string(),
                field: "<root>".into(),
                reason: "expected a JSON object".into(),
            }),
        }
    }

    fn name(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }

    pub(crate) fn invalid(&self, key: &str, reason: impl Into<String>) -> ModelError {
        ModelError::InvalidField {
            file: self.file.to_string(),
            field: self.name(key),
            reason: reason.into(),
        }
    }

    pub(crate) fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingField {
            file: self.file.to_string(),
            field: self.name(key),
        }
    }

    /// The value, treating JSON `null` as absent.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn opt_u64(&self, key: &str) -> Result<Option<u64>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                match v.as_u64() {
                    Some(x) => Ok(Some(x)),
                    // Accept integral floats such as 4096.0.
                    None => match v.as_f64() {
                        Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 1e15 => Ok(Some(f as u64)),
                        _ => Err(self
                            .invalid(key, format!("expected a non-negative integer, found {v}"))),
                    },
                }
            }
        }
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        self.opt_u64(key)?
            .map(|x| usize::try_from(x).map_err(|_| self.invalid(key, "too large")))
            .transpose()
    }

    pub(crate) fn req_usize(&self, key: &str) -> Result<usize, ModelError> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    pub(crate) fn opt_u32(&self, key: &str) -> Result<Option<u32>, ModelError> {
        self.opt_u64(key)?
            .map(|x| u32::try_from(x).map_err(|_| self.invalid(key, "does not fit in u32")))
            .transpose()
    }

    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| self.invalid(key, format!("expected a number, found {v}"))),
        }
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.invalid(key, format!("expected true or false, found {v}"))),
        }
    }

    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&'a str>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.invalid(key, format!("expected a string, found {v}"))),
        }
    }

    /// An int or a list of ints (HF's `eos_token_id` convention).
    pub(crate) fn u32_or_list(&self, key: &str) -> Result<Vec<u32>, ModelError> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| {
                            self.invalid(key, format!("list item {v} is not a token id"))
                        })
                })
                .collect(),
            Some(_) => Ok(vec![self.opt_u32(key)?.unwrap_or(0)]),
        }
    }

    pub(crate) fn sub(&self, key: &str, prefix: &'a str) -> Result<Option<Fields<'a>>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields {
                file: self.file,
                obj,
                prefix,
            })),
            Some(v) => Err(self.invalid(key, format!("expected an object, found {v}"))),
        }
    }
}

/// Parses a JSON document, mapping syntax errors to [`ModelError::Json`] with line/column.
pub(crate) fn parse_json(file: &str, text: &str) -> Result<Value, ModelError> {
    serde_json::from_str(text).map_err(|e| ModelError::json(file, &e))
}

/// Reads a whole file as UTF-8, mapping failures to [`ModelError::Io`].
pub(crate) fn read_text(path: &Path) -> Result<String, ModelError> {
    std::fs::read_to_string(path).map_err(|e| ModelError::io(path, &e))
}

impl ModelConfig {
    /// Loads and validates `config.json`.
    ///
    /// # Errors
    /// [`ModelError::Io`] when unreadable, [`ModelError::Json`] for bad JSON, and the field
    /// errors of [`ModelConfig::from_json_str`].
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = read_text(path)?;
        Self::from_json_str_named(&text, &path.display().to_string())
    }

    /// A 64-bit fingerprint of what the forward pass computes: `model_type`, the widths
    /// (`hidden_size`, `intermediate_size`, `head_dim`), `num_hidden_layers`, the query and KV
    /// head counts, `vocab_size`, `rms_norm_eps`, `rope_theta`, `rope_scaling`, the rotary dim
    /// when below `head_dim`, the sliding windows, and `tie_word_embeddings`. Two processes that disagree on it would run different models on
    /// the same KV pages and token ids, so the scheduler publishes it and a worker or frontend
    /// with another one refuses to attach. Leaves out what may differ between processes of one
    /// deployment (`max_position_embeddings`, EOS/BOS ids, `torch_dtype`).
    ///
    /// FNV-1a ([`crate::fingerprint::Fnv64`]) over the fields' little-endian bytes (floats by
    /// their bit patterns); never 0, which the segment uses for "unknown". The weights have
    /// their own fingerprint ([`crate::fingerprint::weights_fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        let mut h = crate::fingerprint::Fnv64::default();
        let mut eat = |bytes: &[u8]| h.eat(bytes);
        eat(self.model_type.as_bytes());
        eat(&[0xff]);
        for n in [
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.vocab_size,
        ] {
            eat(&(n as u64).to_le_bytes());
        }
        eat(&self.rms_norm_eps.to_bits().to_le_bytes());
        eat(&self.rope_theta.to_bits().to_le_bytes());
        match &self.rope_scaling {
            None => eat(&[0]),
            Some(RopeScaling::Linear { factor }) => {
                eat(&[4]);
                eat(&factor.to_bits().to_le_bytes());
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                eat(&[1]);
                for x in [factor, low_freq_factor, high_freq_factor] {
                    eat(&x.to_bits().to_le_bytes());
                }
                eat(&(*original_max_position_embeddings as u64).to_le_bytes());
            }
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            }) => {
                eat(&[2, u8::from(*truncate)]);
                for x in [factor, beta_fast, beta_slow, attention_factor] {
                    eat(&x.to_bits().to_le_bytes());
                }
                eat(&(*original_max_position_embeddings as u64).to_le_bytes());
            }
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                long,
                attention_factor,
                original_max_position_embeddings,
            }) => {
                // The factors in use (the choice is the served length's, which every process
                // of a deployment sets from the scheduler's).
                eat(&[3, u8::from(*long)]);
                let f = if *long { long_factor } else { short_factor };
                for x in f.iter().chain([attention_factor]) {
                    eat(&x.to_bits().to_le_bytes());
                }
                eat(&(*original_max_position_embeddings as u64).to_le_bytes());
            }
        }
        eat(&[u8::from(self.tie_word_embeddings)]);
        // The model_type above already separates Qwen from Llama; the flags are eaten too
        // (only when set, so Llama fingerprints are unchanged) in case a type gains one.
        if self.qkv_bias || self.qk_norm {
            eat(&[0xfe, u8::from(self.qkv_bias), u8::from(self.qk_norm)]);
        }
        if self.rotary_dim != self.head_dim {
            eat(&[0xfd]);
            eat(&(self.rotary_dim as u64).to_le_bytes());
        }
        if self.sliding_window.iter().any(Option::is_some) {
            eat(&[0xfc]);
            for w in &self.sliding_window {
                eat(&(w.unwrap_or(0) as u64).to_le_bytes());
            }
        }
        // Gemma's conventions (only when any differs from Llama's, so other fingerprints stay).
        let gemma_like = self.hidden_act != Activation::Silu
            || self.norm_offset != 0.0
            || self.sandwich_norms
            || self.embed_scale.is_some()
            || self.query_pre_attn_scalar.is_some()
            || self.local_rope_theta.is_some();
        if gemma_like {
            eat(&[0xfb, self.hidden_act as u8, u8::from(self.sandwich_norms)]);
            for x in [
                self.norm_offset,
                self.embed_scale.unwrap_or(0.0),
                self.query_pre_attn_scalar.unwrap_or(0.0),
                self.local_rope_theta.unwrap_or(0.0),
            ] {
                eat(&x.to_bits().to_le_bytes());
            }
        }
        if let Some(m) = &self.moe {
            eat(&[0xfa, m.naming as u8, u8::from(m.norm_topk_prob)]);
            for n in [
                m.num_experts,
                m.top_k,
                m.intermediate_size,
                m.shared_expert_intermediate_size,
            ] {
                eat(&(n as u64).to_le_bytes());
            }
            eat(&m.layers.iter().map(|&s| u8::from(s)).collect::<Vec<_>>());
        }
        h.finish()
    }

    /// Parses and validates a config from JSON text (errors name the file `config.json`).
    ///
    /// # Errors
    /// [`ModelError::MissingField`] / [`ModelError::InvalidField`] for absent or ill-typed
    /// fields, [`ModelError::UnsupportedArchitecture`] / [`ModelError::UnsupportedModelType`],
    /// and `InvalidField` for unsupported features (biases, non-SiLU
    /// activation, unknown `rope_scaling` type, inconsistent head counts).
    pub fn from_json_str(json: &str) -> Result<Self, ModelError> {
        Self::from_json_str_named(json, "config.json")
    }

    /// [`ModelConfig::from_json_str`], its errors naming `file` (say `--config` for JSON given
    /// on a command line) instead of `config.json`.
    ///
    /// # Errors
    /// As [`ModelConfig::from_json_str`].
    pub fn from_json_str_named(json: &str, file: &str) -> Result<Self, ModelError> {
        let v = parse_json(file, json)?;
        if v.get("model_type").and_then(Value::as_str) == Some("gemma3") {
            return Self::from_multimodal_gemma3(&v, file);
        }
        Self::from_value(&v, file)
    }

    /// The text model of a multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`,
    /// `model_type` `gemma3`: gemma-3-4b/12b/27b): its `text_config`, which gives only what
    /// differs from `Gemma3TextConfig`'s defaults (filled in here), with the top level's EOS/BOS
    /// ids and dtype. The vision tower is not loaded ([`ModelConfig::multimodal_text`]), so
    /// such a model serves text only.
    fn from_multimodal_gemma3(v: &Value, file: &str) -> Result<Self, ModelError> {
        let f = Fields::new(file, v)?;
        let archs = f.get("architectures").and_then(Value::as_array);
        let known = archs.is_none_or(|a| {
            a.iter()
                .any(|x| x.as_str() == Some("Gemma3ForConditionalGeneration"))
        });
        if !known {
            return Err(ModelError::UnsupportedArchitecture {
                file: file.into(),
                found: archs.into_iter().flatten().map(|x| x.to_string()).collect(),
            });
        }
        let text = f
            .get("text_config")
            .ok_or_else(|| f.missing("text_config"))?
            .as_object()
            .ok_or_else(|| f.invalid("text_config", "expected an object"))?;
        // Gemma3TextConfig's defaults (transformers' configuration_gemma3.py).
        let mut merged: Map<String, Value> = serde_json::from_str(
            r#"{"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
            "bos_token_id": 2, "eos_token_id": 1, "rope_theta": 1000000.0,
            "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}"#,
        )
        .expect("the defaults parse");
        for key in [
            "bos_token_id",
            "eos_token_id",
            "torch_dtype",
            "dtype",
            "quantization_config",
        ] {
            if let Some(x) = f.get(key) {
                merged.insert(key.into(), x.clone());
            }
        }
        for (k, x) in text {
            merged.insert(k.clone(), x.clone());
        }
        merged.insert(
            "architectures".into(),
            serde_json::json!(["Gemma3ForCausalLM"]),
        );
        merged.insert("model_type".into(), "gemma3_text".into());
        let mut cfg = Self::from_value(&Value::Object(merged), file)?;
        cfg.architectures = archs
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str().map(str::to_owned))
            .collect();
        cfg.multimodal_text = true;
        Ok(cfg)
    }

    /// The mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config (defaults
    /// from `MixtralConfig`, `Qwen2MoeConfig`, `Qwen3MoeConfig`); `None` for other types, and
    /// for a Qwen MoE config whose layers are all dense.
    fn parse_moe(
        f: &Fields<'_>,
        model_type: &str,
        num_layers: usize,
        intermediate_size: usize,
    ) -> Result<Option<MoeConfig>, ModelError> {
        let (naming, experts_default, top_k_default) = match model_type {
            "mixtral" => (MoeNaming::Mixtral, 8, 2),
            "qwen2_moe" => (MoeNaming::Qwen, 60, 4),
            "qwen3_moe" => (MoeNaming::Qwen, 128, 8),
            _ => return Ok(None),
        };
        // transformers maps `num_experts` and `num_local_experts` to each other.
        let key = if f.get("num_local_experts").is_some() {
            "num_local_experts"
        } else {
            "num_experts"
        };
        let num_experts = f.opt_usize(key)?.unwrap_or(experts_default);
        if num_experts > MAX_EXPERTS {
            return Err(f.invalid(
                key,
                format!("{num_experts} is larger than Baton supports ({MAX_EXPERTS})"),
            ));
        }
        let mixtral = naming == MoeNaming::Mixtral;
        if num_experts == 0 {
            if mixtral {
                return Err(f.invalid(key, "must be > 0"));
            }
            // Qwen: no sparse layer (transformers tests `num_experts > 0`).
            return Ok(None);
        }
        let top_k = f.opt_usize("num_experts_per_tok")?.unwrap_or(top_k_default);
        if top_k == 0 || top_k > num_experts {
            return Err(f.invalid(
                "num_experts_per_tok",
                format!("{top_k} must be in 1..={num_experts} ({key})"),
            ));
        }
        let (moe_width, norm_topk_prob, shared, layers) = if mixtral {
            (intermediate_size, true, 0, vec![true; num_layers])
        } else {
            let width = f
                .opt_usize("moe_intermediate_size")?
                .unwrap_or(if model_type == "qwen2_moe" { 1408 } else { 768 });
            let shared = if model_type == "qwen2_moe" {
                f.opt_usize("shared_expert_intermediate_size")?
                    .unwrap_or(5632)
            } else {
                0
            };
            for (k, x) in [
                ("moe_intermediate_size", width),
                ("shared_expert_intermediate_size", shared),
            ] {
                if x > MAX_INTERMEDIATE_SIZE {
                    return Err(f.invalid(
                        k,
                        format!("{x} is larger than Baton supports ({MAX_INTERMEDIATE_SIZE})"),
                    ));
                }
            }
            if width == 0 {
                return Err(f.invalid("moe_intermediate_size", "must be > 0"));
            }
            let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(f.invalid("decoder_sparse_step", "must be > 0"));
            }
            let dense: Vec<usize> = match f.get("mlp_only_layers") {
                None => vec![],
                Some(v) => v
                    .as_array()
                    .and_then(|a| {
                        a.iter()
                            .map(|x| x.as_u64().map(|x| x as usize))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| {
                        f.invalid("mlp_only_layers", "expected a list of layer indices")
                    })?,
            };
            // (An index past the last layer names no layer; transformers ignores it too.)
            let layers: Vec<bool> = (0..num_layers)
                .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                .collect();
            let norm = f.opt_bool("norm_topk_prob")?.unwrap_or(false);
            (width, norm, shared, layers)
        };
        if !layers.contains(&true) {
            return Ok(None);
        }
        Ok(Some(MoeConfig {
            num_experts,
            top_k,
            intermediate_size: moe_width,
            norm_topk_prob,
            shared_expert_intermediate_size: shared,
            layers,
            naming,
        }))
    }

    /// Whether layer `li`'s MLP is a mixture of experts ([`ModelConfig::moe`]).
    pub fn layer_is_moe(&self, li: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.layers.get(li).copied().unwrap_or(false))
    }

    fn from_value(v: &Value, file: &str) -> Result<Self, ModelError> {
        let f = Fields::new(file, v)?;

        let architectures: Vec<String> = match f.get("architectures") {
            None => vec![],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| f.invalid("architectures", "expected a list of strings"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(f.invalid("architectures", "expected a list of strings")),
        };
        const ARCHS: [&str; 9] = [
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "MixtralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Phi3ForCausalLM",
            "Gemma3ForCausalLM",
        ];
        if !architectures.is_empty() && !architectures.iter().any(|a| ARCHS.contains(&a.as_str())) {
            return Err(ModelError::UnsupportedArchitecture {
                file: file.into(),
                found: architectures,
            });
        }
        let model_type = f
            .opt_str("model_type")?
            .ok_or_else(|| f.missing("model_type"))?;
        const TYPES: [&str; 9] = [
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "phi3",
            "gemma3_text",
        ];
        if !TYPES.contains(&model_type) {
            return Err(ModelError::UnsupportedModelType {
                file: file.into(),
                found: model_type.into(),
            });
        }

        let hidden_size = f.req_usize("hidden_size")?;
        // The MoE config classes default it (their dense layers' width; Mixtral's experts').
        let intermediate_size = match model_type {
            "mixtral" => f.opt_usize("intermediate_size")?.unwrap_or(14336),
            "qwen2_moe" => f.opt_usize("intermediate_size")?.unwrap_or(5632),
            "qwen3_moe" => f.opt_usize("intermediate_size")?.unwrap_or(6144),
            _ => f.req_usize("intermediate_size")?,
        };
        let num_hidden_layers = f.req_usize("num_hidden_layers")?;
        let num_attention_heads = f.req_usize("num_attention_heads")?;
        let vocab_size = f.req_usize("vocab_size")?;
        let max_position_embeddings = f.req_usize("max_position_embeddings")?;
        for (k, x) in [
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("num_hidden_layers", num_hidden_layers),
            ("num_attention_heads", num_attention_heads),
            ("vocab_size", vocab_size),
            ("max_position_embeddings", max_position_embeddings),
        ] {
            if x == 0 {
                return Err(f.invalid(k, "must be > 0"));
            }
        }
        // Far above any model served (Llama 3.1 405B: hidden 16384, 126 layers, 128 heads;
        // Gemma's 262144-token vocabulary): a larger value is a typo, and honouring it would
        // only fail later on an allocation of terabytes.
        for (k, x, max) in [
            ("hidden_size", hidden_size, MAX_HIDDEN_SIZE),
            (
                "intermediate_size",
                intermediate_size,
                MAX_INTERMEDIATE_SIZE,
            ),
            ("num_hidden_layers", num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", num_attention_heads, MAX_HEADS),
            ("vocab_size", vocab_size, MAX_VOCAB_SIZE),
        ] {
            if x > max {
                return Err(f.invalid(k, format!("{x} is larger than Baton supports ({max})")));
            }
        }
        let num_key_value_heads = f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(f.invalid(
                "num_key_value_heads",
                format!("{num_key_value_heads} must be > 0 and divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(h) => h,
            // Qwen3Config's and Gemma3TextConfig's own defaults, whatever the widths.
            None if model_type == "qwen3" => 128,
            None if model_type == "gemma3_text" => 256,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.invalid(
                        "hidden_size",
                        format!("{hidden_size} is not divisible by num_attention_heads {num_attention_heads} and head_dim is absent"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.invalid(
                "head_dim",
                format!("{head_dim} must be even and > 0 for RoPE"),
            ));
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(f.invalid(
                "head_dim",
                format!("{head_dim} is larger than Baton supports ({MAX_HEAD_DIM})"),
            ));
        }
        // MixtralConfig's default is 1e-5; the others' 1e-6.
        let default_eps = if model_type == "mixtral" { 1e-5 } else { 1e-6 };
        let rms_norm_eps = f.opt_f64("rms_norm_eps")?.unwrap_or(default_eps) as f32;
        if !(rms_norm_eps >= 0.0 && rms_norm_eps.is_finite()) {
            return Err(f.invalid("rms_norm_eps", format!("{rms_norm_eps} must be >= 0")));
        }

        let gemma = model_type == "gemma3_text";
        // Gemma3TextConfig reads only `hidden_activation` (default gelu_pytorch_tanh); a
        // `hidden_act` beside it is an unused key there, as in vLLM.
        let act_key = if gemma {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let hidden_act = match f.opt_str(act_key)? {
            None if gemma => Activation::GeluTanh,
            None | Some("silu") => Activation::Silu,
            Some("gelu_pytorch_tanh") => Activation::GeluTanh,
            Some(act) => {
                return Err(f.invalid(
                    act_key,
                    format!("{act:?} is unsupported; only silu and gelu_pytorch_tanh"),
                ))
            }
        };
        // Gemma 3 text: what transformers' Gemma3TextConfig runs that Baton does not is
        // refused (Gemma 2's soft-capping, EmbeddingGemma's bidirectional attention).
        if gemma {
            for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
                match f.get(key) {
                    None | Some(Value::Null) => {}
                    Some(x) => {
                        return Err(f.invalid(key, format!("{x}: soft-capping is not implemented")))
                    }
                }
            }
            if f.opt_bool("use_bidirectional_attention")? == Some(true) {
                return Err(f.invalid(
                    "use_bidirectional_attention",
                    "bidirectional attention (an embedding model) is not implemented",
                ));
            }
        }
        let query_pre_attn_scalar = match f.opt_f64("query_pre_attn_scalar")? {
            Some(x) if gemma && positive_f32(x) => Some(x as f32),
            Some(x) if gemma => {
                return Err(f.invalid("query_pre_attn_scalar", format!("{x} must be > 0")))
            }
            None if gemma => Some(256.0),
            _ => None,
        };
        // Qwen2 always has q/k/v biases (its config has no key for them); elsewhere
        // `attention_bias` also puts one on o_proj, which is not implemented.
        for key in ["attention_bias", "mlp_bias"] {
            if f.opt_bool(key)? == Some(true) {
                return Err(f.invalid(
                    key,
                    format!("biases are unsupported for model_type {model_type:?}"),
                ));
            }
        }
        // Qwen2MoeConfig has a `qkv_bias` key (default true).
        let qkv_bias = model_type == "qwen2"
            || (model_type == "qwen2_moe" && f.opt_bool("qkv_bias")? != Some(false));
        let qk_norm = model_type == "qwen3" || model_type == "qwen3_moe" || gemma;
        let fused_projections = model_type == "phi3";
        // transformers: `int(head_dim * partial_rotary_factor)` leading dims are rotated.
        let rotary_dim = match f.opt_f64("partial_rotary_factor")? {
            None => head_dim,
            Some(x) if x > 0.0 && x <= 1.0 => {
                let r = (head_dim as f64 * x) as usize;
                if r == 0 || !r.is_multiple_of(2) {
                    return Err(f.invalid(
                        "partial_rotary_factor",
                        format!("{x} rotates {r} of {head_dim} dims; need an even number > 0"),
                    ));
                }
                r
            }
            Some(x) => {
                return Err(f.invalid("partial_rotary_factor", format!("{x} must be in (0, 1]")))
            }
        };
        if f.opt_usize("pretraining_tp")?.unwrap_or(1) != 1 {
            return Err(f.invalid("pretraining_tp", "only 1 is supported"));
        }
        // Sliding-window attention, per layer (see `ModelConfig::sliding_window`).
        let mut sliding_window: Vec<Option<usize>> = vec![None; num_hidden_layers];
        // The window in tokens (`sliding_window`): the config class's default when the key is
        // absent (MistralConfig, Qwen2Config, Qwen3Config, Gemma3TextConfig: 4096; Phi3Config:
        // none), none for `null` (transformers then slides no layer); a window that covers
        // every position is no window.
        let window = |default: Option<usize>| -> Result<Option<usize>, ModelError> {
            // (`Fields::get` reads null as absent; here they differ.)
            let w = match f.obj.get("sliding_window") {
                None => match default {
                    Some(w) => w,
                    None => return Ok(None),
                },
                Some(Value::Null) => return Ok(None),
                Some(w) => f.opt_usize("sliding_window")?.ok_or_else(|| {
                    f.invalid("sliding_window", format!("expected an integer, found {w}"))
                })?,
            };
            if w == 0 {
                return Err(f.invalid("sliding_window", "must be > 0"));
            }
            Ok((w < max_position_embeddings).then_some(w))
        };
        // `layer_types` (Qwen2/3, Gemma 3): per layer, whether it slides; `None` when absent.
        let layer_types = || -> Result<Option<Vec<bool>>, ModelError> {
            let Some(types) = f.get("layer_types") else {
                return Ok(None);
            };
            let types = types
                .as_array()
                .ok_or_else(|| f.invalid("layer_types", "expected a list of strings"))?;
            if types.len() != num_hidden_layers {
                return Err(f.invalid(
                    "layer_types",
                    format!("{} entries for {num_hidden_layers} layers", types.len()),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(f.invalid(
                        "layer_types",
                        format!("{t} is unsupported; only \"full_attention\" and \"sliding_attention\" layers are"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        };
        if model_type == "qwen2" || model_type == "qwen3" {
            // transformers keeps `sliding_window` only with `use_sliding_window`, and applies
            // it where `layer_types` says `sliding_attention`, else to the layers from
            // `max_window_layers` on (default 28 in both configs; transformers derives its
            // `layer_types` default from it).
            let slides = f.opt_bool("use_sliding_window")? == Some(true);
            let first_sliding = f.opt_usize("max_window_layers")?.unwrap_or(28);
            let sliding = match layer_types()? {
                Some(types) => types,
                None => (0..num_hidden_layers).map(|i| i >= first_sliding).collect(),
            };
            if slides && sliding.contains(&true) {
                let w = window(Some(4096))?;
                for (s, slides) in sliding_window.iter_mut().zip(sliding) {
                    if slides {
                        *s = w;
                    }
                }
            }
        }
        if model_type == "qwen2_moe" || model_type == "qwen3_moe" {
            // No released checkpoint slides; transformers' per-layer rules differ from Qwen2's.
            if f.opt_bool("use_sliding_window")? == Some(true) {
                return Err(f.invalid(
                    "use_sliding_window",
                    format!("sliding-window attention is not implemented for {model_type}"),
                ));
            }
        }
        if model_type == "mistral" || model_type == "mixtral" || model_type == "phi3" {
            // Every layer slides when `sliding_window` is set (transformers' Mistral, Mixtral
            // and Phi-3; only MistralConfig has a default window).
            let w = window(if model_type == "mistral" {
                Some(4096)
            } else {
                None
            })?;
            sliding_window.fill(w);
        }
        let moe = Self::parse_moe(&f, model_type, num_hidden_layers, intermediate_size)?;
        if gemma {
            // Gemma3TextConfig: `layer_types`, else every `sliding_window_pattern`-th layer
            // (default 6; saved as `_sliding_window_pattern` by newer versions) is full and
            // the rest slide, with `sliding_window` (default 4096) keys.
            let w = window(Some(4096))?;
            let sliding: Vec<bool> = match layer_types()? {
                Some(types) => types,
                None => {
                    let key = if f.get("_sliding_window_pattern").is_some() {
                        "_sliding_window_pattern"
                    } else {
                        "sliding_window_pattern"
                    };
                    let pattern = f.opt_usize(key)?.unwrap_or(6);
                    if pattern == 0 {
                        return Err(f.invalid(key, "must be > 0"));
                    }
                    (0..num_hidden_layers)
                        .map(|i| (i + 1) % pattern != 0)
                        .collect()
                }
            };
            for (s, slides) in sliding_window.iter_mut().zip(sliding) {
                if slides {
                    *s = w;
                }
            }
        }

        // RoPE: transformers <= 4.x uses rope_theta + rope_scaling; 5.x uses rope_parameters,
        // per layer type for Gemma 3 (`full_attention` / `sliding_attention`).
        let mut rope_theta = f.opt_f64("rope_theta")?;
        let mut local_theta = f.opt_f64("rope_local_base_freq")?;
        let mut scaling_fields = f.sub("rope_scaling", "rope_scaling.")?;
        if let Some(p) = f.sub("rope_parameters", "rope_parameters.")? {
            let (full, local) = if gemma && p.get("full_attention").is_some() {
                (
                    p.sub("full_attention", "rope_parameters.full_attention.")?,
                    p.sub("sliding_attention", "rope_parameters.sliding_attention.")?,
                )
            } else {
                (Some(p), None)
            };
            if let Some(l) = local {
                if local_theta.is_none() {
                    local_theta = l.opt_f64("rope_theta")?;
                }
                if !matches!(l.opt_str("rope_type")?, None | Some("default")) {
                    return Err(l.invalid(
                        "rope_type",
                        "only default RoPE is supported on sliding-window layers",
                    ));
                }
            }
            if let Some(p) = full {
                if rope_theta.is_none() {
                    rope_theta = p.opt_f64("rope_theta")?;
                }
                if scaling_fields.is_none() {
                    scaling_fields = Some(p);
                }
            }
        }
        // Gemma3TextConfig's and MixtralConfig's defaults are 1e6; the others' 1e4.
        let default_theta = if gemma || model_type == "mixtral" {
            1_000_000.0
        } else {
            10000.0
        };
        let rope_theta = rope_theta.unwrap_or(default_theta) as f32;
        if !(rope_theta > 0.0 && rope_theta.is_finite()) {
            return Err(f.invalid("rope_theta", "must be > 0 and finite in f32"));
        }
        let local_rope_theta = match local_theta {
            _ if !gemma => None,
            None => Some(10000.0),
            Some(x) if positive_f32(x) => Some(x as f32),
            Some(x) => {
                return Err(f.invalid(
                    "rope_local_base_freq",
                    format!("{x} must be > 0 and finite in f32"),
                ))
            }
        };
        let rope_scaling = match scaling_fields {
            None => None,
            Some(s) => {
                let ty = match s.opt_str("rope_type")? {
                    Some(t) => t,
                    None => s.opt_str("type")?.ok_or_else(|| s.missing("rope_type"))?,
                };
                match ty {
                    "default" => None,
                    "linear" => {
                        let factor = s.opt_f64("factor")?.ok_or_else(|| s.missing("factor"))?;
                        if !positive_f32(factor) {
                            return Err(s.invalid("factor", format!("{factor} must be > 0 and finite in f32")));
                        }
                        Some(RopeScaling::Linear { factor: factor as f32 })
                    }
                    "llama3" => {
                        let num = |k: &str| -> Result<f32, ModelError> {
                            Ok(s.opt_f64(k)?.ok_or_else(|| s.missing(k))? as f32)
                        };
                        let factor = num("factor")?;
                        let low_freq_factor = num("low_freq_factor")?;
                        let high_freq_factor = num("high_freq_factor")?;
                        let original_max_position_embeddings =
                            s.req_usize("original_max_position_embeddings")?;
                        let finite = [factor, low_freq_factor, high_freq_factor].iter().all(|x| x.is_finite());
                        if !finite || factor <= 0.0 || low_freq_factor <= 0.0 || high_freq_factor <= low_freq_factor {
                            return Err(s.invalid(
                                "factor",
                                "need factor > 0 and high_freq_factor > low_freq_factor > 0, finite in f32",
                            ));
                        }
                        Some(RopeScaling::Llama3 {
                            factor,
                            low_freq_factor,
                            high_freq_factor,
                            original_max_position_embeddings,
                        })
                    }
                    "yarn" => {
                        let factor = s.opt_f64("factor")?.ok_or_else(|| s.missing("factor"))?;
                        if !(factor >= 1.0 && positive_f32(factor)) {
                            return Err(s.invalid("factor", format!("{factor} must be >= 1 and finite in f32")));
                        }
                        // DeepSeek's variant; its attention factor is not plain YaRN's.
                        for k in ["mscale", "mscale_all_dim"] {
                            if s.get(k).is_some() && s.get("attention_factor").is_none() {
                                return Err(s.invalid(k, "YaRN's mscale variants are unsupported"));
                            }
                        }
                        let original = s
                            .opt_usize("original_max_position_embeddings")?
                            .unwrap_or(max_position_embeddings);
                        let attention_factor = match s.opt_f64("attention_factor")? {
                            Some(a) if positive_f32(a) => a,
                            Some(a) => {
                                return Err(s.invalid("attention_factor", format!("{a} must be > 0 and finite in f32")))
                            }
                            None if factor > 1.0 => 0.1 * factor.ln() + 1.0,
                            None => 1.0,
                        };
                        let beta_fast = s.opt_f64("beta_fast")?.unwrap_or(32.0);
                        let beta_slow = s.opt_f64("beta_slow")?.unwrap_or(1.0);
                        if !(positive_f32(beta_fast) && positive_f32(beta_slow)) || original == 0 {
                            return Err(s.invalid(
                                "beta_fast",
                                "need beta_fast > 0, beta_slow > 0 and original_max_position_embeddings > 0",
                            ));
                        }
                        Some(RopeScaling::Yarn {
                            factor: factor as f32,
                            original_max_position_embeddings: original,
                            beta_fast: beta_fast as f32,
                            beta_slow: beta_slow as f32,
                            attention_factor: attention_factor as f32,
                            truncate: s.opt_bool("truncate")?.unwrap_or(true),
                        })
                    }
                    "longrope" | "su" => {
                        let half = rotary_dim / 2;
                        let factors = |k: &str| -> Result<Vec<f32>, ModelError> {
                            let bad = || {
                                s.invalid(k, format!("expected a list of {half} positive numbers"))
                            };
                            let list = s.get(k).ok_or_else(|| s.missing(k))?;
                            let list = list.as_array().ok_or_else(bad)?;
                            if list.len() != half {
                                return Err(bad());
                            }
                            list.iter()
                                .map(|x| match x.as_f64() {
                                    Some(x) if positive_f32(x) => Ok(x as f32),
                                    _ => Err(bad()),
                                })
                                .collect()
                        };
                        let short_factor = factors("short_factor")?;
                        let long_factor = factors("long_factor")?;
                        // transformers' `_compute_longrope_parameters`: Phi-3 keeps the
                        // pre-training length at the top level and scales by the ratio.
                        // (`Phi3Config` defaults it to 4096.)
                        let top = match f.opt_usize("original_max_position_embeddings")? {
                            None if model_type == "phi3" => Some(4096),
                            o => o,
                        };
                        let (original, factor) = match top {
                            Some(o) => (o, max_position_embeddings as f64 / o as f64),
                            None => (
                                max_position_embeddings,
                                s.opt_f64("factor")?.unwrap_or(1.0),
                            ),
                        };
                        if original == 0 {
                            return Err(f.invalid("original_max_position_embeddings", "must be > 0"));
                        }
                        let attention_factor = match s.opt_f64("attention_factor")? {
                            Some(a) if positive_f32(a) => a,
                            Some(a) => {
                                return Err(s.invalid("attention_factor", format!("{a} must be > 0 and finite in f32")))
                            }
                            None if factor > 1.0 => {
                                (1.0 + factor.ln() / (original as f64).ln()).sqrt()
                            }
                            None => 1.0,
                        };
                        Some(RopeScaling::LongRope {
                            short_factor,
                            long_factor,
                            long: false,
                            attention_factor: attention_factor as f32,
                            original_max_position_embeddings: original,
                        })
                    }
                    other => {
                        return Err(s.invalid(
                            "rope_type",
                            format!("RoPE scaling type {other:?} is unsupported; supported: default, linear, llama3, yarn, longrope"),
                        ))
                    }
                }
            }
        };

        let torch_dtype = match f.opt_str("torch_dtype")? {
            Some(d) => Some(d.to_string()),
            None => f.opt_str("dtype")?.map(str::to_string),
        };
        // transformers: torch.tensor(hidden_size ** 0.5) (f32), then .to(weight dtype).
        let embed_scale = gemma.then(|| {
            let x = (hidden_size as f64).sqrt() as f32;
            match torch_dtype.as_deref() {
                Some("bfloat16") => half::bf16::from_f32(x).to_f32(),
                Some("float16") => half::f16::from_f32(x).to_f32(),
                _ => x,
            }
        });

        let cfg = ModelConfig {
            architectures,
            model_type: model_type.to_string(),
            qkv_bias,
            qk_norm,
            fused_projections,
            multimodal_text: false,
            hidden_act,
            norm_offset: if gemma { 1.0 } else { 0.0 },
            sandwich_norms: gemma,
            embed_scale,
            query_pre_attn_scalar,
            local_rope_theta,
            sliding_window,
            moe,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim,
            vocab_size,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(gemma),
            bos_token_id: f.opt_u32("bos_token_id")?,
            eos_token_ids: f.u32_or_list("eos_token_id")?,
            torch_dtype,
            quantization: crate::quant::parse(&f)?,
        };
        // Values that parse but give RoPE tables f32 cannot hold (a factor of 1e-39, a
        // llama3 factor of 1e-45) would run as NaN logits: refuse them here, for every table
        // a served length could choose (LongRoPE's short and long factors, Gemma's local one).
        let mut tables = vec![("rope_scaling", cfg.clone())];
        if let Some(RopeScaling::LongRope { .. }) = &cfg.rope_scaling {
            let mut long = cfg.clone();
            long.set_max_model_len(usize::MAX);
            tables = vec![
                ("rope_scaling.short_factor", cfg.clone()),
                ("rope_scaling.long_factor", long),
            ];
        }
        let last = cfg.max_position_embeddings as f32;
        for (field, c) in &tables {
            let mut invs = vec![c.rope_inv_freq()];
            if let Some(li) = (0..c.num_hidden_layers).find(|&li| c.layer_rope_is_local(li)) {
                invs.push(c.layer_rope(li).0);
            }
            for inv in invs {
                if let Some((i, x)) = inv
                    .iter()
                    .enumerate()
                    .find(|(_, x)| !(x.is_finite() && **x >= 0.0 && (**x * last).is_finite()))
                {
                    let field = if c.rope_scaling.is_none() {
                        "rope_theta"
                    } else {
                        field
                    };
                    return Err(f.invalid(
                        field,
                        format!(
                            "gives RoPE inverse frequency {x} for pair {i}, which f32 cannot \
                             rotate positions up to {last} with"
                        ),
                    ));
                }
            }
        }
        Ok(cfg)
    }

    /// RoPE inverse frequencies, `head_dim / 2` values (radians per position), in f32 as HF
    /// computes them.
    ///
    /// Plain RoPE: `inv_freq[i] = 1 / theta^(2i / head_dim)` (transformers
    /// `_compute_default_rope_parameters`). With `rope_scaling.rope_type == "llama3"` this
    /// follows transformers `modeling_rope_utils._compute_llama3_parameters`: with
    /// `wavelen = 2π / inv_freq`, `low = orig_ctx / low_freq_factor`,
    /// `high = orig_ctx / high_freq_factor`: wavelengths `> low` are divided by `factor`,
    /// wavelengths `< high` are kept, and in between
    /// `s = (orig_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`,
    /// `inv = (1 - s) * inv / factor + s * inv`.
    ///
    /// YaRN follows `_compute_yarn_parameters` as vLLM's `YaRNScalingRotaryEmbedding` does (the
    /// `factor` as given): with `pos = base^(2i/d)`, the correction range `[low, high]` from
    /// `d ln(orig / (2π β)) / (2 ln base)` at `β = beta_fast, beta_slow` (floored / ceiled when
    /// `truncate`, clamped to `[0, d - 1]`) and `ramp_i = clamp((i - low) / (high - low), 0, 1)`,
    /// `inv = (1 / (factor pos)) ramp + (1 / pos) (1 - ramp)`.
    ///
    /// LongRoPE follows `_compute_longrope_parameters` with the short factors:
    /// `inv[i] = 1 / (short_factor[i] theta^(2i / d))`.
    ///
    /// With partial RoPE `d` is [`ModelConfig::rotary_dim`] in all of these (as transformers
    /// computes them), and the last `(head_dim - rotary_dim) / 2` values are 0: the pairs of
    /// dims left unrotated in the permuted head layout.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let mut inv = self.rotary_inv_freq();
        inv.resize(self.head_dim / 2, 0.0);
        inv
    }

    /// Whether layer `li` uses the local RoPE ([`ModelConfig::local_rope_theta`]: Gemma 3's
    /// sliding-window layers) rather than [`ModelConfig::rope_inv_freq`].
    pub fn layer_rope_is_local(&self, li: usize) -> bool {
        self.local_rope_theta.is_some() && self.sliding_window.get(li).is_some_and(Option::is_some)
    }

    /// Layer `li`'s `[head_dim / 2]` RoPE inverse frequencies and attention factor: the local
    /// ones where [`ModelConfig::layer_rope_is_local`] (plain RoPE of base
    /// `local_rope_theta`, `1 / base^(2i / rotary_dim)`, factor 1: transformers'
    /// `compute_default_rope_parameters` for the `sliding_attention` layer type), else
    /// [`ModelConfig::rope_inv_freq`] and [`ModelConfig::rope_attention_factor`].
    pub fn layer_rope(&self, li: usize) -> (Vec<f32>, f32) {
        match self.local_rope_theta {
            Some(base) if self.layer_rope_is_local(li) => {
                let r = self.rotary_dim;
                let mut inv: Vec<f32> = (0..r / 2)
                    .map(|i| 1.0 / base.powf((2 * i) as f32 / r as f32))
                    .collect();
                inv.resize(self.head_dim / 2, 0.0);
                (inv, 1.0)
            }
            _ => (self.rope_inv_freq(), self.rope_attention_factor()),
        }
    }

    /// The factor attention scores `q.k` are multiplied by: `query_pre_attn_scalar^-0.5`
    /// (Gemma 3), else `head_dim^-0.5` (transformers' `scaling`, a Python float, used in f32).
    pub fn attention_scale(&self) -> f32 {
        match self.query_pre_attn_scalar {
            Some(x) => (x as f64).powf(-0.5) as f32,
            None => (self.head_dim as f64).powf(-0.5) as f32,
        }
    }

    /// Where each dim of a q or k head comes from in the layout every backend rotates
    /// (see [`ModelConfig::rotary_dim`]): `perm[j]` is the checkpoint's dim at position `j`,
    /// `head_dim` entries. For `i < r/2` (`r = rotary_dim`, `h = head_dim / 2`): `perm[i] = i`,
    /// `perm[i + h] = i + r/2` (the rotated pairs); the unrotated dims `r..head_dim` fill
    /// positions `r/2..h` and then `h + r/2..head_dim`, in order. The identity for full RoPE.
    pub fn rope_head_permutation(&self) -> Vec<usize> {
        let (d, r) = (self.head_dim, self.rotary_dim);
        let (h, rh) = (d / 2, r / 2);
        let mut perm = vec![0; d];
        for i in 0..rh {
            perm[i] = i;
            perm[i + h] = i + rh;
        }
        let pass = h - rh;
        for k in 0..pass {
            perm[rh + k] = r + k;
            perm[h + rh + k] = r + pass + k;
        }
        perm
    }

    /// The `rotary_dim / 2` rotated frequencies of [`ModelConfig::rope_inv_freq`].
    fn rotary_inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim;
        let base = self.rope_theta;
        let inv: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0f32 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        match &self.rope_scaling {
            None => inv,
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            }) => {
                let d = dim as f64;
                let correction = |rot: f32| {
                    d * ((*original_max_position_embeddings as f64)
                        / (rot as f64 * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * (base as f64).ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let low = low.max(0.0) as f32;
                let mut high = high.min(d - 1.0) as f32;
                if low == high {
                    high += 0.001;
                }
                inv.into_iter()
                    .enumerate()
                    .map(|(i, extrapolation)| {
                        let pos = base.powf((2 * i) as f32 / dim as f32);
                        let interpolation = 1.0 / (factor * pos);
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        interpolation * ramp + extrapolation * (1.0 - ramp)
                    })
                    .collect()
            }
            Some(RopeScaling::Linear { factor }) => inv.into_iter().map(|f| f / factor).collect(),
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                long,
                ..
            }) => {
                let f = if *long { long_factor } else { short_factor };
                (0..dim / 2)
                    .map(|i| 1.0f32 / (f[i] * base.powf((2 * i) as f32 / dim as f32)))
                    .collect()
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old_ctx = *original_max_position_embeddings as f32;
                let low_freq_wavelen = old_ctx / low_freq_factor;
                let high_freq_wavelen = old_ctx / high_freq_factor;
                inv.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen > low_freq_wavelen {
                            f / factor
                        } else if wavelen < high_freq_wavelen {
                            f
                        } else {
                            let s = (old_ctx / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * f / factor + s * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// "the model's max_position_embeddings N": what an error about a too-long context names.
    pub fn context_limit(&self) -> String {
        format!(
            "the model's max_position_embeddings {}",
            self.max_position_embeddings
        )
    }

    /// Sets what depends on the served context length `max_model_len` (vLLM's
    /// `--max-model-len`, at most `max_position_embeddings`): LongRoPE's long factors apply,
    /// to every position, when it exceeds `original_max_position_embeddings`, else the short
    /// ones (vLLM's `Phi3LongRoPEScaledRotaryEmbedding`: one choice for the deployment, so a
    /// KV cache never holds keys rotated with both). Every process that runs or checks the
    /// model (scheduler, workers, frontends, `baton generate`) calls it with the scheduler's
    /// value; [`ModelConfig::fingerprint`] covers the choice. Without LongRoPE it does nothing.
    pub fn set_max_model_len(&mut self, max_model_len: usize) {
        if let Some(RopeScaling::LongRope {
            long,
            original_max_position_embeddings,
            ..
        }) = &mut self.rope_scaling
        {
            *long = max_model_len > *original_max_position_embeddings;
        }
    }

    /// What a start-up line says about the RoPE factors [`ModelConfig::set_max_model_len`]
    /// chose, for LongRoPE (vLLM warns the same way): which factors apply to every position,
    /// and the `--max-model-len` that selects the others. `None` without LongRoPE.
    pub fn rope_note(&self) -> Option<String> {
        let Some(RopeScaling::LongRope {
            long,
            original_max_position_embeddings: orig,
            ..
        }) = &self.rope_scaling
        else {
            return None;
        };
        Some(if *long {
            format!(
                "LongRoPE's long factors apply to every position (the served context exceeds \
                 original_max_position_embeddings {orig}), which may cost some quality on \
                 short prompts; --max-model-len {orig} or less selects the short factors"
            )
        } else {
            format!(
                "LongRoPE's short factors apply (the served context is at most \
                 original_max_position_embeddings {orig}); a larger --max-model-len selects the \
                 long factors for every position"
            )
        })
    }

    /// The factor RoPE's cos and sin are multiplied by: YaRN's or LongRoPE's
    /// `attention_factor`, else 1 (transformers' `attention_scaling`). With full RoPE it
    /// scales every attention logit by its square, and a backend may apply it that way
    /// instead; with partial RoPE ([`ModelConfig::rotary_dim`]) it scales only the rotated
    /// pairs (the first `rotary_dim / 2` of `rope_inv_freq`'s).
    pub fn rope_attention_factor(&self) -> f32 {
        match self.rope_scaling {
            Some(RopeScaling::Yarn {
                attention_factor, ..
            })
            | Some(RopeScaling::LongRope {
                attention_factor, ..
            }) => attention_factor,
            _ => 1.0,
        }
    }

    /// Number of f32 parameters the config implies (embedding, layers with their Qwen biases,
    /// head norms, Gemma's output norms and every expert, norm, LM head unless tied). Useful for sizing dummy loads.
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut layer = 2 * h + q * h + 2 * kv * h + h * q;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        if self.sandwich_norms {
            layer += 2 * h;
        }
        let mlps: usize = (0..self.num_hidden_layers)
            .map(|li| match &self.moe {
                Some(m) if self.layer_is_moe(li) => {
                    let shared = m.shared_expert_intermediate_size;
                    m.num_experts * h
                        + m.num_experts * 3 * m.intermediate_size * h
                        + if shared > 0 { 3 * shared * h + h } else { 0 }
                }
                _ => 3 * self.intermediate_size * h,
            })
            .sum();
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_hidden_layers * layer + mlps + h + head
    }
}

/// Sampling defaults and stop ids from `generation_config.json` (optional file).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// `bos_token_id`, if given.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (int or list), empty if absent.
    pub eos_token_ids: Vec<u32>,
    /// Default temperature, if given.
    pub temperature: Option<f32>,
    /// Default nucleus threshold, if given.
    pub top_p: Option<f32>,
    /// Default top-k, if given: -1 and 0 mean no top-k (Hugging Face's "disabled"), as in a
    /// request.
    pub top_k: Option<i64>,
    /// `do_sample`, if given.
    pub do_sample: Option<bool>,
    /// Default min-p, if given.
    pub min_p: Option<f32>,
    /// Default repetition penalty, if given.
    pub repetition_penalty: Option<f32>,
    /// Default number of new tokens (`max_new_tokens`), if given.
    pub max_new_tokens: Option<u32>,
}

impl GenerationConfig {
    /// Parses `generation_config.json` text; `file` is used in error messages.
    ///
    /// # Errors
    /// [`ModelError::Json`] or [`ModelError::InvalidField`].
    pub fn from_json_str(json: &str, file: &str) -> Result<Self, ModelError> {
        let v = parse_json(file, json)?;
        let f = Fields::new(file, &v)?;
        Ok(GenerationConfig {
            bos_token_id: f.opt_u32("bos_token_id")?,
            eos_token_ids: f.u32_or_list("eos_token_id")?,
            temperature: f.opt_f64("temperature")?.map(|x| x as f32),
            top_p: f.opt_f64("top_p")?.map(|x| x as f32),
            top_k: match f.get("top_k") {
                None => None,
                // Integral floats such as 50.0 too, as the other integer fields.
                Some(v) => match v.as_i64().or_else(|| {
                    v.as_f64()
                        .filter(|f| f.fract() == 0.0 && f.abs() < 1e15)
                        .map(|f| f as i64)
                }) {
                    Some(k) if (-1..=i64::from(u32::MAX)).contains(&k) => Some(k),
                    _ => {
                        return Err(f.invalid(
                            "top_k",
                            format!("expected -1 or 0 (no top-k) or a positive integer, found {v}"),
                        ))
                    }
                },
            },
            do_sample: f.opt_bool("do_sample")?,
            min_p: f.opt_f64("min_p")?.map(|x| x as f32),
            repetition_penalty: f.opt_f64("repetition_penalty")?.map(|x| x as f32),
            max_new_tokens: f.opt_u32("max_new_tokens")?,
        })
    }

    /// Loads the file.
    ///
    /// # Errors
    /// As [`GenerationConfig::from_json_str`], plus [`ModelError::Io`].
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        Self::from_json_str(&read_text(path)?, &path.display().to_string())
    }
}

/// The parts of `tokenizer_config.json` that affect encoding and chat formatting.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// `add_bos_token`; `None` means "as tokenizer.json's post-processor does".
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`; `None` means "as tokenizer.json's post-processor does".
    pub add_eos_token: Option<bool>,
    /// BOS token text (`bos_token` as a string or `{content: ...}`).
    pub bos_token: Option<String>,
    /// EOS token text.
    pub eos_token: Option<String>,
    /// Jinja chat template; for a list of `{name, template}` the one named `default`.
    pub chat_template: Option<String>,
    /// `model_max_length`, if given and sensible (HF writes ~1e30 for "unlimited": dropped).
    pub model_max_length: Option<usize>,
}

impl TokenizerConfig {
    /// Parses `tokenizer_config.json` text; `file` is used in error messages.
    ///
    /// # Errors
    /// [`ModelError::Json`] or [`ModelError::InvalidField`].
    pub fn from_json_str(json: &str, file: &str) -> Result<Self, ModelError> {
        let v = parse_json(file, json)?;
        let f = Fields::new(file, &v)?;
        let token = |key: &str| -> Result<Option<String>, ModelError> {
            match f.get(key) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Object(o)) => match o.get("content").and_then(Value::as_str) {
                    Some(s) => Ok(Some(s.to_string())),
                    None => Err(f.invalid(key, "object without a string `content`")),
                },
                Some(v) => Err(f.invalid(key, format!("expected a string or object, found {v}"))),
            }
        };
        let chat_template = match f.get("chat_template") {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(items)) => {
                let mut found = None;
                for it in items {
                    let name = it.get("name").and_then(Value::as_str);
                    let tpl = it.get("template").and_then(Value::as_str);
                    match (name, tpl) {
                        (Some("default"), Some(t)) => found = Some(t.to_string()),
                        (Some(_), Some(_)) => {}
                        _ => {
                            return Err(f.invalid(
                                "chat_template",
                                "list items must be {name: string, template: string}",
                            ))
                        }
                    }
                }
                found
            }
            Some(v) => {
                return Err(f.invalid(
                    "chat_template",
                    format!("expected a string or a list, found {}", short(v)),
                ))
            }
        };
        let model_max_length = match f.get("model_max_length") {
            None => None,
            Some(v) => match v.as_f64() {
                Some(x) if (1.0..1e12).contains(&x) => Some(x as usize),
                Some(_) => None,
                None => {
                    return Err(
                        f.invalid("model_max_length", format!("expected a number, found {v}"))
                    )
                }
            },
        };
        Ok(TokenizerConfig {
            add_bos_token: f.opt_bool("add_bos_token")?,
            add_eos_token: f.opt_bool("add_eos_token")?,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            chat_template,
            model_max_length,
        })
    }

    /// Loads the file.
    ///
    /// # Errors
    /// As [`TokenizerConfig::from_json_str`], plus [`ModelError::Io`].
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        Self::from_json_str(&read_text(path)?, &path.display().to_string())
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}...", &s[..s.floor_char_boundary_compat(60)])
    } else {
        s
    }
}

trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorCharBoundary for String {
    fn floor_char_boundary_compat(&self, mut i: usize) -> usize {
        while i > 0 && !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
        "num_attention_heads": 8, "vocab_size": 512, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5"#;

    fn cfg(extra: &str) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_json_str(&format!("{BASE}{extra}}}"))
    }

    #[test]
    fn fingerprint_changes_with_every_computed_field_and_ignores_the_rest() {
        let base = cfg("").unwrap();
        let fp = base.fingerprint();
        assert_ne!(fp, 0);
        assert_eq!(cfg("").unwrap().fingerprint(), fp, "not deterministic");
        // Fields that change what the forward pass computes.
        for extra in [
            r#", "num_hidden_layers": 3"#,
            r#", "num_key_value_heads": 4"#,
            r#", "head_dim": 16"#,
            r#", "intermediate_size": 173"#,
            r#", "rms_norm_eps": 1e-6"#,
            r#", "rope_theta": 500000.0"#,
            r#", "tie_word_embeddings": true"#,
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}"#,
        ] {
            assert_ne!(cfg(extra).unwrap().fingerprint(), fp, "{extra}");
        }
        let mut c = base.clone();
        c.vocab_size += 1;
        assert_ne!(c.fingerprint(), fp, "vocab_size");
        let mut c = base.clone();
        c.hidden_size = 128;
        assert_ne!(c.fingerprint(), fp, "hidden_size");
        let mut c = base.clone();
        c.model_type = "mistral".into();
        assert_ne!(c.fingerprint(), fp, "model_type");
        // Fields that may differ between the processes of one deployment.
        for extra in [r#", "eos_token_id": 2"#, r#", "torch_dtype": "float32""#] {
            assert_eq!(cfg(extra).unwrap().fingerprint(), fp, "{extra}");
        }
        let mut c = base.clone();
        c.max_position_embeddings = 4096;
        assert_eq!(c.fingerprint(), fp, "max_position_embeddings");
    }

    /// Qwen2.5-0.5B-Instruct's and Qwen3-0.6B's config.json, as published (keys that do not
    /// change the forward pass trimmed).
    const QWEN2: &str = r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "use_sliding_window": false, "vocab_size": 151936,
        "bos_token_id": 151643, "eos_token_id": 151645"#;
    /// Phi-3-mini-4k-instruct's config.json (transformers 4.40).
    const PHI3: &str = r#"{"architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
        "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "use_cache": true, "vocab_size": 32064"#;
    const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "attention_bias": false, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "use_sliding_window": false, "vocab_size": 151936, "bos_token_id": 151643,
        "eos_token_id": 151645"#;

    #[test]
    fn qwen2_and_qwen3_configs_parse_with_their_flags() {
        let q2 = ModelConfig::from_json_str(&format!("{QWEN2}}}")).unwrap();
        assert!(q2.qkv_bias && !q2.qk_norm);
        assert_eq!((q2.head_dim, q2.num_key_value_heads), (64, 2));
        assert!(q2.tie_word_embeddings);
        let q3 = ModelConfig::from_json_str(&format!("{QWEN3}}}")).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias);
        // head_dim 128 with hidden 1024 / 16 heads = 64: the explicit value wins.
        assert_eq!(q3.head_dim, 128);
        assert_eq!(q3.rope_theta, 1e6);
        let l = cfg("").unwrap();
        assert!(!l.qkv_bias && !l.qk_norm);
        // Qwen3Config's default head_dim is 128, not hidden / heads.
        let no_hd = QWEN3.replace(r#""head_dim": 128, "#, "");
        assert_eq!(
            ModelConfig::from_json_str(&format!("{no_hd}}}"))
                .unwrap()
                .head_dim,
            128
        );
        // The flags change the fingerprint beside the model_type.
        let mut c = q3.clone();
        c.qk_norm = false;
        assert_ne!(c.fingerprint(), q3.fingerprint());
        let mut c = q2.clone();
        c.qkv_bias = false;
        assert_ne!(c.fingerprint(), q2.fingerprint());
    }

    /// Qwen's documented YaRN settings (factor 4 over 32768); expected values computed in f64
    /// Python from transformers' `_compute_yarn_parameters` (correction range [23, 40]).
    #[test]
    fn yarn_inv_freq_and_attention_factor_match_hand_computed_values() {
        let c = ModelConfig::from_json_str(&format!(
            r#"{QWEN3}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32768}}}}"#
        ))
        .unwrap();
        let inv = c.rope_inv_freq();
        assert_eq!(inv.len(), 64);
        for (i, want) in [
            (0, 1.0),
            (5, 0.3398208328942559),
            (10, 0.1154781984689458),
            (20, 0.01333521432163324),
            (30, 0.0010643609812470017),
            (40, 4.445698525097307e-05),
            (63, 3.102344401879299e-07),
        ] {
            let got = inv[i] as f64;
            assert!(
                (got - want).abs() <= 2e-6 * want,
                "inv_freq[{i}] = {got}, want {want}"
            );
        }
        assert!((c.rope_attention_factor() - 1.138_629_4).abs() < 1e-6);
        let plain = ModelConfig::from_json_str(&format!("{QWEN3}}}")).unwrap();
        assert_eq!(plain.rope_attention_factor(), 1.0);
        assert_ne!(plain.fingerprint(), c.fingerprint());
        // An explicit attention_factor wins; DeepSeek's mscale variant is refused.
        let c = ModelConfig::from_json_str(&format!(
            r#"{QWEN3}, "rope_scaling": {{"type": "yarn", "factor": 2.0,
                "attention_factor": 1.5}}}}"#
        ))
        .unwrap();
        assert_eq!(c.rope_attention_factor(), 1.5);
        for bad in [
            r#"{"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}"#,
            r#"{"rope_type": "yarn", "factor": 0.5}"#,
            r#"{"rope_type": "yarn"}"#,
            r#"{"rope_type": "longrope", "factor": 4.0}"#,
        ] {
            let e = ModelConfig::from_json_str(&format!(r#"{QWEN3}, "rope_scaling": {bad}}}"#));
            assert!(
                matches!(
                    e,
                    Err(ModelError::InvalidField { .. } | ModelError::MissingField { .. })
                ),
                "{bad}: {e:?}"
            );
        }
    }

    /// Sizes far past any real model are config errors naming the field, not allocations of
    /// terabytes later (a vocabulary of 10^12 aborted the scheduler).
    #[test]
    fn absurd_sizes_are_refused_naming_the_field() {
        for (extra, field) in [
            (r#", "vocab_size": 1000000000000"#, "vocab_size"),
            (r#", "vocab_size": 4194305"#, "vocab_size"),
            (r#", "hidden_size": 1099511627776"#, "hidden_size"),
            (
                r#", "intermediate_size": 1099511627776"#,
                "intermediate_size",
            ),
            (r#", "num_hidden_layers": 100000"#, "num_hidden_layers"),
            (r#", "num_attention_heads": 4096"#, "num_attention_heads"),
            (r#", "head_dim": 100000"#, "head_dim"),
        ] {
            let e = ModelConfig::from_json_str(&format!("{QWEN3}{extra}}}")).unwrap_err();
            assert!(
                matches!(&e, ModelError::InvalidField { field: f, .. } if f == field),
                "{extra}: {e}"
            );
            assert!(e.to_string().contains("larger than Baton supports"), "{e}");
        }
        // The caps themselves are accepted.
        let ok = ModelConfig::from_json_str(&format!(r#"{QWEN3}, "vocab_size": 4194304}}"#));
        assert!(ok.is_ok(), "{ok:?}");
    }

    /// Sliding windows per layer ([`ModelConfig::sliding_window`]) as transformers applies
    /// them, and LongRoPE's factors, short or long by the served context length
    /// ([`ModelConfig::set_max_model_len`]).
    #[test]
    fn sliding_windows_per_layer_and_longrope_factors_by_the_served_length() {
        // Qwen: only with use_sliding_window, from max_window_layers on or on the
        // sliding_attention layers; a window past the positions is none.
        let q = |extra: &str| ModelConfig::from_json_str(&format!("{QWEN2}{extra}}}")).unwrap();
        let none = vec![None; 24];
        let c = q("");
        assert_eq!(
            (c.max_position_embeddings, &c.sliding_window),
            (32768, &none)
        );
        assert_eq!(q(r#", "use_sliding_window": true"#).sliding_window, none);
        let c = q(r#", "use_sliding_window": true, "sliding_window": 4096"#);
        assert_eq!(c.max_position_embeddings, 32768);
        assert_eq!(c.sliding_window[..21], none[..21]);
        assert_eq!(c.sliding_window[21..], [Some(4096); 3]);
        let c =
            q(r#", "use_sliding_window": true, "sliding_window": 4096, "max_window_layers": 20"#);
        assert_eq!(c.sliding_window[..20], none[..20]);
        assert_eq!(c.sliding_window[20..], [Some(4096); 4]);
        let c =
            q(r#", "use_sliding_window": true, "sliding_window": 4096, "max_window_layers": 24"#);
        assert_eq!(c.sliding_window, none);
        assert_eq!(q(r#", "sliding_window": 4096"#).sliding_window, none);
        let c = q(r#", "use_sliding_window": true, "sliding_window": 32768"#);
        assert_eq!(c.sliding_window, none);
        let mut types = vec!["full_attention"; 24];
        types[3] = "sliding_attention";
        let types = serde_json::json!(types);
        let c = q(&format!(
            r#", "use_sliding_window": true, "sliding_window": 1000, "layer_types": {types}"#
        ));
        let mut want = none.clone();
        want[3] = Some(1000);
        assert_eq!(
            (c.max_position_embeddings, &c.sliding_window),
            (32768, &want)
        );
        let c = q(&format!(
            r#", "sliding_window": 1000, "layer_types": {types}"#
        ));
        assert_eq!(c.sliding_window, none);
        // A null window slides no layer (transformers drops it); an absent one is the config
        // class's default, 4096 (MistralConfig, Qwen2Config, Qwen3Config; Phi3Config: none).
        let q3 = |extra: &str| ModelConfig::from_json_str(&format!("{QWEN3}{extra}}}")).unwrap();
        let c = q3(r#", "use_sliding_window": true, "max_window_layers": 2"#);
        assert!(c.sliding_window.iter().all(Option::is_none));
        let absent = QWEN2.replace(r#""sliding_window": 32768, "#, "");
        assert_ne!(absent, QWEN2);
        let c = ModelConfig::from_json_str(&format!(r#"{absent}, "use_sliding_window": true}}"#))
            .unwrap();
        assert_eq!(c.sliding_window[21..], [Some(4096); 3]);
        let mistral = r#"{"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 32768"#;
        let m = |extra: &str| ModelConfig::from_json_str(&format!("{mistral}{extra}}}")).unwrap();
        assert_eq!(m("").sliding_window, [Some(4096); 2]);
        assert_eq!(m(r#", "sliding_window": null"#).sliding_window, [None; 2]);
        // The fingerprint sees the windows.
        let other = q(r#", "use_sliding_window": true, "sliding_window": 999"#);
        let slid = q(r#", "use_sliding_window": true, "sliding_window": 1000"#);
        let fps = [q("").fingerprint(), slid.fingerprint(), other.fingerprint()];
        assert!(fps[0] != fps[1] && fps[1] != fps[2] && fps[0] != fps[2]);

        // Phi-3-mini-4k: a 2047-token window on 4096 positions, every layer.
        let phi3 = |extra: &str| ModelConfig::from_json_str(&format!("{PHI3}{extra}}}"));
        let c = phi3("").unwrap();
        assert!(c.fused_projections && !c.qkv_bias && !c.qk_norm);
        assert_eq!(c.max_position_embeddings, 4096);
        assert!(c.sliding_window.iter().all(|&w| w == Some(2047)));
        // Phi-3.5-mini: LongRoPE to 131072 from 4096, window 262144 (none: past the positions).
        let short: Vec<f64> = (0..48).map(|i| 1.0 + 0.05 * i as f64).collect();
        let long: Vec<f64> = (0..48).map(|i| 2.0 + i as f64).collect();
        let longrope = format!(
            r#", "max_position_embeddings": 131072, "sliding_window": 262144,
            "rope_scaling": {{"type": "longrope", "short_factor": {}, "long_factor": {}}}"#,
            serde_json::json!(short),
            serde_json::json!(long)
        );
        let mut c = phi3(&longrope).unwrap();
        assert_eq!(c.max_position_embeddings, 131072);
        assert!(c.rope_note().unwrap().contains("short factors apply"));
        // Phi3Config's default pre-training length is 4096 too.
        let without = ModelConfig::from_json_str(&format!(
            "{}{longrope}}}",
            PHI3.replace(r#""original_max_position_embeddings": 4096, "#, "")
        ))
        .unwrap();
        assert_eq!(without.rope_scaling, c.rope_scaling);
        // transformers' `_compute_longrope_parameters`: 1 / (short_i * base^(2i/d)), and
        // sqrt(1 + ln(131072 / 4096) / ln(4096)) on cos and sin.
        let inv = c.rope_inv_freq();
        for (i, x) in inv.iter().enumerate() {
            let want = 1.0f32 / (short[i] as f32 * 10000f32.powf((2 * i) as f32 / 96.0));
            assert_eq!(x.to_bits(), want.to_bits(), "{i}");
        }
        let att = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32;
        assert_eq!(c.rope_attention_factor(), att);
        assert!((att - 1.190_238).abs() < 1e-5, "{att}");
        // Served past 4096 positions: the long factors for every position (vLLM), the same
        // attention factor, another fingerprint; back at 4096 the short ones again.
        let short_fp = c.fingerprint();
        c.set_max_model_len(4097);
        for (i, x) in c.rope_inv_freq().iter().enumerate() {
            let want = 1.0f32 / (long[i] as f32 * 10000f32.powf((2 * i) as f32 / 96.0));
            assert_eq!(x.to_bits(), want.to_bits(), "{i}");
        }
        assert_eq!(c.rope_attention_factor(), att);
        assert_ne!(c.fingerprint(), short_fp);
        assert!(c.rope_note().unwrap().contains("long factors apply"));
        c.set_max_model_len(4096);
        assert_eq!((c.fingerprint(), c.rope_inv_freq()), (short_fp, inv));
        assert_eq!(phi3("").unwrap().rope_note(), None);
        // The older name `su`, an explicit attention_factor, and the fingerprint seeing the
        // factors.
        let su = phi3(&longrope.replace("longrope", "su")).unwrap();
        assert_eq!(su.fingerprint(), c.fingerprint());
        let other = phi3(&longrope.replace("1.05", "1.06")).unwrap();
        assert_ne!(other.fingerprint(), c.fingerprint());
        let given = phi3(&longrope.replace(r#""type""#, r#""attention_factor": 1.5, "type""#));
        assert_eq!(given.unwrap().rope_attention_factor(), 1.5);
        // A short list, a non-positive factor, a rotary dim that is odd, 0 or past the head.
        for (bad, field) in [
            (longrope.replace("[1.0,", "["), "short_factor"),
            (longrope.replace("[2.0,", "[0.0,"), "long_factor"),
            (
                format!(r#", "partial_rotary_factor": 0.75{longrope}"#),
                "short_factor",
            ),
            (
                r#", "partial_rotary_factor": 0.7"#.into(),
                "partial_rotary_factor",
            ),
            (
                r#", "partial_rotary_factor": 0.0"#.into(),
                "partial_rotary_factor",
            ),
            (
                r#", "partial_rotary_factor": 1.5"#.into(),
                "partial_rotary_factor",
            ),
            // Values that f32 turns into 0 or infinity (NaN logits otherwise).
            (longrope.replace("[1.0,", "[1e-300,"), "short_factor"),
            (
                longrope.replace(r#""type""#, r#""attention_factor": 1e300, "type""#),
                "attention_factor",
            ),
            (r#", "rope_theta": 1e300"#.into(), "rope_theta"),
            (
                r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e300}"#
                    .into(),
                "attention_factor",
            ),
            (
                r#", "rope_scaling": {"rope_type": "yarn", "factor": 1e300}"#.into(),
                "factor",
            ),
            (
                r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1e300}"#
                    .into(),
                "beta_fast",
            ),
            (
                r#", "rope_scaling": {"rope_type": "llama3", "factor": 1e300, "low_freq_factor": 1,
                "high_freq_factor": 4, "original_max_position_embeddings": 8192}"#
                    .into(),
                "factor",
            ),
            // Positive factors whose inverse frequencies f32 cannot hold, or cannot multiply
            // by the last position (the trial's NaN logits, exit 0): both factor lists are
            // checked whatever the served length.
            (
                longrope.replace("[2.0,", "[1e-39,"),
                "rope_scaling.long_factor",
            ),
            (
                longrope.replace("[1.0,", "[2e-38,"),
                "rope_scaling.short_factor",
            ),
            (
                r#", "rope_scaling": {"rope_type": "llama3", "factor": 1e-45, "low_freq_factor":
                1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}"#
                    .into(),
                "rope_scaling",
            ),
            (
                r#", "rope_scaling": {"rope_type": "linear", "factor": 1e-38}"#.into(),
                "rope_scaling",
            ),
        ] {
            let e = phi3(&bad).unwrap_err();
            assert!(e.to_string().contains(field), "{bad}: {e}");
        }
        assert_eq!(
            phi3(r#", "partial_rotary_factor": 1.0"#)
                .unwrap()
                .rotary_dim,
            96
        );
        assert_eq!(c.rope_head_permutation(), (0..96).collect::<Vec<_>>());
    }

    /// Partial RoPE (Phi-4-mini: 0.75 of a 128-dim head) in the layout every backend rotates
    /// whole: the first `rotary_dim / 2` frequencies are transformers' over `rotary_dim`, the
    /// rest 0, and the head permutation puts each rotated pair `(i, i + r/2)` at
    /// `(i, i + head_dim/2)`.
    #[test]
    fn partial_rope_frequencies_and_head_permutation() {
        let c = ModelConfig::from_json_str(&format!(
            r#"{PHI3}, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
            "partial_rotary_factor": 0.75}}"#
        ))
        .unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (128, 96));
        let inv = c.rope_inv_freq();
        assert_eq!(inv.len(), 64);
        for (i, x) in inv.iter().enumerate() {
            let want = if i < 48 {
                1.0 / 10000f32.powf((2 * i) as f32 / 96.0)
            } else {
                0.0
            };
            assert_eq!(x.to_bits(), want.to_bits(), "{i}");
        }
        let perm = c.rope_head_permutation();
        for i in 0..48 {
            assert_eq!((perm[i], perm[i + 64]), (i, i + 48), "rotated pair {i}");
        }
        // The 32 unrotated dims fill the zero-frequency pairs, in order.
        let rest: Vec<usize> = perm[48..64].iter().chain(&perm[112..]).copied().collect();
        assert_eq!(rest, (96..128).collect::<Vec<_>>());
        let mut sorted = perm.clone();
        sorted.sort();
        assert_eq!(sorted, (0..128).collect::<Vec<_>>());
        // The fingerprint sees the rotary dim.
        let full = ModelConfig {
            rotary_dim: 128,
            ..c.clone()
        };
        assert_ne!(full.fingerprint(), c.fingerprint());
    }

    #[test]
    fn qwen_features_we_do_not_run_are_refused() {
        for (base, extra, field) in [
            (
                QWEN3,
                r#", "layer_types": ["full_attention", "sliding_attention"]"#,
                "layer_types",
            ),
            (
                QWEN3,
                &format!(
                    r#", "layer_types": {}"#,
                    serde_json::json!([vec!["sliding_attention"; 27], vec!["x"]].concat())
                ),
                "layer_types",
            ),
            (QWEN3, r#", "layer_types": "full_attention""#, "layer_types"),
            (
                QWEN3,
                r#", "layer_types": ["full_attention"]"#,
                "layer_types",
            ),
            (QWEN3, r#", "rms_norm_eps": -1.0"#, "rms_norm_eps"),
            (QWEN3, r#", "attention_bias": true"#, "attention_bias"),
            (QWEN2, r#", "hidden_act": "gelu""#, "hidden_act"),
        ] {
            // Later keys win in serde_json: the extra overrides the base's value.
            let e = ModelConfig::from_json_str(&format!("{base}{extra}}}")).unwrap_err();
            assert!(
                matches!(&e, ModelError::InvalidField { field: f, .. } if f == field),
                "{extra}: {e}"
            );
        }
        let full = vec!["full_attention"; 28];
        let ok = ModelConfig::from_json_str(&format!(
            r#"{QWEN3}, "layer_types": {}}}"#,
            serde_json::json!(full)
        ));
        assert!(ok.is_ok(), "{ok:?}");
        let e = ModelConfig::from_json_str(&format!(
            "{}}}",
            QWEN3.replace("Qwen3ForCausalLM", "DeepseekV3ForCausalLM")
        ))
        .unwrap_err();
        assert!(
            matches!(e, ModelError::UnsupportedArchitecture { .. }),
            "{e}"
        );
    }

    #[test]
    fn defaults_follow_hf_llama_config() {
        let c = cfg("").unwrap();
        assert_eq!(c.num_key_value_heads, 8);
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.rope_theta, 10000.0);
        assert_eq!(c.rope_scaling, None);
        assert!(!c.tie_word_embeddings);
        assert!(c.eos_token_ids.is_empty());
        let c = cfg(r#", "eos_token_id": [128001, 128009], "dtype": "bfloat16""#).unwrap();
        assert_eq!(c.eos_token_ids, vec![128001, 128009]);
        assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
    }

    /// Llama 3.1 8B's RoPE settings; expected values hand-computed from the formula in
    /// transformers' `_compute_llama3_parameters` (in f64, Python).
    #[test]
    fn llama3_rope_scaling_inv_freq_matches_hand_computed_values() {
        let c = ModelConfig::from_json_str(
            r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#,
        )
        .unwrap();
        let inv = c.rope_inv_freq();
        assert_eq!(inv.len(), 64);
        let close = |got: f32, want: f64| ((got as f64 - want) / want).abs() < 1e-5;
        // High frequency (wavelength 2π < 8192/4): unchanged.
        assert!(close(inv[0], 1.0), "{}", inv[0]);
        // Medium (wavelength 2948.3): smooth factor 0.59285 interpolates.
        assert!(close(inv[30], 0.001_371_893_567_761_138_1), "{}", inv[30]);
        // Low frequency (wavelength 2.56e6 > 8192): divided by 8.
        assert!(close(inv[63], 3.068_925_988_914_511e-7), "{}", inv[63]);
        // Legacy key `type` is accepted too, and unscaled frequencies differ where expected.
        let plain = ModelConfig {
            rope_scaling: None,
            ..c.clone()
        }
        .rope_inv_freq();
        assert_eq!(inv[..20], plain[..20]);
        assert!(inv[63] < plain[63]);
    }

    #[test]
    fn rope_type_key_variants_and_rope_parameters_are_accepted() {
        let s = r#""factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192"#;
        let a = cfg(&format!(r#", "rope_scaling": {{"type": "llama3", {s}}}"#)).unwrap();
        let b = cfg(&format!(
            r#", "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0, {s}}}"#
        ))
        .unwrap();
        assert!(matches!(a.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        assert_eq!(a.rope_scaling, b.rope_scaling);
        assert_eq!(b.rope_theta, 500000.0);
        let d = cfg(r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}"#).unwrap();
        assert_eq!((d.rope_scaling, d.rope_theta), (None, 1e6));
        let e = cfg(r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#).unwrap_err();
        assert!(
            e.to_string().contains("rope_scaling.low_freq_factor"),
            "{e}"
        );
    }

    #[test]
    fn unsupported_features_are_rejected_with_field_names() {
        for (extra, field) in [
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "attention_bias": true"#, "attention_bias"),
            (r#", "mlp_bias": true"#, "mlp_bias"),
            (r#", "head_dim": 7"#, "head_dim"),
            (r#", "num_key_value_heads": 0"#, "num_key_value_heads"),
            (r#", "vocab_size": 0"#, "vocab_size"),
            (r#", "rms_norm_eps": "x""#, "rms_norm_eps"),
            (r#", "eos_token_id": [1, "x"]"#, "eos_token_id"),
            (r#", "pretraining_tp": 2"#, "pretraining_tp"),
        ] {
            let e = cfg(extra).unwrap_err().to_string();
            assert!(
                e.contains(field) && e.contains("config.json"),
                "{extra}: {e}"
            );
        }
        let e = ModelConfig::from_json_str("[1, 2]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json"), "{e}");
    }

    #[test]
    fn generation_config_eos_may_be_int_or_list() {
        let g = GenerationConfig::from_json_str(r#"{"eos_token_id": 2, "bos_token_id": 1}"#, "g")
            .unwrap();
        assert_eq!((g.eos_token_ids, g.bos_token_id), (vec![2], Some(1)));
        let g = GenerationConfig::from_json_str(
            r#"{"eos_token_id": [128001, 128008], "temperature": 0.6, "top_p": 0.9, "top_k": 50,
            "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 300}"#,
            "g",
        )
        .unwrap();
        assert_eq!(g.eos_token_ids, vec![128001, 128008]);
        assert_eq!(
            (g.min_p, g.repetition_penalty, g.max_new_tokens),
            (Some(0.05), Some(1.1), Some(300))
        );
        assert_eq!(
            (g.temperature, g.top_p, g.top_k),
            (Some(0.6), Some(0.9), Some(50))
        );
        for (text, want) in [(r#"{"top_k": -1}"#, -1), (r#"{"top_k": 0}"#, 0)] {
            let g = GenerationConfig::from_json_str(text, "generation_config.json").unwrap();
            assert_eq!(g.top_k, Some(want), "{text}");
        }
        for bad in [r#"{"top_k": -2}"#, r#"{"top_k": 2.5}"#, r#"{"top_k": "5"}"#] {
            let e = GenerationConfig::from_json_str(bad, "generation_config.json");
            assert!(e.unwrap_err().to_string().contains("top_k"), "{bad}");
        }
    }

    #[test]
    fn tokenizer_config_token_objects_and_template_lists_are_read() {
        let t = TokenizerConfig::from_json_str(
            r#"{"add_bos_token": true, "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>", "model_max_length": 1e30,
            "chat_template": [{"name": "tool_use", "template": "T"},
                              {"name": "default", "template": "D"}]}"#,
            "tokenizer_config.json",
        )
        .unwrap();
        assert_eq!(t.add_bos_token, Some(true));
        assert_eq!(t.add_eos_token, None);
        assert_eq!(t.bos_token.as_deref(), Some("<s>"));
        assert_eq!(t.eos_token.as_deref(), Some("</s>"));
        assert_eq!(t.chat_template.as_deref(), Some("D"));
        assert_eq!(t.model_max_length, None);
        let t = TokenizerConfig::from_json_str(
            r#"{"chat_template": "{{ messages }}", "model_max_length": 4096}"#,
            "x",
        )
        .unwrap();
        assert_eq!(t.chat_template.as_deref(), Some("{{ messages }}"));
        assert_eq!(t.model_max_length, Some(4096));
        let e = TokenizerConfig::from_json_str(r#"{"chat_template": 5}"#, "tokenizer_config.json");
        assert!(e.unwrap_err().to_string().contains("chat_template"));
    }
}
