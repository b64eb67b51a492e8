//! Error types of the model crate.
//!
//! Contract: every loading failure is a [`ModelError`] whose `Display` names the file and the
//! field or tensor at fault; no input, however malformed, makes this crate panic. Forward-pass
//! input validation failures are [`ForwardError`]s (convertible into [`ModelError`]).

use thiserror::Error;

/// A failure while loading or validating a model directory.
///
/// `file` is always the path (as displayed) of the file being read when the failure happened.
#[derive(Debug, Error)]
pub enum ModelError {
    /// Weights this process would have to generate do not fit in the host's available
    /// memory (`--load-format dummy` on a shape too large for the machine).
    #[error(
        "{what} need {need_gib:.1} GiB of host memory but only {available_gib:.1} GiB is \
         available"
    )]
    TooLarge {
        /// What would be allocated.
        what: String,
        /// GiB needed.
        need_gib: f64,
        /// GiB available (`MemAvailable`).
        available_gib: f64,
    },
    /// A file that must exist is missing or unreadable.
    #[error("{file}: cannot read file: {reason}")]
    Io {
        /// File path.
        file: String,
        /// OS error text.
        reason: String,
    },
    /// The file is not valid JSON; `line`/`column` come from serde_json (1-based).
    #[error("{file}: invalid JSON at line {line} column {column}: {reason}")]
    Json {
        /// File path.
        file: String,
        /// 1-based line of the syntax error.
        line: usize,
        /// 1-based column of the syntax error.
        column: usize,
        /// serde_json's message.
        reason: String,
    },
    /// A required field is absent (or null).
    #[error("{file}: missing required field `{field}`")]
    MissingField {
        /// File path.
        file: String,
        /// JSON key (dotted for nested keys).
        field: String,
    },
    /// A field is present but has the wrong type or an unusable value.
    #[error("{file}: invalid field `{field}`: {reason}")]
    InvalidField {
        /// File path.
        file: String,
        /// JSON key (dotted for nested keys).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `architectures` names no supported architecture.
    #[error(
        "{file}: unsupported `architectures` {found:?}; supported: LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration (its text model)"
    )]
    UnsupportedArchitecture {
        /// File path.
        file: String,
        /// The `architectures` list as found.
        found: Vec<String>,
    },
    /// `model_type` is not one of those [`crate::ModelConfig`] reads.
    #[error(
        "{file}: unsupported `model_type` {found:?}; supported: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, phi3, gemma3_text, gemma3"
    )]
    UnsupportedModelType {
        /// File path.
        file: String,
        /// The `model_type` as found.
        found: String,
    },
    /// A tensor required by the config is not stored.
    #[error("{file}: missing tensor `{tensor}`")]
    MissingTensor {
        /// The weights file (or index) that was searched.
        file: String,
        /// HF tensor name.
        tensor: String,
    },
    /// A tensor's shape does not match the one implied by config.json.
    #[error(
        "{file}: tensor `{tensor}` has shape {found:?}, expected {expected:?} (from config.json)"
    )]
    ShapeMismatch {
        /// The weights file holding the tensor.
        file: String,
        /// HF tensor name.
        tensor: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape stored in the file.
        found: Vec<usize>,
    },
    /// The checkpoint stores decoder layers the config does not have (config.json and the
    /// weights belong to different models, e.g. an edited `num_hidden_layers`).
    #[error(
        "{file}: the checkpoint has tensors of layers the config does not have, e.g. `{tensor}` \
         (config.json says num_hidden_layers = {layers}); the config and the weights do not match"
    )]
    ExtraLayers {
        /// The weights file holding the tensor named first (a shard when sharded).
        file: String,
        /// One such tensor.
        tensor: String,
        /// `num_hidden_layers` from config.json.
        layers: usize,
    },
    /// A fused checkpoint (Phi-3) also stores one of the parts its fused tensor holds (a
    /// `q_proj` beside the `qkv_proj`): one of the two would be ignored, and which is meant is
    /// unknown.
    #[error(
        "{file}: the checkpoint stores both `{part}` and the fused `{fused}` that holds its \
         rows; one of them would be ignored, so the weights are ambiguous"
    )]
    FusedAndPart {
        /// The weights file holding the part (a shard when sharded).
        file: String,
        /// The separately stored part.
        part: String,
        /// The fused tensor.
        fused: String,
    },
    /// The checkpoint stores tensors a model of config.json's architecture does not use
    /// (say an `o_proj.bias` in a Qwen2 checkpoint, a `q_norm` in a Llama one): the weights
    /// are of another architecture, and running without them would give wrong outputs. Names
    /// known to be harmless (saved RoPE tables, a tied `lm_head.weight`, an all-zero bias) are
    /// not counted. vLLM refuses such a checkpoint too (a `KeyError` or `ValueError` naming
    /// the weight).
    #[error(
        "{file}: the checkpoint has {count} tensor(s) that a `{model_type}` model as config.json \
         describes does not use: {}; config.json and the weights do not match, or the \
         checkpoint's architecture is not supported",
        list_names(.tensors, *.count)
    )]
    UnusedTensors {
        /// The weights file holding the tensor named first (a shard when sharded).
        file: String,
        /// `model_type` from config.json.
        model_type: String,
        /// The first few such tensors, sorted.
        tensors: Vec<String>,
        /// How many there are.
        count: usize,
    },
    /// A tensor is stored in a dtype other than F32, F16 or BF16.
    #[error("{file}: tensor `{tensor}` has unsupported dtype {dtype}; supported: F32, F16, BF16")]
    UnsupportedDtype {
        /// The weights file holding the tensor.
        file: String,
        /// HF tensor name.
        tensor: String,
        /// The dtype as safetensors names it.
        dtype: String,
    },
    /// A one-dimensional tensor (a norm weight, a bias, RoPE factors) holds a NaN or an
    /// infinity: every logit would be NaN, and the sampler would emit garbage without an
    /// error. Checked at load for every 1-D tensor (a few KB each); matrices are not scanned.
    #[error("{file}: tensor `{tensor}` holds {value} at index {index}; a norm weight or bias must be finite")]
    NonFinite {
        /// The weights file holding the tensor.
        file: String,
        /// HF tensor name.
        tensor: String,
        /// The first non-finite element's index.
        index: usize,
        /// Its value as text (`NaN`, `inf`, `-inf`).
        value: String,
    },
    /// A float8 weight of an FP8 checkpoint cannot be dequantized ([`crate::quant`]): its
    /// scale tensor is missing or of a shape that fits neither per-tensor, per-row nor the
    /// config's blocks, or the checkpoint stores float8 tensors without a
    /// `quantization_config` saying how they are scaled.
    #[error("{file}: FP8 weight `{tensor}`: {reason}")]
    Fp8 {
        /// The weights file holding the tensor.
        file: String,
        /// HF tensor name of the float8 weight.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The safetensors container itself is malformed (header, offsets, truncation).
    #[error("{file}: invalid safetensors file: {reason}")]
    Safetensors {
        /// The weights file.
        file: String,
        /// safetensors' message.
        reason: String,
    },
    /// A GGUF file (llama.cpp's format) is malformed, or holds something Baton does not
    /// read (an architecture, a tensor type, a tokenizer model), named in `reason`.
    #[error("{file}: GGUF: {reason}")]
    Gguf {
        /// The .gguf file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// `model.safetensors.index.json` is inconsistent (e.g. `weight_map` points at a missing shard).
    #[error("{file}: sharded index: {reason}")]
    ShardIndex {
        /// The index file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// tokenizer.json could not be loaded or used.
    #[error("{file}: tokenizer: {reason}")]
    Tokenizer {
        /// tokenizer.json's path (or `tokenizer` when not file-specific).
        file: String,
        /// The tokenizers crate's message.
        reason: String,
    },
    /// A forward pass was called with invalid inputs.
    #[error("forward: {0}")]
    Forward(#[from] ForwardError),
}

/// Invalid input to [`crate::CpuModel::forward`]; nothing is written to the KV cache when one is
/// returned (all rows are validated before any computation).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ForwardError {
    /// A row has no tokens.
    #[error("row {row}: no tokens")]
    EmptyRow {
        /// Row index in the batch.
        row: usize,
    },
    /// A token id is `>= vocab_size`.
    #[error("row {row}: token {token} at index {index} is >= vocab_size {vocab_size}")]
    TokenOutOfRange {
        /// Row index in the batch.
        row: usize,
        /// Index of the token within the row.
        index: usize,
        /// The offending id.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// The row's last position is `>= max_position_embeddings`.
    #[error("row {row}: positions up to {end} exceed max_position_embeddings {max}")]
    PositionOutOfRange {
        /// Row index in the batch.
        row: usize,
        /// One past the row's last position.
        end: usize,
        /// The model's `max_position_embeddings`.
        max: usize,
    },
    /// The block table has fewer entries than the row's positions need.
    #[error("row {row}: block table has {len} entries, positions 0..{end} need {needed}")]
    BlockTableTooShort {
        /// Row index in the batch.
        row: usize,
        /// Entries present.
        len: usize,
        /// Entries needed (`ceil(end / block_size)`).
        needed: usize,
        /// One past the row's last position.
        end: usize,
    },
    /// A block-table entry is not a page of this cache.
    #[error("row {row}: block table entry {index} is page {page}, cache has {num_blocks} pages")]
    PageOutOfRange {
        /// Row index in the batch.
        row: usize,
        /// Index within the block table.
        index: usize,
        /// The offending page id.
        page: u32,
        /// Pages in the cache.
        num_blocks: usize,
    },
    /// The cache was built for a model of a different shape.
    #[error(
        "KV cache shape {cache:?} (layers, kv heads, head dim) does not match model {model:?}"
    )]
    CacheMismatch {
        /// The cache's (layers, kv heads, head dim).
        cache: (usize, usize, usize),
        /// The model's (layers, kv heads, head dim).
        model: (usize, usize, usize),
    },
    /// Forced layer inputs of the wrong count or size
    /// ([`crate::CpuModel::forward_layers_forced`]).
    #[error("forced layer inputs: want {layers} buffers of {values} values")]
    ForcedInputs {
        /// Buffers wanted (the model's layers, or its mixture-of-experts layers for
        /// [`crate::CpuModel::forward_layers_forced_moe`]'s MLP inputs).
        layers: usize,
        /// Values per buffer (`T * hidden`).
        values: usize,
    },
    /// A row names a LoRA adapter id past the ones loaded.
    #[error("row {row}: LoRA adapter {lora}, but {loaded} are loaded")]
    UnknownLora {
        /// Row index in the batch.
        row: usize,
        /// The id asked for.
        lora: u32,
        /// Adapters loaded.
        loaded: usize,
    },
}

/// `` `a`, `b` and 3 more `` for an error message.
fn list_names(names: &[String], count: usize) -> String {
    let mut s = names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if count > names.len() {
        s.push_str(&format!(" and {} more", count - names.len()));
    }
    s
}

impl ModelError {
    pub(crate) fn io(file: &std::path::Path, e: &std::io::Error) -> Self {
        ModelError::Io {
            file: file.display().to_string(),
            reason: e.to_string(),
        }
    }

    pub(crate) fn json(file: &str, e: &serde_json::Error) -> Self {
        ModelError::Json {
            file: file.to_string(),
            line: e.line(),
            column: e.column(),
            reason: e.to_string(),
        }
    }
}
