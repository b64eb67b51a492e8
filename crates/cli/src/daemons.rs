//! `baton scheduler` and `baton worker`: the two daemons.

use crate::args::{EngineArgs, KvCacheDtype};
use crate::cuda_args::{build_cuda, check_cuda_device, check_cuda_kv_dtype, CudaArgs, CudaSizes};
use crate::generate::LoadFormatArg;
use anyhow::{bail, Context, Result};
use baton_model::{LoadFormat, ModelConfig, ModelDir, ModelError};
use baton_scheduler::daemon::{DaemonConfig, SchedulerDaemon};
use baton_worker::daemon::{self, WorkerDaemon};
use baton_worker::{Backend, CpuBackend, KvCapacity, NullBackend};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Flags of `baton scheduler`.
#[derive(Args, Clone, Debug)]
pub struct SchedulerArgs {
    /// Instance name: the control segment is /dev/shm/baton-INSTANCE.
    #[arg(long, default_value = "default")]
    pub instance: String,
    /// A model directory, for the defaults of --max-model-len, the vocabulary check and the
    /// model and weights fingerprints workers must match.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The weights workers load: `auto` publishes the fingerprint of the --model directory's
    /// safetensors (none without --model), `dummy` that of --seed's random weights, so a
    /// worker with other weights refuses to attach.
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// Seed of the workers' dummy weights (with --load-format dummy; default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// A directory with the tokenizer.json (and optionally tokenizer_config.json, whose chat
    /// template then applies) to use instead of the model directory's (vLLM's `--tokenizer`).
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Frontend slots (ring pairs).
    #[arg(long, default_value_t = 8, value_parser = crate::args::parse_frontends)]
    pub frontends: usize,
    /// Where the stop ids a structured output may end with come from, as the frontend's flag
    /// of the same name: "auto" and "vllm" read the --model directory's
    /// generation_config.json (one that does not load is ignored with a warning), anything
    /// else is a directory holding a generation_config.json. Give the frontends' value (`baton
    /// serve` does).
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// Scheduler and KV-cache flags.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// LoRA adapters: the scheduler publishes their count and fingerprint, so workers and
    /// frontends with another list refuse to attach.
    #[command(flatten)]
    pub lora: crate::args::LoraArgs,
}

/// Which device a worker runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The f32 CPU reference backend.
    Cpu,
    /// NVIDIA GPU through CUDA.
    Cuda,
    /// No computation: fixed tokens (control-plane benchmarks).
    Null,
}

/// Flags of `baton worker`.
#[derive(Args, Clone, Debug)]
pub struct WorkerArgs {
    /// Instance name of the scheduler to attach to.
    #[arg(long, default_value = "default")]
    pub instance: String,
    /// A Hugging Face model directory or a GGUF file (not needed for --device null).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Device.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Weight loading.
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// Seed of dummy weights (with --load-format dummy; default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// vLLM's `--quantization` (`-q`): the checkpoint's quantization method, which must be
    /// the `quant_method` of config.json's `quantization_config` (`fp8` or
    /// `compressed-tensors`). Not needed: FP8 checkpoints load without it (dequantized at
    /// load). Naming a method the checkpoint does not use is refused, as vLLM does; online
    /// quantization of an unquantized checkpoint is not supported.
    #[arg(long, short = 'q')]
    pub quantization: Option<String>,
    /// Accepted as the other commands take it (vLLM's `--tokenizer`) and checked to be a
    /// directory holding tokenizer.json, but unused: a worker reads no tokenizer (nor
    /// generation_config.json), so its `--model` directory needs only config.json and the
    /// weights.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// How long to wait for the scheduler's segment and a free worker slot, in seconds.
    #[arg(long, default_value_t = 10.0, value_parser = crate::frontend_cmd::parse_seconds)]
    pub attach_timeout: f64,
    /// Token the null backend samples.
    #[arg(long, default_value_t = 3)]
    pub null_token: u32,
    /// Threads of the CPU backend's forward pass (0: one per available CPU).
    #[arg(long, default_value_t = 0, value_parser = crate::args::parse_cpu_threads)]
    pub cpu_threads: usize,
    /// 8-bit activations for a GGUF file's quantized matrices (the CPU backend's default).
    #[command(flatten)]
    pub int8: crate::args::Int8Args,
    /// Data type of the CPU KV cache: `auto` (the model's), `bfloat16`, `float16` or
    /// `float32` (as the scheduler's flag, which sizes the pool from it; `baton serve` passes
    /// both the same value). Under --device cuda the cache has the --dtype.
    #[arg(long, default_value = "auto", value_parser = crate::args::parse_kv_cache_dtype)]
    pub kv_cache_dtype: crate::args::KvCacheDtype,
    /// CUDA flags (with --device cuda). The KV pool has exactly the scheduler's page count.
    #[command(flatten)]
    pub cuda: CudaArgs,
    /// LoRA adapters the worker loads (the scheduler's list).
    #[command(flatten)]
    pub lora: crate::args::LoraArgs,
}

