//! GGUF, llama.cpp's model file: the container (header, metadata, tensor directory), read
//! from a memory map.
//!
//! Layout (little-endian; versions 2 and 3, <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>):
//! the magic `GGUF`, a `u32` version, `u64` tensor and metadata counts, the metadata as
//! (string key, `u32` value type, value) triples, one directory entry per tensor (string name,
//! `u32` dimension count, that many `u64` dimensions innermost first, `u32` ggml type, `u64`
//! offset into the data section), then the data section, aligned to `general.alignment`
//! (default 32) bytes. Strings are a `u64` byte length and UTF-8 bytes; arrays a `u32` element
//! type, a `u64` length and the elements.
//!
//! Every length is checked against the bytes left before anything is allocated, so a
//! truncated or corrupt file is a [`ModelError::Gguf`] naming what is wrong, never a panic or
//! a huge allocation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::ModelError;

/// The first four bytes of a GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// The data section's alignment when `general.alignment` is absent (bytes).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7 (a byte, 0 or 1).
    Bool(bool),
    /// Type 8.
    Str(String),
    /// Type 9: elements of one type.
    Array(Vec<GgufValue>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl GgufValue {
    /// An integer value of any width, as `i128` (none for floats, strings, arrays, booleans).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A float or integer value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_int().map(|i| i as f64),
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An array value's elements.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A boolean value (also an integer 0 or 1, as some converters write flags).
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            GgufValue::Bool(b) => Some(*b),
            v => match v.as_int() {
                Some(0) => Some(false),
                Some(1) => Some(true),
                _ => None,
            },
        }
    }

    /// The type's name in the GGUF specification, for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::F32(_) => "float32",
            GgufValue::Bool(_) => "bool",
            GgufValue::Str(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F64(_) => "float64",
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// llama.cpp's tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (ggml's `ne`): a `[rows, cols]` matrix is `[cols, rows]`.
    pub dims: Vec<u64>,
    /// The ggml type id ([`crate::gguf_quant::GgmlType`]).
    pub ggml_type: u32,
    /// Byte offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The shape in row-major order, outermost first (safetensors' and PyTorch's order).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements (`None` on overflow).
    pub fn elements(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }
}

/// A GGUF file: its metadata and tensor directory, and the mapped bytes.
pub struct GgufFile {
    /// The file.
    pub path: PathBuf,
    /// The format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// The tensor directory in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Absolute byte offset of the data section.
    pub data_start: usize,
    mmap: Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked little-endian reader over the header.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "truncated: {what} at byte {} needs {n} bytes, {} left",
                    self.at,
                    self.bytes.len().saturating_sub(self.at)
                )
            })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.left())
            .ok_or_else(|| {
                format!(
                    "{what} at byte {} claims {n} bytes, the file has {} left",
                    self.at - 8,
                    self.left()
                )
            })?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<GgufValue, String> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("{what}: bool byte {b} is neither 0 nor 1")),
            },
            8 => GgufValue::Str(self.string(what)?),
            9 => {
                if depth > 0 {
                    // The specification allows nested arrays; no key llama.cpp writes uses
                    // them, and unbounded nesting is a stack risk.
                    return Err(format!("{what}: arrays nested in arrays are not read"));
                }
                let ety = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count past the bytes left is
                // corrupt, and checking it first bounds the allocation.
                if n > self.left() as u64 {
                    return Err(format!(
                        "{what}: array of {n} elements, the file has {} bytes left",
                        self.left()
                    ));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, what, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(format!("{what}: unknown value type {t}")),
        })
    }
}

/// Parses a GGUF header (everything before the data section) from `bytes`, the whole file.
/// Returns the version, metadata, tensor directory and the data section's offset.
///
/// # Errors
/// A message naming the first fault: not GGUF, a version other than 2 or 3 (version 1 used
/// 32-bit lengths; a big-endian file reads as a huge version), truncation, a length past the
/// file, an unknown value type, a duplicate key or tensor name, a bad `general.alignment`, a
/// tensor of more than 4 dimensions or whose offset is not aligned.
#[allow(clippy::type_complexity)]
pub fn parse_header(
    bytes: &[u8],
) -> Result<(u32, BTreeMap<String, GgufValue>, Vec<GgufTensorInfo>, usize), String> {
    let mut r = Reader { bytes, at: 0 };
    if r.take(4, "the magic").ok() != Some(&GGUF_MAGIC[..]) {
        return Err("not a GGUF file (it does not start with `GGUF`)".into());
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(if version.swap_bytes() <= 3 {
            format!(
                "a big-endian GGUF file (version {}); only little-endian files are read",
                version.swap_bytes()
            )
        } else {
            format!("version {version}; versions 2 and 3 are read")
        });
    }
    let n_tensors = r.u64("the tensor count")?;
    let n_kv = r.u64("the metadata count")?;
    // A metadata entry takes at least 13 bytes, a tensor entry at least 24.
    if n_kv > (r.left() / 13) as u64 || n_tensors > (r.left() / 24) as u64 {
        return Err(format!(
            "claims {n_kv} metadata entries and {n_tensors} tensors, more than the file's \
             {} bytes can hold: truncated or corrupt",
            bytes.len()
        ));
    }
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key {i}"))?;
        let ty = r.u32(&format!("the type of `{key}`"))?;
        let value = r.value(ty, &format!("metadata `{key}`"), 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("metadata key `{key}` appears twice"));
        }
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = r.string(&format!("tensor name {i}"))?;
        let n_dims = r.u32(&format!("tensor `{name}`'s dimension count"))?;
        if n_dims > 4 {
            return Err(format!(
                "tensor `{name}` has {n_dims} dimensions; ggml tensors have at most 4"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64(&format!("tensor `{name}`'s dimensions"))?);
        }
        let ggml_type = r.u32(&format!("tensor `{name}`'s type"))?;
        let offset = r.u64(&format!("tensor `{name}`'s offset"))?;
        if !seen.insert(name.clone()) {
            return Err(format!("tensor `{name}` appears twice"));
        }
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_int() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 20 => a as u64,
            _ => {
                return Err(format!(
                    "`general.alignment` is {v:?}; it must be a power of two from 1 to 1 MiB"
                ))
            }
        },
    };
    let data_start = (r.at as u64).div_ceil(alignment) * alignment;
    for t in &tensors {
        if t.offset % alignment != 0 {
            return Err(format!(
                "tensor `{}`'s offset {} is not a multiple of the alignment {alignment}",
                t.name, t.offset
            ));
        }
    }
    Ok((version, metadata, tensors, data_start as usize))
}

