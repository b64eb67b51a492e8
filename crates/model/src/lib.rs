//! baton-model: Hugging Face Llama-family model loading and the f32 CPU reference forward pass.
//!
//! Contract: [`load_model_dir`] turns a HF model directory (config.json, optional
//! generation_config.json, tokenizer.json + tokenizer_config.json, model.safetensors or a sharded
//! index) into a [`LoadedModel`], or a [`ModelError`] naming the file and field/tensor at fault;
//! [`CpuModel::forward`] runs batched prefill/decode rows over a [`PagedKvCache`] with HF
//! `modeling_llama.py` numerics and per-row bit-exact batch invariance.

#![warn(missing_docs)]

mod attention;
pub mod config;
pub mod cpu;
pub mod error;
pub mod fingerprint;
pub mod gguf;
pub mod gguf_quant;
pub mod gguf_tokenizer;
mod linear;
mod linear_q8;
pub mod lora;
pub mod quant;
pub mod tokenizer;
mod vmath;
pub mod weights;

pub use config::{
    Activation, GenerationConfig, ModelConfig, MoeConfig, MoeNaming, RopeScaling, TokenizerConfig,
};
pub use cpu::{CpuModel, ForwardRow, LogitsAndLayers, MoeTrace, PagedKvCache};
pub use error::{ForwardError, ModelError};
pub use fingerprint::{dummy_weights_fingerprint, tokenizer_fingerprint, weights_fingerprint};
pub use lora::{LoraAdapter, LoraModule};
pub use tokenizer::Tokenizer;
pub use weights::{
    DType, LayerWeights, LlamaWeights, ModelWeights, MoeWeights, RawTensor, Tensor, WeightSource,
};

use std::path::{Path, PathBuf};

/// How weights are obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// Read safetensors weights; tokenizer.json is required.
    #[default]
    Auto,
    /// Seeded random weights from config.json alone ([`LlamaWeights::dummy`]); the tokenizer is
    /// loaded only if tokenizer.json exists.
    Dummy {
        /// RNG seed.
        seed: u64,
    },
}

/// Where the generation config comes from: vLLM's `--generation-config auto|vllm|DIR`
/// (parsed from the flag's value by [`std::str::FromStr`]; read by
/// [`ModelDir::generation_config_from`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum GenerationConfigSource {
    /// `auto`: the model directory's generation_config.json gives the sampling defaults and
    /// the stop ids; a malformed file is an error.
    #[default]
    Auto,
    /// `vllm`: no sampling defaults (the OpenAI ones apply). The stop ids still come from the
    /// model directory's generation_config.json, as vLLM loads that file for them under
    /// `vllm` too; a file that does not load is then ignored and its error returned for the
    /// caller to report.
    Vllm,
    /// `DIR`: `DIR/generation_config.json`, which must exist, gives the sampling defaults and
    /// the stop ids (the model directory's file is not read).
    Dir(PathBuf),
}

impl std::str::FromStr for GenerationConfigSource {
    type Err = String;

    /// `auto`, `vllm`, or any other non-empty string as a directory.
    ///
    /// # Errors
    /// An empty string.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "vllm" => Ok(Self::Vllm),
            "" => Err("expected auto, vllm or a directory holding generation_config.json".into()),
            dir => Ok(Self::Dir(PathBuf::from(dir))),
        }
    }
}

impl std::fmt::Display for GenerationConfigSource {
    /// The flag value that parses back to this source.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Vllm => f.write_str("vllm"),
            Self::Dir(d) => write!(f, "{}", d.display()),
        }
    }
}

/// The files of a HF model directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDir {
    /// The directory.
    pub root: PathBuf,
    /// Where tokenizer.json and tokenizer_config.json are read from instead of `root`
    /// (vLLM's `--tokenizer`); `None`: from `root`.
    pub tokenizer_root: Option<PathBuf>,
}

