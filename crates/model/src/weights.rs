//! Safetensors weight loading (single file or sharded index), memory-mapped.
//!
//! Contract: [`WeightSource`] opens `model.safetensors` or `model.safetensors.index.json` and
//! exposes every tensor's name, source dtype, shape and raw little-endian bytes without copying
//! (for backends that load bf16 directly). [`LlamaWeights::load`] converts F32/F16/BF16 to f32
//! host tensors after checking every shape against the [`ModelConfig`]; any problem is a
//! [`ModelError`] naming the file and tensor.

use crate::config::{parse_json, read_text, Fields, ModelConfig, MoeNaming};
use crate::error::ModelError;
use crate::quant::{self, Fp8Format, Fp8Quant, FP8_SCALE_SUFFIXES};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};
use std::collections::{BTreeMap, HashMap};

use crate::gguf_quant::GgmlType;
use std::path::{Path, PathBuf};

/// A dense row-major f32 host tensor. `Debug` prints the shape only.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    /// Dimensions, outermost first (HF order: linear weights are `[out, in]`).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major; empty when [`Tensor::is_ggml`].
    pub data: Vec<f32>,
    /// A CPU linear layer's weight kept in a GGUF file's blocks
    /// ([`WeightSource::load_kept`]), in place of `data`.
    pub(crate) ggml: Option<crate::linear::GgmlRows>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor{:?}", self.shape)
    }
}

impl Tensor {
    /// A tensor of shape `shape` holding `data` (`shape.iter().product()` values, row-major).
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        Tensor {
            shape,
            data,
            ggml: None,
        }
    }

    /// A tensor filled with `value`.
    pub fn full(shape: &[usize], value: f32) -> Self {
        Tensor::new(shape.to_vec(), vec![value; shape.iter().product()])
    }

    /// Whether the values are held as a GGUF file's quantized blocks (the CPU backend's
    /// `WeightSource::load_kept`) rather than in `data`.
    pub fn is_ggml(&self) -> bool {
        self.ggml.is_some()
    }
}

/// Weights of one decoder layer (HF names; linear weights are `[out_features, in_features]`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// `[hidden]` RMSNorm weight before attention.
    pub input_layernorm: Tensor,
    /// `[heads * head_dim, hidden]`, rows in HF rotate-half RoPE order.
    pub q_proj: Tensor,
    /// `[kv_heads * head_dim, hidden]`, rows in HF rotate-half RoPE order.
    pub k_proj: Tensor,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: Tensor,
    /// `[hidden, heads * head_dim]`.
    pub o_proj: Tensor,
    /// `[hidden]` RMSNorm weight before the MLP: Llama's `post_attention_layernorm`, Gemma 3's
    /// `pre_feedforward_layernorm` ([`ModelConfig::sandwich_norms`]).
    pub post_attention_layernorm: Tensor,
    /// `[intermediate, hidden]` dense MLP gate projection; empty (`[0, hidden]`) in a
    /// mixture-of-experts layer, whose MLP is [`LayerWeights::moe`].
    pub gate_proj: Tensor,
    /// `[intermediate, hidden]`; empty (`[0, hidden]`) in a mixture-of-experts layer.
    pub up_proj: Tensor,
    /// `[hidden, intermediate]`; empty (`[hidden, 0]`) in a mixture-of-experts layer.
    pub down_proj: Tensor,
    /// `[heads * head_dim]` q projection bias, present exactly when
    /// [`ModelConfig::qkv_bias`] (Qwen2).
    pub q_bias: Option<Tensor>,
    /// `[kv_heads * head_dim]` k projection bias, as `q_bias`.
    pub k_bias: Option<Tensor>,
    /// `[kv_heads * head_dim]` v projection bias, as `q_bias`.
    pub v_bias: Option<Tensor>,
    /// `[head_dim]` RMSNorm weight of every query head, present exactly when
    /// [`ModelConfig::qk_norm`] (Qwen3).
    pub q_norm: Option<Tensor>,
    /// `[head_dim]` RMSNorm weight of every key head, as `q_norm`.
    pub k_norm: Option<Tensor>,
    /// `[hidden]` RMSNorm weight of the attention output before its residual add (Gemma 3's
    /// `post_attention_layernorm`), present exactly when [`ModelConfig::sandwich_norms`].
    pub attn_out_norm: Option<Tensor>,
    /// `[hidden]` RMSNorm weight of the MLP output before its residual add (Gemma 3's
    /// `post_feedforward_layernorm`), as `attn_out_norm`.
    pub mlp_out_norm: Option<Tensor>,
    /// The mixture of experts, present exactly in the layers [`ModelConfig::layer_is_moe`]
    /// names.
    pub moe: Option<MoeWeights>,
}

/// One mixture-of-experts MLP ([`crate::MoeConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeWeights {
    /// `[num_experts, hidden]` router (Mixtral's `block_sparse_moe.gate`, Qwen's `mlp.gate`).
    pub router: Tensor,
    /// Per expert: gate `[moe_intermediate, hidden]`, up `[moe_intermediate, hidden]`, down
    /// `[hidden, moe_intermediate]` (Mixtral's `w1`, `w3`, `w2`).
    pub experts: Vec<[Tensor; 3]>,
    /// Qwen2-MoE's shared expert: gate, up `[shared_intermediate, hidden]`, down `[hidden,
    /// shared_intermediate]`, and its gate `[1, hidden]` (`mlp.shared_expert_gate`).
    pub shared: Option<[Tensor; 4]>,
}

impl MoeWeights {
    /// Every tensor in [`layer_tensor_shapes`]'s order: the router, each expert's gate, up and
    /// down, the shared expert's gate, up, down and gate weight.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.router];
        v.extend(self.experts.iter().flatten());
        v.extend(self.shared.iter().flatten());
        v
    }

    /// [`MoeWeights::tensors`], mutable.
    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.router];
        v.extend(self.experts.iter_mut().flatten());
        v.extend(self.shared.iter_mut().flatten());
        v
    }
}

impl LayerWeights {
    /// Every tensor in [`layer_tensor_shapes`]'s order: the nine Llama ones in field order
    /// (less the dense MLP's three in a mixture-of-experts layer), then the present q/k/v
    /// biases, the present q/k norms, the present output norms, the experts'.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![
            &self.input_layernorm,
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.post_attention_layernorm,
        ];
        if self.moe.is_none() {
            v.extend([&self.gate_proj, &self.up_proj, &self.down_proj]);
        }
        v.extend(
            [
                &self.q_bias,
                &self.k_bias,
                &self.v_bias,
                &self.q_norm,
                &self.k_norm,
                &self.attn_out_norm,
                &self.mlp_out_norm,
            ]
            .into_iter()
            .flatten(),
        );
        v.extend(self.moe.iter().flat_map(MoeWeights::tensors));
        v
    }

    /// [`LayerWeights::tensors`], mutable.
    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![
            &mut self.input_layernorm,
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.post_attention_layernorm,
        ];
        if self.moe.is_none() {
            v.extend([&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj]);
        }
        v.extend(
            [
                &mut self.q_bias,
                &mut self.k_bias,
                &mut self.v_bias,
                &mut self.q_norm,
                &mut self.k_norm,
                &mut self.attn_out_norm,
                &mut self.mlp_out_norm,
            ]
            .into_iter()
            .flatten(),
        );
        v.extend(self.moe.iter_mut().flat_map(MoeWeights::tensors_mut));
        v
    }
}

/// All weights of a Llama-family model as f32 host tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaWeights {
    /// `[vocab, hidden]` token embedding (`model.embed_tokens.weight`).
    pub embed: Tensor,
    /// `num_hidden_layers` layers.
    pub layers: Vec<LayerWeights>,
    /// `[hidden]` final RMSNorm weight (`model.norm.weight`).
    pub norm: Tensor,
    /// `[vocab, hidden]` LM head (`lm_head.weight`, or a copy of `embed` when tied).
    pub lm_head: Tensor,
}

/// Source element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The dtype a name means, case-insensitively: PyTorch's (`float32`, `bfloat16`,
    /// `float16`, as config.json's `torch_dtype` and vLLM's flags spell them) or a short one
    /// (`f32`/`fp32`/`float`, `bf16`, `f16`/`fp16`/`half`). `None` for anything else.
    pub fn from_name(name: &str) -> Option<DType> {
        match name.trim().to_ascii_lowercase().as_str() {
            "float32" | "fp32" | "f32" | "float" => Some(DType::F32),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "fp16" | "f16" | "half" => Some(DType::F16),
            _ => None,
        }
    }
}

/// One stored tensor, borrowed from the memory map.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    /// HF tensor name.
    pub name: &'a str,
    /// Source dtype.
    pub dtype: DType,
    /// Stored shape.
    pub shape: &'a [usize],
    /// Little-endian element bytes (`shape.product() * dtype.size()` of them).
    pub bytes: &'a [u8],
    /// The file holding it.
    pub file: &'a Path,
}

impl RawTensor<'_> {
    /// Converts to an f32 tensor (exact for F16/BF16).
    pub fn to_f32(&self) -> Tensor {
        let data: Vec<f32> = match self.dtype {
            DType::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        Tensor::new(self.shape.to_vec(), data)
    }
}

/// The dtype FP8 and GGUF weights are dequantized into: the model's 16-bit dtype
/// (`torch_dtype` bfloat16 or float16), else f32.
fn dequantized_dtype(cfg: &ModelConfig) -> DType {
    match cfg.torch_dtype.as_deref().and_then(DType::from_name) {
        Some(d @ (DType::BF16 | DType::F16)) => d,
        _ => DType::F32,
    }
}

/// One mapped weights file: a safetensors file, or a GGUF file whose tensors are listed in
/// safetensors' terms (a quantized one as its raw bytes, `U8` of its byte length;
/// [`WeightSource::open_gguf`]).
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Where the data section starts, less 8 (a safetensors file's header length).
    header_len: usize,
    /// Stored tensors by stored name; `data_offsets` from the data section's start.
    tensors: HashMap<String, TensorInfo>,
}