impl GgufFile {
    /// Maps and parses `path`.
    ///
    /// # Errors
    /// [`ModelError::Io`] if it cannot be read; [`ModelError::Gguf`] as [`parse_header`], or
    /// for a tensor whose data (per [`crate::gguf_quant::GgmlType::row_bytes`]) lies past the
    /// end of the file or whose type is unknown, and for two tensors whose data overlap.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, &e))?;
        // SAFETY: the mapping is read-only and private to this process; model files are not
        // expected to change while loaded (the assumption llama.cpp's loader makes too). All
        // accesses are bounds-checked slices of the map.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, &e))?;
        let fault = |reason: String| ModelError::Gguf {
            file: path.display().to_string(),
            reason,
        };
        let (version, metadata, tensors, data_start) = parse_header(&mmap).map_err(fault)?;
        let f = GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data_start,
            mmap,
        };
        // Each tensor's data must be its own: a corrupt offset pointing into another
        // tensor's data would otherwise load silently as wrong weights. (llama.cpp requires
        // each offset to be the padded end of the tensor before it; any order is read here.)
        let mut spans = Vec::with_capacity(f.tensors.len());
        for t in &f.tensors {
            let len = f.tensor_bytes(t)?.len() as u64;
            if len > 0 {
                spans.push((t.offset, t.offset + len, &t.name));
            }
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            let ((a0, a1, a), (b0, b1, b)) = (w[0], w[1]);
            return Err(fault(format!(
                "the data of tensors `{a}` (bytes {a0}..{a1} of the data section) and `{b}` \
                 (bytes {b0}..{b1}) overlap; the file is corrupt"
            )));
        }
        Ok(f)
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A tensor's directory entry by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor's data: its element count in its ggml type's blocks.
    ///
    /// # Errors
    /// [`ModelError::Gguf`] for an unknown type, a row length that is not a whole number of
    /// the type's blocks, or data past the end of the file.
    pub fn tensor_bytes(&self, t: &GgufTensorInfo) -> Result<&[u8], ModelError> {
        let fault = |reason: String| ModelError::Gguf {
            file: self.path.display().to_string(),
            reason: format!("tensor `{}`: {reason}", t.name),
        };
        let ty = crate::gguf_quant::GgmlType::from_u32(t.ggml_type).ok_or_else(|| {
            let what = match crate::gguf_quant::GgmlType::name_of(t.ggml_type) {
                Some(n) => format!("type {n} (ggml type {}) is not read", t.ggml_type),
                None => format!("unknown ggml type {}", t.ggml_type),
            };
            fault(format!(
                "{what}; the types read are {} (requantize the file to one of them with \
                 llama-quantize, or serve the Hugging Face checkpoint)",
                crate::gguf_quant::GgmlType::names()
            ))
        })?;
        let cols = t.dims.first().copied().unwrap_or(1);
        let rows = t
            .dims
            .iter()
            .skip(1)
            .try_fold(1u64, |a, &d| a.checked_mul(d));
        let row_bytes = usize::try_from(cols)
            .ok()
            .and_then(|c| ty.row_bytes(c))
            .ok_or_else(|| {
                fault(format!(
                    "{cols} elements per row is not a whole number of {ty:?} blocks of {}",
                    ty.block_size()
                ))
            })?;
        let start = (self.data_start as u64).checked_add(t.offset);
        let len = rows.and_then(|r| r.checked_mul(row_bytes as u64));
        let end = start.zip(len).and_then(|(s, l)| s.checked_add(l));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.mmap.len() as u64 => {
                Ok(&self.mmap[s as usize..e as usize])
            }
            _ => Err(fault(format!(
                "its data ({} at offset {} of the data section at byte {}) lies past the end \
                 of the file ({} bytes); the file is truncated or corrupt",
                len.map_or_else(
                    || "an impossible number of bytes".into(),
                    |l| format!("{l} bytes")
                ),
                t.offset,
                self.data_start,
                self.mmap.len()
            ))),
        }
    }
}

impl GgufFile {
    /// The mapped file, for a [`crate::WeightSource`] to serve tensors from.
    pub(crate) fn into_mmap(self) -> Mmap {
        self.mmap
    }

    fn fault(&self, reason: impl Into<String>) -> ModelError {
        ModelError::Gguf {
            file: self.path.display().to_string(),
            reason: reason.into(),
        }
    }

    /// `general.architecture`.
    ///
    /// # Errors
    /// [`ModelError::Gguf`] when it is missing or not a string.
    pub fn architecture(&self) -> Result<&str, ModelError> {
        self.get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| self.fault("no `general.architecture` string"))
    }

    /// A metadata integer `{arch}.{key}` as `usize`; `None` when absent.
    fn arch_usize(&self, arch: &str, key: &str) -> Result<Option<usize>, ModelError> {
        let k = format!("{arch}.{key}");
        match self.get(&k) {
            None => Ok(None),
            Some(GgufValue::Array(_)) => Err(self.fault(format!(
                "`{k}` is a per-layer array; models whose layers differ in shape are not read"
            ))),
            Some(v) => match v.as_int() {
                Some(i) if i >= 0 && i <= usize::MAX as i128 => Ok(Some(i as usize)),
                _ => Err(self.fault(format!("`{k}` is {v:?}; expected a non-negative integer"))),
            },
        }
    }

    fn arch_f64(&self, arch: &str, key: &str) -> Result<Option<f64>, ModelError> {
        let k = format!("{arch}.{key}");
        match self.get(&k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| self.fault(format!("`{k}` is {v:?}; expected a finite number"))),
        }
    }
}

/// The GGUF architectures read, with the Hugging Face `model_type` and architecture each
/// becomes, and whether llama.cpp's converter permuted the q and k rows for its interleaved
/// RoPE (`LlamaModel.permute` in `convert_hf_to_gguf.py`; Qwen's and Phi-3's use NeoX-style
/// RoPE, unpermuted).
const ARCHS: [(&str, &str, &str, bool); 7] = [
    ("llama", "llama", "LlamaForCausalLM", true),
    ("gemma3", "gemma3_text", "Gemma3ForCausalLM", false),
    ("qwen2", "qwen2", "Qwen2ForCausalLM", false),
    ("qwen3", "qwen3", "Qwen3ForCausalLM", false),
    ("phi3", "phi3", "Phi3ForCausalLM", false),
    ("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", false),
    ("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", false),
];

/// Whether the q and k rows of a GGUF model of architecture `arch` are stored permuted for
/// interleaved RoPE (and must be un-permuted into Hugging Face's rotate-half layout).
pub fn permuted_qk(arch: &str) -> bool {
    ARCHS.iter().any(|a| a.0 == arch && a.3)
}

