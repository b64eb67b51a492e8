//! LoRA adapters: low-rank updates of a model's linear layers, served beside the base model
//! (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685).
//!
//! An adapter is a directory in Hugging Face PEFT's layout: `adapter_config.json` (`r`,
//! `lora_alpha`, `target_modules`, `use_rslora`, ...) and `adapter_model.safetensors`, with
//! tensors named `base_model.model.model.layers.{i}.{module}.lora_A.weight` (`[r, in]`) and
//! `...lora_B.weight` (`[out, r]`). A linear layer `y = x·Wᵀ` with an adapter computes
//! `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, `s = lora_alpha / r` (PEFT's `scaling`; `lora_alpha / sqrt(r)`
//! with `use_rslora`, Kalajdzievski 2023). As vLLM does (`LoRALayerWeights.optimize`), `s`
//! is folded into `B` at load.
//!
//! The updates are mapped onto the fused linear layers every backend runs ([`LoraLinear`]):
//! q, k and v (or a fused `qkv_proj`) onto the q/k/v projection, gate and up (or
//! `gate_up_proj`) onto the gate/up projection, with the rows of `B` at the fused output's
//! offsets, and a partial-RoPE model's q and k rows permuted as the base weights are
//! ([`ModelConfig::rope_head_permutation`]).
//!
//! Served as vLLM's `--enable-lora --lora-modules NAME=PATH`: a request whose `model` is
//! `NAME` runs with the adapter; adapter id 0 is the base model, `i + 1` the `i`-th module.

use crate::config::{parse_json, read_text};
use crate::fingerprint::Fnv64;
use crate::{ModelConfig, ModelError, WeightSource};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// vLLM's default `--max-lora-rank`.
pub const DEFAULT_MAX_LORA_RANK: usize = 16;

/// The largest `--max-lora-rank` accepted (vLLM's largest choice).
pub const MAX_LORA_RANK: usize = 512;

/// One `--lora-modules` entry: the name requests use and the adapter's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The served model name that selects this adapter.
    pub name: String,
    /// The PEFT adapter directory.
    pub path: PathBuf,
}

impl LoraModule {
    /// Parses one `--lora-modules` value as vLLM does: `NAME=PATH`, or a JSON object
    /// `{"name": ..., "path": ..., "base_model_name": ...}` (`base_model_name` is accepted and
    /// not used: there is one base model).
    ///
    /// # Errors
    /// A message naming what is wrong: no `=`, an empty name or path, bad JSON, a name with
    /// whitespace.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (name, path) = if s.trim_start().starts_with('{') {
            let v: Value = serde_json::from_str(s)
                .map_err(|e| format!("--lora-modules {s:?}: invalid JSON: {e}"))?;
            let field = |k: &str| -> Result<String, String> {
                match v.get(k) {
                    Some(Value::String(x)) => Ok(x.clone()),
                    Some(_) => Err(format!("--lora-modules {s:?}: `{k}` must be a string")),
                    None => Err(format!("--lora-modules {s:?}: missing `{k}`")),
                }
            };
            if let Some(obj) = v.as_object() {
                if let Some(k) = obj
                    .keys()
                    .find(|k| !["name", "path", "base_model_name"].contains(&k.as_str()))
                {
                    return Err(format!(
                        "--lora-modules {s:?}: unknown key `{k}` (expected name, path, \
                         base_model_name)"
                    ));
                }
            }
            (field("name")?, field("path")?)
        } else {
            let Some((n, p)) = s.split_once('=') else {
                return Err(format!(
                    "--lora-modules {s:?}: expected NAME=PATH or a JSON object with `name` and \
                     `path`"
                ));
            };
            (n.to_string(), p.to_string())
        };
        if name.trim().is_empty() || name.chars().any(char::is_whitespace) {
            return Err(format!(
                "--lora-modules {s:?}: the name must be non-empty without whitespace"
            ));
        }
        if path.is_empty() {
            return Err(format!("--lora-modules {s:?}: the path is empty"));
        }
        Ok(Self {
            name,
            path: PathBuf::from(path),
        })
    }

    /// Parses every value and checks that the names are distinct.
    ///
    /// # Errors
    /// As [`LoraModule::parse`], or a repeated name.
    pub fn parse_all(values: &[String]) -> Result<Vec<Self>, String> {
        let mut out: Vec<Self> = Vec::with_capacity(values.len());
        for v in values {
            let m = Self::parse(v)?;
            if out.iter().any(|o| o.name == m.name) {
                return Err(format!(
                    "--lora-modules: the name {:?} is given twice",
                    m.name
                ));
            }
            out.push(m);
        }
        Ok(out)
    }
}