/// Memory-mapped safetensors weights of a model directory (one file or an index of shards).
pub struct WeightSource {
    shards: Vec<Shard>,
    /// tensor name -> shard index
    names: BTreeMap<String, usize>,
    /// The file named in "missing tensor" errors (the single file or the index).
    origin: PathBuf,
    /// Tensors served as a row range of a stored one (a fused checkpoint's q, k, v, gate and
    /// up projections; [`WeightSource::open_for`]), by the name the model uses.
    views: BTreeMap<String, RowView>,
    /// Tensors served from a copy: a partial-RoPE model's q and k rows in the permuted head
    /// layout ([`WeightSource::open_for`]), by name.
    copies: BTreeMap<String, CopiedTensor>,
    /// The stored name of a tensor `names` lists under another (a multimodal checkpoint's
    /// text model, [`ModelConfig::multimodal_text`]).
    aliases: BTreeMap<String, String>,
    /// A GGUF file's quantized tensors (stored as raw bytes), with their type and shape, by
    /// stored name.
    gguf_quantized: BTreeMap<String, GgufQuantized>,
    /// The tensors served from a GGUF file's quantized ones, by the name the model uses: each
    /// a list of stored rows ([`WeightSource::open_for`]).
    ggml: BTreeMap<String, GgmlServed>,
    /// A GGUF file whose q and k rows llama.cpp's converter permuted for interleaved RoPE
    /// ([`crate::gguf::permuted_qk`]), for [`WeightSource::open_for`] to un-permute.
    gguf_permuted_qk: bool,
    /// A GGUF file whose norm weights are stored with 1 added
    /// ([`crate::gguf::norms_shifted`]), for [`WeightSource::open_for`] to subtract.
    gguf_norms_shifted: bool,
}

/// A quantized tensor of a GGUF file, for [`WeightSource::open_for`] to dequantize.
#[derive(Debug)]
struct GgufQuantized {
    ty: GgmlType,
    /// Row-major shape, outermost first.
    shape: Vec<usize>,
    /// llama.cpp's name (`blk.0.attn_q.weight`), for errors.
    gguf_name: String,
}

/// A tensor served from rows of a GGUF file's quantized tensor ([`WeightSource::open_for`]):
/// the whole tensor, a row range of a fused one, or either with its rows reordered (q and k
/// un-permuted, or in a partial-RoPE model's head layout). The CPU backend takes the rows as
/// stored ([`WeightSource::load_kept`]); [`WeightSource::get`] dequantizes them once, on first
/// use, into the model's 16-bit dtype (what the CUDA backend uploads).
#[derive(Debug)]
struct GgmlServed {
    /// The stored tensor (a key of [`WeightSource::gguf_quantized`]).
    source: String,
    /// Served shape: `[rows.len(), cols]`.
    shape: Vec<usize>,
    /// Served row `i` is the source's row `rows[i]`.
    rows: Vec<usize>,
    /// The dtype [`WeightSource::get`] dequantizes into.
    dtype: DType,
    /// [`WeightSource::get`]'s dequantized copy, made on first use.
    copy: std::sync::OnceLock<CopiedTensor>,
}

/// A tensor [`WeightSource`] holds in memory: its stored dtype and shape, its file.
#[derive(Debug)]
struct CopiedTensor {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
    file: PathBuf,
}

impl CopiedTensor {
    /// A copy of `t` (its dtype, shape and file) holding `bytes` instead.
    fn of(t: &RawTensor<'_>, bytes: Vec<u8>) -> Self {
        CopiedTensor {
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            bytes,
            file: t.file.to_path_buf(),
        }
    }

    /// This copy as the tensor `name`.
    fn raw<'a>(&'a self, name: &'a str) -> RawTensor<'a> {
        RawTensor {
            name,
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
            file: &self.file,
        }
    }
}

/// Rows `start..start + shape[0]` of the stored 2-D tensor `source`, whose whole shape is
/// `[fused_rows, shape[1]]`. Row-major storage makes them one contiguous byte range.
#[derive(Debug)]
struct RowView {
    source: String,
    start: usize,
    fused_rows: usize,
    shape: [usize; 2],
}

impl std::fmt::Debug for WeightSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSource")
            .field("origin", &self.origin)
            .field("shards", &self.shards.len())
            .field("tensors", &self.names.len())
            .finish()
    }
}

/// Why the safetensors header of `bytes` (a whole file) is invalid, naming the first tensor at
/// fault, for a file `SafeTensors::read_metadata` refused (its message names no tensor).
/// Checks, per tensor in file order: `dtype`, `shape` and `data_offsets` are present and
/// well-formed, the dtype is one safetensors defines, the shape's byte size equals the span of
/// its `data_offsets`, and the spans are packed from 0 without gaps or overlaps (the format's
/// rules, <https://github.com/huggingface/safetensors>). `None` when no tensor is at fault (a
/// truncated file, a header that is not JSON, a file longer than its tensors).
fn header_fault(bytes: &[u8]) -> Option<String> {
    use serde_json::Value;
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    let map: serde_json::Map<String, Value> = serde_json::from_slice(header).ok()?;
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    for (name, info) in map.iter().filter(|(k, _)| *k != "__metadata__") {
        let field = |f: &str| info.get(f);
        let Some(dtype) = field("dtype").and_then(Value::as_str) else {
            return Some(format!("tensor `{name}` has no string `dtype`"));
        };
        let bits: u64 = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
            "I16" | "U16" | "F16" | "BF16" => 16,
            "I32" | "U32" | "F32" => 32,
            "I64" | "U64" | "F64" | "C64" => 64,
            "F4" => 4,
            "F6_E2M3" | "F6_E3M2" => 6,
            other => return Some(format!("tensor `{name}` has an unknown dtype {other:?}")),
        };
        let shape: Option<Vec<u64>> = field("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect());
        let Some(shape) = shape else {
            return Some(format!(
                "tensor `{name}` has no `shape` list of non-negative integers"
            ));
        };
        let offsets: Option<Vec<u64>> = field("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect());
        let (start, end) = match offsets.as_deref() {
            Some(&[s, e]) if s <= e => (s, e),
            _ => {
                return Some(format!(
                    "tensor `{name}` needs `data_offsets` [start, end] with start <= end, \
                     found {}",
                    field("data_offsets").unwrap_or(&Value::Null)
                ))
            }
        };
        let size = shape
            .iter()
            .try_fold(bits, |a, &d| a.checked_mul(d))
            .filter(|b| b % 8 == 0)
            .map(|b| b / 8);
        if size != Some(end - start) {
            return Some(format!(
                "tensor `{name}` of shape {shape:?} and dtype {dtype} takes {} bytes, but its \
                 data_offsets {start}..{end} span {}",
                size.map_or_else(|| "an impossible number of".into(), |b| b.to_string()),
                end - start
            ));
        }
        spans.push((start, end, name));
    }
    spans.sort_unstable();
    let mut at = 0u64;
    for (start, end, name) in spans {
        if start != at {
            return Some(format!(
                "tensor `{name}`'s data starts at byte {start}, where {at} was expected \
                 (tensors are packed from 0 without gaps or overlaps)"
            ));
        }
        at = end;
    }
    None
}

fn open_shard(path: &Path) -> Result<Shard, ModelError> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, &e))?;
    // SAFETY: the mapping is read-only and private to this process; model files are not
    // expected to be modified while loaded (the same assumption HF and the safetensors crate
    // make). All accesses are bounds-checked slices of the map.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, &e))?;
    let (header_len, meta) =
        SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
            file: path.display().to_string(),
            reason: match header_fault(&mmap) {
                Some(why) => format!("{e}: {why}"),
                None => e.to_string(),
            },
        })?;
    // read_metadata validates offsets against the buffer, but be defensive: every tensor's
    // byte range must lie inside the map.
    let data_start = 8usize.saturating_add(header_len);
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        if s > e || data_start.saturating_add(e) > mmap.len() {
            return Err(ModelError::Safetensors {
                file: path.display().to_string(),
                reason: format!("tensor `{name}` data offsets {s}..{e} exceed the file"),
            });
        }
    }
    let tensors = meta
        .tensors()
        .into_iter()
        .map(|(k, info)| (k, info.clone()))
        .collect();
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
        header_len,
        tensors,
    })
}

impl WeightSource {
    /// Opens one safetensors file (a LoRA adapter's `adapter_model.safetensors`), its tensors
    /// by their stored names.
    ///
    /// # Errors
    /// [`ModelError::Io`] if it cannot be read, [`ModelError::Safetensors`] for a corrupt file.
    pub fn open_file(path: &Path) -> Result<Self, ModelError> {
        let shard = open_shard(path)?;
        let names = shard.tensors.keys().map(|k| (k.clone(), 0)).collect();
        Ok(WeightSource {
            shards: vec![shard],
            names,
            origin: path.to_path_buf(),
            views: BTreeMap::new(),
            copies: BTreeMap::new(),
            aliases: BTreeMap::new(),
            gguf_quantized: BTreeMap::new(),
            ggml: BTreeMap::new(),
            gguf_permuted_qk: false,
            gguf_norms_shifted: false,
        })
    }