/// Whether the norm weights of a GGUF model of architecture `arch` are stored with 1 added:
/// Gemma's RMSNorm scales by `1 + w`, and `convert_hf_to_gguf.py`'s `Gemma3Model` stores
/// `w + 1` (in f32) so that llama.cpp's plain RMSNorm applies; Baton serves `w` (the stored
/// value less 1, exact for stored values of at least 0.5) under Hugging Face's convention.
pub fn norms_shifted(arch: &str) -> bool {
    arch == "gemma3"
}

/// The architecture that names a GGUF file's tensors: `general.architecture`, except
/// `mixtral` for a `llama` file with experts (`llama.expert_count` > 0: llama.cpp converts
/// Mixtral as `llama`, its experts under Mixtral's names).
///
/// # Errors
/// As [`GgufFile::architecture`]; [`ModelError::Gguf`] for a malformed expert count.
pub fn naming_arch(g: &GgufFile) -> Result<&str, ModelError> {
    let arch = g.architecture()?;
    Ok(
        if arch == "llama" && g.arch_usize(arch, "expert_count")?.unwrap_or(0) > 0 {
            "mixtral"
        } else {
            arch
        },
    )
}

/// The Hugging Face name of a GGUF tensor of a model of architecture `arch` (llama.cpp's
/// `gguf-py/gguf/tensor_mapping.py`, read backwards), `None` for the tensors [`hf_config`]
/// reads into config.json (`rope_freqs.weight`, Phi-3's `rope_factors_long.weight` and
/// `rope_factors_short.weight`), for a layer's merged experts (served per expert, see
/// [`merged_experts`]; `arch` as [`naming_arch`] gives it) and for a fused q/k/v projection
/// outside Phi-3 (served per part, [`fused_qkv`]). Phi-3's `attn_qkv` and `ffn_up`
/// are its fused `qkv_proj` and `gate_up_proj` (gate rows first, as `Phi3MLP` and llama.cpp's
/// `LLM_ARCH_PHI3` split them). Gemma 3's four norms a layer are `attn_norm`,
/// `post_attention_norm`, `ffn_norm` (its `pre_feedforward_layernorm`) and `post_ffw_norm`.
/// Mixtral's router and experts are `block_sparse_moe.gate` and
/// `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down), also from the per-expert
/// tensors of files converted before llama.cpp stacked them (`blk.{i}.ffn_gate.{e}.weight`).
/// Names without a counterpart are returned unchanged, for the unused-tensor check to name.
pub fn hf_tensor_name(arch: &str, name: &str) -> Option<String> {
    let global = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        "rope_freqs.weight" | "rope_factors_long.weight" | "rope_factors_short.weight" => {
            return None
        }
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.into());
    }
    if merged_experts(arch, name).is_some() || fused_qkv(arch, name).is_some() {
        return None;
    }
    let mapped = name.strip_prefix("blk.").and_then(|rest| {
        let (layer, part) = rest.split_once('.')?;
        layer.parse::<usize>().ok()?;
        let (stem, suffix) = part.rsplit_once('.')?;
        if arch == "mixtral" {
            if stem == "ffn_gate_inp" {
                return Some(format!(
                    "model.layers.{layer}.block_sparse_moe.gate.{suffix}"
                ));
            }
            if let Some((proj, e)) = stem.split_once('.') {
                let e: usize = e.parse().ok()?;
                let w = mixtral_part(proj)?;
                return Some(format!(
                    "model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.{suffix}"
                ));
            }
        }
        let hf = match stem {
            "attn_norm" => "input_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_qkv" => "self_attn.qkv_proj",
            "attn_output" => "self_attn.o_proj",
            "attn_q_norm" => "self_attn.q_norm",
            "attn_k_norm" => "self_attn.k_norm",
            "ffn_norm" if arch == "gemma3" => "pre_feedforward_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "post_attention_norm" if arch == "gemma3" => "post_attention_layernorm",
            "post_ffw_norm" if arch == "gemma3" => "post_feedforward_layernorm",
            "ffn_gate" => "mlp.gate_proj",
            "ffn_up" if arch == "phi3" => "mlp.gate_up_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            "ffn_gate_inp" => "mlp.gate",
            "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
            "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
            "ffn_up_shexp" => "mlp.shared_expert.up_proj",
            "ffn_down_shexp" => "mlp.shared_expert.down_proj",
            _ => return None,
        };
        Some(format!("model.layers.{layer}.{hf}.{suffix}"))
    });
    Some(mapped.unwrap_or_else(|| name.to_string()))
}

/// For a fused attention projection (`blk.{i}.attn_qkv.weight` or `.bias`, as
/// `convert_hf_to_gguf.py --fuse-qkv` writes it: q rows, then k, then v) of an architecture
/// other than `phi3` (whose fused projection is read as `qkv_proj`, [`hf_tensor_name`]), the
/// Hugging Face names of its three parts (`self_attn.{q,k,v}_proj`), which
/// [`crate::WeightSource::open_gguf`] serves as row ranges of it ([`fused_qkv_rows`]).
pub fn fused_qkv(arch: &str, name: &str) -> Option<[String; 3]> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let suffix = part.strip_prefix("attn_qkv.")?;
    if arch == "phi3" || suffix.contains('.') {
        return None;
    }
    Some(["q", "k", "v"].map(|p| format!("model.layers.{layer}.self_attn.{p}_proj.{suffix}")))
}

/// The q, k and v rows of a fused attention projection ([`fused_qkv`]): heads x head size,
/// then twice KV heads x head size, from the file's metadata (as [`hf_config`] reads it).
///
/// # Errors
/// [`ModelError::Gguf`] for a malformed count, or a file of a permuted architecture
/// ([`permuted_qk`]) that stores one (the order of llama.cpp's permutation and fusion is not
/// pinned down, so it is refused rather than guessed).
pub fn fused_qkv_rows(g: &GgufFile) -> Result<Option<[usize; 3]>, ModelError> {
    let arch = g.architecture()?;
    if !g.tensors.iter().any(|t| fused_qkv(arch, &t.name).is_some()) {
        return Ok(None);
    }
    if permuted_qk(arch) {
        return Err(g.fault(format!(
            "fused `attn_qkv` tensors in a {arch} file are not read (convert without \
             --fuse-qkv)"
        )));
    }
    let (Some(hidden), Some(heads)) = (
        g.arch_usize(arch, "embedding_length")?,
        g.arch_usize(arch, "attention.head_count")?
            .filter(|&h| h > 0),
    ) else {
        return Ok(None);
    };
    let kv_heads = g
        .arch_usize(arch, "attention.head_count_kv")?
        .unwrap_or(heads);
    let d = g
        .arch_usize(arch, "attention.key_length")?
        .unwrap_or(hidden / heads);
    Ok(Some([heads * d, kv_heads * d, kv_heads * d]))
}

