//! `baton generate`: offline generation over the in-process engine.

use crate::args::{EngineArgs, KvCacheDtype};
use crate::cuda_args::{
    build_cuda, check_cuda_device, check_cuda_kv_dtype, model_dtype, CudaArgs, CudaSizes,
};
use crate::engine::LocalEngine;
use anyhow::{bail, Context, Result};
use baton_model::{GenerationConfig, GenerationConfigSource, LoadFormat, ModelDir, Tokenizer};
use baton_proto::SamplingParams;
use baton_scheduler::{Event, FinishReason, NewRequest};
use baton_worker::{Backend, CpuBackend};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How weights are loaded (vLLM's `--load-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoadFormatArg {
    /// Read the safetensors files.
    Auto,
    /// Seeded random weights from config.json alone (benchmarks).
    Dummy,
    /// Read the safetensors files; a directory without them is an error naming the flag
    /// (vLLM's `safetensors`; Baton reads no other format, so otherwise the same as `auto`).
    Safetensors,
}

impl LoadFormatArg {
    /// The model crate's [`LoadFormat`] for the daemons' `--load-format` and `--seed` (seed 0
    /// by default), checked against the `--model` directory when one is given.
    ///
    /// # Errors
    /// A `--seed` without `--load-format dummy` (it would be ignored); as
    /// [`LoadFormatArg::with_seed`].
    pub fn with_seed_flag(
        self,
        seed: Option<u64>,
        model: Option<&Path>,
    ) -> anyhow::Result<LoadFormat> {
        if self != LoadFormatArg::Dummy && seed.is_some() {
            anyhow::bail!("--seed sets the seed of dummy weights; it needs --load-format dummy");
        }
        self.with_seed(seed.unwrap_or(0), model)
    }

    /// The model crate's [`LoadFormat`], with `seed` for dummy weights (`safetensors` is
    /// [`LoadFormat::Auto`] once `model`, when given, is checked to hold safetensors).
    ///
    /// # Errors
    /// `--load-format safetensors` with a `model` directory that has neither
    /// `model.safetensors` nor `model.safetensors.index.json`.
    pub fn with_seed(self, seed: u64, model: Option<&Path>) -> anyhow::Result<LoadFormat> {
        Ok(match self {
            LoadFormatArg::Auto => LoadFormat::Auto,
            LoadFormatArg::Dummy => LoadFormat::Dummy { seed },
            LoadFormatArg::Safetensors => {
                if let Some(dir) = model {
                    let has = ["model.safetensors", "model.safetensors.index.json"]
                        .iter()
                        .any(|f| dir.join(f).is_file());
                    if !has {
                        anyhow::bail!(
                            "--load-format safetensors: {} has no model.safetensors or \
                             model.safetensors.index.json",
                            dir.display()
                        );
                    }
                }
                LoadFormat::Auto
            }
        })
    }
}