/// The fused linear layers of a decoder layer that an adapter may update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraLinear {
    /// The fused q/k/v projection, output `[(heads + 2 kv_heads) * head_dim]`.
    Qkv = 0,
    /// The attention output projection, output `[hidden]`.
    O = 1,
    /// The fused gate/up projection, output `[2 * intermediate]` (gate first).
    GateUp = 2,
    /// The MLP down projection, output `[hidden]`.
    Down = 3,
}

/// Number of [`LoraLinear`] kinds.
pub const LORA_LINEARS: usize = 4;

/// One low-rank update of a part of a fused linear layer's output:
/// `y[out_offset .. out_offset + out] += (x·Aᵀ)·Bᵀ` (the scaling folded into `b`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPart {
    /// First output column of the fused layer this part updates.
    pub out_offset: usize,
    /// Rank `r`.
    pub rank: usize,
    /// Input width `k`.
    pub k: usize,
    /// Output width `n` of the part.
    pub n: usize,
    /// `A`, `[r, k]` row-major, f32.
    pub a: Vec<f32>,
    /// `s·B`, `[n, r]` row-major, f32.
    pub b: Vec<f32>,
}

impl LoraPart {
    /// Adds this part's update for one token: `out[out_offset + j] += Σ_r b[j, r]·(A·x)[r]`,
    /// with `x` `[k]`, `out` the fused layer's `[N]` output, `v` scratch of at least `rank`.
    /// Sums run in index order (f32), so a token's bits do not depend on its batch.
    pub fn apply_token(&self, x: &[f32], out: &mut [f32], v: &mut [f32]) {
        for (i, vi) in v[..self.rank].iter_mut().enumerate() {
            *vi = self.shrink_row(i, x);
        }
        let out = &mut out[self.out_offset..self.out_offset + self.n];
        for (j, o) in out.iter_mut().enumerate() {
            *o += self.expand_row(j, &v[..self.rank]);
        }
    }

    /// `(A·x)[i]` for `x` `[k]`: row `i` of A dotted with `x` ([`dot8`]'s order).
    #[inline]
    pub fn shrink_row(&self, i: usize, x: &[f32]) -> f32 {
        dot8(&self.a[i * self.k..(i + 1) * self.k], x)
    }

    /// `(B·v)[j]` for `v` `[rank]` (what [`LoraPart::apply_token`] adds to output column
    /// `out_offset + j`; [`dot8`]'s order).
    #[inline]
    pub fn expand_row(&self, j: usize, v: &[f32]) -> f32 {
        let r = self.rank;
        dot8(&self.b[j * r..(j + 1) * r], v)
    }
}

/// `Σ a[i]·b[i]` (f32, `a.len() == b.len()`) in a fixed order that vectorizes: eight lane
/// sums, lane `l` taking the `i` with `i % 8 == l` in ascending order (a product rounded, then
/// added), combined as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`. The same bits
/// whatever the batch, the thread or the instruction set.
#[inline]
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let full = a.len().min(b.len()) / 8 * 8;
    for (ca, cb) in a[..full].chunks_exact(8).zip(b[..full].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    for (l, (x, y)) in a[full..].iter().zip(&b[full..]).enumerate() {
        acc[l] += x * y;
    }
    let s = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// A loaded adapter: per decoder layer, per [`LoraLinear`], the parts it updates (empty where
/// it has none).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    /// The served name (`--lora-modules NAME=...`).
    pub name: String,
    /// The adapter directory.
    pub path: PathBuf,
    /// The largest rank of its parts.
    pub max_rank: usize,
    /// `layers[i][kind as usize]`: layer `i`'s parts of that linear layer.
    pub layers: Vec<[Vec<LoraPart>; LORA_LINEARS]>,
}