    /// Opens `dir/model.safetensors`, or else `dir/model.safetensors.index.json` and the shards
    /// its `weight_map` names.
    ///
    /// # Errors
    /// [`ModelError::Io`] if neither exists, [`ModelError::ShardIndex`] for a malformed index,
    /// a shard that is missing or that lacks a tensor the index assigns to it,
    /// [`ModelError::Safetensors`] for a corrupt file.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let gguf = dir.join(crate::gguf::GGUF_WEIGHTS);
        if !single.exists() && !index.exists() && gguf.exists() {
            return Self::open_gguf(&gguf);
        }
        if single.exists() || !index.exists() {
            return Self::open_file(&single);
        }
        let index_name = index.display().to_string();
        let v = parse_json(&index_name, &read_text(&index)?)?;
        let f = Fields::new(&index_name, &v)?;
        let map = match f.get("weight_map") {
            Some(serde_json::Value::Object(m)) => m,
            Some(_) => return Err(f.invalid("weight_map", "expected an object")),
            None => return Err(f.missing("weight_map")),
        };
        let mut shard_ids: BTreeMap<String, usize> = BTreeMap::new();
        let mut shards = Vec::new();
        let mut names = BTreeMap::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(ModelError::ShardIndex {
                    file: index_name.clone(),
                    reason: format!("weight_map[`{tensor}`] is not a file name"),
                });
            };
            if file.contains('/') || file.contains('\\') || file.contains("..") {
                return Err(ModelError::ShardIndex {
                    file: index_name.clone(),
                    reason: format!("weight_map[`{tensor}`] = {file:?} is not a plain file name"),
                });
            }
            let id = match shard_ids.get(file) {
                Some(&id) => id,
                None => {
                    let p = dir.join(file);
                    if !p.exists() {
                        return Err(ModelError::ShardIndex {
                            file: index_name.clone(),
                            reason: format!(
                                "shard `{file}` (holding tensor `{tensor}`) does not exist"
                            ),
                        });
                    }
                    shards.push(open_shard(&p)?);
                    shard_ids.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            if !shards[id].tensors.contains_key(tensor) {
                return Err(ModelError::ShardIndex {
                    file: index_name.clone(),
                    reason: format!("tensor `{tensor}` is not in shard `{file}`"),
                });
            }
            names.insert(tensor.clone(), id);
        }
        Ok(WeightSource {
            shards,
            names,
            origin: index,
            views: BTreeMap::new(),
            copies: BTreeMap::new(),
            aliases: BTreeMap::new(),
            gguf_quantized: BTreeMap::new(),
            ggml: BTreeMap::new(),
            gguf_permuted_qk: false,
            gguf_norms_shifted: false,
        })
    }

    /// Opens a GGUF file (llama.cpp's format; [`crate::gguf`]), its tensors under their
    /// Hugging Face names ([`crate::gguf::hf_tensor_name`]; the RoPE factor tensors are left
    /// out, config.json holds them; a layer's merged experts tensor is served as one tensor
    /// per expert, [`crate::gguf::merged_experts`], each a slice of it, and a fused q/k/v
    /// projection outside Phi-3 as its three row ranges, [`crate::gguf::fused_qkv`]). F32, F16 and BF16
    /// tensors are served from the map as they are stored; a quantized one is listed as its
    /// raw bytes (`U8`, which the fingerprint hashes) until [`WeightSource::open_for`]
    /// dequantizes it.
    ///
    /// # Errors
    /// As [`crate::gguf::GgufFile::open`]; [`ModelError::Gguf`] for two tensors of one name,
    /// a merged experts tensor that is not `[experts, rows, cols]`, or a fused q/k/v tensor
    /// whose rows are not the heads' ([`crate::gguf::fused_qkv_rows`]).
    pub fn open_gguf(path: &Path) -> Result<Self, ModelError> {
        // Errors name the file itself, not a prepared directory's link to it.
        let real = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let path = real.as_path();
        let g = crate::gguf::GgufFile::open(path)?;
        let permuted = crate::gguf::permuted_qk(g.architecture()?);
        let norms_shifted = crate::gguf::norms_shifted(g.architecture()?);
        let arch = crate::gguf::naming_arch(&g)?;
        let mut tensors = HashMap::new();
        let mut names = BTreeMap::new();
        let mut quantized = BTreeMap::new();
        let fault = |reason: String| ModelError::Gguf {
            file: path.display().to_string(),
            reason,
        };
        let qkv_rows = crate::gguf::fused_qkv_rows(&g)?;
        for t in &g.tensors {
            // (Hugging Face name, row-major shape, byte range in the data section) of each
            // tensor served: one, one per expert of a merged experts tensor, or q, k and v of
            // a fused one.
            let len = g.tensor_bytes(t)?.len();
            let start = t.offset as usize;
            let mut parts = Vec::new();
            if let Some(names) = crate::gguf::fused_qkv(arch, &t.name) {
                let shape = t.shape();
                let rows = qkv_rows.map_or(0, |r| r.iter().sum::<usize>());
                let ok = (shape.len() == 1 || shape.len() == 2) && shape[0] == rows && rows > 0;
                let Some(qkv_rows) = qkv_rows.filter(|_| ok) else {
                    return Err(fault(format!(
                        "tensor `{}` has shape {shape:?}; expected {rows} rows (q, k and v of \
                         `attention.head_count`, `head_count_kv` and `key_length`)",
                        t.name
                    )));
                };
                // Rows are whole blocks of the tensor's type, so each part is a byte range.
                let row_bytes = len / rows;
                let mut at = start;
                for (name, r) in names.into_iter().zip(qkv_rows) {
                    let mut part = shape.clone();
                    part[0] = r;
                    parts.push((name, part, at, r * row_bytes));
                    at += r * row_bytes;
                }
            } else if let Some((_, expert_name)) = crate::gguf::merged_experts(arch, &t.name) {
                let shape = t.shape();
                let [n, rows, cols] = shape[..] else {
                    return Err(fault(format!(
                        "tensor `{}` has shape {shape:?}; expected [experts, rows, cols]",
                        t.name
                    )));
                };
                if n == 0 || !len.is_multiple_of(n) {
                    return Err(fault(format!(
                        "tensor `{}` of {len} bytes does not split into {n} experts",
                        t.name
                    )));
                }
                let each = len / n;
                for e in 0..n {
                    parts.push((expert_name(e), vec![rows, cols], start + e * each, each));
                }
            } else if let Some(name) = crate::gguf::hf_tensor_name(arch, &t.name) {
                let mut shape = t.shape();
                // Qwen2-MoE's shared expert gate is `[1, hidden]` in Hugging Face's files;
                // llama.cpp reads it as `{hidden}`, which a converted file may store.
                if name.ends_with(".mlp.shared_expert_gate.weight") && shape.len() == 1 {
                    shape.insert(0, 1);
                }
                parts.push((name, shape, start, len));
            }
            let ty = GgmlType::from_u32(t.ggml_type).expect("GgufFile::open checked the types");
            for (name, shape, start, len) in parts {
                let (dtype, shape) = match ty {
                    GgmlType::F32 => (Dtype::F32, shape),
                    GgmlType::F16 => (Dtype::F16, shape),
                    GgmlType::BF16 => (Dtype::BF16, shape),
                    q => {
                        let info = GgufQuantized {
                            ty: q,
                            shape,
                            gguf_name: t.name.clone(),
                        };
                        quantized.insert(name.clone(), info);
                        (Dtype::U8, vec![len])
                    }
                };
                let info = TensorInfo {
                    dtype,
                    shape,
                    data_offsets: (start, start + len),
                };
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(fault(format!(
                        "two tensors are named `{name}` in Hugging Face terms"
                    )));
                }
                names.insert(name, 0);
            }
        }
        let header_len = g.data_start - 8;
        let shard = Shard {
            path: path.to_path_buf(),
            mmap: g.into_mmap(),
            header_len,
            tensors,
        };
        Ok(WeightSource {
            shards: vec![shard],
            names,
            origin: path.to_path_buf(),
            views: BTreeMap::new(),
            copies: BTreeMap::new(),
            aliases: BTreeMap::new(),
            gguf_quantized: quantized,
            ggml: BTreeMap::new(),
            gguf_permuted_qk: permuted,
            gguf_norms_shifted: norms_shifted,
        })
    }

    /// [`WeightSource::open`] for a model of `cfg`: with [`ModelConfig::multimodal_text`] the
    /// text model's tensors (`language_model.model.*`, `model.language_model.*`,
    /// `language_model.lm_head.weight`) are served under the text model's names (`model.*`,
    /// `lm_head.weight`) and the vision tower's and projector's are not listed; with [`ModelConfig::fused_projections`]
    /// (Phi-3), each layer's `self_attn.{q,k,v}_proj.weight` is served as its row range of
    /// the stored `self_attn.qkv_proj.weight` (`[q + 2 kv, hidden]`: q rows first, then k,
    /// then v, as transformers' `Phi3Attention` slices it) and `mlp.{gate,up}_proj.weight` as
    /// the halves of `mlp.gate_up_proj.weight` (`[2 intermediate, hidden]`: gate first, as
    /// `Phi3MLP`'s `chunk(2)`), without a copy. A fused tensor of another shape is a
    /// [`ModelError::ShapeMismatch`] naming it when a part is read; a checkpoint storing the
    /// separate parts is read as it is.
    ///
    /// With partial RoPE ([`ModelConfig::rotary_dim`] below `head_dim`), each layer's
    /// `self_attn.{q,k}_proj.weight` (and `.bias`, and Qwen3's `q_norm`/`k_norm`) is served
    /// from a copy whose rows within each head follow [`ModelConfig::rope_head_permutation`]
    /// (a tensor that is missing or of another shape is left to the load's own error).
    ///
    /// # Errors
    /// As [`WeightSource::open`], and [`ModelError::FusedAndPart`] for a checkpoint storing
    /// both a fused tensor and one of its parts.
    pub fn open_for(dir: &Path, cfg: &ModelConfig) -> Result<Self, ModelError> {
        Self::open_with(dir, cfg, true)
    }

    /// [`WeightSource::open_for`] without the permuted copies: the tensor names and shapes
    /// are the same, but a partial-RoPE model's q and k come unpermuted. For checks of the
    /// names ([`WeightSource::check_tensor_names`]) that read no values.
    pub(crate) fn open_names_for(dir: &Path, cfg: &ModelConfig) -> Result<Self, ModelError> {
        Self::open_with(dir, cfg, false)
    }

    fn open_with(dir: &Path, cfg: &ModelConfig, copies: bool) -> Result<Self, ModelError> {
        let mut src = Self::open(dir)?;
        src.rename_multimodal(cfg);
        src.serve_ggml(cfg);
        if copies {
            if let Some(q) = &cfg.quantization {
                src.dequantize_fp8(cfg, q)?;
            }
            src.unpermute_gguf_qk(cfg)?;
            src.unshift_gguf_norms()?;
        }
        src.add_fused_views(cfg)?;
        src.serve_ggml_views();
        if copies {
            src.permute_partial_rope(cfg);
        }
        Ok(src)
    }

    /// With [`ModelConfig::multimodal_text`], serves the text model's tensors under the text
    /// model's names and drops the vision tower's ([`WeightSource::open_for`]).
    fn rename_multimodal(&mut self, cfg: &ModelConfig) {
        let src = self;
        if cfg.multimodal_text {
            // The text model's tensors under its own names; the vision tower's are not read.
            let mut names = BTreeMap::new();
            for (name, id) in std::mem::take(&mut src.names) {
                let text = ["language_model.model.", "model.language_model."]
                    .iter()
                    .find_map(|p| name.strip_prefix(p).map(|rest| format!("model.{rest}")))
                    .or_else(|| {
                        (name == "language_model.lm_head.weight").then(|| "lm_head.weight".into())
                    });
                let vision = [
                    "vision_tower.",
                    "multi_modal_projector.",
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                ]
                .iter()
                .any(|p| name.starts_with(p));
                match text {
                    Some(t) => {
                        names.insert(t.clone(), id);
                        src.aliases.insert(t, name);
                    }
                    None if vision => {}
                    // Anything else is left for the unused-tensor check to name.
                    None => {
                        names.insert(name, id);
                    }
                }
            }
            src.names = names;
        }
    }

    /// Replaces each float8 `*.weight` by a copy dequantized with its scales
    /// ([`crate::quant`]) in the model's 16-bit dtype (`torch_dtype` bfloat16 or float16),
    /// else in f32.
    ///
    /// # Errors
    /// [`ModelError::Fp8`] for a weight without a scale tensor or with both names, a scale of
    /// a shape that fits no layout, a scale that is not finite and positive, or an element
    /// that dequantizes to NaN or past the dtype's range; as [`WeightSource::get`] for a
    /// scale tensor.
    fn dequantize_fp8(&mut self, cfg: &ModelConfig, q: &Fp8Quant) -> Result<(), ModelError> {
        let out = dequantized_dtype(cfg);
        let mut done = Vec::new();
        for name in self.names.keys().filter(|n| n.ends_with(".weight")) {
            let (_, shard, info, bytes) = self.stored(name)?;
            let format = match info.dtype {
                Dtype::F8_E4M3 => Fp8Format::E4M3,
                Dtype::F8_E5M2 => Fp8Format::E5M2,
                _ => continue,
            };
            let fault = |reason: String| ModelError::Fp8 {
                file: shard.path.display().to_string(),
                tensor: name.clone(),
                reason,
            };
            let n: usize = info.shape.iter().product();
            if bytes.len() != n {
                return Err(fault(format!(
                    "holds {} bytes, shape {:?} needs {n}",
                    bytes.len(),
                    info.shape
                )));
            }
            let base = &name[..name.len() - ".weight".len()];
            let names = ["weight_scale_inv", "weight_scale"].map(|s| format!("{base}.{s}"));
            let scale_name = match names.iter().filter(|s| self.contains(s)).count() {
                1 => names.iter().find(|s| self.contains(s)).expect("counted"),
                0 => {
                    return Err(fault(format!(
                        "the checkpoint has neither `{}` nor `{}` to scale it",
                        names[1], names[0]
                    )))
                }
                _ => {
                    return Err(fault(format!(
                        "the checkpoint has both `{}` and `{}`: which scales it is ambiguous",
                        names[1], names[0]
                    )))
                }
            };
            let scale = self.get(scale_name)?.to_f32();
            let [rows, cols] = match info.shape[..] {
                [r, c] => [r, c],
                _ if scale.data.len() == 1 => [1, n],
                _ => {
                    return Err(fault(format!(
                        "shape {:?} takes one scale (per tensor); `{scale_name}` has shape \
                         {:?} (per-row and block scales are for 2-D weights)",
                        info.shape, scale.shape
                    )))
                }
            };
            let layout = quant::scale_layout(rows, cols, &scale.shape, q.block)
                .map_err(|e| fault(format!("scale `{scale_name}`: {e}")))?;
            if let Some(bad) = scale.data.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(fault(format!(
                    "scale `{scale_name}` holds {bad}; scales must be finite and positive"
                )));
            }
            let mut copy = vec![0u8; n * out.size()];
            let table = format.table();
            let dims = [rows, cols];
            let (data, sc) = (bytes, &scale.data);
            // A NaN code, or a product past the dtype's range (a scale of 1e38 times 448),
            // would run as NaN logits: refused, naming the first such element.
            let bad = match out {
                DType::F32 => {
                    quant::dequantize_rows(data, &table, sc, dims, layout, &mut copy, |x| {
                        x.is_finite().then(|| x.to_le_bytes())
                    })
                }
                DType::BF16 => {
                    quant::dequantize_rows(data, &table, sc, dims, layout, &mut copy, |x| {
                        let y = half::bf16::from_f32(x);
                        y.is_finite().then(|| y.to_le_bytes())
                    })
                }
                DType::F16 => {
                    quant::dequantize_rows(data, &table, sc, dims, layout, &mut copy, |x| {
                        let y = half::f16::from_f32(x);
                        y.is_finite().then(|| y.to_le_bytes())
                    })
                }
            };
            if let Some((r, c, x)) = bad {
                return Err(fault(format!(
                    "element [{r}, {c}] dequantizes to {x} (byte {:#04x} times scale `{scale_name}`), \
                     which {out:?} cannot hold; the checkpoint is corrupt",
                    data[r * cols + c]
                )));
            }
            let tensor = CopiedTensor {
                dtype: out,
                shape: info.shape.clone(),
                bytes: copy,
                file: shard.path.clone(),
            };
            done.push((name.clone(), tensor));
        }
        self.copies.extend(done);
        Ok(())
    }

    /// Serves each quantized tensor of a GGUF file from its stored rows ([`GgmlServed`]),
    /// to be dequantized into the model's 16-bit dtype (`torch_dtype` bfloat16 or float16,
    /// else f32) only when [`WeightSource::get`] asks for it.
    fn serve_ggml(&mut self, cfg: &ModelConfig) {
        let dtype = dequantized_dtype(cfg);
        for (name, q) in &self.gguf_quantized {
            let rows = q.shape.iter().rev().skip(1).product::<usize>();
            let served = GgmlServed {
                source: name.clone(),
                shape: q.shape.clone(),
                rows: (0..rows).collect(),
                dtype,
                copy: std::sync::OnceLock::new(),
            };
            self.ggml.insert(name.clone(), served);
        }
    }

    /// Serves each row view ([`WeightSource::add_fused_views`]) of a quantized GGUF tensor as
    /// its rows of that tensor.
    fn serve_ggml_views(&mut self) {
        let mut add = Vec::new();
        for (name, view) in &self.views {
            let Some(whole) = self.ggml.get(&view.source) else {
                continue;
            };
            // A fused tensor of another shape is left to `get`'s shape error.
            if whole.shape != [view.fused_rows, view.shape[1]] {
                continue;
            }
            let rows = whole.rows[view.start..view.start + view.shape[0]].to_vec();
            let served = GgmlServed {
                source: whole.source.clone(),
                shape: view.shape.to_vec(),
                rows,
                dtype: whole.dtype,
                copy: std::sync::OnceLock::new(),
            };
            add.push((name.clone(), served));
        }
        self.ggml.extend(add);
    }

    /// The quantized GGUF tensor `name` is served from ([`GgmlServed`]), unless a copy (a
    /// Gemma norm less 1) replaced it.
    fn ggml_served(&self, name: &str) -> Option<&GgmlServed> {
        self.ggml
            .get(name)
            .filter(|_| !self.copies.contains_key(name))
    }

    /// The rows `g` serves, as stored (ggml blocks).
    ///
    /// # Errors
    /// [`ModelError::Gguf`] when the stored bytes are not the rows its shape says (the
    /// file's header and data disagree).
    fn ggml_rows(&self, g: &GgmlServed) -> Result<crate::linear::GgmlRows, ModelError> {
        let q = &self.gguf_quantized[&g.source];
        let (_, shard, _, bytes) = self.stored(&g.source)?;
        let cols = g.shape.last().copied().unwrap_or(1);
        let stored_rows = q.shape.iter().rev().skip(1).product::<usize>();
        let fault = |reason: String| ModelError::Gguf {
            file: shard.path.display().to_string(),
            reason: format!("tensor `{}` ({}): {reason}", q.gguf_name, q.ty.name()),
        };
        let row =
            q.ty.row_bytes(cols)
                .filter(|r| stored_rows.checked_mul(*r) == Some(bytes.len()))
                .ok_or_else(|| {
                    fault(format!(
                        "{} bytes are not {stored_rows} rows of {cols}",
                        bytes.len()
                    ))
                })?;
        let mut out = Vec::with_capacity(g.rows.len() * row);
        for &r in &g.rows {
            out.extend_from_slice(&bytes[r * row..(r + 1) * row]);
        }
        crate::linear::GgmlRows::new(q.ty, g.rows.len(), cols, out).map_err(fault)
    }

    /// `g`'s rows dequantized into its dtype: [`WeightSource::get`]'s copy.
    ///
    /// # Errors
    /// As [`WeightSource::dequantized`].
    fn ggml_copy(&self, g: &GgmlServed) -> Result<CopiedTensor, ModelError> {
        let rows = self.ggml_rows(g)?;
        Ok(CopiedTensor {
            dtype: g.dtype,
            shape: g.shape.clone(),
            bytes: self.dequantized(g, &rows, Some(g.dtype))?,
            file: self.file_of(&g.source).to_path_buf(),
        })
    }

    /// `rows` (what `g` serves) dequantized in parallel over blocks of 64 rows, as
    /// little-endian values of `out`, or with `None` only checked (an empty result).
    ///
    /// # Errors
    /// [`ModelError::Gguf`] naming the first value that is NaN or infinite in f32, or past
    /// the range of `out`: the file is corrupt.
    fn dequantized(
        &self,
        g: &GgmlServed,
        rows: &crate::linear::GgmlRows,
        out: Option<DType>,
    ) -> Result<Vec<u8>, ModelError> {
        use rayon::prelude::*;
        let cols = rows.cols.max(1);
        let size = out.map_or(0, DType::size);
        let mut bytes = vec![0u8; rows.rows * cols * size];
        // 64 rows a job: large enough to amortize, small enough to spread a matrix.
        const ROWS: usize = 64;
        let row_bytes = (rows.bytes.len() / rows.rows.max(1)).max(1);
        let job = |(job, (dst, src)): (usize, (&mut [u8], &[u8]))| {
            let mut f = vec![0f32; src.len() / row_bytes * cols];
            if let Err(e) = rows.ty.dequantize(src, &mut f) {
                return Some(e);
            }
            for (i, &x) in f.iter().enumerate() {
                let ok = match out {
                    None => x.is_finite(),
                    Some(DType::F32) => {
                        dst[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
                        x.is_finite()
                    }
                    Some(DType::F16) => {
                        let y = half::f16::from_f32(x);
                        dst[2 * i..2 * i + 2].copy_from_slice(&y.to_le_bytes());
                        y.is_finite()
                    }
                    Some(DType::BF16) => {
                        let y = half::bf16::from_f32(x);
                        dst[2 * i..2 * i + 2].copy_from_slice(&y.to_le_bytes());
                        y.is_finite()
                    }
                };
                if !ok {
                    // The position in the stored tensor, which the error names (a served
                    // row may be another stored row: q and k un-permuted).
                    let at = job * ROWS * cols + i;
                    let (row, col) = (at / cols, at % cols);
                    let row = g.rows.get(row).copied().unwrap_or(row);
                    let held = match out {
                        Some(d @ (DType::F16 | DType::BF16)) if x.is_finite() => {
                            format!(", which {d:?} cannot hold")
                        }
                        _ => String::new(),
                    };
                    return Some(format!(
                        "element [{row}, {col}] dequantizes to {x}{held}; the file is corrupt"
                    ));
                }
            }
            None
        };
        let src = rows.bytes.par_chunks(ROWS * row_bytes);
        let bad = if size == 0 {
            // Nothing to write: every job gets an empty destination.
            src.map(|c| (&mut [][..], c))
                .enumerate()
                .map(job)
                .find_first(Option::is_some)
        } else {
            bytes
                .par_chunks_mut(ROWS * cols * size)
                .zip(src)
                .enumerate()
                .map(job)
                .find_first(Option::is_some)
        };
        match bad.flatten() {
            Some(why) => Err(self.ggml_fault(g, why)),
            None => Ok(bytes),
        }
    }

    /// For a GGUF file whose norm weights llama.cpp's converter stored with 1 added
    /// ([`crate::gguf::norms_shifted`]: Gemma 3), serves each `*norm.weight` from a copy of
    /// the stored value less 1, in its dtype (exact for stored values of at least 0.5, which
    /// `1 + w` with `w >= -0.5` gives), so that the model's `norm_offset + w` is the stored
    /// value again.
    ///
    /// # Errors
    /// As [`WeightSource::get`].
    fn unshift_gguf_norms(&mut self) -> Result<(), ModelError> {
        if !self.gguf_norms_shifted {
            return Ok(());
        }
        let names: Vec<String> = self
            .names
            .keys()
            .filter(|n| n.ends_with("norm.weight"))
            .cloned()
            .collect();
        let mut done = Vec::new();
        for name in names {
            let t = self.get(&name)?;
            let values = t.to_f32().data;
            let bytes: Vec<u8> = match t.dtype {
                DType::F32 => values
                    .iter()
                    .flat_map(|x| (x - 1.0).to_le_bytes())
                    .collect(),
                DType::F16 => values
                    .iter()
                    .flat_map(|x| half::f16::from_f32(x - 1.0).to_le_bytes())
                    .collect(),
                DType::BF16 => values
                    .iter()
                    .flat_map(|x| half::bf16::from_f32(x - 1.0).to_le_bytes())
                    .collect(),
            };
            let copy = CopiedTensor::of(&t, bytes);
            done.push((name, copy));
        }
        self.copies.extend(done);
        Ok(())
    }

    /// For a GGUF file of an architecture whose q and k rows llama.cpp permuted
    /// ([`crate::gguf::permuted_qk`]), serves each layer's q and k from a copy in Hugging
    /// Face's layout. `convert_hf_to_gguf.py`'s `permute` stores, within each head of `d`
    /// rows, row `2i + j` from Hugging Face's row `j·d/2 + i` (`i < d/2`, `j ∈ {0, 1}`);
    /// the copy puts it back (a quantized q or k is served from its stored rows in that
    /// order, [`GgmlServed`]).
    ///
    /// # Errors
    /// As [`WeightSource::get`] for a tensor of an unsupported dtype.
    fn unpermute_gguf_qk(&mut self, cfg: &ModelConfig) -> Result<(), ModelError> {
        if !self.gguf_permuted_qk {
            return Ok(());
        }
        let d = cfg.head_dim;
        let mut done = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            for (part, heads) in [
                ("q_proj", cfg.num_attention_heads),
                ("k_proj", cfg.num_key_value_heads),
            ] {
                let name = format!("model.layers.{i}.self_attn.{part}.weight");
                if !self.contains(&name) {
                    continue;
                }
                if let Some(g) = self.ggml.get_mut(&name) {
                    // Quantized: the same reorder, of the rows it serves.
                    if g.shape.first() == Some(&(heads * d)) && d.is_multiple_of(2) {
                        let stored = g.rows.clone();
                        for h in 0..heads {
                            for i in 0..d / 2 {
                                for j in 0..2 {
                                    g.rows[h * d + j * d / 2 + i] = stored[h * d + 2 * i + j];
                                }
                            }
                        }
                    }
                    continue;
                }
                let t = self.get(&name)?;
                // A tensor of another shape is left to the load's own shape error.
                if t.shape.first() != Some(&(heads * d)) || !d.is_multiple_of(2) {
                    continue;
                }
                let row = t.bytes.len() / (heads * d);
                let mut bytes = vec![0u8; t.bytes.len()];
                for h in 0..heads {
                    for i in 0..d / 2 {
                        for j in 0..2 {
                            let from = h * d + 2 * i + j;
                            let to = h * d + j * d / 2 + i;
                            bytes[to * row..(to + 1) * row]
                                .copy_from_slice(&t.bytes[from * row..(from + 1) * row]);
                        }
                    }
                }
                let copy = CopiedTensor::of(&t, bytes);
                done.push((name, copy));
            }
        }
        self.copies.extend(done);
        Ok(())
    }

    /// With [`ModelConfig::fused_projections`], serves each part of a fused projection as a
    /// row range of the stored one ([`WeightSource::open_for`]).
    ///
    /// # Errors
    /// [`ModelError::FusedAndPart`].
    fn add_fused_views(&mut self, cfg: &ModelConfig) -> Result<(), ModelError> {
        let src = self;
        if cfg.fused_projections {
            let h = cfg.hidden_size;
            let q = cfg.num_attention_heads * cfg.head_dim;
            let kv = cfg.num_key_value_heads * cfg.head_dim;
            let im = cfg.intermediate_size;
            for i in 0..cfg.num_hidden_layers {
                let p = format!("model.layers.{i}.");
                let qkv = format!("{p}self_attn.qkv_proj.weight");
                let gate_up = format!("{p}mlp.gate_up_proj.weight");
                for (part, source, start, rows, fused_rows) in [
                    ("self_attn.q_proj.weight", &qkv, 0, q, q + 2 * kv),
                    ("self_attn.k_proj.weight", &qkv, q, kv, q + 2 * kv),
                    ("self_attn.v_proj.weight", &qkv, q + kv, kv, q + 2 * kv),
                    ("mlp.gate_proj.weight", &gate_up, 0, im, 2 * im),
                    ("mlp.up_proj.weight", &gate_up, im, im, 2 * im),
                ] {
                    let name = format!("{p}{part}");
                    // A checkpoint of unfused tensors keeps them; one with both is ambiguous.
                    if src.contains(&name) && src.contains(source) {
                        return Err(ModelError::FusedAndPart {
                            file: src.file_of(&name).display().to_string(),
                            part: name,
                            fused: source.clone(),
                        });
                    }
                    if !src.contains(&name) {
                        let view = RowView {
                            source: source.clone(),
                            start,
                            fused_rows,
                            shape: [rows, h],
                        };
                        src.views.insert(name, view);
                    }
                }
            }
        }
        Ok(())
    }

    /// With partial RoPE, replaces each layer's q and k rows (biases, norms) by a copy in the
    /// permuted head layout ([`WeightSource::open_for`]); a quantized GGUF q or k is served
    /// from its stored rows in that order ([`GgmlServed`]).
    fn permute_partial_rope(&mut self, cfg: &ModelConfig) {
        let src = self;
        if cfg.rotary_dim != cfg.head_dim {
            let perm = cfg.rope_head_permutation();
            let d = cfg.head_dim;
            for i in 0..cfg.num_hidden_layers {
                let p = format!("model.layers.{i}.");
                let mut parts = vec![
                    ("self_attn.q_proj.weight", cfg.num_attention_heads),
                    ("self_attn.k_proj.weight", cfg.num_key_value_heads),
                ];
                if cfg.qkv_bias {
                    parts.push(("self_attn.q_proj.bias", cfg.num_attention_heads));
                    parts.push(("self_attn.k_proj.bias", cfg.num_key_value_heads));
                }
                if cfg.qk_norm {
                    parts.push(("self_attn.q_norm.weight", 1));
                    parts.push(("self_attn.k_norm.weight", 1));
                }
                for (part, heads) in parts {
                    let name = format!("{p}{part}");
                    if let Some(g) = src.ggml.get_mut(&name) {
                        // Quantized: the same permutation, of the rows it serves.
                        if g.shape.first() == Some(&(heads * d)) {
                            let served = g.rows.clone();
                            for h in 0..heads {
                                for (to, &from) in perm.iter().enumerate() {
                                    g.rows[h * d + to] = served[h * d + from];
                                }
                            }
                        }
                        continue;
                    }
                    let Ok(t) = src.get(&name) else { continue };
                    if t.shape.first() != Some(&(heads * d)) {
                        continue;
                    }
                    let row = t.bytes.len() / (heads * d);
                    let mut bytes = Vec::with_capacity(t.bytes.len());
                    for h in 0..heads {
                        for &from in &perm {
                            let r = h * d + from;
                            bytes.extend_from_slice(&t.bytes[r * row..(r + 1) * row]);
                        }
                    }
                    let copy = CopiedTensor::of(&t, bytes);
                    src.copies.insert(name, copy);
                }
            }
        }
    }

    /// Names of all stored tensors, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// Whether a tensor is stored.
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// A stored tensor's dtype, shape and bytes, or a part of a fused one, or a permuted
    /// copy ([`WeightSource::open_for`]). A quantized GGUF tensor comes dequantized into the
    /// model's 16-bit dtype (`torch_dtype` bfloat16 or float16, else f32), a copy made on its
    /// first `get` and kept (`GgmlServed`).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] (naming the fused tensor for a part), or
    /// [`ModelError::UnsupportedDtype`] for anything other than F32/F16/BF16.
    pub fn get(&self, name: &str) -> Result<RawTensor<'_>, ModelError> {
        if let Some((key, t)) = self.copies.get_key_value(name) {
            return Ok(t.raw(key));
        }
        if let Some((key, g)) = self.ggml.get_key_value(name) {
            let t = match g.copy.get() {
                Some(t) => t,
                None => {
                    let t = self.ggml_copy(g)?;
                    g.copy.get_or_init(|| t)
                }
            };
            return Ok(t.raw(key));
        }
        if let Some((key, view)) = self.views.get_key_value(name) {
            let fused = self.get(&view.source)?;
            let whole = [view.fused_rows, view.shape[1]];
            if fused.shape != whole {
                return Err(ModelError::ShapeMismatch {
                    file: fused.file.display().to_string(),
                    tensor: view.source.clone(),
                    expected: whole.to_vec(),
                    found: fused.shape.to_vec(),
                });
            }
            let row = view.shape[1] * fused.dtype.size();
            return Ok(RawTensor {
                name: key,
                shape: &view.shape,
                bytes: &fused.bytes[view.start * row..(view.start + view.shape[0]) * row],
                ..fused
            });
        }
        let (key, shard, info, bytes) = self.stored(name)?;
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F8_E4M3 | Dtype::F8_E5M2 => {
                return Err(ModelError::Fp8 {
                    file: shard.path.display().to_string(),
                    tensor: name.to_string(),
                    reason: format!(
                    "stored as {:?}: float8 is read only as the `*.weight` of an FP8 checkpoint, \
                     with its scales, under config.json's `quantization_config` (quant_method \
                     \"fp8\" or \"compressed-tensors\")",
                    info.dtype
                ),
                })
            }
            other => {
                return Err(ModelError::UnsupportedDtype {
                    file: shard.path.display().to_string(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let n: usize = info.shape.iter().product();
        if bytes.len() != n * dtype.size() {
            return Err(ModelError::Safetensors {
                file: shard.path.display().to_string(),
                reason: format!(
                    "tensor `{name}` holds {} bytes, shape {:?} needs {}",
                    bytes.len(),
                    info.shape,
                    n * dtype.size()
                ),
            });
        }
        Ok(RawTensor {
            name: key,
            dtype,
            shape: &info.shape,
            bytes,
            file: &shard.path,
        })
    }

    /// A stored tensor's name as stored, shard, safetensors metadata and bytes, whatever its
    /// dtype (unchecked against the shape).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], or [`ModelError::Safetensors`] for data outside the file.
    #[allow(clippy::type_complexity)]
    fn stored(
        &self,
        name: &str,
    ) -> Result<(&str, &Shard, &safetensors::tensor::TensorInfo, &[u8]), ModelError> {
        let (key, &id) =
            self.names
                .get_key_value(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    file: self.origin.display().to_string(),
                    tensor: name.to_string(),
                })?;
        let shard = &self.shards[id];
        let info = shard
            .tensors
            .get(self.aliases.get(name).map_or(name, String::as_str))
            .ok_or_else(|| ModelError::MissingTensor {
                file: shard.path.display().to_string(),
                tensor: name.to_string(),
            })?;
        let start = 8 + shard.header_len + info.data_offsets.0;
        let end = 8 + shard.header_len + info.data_offsets.1;
        let bytes = shard
            .mmap
            .get(start..end)
            .ok_or_else(|| ModelError::Safetensors {
                file: shard.path.display().to_string(),
                reason: format!("tensor `{name}` data out of range"),
            })?;
        Ok((key, shard, info, bytes))
    }

    /// A stored tensor's dtype as safetensors names it (`"F32"`, `"I64"`, ...), shape and
    /// bytes, whatever the dtype: what [`crate::weights_fingerprint`] hashes, so that a tensor
    /// the model skips (a saved RoPE table in an integer dtype, say) does not stop it.
    ///
    /// # Errors
    /// As [`WeightSource::get`], less [`ModelError::UnsupportedDtype`].
    pub(crate) fn get_any_dtype(
        &self,
        name: &str,
    ) -> Result<(String, &[usize], &[u8]), ModelError> {
        let (_, _, info, bytes) = self.stored(name)?;
        Ok((format!("{:?}", info.dtype), &info.shape, bytes))
    }

    /// The file holding a stored tensor: its shard (the single file when not sharded), or the
    /// index file when `name` is not stored.
    pub(crate) fn file_of(&self, name: &str) -> &Path {
        self.names
            .get(name)
            .map_or(&self.origin, |&id| &self.shards[id].path)
    }

    /// A stored tensor after checking its shape.
    ///
    /// # Errors
    /// As [`WeightSource::get`], plus [`ModelError::ShapeMismatch`].
    pub fn get_shaped(&self, name: &str, expected: &[usize]) -> Result<RawTensor<'_>, ModelError> {
        self.check_shape(name, expected)?;
        self.get(name)
    }

    /// Checks that a tensor is stored (or served) with shape `expected`, reading no values
    /// (a quantized GGUF tensor is not dequantized).
    ///
    /// # Errors
    /// As [`WeightSource::get_shaped`].
    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<(), ModelError> {
        let (shape, file) = match self.ggml_served(name) {
            Some(g) => (g.shape.as_slice(), self.file_of(&g.source)),
            None => {
                let raw = self.get(name)?;
                (raw.shape, raw.file)
            }
        };
        if shape != expected {
            return Err(ModelError::ShapeMismatch {
                file: file.display().to_string(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                found: shape.to_vec(),
            });
        }
        Ok(())
    }

    /// Checks that every value of tensor `name` is finite (for 1-D tensors: norm weights,
    /// biases, RoPE factors; see [`ModelError::NonFinite`]).
    ///
    /// # Errors
    /// As [`WeightSource::get`], and [`ModelError::NonFinite`] naming the first bad value.
    fn check_finite(&self, name: &str) -> Result<(), ModelError> {
        let raw = self.get(name)?;
        let t = raw.to_f32();
        match t.data.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(index) => Err(ModelError::NonFinite {
                file: raw.file.display().to_string(),
                tensor: name.to_string(),
                index,
                value: t.data[index].to_string(),
            }),
        }
    }

    /// Loads a tensor as f32 after checking its shape. A quantized GGUF tensor is
    /// dequantized straight to f32 (ggml's values, [`GgmlType::dequantize`]), not through
    /// [`WeightSource::get`]'s 16-bit copy.
    ///
    /// # Errors
    /// As [`WeightSource::get_shaped`], and [`ModelError::Gguf`] for a quantized value that
    /// is NaN or infinite.
    pub fn load_f32(&self, name: &str, expected: &[usize]) -> Result<Tensor, ModelError> {
        self.check_shape(name, expected)?;
        if expected.len() == 1 {
            self.check_finite(name)?;
        }
        match self.ggml_served(name) {
            Some(g) => {
                let rows = self.ggml_rows(g)?;
                let bytes = self.dequantized(g, &rows, Some(DType::F32))?;
                let data = bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Ok(Tensor::new(expected.to_vec(), data))
            }
            None => Ok(self.get(name)?.to_f32()),
        }
    }

    /// [`WeightSource::load_f32`] for the CPU backend: a 2-D quantized GGUF tensor comes as
    /// its stored blocks ([`Tensor::is_ggml`]; `data` empty), rows in the served order, for
    /// a linear layer that dequantizes as it multiplies (every value checked once here, none
    /// kept); anything else as `load_f32`.
    ///
    /// # Errors
    /// As [`WeightSource::load_f32`].
    pub(crate) fn load_kept(&self, name: &str, expected: &[usize]) -> Result<Tensor, ModelError> {
        match self.ggml_served(name) {
            Some(g) if expected.len() == 2 => {
                self.check_shape(name, expected)?;
                let rows = self.ggml_rows(g)?;
                self.dequantized(g, &rows, None)?;
                Ok(Tensor {
                    shape: expected.to_vec(),
                    data: Vec::new(),
                    ggml: Some(rows),
                })
            }
            _ => self.load_f32(name, expected),
        }
    }

    /// A [`ModelError::Gguf`] about the tensor `g` serves, naming it in both terms.
    fn ggml_fault(&self, g: &GgmlServed, why: String) -> ModelError {
        let q = &self.gguf_quantized[&g.source];
        ModelError::Gguf {
            file: self.file_of(&g.source).display().to_string(),
            reason: format!(
                "tensor `{}` ({}, {}): {why}",
                q.gguf_name,
                g.source,
                q.ty.name()
            ),
        }
    }

    /// Fails with [`ModelError::ExtraLayers`] when `src` holds a layer index past `cfg`'s: the
    /// two describe different models, and the forward pass would run fewer layers than
    /// trained and produce fluent garbage.
    ///
    /// # Errors
    /// [`ModelError::ExtraLayers`].
    pub fn check_layer_count(&self, cfg: &ModelConfig) -> Result<(), ModelError> {
        let extra = self.tensor_names().find(|n| {
            n.strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i >= cfg.num_hidden_layers)
        });
        match extra {
            Some(tensor) => Err(ModelError::ExtraLayers {
                file: self.file_of(tensor).display().to_string(),
                tensor: tensor.to_owned(),
                layers: cfg.num_hidden_layers,
            }),
            None => Ok(()),
        }
    }

    /// Stored tensors that a model of `cfg` does not use and that are not known to be
    /// harmless ([`is_harmless_unused`], or an all-zero bias), sorted. Layers past `cfg`'s are
    /// included (see [`WeightSource::check_layer_count`]).
    pub fn unused_tensors(&self, cfg: &ModelConfig) -> Vec<&str> {
        let mut used: std::collections::HashSet<String> = (0..cfg.num_hidden_layers)
            .flat_map(|i| layer_tensor_shapes(cfg, i).into_iter().map(|(n, _)| n))
            .collect();
        used.extend(self.views.values().map(|v| v.source.clone()));
        used.insert("model.embed_tokens.weight".into());
        used.insert("model.norm.weight".into());
        if !cfg.tie_word_embeddings {
            used.insert("lm_head.weight".into());
        }
        self.tensor_names()
            .filter(|n| !used.contains(*n) && !is_harmless_unused(cfg, n))
            .filter(|n| !(n.ends_with(".bias") && self.is_all_zero(n)))
            .collect()
    }

    /// Whether a stored tensor of a supported dtype holds only zeros (`-0.0` included).
    fn is_all_zero(&self, name: &str) -> bool {
        self.get(name).is_ok_and(|t| {
            let sign = match t.dtype {
                DType::F32 => 0x8000_0000u32,
                DType::F16 | DType::BF16 => 0x8000,
            };
            match t.dtype {
                DType::F32 => t
                    .bytes
                    .chunks_exact(4)
                    .all(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & !sign == 0),
                DType::F16 | DType::BF16 => t
                    .bytes
                    .chunks_exact(2)
                    .all(|c| u32::from(u16::from_le_bytes([c[0], c[1]])) & !sign == 0),
            }
        })
    }

    /// Fails when the checkpoint's tensor names do not match a model of `cfg`: layers past
    /// `cfg`'s ([`ModelError::ExtraLayers`]), float8 tensors without a `quantization_config`
    /// ([`ModelError::Fp8`]), or any other tensor the model would not use
    /// ([`ModelError::UnusedTensors`], from [`WeightSource::unused_tensors`]): an
    /// architecture the loader does not handle would otherwise give wrong outputs silently.
    /// Both [`LlamaWeights::load`] and [`WeightSource::check_llama`] (the mapped load) start
    /// with it.
    ///
    /// # Errors
    /// [`ModelError::ExtraLayers`], [`ModelError::Fp8`], [`ModelError::UnusedTensors`].
    pub fn check_tensor_names(&self, cfg: &ModelConfig) -> Result<(), ModelError> {
        self.check_layer_count(cfg)?;
        if cfg.quantization.is_none() {
            // An FP8 checkpoint whose config lost its quantization_config: say that, not
            // that its scale tensors are unused.
            let float8 = |n: &&str| {
                self.stored(n).is_ok_and(|(_, _, info, _)| {
                    matches!(info.dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2)
                })
            };
            if let Some(n) = self.tensor_names().find(float8) {
                self.get(n)?;
            }
        }
        let unused = self.unused_tensors(cfg);
        if unused.is_empty() {
            return Ok(());
        }
        // The shard holding the first one named: where to look (a sharded checkpoint's index
        // only lists names).
        Err(ModelError::UnusedTensors {
            file: self.file_of(unused[0]).display().to_string(),
            model_type: cfg.model_type.clone(),
            count: unused.len(),
            tensors: unused
                .iter()
                .take(UNUSED_TENSORS_NAMED)
                .map(|n| (*n).to_owned())
                .collect(),
        })
    }

    /// Name of the tensor holding the LM head, `[vocab, hidden]`: `model.embed_tokens.weight`
    /// with tied embeddings (a stored `lm_head.weight` is then ignored, as vLLM skips it and
    /// transformers ties it to the embedding), else `lm_head.weight`.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] for an untied model without `lm_head.weight` (HF would
    /// leave it randomly initialised; we refuse instead).
    pub fn lm_head_name(&self, cfg: &ModelConfig) -> Result<&'static str, ModelError> {
        if cfg.tie_word_embeddings {
            Ok("model.embed_tokens.weight")
        } else if self.contains("lm_head.weight") {
            Ok("lm_head.weight")
        } else {
            Err(ModelError::MissingTensor {
                file: self.origin.display().to_string(),
                tensor: "lm_head.weight".into(),
            })
        }
    }

    /// Checks everything [`LlamaWeights::load`] checks (no extra layers or other unused
    /// tensors: [`WeightSource::check_tensor_names`]; every tensor present, of a supported
    /// dtype, with its shape) without converting anything: a device backend then reads each
    /// tensor from the map in its stored dtype.
    ///
    /// # Errors
    /// As [`LlamaWeights::load`].
    pub fn check_llama(&self, cfg: &ModelConfig) -> Result<(), ModelError> {
        // Shapes only: a quantized GGUF tensor is not dequantized here (the CPU backend keeps
        // its blocks; `get` would make and keep a 16-bit copy of each).
        self.check_tensor_names(cfg)?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        self.check_shape("model.embed_tokens.weight", &[v, h])?;
        for i in 0..cfg.num_hidden_layers {
            for (n, s) in layer_tensor_shapes(cfg, i) {
                self.check_shape(&n, &s)?;
                if s.len() == 1 {
                    self.check_finite(&n)?;
                }
            }
        }
        self.check_shape("model.norm.weight", &[h])?;
        self.check_finite("model.norm.weight")?;
        self.check_shape(self.lm_head_name(cfg)?, &[v, h])?;
        Ok(())
    }
}