/// Flags of `baton generate`.
#[derive(Args, Clone, Debug)]
pub struct GenerateArgs {
    /// A Hugging Face model directory (config.json, tokenizer.json, *.safetensors) or a
    /// GGUF file (llama.cpp's; quantized types are read in their blocks on the CPU).
    #[arg(long)]
    pub model: PathBuf,
    /// A directory with the tokenizer.json (and optionally tokenizer_config.json, whose chat
    /// template then applies) to use instead of the model directory's (vLLM's `--tokenizer`).
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// A prompt; repeat for several.
    #[arg(long = "prompt")]
    pub prompts: Vec<String>,
    /// A file with one prompt per line.
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// New tokens per prompt [default: the generation config's max_new_tokens, else 16].
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature; 0 is greedy [default: the generation config's, else 1].
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass; 1 disables [default: the generation config's, else 1].
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; 0 or -1 disables [default: the generation config's,
    /// else 0].
    #[arg(long, allow_hyphen_values = true)]
    pub top_k: Option<i32>,
    /// Drop tokens below min_p times the top probability; 0 disables [default: the
    /// generation config's, else 0].
    #[arg(long, allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// Subtracted once from the logit of every token already generated (OpenAI
    /// `presence_penalty`), in [-2, 2]; 0 disables.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI
    /// `frequency_penalty`), in [-2, 2]; 0 disables.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Divides positive and multiplies negative logits of tokens in the prompt or the output
    /// (vLLM `repetition_penalty`), > 0; 1 disables [default: the generation config's,
    /// else 1].
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f32>,
    /// Where the sampling defaults and stop ids come from (vLLM's flag): "auto" reads the
    /// model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    /// max_new_tokens as --max-tokens, for the flags not given; eos_token_id as stop ids);
    /// "vllm" takes no defaults from it (the stop ids still; a malformed file is then only a
    /// warning); anything else is a directory whose generation_config.json gives both.
    #[arg(long, default_value = "auto")]
    pub generation_config: GenerationConfigSource,
    /// No stop token (EOS included) is sampled before this many new tokens (vLLM
    /// `min_tokens`); at most --max-tokens.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: u32,
    /// Seed of every request's random stream (default: a random seed per request).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Weight loading.
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// vLLM's `--quantization` (`-q`): the checkpoint's quantization method, which must be
    /// the `quant_method` of config.json's `quantization_config` (`fp8` or
    /// `compressed-tensors`). Not needed: FP8 checkpoints load without it (dequantized at
    /// load). Naming a method the checkpoint does not use is refused, as vLLM does; online
    /// quantization of an unquantized checkpoint is not supported.
    #[arg(long, short = 'q')]
    pub quantization: Option<String>,
    /// Threads of the CPU backend's forward pass (0: one per available CPU).
    #[arg(long, default_value_t = 0, value_parser = crate::args::parse_cpu_threads)]
    pub cpu_threads: usize,
    /// 8-bit activations for a GGUF file's quantized matrices (the CPU backend's default).
    #[command(flatten)]
    pub int8: crate::args::Int8Args,
    /// Print one JSON object per prompt (ids, text, finish reason) instead of plain text.
    #[arg(long)]
    pub json: bool,
    /// Device: the CPU reference or CUDA.
    #[arg(long, value_enum, default_value_t = GenDevice::Cpu)]
    pub device: GenDevice,
    /// Scheduler and KV-cache flags.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// CUDA flags (with --device cuda).
    #[command(flatten)]
    pub cuda: CudaArgs,
    /// LoRA adapters to load (--enable-lora --lora-modules NAME=PATH ...).
    #[command(flatten)]
    pub lora_args: crate::args::LoraArgs,
    /// The adapter every prompt runs with: a NAME of --lora-modules (vLLM's `LoRARequest`);
    /// the base model when not given.
    #[arg(long, value_name = "NAME")]
    pub lora: Option<String>,
}

/// Devices `baton generate` runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GenDevice {
    /// The f32 CPU reference backend.
    Cpu,
    /// NVIDIA GPU through CUDA.
    Cuda,
}

/// One finished generation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    /// The prompt text.
    pub prompt: String,
    /// Prompt token ids (BOS included).
    pub prompt_ids: Vec<u32>,
    /// New token ids.
    pub ids: Vec<u32>,
    /// Text that follows the prompt.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

/// A sampling value and where it came from: the flag, the generation config, or the
/// OpenAI default.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sourced<T> {
    /// The value used.
    pub value: T,
    /// The generation config's field it came from, when the flag was not given.
    pub from_config: Option<&'static str>,
}

impl<T> Sourced<T> {
    /// `flag` alone, or with the generation config's field the value came from, for
    /// messages.
    fn name(&self, flag: &str, source: &GenerationConfigSource) -> String {
        match self.from_config {
            None => flag.to_owned(),
            Some(field) => {
                format!("{flag} (the generation config's {field}, --generation-config {source})")
            }
        }
    }
}

/// The sampling values of `baton generate`: a flag given wins, else the generation config's
/// default (vLLM's `--generation-config`), else OpenAI's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// `--temperature` (default 1).
    pub temperature: Sourced<f32>,
    /// `--top-p` (default 1).
    pub top_p: Sourced<f32>,
    /// `--top-k` (default 0: off).
    pub top_k: Sourced<i32>,
    /// `--min-p` (default 0).
    pub min_p: Sourced<f32>,
    /// `--repetition-penalty` (default 1).
    pub repetition_penalty: Sourced<f32>,
    /// `--max-tokens` (default 16; the generation config's `max_new_tokens`).
    pub max_tokens: Sourced<u32>,
}