impl ModelDir {
    /// Wraps a directory path (nothing is read yet).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ModelDir {
            root: root.into(),
            tokenizer_root: None,
        }
    }

    /// Reads the tokenizer files from `dir` instead (vLLM's `--tokenizer`: a directory with
    /// tokenizer.json and optionally tokenizer_config.json, whose chat template then applies);
    /// `None` keeps the model directory's.
    pub fn with_tokenizer(mut self, dir: Option<impl Into<PathBuf>>) -> Self {
        self.tokenizer_root = dir.map(Into::into);
        self
    }

    fn tokenizer_dir(&self) -> &Path {
        self.tokenizer_root.as_deref().unwrap_or(&self.root)
    }

    /// `config.json`.
    pub fn config_path(&self) -> PathBuf {
        self.root.join("config.json")
    }

    /// `generation_config.json` (optional).
    pub fn generation_config_path(&self) -> PathBuf {
        self.root.join("generation_config.json")
    }

    /// `tokenizer.json`, of the tokenizer directory when one is set.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.tokenizer_dir().join("tokenizer.json")
    }

    /// `tokenizer_config.json` (optional), of the tokenizer directory when one is set.
    pub fn tokenizer_config_path(&self) -> PathBuf {
        self.tokenizer_dir().join("tokenizer_config.json")
    }

    /// Loads everything per `format`; see [`load_model_dir_with`] (the tokenizer from the
    /// tokenizer directory when one is set).
    ///
    /// # Errors
    /// As [`load_model_dir_with`].
    pub fn load(&self, format: LoadFormat) -> Result<LoadedModel, ModelError> {
        load_dir(self, format)
    }

    /// The fingerprint of the weights `format` names, without loading them: the stored
    /// tensors' ([`weights_fingerprint`]) or the dummy seed's ([`dummy_weights_fingerprint`]).
    /// Equal to [`MappedModel::weights_fingerprint`] of the same directory and format.
    ///
    /// # Errors
    /// As [`WeightSource::open`] for [`LoadFormat::Auto`].
    pub fn weights_fingerprint(&self, format: LoadFormat) -> Result<u64, ModelError> {
        match format {
            LoadFormat::Auto => weights_fingerprint(&WeightSource::open(&self.root)?),
            LoadFormat::Dummy { seed } => Ok(dummy_weights_fingerprint(seed)),
        }
    }

    /// [`ModelDir::weights_fingerprint`] after checking that the stored tensor names fit a
    /// model of `cfg` ([`WeightSource::check_tensor_names`]), so that a checkpoint the
    /// workers' load would refuse is refused with the same error (not with one about the
    /// fingerprint). For a process that publishes the fingerprint without loading weights
    /// (the scheduler).
    ///
    /// # Errors
    /// As [`WeightSource::open`], [`ModelError::ExtraLayers`], [`ModelError::UnusedTensors`],
    /// as [`weights_fingerprint`].
    pub fn checked_weights_fingerprint(
        &self,
        format: LoadFormat,
        cfg: &ModelConfig,
    ) -> Result<u64, ModelError> {
        match format {
            LoadFormat::Auto => {
                let src = WeightSource::open_names_for(&self.root, cfg)?;
                src.check_tensor_names(cfg)?;
                weights_fingerprint(&src)
            }
            LoadFormat::Dummy { .. } => self.weights_fingerprint(format),
        }
    }

    /// The model's stop token ids (as [`LoadedModel::eos_token_ids`]) without loading weights.
    ///
    /// # Errors
    /// A missing or malformed config.json, a malformed generation_config.json or tokenizer.
    pub fn eos_token_ids(&self) -> Result<Vec<u32>, ModelError> {
        let m = load_meta(self, LoadFormat::Dummy { seed: 0 }, false)?;
        Ok(eos_token_ids(
            &m.generation_config,
            &m.config,
            m.tokenizer.as_ref(),
        ))
    }

    /// [`ModelDir::eos_token_ids`], except that a generation_config.json that does not load
    /// is ignored (the ids then come from config.json, else the tokenizer) and its error
    /// returned beside them for the caller to report: what `--generation-config vllm` needs,
    /// and what a process that takes only the stop ids from that file can do whatever the
    /// flag (the frontend, which reads the sampling defaults, refuses the file under `auto`).
    ///
    /// # Errors
    /// A missing or malformed config.json or tokenizer.
    pub fn eos_token_ids_lenient(&self) -> Result<(Vec<u32>, Option<ModelError>), ModelError> {
        let m = load_meta(self, LoadFormat::Dummy { seed: 0 }, true)?;
        let ids = eos_token_ids(&m.generation_config, &m.config, m.tokenizer.as_ref());
        Ok((ids, m.generation_config_error))
    }

    /// The model's stop ids ([`model_stop_ids`]) with the generation config `source` gives
    /// ([`ModelDir::generation_config_from`]): what the frontend stops on, and what a
    /// structured output may end with. Under [`GenerationConfigSource::Vllm`] a file that
    /// does not load is ignored and its error returned beside the ids, for the caller to
    /// report.
    ///
    /// # Errors
    /// As [`ModelDir::generation_config_from`]; a missing or malformed config.json or
    /// tokenizer.
    pub fn eos_token_ids_from(
        &self,
        source: &GenerationConfigSource,
    ) -> Result<(Vec<u32>, Option<ModelError>), ModelError> {
        let (g, skipped) = self.generation_config_from(source)?;
        let m = load_meta(self, LoadFormat::Dummy { seed: 0 }, true)?;
        Ok((eos_token_ids(&g, &m.config, m.tokenizer.as_ref()), skipped))
    }

    /// generation_config.json, or the default (no values) when the file does not exist.
    ///
    /// # Errors
    /// An unreadable or malformed file, named.
    pub fn generation_config(&self) -> Result<GenerationConfig, ModelError> {
        let p = self.generation_config_path();
        if p.exists() {
            GenerationConfig::from_file(&p)
        } else {
            Ok(GenerationConfig::default())
        }
    }

    /// The generation config `source` gives for this model: under
    /// [`GenerationConfigSource::Auto`] this directory's generation_config.json (the default,
    /// no values, when absent); under [`GenerationConfigSource::Vllm`] only that file's
    /// `eos_token_ids` (the sampling fields `None`), and when the file does not load, no
    /// values and its error beside them, for the caller to report; under
    /// [`GenerationConfigSource::Dir`] `DIR/generation_config.json`, whole. The stop ids of a
    /// model are these `eos_token_ids`, else config.json's, else the tokenizer's EOS
    /// ([`MappedModel::eos_token_ids`]).
    ///
    /// # Errors
    /// Under `Auto`, an unreadable or malformed generation_config.json; under `Dir`, a
    /// `DIR/generation_config.json` that is missing ([`ModelError::Io`] naming it),
    /// unreadable or malformed.
    pub fn generation_config_from(
        &self,
        source: &GenerationConfigSource,
    ) -> Result<(GenerationConfig, Option<ModelError>), ModelError> {
        match source {
            GenerationConfigSource::Auto => Ok((self.generation_config()?, None)),
            GenerationConfigSource::Vllm => Ok(match self.generation_config() {
                Ok(g) => (
                    GenerationConfig {
                        eos_token_ids: g.eos_token_ids,
                        ..GenerationConfig::default()
                    },
                    None,
                ),
                Err(e) => (GenerationConfig::default(), Some(e)),
            }),
            GenerationConfigSource::Dir(dir) => {
                let p = ModelDir::new(dir).generation_config_path();
                if !p.is_file() {
                    return Err(ModelError::Io {
                        file: p.display().to_string(),
                        reason: "no such file (--generation-config DIR needs \
                                 DIR/generation_config.json)"
                            .into(),
                    });
                }
                Ok((GenerationConfig::from_file(&p)?, None))
            }
        }
    }

    /// [`ModelDir::load_mapped`] with the generation config `source` gives
    /// ([`ModelDir::generation_config_from`]) in [`MappedModel::generation_config`] (so
    /// [`MappedModel::eos_token_ids`] follows it) and, under
    /// [`GenerationConfigSource::Vllm`], the ignored file's error in
    /// [`MappedModel::generation_config_error`]. The generation config is read first, so its
    /// errors come before the weights'.
    ///
    /// # Errors
    /// As [`ModelDir::generation_config_from`], then as [`ModelDir::load_mapped`] less the
    /// model directory's generation config.
    pub fn load_mapped_from(
        &self,
        format: LoadFormat,
        source: &GenerationConfigSource,
    ) -> Result<MappedModel, ModelError> {
        let (generation_config, ignored) = self.generation_config_from(source)?;
        let mut m = self.load_mapped_with(format, true)?;
        m.generation_config = generation_config;
        m.generation_config_error = ignored;
        Ok(m)
    }

    /// Loads everything as [`ModelDir::load`] does, except that safetensors weights stay
    /// memory-mapped ([`ModelWeights::Mapped`], checked but not converted) for a device
    /// backend to read in their stored dtype. Dummy weights are generated in f32 as before.
    ///
    /// # Errors
    /// As [`load_model_dir_with`].
    pub fn load_mapped(&self, format: LoadFormat) -> Result<MappedModel, ModelError> {
        self.load_mapped_with(format, false)
    }

    /// [`ModelDir::load_mapped`], except that a generation_config.json that does not load is
    /// ignored: [`MappedModel::generation_config_error`] holds its error and the stop ids come
    /// from config.json, else the tokenizer (as [`ModelDir::eos_token_ids_lenient`]). For a
    /// worker, which uses nothing from that file.
    ///
    /// # Errors
    /// As [`ModelDir::load_mapped`], less the generation config's.
    pub fn load_mapped_lenient(&self, format: LoadFormat) -> Result<MappedModel, ModelError> {
        self.load_mapped_with(format, true)
    }

    /// config.json and the weights only, for a worker: it uses neither generation_config.json
    /// nor the tokenizer (the scheduler and the frontends do), so neither is read and a
    /// worker's model directory needs only config.json and the safetensors. The result's
    /// generation config is the default and its tokenizer `None`.
    ///
    /// # Errors
    /// As [`ModelDir::load_mapped`], less the generation config's and the tokenizer's.
    pub fn load_mapped_weights(&self, format: LoadFormat) -> Result<MappedModel, ModelError> {
        let meta = Meta {
            config: ModelConfig::from_file(&self.config_path())?,
            generation_config: GenerationConfig::default(),
            generation_config_error: None,
            tokenizer: None,
        };
        self.load_mapped_meta(format, meta)
    }

    fn load_mapped_with(
        &self,
        format: LoadFormat,
        lenient: bool,
    ) -> Result<MappedModel, ModelError> {
        self.load_mapped_meta(format, load_meta(self, format, lenient)?)
    }

    fn load_mapped_meta(&self, format: LoadFormat, meta: Meta) -> Result<MappedModel, ModelError> {
        let Meta {
            config,
            generation_config,
            generation_config_error,
            tokenizer,
        } = meta;
        let (weights, weights_fingerprint) = match format {
            LoadFormat::Auto => {
                let src = WeightSource::open_for(&self.root, &config)?;
                src.check_llama(&config)?;
                let f = weights_fingerprint(&src)?;
                (ModelWeights::Mapped(src), f)
            }
            LoadFormat::Dummy { seed } => {
                check_dummy_fits(&config)?;
                (
                    ModelWeights::Host(LlamaWeights::dummy(&config, seed)),
                    dummy_weights_fingerprint(seed),
                )
            }
        };
        Ok(MappedModel {
            weights_fingerprint,
            config,
            generation_config,
            generation_config_error,
            tokenizer,
            weights,
        })
    }
}