/// SIGTERM and SIGINT set the returned flag.
///
/// # Errors
/// Installing the handlers failed.
pub fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    Ok(stop)
}

/// The vocabulary structured outputs compile against: the model directory's tokenizer.json
/// for `vocab_size` logits, ending on the model's EOS ids. `None` (with a warning) when the
/// directory has no tokenizer.json or llguidance cannot read it: the scheduler then refuses
/// constrained requests.
///
/// # Errors
/// A malformed config.json or generation_config.json.
pub fn grammar_vocabulary(
    dir: &ModelDir,
    vocab_size: usize,
    generation_config: &str,
) -> Result<Option<baton_grammar::Vocabulary>> {
    let path = dir.tokenizer_path();
    if !path.exists() {
        return Ok(None);
    }
    // Only the stop ids are taken from the generation config here, from the file the
    // frontends read. Under `auto` one that does not load is ignored, as under `vllm` (the
    // frontend refuses it under `auto`, so no request comes).
    let source = match generation_config
        .parse()
        .map_err(|e| anyhow::anyhow!("--generation-config: {e}"))?
    {
        baton_model::GenerationConfigSource::Auto => baton_model::GenerationConfigSource::Vllm,
        s => s,
    };
    // The flag's file first, so that only its errors are put down to the flag (a bad
    // tokenizer.json or config.json is reported as itself).
    dir.generation_config_from(&source)
        .with_context(|| format!("--generation-config {generation_config}"))?;
    let (eos, ignored) = dir.eos_token_ids_from(&source)?;
    if let Some(e) = ignored {
        tracing::warn!("ignoring {e}; the stop ids come from config.json");
    }
    match baton_grammar::Vocabulary::from_tokenizer_json(&path, vocab_size, &eos) {
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            tracing::warn!("structured outputs are unavailable: {e}");
            Ok(None)
        }
    }
}

/// Runs `baton scheduler` until SIGTERM/SIGINT.
///
/// # Errors
/// Bad flags, a running instance of the same name.
pub fn run_scheduler(a: SchedulerArgs) -> Result<()> {
    // Structured outputs' constraints are compiled and their masks computed on the scheduler's
    // thread: give it the stack they may need (`baton_grammar::GRAMMAR_STACK_BYTES`).
    std::thread::Builder::new()
        .name("baton-scheduler".into())
        .stack_size(baton_grammar::GRAMMAR_STACK_BYTES)
        .spawn(move || scheduler_main(a))
        .context("starting the scheduler thread")?
        .join()
        .map_err(|_| anyhow::anyhow!("the scheduler thread panicked"))?
}