/// The flag's value if given, else the generation config's `field` if set, else `default`.
fn pick<T>(flag: Option<T>, config: Option<T>, field: &'static str, default: T) -> Sourced<T> {
    match (flag, config) {
        (Some(value), _) => Sourced {
            value,
            from_config: None,
        },
        (None, Some(value)) => Sourced {
            value,
            from_config: Some(field),
        },
        (None, None) => Sourced {
            value: default,
            from_config: None,
        },
    }
}

impl Sampling {
    /// The values of `a`'s flags over the defaults of `g` (the generation config
    /// `--generation-config` gave: [`baton_model::ModelDir::generation_config_from`]).
    pub fn resolve(a: &GenerateArgs, g: &GenerationConfig) -> Self {
        // A top_k past i32 keeps every token, as i32::MAX does.
        let top_k = g.top_k.map(|k| k.min(i64::from(i32::MAX)) as i32);
        Sampling {
            temperature: pick(a.temperature, g.temperature, "temperature", 1.0),
            top_p: pick(a.top_p, g.top_p, "top_p", 1.0),
            top_k: pick(a.top_k, top_k, "top_k", 0),
            min_p: pick(a.min_p, g.min_p, "min_p", 0.0),
            repetition_penalty: pick(
                a.repetition_penalty,
                g.repetition_penalty,
                "repetition_penalty",
                1.0,
            ),
            max_tokens: pick(a.max_tokens, g.max_new_tokens, "max_new_tokens", 16),
        }
    }

    /// The request parameters of these values and `a`'s penalties.
    fn params(&self, a: &GenerateArgs) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.value,
            top_p: self.top_p.value,
            top_k: self.top_k.value,
            min_p: self.min_p.value,
            presence_penalty: a.presence_penalty,
            frequency_penalty: a.frequency_penalty,
            repetition_penalty: self.repetition_penalty.value,
            ..SamplingParams::greedy()
        }
    }
}

/// Checks the sampling values, naming the flag (and the generation config's field when the
/// value came from there).
fn validate_sampling(a: &GenerateArgs, s: &Sampling) -> Result<()> {
    let src = &a.generation_config;
    let t = s.temperature.value;
    if !t.is_finite() || t < 0.0 {
        bail!(
            "{} must be a finite number >= 0, got {t}",
            s.temperature.name("--temperature", src)
        );
    }
    let p = s.top_p.value;
    if p.is_nan() || p <= 0.0 || p > 1.0 {
        bail!(
            "{} must be in (0, 1], got {p}",
            s.top_p.name("--top-p", src)
        );
    }
    if s.top_k.value < -1 {
        bail!(
            "{} must be -1, 0 or positive, got {}",
            s.top_k.name("--top-k", src),
            s.top_k.value
        );
    }
    if !(0.0..=1.0).contains(&s.min_p.value) {
        bail!(
            "{} must be in [0, 1], got {}",
            s.min_p.name("--min-p", src),
            s.min_p.value
        );
    }
    for (name, v) in [
        ("--presence-penalty", a.presence_penalty),
        ("--frequency-penalty", a.frequency_penalty),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            bail!("{name} must be in [-2, 2], got {v}");
        }
    }
    let r = s.repetition_penalty.value;
    if !(r > 0.0 && r.is_finite()) {
        bail!(
            "{} must be a finite number > 0, got {r}",
            s.repetition_penalty.name("--repetition-penalty", src)
        );
    }
    let max = s.max_tokens.value;
    if a.min_tokens > max {
        bail!(
            "--min-tokens ({}) must be at most {} ({max})",
            a.min_tokens,
            s.max_tokens.name("--max-tokens", src)
        );
    }
    if max == 0 {
        bail!(
            "{} must be at least 1",
            s.max_tokens.name("--max-tokens", src)
        );
    }
    Ok(())
}