/// Mixtral's name of an expert's `ffn_gate`, `ffn_up` or `ffn_down` part (`w1`, `w3`, `w2`).
fn mixtral_part(proj: &str) -> Option<&'static str> {
    Some(match proj {
        "ffn_gate" => "w1",
        "ffn_up" => "w3",
        "ffn_down" => "w2",
        _ => return None,
    })
}

/// For a tensor holding every expert of a mixture-of-experts layer
/// (`blk.{i}.ffn_{gate,up,down}_exps.weight`: `convert_hf_to_gguf.py`'s `Qwen2MoeModel` and
/// `LlamaModel` stack the experts' matrices, row-major `[experts, rows, cols]`), the layer and
/// the Hugging Face name of expert `e`'s part: `model.layers.{i}.mlp.experts.{e}.{gate,up,
/// down}_proj.weight`, or for `mixtral` ([`naming_arch`])
/// `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`. Each expert's part is
/// one contiguous slice of the tensor.
pub fn merged_experts(arch: &str, name: &str) -> Option<(usize, impl Fn(usize) -> String)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let proj = part.strip_suffix("_exps.weight")?;
    let (block, hf) = if arch == "mixtral" {
        ("block_sparse_moe", mixtral_part(proj)?)
    } else {
        let hf = match proj {
            "ffn_gate" => "gate_proj",
            "ffn_up" => "up_proj",
            "ffn_down" => "down_proj",
            _ => return None,
        };
        ("mlp", hf)
    };
    Some((layer, move |e: usize| {
        format!("model.layers.{layer}.{block}.experts.{e}.{hf}.weight")
    }))
}

/// The `torch_dtype` a GGUF model is served in: `float32` when every tensor is F32,
/// `bfloat16` when any is BF16, else `float16` (quantized tensors are dequantized into it).
pub fn served_dtype(g: &GgufFile) -> &'static str {
    use crate::gguf_quant::GgmlType;
    let types: Vec<_> = g
        .tensors
        .iter()
        .filter_map(|t| GgmlType::from_u32(t.ggml_type))
        .collect();
    if types.iter().all(|t| *t == GgmlType::F32) {
        "float32"
    } else if types.contains(&GgmlType::BF16) {
        "bfloat16"
    } else {
        "float16"
    }
}

