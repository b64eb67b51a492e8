//! `baton serve`: starts the scheduler, a worker and a frontend as child processes, restarts a
//! dead worker or frontend, and shuts everything down on SIGINT/SIGTERM.
//!
//! Contract: the supervisor shares nothing with its children but their pids. Every child gets
//! a parent-death signal, so a SIGKILL of `baton serve` takes them all down; a clean stop sends
//! SIGTERM to the frontend, the worker, then the scheduler (which unlinks the segment), so
//! nothing is left in `/dev/shm`.

use crate::args::EngineArgs;
use crate::cuda_args::{cuda_options, CudaArgs, CudaSizes};
use crate::daemons::Device;
use crate::frontend_cmd::HttpArgs;
use crate::generate::LoadFormatArg;
use anyhow::{bail, Context, Result};
use clap::Args;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Flags of `baton serve`.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// A Hugging Face model directory or a GGUF file (also taken as the first argument, as
    /// `vllm serve MODEL` takes it).
    #[arg(long = "model", value_name = "DIR", conflicts_with = "model_arg")]
    pub model_flag: Option<PathBuf>,
    /// The model directory given as the first argument (vLLM's `vllm serve MODEL`).
    #[arg(value_name = "MODEL")]
    pub model_arg: Option<PathBuf>,
    /// The model directory, from `--model` or the first argument ([`ServeArgs::resolve`]).
    #[arg(skip)]
    pub model: PathBuf,
    /// Device of the worker.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Weight loading, passed to the scheduler and the worker: `dummy` serves seeded random
    /// weights of config.json's shape (benchmarks; no safetensors needed, tokenizer.json is).
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// vLLM's `--seed`: the seed of the random streams of requests that give no `seed`
    /// (passed to the frontend: the same requests in the same order sample the same tokens
    /// after a restart), and of --load-format dummy weights (default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// vLLM's `--quantization` (`-q`): the checkpoint's quantization method, which must be
    /// the `quant_method` of config.json's `quantization_config` (`fp8` or
    /// `compressed-tensors`). Not needed: FP8 checkpoints load without it (dequantized at
    /// load). Naming a method the checkpoint does not use is refused, as vLLM does; online
    /// quantization of an unquantized checkpoint is not supported.
    #[arg(long, short = 'q')]
    pub quantization: Option<String>,
    /// Instance name: the segment is /dev/shm/baton-INSTANCE. Two servers need two names.
    #[arg(long, default_value = "default")]
    pub instance: String,
    /// HTTP flags, passed to the frontend.
    #[command(flatten)]
    pub http: HttpArgs,
    /// Threads of the CPU worker's forward pass (0: one per available CPU).
    #[arg(long, default_value_t = 0, value_parser = crate::args::parse_cpu_threads)]
    pub cpu_threads: usize,
    /// 8-bit activations for a GGUF file's quantized matrices (the CPU backend's default).
    #[command(flatten)]
    pub int8: crate::args::Int8Args,
    /// Frontend slots in the segment.
    #[arg(long, default_value_t = 8, value_parser = crate::args::parse_frontends)]
    pub frontends: usize,
    /// Seconds without a heartbeat after which a child is taken as hung and killed: a
    /// frontend is then restarted, a scheduler stops serve as its death does (0: never;
    /// else at least 1). The
    /// worker is watched by the scheduler's --launch-timeout instead (a long step sends no
    /// heartbeat).
    #[arg(long, default_value_t = 30.0)]
    pub heartbeat_timeout: f64,
    /// Scheduler and KV-cache flags.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// CUDA flags (with --device cuda), passed to the worker. Without --num-blocks the KV
    /// pool is sized for --gpu-memory-utilization of the GPU's memory.
    #[command(flatten)]
    pub cuda: CudaArgs,
    /// vLLM flags whose only value here is what Baton does anyway.
    #[command(flatten)]
    pub vllm: VllmFlags,
    /// LoRA adapters, passed to the scheduler, the worker and the frontend.
    #[command(flatten)]
    pub lora: crate::args::LoraArgs,
}