/// Runs `baton generate`.
///
/// # Errors
/// Bad flags, a model that fails to load, a prompt that cannot run.
pub fn run(mut a: GenerateArgs) -> Result<()> {
    if let Some(g) = crate::gguf_model::resolve(&a.model, a.tokenizer.as_deref(), true)? {
        a.model = g.dir;
    }
    crate::args::check_tokenizer_dir(a.tokenizer.as_deref())?;
    crate::args::check_quantization_of(a.quantization.as_deref(), &a.model)?;
    let dir = ModelDir::new(&a.model).with_tokenizer(a.tokenizer.as_ref());
    // Read first: the sampling values it gives are checked with the flags'.
    let (generation_config, ignored) = dir
        .generation_config_from(&a.generation_config)
        .with_context(|| format!("--generation-config {}", a.generation_config))?;
    if let Some(e) = &ignored {
        tracing::warn!(
            "ignoring {e} (--generation-config {}); the stop ids come from config.json",
            a.generation_config
        );
    }
    let sampling = Sampling::resolve(&a, &generation_config);
    validate_sampling(&a, &sampling)?;
    let mut prompts = a.prompts.clone();
    if let Some(f) = &a.prompts_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading --prompts-file {}", f.display()))?;
        let before = prompts.len();
        prompts.extend(text.lines().filter(|l| !l.is_empty()).map(str::to_owned));
        if prompts.len() == before {
            bail!(
                "--prompts-file {} has no prompts (one per non-empty line)",
                f.display()
            );
        }
    }
    if prompts.is_empty() {
        bail!("give at least one --prompt or a --prompts-file");
    }
    let format = a
        .load_format
        .with_seed(a.seed.unwrap_or(0), Some(&a.model))?;
    let lora_modules = a.lora_args.modules()?;
    let lora_id = match &a.lora {
        None => 0,
        Some(name) => match lora_modules.iter().position(|m| &m.name == name) {
            Some(i) => i as u32 + 1,
            None => bail!(
                "--lora {name}: no such adapter among --lora-modules ({})",
                if lora_modules.is_empty() {
                    "none given".to_string()
                } else {
                    lora_modules
                        .iter()
                        .map(|m| m.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        },
    };
    if a.device == GenDevice::Cuda {
        let cfg = baton_model::ModelConfig::from_file(&dir.config_path()).ok();
        a.cuda.resolve_dtype(cfg.as_ref());
        check_cuda_kv_dtype(a.engine.kv_cache_dtype, &a.cuda)?;
        check_cuda_device(&a.cuda, cfg.as_ref())?;
    } else if let Some(note) = crate::cuda_args::cpu_dtype_note(&a.cuda) {
        say!("{note}");
    }
    // Mapped: the CUDA worker reads each tensor in its stored dtype; the CPU converts to f32.
    let mut loaded = dir.load_mapped_from(format, &a.generation_config)?;
    let eos = loaded.eos_token_ids();
    let mut cfg = a
        .engine
        .scheduler_config(&loaded.config)
        .map_err(anyhow::Error::msg)?;
    crate::args::serve_up_to("note", &mut loaded.config, cfg.max_model_len);
    let kv_window = cfg.kv_window;
    let tokenizer = loaded.tokenizer.take().context(
        "the model directory has no tokenizer.json; generate needs one to encode prompts",
    )?;
    crate::args::check_tokenizer_fits(
        a.tokenizer.as_deref(),
        tokenizer.vocab_size(),
        loaded.config.vocab_size,
    )?;
    let adapters = baton_model::LoraAdapter::load_all(
        &lora_modules,
        &loaded.config,
        a.lora_args.max_lora_rank,
    )?;
    match a.device {
        GenDevice::Cpu => {
            let (mut model, _) = loaded.into_cpu_model()?;
            model
                .set_threads(crate::args::cpu_threads(a.cpu_threads))
                .map_err(anyhow::Error::msg)?;
            let int8 = model.set_int8_activations(a.int8.on());
            if int8 > 0 {
                say!(
                    "CPU: 8-bit activations for {int8} quantized {} (llama.cpp's scheme; \
                     --no-cpu-int8-activations for f32)",
                    if int8 == 1 { "matrix" } else { "matrices" }
                );
            }
            let kv_dtype = a.engine.kv_cache_dtype.resolve(model.config());
            let mut backend = CpuBackend::try_new(model, cfg.num_blocks, cfg.block_size, kv_dtype)
                .map_err(anyhow::Error::msg)?;
            backend.set_lora_adapters(adapters)?;
            say_kv_cache(cfg.num_blocks, cfg.block_size, kv_dtype, kv_window);
            run_on(
                LocalEngine::new(cfg, backend),
                &a,
                &tokenizer,
                &prompts,
                &eos,
                &sampling,
                lora_id,
            )
        }
        GenDevice::Cuda => {
            let sizes = CudaSizes {
                block_size: cfg.block_size,
                num_blocks: a.engine.num_blocks,
                max_tokens: cfg.max_num_batched_tokens,
                max_rows: cfg.max_num_seqs,
                max_model_len: cfg.max_model_len,
            };
            let mut backend = build_cuda(loaded.config, loaded.weights, &a.cuda, sizes)?;
            backend.set_lora_adapters(adapters)?;
            cfg.num_blocks = backend.kv_capacity().num_blocks;
            say_kv_cache(
                cfg.num_blocks,
                cfg.block_size,
                model_dtype(a.cuda.dtype),
                kv_window,
            );
            run_on(
                LocalEngine::new(cfg, backend),
                &a,
                &tokenizer,
                &prompts,
                &eos,
                &sampling,
                lora_id,
            )
        }
    }
}

/// The KV cache's line on stderr: its pages and the dtype `--kv-cache-dtype` resolved to.
fn say_kv_cache(
    num_blocks: usize,
    block_size: usize,
    dtype: baton_model::DType,
    window: Option<usize>,
) {
    say!(
        "KV cache: {} of {} in {}",
        crate::args::count(num_blocks, "page"),
        crate::args::count(block_size, "token"),
        KvCacheDtype::Is(dtype).name()
    );
    if let Some(w) = window {
        say!("KV cache: every layer attends to its last {w} keys: pages out of that window come back mid-request");
    }
}

fn run_on<B: Backend>(
    mut engine: LocalEngine<B>,
    a: &GenerateArgs,
    tokenizer: &Tokenizer,
    prompts: &[String],
    eos: &[u32],
    sampling: &Sampling,
    lora: u32,
) -> Result<()> {
    if let Some(path) = &a.engine.trace {
        let t = baton_scheduler::Tracer::to_file(path)
            .with_context(|| format!("creating --trace {}", path.display()))?;
        engine.scheduler_mut().set_tracer(t);
    }

    let max_tokens = sampling.max_tokens.value;
    let start = Instant::now();
    let gens = generate(
        &mut engine,
        tokenizer,
        prompts,
        max_tokens,
        sampling.params(a),
        a.seed,
        eos,
        a.ignore_eos,
        a.min_tokens,
        lora,
    )?;
    let secs = start.elapsed().as_secs_f64();
    engine.scheduler_mut().flush_trace();
    let max_model_len = engine.scheduler_mut().config().max_model_len;

    let mut out = std::io::stdout().lock();
    let mut print = || -> std::io::Result<()> {
        for (i, g) in gens.iter().enumerate() {
            if a.json {
                writeln!(out, "{}", serde_json::to_string(g)?)?;
            } else if gens.len() == 1 {
                writeln!(out, "{}", g.text)?;
            } else {
                writeln!(out, "### [{i}] {}", g.prompt)?;
                writeln!(out, "{}", g.text)?;
            }
        }
        out.flush()
    };
    match print() {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            return Err(crate::ClosedStdout.into())
        }
        r => r.context("writing the generations to stdout")?,
    }
    for (i, g) in gens.iter().enumerate() {
        let n = g.ids.len();
        if g.finish_reason == FinishReason::Length && n < max_tokens as usize {
            say!(
                "note: prompt {i} stopped at the maximum model length ({max_model_len} tokens) \
                 after {n} of --max-tokens {max_tokens}"
            );
        }
    }
    let tokens: usize = gens.iter().map(|g| g.ids.len()).sum();
    say!(
        "generated {tokens} tokens for {} prompts in {secs:.3} s ({:.1} tokens/s)",
        gens.len(),
        tokens as f64 / secs.max(1e-9)
    );
    Ok(())
}

/// Runs `prompts` to completion on `engine` with LoRA adapter `lora` (0: none) and decodes
/// the results.
///
/// # Errors
/// A prompt the tokenizer or the scheduler rejects, or a backend failure.
#[allow(clippy::too_many_arguments)]
pub fn generate<B: baton_worker::Backend>(
    engine: &mut LocalEngine<B>,
    tokenizer: &Tokenizer,
    prompts: &[String],
    max_tokens: u32,
    params: SamplingParams,
    seed: Option<u64>,
    eos: &[u32],
    ignore_eos: bool,
    min_tokens: u32,
    lora: u32,
) -> Result<Vec<Generation>> {
    let mut gens = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let ids = tokenizer.encode(p, true)?;
        let mut params = params;
        params.seed = seed.unwrap_or_else(rand_seed);
        engine
            .add_request(NewRequest {
                priority: 0,
                id: i as u64,
                prompt: ids.clone(),
                max_tokens,
                params,
                eos_ids: eos.to_vec(),
                stop_token_ids: Vec::new(),
                ignore_eos,
                logit_bias: Vec::new(),
                min_tokens,
                cache_salt: 0,
                guide: None,
                bad_words: Vec::new(),
                lora,
            })
            .with_context(|| format!("prompt {i}"))?;
        gens.push(Generation {
            prompt: p.clone(),
            prompt_ids: ids,
            ids: Vec::new(),
            text: String::new(),
            finish_reason: FinishReason::Abort,
        });
    }
    let mut events = Vec::new();
    engine.run_until_idle(&mut events)?;
    for e in events {
        match e {
            Event::Token { id, token, .. } => gens[id as usize].ids.push(token),
            Event::Finished { id, reason, .. } => gens[id as usize].finish_reason = reason,
            // `generate` asks for none.
            Event::PromptLogprob { .. } => {}
        }
    }
    for g in &mut gens {
        let prefix = tokenizer.decode(&g.prompt_ids, true)?;
        let mut all = g.prompt_ids.clone();
        // A stop id ends the output without showing in its text (vLLM's and the HTTP
        // endpoints'): the scheduler stops only on stop ids, so `Stop` means the last is one.
        let shown = match g.finish_reason {
            FinishReason::Stop => &g.ids[..g.ids.len().saturating_sub(1)],
            _ => &g.ids[..],
        };
        all.extend_from_slice(shown);
        let full = tokenizer.decode(&all, true)?;
        g.text = full
            .strip_prefix(prefix.as_str())
            .map(str::to_owned)
            .unwrap_or(full);
    }
    Ok(gens)
}

/// A random seed for an unseeded request.
pub fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}