/// How many unused tensors [`ModelError::UnusedTensors`] names (it counts them all).
pub const UNUSED_TENSORS_NAMED: usize = 5;

/// Substrings of checkpoint tensor names that carry nothing a model needs: RoPE tables some
/// training frameworks save (early ColossalAI, GPTQModel). vLLM's loaders skip the same
/// names.
pub const HARMLESS_UNUSED_TENSORS: &[&str] = &[
    "rotary_emb.inv_freq",
    "rotary_pos_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
];

/// Whether an unused stored tensor is known to be harmless for a model of `cfg`: one of
/// [`HARMLESS_UNUSED_TENSORS`], or `lm_head.weight` with tied embeddings (the embedding is
/// the head; vLLM skips `lm_head.*` then), or in an FP8 checkpoint
/// ([`ModelConfig::quantization`]) a scale tensor ([`FP8_SCALE_SUFFIXES`]: a weight's scales
/// are read with the weight, activation and KV-cache scales are not used).
pub fn is_harmless_unused(cfg: &ModelConfig, name: &str) -> bool {
    HARMLESS_UNUSED_TENSORS.iter().any(|s| name.contains(s))
        || (cfg.tie_word_embeddings && name == "lm_head.weight")
        || (cfg.quantization.is_some() && FP8_SCALE_SUFFIXES.iter().any(|s| name.ends_with(s)))
}