/// The module names PEFT adapters target, in HF's naming, and where each goes.
const MODULES: [(&str, LoraLinear, Slice); 9] = [
    ("self_attn.q_proj", LoraLinear::Qkv, Slice::Q),
    ("self_attn.k_proj", LoraLinear::Qkv, Slice::K),
    ("self_attn.v_proj", LoraLinear::Qkv, Slice::V),
    ("self_attn.qkv_proj", LoraLinear::Qkv, Slice::Qkv),
    ("self_attn.o_proj", LoraLinear::O, Slice::Whole),
    ("mlp.gate_proj", LoraLinear::GateUp, Slice::Gate),
    ("mlp.up_proj", LoraLinear::GateUp, Slice::Up),
    ("mlp.gate_up_proj", LoraLinear::GateUp, Slice::Whole),
    ("mlp.down_proj", LoraLinear::Down, Slice::Whole),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slice {
    Q,
    K,
    V,
    Qkv,
    Gate,
    Up,
    Whole,
}

/// The adapter files of `dir`.
fn files(dir: &Path) -> (PathBuf, PathBuf) {
    (
        dir.join("adapter_config.json"),
        dir.join("adapter_model.safetensors"),
    )
}

impl LoraAdapter {
    /// Loads `m.path` for a model of config `cfg`, refusing ranks above `max_rank`.
    ///
    /// # Errors
    /// [`ModelError::Io`] for a missing `adapter_config.json` or `adapter_model.safetensors`
    /// (a `.bin`-only adapter is refused with a hint), [`ModelError::InvalidField`] for a
    /// config this server cannot apply (`use_dora`, `bias` other than `none`,
    /// `modules_to_save`, `alpha_pattern`, `rank_pattern`, `fan_in_fan_out`, a `peft_type`
    /// other than LORA, an `r` that is not a positive integer or is above `max_rank`, a
    /// non-boolean flag) or a tensor that is not a LoRA update of a supported module
    /// (embeddings, the LM head, MoE experts) or holds a NaN or infinity,
    /// [`ModelError::MissingField`] without `r`, [`ModelError::ShapeMismatch`] for shapes
    /// that do not fit the model or the rank `r`, and safetensors errors. Every update's
    /// tensors are used, whatever `target_modules` and `layers_to_transform` say (as vLLM).
    pub fn load(m: &LoraModule, cfg: &ModelConfig, max_rank: usize) -> Result<Self, ModelError> {
        let (cfg_path, st_path) = files(&m.path);
        let cfg_name = cfg_path.display().to_string();
        let v = parse_json(&cfg_name, &read_text(&cfg_path)?)?;
        let bad = |field: &str, reason: String| ModelError::InvalidField {
            file: cfg_name.clone(),
            field: field.into(),
            reason,
        };
        if !v.is_object() {
            return Err(bad("adapter_config", "expected a JSON object".into()));
        }
        if let Some(t) = v.get("peft_type").and_then(Value::as_str) {
            if t != "LORA" {
                return Err(bad(
                    "peft_type",
                    format!("{t:?}: only LORA adapters are served"),
                ));
            }
        }
        let flag = |k: &str| match v.get(k) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => Err(bad(k, format!("{x}: expected true or false"))),
        };
        let rank =
            match v.get("r") {
                None | Some(Value::Null) => {
                    return Err(ModelError::MissingField {
                        file: cfg_name.clone(),
                        field: "r".into(),
                    })
                }
                Some(x) => x.as_u64().filter(|&r| r >= 1).ok_or_else(|| {
                    bad("r", format!("{x}: expected a positive integer (the rank)"))
                })? as usize,
            };
        if rank > max_rank {
            return Err(bad(
                "r",
                format!(
                    "rank {rank} is above --max-lora-rank {max_rank} (raise it, up to \
                     {MAX_LORA_RANK})"
                ),
            ));
        }
        if flag("use_dora")? {
            return Err(bad("use_dora", "DoRA adapters are not served".into()));
        }
        if flag("fan_in_fan_out")? {
            return Err(bad(
                "fan_in_fan_out",
                "Conv1D (GPT-2 style) weights are not served".into(),
            ));
        }
        match v.get("bias") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(b) => return Err(bad("bias", format!("{b}: only \"none\" is served"))),
        }
        match v.get("modules_to_save") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(x) => {
                return Err(bad(
                    "modules_to_save",
                    format!("{x}: adapters that replace whole modules are not served"),
                ))
            }
        }
        for (k, what) in [("alpha_pattern", "alphas"), ("rank_pattern", "ranks")] {
            match v.get(k) {
                None | Some(Value::Null) => {}
                Some(Value::Object(o)) if o.is_empty() => {}
                Some(_) => return Err(bad(k, format!("per-module {what} are not served"))),
            }
        }
        let alpha = match v.get("lora_alpha") {
            None | Some(Value::Null) => 8.0, // PEFT's LoraConfig default
            Some(x) => x
                .as_f64()
                .filter(|a| a.is_finite())
                .ok_or_else(|| bad("lora_alpha", format!("{x}: expected a number")))?,
        };
        let rslora = flag("use_rslora")?;
        if !st_path.exists() && m.path.join("adapter_model.bin").exists() {
            return Err(ModelError::Io {
                file: st_path.display().to_string(),
                reason: "not found; only adapter_model.bin is there (convert it to safetensors, \
                         e.g. with PEFT's `save_pretrained(..., safe_serialization=True)`)"
                    .into(),
            });
        }
        let src = WeightSource::open_file(&st_path)?;
        let st_name = st_path.display().to_string();
        let tensor_bad = |tensor: &str, reason: String| ModelError::InvalidField {
            file: st_name.clone(),
            field: tensor.into(),
            reason,
        };

        let (q_w, kv_w) = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        );
        let h = cfg.hidden_size;
        let perm = (cfg.rotary_dim != cfg.head_dim).then(|| cfg.rope_head_permutation());
        let mut layers: Vec<[Vec<LoraPart>; LORA_LINEARS]> = (0..cfg.num_hidden_layers)
            .map(|_| Default::default())
            .collect();
        let mut max_seen = 0;
        let names: Vec<String> = src.tensor_names().map(str::to_string).collect();
        for name in &names {
            let Some(stem) = name.strip_suffix(".lora_A.weight") else {
                if name.ends_with(".lora_B.weight") {
                    let a = name.replace(".lora_B.weight", ".lora_A.weight");
                    if !src.contains(&a) {
                        return Err(tensor_bad(name, format!("no `{a}` beside it")));
                    }
                    continue;
                }
                return Err(tensor_bad(
                    name,
                    "not a LoRA update of a decoder layer's linear layer (embedding, LM head \
                     and other modules are not served)"
                        .into(),
                ));
            };
            let Some((li, module)) = layer_module(stem) else {
                return Err(tensor_bad(
                    name,
                    "not a LoRA update of a decoder layer's linear layer (embedding, LM head \
                     and other modules are not served)"
                        .into(),
                ));
            };
            let Some(&(_, kind, slice)) = MODULES.iter().find(|(m, _, _)| *m == module) else {
                return Err(tensor_bad(
                    name,
                    format!(
                        "module `{module}` is not served (q/k/v/o/qkv_proj, gate/up/down/\
                         gate_up_proj are)"
                    ),
                ));
            };
            if li >= cfg.num_hidden_layers {
                return Err(tensor_bad(
                    name,
                    format!("layer {li}, but the model has {}", cfg.num_hidden_layers),
                ));
            }
            let moe_layer = cfg.moe.as_ref().is_some_and(|m| m.layers[li]);
            if moe_layer && matches!(kind, LoraLinear::GateUp | LoraLinear::Down) {
                return Err(tensor_bad(
                    name,
                    format!("layer {li}'s MLP is a mixture of experts; LoRA on it is not served"),
                ));
            }
            let inter = cfg.intermediate_size;
            let (k, n, off) = match slice {
                Slice::Q => (h, q_w, 0),
                Slice::K => (h, kv_w, q_w),
                Slice::V => (h, kv_w, q_w + kv_w),
                Slice::Qkv => (h, q_w + 2 * kv_w, 0),
                Slice::Gate => (h, inter, 0),
                Slice::Up => (h, inter, inter),
                Slice::Whole => match kind {
                    LoraLinear::O => (q_w, h, 0),
                    LoraLinear::GateUp => (h, 2 * inter, 0),
                    _ => (inter, h, 0),
                },
            };
            let a_raw = src.get(name)?;
            if a_raw.shape.len() == 2 && a_raw.shape[1] == k && a_raw.shape[0] != rank {
                return Err(tensor_bad(
                    name,
                    format!(
                        "rank {} (shape {:?}), but adapter_config.json's r is {rank}",
                        a_raw.shape[0], a_raw.shape
                    ),
                ));
            }
            let a_raw = src.get_shaped(name, &[rank, k])?;
            let b_name = format!("{stem}.lora_B.weight");
            let b_raw = src.get_shaped(&b_name, &[n, rank]).map_err(|e| match e {
                ModelError::MissingTensor { .. } => {
                    tensor_bad(name, format!("no `{b_name}` beside it"))
                }
                e => e,
            })?;
            let scaling = if rslora {
                alpha / (rank as f64).sqrt()
            } else {
                alpha / rank as f64
            } as f32;
            let a = a_raw.to_f32().data;
            let mut b = b_raw.to_f32().data;
            for (t, values) in [(name, &a), (&b_name, &b)] {
                if let Some((i, x)) = values.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                    return Err(tensor_bad(
                        t,
                        format!("element {i} is {x}: the adapter is corrupt"),
                    ));
                }
            }
            b.iter_mut().for_each(|x| *x *= scaling);
            if let Some(perm) = &perm {
                // The backends hold q and k heads with their dims permuted; so do B's rows.
                let (q_rows, k_rows) = match slice {
                    Slice::Q => (0..q_w, 0..0),
                    Slice::K => (0..0, 0..kv_w),
                    Slice::Qkv => (0..q_w, q_w..q_w + kv_w),
                    _ => (0..0, 0..0),
                };
                for rows in [q_rows, k_rows] {
                    permute_rows(&mut b[rows.start * rank..rows.end * rank], rank, perm);
                }
            }
            max_seen = max_seen.max(rank);
            let parts = &mut layers[li][kind as usize];
            if parts.iter().any(|p| p.out_offset == off && p.n == n) {
                return Err(tensor_bad(name, "given twice".into()));
            }
            parts.push(LoraPart {
                out_offset: off,
                rank,
                k,
                n,
                a,
                b,
            });
        }
        if max_seen == 0 {
            return Err(ModelError::InvalidField {
                file: st_name,
                field: "lora_A".into(),
                reason: "the adapter holds no LoRA weights".into(),
            });
        }
        for l in &mut layers {
            for parts in l.iter_mut() {
                parts.sort_by_key(|p| p.out_offset);
            }
        }
        Ok(Self {
            name: m.name.clone(),
            path: m.path.clone(),
            max_rank: max_seen,
            layers,
        })
    }

    /// Loads every module in order (adapter id `i + 1` is `modules[i]`).
    ///
    /// # Errors
    /// The first [`LoraAdapter::load`] error, prefixed by nothing: the errors name the files.
    pub fn load_all(
        modules: &[LoraModule],
        cfg: &ModelConfig,
        max_rank: usize,
    ) -> Result<Vec<Self>, ModelError> {
        modules
            .iter()
            .map(|m| Self::load(m, cfg, max_rank))
            .collect()
    }

    /// The bytes of its weights (f32 here).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| 4 * (p.a.len() + p.b.len()))
            .sum()
    }
}