/// A model directory loaded for a device backend ([`ModelDir::load_mapped`]).
#[derive(Debug)]
pub struct MappedModel {
    /// Parsed config.json.
    pub config: ModelConfig,
    /// Parsed generation_config.json (default when absent, or when it did not load under
    /// [`ModelDir::load_mapped_lenient`]).
    pub generation_config: GenerationConfig,
    /// Why generation_config.json was ignored ([`ModelDir::load_mapped_lenient`] only).
    pub generation_config_error: Option<ModelError>,
    /// The tokenizer; always `Some` for [`LoadFormat::Auto`].
    pub tokenizer: Option<Tokenizer>,
    /// Mapped safetensors, or f32 dummy weights.
    pub weights: ModelWeights,
    /// [`ModelDir::weights_fingerprint`] of these weights (a worker checks it against the
    /// scheduler's at attach).
    pub weights_fingerprint: u64,
}

impl MappedModel {
    /// Builds the CPU model, consuming the weights: mapped ones layer by layer
    /// ([`CpuModel::from_source`]: a bf16 checkpoint never exists whole as f32).
    ///
    /// # Errors
    /// As [`CpuModel::from_source`] and [`CpuModel::try_new`].
    pub fn into_cpu_model(self) -> Result<(CpuModel, Option<Tokenizer>), ModelError> {
        let model = match self.weights {
            ModelWeights::Host(w) => CpuModel::try_new(self.config, w)?,
            ModelWeights::Mapped(src) => CpuModel::from_source(self.config, &src)?,
        };
        Ok((model, self.tokenizer))
    }