/// Llama 3's RoPE frequency factors (transformers' `_compute_llama3_parameters`, as
/// `convert_hf_to_gguf.py` writes them into `rope_freqs.weight`): per rotary pair, the
/// divisor of the default inverse frequency.
fn llama3_factors(theta: f64, dim: usize, factor: f64, low: f64, high: f64, orig: f64) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < orig / high {
                1.0
            } else if wavelen > orig / low {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// config.json for a GGUF model, from its metadata (the inverse of llama.cpp's
/// `convert_hf_to_gguf.py` for the `llama` (with experts: Mixtral), `gemma3`, `qwen2`,
/// `qwen3`, `phi3`, `qwen2moe` and `qwen3moe` architectures): sizes, heads,
/// RoPE base and scaling (`{arch}.rope.scaling.*`, or Llama 3's `rope_freqs.weight` when it
/// equals the factors of `rope_type: llama3` with factor = its largest value and the Llama
/// 3.1 constants low 1, high 4, original 8192, or Phi-3's LongRoPE factor tensors with
/// `rope.scaling.original_context_length` and `rope.scaling.attn_factor`), partial rotary
/// embeddings (`rope.dimension_count` below the head size, unpermuted architectures), Phi-3's
/// sliding window (`attention.sliding_window`, 0 for none), the experts of qwen2moe and
/// qwen3moe files (`moe_config`), Gemma 3's fixed fields (`gemma3_config`), epsilon,
/// context length, BOS/EOS ids, tied
/// embeddings (no `output.weight`), and [`served_dtype`].
///
/// # Errors
/// [`ModelError::Gguf`] naming the key: another architecture, a missing size, per-layer
/// arrays, a partial rotary dimension of a permuted architecture, value heads of another
/// width than key heads, an unknown RoPE scaling, a `rope_freqs.weight` that is not Llama 3's,
/// one LongRoPE factor tensor without the other, experts where none are read, split files.
pub fn hf_config(g: &GgufFile) -> Result<serde_json::Value, ModelError> {
    use serde_json::json;
    let arch = g.architecture()?;
    let Some(&(_, mut model_type, mut hf_arch, _)) = ARCHS.iter().find(|a| a.0 == arch) else {
        return Err(g.fault(format!(
            "architecture `{arch}` is not read; GGUF files of {} are (for other models, serve \
             the Hugging Face checkpoint)",
            ARCHS.map(|a| a.0).join(", ")
        )));
    };
    if let Some(n) = g.get("split.count").and_then(GgufValue::as_int) {
        if n > 1 {
            return Err(g.fault(format!(
                "one of {n} split files; merge them first (`llama-gguf-split --merge FIRST OUT`)"
            )));
        }
    }
    let req = |key: &str| -> Result<usize, ModelError> {
        g.arch_usize(arch, key)?
            .ok_or_else(|| g.fault(format!("no `{arch}.{key}`")))
    };
    let hidden = req("embedding_length")?;
    let layers = req("block_count")?;
    let heads = req("attention.head_count")?;
    let kv_heads = g
        .arch_usize(arch, "attention.head_count_kv")?
        .unwrap_or(heads);
    let experts = g.arch_usize(arch, "expert_count")?.unwrap_or(0);
    let mixtral = naming_arch(g)? == "mixtral";
    if mixtral {
        (model_type, hf_arch) = ("mixtral", "MixtralForCausalLM");
    }
    let qwen_moe = arch.ends_with("moe");
    let moe = qwen_moe || mixtral;
    if moe != (experts > 0) {
        return Err(g.fault(format!(
            "`{arch}.expert_count` is {experts}; {}",
            if moe {
                "a mixture-of-experts architecture needs experts"
            } else {
                "experts are read for llama (Mixtral), qwen2moe and qwen3moe files only"
            }
        )));
    }
    // Mixtral's experts are `feed_forward_length` wide (MixtralConfig's intermediate_size).
    let expert_ffn = if qwen_moe {
        req("expert_feed_forward_length")?
    } else {
        0
    };
    // A sparse model's dense width only matters for dense layers (Qwen's `mlp_only_layers`).
    let ffn = match g.arch_usize(arch, "feed_forward_length")? {
        Some(f) => f,
        None if moe => expert_ffn,
        None => return Err(g.fault(format!("no `{arch}.feed_forward_length`"))),
    };
    let context = req("context_length")?;
    if heads == 0 {
        return Err(g.fault(format!("`{arch}.attention.head_count` is 0")));
    }
    let head_dim = g
        .arch_usize(arch, "attention.key_length")?
        .unwrap_or(hidden / heads);
    if let Some(v) = g.arch_usize(arch, "attention.value_length")? {
        if v != head_dim {
            return Err(g.fault(format!(
                "`{arch}.attention.value_length` {v} differs from the key length {head_dim}"
            )));
        }
    }
    // Partial rotary embeddings (Phi-4-mini): the leading `r` dims of each head rotate.
    let mut partial_rotary = None;
    if let Some(r) = g.arch_usize(arch, "rope.dimension_count")? {
        if r != head_dim {
            let x = r as f64 / head_dim as f64;
            // (config.json's `partial_rotary_factor` gives back `int(head_dim * x)` dims.)
            if permuted_qk(arch) || r == 0 || r > head_dim || (head_dim as f64 * x) as usize != r {
                return Err(g.fault(format!(
                    "`{arch}.rope.dimension_count` {r} is not the head size {head_dim}, and \
                     partial rotary embeddings of {arch} files are not read"
                )));
            }
            partial_rotary = Some(x);
        }
    }
    let embd = g
        .tensor("token_embd.weight")
        .ok_or_else(|| g.fault("no tensor `token_embd.weight`"))?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
    let theta = g.arch_f64(arch, "rope.freq_base")?.unwrap_or(10000.0);
    let eps = g
        .arch_f64(arch, "attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| g.fault(format!("no `{arch}.attention.layer_norm_rms_epsilon`")))?;
    let mut cfg = json!({
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "tie_word_embeddings": g.tensor("output.weight").is_none(),
        "torch_dtype": served_dtype(g),
    });
    let o = cfg.as_object_mut().expect("an object");
    if let Some(x) = partial_rotary {
        o.insert("partial_rotary_factor".into(), json!(x));
    }
    if qwen_moe {
        moe_config(g, arch, experts, expert_ffn, layers, o)?;
    }
    if mixtral {
        let used = g
            .arch_usize(arch, "expert_used_count")?
            .ok_or_else(|| g.fault(format!("no `{arch}.expert_used_count`")))?;
        o.insert("num_local_experts".into(), json!(experts));
        o.insert("num_experts_per_tok".into(), json!(used));
        // MixtralConfig's default window is 4096; converted files of Mixtral have none.
        o.insert("sliding_window".into(), serde_json::Value::Null);
    }
    if arch == "gemma3" {
        gemma3_config(g, hidden, heads, head_dim, layers, o)?;
    }
    if arch == "phi3" {
        // `convert_hf_to_gguf.py` writes 0 for no window (Phi-4); Phi3Config's default is none.
        if let Some(w) = g.arch_usize(arch, "attention.sliding_window")? {
            if w > 0 {
                o.insert("sliding_window".into(), json!(w));
            }
        }
        // Phi-3 keeps the pre-training length at the top level (LongRoPE's scale is the
        // ratio of the two lengths).
        if let Some(orig) = g.arch_usize(arch, "rope.scaling.original_context_length")? {
            o.insert("original_max_position_embeddings".into(), json!(orig));
        }
    }
    for (hf, key) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ] {
        if let Some(id) = g.get(key).and_then(GgufValue::as_int) {
            o.insert(hf.into(), json!(id));
        }
    }
    // RoPE scaling written as metadata ...
    let scaling = g
        .get(&format!("{arch}.rope.scaling.type"))
        .map(|v| {
            v.as_str()
                .ok_or_else(|| g.fault(format!("`{arch}.rope.scaling.type` is not a string")))
        })
        .transpose()?;
    let factor = g.arch_f64(arch, "rope.scaling.factor")?;
    let original = g.arch_usize(arch, "rope.scaling.original_context_length")?;
    match scaling {
        None | Some("none") => {
            if let Some(f) = g.arch_f64(arch, "rope.scale_linear")? {
                if f != 1.0 {
                    o.insert(
                        "rope_scaling".into(),
                        json!({"type": "linear", "factor": f}),
                    );
                }
            }
        }
        Some("linear") => {
            let f = factor.ok_or_else(|| g.fault(format!("no `{arch}.rope.scaling.factor`")))?;
            o.insert(
                "rope_scaling".into(),
                json!({"type": "linear", "factor": f}),
            );
        }
        Some("yarn") => {
            let f = factor.ok_or_else(|| g.fault(format!("no `{arch}.rope.scaling.factor`")))?;
            let mut y = json!({"rope_type": "yarn", "factor": f});
            if let Some(orig) = original {
                y["original_max_position_embeddings"] = json!(orig);
            }
            for (hf, key) in [
                ("beta_fast", "rope.scaling.yarn_beta_fast"),
                ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ] {
                if let Some(b) = g.arch_f64(arch, key)? {
                    y[hf] = json!(b);
                }
            }
            o.insert("rope_scaling".into(), y);
        }
        Some(other) => {
            return Err(g.fault(format!(
                "`{arch}.rope.scaling.type` is `{other}`; `none`, `linear` and `yarn` are read"
            )))
        }
    }
    // ... or, for Phi-3's LongRoPE, as the short and long factors' tensors ...
    let long = g.tensor("rope_factors_long.weight");
    let short = g.tensor("rope_factors_short.weight");
    if long.is_some() || short.is_some() {
        let (Some(long), Some(short), "phi3") = (long, short, arch) else {
            return Err(g.fault(format!(
                "tensors `rope_factors_long.weight` and `rope_factors_short.weight` are read \
                 as a pair, for phi3 files only (this {arch} file has {})",
                if long.is_some() {
                    "the long one"
                } else {
                    "the short one"
                }
            )));
        };
        if o.contains_key("rope_scaling") {
            return Err(g.fault("both a RoPE scaling type and LongRoPE factor tensors"));
        }
        let mut y = json!({"type": "longrope", "long_factor": f32_values(g, long)?,
                           "short_factor": f32_values(g, short)?});
        if let Some(a) = g.arch_f64(arch, "rope.scaling.attn_factor")? {
            y["attention_factor"] = json!(a);
        }
        o.insert("rope_scaling".into(), y);
    }
    // ... or, for Llama 3, as the per-pair factors of `rope_freqs.weight`.
    if let Some(t) = g.tensor("rope_freqs.weight") {
        let ours = f32_values(g, t)?;
        let factor = ours.iter().copied().fold(f64::NAN, f64::max);
        let (low, high, orig) = (1.0, 4.0, 8192.0);
        let want = llama3_factors(theta, head_dim, factor, low, high, orig);
        let close = want.len() == ours.len()
            && want
                .iter()
                .zip(&ours)
                .all(|(a, b)| (a - b).abs() <= 1e-4 * a.abs().max(1.0));
        if !close || o.contains_key("rope_scaling") {
            return Err(g.fault(format!(
                "tensor `rope_freqs.weight` ({} factors, largest {factor}) is not Llama 3's \
                 RoPE scaling (factor {factor}, low_freq_factor 1, high_freq_factor 4, \
                 original_max_position_embeddings 8192); other per-frequency factors are not read",
                ours.len()
            )));
        }
        if factor != 1.0 {
            o.insert(
                "rope_scaling".into(),
                json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": orig as usize}),
            );
        }
    }
    Ok(cfg)
}

/// The values of an F32 tensor (RoPE factors), widened.
fn f32_values(g: &GgufFile, t: &GgufTensorInfo) -> Result<Vec<f64>, ModelError> {
    if t.ggml_type != crate::gguf_quant::GgmlType::F32 as u32 {
        return Err(g.fault(format!("tensor `{}` is not F32", t.name)));
    }
    Ok(g.tensor_bytes(t)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64)
        .collect())
}