/// `(layer, module)` of a LoRA tensor stem such as
/// `base_model.model.model.layers.3.self_attn.q_proj`: the text after the last `layers.N.`.
fn layer_module(stem: &str) -> Option<(usize, &str)> {
    let at = stem.rfind("layers.")?;
    if at > 0 && !stem[..at].ends_with('.') {
        return None;
    }
    let rest = &stem[at + "layers.".len()..];
    let (idx, module) = rest.split_once('.')?;
    Some((idx.parse().ok()?, module))
}

/// Reorders each head's rows of `rows` (`[heads * head_dim, r]`) by `perm`.
fn permute_rows(rows: &mut [f32], r: usize, perm: &[usize]) {
    let d = perm.len();
    let head = d * r;
    for h in rows.chunks_exact_mut(head) {
        let orig = h.to_vec();
        for (j, &from) in perm.iter().enumerate() {
            h[j * r..(j + 1) * r].copy_from_slice(&orig[from * r..(from + 1) * r]);
        }
    }
}

/// A 64-bit fingerprint of a list of adapters: per module, its name, `adapter_config.json`'s
/// bytes and [`crate::weights_fingerprint`] of its safetensors file; 0 for no module. The
/// scheduler publishes it and every worker and frontend checks theirs, so adapter id `i`
/// means the same adapter in every process.
///
/// # Errors
/// A missing or unreadable file, a corrupt safetensors file.
pub fn lora_fingerprint(modules: &[LoraModule]) -> Result<u64, ModelError> {
    if modules.is_empty() {
        return Ok(0);
    }
    let mut h = Fnv64::default();
    h.eat(b"lora");
    for m in modules {
        let (c, st) = files(&m.path);
        h.eat(m.name.as_bytes());
        h.eat(&[0xff]);
        h.eat(read_text(&c)?.as_bytes());
        h.eat_u64(crate::weights_fingerprint(&WeightSource::open_file(&st)?)?);
    }
    Ok(h.finish())
}