    /// Stop token ids, as [`LoadedModel::eos_token_ids`].
    pub fn eos_token_ids(&self) -> Vec<u32> {
        eos_token_ids(
            &self.generation_config,
            &self.config,
            self.tokenizer.as_ref(),
        )
    }
}

/// The tokenizer's EOS, then generation_config's `eos_token_id`s (config.json's when it has
/// none): [`model_stop_ids`].
fn eos_token_ids(
    generation_config: &GenerationConfig,
    config: &ModelConfig,
    tokenizer: Option<&Tokenizer>,
) -> Vec<u32> {
    model_stop_ids(
        tokenizer.and_then(Tokenizer::eos_id),
        &generation_config.eos_token_ids,
        &config.eos_token_ids,
    )
}

/// A model's stop ids as vLLM gathers them: the tokenizer's EOS (`tokenizer_eos`, which
/// always ends a request unless `ignore_eos`), then the generation config's `eos_token_id`s
/// (`generation_ids`; vLLM's `SamplingParams.update_from_generation_config` adds them to the
/// request's stop ids), or config.json's (`config_ids`) when the generation config has none.
/// Each id once, the tokenizer's first (a chat template's `eos_token` falls back to it).
pub fn model_stop_ids(
    tokenizer_eos: Option<u32>,
    generation_ids: &[u32],
    config_ids: &[u32],
) -> Vec<u32> {
    let more = if generation_ids.is_empty() {
        config_ids
    } else {
        generation_ids
    };
    let mut ids: Vec<u32> = tokenizer_eos.into_iter().collect();
    for &id in more {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// A loaded model directory.
#[derive(Debug)]
pub struct LoadedModel {
    /// Parsed config.json.
    pub config: ModelConfig,
    /// Parsed generation_config.json (default when absent).
    pub generation_config: GenerationConfig,
    /// The tokenizer; always `Some` for [`LoadFormat::Auto`].
    pub tokenizer: Option<Tokenizer>,
    /// f32 weights.
    pub weights: LlamaWeights,
}

impl LoadedModel {
    /// Stop token ids: generation_config's `eos_token_id`s, else config.json's, else the
    /// tokenizer's EOS.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        eos_token_ids(
            &self.generation_config,
            &self.config,
            self.tokenizer.as_ref(),
        )
    }

    /// Builds the CPU model, consuming the weights.
    pub fn into_cpu_model(self) -> (CpuModel, Option<Tokenizer>) {
        (CpuModel::new(self.config, self.weights), self.tokenizer)
    }
}