/// config.json's mixture-of-experts fields for a `qwen2moe` or `qwen3moe` file: expert count
/// and width, experts per token, Qwen2-MoE's shared expert width, and `norm_topk_prob` (the
/// file's `{arch}.expert_weights_norm` when given, else what llama.cpp's graph for the
/// architecture does: qwen3moe renormalizes the chosen experts' weights, qwen2moe does not).
/// A layer without a router (`blk.{i}.ffn_gate_inp.weight`) is listed in `mlp_only_layers`.
fn moe_config(
    g: &GgufFile,
    arch: &str,
    experts: usize,
    expert_ffn: usize,
    layers: usize,
    o: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), ModelError> {
    use serde_json::json;
    let used = g
        .arch_usize(arch, "expert_used_count")?
        .ok_or_else(|| g.fault(format!("no `{arch}.expert_used_count`")))?;
    o.insert("num_experts".into(), json!(experts));
    o.insert("num_experts_per_tok".into(), json!(used));
    o.insert("moe_intermediate_size".into(), json!(expert_ffn));
    o.insert("decoder_sparse_step".into(), json!(1));
    let dense: Vec<usize> = (0..layers)
        .filter(|i| g.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_none())
        .collect();
    o.insert("mlp_only_layers".into(), json!(dense));
    let norm = match g.get(&format!("{arch}.expert_weights_norm")) {
        Some(v) => v.as_bool().ok_or_else(|| {
            g.fault(format!(
                "`{arch}.expert_weights_norm` is {v:?}; expected a bool"
            ))
        })?,
        None => arch == "qwen3moe",
    };
    o.insert("norm_topk_prob".into(), json!(norm));
    if arch == "qwen2moe" {
        let shared = g
            .arch_usize(arch, "expert_shared_feed_forward_length")?
            .unwrap_or(0);
        o.insert("shared_expert_intermediate_size".into(), json!(shared));
    }
    Ok(())
}

/// config.json's Gemma 3 fields, as llama.cpp reads or fixes them (`LLM_ARCH_GEMMA3`): the
/// layers slide over `gemma3.attention.sliding_window` keys (absent or 0: no layer slides)
/// with the pattern of `attention.sliding_window_pattern` (a period, or a flag per layer;
/// absent: every 6th layer is full) and RoPE base `rope.freq_base_swa` (absent: 10000; the
/// file's `rope.freq_base` and scaling are the full layers'); queries are scaled by
/// `1/sqrt(hidden / heads)` in the 62-layer model (Gemma 3 27B, whose
/// `query_pre_attn_scalar` is 168) and `1/sqrt(head_dim)` in the others. Soft-capping, which
/// Gemma 3 does not use, is carried over when the file gives it (and then refused by the
/// config's parser).
fn gemma3_config(
    g: &GgufFile,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    layers: usize,
    o: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), ModelError> {
    use serde_json::json;
    // No window (the converter leaves the key out when every layer is full): every layer
    // attends to all keys, as llama.cpp then runs it.
    match g.arch_usize("gemma3", "attention.sliding_window")? {
        None | Some(0) => {
            o.insert("sliding_window".into(), serde_json::Value::Null);
        }
        Some(w) => {
            o.insert("sliding_window".into(), json!(w));
        }
    }
    // Which layers slide: the file's pattern (a period, or a flag per layer) when it gives
    // one, else llama.cpp's fixed period of 6 for Gemma 3.
    let key = "gemma3.attention.sliding_window_pattern";
    match g.get(key) {
        None => {
            o.insert("sliding_window_pattern".into(), json!(6));
        }
        Some(GgufValue::Array(flags)) => {
            let types = flags
                .iter()
                .map(|f| match f.as_bool() {
                    Some(true) => Some("sliding_attention"),
                    Some(false) => Some("full_attention"),
                    None => None,
                })
                .collect::<Option<Vec<_>>>()
                .filter(|t| t.len() == layers)
                .ok_or_else(|| g.fault(format!("`{key}` is not {layers} booleans, one a layer")))?;
            o.insert("layer_types".into(), json!(types));
        }
        Some(v) => {
            let p = v
                .as_int()
                .filter(|&p| p > 0 && p <= layers as i128)
                .ok_or_else(|| g.fault(format!("`{key}` is {v:?}; expected a layer period")))?;
            o.insert("sliding_window_pattern".into(), json!(p as u64));
        }
    }
    // The sliding layers' RoPE base: `rope.freq_base_swa` (what the converter writes from the
    // sliding layers' `rope_theta`), else Gemma 3's 10000.
    let local = g
        .arch_f64("gemma3", "rope.freq_base_swa")?
        .unwrap_or(10000.0);
    o.insert("rope_local_base_freq".into(), json!(local));
    let scalar = if layers == 62 {
        hidden / heads
    } else {
        head_dim
    };
    o.insert("query_pre_attn_scalar".into(), json!(scalar));
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(x) = g.arch_f64("gemma3", key)? {
            o.insert(key.into(), json!(x));
        }
    }
    Ok(())
}