/// vLLM `serve` flags a copied command line often carries, accepted where their value is what
/// Baton does and refused where it is not, so that `vllm serve` command lines run unchanged
/// when they ask for nothing Baton lacks.
#[derive(Args, Clone, Debug, Default)]
pub struct VllmFlags {
    /// vLLM's `--trust-remote-code`: accepted, and nothing to trust: Baton never runs code
    /// from a checkpoint (its architectures are built in; another one is refused).
    #[arg(long)]
    pub trust_remote_code: bool,
    /// vLLM's `--tensor-parallel-size` (also `-tp`): only 1 (one worker runs the whole model
    /// on one device).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// vLLM's `--pipeline-parallel-size` (also `-pp`): only 1.
    #[arg(long, default_value_t = 1)]
    pub pipeline_parallel_size: usize,
    /// vLLM's `--disable-log-requests`: accepted; Baton logs no line per request.
    #[arg(long)]
    pub disable_log_requests: bool,
    /// vLLM's `--disable-log-stats`: accepted; Baton logs no periodic statistics (they are on
    /// `/metrics`).
    #[arg(long)]
    pub disable_log_stats: bool,
    /// vLLM's `--data-parallel-size` (also `-dp`): only 1 (one engine).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: usize,
    /// vLLM's `--api-server-count`: only 1 (one frontend process, multithreaded).
    #[arg(long, default_value_t = 1)]
    pub api_server_count: usize,
    /// vLLM's `--enable-chunked-prefill`: accepted; Baton always chunks long prefills
    /// (`--max-num-batched-tokens` per step).
    #[arg(long)]
    pub enable_chunked_prefill: bool,
    /// vLLM's `--swap-space` (GiB of CPU swap for preempted requests): accepted and unused;
    /// Baton preempts by recomputation, as vLLM V1 does.
    #[arg(long)]
    pub swap_space: Option<f64>,
    /// vLLM's `--tokenizer-mode`: `auto` or `hf` (Baton uses the Hugging Face tokenizer);
    /// `mistral`, `slow` and `custom` are refused.
    #[arg(long, default_value = "auto")]
    pub tokenizer_mode: String,
    /// vLLM's `--chat-template-content-format`: `auto` or `string` (Baton gives templates
    /// text content as one string); `openai` (content as a list of parts) is refused.
    #[arg(long, default_value = "auto")]
    pub chat_template_content_format: String,
    /// vLLM's `--response-role`: only `assistant`.
    #[arg(long, default_value = "assistant")]
    pub response_role: String,
    /// vLLM's `--max-logprobs`: 0 to 20. Baton's limit stays 20 (a request asking for more is
    /// refused; one asking for up to 20 is served whatever this says).
    #[arg(long, default_value_t = 20)]
    pub max_logprobs: i64,
    /// vLLM's `--download-dir`: accepted and unused (Baton serves a local model directory).
    #[arg(long)]
    pub download_dir: Option<std::path::PathBuf>,
    /// vLLM's `--uvicorn-log-level`: accepted; Baton's log level is `BATON_LOG`.
    #[arg(long)]
    pub uvicorn_log_level: Option<String>,
    /// vLLM's `--disable-uvicorn-access-log`: accepted; Baton writes no access log.
    #[arg(long)]
    pub disable_uvicorn_access_log: bool,
    /// vLLM's `--max-log-len`: accepted; Baton logs no prompts.
    #[arg(long)]
    pub max_log_len: Option<u64>,
    /// vLLM's `--enable-prompt-tokens-details`: accepted; Baton's usage always has
    /// `prompt_tokens_details.cached_tokens`.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// vLLM's `--disable-fastapi-docs`: accepted; Baton serves no API docs pages.
    #[arg(long)]
    pub disable_fastapi_docs: bool,
}