/// A model's weights as a backend takes them.
#[derive(Debug)]
pub enum ModelWeights {
    /// f32 tensors in host memory (dummy weights; what the CPU backend runs on).
    Host(LlamaWeights),
    /// Memory-mapped safetensors, checked by [`WeightSource::check_llama`]: a device backend
    /// converts each tensor straight from its stored dtype, so a bf16 checkpoint never exists
    /// as f32 in host memory (32 GB for an 8B model).
    Mapped(WeightSource),
}

impl From<LlamaWeights> for ModelWeights {
    fn from(w: LlamaWeights) -> Self {
        ModelWeights::Host(w)
    }
}

impl ModelWeights {
    /// The weights as f32 tensors (converting mapped ones: [`LlamaWeights::load`]).
    ///
    /// # Errors
    /// As [`LlamaWeights::load`].
    pub fn into_host(self, cfg: &ModelConfig) -> Result<LlamaWeights, ModelError> {
        match self {
            ModelWeights::Host(w) => Ok(w),
            ModelWeights::Mapped(src) => LlamaWeights::load(cfg, &src),
        }
    }
}

/// Expected HF names and shapes of every tensor of layer `i`, in [`LayerWeights::tensors`]
/// order: the nine Llama tensors (input norm, q, k, v, o, the norm before the MLP, gate, up,
/// down; in a mixture-of-experts layer only the first six), then `self_attn.{q,k,v}_proj.bias`
/// when [`ModelConfig::qkv_bias`], then `self_attn.{q,k}_norm.weight` when
/// [`ModelConfig::qk_norm`], then with [`ModelConfig::sandwich_norms`] (Gemma 3)
/// `post_attention_layernorm.weight` and `post_feedforward_layernorm.weight` (the norm before
/// the MLP then being `pre_feedforward_layernorm.weight`), then in a mixture-of-experts layer
/// ([`ModelConfig::layer_is_moe`]) the router, each expert's gate, up and down, and Qwen2-MoE's
/// shared expert (gate, up, down, its gate), named as [`crate::MoeNaming`] says.
pub fn layer_tensor_shapes(cfg: &ModelConfig, i: usize) -> Vec<(String, Vec<usize>)> {
    let h = cfg.hidden_size;
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let im = cfg.intermediate_size;
    let p = format!("model.layers.{i}.");
    let mut v = vec![
        (format!("{p}input_layernorm.weight"), vec![h]),
        (format!("{p}self_attn.q_proj.weight"), vec![q, h]),
        (format!("{p}self_attn.k_proj.weight"), vec![kv, h]),
        (format!("{p}self_attn.v_proj.weight"), vec![kv, h]),
        (format!("{p}self_attn.o_proj.weight"), vec![h, q]),
        if cfg.sandwich_norms {
            (format!("{p}pre_feedforward_layernorm.weight"), vec![h])
        } else {
            (format!("{p}post_attention_layernorm.weight"), vec![h])
        },
    ];
    let moe = cfg.moe.as_ref().filter(|_| cfg.layer_is_moe(i));
    if moe.is_none() {
        v.push((format!("{p}mlp.gate_proj.weight"), vec![im, h]));
        v.push((format!("{p}mlp.up_proj.weight"), vec![im, h]));
        v.push((format!("{p}mlp.down_proj.weight"), vec![h, im]));
    }
    if cfg.qkv_bias {
        v.push((format!("{p}self_attn.q_proj.bias"), vec![q]));
        v.push((format!("{p}self_attn.k_proj.bias"), vec![kv]));
        v.push((format!("{p}self_attn.v_proj.bias"), vec![kv]));
    }
    if cfg.qk_norm {
        v.push((format!("{p}self_attn.q_norm.weight"), vec![cfg.head_dim]));
        v.push((format!("{p}self_attn.k_norm.weight"), vec![cfg.head_dim]));
    }
    if cfg.sandwich_norms {
        v.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
        v.push((format!("{p}post_feedforward_layernorm.weight"), vec![h]));
    }
    if let Some(m) = moe {
        let e_im = m.intermediate_size;
        let (block, names) = match m.naming {
            MoeNaming::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            MoeNaming::Qwen => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        v.push((format!("{p}{block}.gate.weight"), vec![m.num_experts, h]));
        for e in 0..m.num_experts {
            let x = format!("{p}{block}.experts.{e}.");
            v.push((format!("{x}{}.weight", names[0]), vec![e_im, h]));
            v.push((format!("{x}{}.weight", names[1]), vec![e_im, h]));
            v.push((format!("{x}{}.weight", names[2]), vec![h, e_im]));
        }
        let s_im = m.shared_expert_intermediate_size;
        if s_im > 0 {
            let x = format!("{p}mlp.shared_expert.");
            v.push((format!("{x}gate_proj.weight"), vec![s_im, h]));
            v.push((format!("{x}up_proj.weight"), vec![s_im, h]));
            v.push((format!("{x}down_proj.weight"), vec![h, s_im]));
            v.push((format!("{p}mlp.shared_expert_gate.weight"), vec![1, h]));
        }
    }
    v
}

/// The empty dense gate, up and down projections of a mixture-of-experts layer
/// ([`LayerWeights::gate_proj`]).
fn no_dense_mlp(h: usize) -> [Tensor; 3] {
    [
        Tensor::full(&[0, h], 0.0),
        Tensor::full(&[0, h], 0.0),
        Tensor::full(&[h, 0], 0.0),
    ]
}

/// A mixture-of-experts layer's router, experts' (gate, up, down) and shared expert (gate, up,
/// down, its gate).
type MoeParts<T> = (T, Vec<[T; 3]>, Option<[T; 4]>);

/// A layer's [`layer_tensor_shapes`]-ordered values, split by role.
struct LayerParts<T> {
    /// Input norm, q, k, v, o, the norm before the MLP.
    core: [T; 6],
    /// The dense MLP's gate, up, down (`None` in a mixture-of-experts layer).
    mlp: Option<[T; 3]>,
    bias: (Option<T>, Option<T>, Option<T>),
    qk_norm: (Option<T>, Option<T>),
    out_norms: (Option<T>, Option<T>),
    moe: Option<MoeParts<T>>,
}

/// Splits [`layer_tensor_shapes`]-ordered values of layer `i` by role.
fn split_layer<T>(cfg: &ModelConfig, i: usize, v: Vec<T>) -> LayerParts<T> {
    let mut it = v.into_iter();
    let mut next = || it.next().expect("as many values as layer_tensor_shapes");
    let core: [T; 6] = std::array::from_fn(|_| next());
    let moe = cfg.moe.as_ref().filter(|_| cfg.layer_is_moe(i));
    let mlp = moe.is_none().then(|| std::array::from_fn(|_| next()));
    let bias = if cfg.qkv_bias {
        (Some(next()), Some(next()), Some(next()))
    } else {
        (None, None, None)
    };
    let qk_norm = if cfg.qk_norm {
        (Some(next()), Some(next()))
    } else {
        (None, None)
    };
    let out_norms = if cfg.sandwich_norms {
        (Some(next()), Some(next()))
    } else {
        (None, None)
    };
    let moe = moe.map(|m| {
        let router = next();
        let experts = (0..m.num_experts)
            .map(|_| std::array::from_fn(|_| next()))
            .collect();
        let shared =
            (m.shared_expert_intermediate_size > 0).then(|| std::array::from_fn(|_| next()));
        (router, experts, shared)
    });
    LayerParts {
        core,
        mlp,
        bias,
        qk_norm,
        out_norms,
        moe,
    }
}

impl LayerWeights {
    /// Layer `i`'s tensors from `src`, converted to f32 and checked against
    /// [`layer_tensor_shapes`]; with `keep_ggml` (the CPU backend), quantized GGUF matrices
    /// stay in their blocks ([`WeightSource::load_kept`]).
    ///
    /// # Errors
    /// As [`WeightSource::load_f32`] (missing, misshapen or unsupported tensors).
    pub(crate) fn load(
        cfg: &ModelConfig,
        src: &WeightSource,
        i: usize,
        keep_ggml: bool,
    ) -> Result<Self, ModelError> {
        let tensors = layer_tensor_shapes(cfg, i)
            .into_iter()
            .map(|(n, s)| match keep_ggml {
                true => src.load_kept(&n, &s),
                false => src.load_f32(&n, &s),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::from_ordered(cfg, i, tensors))
    }

    /// Layer `i` from its tensors in [`layer_tensor_shapes`] order.
    fn from_ordered(cfg: &ModelConfig, i: usize, tensors: Vec<Tensor>) -> Self {
        let h = cfg.hidden_size;
        let LayerParts {
            core: [ln1, q, k, v, o, ln2],
            mlp,
            bias: (qb, kb, vb),
            qk_norm: (qn, kn),
            out_norms: (an, mn),
            moe,
        } = split_layer(cfg, i, tensors);
        let [g, u, d] = mlp.unwrap_or_else(|| no_dense_mlp(h));
        LayerWeights {
            input_layernorm: ln1,
            q_proj: q,
            k_proj: k,
            v_proj: v,
            o_proj: o,
            post_attention_layernorm: ln2,
            gate_proj: g,
            up_proj: u,
            down_proj: d,
            q_bias: qb,
            k_bias: kb,
            v_bias: vb,
            q_norm: qn,
            k_norm: kn,
            attn_out_norm: an,
            mlp_out_norm: mn,
            moe: moe.map(|(router, experts, shared)| MoeWeights {
                router,
                experts,
                shared,
            }),
        }
    }
}

impl LlamaWeights {
    /// Loads and converts all weights from `src`, checking shapes against `cfg`.
    ///
    /// The LM head is `lm_head.weight`, or with tied embeddings a copy of
    /// `model.embed_tokens.weight` ([`WeightSource::lm_head_name`]).
    ///
    /// # Errors
    /// [`ModelError::ExtraLayers`] and [`ModelError::UnusedTensors`]
    /// ([`WeightSource::check_tensor_names`]), [`ModelError::MissingTensor`],
    /// [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`] naming the file and
    /// tensor.
    pub fn load(cfg: &ModelConfig, src: &WeightSource) -> Result<Self, ModelError> {
        src.check_tensor_names(cfg)?;
        let h = cfg.hidden_size;
        let v = cfg.vocab_size;
        let embed = src.load_f32("model.embed_tokens.weight", &[v, h])?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| LayerWeights::load(cfg, src, i, false))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = src.load_f32("model.norm.weight", &[h])?;
        let lm_head = match src.lm_head_name(cfg)? {
            "lm_head.weight" => src.load_f32("lm_head.weight", &[v, h])?,
            _ => embed.clone(),
        };
        Ok(LlamaWeights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Every value of every tensor replaced by `f(value)` (for example rounded to the 16-bit
    /// type another backend holds, so that a CPU reference runs on the same weights).
    pub fn map_values(&mut self, f: impl Fn(f32) -> f32) {
        let mut tensors = vec![&mut self.embed, &mut self.norm, &mut self.lm_head];
        for l in &mut self.layers {
            tensors.extend(l.tensors_mut());
        }
        for t in tensors {
            t.data.iter_mut().for_each(|x| *x = f(*x));
        }
    }

    /// Deterministic random weights for `cfg` (for `load_format = dummy` and benchmarks).
    ///
    /// Linear and embedding weights are uniform in `[-0.02·√3, 0.02·√3]` (standard deviation
    /// 0.02, HF's `initializer_range`), norm weights are 1.0. The same `seed` gives the same
    /// weights on every run and platform, whatever the thread count: each tensor is filled in
    /// chunks of [`DUMMY_CHUNK`] values, each chunk from its own xorshift64* stream keyed by
    /// (seed, tensor, chunk), the chunks in parallel (an 8B model is 8e9 values; filled in one
    /// stream it took most of a minute). A tensor's values do not depend on its size beyond
    /// its own prefix. A tied config gets `lm_head == embed`. Qwen2's q/k/v biases are uniform
    /// in `[-0.1, 0.1]` and Qwen3's q/k norm weights uniform in `[0.5, 1.5]` (HF initializes
    /// those to 0 and 1; random values make a backend that mixes up heads or skips them
    /// differ from the reference). They are drawn after each layer's nine Llama tensors, so
    /// a Llama config's values are unchanged. A mixture-of-experts layer draws its router
    /// uniform in `[-0.5, 0.5]` (so that tokens pick clearly different experts) and its
    /// experts as linear weights, after the rest of the layer.
    pub fn dummy(cfg: &ModelConfig, seed: u64) -> Self {
        let h = cfg.hidden_size;
        let mut tensor_id = 0u64;
        let mut rand = |shape: &[usize], a: f32| {
            let n: usize = shape.iter().product();
            tensor_id += 1;
            Tensor::new(shape.to_vec(), uniform_chunked(seed, tensor_id, n, a))
        };
        let embed = rand(&[cfg.vocab_size, h], 0.02 * 3f32.sqrt());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let LayerParts {
                core: [ln1, q, k, v, o, ln2],
                mlp,
                bias: (qb, kb, vb),
                qk_norm: (qn, kn),
                out_norms: (an, mn),
                moe,
            } = split_layer(cfg, i, layer_tensor_shapes(cfg, i));
            let a = 0.02 * 3f32.sqrt();
            let (input_layernorm, q_proj, k_proj, v_proj, o_proj) = (
                Tensor::full(&ln1.1, 1.0),
                rand(&q.1, a),
                rand(&k.1, a),
                rand(&v.1, a),
                rand(&o.1, a),
            );
            let [gate_proj, up_proj, down_proj] = match mlp {
                Some([g, u, d]) => [rand(&g.1, a), rand(&u.1, a), rand(&d.1, a)],
                None => no_dense_mlp(h),
            };
            let mut layer = LayerWeights {
                input_layernorm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                post_attention_layernorm: Tensor::full(&ln2.1, 1.0),
                gate_proj,
                up_proj,
                down_proj,
                q_bias: None,
                k_bias: None,
                v_bias: None,
                q_norm: None,
                k_norm: None,
                attn_out_norm: None,
                mlp_out_norm: None,
                moe: None,
            };
            layer.q_bias = qb.map(|t| rand(&t.1, 0.1));
            layer.k_bias = kb.map(|t| rand(&t.1, 0.1));
            layer.v_bias = vb.map(|t| rand(&t.1, 0.1));
            let around_one = |mut t: Tensor| {
                t.data.iter_mut().for_each(|x| *x += 1.0);
                t
            };
            layer.q_norm = qn.map(|t| around_one(rand(&t.1, 0.5)));
            layer.k_norm = kn.map(|t| around_one(rand(&t.1, 0.5)));
            if cfg.norm_offset != 0.0 {
                // Gemma: every norm weight is stored around 0 (used as 1 + w); random ones
                // (drawn after the rest, so Llama's values are unchanged).
                for t in [
                    &mut layer.input_layernorm,
                    &mut layer.post_attention_layernorm,
                ]
                .into_iter()
                .chain(layer.q_norm.as_mut())
                .chain(layer.k_norm.as_mut())
                {
                    let shape = t.shape.clone();
                    *t = rand(&shape, 0.5);
                }
            }
            layer.attn_out_norm = an.map(|t| rand(&t.1, 0.5));
            layer.mlp_out_norm = mn.map(|t| rand(&t.1, 0.5));
            layer.moe = moe.map(|(router, experts, shared)| MoeWeights {
                router: rand(&router.1, 0.5),
                experts: experts
                    .into_iter()
                    .map(|e| e.map(|t| rand(&t.1, a)))
                    .collect(),
                shared: shared.map(|s| s.map(|t| rand(&t.1, a))),
            });
            layers.push(layer);
        }
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            rand(&[cfg.vocab_size, h], 0.02 * 3f32.sqrt())
        };
        let norm = if cfg.norm_offset != 0.0 {
            rand(&[h], 0.5)
        } else {
            Tensor::full(&[h], 1.0)
        };
        LlamaWeights {
            embed,
            layers,
            norm,
            lm_head,
        }
    }
}

/// Values per independently seeded chunk of a dummy tensor ([`LlamaWeights::dummy`]).
pub const DUMMY_CHUNK: usize = 1 << 20;

/// `n` values uniform in `[-a, a)`: chunk `c` of [`DUMMY_CHUNK`] values from the stream keyed
/// by `(seed, tensor, c)`, the chunks filled in parallel.
fn uniform_chunked(seed: u64, tensor: u64, n: usize, a: f32) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(DUMMY_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let key = splitmix64(splitmix64(seed ^ splitmix64(tensor)) ^ c as u64);
            XorShift::new(key).fill_uniform(chunk, a);
        });
    out
}

/// splitmix64's output function (Steele, Lea and Flood 2014): a bijective 64-bit mix.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xorshift64* (Vigna 2016): tiny, fast, deterministic across platforms.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        // splitmix64 of the seed so that seed 0 and nearby seeds give unrelated streams.
        let z = splitmix64(seed);
        XorShift(if z == 0 { 1 } else { z })
    }

    #[inline]
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Fills `out` with values uniform in `[-a, a)`, two per 64-bit draw (23 random mantissa
    /// bits each, via the `1.0 + mantissa` bit trick).
    fn fill_uniform(&mut self, out: &mut [f32], a: f32) {
        let scale = 2.0 * a;
        let mut pairs = out.chunks_exact_mut(2);
        for p in &mut pairs {
            let r = self.next();
            p[0] = (f32::from_bits(0x3F80_0000 | (r >> 41) as u32) - 1.5) * scale;
            p[1] = (f32::from_bits(0x3F80_0000 | ((r >> 9) as u32 & 0x7F_FFFF)) - 1.5) * scale;
        }
        if let [last] = pairs.into_remainder() {
            let r = self.next();
            *last = (f32::from_bits(0x3F80_0000 | (r >> 41) as u32) - 1.5) * scale;
        }
    }
}