/// The modules [`write_dummy_adapter`] targets, HF names.
pub const DUMMY_TARGETS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// Writes a seeded random PEFT adapter for a dense model of config `cfg` into `dir`
/// (`adapter_config.json` with `r = rank`, `lora_alpha = alpha`, and
/// `adapter_model.safetensors` of f32 `lora_A`/`lora_B` for every [`DUMMY_TARGETS`] module
/// of every layer), values uniform in `±amplitude` (for tests and benchmarks, as
/// `--load-format dummy` is for weights). The `(A, B)` of a module come from
/// [`dummy_lora_values`].
///
/// # Errors
/// [`ModelError::Io`] when `dir` cannot be created or written.
pub fn write_dummy_adapter(
    dir: &Path,
    cfg: &ModelConfig,
    rank: usize,
    alpha: f64,
    amplitude: f32,
    seed: u64,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, &e))?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": DUMMY_TARGETS.iter().map(|m| m.rsplit('.').next().unwrap_or(m)).collect::<Vec<_>>(),
        "bias": "none",
        "use_rslora": false,
        "base_model_name_or_path": "dummy",
    });
    let c = dir.join("adapter_config.json");
    std::fs::write(&c, config.to_string()).map_err(|e| ModelError::io(&c, &e))?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for li in 0..cfg.num_hidden_layers {
        for m in DUMMY_TARGETS {
            let (k, n) = dummy_module_shape(cfg, m);
            let (a, b) = dummy_lora_values(seed, li, m, rank, k, n, amplitude);
            let stem = format!("base_model.model.model.layers.{li}.{m}");
            let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            tensors.push((format!("{stem}.lora_A.weight"), vec![rank, k], le(&a)));
            tensors.push((format!("{stem}.lora_B.weight"), vec![n, rank], le(&b)));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .expect("shape and byte count agree");
            (name.clone(), view)
        })
        .collect();
    let st = dir.join("adapter_model.safetensors");
    safetensors::serialize_to_file(views, None, &st).map_err(|e| ModelError::Io {
        file: st.display().to_string(),
        reason: e.to_string(),
    })
}