/// The sampling defaults a GGUF file recommends (`general.sampling.temp`, `top_p`, `top_k`,
/// `min_p`: what llama.cpp's server applies to requests that leave them out) and its stop
/// tokens beyond EOS (`tokenizer.ggml.eot_token_id`, `eom_token_id`: llama.cpp ends
/// generation on them) as a `generation_config.json` (`temperature`, `top_p`, `top_k`,
/// `min_p`, `eos_token_id` listing EOS and those), which Baton's processes read as vLLM reads
/// a checkpoint's (`--generation-config auto`); `None` when the file gives none of them. `general.sampling.penalty_repeat` is not carried over: llama.cpp applies
/// it to the last `penalty_last_n` tokens, Hugging Face's `repetition_penalty` to all of them.
///
/// # Errors
/// [`ModelError::Gguf`] for a value that is not a number (top-k: an integer of at least -1;
/// the token ids: ids).
pub fn generation_config(g: &GgufFile) -> Result<Option<serde_json::Value>, ModelError> {
    let mut out = serde_json::Map::new();
    for (key, hf) in [
        ("temp", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
    ] {
        let k = format!("general.sampling.{key}");
        let Some(v) = g.get(&k) else { continue };
        let value = if hf == "top_k" {
            v.as_int()
                .filter(|&i| (-1..=i128::from(u32::MAX)).contains(&i))
                .map(|i| serde_json::json!(i as i64))
        } else {
            v.as_f64()
                .filter(|x| x.is_finite())
                .map(|x| serde_json::json!(x))
        };
        let value = value.ok_or_else(|| {
            g.fault(format!(
                "`{k}` is {v:?}; expected {}",
                if hf == "top_k" {
                    "an integer of at least -1"
                } else {
                    "a finite number"
                }
            ))
        })?;
        out.insert(hf.into(), value);
    }
    // End-of-turn and end-of-message tokens end generation in llama.cpp (its end-of-generation
    // set); as generation_config.json's `eos_token_id` they are stop ids here too (Gemma 3's
    // `<end_of_turn>`, whose EOS is `<eos>`).
    let mut eos: Vec<i128> = Vec::new();
    for key in ["eos_token_id", "eot_token_id", "eom_token_id"] {
        let k = format!("tokenizer.ggml.{key}");
        if let Some(v) = g.get(&k) {
            let id = v
                .as_int()
                .filter(|&i| (0..=i128::from(u32::MAX)).contains(&i))
                .ok_or_else(|| g.fault(format!("`{k}` is {v:?}; expected a token id")))?;
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    if eos.len() > 1 {
        let ids: Vec<i64> = eos.iter().map(|&i| i as i64).collect();
        out.insert("eos_token_id".into(), serde_json::json!(ids));
    }
    Ok((!out.is_empty()).then_some(serde_json::Value::Object(out)))
}

/// What [`prepare_dir`] made.
#[derive(Debug, Clone)]
pub struct PreparedGguf {
    /// A Hugging Face layout directory: config.json, the tokenizer files when the GGUF
    /// tokenizer converts, and `model.gguf`, a symbolic link to the file.
    pub dir: PathBuf,
    /// Why the GGUF tokenizer was not converted (`None`: tokenizer.json and
    /// tokenizer_config.json were written); the caller then needs `--tokenizer`.
    pub tokenizer_error: Option<String>,
}

/// The name of the weights file of a directory that serves a GGUF model
/// ([`crate::WeightSource::open`] reads it when there is no safetensors file).
pub const GGUF_WEIGHTS: &str = "model.gguf";

/// Removes the directories under `cache` (other than `made`, just made for the file at
/// `canon`) that serve no file any more: their `model.gguf` link names a file that is gone,
/// or names `canon`, whose version they no longer match (a changed file gets a new
/// directory, so without this each version's would stay). Best effort: a directory that
/// cannot be read or removed is left.
fn prune_superseded(cache: &Path, made: &Path, canon: &Path) {
    let Ok(entries) = std::fs::read_dir(cache) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let ours = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("gguf-"));
        if !ours || path == made {
            continue;
        }
        let Ok(target) = std::fs::read_link(path.join(GGUF_WEIGHTS)) else {
            continue;
        };
        if target == canon || !target.exists() {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// Makes (once per file version) a model directory for the GGUF file `gguf` under `cache`:
/// `cache/gguf-<16 hex digits>/` with config.json ([`hf_config`]), tokenizer.json and
/// tokenizer_config.json ([`crate::gguf_tokenizer::tokenizer_files`]), generation_config.json
/// when the file recommends sampling defaults ([`generation_config`]) and a `model.gguf`
/// link to the file. The name hashes the file's canonical path, length and modification
/// time and the files' contents, so a changed file (or a changed conversion) gets a new
/// directory, and making one removes the directories of the file's earlier versions and
/// of files that are gone; the directory is written under a temporary
/// name and renamed, so processes preparing the same file at once (a scheduler, workers and
/// frontends started together) all see a complete one.
///
/// # Errors
/// As [`GgufFile::open`] and [`hf_config`]; [`ModelError::Io`] when `cache` cannot be written.
pub fn prepare_dir(gguf: &Path, cache: &Path) -> Result<PreparedGguf, ModelError> {
    let canon = gguf.canonicalize().map_err(|e| ModelError::io(gguf, &e))?;
    let meta = std::fs::metadata(&canon).map_err(|e| ModelError::io(&canon, &e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let g = GgufFile::open(&canon)?;
    let config = hf_config(&g)?;
    // Checked here, so that a value Baton refuses is named as the file's, not as the cache's
    // config.json that every process would read (and refuse) later.
    crate::ModelConfig::from_json_str_named(
        &config.to_string(),
        &format!("{} (its metadata as config.json)", gguf.display()),
    )?;
    let max_len = config["max_position_embeddings"]
        .as_u64()
        .map(|x| x as usize);
    // Gemma 3's SentencePiece vocabulary (no space prefix, 262k pieces) has not been checked
    // against its Hugging Face tokenizer.json, so it is not converted.
    let tokenizer = if g.architecture()? == "gemma3" {
        Err(
            "Gemma 3's SentencePiece vocabulary is not checked against its Hugging Face \
             tokenizer.json; give the model's tokenizer with `--tokenizer` (for example a \
             download of google/gemma-3-1b-it)"
                .to_string(),
        )
    } else {
        crate::gguf_tokenizer::tokenizer_files(&g.metadata, max_len)
    };
    let tokenizer_error = tokenizer.as_ref().err().cloned();
    // The name covers what the directory holds, so another file version or another
    // conversion (a newer Baton's) gets a directory of its own.
    let mut h = crate::fingerprint::Fnv64::default();
    h.eat(format!("{}\0{}\0{mtime}\0", canon.display(), meta.len()).as_bytes());
    h.eat(config.to_string().as_bytes());
    let generation = generation_config(&g)?;
    if let Some(gen) = &generation {
        h.eat(gen.to_string().as_bytes());
    }
    if let Ok((tok, tok_cfg)) = &tokenizer {
        h.eat(tok.to_string().as_bytes());
        h.eat(tok_cfg.to_string().as_bytes());
    }
    let key = h.finish();
    let dir = cache.join(format!("gguf-{key:016x}"));
    if dir.join("config.json").is_file() {
        return Ok(PreparedGguf {
            dir,
            tokenizer_error,
        });
    }
    std::fs::create_dir_all(cache).map_err(|e| ModelError::io(cache, &e))?;
    let tmp = cache.join(format!(
        ".gguf-{key:016x}.tmp-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ));
    let write = |name: &str, v: &serde_json::Value| -> Result<(), ModelError> {
        let p = tmp.join(name);
        let text = serde_json::to_string_pretty(v).expect("JSON values serialize");
        std::fs::write(&p, text).map_err(|e| ModelError::io(&p, &e))
    };
    let made = (|| {
        std::fs::create_dir(&tmp).map_err(|e| ModelError::io(&tmp, &e))?;
        write("config.json", &config)?;
        if let Some(gen) = &generation {
            write("generation_config.json", gen)?;
        }
        if let Ok((tok, tok_cfg)) = &tokenizer {
            write("tokenizer.json", tok)?;
            write("tokenizer_config.json", tok_cfg)?;
        }
        let link = tmp.join(GGUF_WEIGHTS);
        std::os::unix::fs::symlink(&canon, &link).map_err(|e| ModelError::io(&link, &e))?;
        match std::fs::rename(&tmp, &dir) {
            Ok(()) => {
                prune_superseded(cache, &dir, &canon);
                Ok(())
            }
            // Another process made it first: theirs is complete and equal.
            Err(_) if dir.join("config.json").is_file() => Ok(()),
            Err(e) => Err(ModelError::io(&dir, &e)),
        }
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    made.map(|()| PreparedGguf {
        dir,
        tokenizer_error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF writer for the parser's tests.
    fn header(
        version: u32,
        kv: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, &[u64], u32, u64)],
    ) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        let s = |b: &mut Vec<u8>, x: &str| {
            b.extend((x.len() as u64).to_le_bytes());
            b.extend(x.as_bytes());
        };
        for (k, ty, v) in kv {
            s(&mut b, k);
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        for (name, dims, ty, off) in tensors {
            s(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(off.to_le_bytes());
        }
        b
    }

    #[test]
    fn parses_metadata_tensors_and_aligns_the_data_section() {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend(2u64.to_le_bytes());
        for x in ["a", "bc"] {
            arr.extend((x.len() as u64).to_le_bytes());
            arr.extend(x.as_bytes());
        }
        let b = header(
            3,
            &[
                ("general.architecture", 8, {
                    let mut v = 5u64.to_le_bytes().to_vec();
                    v.extend(b"llama");
                    v
                }),
                ("llama.block_count", 4, 5u32.to_le_bytes().to_vec()),
                ("tokenizer.ggml.tokens", 9, arr),
            ],
            &[("token_embd.weight", &[64, 512], 0, 0)],
        );
        let (v, meta, t, start) = parse_header(&b).unwrap();
        assert_eq!(v, 3);
        assert_eq!(meta["general.architecture"].as_str(), Some("llama"));
        assert_eq!(meta["llama.block_count"].as_int(), Some(5));
        let toks: Vec<_> = meta["tokenizer.ggml.tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(toks, ["a", "bc"]);
        assert_eq!(t[0].shape(), vec![512, 64]);
        assert_eq!(start % 32, 0);
        assert!(start >= b.len() && start < b.len() + 32);
    }

    #[test]
    fn overlapping_tensor_data_is_refused() {
        let dir = std::env::temp_dir().join(format!("baton-gguf-overlap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Two 64-float tensors: at offsets 0 and 256 they are apart, at 0 and 128 the second
        // starts inside the first.
        for (second, ok) in [(256u64, true), (128, false), (0, false)] {
            let mut b = header(3, &[], &[("a", &[64], 0, 0), ("b", &[64], 0, second)]);
            b.resize(b.len().next_multiple_of(32) + 512, 0);
            let path = dir.join(format!("t{second}.gguf"));
            std::fs::write(&path, &b).unwrap();
            match GgufFile::open(&path) {
                Ok(_) => assert!(ok, "offset {second} accepted"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(!ok, "offset {second}: {e}");
                    assert!(
                        e.contains("`a`") && e.contains("`b`") && e.contains("overlap"),
                        "{e}"
                    );
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corrupt_headers_are_errors_not_panics() {
        assert!(parse_header(b"GGML\x03\0\0\0")
            .unwrap_err()
            .contains("not a GGUF"));
        assert!(parse_header(b"GGUF\x01\0\0\0")
            .unwrap_err()
            .contains("version 1"));
        assert!(parse_header(b"GGUF\0\0\0\x03")
            .unwrap_err()
            .contains("big-endian"));
        let mut b = header(3, &[], &[]);
        b.truncate(12);
        assert!(parse_header(&b).unwrap_err().contains("truncated"));
        // A string claiming more bytes than the file has: no allocation, an error.
        let mut b = header(3, &[("k", 8, u64::MAX.to_le_bytes().to_vec())], &[]);
        b.extend([0u8; 16]);
        assert!(parse_header(&b).unwrap_err().contains("claims"));
        // An array claiming 2^40 elements.
        let mut arr = 0u32.to_le_bytes().to_vec();
        arr.extend((1u64 << 40).to_le_bytes());
        let b = header(3, &[("k", 9, arr)], &[]);
        assert!(parse_header(&b).unwrap_err().contains("array of"));
        let b = header(3, &[("k", 99, vec![])], &[]);
        assert!(parse_header(&b)
            .unwrap_err()
            .contains("unknown value type 99"));
        let b = header(3, &[], &[("t", &[1, 1, 1, 1, 1], 0, 0)]);
        assert!(parse_header(&b).unwrap_err().contains("5 dimensions"));
        let b = header(3, &[], &[("t", &[4], 0, 3)]);
        assert!(parse_header(&b).unwrap_err().contains("not a multiple"));
        let b = header(3, &[], &[("t", &[4], 0, 0), ("t", &[4], 0, 32)]);
        assert!(parse_header(&b).unwrap_err().contains("twice"));
        let b = header(
            3,
            &[("general.alignment", 4, 3u32.to_le_bytes().to_vec())],
            &[],
        );
        assert!(parse_header(&b).unwrap_err().contains("power of two"));
    }
}