/// Loads a model directory with [`LoadFormat::Auto`].
///
/// # Errors
/// As [`load_model_dir_with`].
pub fn load_model_dir(path: impl AsRef<Path>) -> Result<LoadedModel, ModelError> {
    load_model_dir_with(path.as_ref(), LoadFormat::Auto)
}

/// Loads config.json, generation_config.json (if present), the tokenizer and the weights.
///
/// # Errors
/// Any [`ModelError`]: missing/unreadable files, bad JSON, missing or invalid fields,
/// unsupported architecture/model_type/features, missing tensors, wrong shapes, unsupported
/// dtypes, inconsistent shard index, tokenizer failures. Never panics on bad input.
pub fn load_model_dir_with(path: &Path, format: LoadFormat) -> Result<LoadedModel, ModelError> {
    load_dir(&ModelDir::new(path), format)
}

fn load_dir(dir: &ModelDir, format: LoadFormat) -> Result<LoadedModel, ModelError> {
    let path = dir.root.as_path();
    let Meta {
        config,
        generation_config,
        tokenizer,
        ..
    } = load_meta(dir, format, false)?;
    let weights = match format {
        LoadFormat::Auto => LlamaWeights::load(&config, &WeightSource::open_for(path, &config)?)?,
        LoadFormat::Dummy { seed } => LlamaWeights::dummy(&config, seed),
    };
    Ok(LoadedModel {
        config,
        generation_config,
        tokenizer,
        weights,
    })
}