impl VllmFlags {
    /// Refuses values that ask for what Baton does not do.
    ///
    /// # Errors
    /// A parallel size or `--api-server-count` other than 1; `--tokenizer-mode` other than
    /// `auto`/`hf`; `--chat-template-content-format` other than `auto`/`string`;
    /// `--response-role` other than `assistant`; `--max-logprobs` above 20; a negative
    /// `--swap-space`.
    pub fn check(&self) -> Result<()> {
        for (flag, n) in [
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        ] {
            if n != 1 {
                bail!(
                    "{flag} {n}: Baton runs a model on one device (one worker process); \
                     parallelism across devices is not supported, give 1 or leave it out"
                );
            }
        }
        if self.api_server_count != 1 {
            bail!(
                "--api-server-count {}: Baton serves HTTP from one multithreaded frontend \
                 process; give 1 or leave it out",
                self.api_server_count
            );
        }
        let one_of = |flag: &str, value: &str, ok: &[&str]| -> Result<()> {
            if ok.contains(&value) {
                return Ok(());
            }
            bail!(
                "{flag} {value}: Baton supports only {}",
                ok.iter()
                    .map(|v| format!("`{v}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        };
        one_of("--tokenizer-mode", &self.tokenizer_mode, &["auto", "hf"])?;
        one_of(
            "--chat-template-content-format",
            &self.chat_template_content_format,
            &["auto", "string"],
        )?;
        one_of("--response-role", &self.response_role, &["assistant"])?;
        if !(0..=20).contains(&self.max_logprobs) {
            bail!(
                "--max-logprobs {}: Baton returns at most 20 log-probabilities per token; give \
                 0 to 20",
                self.max_logprobs
            );
        }
        if self.swap_space.is_some_and(|s| s.is_nan() || s < 0.0) {
            bail!("--swap-space must be a number of GiB, 0 or more");
        }
        Ok(())
    }
}

struct Kid {
    name: &'static str,
    args: Vec<String>,
    /// Extra environment (secrets stay out of the argument list, which `ps` shows).
    env: Vec<(&'static str, String)>,
    child: Option<Child>,
    restarts: u32,
    /// When the running child started.
    started: Instant,
    /// Exits in a row of a child that lived less than [`STABLE_AFTER`].
    crashes: u32,
    /// When a dead child is due to be started again.
    restart_at: Option<Instant>,
}

/// A child that ran this long is healthy again: its next restart is immediate.
const STABLE_AFTER: Duration = Duration::from_secs(10);

/// The wait before restarting a child after `crashes` quick exits in a row: none for the first,
/// then 0.25 s doubling up to 8 s, so a child that cannot start (a port in use, a bad model)
/// does not spin.
fn restart_delay(crashes: u32) -> Duration {
    if crashes <= 1 {
        return Duration::ZERO;
    }
    Duration::from_millis(250u64 << (crashes - 2).min(5))
}

fn spawn(k: &Kid, capture_stdout: bool) -> Result<Child> {
    spawn_with(&k.args, &k.env, capture_stdout, false)
}

/// The signal a child gets when `baton serve` dies (`PR_SET_PDEATHSIG`): SIGTERM for the
/// scheduler, which then removes its shared-memory segment before exiting (a SIGKILL would
/// leave it in /dev/shm until the instance's next start), SIGKILL for the others.
fn death_signal(args: &[String]) -> libc::c_int {
    if args.first().map(String::as_str) == Some("scheduler") {
        libc::SIGTERM
    } else {
        libc::SIGKILL
    }
}

fn spawn_with(
    args: &[String],
    env: &[(&'static str, String)],
    capture_stdout: bool,
    capture_stderr: bool,
) -> Result<Child> {
    let exe = std::env::current_exe().context("locating the baton executable")?;
    let mut c = Command::new(exe);
    c.args(args).stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    if capture_stdout {
        c.stdout(Stdio::piped());
    }
    if capture_stderr {
        c.stderr(Stdio::piped());
    }
    let sig = death_signal(args);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl, getppid
    // and setpgid, which are async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        c.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground
            // group) reaches only `baton serve`, which then stops the children in order with
            // the drain grace period, instead of every child stopping at once.
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may already have died between fork and prctl.
            if libc::getppid() == 1 {
                return Err(std::io::Error::other("parent died"));
            }
            Ok(())
        });
    }
    c.spawn().with_context(|| {
        format!(
            "starting baton {}",
            args.first().map(String::as_str).unwrap_or("")
        )
    })
}

impl ServeArgs {
    /// Sets [`ServeArgs::model`] from `--model DIR` or the first argument.
    ///
    /// # Errors
    /// Neither is given.
    pub fn resolve(mut self) -> Result<Self> {
        self.model = match (self.model_flag.take(), self.model_arg.take()) {
            (Some(m), _) | (None, Some(m)) => m,
            (None, None) => bail!(
                "no model: give its directory as `baton serve DIR` or `baton serve --model DIR`"
            ),
        };
        Ok(self)
    }
}

/// The KV page count of a CUDA worker under `a`'s flags on its GPU, computed here (before the
/// scheduler publishes its limits) from the device's free and total memory and the worker's
/// own allocation plan ([`baton_cuda::CudaWorker::plan_kv_blocks`], the function the worker
/// would use), so the scheduler's pool is what the GPU holds rather than the CPU formula.
///
/// # Errors
/// No driver or device, a model config that cannot be read, a model that does not fit.
fn cuda_kv_blocks(a: &ServeArgs) -> Result<usize> {
    let cfg = baton_model::ModelConfig::from_file(&a.model.join("config.json"))?;
    let sched = a
        .engine
        .scheduler_config(&cfg)
        .map_err(anyhow::Error::msg)?;
    let sizes = CudaSizes {
        block_size: sched.block_size,
        num_blocks: None,
        max_tokens: sched.max_num_batched_tokens,
        max_rows: sched.max_num_seqs,
        max_model_len: sched.max_model_len,
    };
    let opts = cuda_options(&a.cuda, sizes)?;
    let (free, total) = baton_cuda::CudaDevice::probe_memory(a.cuda.cuda_device)
        .context("sizing the KV cache for --device cuda")?;
    let n = baton_cuda::CudaWorker::plan_kv_blocks(&cfg, &opts, free, total)
        .context("sizing the KV cache for --device cuda")?;
    say!(
        "baton serve: KV cache sized for --gpu-memory-utilization {} of cuda:{} ({:.1} of {:.1} GiB free): {n} pages of {} tokens",
        a.cuda.gpu_memory_utilization,
        a.cuda.cuda_device,
        free as f64 / f64::from(1u32 << 30),
        total as f64 / f64::from(1u32 << 30),
        sched.block_size
    );
    Ok(n)
}

/// The adapters load for this model (each is read here once more than by the worker, so a
/// bad one stops `serve` before any child starts), under names the base model does not use.
///
/// # Errors
/// As `LoraArgs::modules`, `LoraAdapter::load` and `check_lora_names`; an adapter with
/// --device null.
fn check_lora(a: &ServeArgs, model_arg: &std::path::Path) -> Result<()> {
    let modules = a.lora.modules()?;
    if modules.is_empty() {
        return Ok(());
    }
    if a.device == Device::Null {
        bail!("--lora-modules: the null backend computes nothing and serves no adapters");
    }
    crate::frontend_cmd::check_lora_names(&modules, &a.http, model_arg)?;
    let cfg = baton_model::ModelConfig::from_file(&a.model.join("config.json"))?;
    baton_model::LoraAdapter::load_all(&modules, &cfg, a.lora.max_lora_rank)?;
    Ok(())
}

fn engine_flags(e: &EngineArgs) -> Vec<String> {
    let mut v = vec![
        "--max-num-seqs".into(),
        e.max_num_seqs.to_string(),
        "--max-num-batched-tokens".into(),
        e.max_num_batched_tokens.to_string(),
        "--block-size".into(),
        e.block_size.to_string(),
        "--kv-cache-memory".into(),
        e.kv_cache_memory.to_string(),
        "--kv-cache-dtype".into(),
        e.kv_cache_dtype.name().into(),
    ];
    if let Some(n) = e.num_blocks {
        v.extend(["--num-blocks".into(), n.to_string()]);
    }
    if let Some(n) = e.max_model_len {
        v.extend(["--max-model-len".into(), n.to_string()]);
    }
    if e.no_async_scheduling || !e.async_scheduling {
        v.push("--no-async-scheduling".into());
    }
    if e.no_enable_prefix_caching || !e.enable_prefix_caching {
        v.push("--no-enable-prefix-caching".into());
    }
    if e.scheduling_policy != baton_scheduler::SchedulingPolicy::Fcfs {
        v.extend([
            "--scheduling-policy".into(),
            e.scheduling_policy.name().into(),
        ]);
    }
    if let Some(t) = &e.trace {
        v.extend(["--trace".into(), t.display().to_string()]);
    }
    if let Some(t) = e.launch_timeout {
        v.extend(["--launch-timeout".into(), t.to_string()]);
    }
    v
}

fn http_health(addr: &str) -> Option<u16> {
    let mut s =
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_millis(200))
            .ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    write!(
        s,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_whitespace().nth(1)?.parse().ok()
}

/// Runs `baton serve` until SIGINT/SIGTERM.
///
/// # Errors
/// A child that cannot start, or a frontend that never becomes ready.
pub fn run(a: ServeArgs) -> Result<()> {
    let mut a = a.resolve()?;
    let stop = crate::daemons::stop_flag()?;
    // A GGUF file is read from its prepared directory, which the scheduler and worker get
    // as --model; the frontend gets the file itself, whose name it serves the model under.
    let model_arg = a.model.clone();
    if let Some(g) = crate::gguf_model::resolve(&a.model, a.http.tokenizer.as_deref(), true)? {
        a.model = g.dir;
    }
    if a.model.is_file() {
        bail!(
            "--model {}: a file that is neither a Hugging Face model directory nor a GGUF file",
            a.model.display()
        );
    }
    if !a.model.is_dir() {
        bail!(
            "--model {}: no such directory (relative paths are from {})",
            a.model.display(),
            std::env::current_dir().map_or_else(|_| "?".into(), |d| d.display().to_string())
        );
    }
    if !a.model.join("config.json").exists() {
        bail!(
            "{}: no config.json; --model must be a Hugging Face model directory",
            a.model.display()
        );
    }
    // What would make a child fail at once is checked before any child starts.
    a.vllm.check()?;
    baton_ipc::check_instance(&a.instance).context("--instance")?;
    if a.device == Device::Cuda {
        // `--dtype auto` resolved here: the worker gets the dtype by name.
        let cfg = baton_model::ModelConfig::from_file(&a.model.join("config.json")).ok();
        a.cuda.resolve_dtype(cfg.as_ref());
        crate::cuda_args::check_cuda_kv_dtype(a.engine.kv_cache_dtype, &a.cuda)?;
    } else if let Some(note) = crate::cuda_args::cpu_dtype_note(&a.cuda) {
        say!("baton serve: {note}");
    }
    a.http.check()?;
    crate::args::check_quantization_of(a.quantization.as_deref(), &a.model)?;
    check_lora(&a, &model_arg)?;
    a.http.sampling_defaults(&a.model)?;
    if let Some(t) = &a.http.chat_template {
        let source = baton_frontend::chat::load_template_arg(t)?;
        baton_frontend::chat::ChatTemplate::new(source)
            .map_err(anyhow::Error::msg)
            .context("--chat-template")?;
    }
    if a.http.port != 0 {
        // Bound and released at once (the frontend binds it again, with SO_REUSEADDR).
        std::net::TcpListener::bind((a.http.host.as_str(), a.http.port)).with_context(|| {
            format!(
                "--host {} --port {}: cannot listen",
                a.http.host, a.http.port
            )
        })?;
    }
    let instance = a.instance.clone();
    let model = a.model.display().to_string();
    let mut engine = a.engine.clone();
    if a.device == Device::Cuda && engine.num_blocks.is_none() {
        engine.num_blocks = Some(cuda_kv_blocks(&a)?);
    }
    if a.device == Device::Cuda && engine.launch_timeout.is_none() {
        engine.launch_timeout = Some(crate::args::CUDA_LAUNCH_TIMEOUT_S);
    }
    // Children send a heartbeat every 20-100 ms: under a second would kill healthy ones.
    if !(a.heartbeat_timeout == 0.0 || (1.0..=1e9).contains(&a.heartbeat_timeout)) {
        bail!(
            "--heartbeat-timeout must be 0 (off) or from 1 to 1e9 seconds, not {}",
            a.heartbeat_timeout
        );
    }
    if a.device == Device::Null
        && !matches!(
            a.load_format
                .with_seed(a.seed.unwrap_or(0), Some(&a.model))?,
            baton_model::LoadFormat::Dummy { .. }
        )
    {
        bail!(
            "--device null computes nothing (every row samples one fixed token): it serves \
             only random weights, for benchmarks of the control plane; add --load-format dummy"
        );
    }
    let mut sched_args = vec![
        "scheduler".into(),
        "--instance".into(),
        instance.clone(),
        "--model".into(),
        model.clone(),
        "--frontends".into(),
        a.frontends.to_string(),
        // One argument: a directory named like a flag (`-dash`) stays a value.
        format!("--generation-config={}", a.http.generation_config),
    ];
    sched_args.extend(engine_flags(&engine));
    let tokenizer_flag: Vec<String> = a
        .http
        .tokenizer
        .iter()
        .map(|t| format!("--tokenizer={}", t.display()))
        .collect();
    sched_args.extend(tokenizer_flag.iter().cloned());
    // (The worker reads no tokenizer: it gets no --tokenizer.)
    let weights: Vec<String> = match a
        .load_format
        .with_seed(a.seed.unwrap_or(0), Some(&a.model))?
    {
        baton_model::LoadFormat::Auto => Vec::new(),
        baton_model::LoadFormat::Dummy { seed } => vec![
            "--load-format".into(),
            "dummy".into(),
            "--seed".into(),
            seed.to_string(),
        ],
    };
    sched_args.extend(weights.iter().cloned());
    let device = match a.device {
        Device::Cpu => "cpu",
        Device::Cuda => "cuda",
        Device::Null => "null",
    };
    let mut worker_args: Vec<String> = vec![
        "worker".into(),
        "--instance".into(),
        instance.clone(),
        "--model".into(),
        model.clone(),
        "--device".into(),
        device.into(),
        "--cpu-threads".into(),
        a.cpu_threads.to_string(),
        "--kv-cache-dtype".into(),
        engine.kv_cache_dtype.name().into(),
    ];
    worker_args.extend(weights);
    worker_args.push(a.int8.to_flag().into());
    if a.device == Device::Cuda {
        worker_args.extend(a.cuda.to_flags());
    }
    let mut front_args: Vec<String> = vec![
        "frontend".into(),
        "--instance".into(),
        instance.clone(),
        "--model".into(),
        model_arg.display().to_string(),
    ];
    front_args.extend(a.http.to_flags());
    if let Some(seed) = a.seed {
        front_args.extend(["--seed".into(), seed.to_string()]);
    }
    let lora = a.lora.to_args();
    for v in [&mut sched_args, &mut worker_args, &mut front_args] {
        v.extend(lora.iter().cloned());
    }

    let mut kids = [
        Kid {
            name: "scheduler",
            args: sched_args,
            env: Vec::new(),
            child: None,
            restarts: 0,
            started: Instant::now(),
            crashes: 0,
            restart_at: None,
        },
        Kid {
            name: "worker",
            args: worker_args,
            env: Vec::new(),
            child: None,
            restarts: 0,
            started: Instant::now(),
            crashes: 0,
            restart_at: None,
        },
        Kid {
            name: "frontend",
            args: front_args,
            env: a
                .http
                .api_key
                .iter()
                .map(|k| (crate::frontend_cmd::API_KEY_ENV, k.clone()))
                .collect(),
            child: None,
            restarts: 0,
            started: Instant::now(),
            crashes: 0,
            restart_at: None,
        },
    ];
    // The scheduler first: the others start only once it owns the segment, so a bad flag or a
    // name already in use fails at once, and nothing attaches to another server's segment.
    let mut sched = spawn_with(&kids[0].args, &kids[0].env, false, true)?;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    if let Some(err) = sched.stderr.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if line.contains(" ready (") {
                    let _ = ready_tx.send(());
                }
                say!("{line}");
            }
        });
    }
    kids[0].child = Some(sched);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if ready_rx.recv_timeout(Duration::from_millis(20)).is_ok() {
            break;
        }
        if let Some(Ok(Some(st))) = kids[0].child.as_mut().map(Child::try_wait) {
            shutdown(&mut kids, &instance);
            bail!("the scheduler could not start ({st}); see its error above");
        }
        if stop.load(Ordering::Relaxed) {
            // SIGINT/SIGTERM before the scheduler is ready: a requested stop, as below.
            shutdown(&mut kids, &instance);
            say!("baton serve: stopped during start-up");
            return Ok(());
        }
        if Instant::now() >= deadline {
            shutdown(&mut kids, &instance);
            bail!("the scheduler did not become ready");
        }
    }
    for k in kids[1..].iter_mut() {
        k.child = Some(spawn(k, k.name == "frontend")?);
        k.started = Instant::now();
    }
    // The frontend prints its address on stdout once it listens.
    let mut addr = String::new();
    if let Some(out) = kids[2].child.as_mut().and_then(|c| c.stdout.take()) {
        let mut line = String::new();
        let _ = BufReader::new(out).read_line(&mut line);
        addr = line
            .trim()
            .trim_start_matches("listening on http://")
            .to_owned();
    }
    if addr.is_empty() {
        shutdown(&mut kids, &instance);
        bail!("the frontend did not start (see its error above)");
    }
    // A restarted frontend must listen where this one does (with --port 0, the port it got).
    if let Some(port) = addr.rsplit(':').next() {
        if let Some(i) = kids[2].args.iter().position(|x| x == "--port") {
            kids[2].args[i + 1] = port.to_owned();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while http_health(&addr) != Some(200) {
        if stop.load(Ordering::Relaxed) {
            // SIGINT/SIGTERM while the children start: a requested stop, not a failure.
            shutdown(&mut kids, &instance);
            say!("baton serve: stopped during start-up");
            return Ok(());
        }
        if Instant::now() >= deadline {
            shutdown(&mut kids, &instance);
            bail!("the server did not become healthy within 120 s");
        }
        let dead = kids
            .iter_mut()
            .find_map(|k| match k.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(st))) => Some((k.name, st)),
                _ => None,
            });
        if let Some((name, st)) = dead {
            shutdown(&mut kids, &instance);
            bail!("baton {name} exited during start-up ({st})");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let limits = baton_ipc::Segment::peek_limits(&instance)
        .ok()
        .map(|l| baton_proto::plane::PlaneLimits::from_limits(&l));
    let kv = limits.map_or_else(String::new, |l| {
        let dtype = crate::args::KvCacheDtype::from_code(l.kv_dtype)
            .map_or_else(String::new, |d| {
                format!(" in {}", crate::args::KvCacheDtype::Is(d).name())
            });
        format!(
            ", KV capacity {} pages x {} tokens = {} tokens{dtype}, max model len {}",
            l.num_blocks,
            l.block_size,
            l.num_blocks * l.block_size,
            l.max_model_len
        )
    });
    // What the user gave: a GGUF file, not the directory prepared from it.
    let given = model_arg.display();
    say!("baton serve: ready on http://{addr}, model {given} ({device}){kv}");

    // The participant table, to find hung children by their heartbeats (DESIGN section 6).
    let hang_ms = (a.heartbeat_timeout * 1000.0) as u64;
    let watch = (hang_ms > 0)
        .then(|| baton_worker::daemon::attach(&instance, Duration::ZERO).ok())
        .flatten()
        .and_then(|(seg, _)| {
            let t = seg.participants(baton_ipc::topology::PARTICIPANTS).ok()?;
            Some((seg, t))
        });
    let mut last_watch = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if let Some((_, table)) = &watch {
            if last_watch.elapsed() >= Duration::from_secs(1) {
                last_watch = Instant::now();
                kill_hung(&kids, table, hang_ms);
            }
        }
        for i in 0..kids.len() {
            let exited = kids[i].child.as_mut().map(Child::try_wait);
            let Some(Ok(Some(st))) = exited else { continue };
            if kids[i].name == "scheduler" {
                say!("baton serve: the scheduler exited ({st}); stopping");
                shutdown(&mut kids, &instance);
                bail!("the scheduler exited ({st})");
            }
            let k = &mut kids[i];
            k.child = None;
            k.crashes = if k.started.elapsed() >= STABLE_AFTER {
                1
            } else {
                k.crashes + 1
            };
            let delay = restart_delay(k.crashes);
            say!(
                "baton serve: {} exited ({st}); restarting in {:.2} s",
                k.name,
                delay.as_secs_f64()
            );
            k.restart_at = Some(Instant::now() + delay);
        }
        for k in kids.iter_mut() {
            if k.child.is_some() || k.restart_at.is_none_or(|t| Instant::now() < t) {
                continue;
            }
            k.restart_at = None;
            k.restarts += 1;
            let capture = k.name == "frontend";
            k.child = Some(spawn(k, capture)?);
            k.started = Instant::now();
            if capture {
                // Drain the new frontend's address line in the background.
                if let Some(out) = k.child.as_mut().and_then(|c| c.stdout.take()) {
                    std::thread::spawn(move || {
                        let mut sink = String::new();
                        let _ = BufReader::new(out).read_to_string(&mut sink);
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    say!("baton serve: shutting down");
    shutdown(&mut kids, &instance);
    Ok(())
}

/// SIGKILLs every scheduler or frontend child whose participant slot is live (its kernel lock
/// held) with a heartbeat older than `hang_ms`: stopped or hung, not dead. The supervisor loop
/// then sees it exit and acts as for any death (a frontend is restarted; the scheduler's
/// death stops serve). The worker is left to the scheduler's launch watchdog.
fn kill_hung(kids: &[Kid], table: &baton_ipc::ParticipantTable, hang_ms: u64) {
    for p in table.scan_hung(baton_ipc::process::monotonic_ms(), hang_ms) {
        let Some(k) = kids
            .iter()
            .find(|k| k.name != "worker" && k.child.as_ref().is_some_and(|c| c.id() == p.pid))
        else {
            continue;
        };
        say!(
            "baton serve: the {} (pid {}) sent no heartbeat for over {:.0} s; killing it as hung",
            k.name,
            p.pid,
            hang_ms as f64 / 1000.0
        );
        let _ = kill(Pid::from_raw(p.pid as i32), Signal::SIGKILL);
    }
}

/// Stops the children, frontend first, then the worker, then the scheduler (which unlinks the
/// segment), each with SIGTERM and, after 5 s, SIGKILL. A scheduler that could not unlink its
/// segment (it died, or was killed here because it did not stop: stopped with SIGSTOP, say)
/// leaves it behind, so it is removed here once no process holds it
/// ([`baton_ipc::Segment::remove_stale`] checks that its creator is dead).
fn shutdown(kids: &mut [Kid], instance: &str) {
    for k in kids.iter_mut().rev() {
        let Some(mut c) = k.child.take() else {
            continue;
        };
        let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    say!(
                        "baton serve: the {} did not stop within 5 s of SIGTERM; killing it",
                        k.name
                    );
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
    let _ = baton_ipc::Segment::remove_stale(instance);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_flags_accept_what_baton_does_and_refuse_the_rest() {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            v: VllmFlags,
        }
        let check = |args: &[&str]| {
            P::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
                .map_err(|e| e.to_string())
                .and_then(|p| p.v.check().map_err(|e| e.to_string()))
        };
        // A copied vLLM command line's usual tail.
        check(&[
            "--enable-chunked-prefill",
            "--swap-space",
            "4",
            "--tokenizer-mode",
            "auto",
            "--chat-template-content-format",
            "string",
            "--response-role",
            "assistant",
            "--max-logprobs",
            "20",
            "--download-dir",
            "/tmp",
            "--uvicorn-log-level",
            "warning",
            "--disable-uvicorn-access-log",
            "--max-log-len",
            "100",
            "--enable-prompt-tokens-details",
            "--disable-fastapi-docs",
            "--data-parallel-size",
            "1",
            "--api-server-count",
            "1",
        ])
        .unwrap();
        for (args, flag) in [
            (&["--data-parallel-size", "2"][..], "--data-parallel-size 2"),
            (&["--api-server-count", "4"], "--api-server-count 4"),
            (&["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral"),
            (
                &["--chat-template-content-format", "openai"],
                "--chat-template-content-format openai",
            ),
            (&["--response-role", "user"], "--response-role user"),
            (&["--max-logprobs=-1"], "--max-logprobs -1"),
            (&["--swap-space=-2"], "--swap-space"),
        ] {
            let e = check(args).expect_err(flag);
            assert!(e.contains(flag), "{args:?}: {e}");
        }
    }

    #[test]
    fn restarts_back_off_after_quick_exits_and_cap() {
        let d: Vec<u64> = (1..=9)
            .map(|c| restart_delay(c).as_millis() as u64)
            .collect();
        assert_eq!(d, [0, 250, 500, 1000, 2000, 4000, 8000, 8000, 8000]);
    }

    #[test]
    fn the_scheduler_child_gets_the_watchdog_only_when_one_is_set() {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            e: EngineArgs,
        }
        let flags = |args: &[&str]| {
            engine_flags(&P::parse_from(std::iter::once("x").chain(args.iter().copied())).e)
        };
        assert!(!flags(&[]).iter().any(|f| f == "--launch-timeout"));
        let f = flags(&["--launch-timeout", "7.5"]);
        let i = f.iter().position(|x| x == "--launch-timeout").unwrap();
        assert_eq!(f[i + 1], "7.5");
    }

    #[test]
    fn the_scheduler_child_gets_the_scheduling_policy() {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            e: EngineArgs,
        }
        let parse = |args: &[&str]| {
            P::try_parse_from(std::iter::once("x").chain(args.iter().copied())).map(|p| p.e)
        };
        let e = parse(&["--scheduling-policy", "priority"]).unwrap();
        let f = engine_flags(&e);
        let i = f.iter().position(|x| x == "--scheduling-policy").unwrap();
        assert_eq!(f[i + 1], "priority");
        // The child parses what it is given back to the same policy.
        let back: Vec<&str> = f.iter().map(String::as_str).collect();
        assert_eq!(parse(&back).unwrap().scheduling_policy, e.scheduling_policy);
        assert_eq!(
            parse(&[]).unwrap().scheduling_policy,
            baton_scheduler::SchedulingPolicy::Fcfs
        );
        let err = parse(&["--scheduling-policy", "lifo"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("fcfs or priority"), "{err}");
    }
}