fn scheduler_main(mut a: SchedulerArgs) -> Result<()> {
    let stop = stop_flag()?;
    if let Some(m) = &a.model {
        if let Some(g) = crate::gguf_model::resolve(m, a.tokenizer.as_deref(), true)? {
            a.model = Some(g.dir);
        }
    }
    crate::args::check_tokenizer_dir(a.tokenizer.as_deref())?;
    let format = a.load_format.with_seed_flag(a.seed, a.model.as_deref())?;
    let (lora_modules, lora_fingerprint) = a.lora.fingerprinted()?;
    let (mut model_cfg, vocab, weights_fingerprint) = match &a.model {
        Some(dir) => {
            let dir = ModelDir::new(dir);
            let c = ModelConfig::from_file(&dir.config_path())?;
            // The workers' load refuses a checkpoint whose tensor names do not fit the
            // config: say so here too, first (not as a fingerprint failure). The hint fits a
            // directory without weights.
            let w = dir
                .checked_weights_fingerprint(format, &c)
                .map_err(|e| match e {
                    ModelError::Io { .. } => anyhow::Error::new(e).context(
                        "reading the weights' fingerprint (give --load-format dummy for \
                         workers with random weights)",
                    ),
                    e => e.into(),
                })?;
            // The adapters must be ones the workers can load (shapes, ranks, fields): refused
            // here, not by every worker after attaching.
            baton_model::LoraAdapter::load_all(&lora_modules, &c, a.lora.max_lora_rank)?;
            let v = c.vocab_size;
            (c, v, w)
        }
        None if !lora_modules.is_empty() => {
            bail!("--lora-modules needs --model DIR (the adapters are checked against it)")
        }
        None => {
            let Some(len) = a.engine.max_model_len else {
                bail!("give --model DIR, or --max-model-len and --num-blocks");
            };
            if a.engine.num_blocks.is_none() {
                bail!("without --model, --num-blocks is required");
            }
            let mut c = ModelConfig::from_json_str(
                r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1,"max_position_embeddings":1}"#,
            )?;
            c.max_position_embeddings = len;
            // Dummy weights need no directory: their fingerprint is the seed's.
            let w = match format {
                LoadFormat::Dummy { seed } => baton_model::dummy_weights_fingerprint(seed),
                LoadFormat::Auto => 0,
            };
            (c, usize::MAX, w)
        }
    };
    let sched = a
        .engine
        .scheduler_config(&model_cfg)
        .map_err(anyhow::Error::msg)?;
    // The fingerprint workers and frontends must match, with the RoPE factors the served
    // length chooses (they set the same from the segment's max_model_len).
    crate::args::serve_up_to("baton scheduler", &mut model_cfg, sched.max_model_len);
    let fingerprint = if a.model.is_some() {
        model_cfg.fingerprint()
    } else {
        0
    };
    // Frontends with another tokenizer.json refuse to attach (absent: nothing to check; the
    // scheduler then has no grammar vocabulary either).
    let tokenizer_fingerprint = match &a.model {
        Some(dir) => {
            let path = ModelDir::new(dir)
                .with_tokenizer(a.tokenizer.as_ref())
                .tokenizer_path();
            if path.exists() {
                baton_model::tokenizer_fingerprint(&path)?
            } else {
                0
            }
        }
        None => 0,
    };
    let cfg = DaemonConfig {
        instance: a.instance.clone(),
        sched: sched.clone(),
        vocab_size: vocab,
        frontends: a.frontends,
        model_fingerprint: fingerprint,
        weights_fingerprint,
        tokenizer_fingerprint,
        // What the CPU formula sized the pool for (with --model: its config.json's dtype
        // under `auto`).
        kv_dtype: match &a.model {
            Some(_) => KvCacheDtype::code(a.engine.kv_cache_dtype.resolve(&model_cfg)),
            None => match a.engine.kv_cache_dtype {
                KvCacheDtype::Is(d) => KvCacheDtype::code(d),
                KvCacheDtype::Auto => baton_proto::plane::KV_DTYPE_UNKNOWN,
            },
        },
        launch_timeout: a.engine.launch_timeout(),
        trace: a.engine.trace.clone(),
        vocabulary: match &a.model {
            Some(dir) => grammar_vocabulary(
                &ModelDir::new(dir).with_tokenizer(a.tokenizer.as_ref()),
                vocab,
                &a.generation_config,
            )?,
            None => None,
        },
        lora_count: lora_modules.len() as u32,
        lora_fingerprint,
    };
    let kv = KvCacheDtype::from_code(cfg.kv_dtype).map_or(String::new(), |d| {
        format!(" ({} on a CPU worker)", KvCacheDtype::Is(d).name())
    });
    let window = sched.kv_window;
    let mut d = SchedulerDaemon::create(cfg)?;
    say!(
        "baton scheduler: instance {} ready (KV: {} of {}{kv}, max model len {}, max {} seqs, async scheduling {})",
        a.instance,
        crate::args::count(sched.num_blocks, "page"),
        crate::args::count(sched.block_size, "token"),
        sched.max_model_len,
        sched.max_num_seqs,
        if sched.max_inflight > 1 { "on" } else { "off" }
    );
    if let Some(w) = window {
        say!(
            "baton scheduler: every layer attends to its last {w} keys: running requests give \
             back the KV pages out of that window"
        );
    }
    d.run(&stop);
    drop(d);
    say!("baton scheduler: stopped, segment removed");
    Ok(())
}