/// What [`load_meta`] reads.
struct Meta {
    config: ModelConfig,
    generation_config: GenerationConfig,
    /// The generation config's error when `lenient` ignored it.
    generation_config_error: Option<ModelError>,
    tokenizer: Option<Tokenizer>,
}

/// config.json, generation_config.json (default when absent, and with `lenient` when it does
/// not load, its error kept) and the tokenizer (required for [`LoadFormat::Auto`], loaded
/// when present otherwise).
fn load_meta(dir: &ModelDir, format: LoadFormat, lenient: bool) -> Result<Meta, ModelError> {
    let config = ModelConfig::from_file(&dir.config_path())?;
    let (generation_config, generation_config_error) = match dir.generation_config() {
        Ok(g) => (g, None),
        Err(e) if lenient => (GenerationConfig::default(), Some(e)),
        Err(e) => return Err(e),
    };
    let tok_path = dir.tokenizer_path();
    let tokenizer = if matches!(format, LoadFormat::Auto) || tok_path.exists() {
        let tc_path = dir.tokenizer_config_path();
        let tc = if tc_path.exists() {
            TokenizerConfig::from_file(&tc_path)?
        } else {
            TokenizerConfig::default()
        };
        Some(Tokenizer::from_file(&tok_path, tc)?)
    } else {
        None
    };
    Ok(Meta {
        config,
        generation_config,
        generation_config_error,
        tokenizer,
    })
}

/// f32 values [`LlamaWeights::dummy`] allocates for `cfg`: the embedding and LM head, the
/// final norm and every layer's tensors.
pub fn dummy_weight_elems(cfg: &ModelConfig) -> u128 {
    let vh = cfg.vocab_size as u128 * cfg.hidden_size as u128;
    let layers: u128 = (0..cfg.num_hidden_layers)
        .map(|i| {
            weights::layer_tensor_shapes(cfg, i)
                .iter()
                .map(|(_, s)| s.iter().map(|&d| d as u128).product::<u128>())
                .sum::<u128>()
        })
        .sum();
    2 * vh + cfg.hidden_size as u128 + layers
}

/// Host memory this process may still take (`MemAvailable` of /proc/meminfo), in bytes;
/// `None` where that is not known.
pub fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses dummy weights ([`LlamaWeights::dummy`]) that would not fit in host memory, rather
/// than abort on the allocation part way.
///
/// # Errors
/// [`ModelError::TooLarge`] when [`dummy_weight_elems`] f32 values exceed
/// [`host_memory_available`].
pub fn check_dummy_fits(cfg: &ModelConfig) -> Result<(), ModelError> {
    let need = dummy_weight_elems(cfg) * 4;
    match host_memory_available() {
        Some(avail) if need > avail as u128 => Err(ModelError::TooLarge {
            what: "--load-format dummy weights of this config (f32)".into(),
            need_gib: need as f64 / (1u64 << 30) as f64,
            available_gib: avail as f64 / (1u64 << 30) as f64,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::model_stop_ids;

    #[test]
    fn stop_ids_are_the_tokenizers_eos_then_the_generation_configs() {
        // Llama 3.1 Instruct: the tokenizer's <|eot_id|>, then the generation config's three.
        assert_eq!(
            model_stop_ids(Some(128009), &[128001, 128008, 128009], &[128001]),
            [128009, 128001, 128008]
        );
        // A generation config without the tokenizer's EOS adds to it, not replaces it.
        assert_eq!(model_stop_ids(Some(2), &[376], &[2]), [2, 376]);
        // No generation-config ids: config.json's.
        assert_eq!(model_stop_ids(Some(2), &[], &[2, 7]), [2, 7]);
        assert_eq!(model_stop_ids(None, &[], &[7]), [7]);
        assert!(model_stop_ids(None, &[], &[]).is_empty());
    }
}