/// `(in, out)` widths of an HF module name of [`DUMMY_TARGETS`] for `cfg`.
pub fn dummy_module_shape(cfg: &ModelConfig, module: &str) -> (usize, usize) {
    let (h, im) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    );
    match module {
        "self_attn.q_proj" => (h, q),
        "self_attn.k_proj" | "self_attn.v_proj" => (h, kv),
        "self_attn.o_proj" => (q, h),
        "mlp.down_proj" => (im, h),
        _ => (h, im),
    }
}

/// The `(A [rank, k], B [n, rank])` values [`write_dummy_adapter`] stores for `module` of
/// layer `layer`: splitmix64 draws mapped to `±amplitude`, a function of the arguments only.
pub fn dummy_lora_values(
    seed: u64,
    layer: usize,
    module: &str,
    rank: usize,
    k: usize,
    n: usize,
    amplitude: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut h = Fnv64::default();
    h.eat_u64(seed);
    h.eat_u64(layer as u64);
    h.eat(module.as_bytes());
    let mut state = h.finish();
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amplitude
    };
    let a = (0..rank * k).map(|_| next()).collect();
    let b = (0..n * rank).map(|_| next()).collect();
    (a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_module_forms_and_refuses_bad_ones() {
        let m = LoraModule::parse("sql=/a/b").unwrap();
        assert_eq!(
            (m.name.as_str(), m.path.as_path()),
            ("sql", Path::new("/a/b"))
        );
        let j = LoraModule::parse(r#"{"name": "x", "path": "p", "base_model_name": "m"}"#).unwrap();
        assert_eq!((j.name.as_str(), j.path.as_path()), ("x", Path::new("p")));
        for bad in [
            "nopath",
            "=p",
            "a=",
            "a b=p",
            r#"{"name": "x"}"#,
            r#"{"name": 1, "path": "p"}"#,
            r#"{"name": "x", "path": "p", "rank": 8}"#,
            "{bad",
        ] {
            assert!(LoraModule::parse(bad).is_err(), "{bad}");
        }
        assert!(LoraModule::parse_all(&["a=p".into(), "a=q".into()]).is_err());
        assert_eq!(
            LoraModule::parse_all(&["a=p".into(), "b=q".into()])
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn layer_module_reads_peft_names() {
        assert_eq!(
            layer_module("base_model.model.model.layers.3.self_attn.q_proj"),
            Some((3, "self_attn.q_proj"))
        );
        assert_eq!(
            layer_module("base_model.model.model.language_model.layers.12.mlp.down_proj"),
            Some((12, "mlp.down_proj"))
        );
        assert_eq!(layer_module("base_model.model.lm_head"), None);
        assert_eq!(layer_module("base_model.model.xlayers.1.mlp.up_proj"), None);
    }

    #[test]
    fn a_part_adds_b_times_a_x_at_its_offset() {
        // r = 2, k = 3, n = 2 at offset 1 of a 4-wide output.
        let p = LoraPart {
            out_offset: 1,
            rank: 2,
            k: 3,
            n: 2,
            a: vec![1.0, 0.0, 2.0, 0.0, 1.0, -1.0],
            b: vec![1.0, 1.0, 0.5, -2.0],
        };
        let x = [1.0, 2.0, 3.0];
        let mut out = [10.0; 4];
        let mut v = [0.0; 2];
        p.apply_token(&x, &mut out, &mut v);
        // A x = [7, -1]; B (A x) = [6, 5.5].
        assert_eq!(out, [10.0, 16.0, 15.5, 10.0]);
    }

    #[test]
    fn permute_rows_follows_the_head_permutation() {
        let mut rows: Vec<f32> = (0..8).map(|i| i as f32).collect(); // 2 heads of 4 dims, r=1
        permute_rows(&mut rows, 1, &[0, 2, 1, 3]);
        assert_eq!(rows, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    }
}