/// The model a worker's ready line names: a GGUF file rather than the directory prepared
/// from it (serve hands its worker that directory).
fn shown(dir: &std::path::Path) -> std::path::PathBuf {
    crate::gguf_model::served_file(dir).unwrap_or_else(|| dir.to_owned())
}

/// Runs `baton worker` until SIGTERM/SIGINT.
///
/// What can fail without a scheduler (a missing `--model`, no CUDA driver or device, a model
/// that does not load) fails before the worker waits for the segment.
///
/// # Errors
/// No scheduler, a model that fails to load, a KV pool or model mismatch.
pub fn run_worker(mut a: WorkerArgs) -> Result<()> {
    let stop = stop_flag()?;
    if let Some(m) = &a.model {
        // A worker reads no tokenizer.
        if let Some(g) = crate::gguf_model::resolve(m, None, false)? {
            a.model = Some(g.dir);
        }
    }
    crate::args::check_tokenizer_dir(a.tokenizer.as_deref())?;
    if a.quantization.is_some() {
        let dir = a
            .model
            .as_deref()
            .context("--quantization needs --model DIR (the checkpoint it describes)")?;
        crate::args::check_quantization_of(a.quantization.as_deref(), dir)?;
    }
    let wait = Duration::from_secs_f64(a.attach_timeout.max(0.0));
    let (lora_modules, lora_fingerprint) = a.lora.fingerprinted()?;
    if a.device == Device::Null && !lora_modules.is_empty() {
        bail!("--lora-modules: the null backend computes nothing and serves no adapters");
    }
    // The null backend's weights are what it stands in for: the scheduler's dummy weights
    // (same --load-format dummy --seed), or none.
    let null_format = match a.device {
        Device::Null => Some(a.load_format.with_seed_flag(a.seed, a.model.as_deref())?),
        Device::Cpu | Device::Cuda => None,
    };
    let loaded = match a.device {
        Device::Null => None,
        Device::Cpu | Device::Cuda => {
            let name = if a.device == Device::Cuda {
                "cuda"
            } else {
                "cpu"
            };
            let dir = a
                .model
                .clone()
                .with_context(|| format!("--model DIR is required for --device {name}"))?;
            if a.device == Device::Cuda {
                let cfg = baton_model::ModelConfig::from_file(&dir.join("config.json")).ok();
                a.cuda.resolve_dtype(cfg.as_ref());
                check_cuda_kv_dtype(a.kv_cache_dtype, &a.cuda)?;
                check_cuda_device(&a.cuda, cfg.as_ref())?;
            } else if let Some(note) = crate::cuda_args::cpu_dtype_note(&a.cuda) {
                say!("baton worker: {note}");
            }
            let format = a.load_format.with_seed_flag(a.seed, Some(&dir))?;
            // A worker uses nothing from generation_config.json or the tokenizer: they are
            // the scheduler's and the frontends' to read and report.
            let weights = ModelDir::new(&dir).load_mapped_weights(format)?;
            let adapters = baton_model::LoraAdapter::load_all(
                &lora_modules,
                &weights.config,
                a.lora.max_lora_rank,
            )?;
            Some((dir.clone(), weights, adapters))
        }
    };
    let (segment, limits) = daemon::attach(&a.instance, wait)?;
    if loaded.is_some() {
        check_lora_fingerprint(&limits, lora_fingerprint, "worker", &a.instance)?;
    }
    // The RoPE factors of the scheduler's served length (its fingerprint covers them).
    let loaded = loaded.map(|(dir, mut l, adapters)| {
        l.config.set_max_model_len(limits.max_model_len);
        (dir, l, adapters)
    });
    match (a.device, loaded) {
        (Device::Cpu, Some((dir, loaded, adapters))) => {
            let weights = loaded.weights_fingerprint;
            let (mut model, _) = loaded.into_cpu_model()?;
            model
                .set_threads(crate::args::cpu_threads(a.cpu_threads))
                .map_err(anyhow::Error::msg)?;
            let int8 = model.set_int8_activations(a.int8.on());
            let weight_gib = model.weight_bytes() as f64 / (1u64 << 30) as f64;
            let threads = model.threads();
            let kv_dtype = a
                .kv_cache_dtype
                .for_worker(limits.kv_dtype, model.config())
                .map_err(anyhow::Error::msg)?;
            let mut backend =
                CpuBackend::try_new(model, limits.num_blocks, limits.block_size, kv_dtype)
                    .map_err(anyhow::Error::msg)?;
            let n_lora = adapters.len();
            backend.set_lora_adapters(adapters)?;
            let mut w = WorkerDaemon::new(segment, limits, backend, weights, wait)?;
            say!(
                "baton worker: cpu backend ({}; {weight_gib:.2} GiB of weights, {threads} \
                 threads, {} KV cache{}{}) attached to {}",
                shown(&dir).display(),
                KvCacheDtype::Is(kv_dtype).name(),
                if int8 > 0 { ", int8 activations" } else { "" },
                lora_note(n_lora),
                a.instance
            );
            w.run(&stop)?;
        }
        (Device::Cuda, Some((dir, loaded, adapters))) => {
            let sizes = CudaSizes {
                block_size: limits.block_size,
                num_blocks: Some(limits.num_blocks),
                max_tokens: limits.max_num_batched_tokens,
                max_rows: limits.max_num_seqs,
                max_model_len: limits.max_model_len,
            };
            let weights = loaded.weights_fingerprint;
            let mut backend = build_cuda(loaded.config, loaded.weights, &a.cuda, sizes)?;
            let n_lora = adapters.len();
            backend.set_lora_adapters(adapters)?;
            let mut w = WorkerDaemon::new(segment, limits, backend, weights, wait)?;
            say!(
                "baton worker: cuda backend ({}{}) attached to {}",
                shown(&dir).display(),
                lora_note(n_lora),
                a.instance
            );
            w.run(&stop)?;
        }
        _ => {
            let cap = KvCapacity {
                num_blocks: limits.num_blocks,
                block_size: limits.block_size,
            };
            let vocab = if limits.vocab_size == 0 {
                32000
            } else {
                limits.vocab_size
            };
            let weights = match null_format {
                Some(LoadFormat::Dummy { seed }) => baton_model::dummy_weights_fingerprint(seed),
                _ if limits.weights_fingerprint != 0 => bail!(
                    "the null backend computes nothing (every row samples token {}), so it \
                     attaches only to a scheduler of random weights, given the scheduler's \
                     --load-format dummy --seed N, or to one without --model; instance {} \
                     serves weights (fingerprint {:016x}): a checkpoint's, or dummy ones this \
                     worker was not told of",
                    a.null_token,
                    a.instance,
                    limits.weights_fingerprint
                ),
                _ => 0,
            };
            let backend = NullBackend::new(cap, vocab, a.null_token);
            let mut w = WorkerDaemon::new(segment, limits, backend, weights, wait)?;
            say!("baton worker: null backend attached to {}", a.instance);
            w.run(&stop)?;
        }
    }
    Ok(())
}

/// `; N LoRA adapters` for a start-up line (empty for none).
fn lora_note(n: usize) -> String {
    match n {
        0 => String::new(),
        n => format!("; {}", crate::args::count(n, "LoRA adapter")),
    }
}

/// A worker or frontend's `--lora-modules` (fingerprint `mine`) must be the scheduler's:
/// adapter id `i` means entry `i` in every process.
///
/// # Errors
/// The lists differ.
pub fn check_lora_fingerprint(
    limits: &baton_proto::plane::PlaneLimits,
    mine: u64,
    who: &str,
    instance: &str,
) -> Result<()> {
    if limits.lora_fingerprint != mine {
        let theirs = match limits.lora_count {
            0 => "none".to_string(),
            n => crate::args::count(n as usize, "adapter"),
        };
        bail!(
            "this {who}'s --lora-modules are not the scheduler's (instance {instance} serves \
             {theirs}, fingerprint {:016x}; this {who}'s {mine:016x}): give every process the \
             same --enable-lora --lora-modules list: the same names, in the same order, with \
             the same adapter files",
            limits.lora_fingerprint
        );
    }
    Ok(())
}
