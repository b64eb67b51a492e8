//! `baton bench decode`: milliseconds per decode step at several batch sizes, output tokens/s,
//! and the HBM floor of each step (weight bytes + KV bytes read, over a measured copy
//! bandwidth), with the ratio measured / floor.
//!
//! The launches are built here, without the scheduler: per batch size, prefill launches of
//! whole prompts (rows packed up to the backend's token capacity), then `gen_len` decode
//! launches whose rows take their input from the previous launch's sampled ids
//! (`PendingFrom`), exactly as the asynchronous scheduler publishes them. With one launch in
//! flight each step is timed from `execute` to its return, i.e. through the fence; with
//! `--in-flight 2` (the default; CUDA only) the steps after the warm-up are submitted while
//! the previous one runs, as the worker daemon does, and a step's time is the whole run's
//! wall time over the steps.

use crate::cuda_args::{
    build_cuda_with, check_cuda_device, cuda_options, CudaArgs, CudaSizes, DtypeFlag,
};
use crate::generate::LoadFormatArg;
use anyhow::{bail, Context, Result};
use baton_cuda::memory::decode_floor_seconds;
use baton_cuda::trace::{summarize, StepTrace, TraceSummary};
use baton_cuda::{CudaWorker, Dtype};
use baton_model::{CpuModel, LlamaWeights, ModelConfig, ModelDir, ModelWeights};
use baton_proto::{Launch, LaunchRow, SamplingParams, SlotRef, NOT_PENDING};
use baton_worker::{Backend, CpuBackend, TableReader};
use clap::{Args, ValueEnum};
use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

/// Devices of the decode benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchDevice {
    /// The f32 CPU reference.
    Cpu,
    /// CUDA.
    Cuda,
}

/// Flags of `baton bench decode`.
#[derive(Args, Clone, Debug)]
pub struct DecodeArgs {
    /// Device.
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu)]
    pub device: BenchDevice,
    /// A Hugging Face model directory (its config.json, and its weights unless
    /// --load-format dummy; no tokenizer is read) or a GGUF file.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight loading; dummy needs only a config (--model or --config).
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// A config.json file, or its JSON text, for --load-format dummy without --model.
    #[arg(long)]
    pub config: Option<String>,
    /// Batch sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,32,128")]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Decode steps measured per batch size.
    #[arg(long, default_value_t = 128)]
    pub gen_len: usize,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seed of dummy weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// After each batch size, time one eager decode step kernel by kernel and print where the
    /// time goes (CUDA only; an event pair around each call, so the total exceeds a graph
    /// replay's).
    #[arg(long)]
    pub breakdown: bool,
    /// Also time each step's device work (CUDA only: timing events from the step's upload to
    /// its fence; two more event records per step) and report it beside the wall time: the
    /// difference is host time per step.
    #[arg(long)]
    pub device_time: bool,
    /// Compile the kernels with the launch trace (`BATON_TRACE=1`) and report where a decode
    /// step's device time goes launch by launch, with the kernels overlapping as they do in
    /// a graph replay: each launch's share of the step is the time from its release (every
    /// earlier kernel done) to the next launch's. CUDA only, with --in-flight 1; the trace
    /// adds a barrier at each kernel's start, a few atomics per thread block that nothing
    /// waits for, and a 32 MB table fill before each step, so steps run a little slower
    /// than without it.
    #[arg(long)]
    pub launch_trace: bool,
    /// Sampling temperature of the decode rows (0: greedy, the default). With a temperature
    /// the rows are sampled (seeded per sequence), so the step includes the sampler's
    /// selection passes.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k filter (0 or -1: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Top log-probabilities returned per row and step (0-20; 0: none, the default), as a
    /// request with `logprobs`/`top_logprobs` asks: the step includes finding them.
    #[arg(long, default_value_t = 0)]
    pub top_logprobs: u32,
    /// Decode launches kept in flight: 2 submits each step while the previous one runs (the
    /// worker daemon's pipelining; CUDA only, the CPU backend runs one at a time), 1 waits
    /// for each step's fence before staging the next. Default 2, or 1 with --device-time or
    /// --launch-trace, which need 1.
    #[arg(long)]
    pub in_flight: Option<usize>,
    /// Threads of the CPU backend's forward pass (0: one per available CPU, as the worker).
    #[arg(long, default_value_t = 0, value_parser = crate::args::parse_cpu_threads)]
    pub cpu_threads: usize,
    /// 8-bit activations for a GGUF file's quantized matrices (the CPU backend's default).
    #[command(flatten)]
    pub int8: crate::args::Int8Args,
    /// Weights of the CPU backend: `auto` (the default) holds them as the CPU worker does (a
    /// 16-bit checkpoint at 2 bytes per weight, a GGUF file's quantized matrices in their
    /// blocks; f32 for --load-format dummy); f32, or rounded to bf16 or f16, which it then
    /// keeps at 2 bytes per weight (its arithmetic is f32 either way). --dtype is the CUDA
    /// backend's.
    #[arg(long, default_value = "auto", value_parser = crate::cuda_args::parse_dtype_flag)]
    pub cpu_dtype: DtypeFlag,
    /// The CPU KV cache's dtype: `auto` (the --cpu-dtype; with `--cpu-dtype auto` the
    /// worker's choice for the model), `bfloat16`, `float16` or `float32`. Under --device
    /// cuda the cache has the --dtype.
    #[arg(long, default_value = "auto", value_parser = crate::args::parse_kv_cache_dtype)]
    pub kv_cache_dtype: crate::args::KvCacheDtype,
    /// Every row runs with a seeded LoRA adapter of this rank on every q, k, v, o, gate, up
    /// and down projection (`baton debug lora-adapter`'s), to measure what serving an
    /// adapter costs; 0 (the default): none. The HBM floor leaves the adapter's bytes out.
    #[arg(long, default_value_t = 0)]
    pub lora_rank: usize,
    /// CUDA flags (--dtype, --enforce-eager, ...).
    #[command(flatten)]
    pub cuda: CudaArgs,
}

impl DecodeArgs {
    /// Decode launches in flight: `--in-flight`, else 1 with `--device-time` or
    /// `--launch-trace` (each times a step alone), else 2.
    pub fn in_flight(&self) -> usize {
        self.in_flight
            .unwrap_or(if self.device_time || self.launch_trace {
                1
            } else {
                2
            })
    }
}

/// One measured batch size.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct DecodePoint {
    /// Sequences decoded together.
    pub batch: usize,
    /// Mean wall time per decode step through the fence, ms.
    pub ms_per_step: f64,
    /// `batch / step time`.
    pub output_tokens_per_s: f64,
    /// Mean HBM floor per step, ms.
    pub floor_ms: f64,
    /// `ms_per_step / floor_ms`.
    pub ratio: f64,
    /// Mean device time per step (CUDA: timing events from the step's upload to its fence),
    /// ms: `ms_per_step` less this is host time per step that pipelined launches could hide.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_ms_per_step: Option<f64>,
    /// Decode launches in flight while timing (1: each step waited for before the next).
    pub in_flight: usize,
    /// With `--breakdown`: one eager decode step, per kernel or GEMM, most time first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub breakdown: Vec<KernelTime>,
    /// With `--launch-trace`: the timed steps' launches, averaged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch_trace: Option<TraceSummary>,
}

/// Time of one kind of call in a profiled step.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct KernelTime {
    /// Kernel name or GEMM label.
    pub name: String,
    /// Calls in the step.
    pub calls: usize,
    /// Their total time, microseconds.
    pub total_us: f64,
}

/// Groups a profile (`(name, ms)` per call) by name, most total time first.
pub fn group_profile(profile: &[(String, f64)]) -> Vec<KernelTime> {
    let mut by: Vec<KernelTime> = Vec::new();
    for (name, ms) in profile {
        match by.iter_mut().find(|k| &k.name == name) {
            Some(k) => {
                k.calls += 1;
                k.total_us += ms * 1e3;
            }
            None => by.push(KernelTime {
                name: name.clone(),
                calls: 1,
                total_us: ms * 1e3,
            }),
        }
    }
    by.sort_by(|a, b| b.total_us.total_cmp(&a.total_us));
    by
}

/// Runs one decode launch of `batch` rows at position `pos` (ids from the tables, rows sampled
/// with `params`) on `w` with profiling on, and returns its calls grouped by name.
///
/// # Errors
/// A backend failure.
pub fn profile_decode_step(
    w: &mut CudaWorker,
    tables: &BenchTables,
    seq: &mut u64,
    batch: usize,
    pos: usize,
    block_size: usize,
    params: SamplingParams,
) -> Result<Vec<KernelTime>> {
    *seq += 1;
    let l = Launch {
        seq: *seq,
        rows: (0..batch)
            .map(|s| LaunchRow {
                params: SamplingParams {
                    seed: params.seed.wrapping_add(s as u64),
                    ..params
                },
                ..row(s, pos, 1, block_size, true)
            })
            .collect(),
    };
    w.set_profiling(true);
    let r = w.execute(&l, tables).context("profiled decode step");
    let profile = w.take_profile().map_err(|e| anyhow::anyhow!("{e}"));
    w.set_profiling(false);
    r?;
    Ok(group_profile(&profile?))
}

/// Token and block tables of the benchmark's synthetic sequences: sequence `i` has prompt
/// token `p` = `(7 + 31 i + 17 p) % vocab` and pages `i * pages_per_seq ..`.
pub struct BenchTables {
    vocab: u32,
    pages_per_seq: u32,
}

impl BenchTables {
    /// Tables for `pages_per_seq` pages per sequence over `vocab` ids.
    pub fn new(vocab: usize, pages_per_seq: usize) -> Self {
        Self {
            vocab: vocab.max(1) as u32,
            pages_per_seq: pages_per_seq as u32,
        }
    }
}

impl TableReader for BenchTables {
    fn read_tokens(&self, slot: u32, range: Range<usize>, out: &mut Vec<u32>) {
        out.extend(range.map(|p| (7 + 31 * slot + 17 * p as u32) % self.vocab));
    }
    fn read_blocks(&self, slot: u32, n: usize, out: &mut Vec<u32>) {
        out.extend((0..n as u32).map(|j| slot * self.pages_per_seq + j));
    }
    /// The bench's rows carry no logit bias (`logit_bias_len == 0`), so nothing is read.
    fn read_logit_bias(&self, _slot: u32, _n: usize, _out: &mut Vec<(u32, f32)>) {}
    fn read_token_mask(&self, _slot: u32, out: &mut Vec<u32>) {
        out.clear();
    }
}

fn row(slot: usize, first_pos: usize, n: usize, block_size: usize, sample: bool) -> LaunchRow {
    LaunchRow {
        req: SlotRef {
            slot: slot as u32,
            generation: 0,
        },
        first_pos: first_pos as u32,
        num_tokens: n as u32,
        num_blocks: (first_pos + n).div_ceil(block_size) as u32,
        sample: u32::from(sample),
        pending_launch: NOT_PENDING,
        pending_row: 0,
        output_index: 0,
        lora: 0,
        reserved: 0,
        params: SamplingParams::greedy(),
    }
}

/// What [`measure_batch`] drives: a backend, and the device's share of its last step where
/// the backend measures it (CUDA with step timing on).
pub trait BenchBackend {
    /// The backend.
    fn backend(&mut self) -> &mut dyn Backend;
    /// Device milliseconds of the last executed step, or `None`.
    fn last_step_device_ms(&self) -> Option<f64> {
        None
    }
    /// The launch trace of the last executed step, or `None` (a backend without one).
    ///
    /// # Errors
    /// A device failure.
    fn take_launch_trace(&mut self) -> Result<Option<StepTrace>> {
        Ok(None)
    }
}

impl BenchBackend for CudaWorker {
    fn backend(&mut self) -> &mut dyn Backend {
        self
    }
    fn last_step_device_ms(&self) -> Option<f64> {
        CudaWorker::last_step_device_ms(self)
    }
    fn take_launch_trace(&mut self) -> Result<Option<StepTrace>> {
        Ok(CudaWorker::take_launch_trace(self)?)
    }
}

impl BenchBackend for CpuBackend {
    fn backend(&mut self) -> &mut dyn Backend {
        self
    }
}

/// Timing of one batch size ([`measure_batch`]).
#[derive(Clone, Debug)]
pub struct BatchTiming {
    /// Mean wall seconds per timed decode step, through the fence.
    pub step_s: f64,
    /// Mean device seconds per timed step (upload to fence), when the backend reports it.
    pub device_step_s: Option<f64>,
    /// Context length (tokens) of each timed step.
    pub ctxs: Vec<usize>,
    /// The launch trace of each timed step where the backend traces (steps run one at a
    /// time only), else empty.
    pub traces: Vec<StepTrace>,
}

/// The decode rows' sampling parameters from `--temperature`, `--top-p` and `--top-k` (greedy
/// by default; each sequence's seed is added to its slot).
///
/// # Errors
/// A temperature that is negative or not finite, a top-p outside (0, 1], a top-k below -1,
/// a top-p or top-k without a temperature (greedy rows would ignore them), a sampled request
/// that the sampler treats as greedy (top-k 1, a temperature whose inverse overflows), more
/// top log-probabilities than the API allows.
pub fn decode_params(a: &DecodeArgs) -> Result<SamplingParams> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!("--temperature {} must be finite and >= 0", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {} must be in (0, 1]", a.top_p);
    }
    if a.top_k < -1 {
        bail!("--top-k {} must be >= -1 (0 or -1: off)", a.top_k);
    }
    if a.temperature == 0.0 && (a.top_p < 1.0 || a.top_k > 0) {
        bail!(
            "--top-p and --top-k need --temperature > 0: at temperature 0 every row is greedy, \
             so the benchmark would not measure them"
        );
    }
    if a.top_logprobs as usize > baton_proto::MAX_TOP_LOGPROBS {
        bail!(
            "--top-logprobs {} must be at most {}",
            a.top_logprobs,
            baton_proto::MAX_TOP_LOGPROBS
        );
    }
    if a.temperature > 0.0 && (a.top_k == 1 || !(1.0 / a.temperature).is_finite()) {
        bail!(
            "--top-k 1, or a temperature whose inverse overflows ({}), samples greedily; \
             leave --temperature at 0 to benchmark greedy rows",
            a.temperature
        );
    }
    Ok(SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: 1_000,
        top_logprobs: a.top_logprobs,
        want_logprob: u32::from(a.top_logprobs > 0),
        ..SamplingParams::greedy()
    })
}

/// Runs one batch size on `target`: prefill, then `gen_len` decode steps (rows sampled with
/// `params`, the seed offset by each row's slot), the first a warm-up. With `in_flight` > 1
/// (capped by the backend's [`Backend::max_in_flight`]) the timed steps are submitted that
/// many deep and the step time is the run's wall time over the steps.
///
/// # Errors
/// A backend failure.
#[allow(clippy::too_many_arguments)]
pub fn measure_batch(
    target: &mut dyn BenchBackend,
    tables: &BenchTables,
    seq: &mut u64,
    batch: usize,
    prompt_len: usize,
    gen_len: usize,
    block_size: usize,
    max_tokens: usize,
    params: SamplingParams,
    in_flight: usize,
    lora: u32,
) -> Result<BatchTiming> {
    let depth = in_flight.clamp(1, target.backend().max_in_flight().max(1));
    // Prefill whole prompts, rows packed up to the token capacity.
    let per_launch = (max_tokens / prompt_len.max(1)).max(1);
    let mut i = 0;
    while i < batch {
        let n = per_launch.min(batch - i);
        *seq += 1;
        let l = Launch {
            seq: *seq,
            rows: (i..i + n)
                .map(|s| LaunchRow {
                    lora,
                    ..row(s, 0, prompt_len, block_size, false)
                })
                .collect(),
        };
        target.backend().execute(&l, tables).context("prefill")?;
        i += n;
    }
    // Decode: the first step reads position prompt_len from the table, the others take the
    // previous launch's sampled ids on the device.
    let mut total = 0.0;
    let mut device_total = Some(0.0);
    let mut timed = 0;
    let mut ctxs = Vec::with_capacity(gen_len);
    let mut traces = Vec::new();
    let decode_launch = |seq: u64, step: usize| {
        let pos = prompt_len + step;
        let rows = (0..batch)
            .map(|s| {
                let mut r = row(s, pos, 1, block_size, true);
                r.output_index = step as u32;
                r.lora = lora;
                r.params = SamplingParams {
                    seed: params.seed.wrapping_add(s as u64),
                    ..params
                };
                if step > 0 {
                    r.pending_launch = seq - 1;
                    r.pending_row = s as u32;
                }
                r
            })
            .collect();
        Launch { seq, rows }
    };
    let synchronous = if depth > 1 { 1.min(gen_len) } else { gen_len };
    for step in 0..synchronous {
        *seq += 1;
        let pos = prompt_len + step;
        let l = decode_launch(*seq, step);
        let t = Instant::now();
        let c = target
            .backend()
            .execute(&l, tables)
            .context("decode step")?;
        let dt = t.elapsed().as_secs_f64();
        let device_ms = target.last_step_device_ms();
        let trace = target
            .take_launch_trace()
            .context("reading the launch trace")?;
        anyhow::ensure!(c.sampled.len() == batch, "a decode step lost rows");
        // Step 0 (table input, first use of the shape) is a warm-up.
        if step > 0 || gen_len == 1 {
            total += dt;
            device_total = device_total.zip(device_ms).map(|(a, ms)| a + ms / 1e3);
            timed += 1;
            ctxs.push(pos + 1);
            traces.extend(trace);
        }
    }
    if synchronous < gen_len {
        // Pipelined: keep `depth` steps in flight, timed as a whole from the first submit
        // to the last fence.
        let finish = |target: &mut dyn BenchBackend| -> Result<()> {
            let (_, c) = target
                .backend()
                .finish()
                .context("the backend lost a launch in flight")?;
            let c = c.context("decode step")?;
            anyhow::ensure!(c.sampled.len() == batch, "a decode step lost rows");
            Ok(())
        };
        let t = Instant::now();
        let mut inflight = 0;
        for step in synchronous..gen_len {
            *seq += 1;
            let l = decode_launch(*seq, step);
            if inflight == depth {
                finish(target)?;
                inflight -= 1;
            }
            let queued = target.backend().submit(&l, tables).context("decode step")?;
            anyhow::ensure!(queued, "the backend refused to overlap a decode step");
            inflight += 1;
            ctxs.push(prompt_len + step + 1);
        }
        while inflight > 0 {
            finish(target)?;
            inflight -= 1;
        }
        total = t.elapsed().as_secs_f64();
        timed = gen_len - synchronous;
        device_total = None;
    }
    let n = timed.max(1) as f64;
    Ok(BatchTiming {
        step_s: total / n,
        device_step_s: device_total.filter(|_| timed > 0).map(|s| s / n),
        ctxs,
        traces,
    })
}

/// The benchmarked backend, typed so the CUDA worker's profiling is reachable.
enum Bench {
    Cpu(Box<CpuBackend>),
    Cuda(Box<CudaWorker>),
}

impl Bench {
    fn as_target(&mut self) -> &mut dyn BenchBackend {
        match self {
            Bench::Cpu(b) => b.as_mut(),
            Bench::Cuda(w) => w.as_mut(),
        }
    }
}

/// Host memcpy bandwidth in bytes/s (read + write counted), best of 5 copies of 256 MiB.
pub fn host_copy_bandwidth() -> f64 {
    let n = 256 << 20;
    let a = vec![1u8; n];
    let mut b = vec![0u8; n];
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        b.copy_from_slice(&a);
        std::hint::black_box(&b);
        let s = t.elapsed().as_secs_f64();
        if s > 0.0 {
            best = best.max(2.0 * n as f64 / s);
        }
    }
    best
}

fn load_config(a: &DecodeArgs) -> Result<ModelConfig> {
    if let Some(c) = &a.config {
        let t = c.trim_start();
        return if t.starts_with('{') {
            Ok(ModelConfig::from_json_str_named(t, "--config")?)
        } else {
            Ok(ModelConfig::from_file(std::path::Path::new(c))?)
        };
    }
    match &a.model {
        Some(dir) => Ok(ModelConfig::from_file(&ModelDir::new(dir).config_path())?),
        None => bail!("give --model DIR, or --load-format dummy --config JSON"),
    }
}

fn load_weights(a: &DecodeArgs, cfg: &ModelConfig) -> Result<ModelWeights> {
    match (a.load_format, &a.model) {
        (LoadFormatArg::Dummy, _) => {
            baton_model::check_dummy_fits(cfg)?;
            Ok(LlamaWeights::dummy(cfg, a.seed).into())
        }
        (f, Some(dir)) => {
            let format = f.with_seed(a.seed, Some(dir))?;
            Ok(ModelDir::new(dir).load_mapped_weights(format)?.weights)
        }
        (_, None) => bail!("--config needs --load-format dummy"),
    }
}

/// Runs `baton bench decode`.
///
/// # Errors
/// Bad flags, a model that fails to load, a backend failure.
pub fn run(a: &DecodeArgs) -> Result<()> {
    if let Some(m) = &a.model {
        if let Some(g) = crate::gguf_model::resolve(m, None, false)? {
            let mut a = a.clone();
            a.model = Some(g.dir);
            return run(&a);
        }
    }
    if a.batch.is_empty() || a.batch.contains(&0) {
        bail!("--batch needs positive sizes");
    }
    if a.prompt_len == 0 || a.gen_len == 0 || a.block_size == 0 {
        bail!("--prompt-len, --gen-len and --block-size must be at least 1");
    }
    let mut cfg = load_config(a)?;
    let max_len = a.prompt_len + a.gen_len + 1;
    if cfg.max_position_embeddings < max_len {
        bail!("prompt + gen ({max_len}) exceeds {}", cfg.context_limit());
    }
    crate::args::serve_up_to("baton bench decode", &mut cfg, max_len);
    let params = decode_params(a)?;
    if a.breakdown && a.device != BenchDevice::Cuda {
        bail!("--breakdown needs --device cuda");
    }
    if a.device_time && a.device != BenchDevice::Cuda {
        bail!("--device-time needs --device cuda");
    }
    if a.in_flight() == 0 {
        bail!("--in-flight must be at least 1");
    }
    if a.launch_trace && a.device != BenchDevice::Cuda {
        bail!("--launch-trace needs --device cuda");
    }
    if a.launch_trace && a.in_flight() > 1 {
        bail!(
            "--launch-trace reads each step's trace after its fence: give --in-flight 1 with \
             it (its default)"
        );
    }
    if a.device_time && a.in_flight() > 1 {
        bail!(
            "--device-time times each step alone: give --in-flight 1 with it (steps in \
             flight overlap, so one step's device time is not its own)"
        );
    }
    if let Some(dir) = a.out.as_deref().and_then(std::path::Path::parent) {
        // Before minutes of benchmarking, not after.
        anyhow::ensure!(
            dir.as_os_str().is_empty() || dir.is_dir(),
            "--out {}: no directory {}",
            a.out.as_deref().unwrap_or(dir).display(),
            dir.display()
        );
    }
    let mut resolved = a.clone();
    resolved.cuda.resolve_dtype(Some(&cfg));
    let a = &resolved;
    if a.device == BenchDevice::Cuda {
        crate::cuda_args::check_cuda_kv_dtype(a.kv_cache_dtype, &a.cuda)?;
        check_cuda_device(&a.cuda, Some(&cfg))?;
    }
    if a.lora_rank > baton_model::lora::MAX_LORA_RANK {
        bail!(
            "--lora-rank {} is above {}",
            a.lora_rank,
            baton_model::lora::MAX_LORA_RANK
        );
    }
    let bench_cfg = cfg.clone();
    let weights = load_weights(a, &cfg)?;
    let max_batch = *a.batch.iter().max().unwrap_or(&1);
    let pages_per_seq = max_len.div_ceil(a.block_size);
    let num_blocks = max_batch * pages_per_seq;
    let max_tokens = a.prompt_len.max((max_batch * a.prompt_len).min(8192));
    let shape = baton_cuda::executor::model_shape(&cfg);
    let vocab = cfg.vocab_size;
    // Bytes per weight and per KV element.
    let (mut backend, elem_bytes, kv_elem_bytes, bandwidth, label): (
        Bench,
        f64,
        usize,
        f64,
        String,
    ) = match a.device {
        BenchDevice::Cpu => {
            // The cache is zero-filled at once: refuse what this machine cannot hold
            // rather than be killed by the OOM killer part way.
            let kv_dtype = match (a.kv_cache_dtype, a.cpu_dtype) {
                (crate::args::KvCacheDtype::Auto, DtypeFlag::Is(d)) => {
                    crate::cuda_args::model_dtype(d)
                }
                (kv, DtypeFlag::Auto) => kv.resolve(&cfg),
                (crate::args::KvCacheDtype::Is(d), _) => d,
            };
            let kv_bytes = num_blocks as f64
                * baton_model::PagedKvCache::bytes_per_block(&cfg, a.block_size, kv_dtype) as f64;
            if let Some(avail) = baton_model::host_memory_available() {
                anyhow::ensure!(
                    kv_bytes <= 0.8 * avail as f64,
                    "--batch {max_batch} at {max_len} tokens needs a {:.1} GiB CPU KV cache \
                         but only {:.1} GiB of memory is available; use smaller batches or \
                         lengths",
                    kv_bytes / (1u64 << 30) as f64,
                    avail as f64 / (1u64 << 30) as f64
                );
            }
            let (mut m, weights_label) = match (a.cpu_dtype, weights) {
                (DtypeFlag::Auto, ModelWeights::Mapped(src)) => (
                    CpuModel::from_source(cfg.clone(), &src)?,
                    "stored".to_owned(),
                ),
                (DtypeFlag::Auto, ModelWeights::Host(w)) => {
                    (CpuModel::try_new(cfg.clone(), w)?, "f32".to_owned())
                }
                (DtypeFlag::Is(d), weights) => {
                    let mut host = weights.into_host(&cfg)?;
                    if d != Dtype::F32 {
                        host.map_values(|x| d.round(x));
                    }
                    (CpuModel::try_new(cfg.clone(), host)?, d.name().to_owned())
                }
            };
            let threads = crate::args::cpu_threads(a.cpu_threads);
            m.set_threads(threads).map_err(anyhow::Error::msg)?;
            let int8 = m.set_int8_activations(a.int8.on());
            // Bytes per weight as held (a GGUF file's blocks: a fraction of a byte more
            // than their bits over 8), for the floor.
            let per_weight = m.weight_bytes() as f64 / m.weight_values().max(1) as f64;
            let b = CpuBackend::try_new(m, num_blocks, a.block_size, kv_dtype)
                .map_err(anyhow::Error::msg)?;
            (
                Bench::Cpu(Box::new(b)),
                per_weight,
                kv_dtype.size(),
                host_copy_bandwidth(),
                format!(
                    "cpu {weights_label} weights ({per_weight:.2} bytes each{}), {} KV cache, \
                     {threads} threads",
                    if int8 > 0 { ", int8 activations" } else { "" },
                    crate::args::KvCacheDtype::Is(kv_dtype).name()
                ),
            )
        }
        BenchDevice::Cuda => {
            let sizes = CudaSizes {
                block_size: a.block_size,
                num_blocks: Some(num_blocks),
                max_tokens,
                max_rows: max_batch,
                max_model_len: max_len,
            };
            let mut opts = cuda_options(&a.cuda, sizes)?;
            if a.launch_trace {
                opts.tuning
                    .kernel_defines
                    .retain(|d| !d.starts_with("BATON_TRACE="));
                opts.tuning.kernel_defines.push("BATON_TRACE=1".to_owned());
            }
            let mut w = build_cuda_with(cfg, weights, opts)?;
            w.set_step_timing(a.device_time)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let bw = w
                .measure_copy_bandwidth(1 << 30, 10)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let label = format!(
                "cuda {} {}{}",
                a.cuda.dtype.name(),
                if a.cuda.enforce_eager {
                    "eager"
                } else {
                    "graphs"
                },
                match w.persistent_decode() {
                    Some(grid) => format!(", persistent decode ({grid} blocks)"),
                    None => String::new(),
                }
            );
            let e = a.cuda.dtype.size();
            (Bench::Cuda(Box::new(w)), e as f64, e, bw, label)
        }
    };
    let label = if a.lora_rank > 0 {
        let dir = std::env::temp_dir().join(format!("baton-bench-lora-{}", std::process::id()));
        let loaded = baton_model::lora::write_dummy_adapter(
            &dir,
            &bench_cfg,
            a.lora_rank,
            2.0 * a.lora_rank as f64,
            0.05,
            a.seed,
        )
        .and_then(|()| {
            let m = baton_model::LoraModule {
                name: "bench".into(),
                path: dir.clone(),
            };
            baton_model::LoraAdapter::load(&m, &bench_cfg, a.lora_rank)
        });
        let _ = std::fs::remove_dir_all(&dir);
        backend
            .as_target()
            .backend()
            .set_lora_adapters(vec![loaded?])?;
        format!(
            "{label}, every row with a rank-{} LoRA adapter",
            a.lora_rank
        )
    } else {
        label
    };
    let tables = BenchTables::new(vocab, pages_per_seq);
    let mut seq = 0u64;
    let mut points = Vec::new();
    let mut sampling = if params.temperature > 0.0 {
        format!(
            "sampled (temperature {}, top-p {}, top-k {})",
            params.temperature, params.top_p, params.top_k
        )
    } else {
        "greedy".to_owned()
    };
    if params.top_logprobs > 0 {
        sampling += &format!(", {} top log-probabilities", params.top_logprobs);
    }
    for &b in &a.batch {
        let BatchTiming {
            step_s,
            device_step_s,
            ctxs,
            traces,
        } = measure_batch(
            backend.as_target(),
            &tables,
            &mut seq,
            b,
            a.prompt_len,
            a.gen_len,
            a.block_size,
            max_tokens,
            params,
            a.in_flight(),
            u32::from(a.lora_rank > 0),
        )?;
        let in_flight = a
            .in_flight()
            .clamp(1, backend.as_target().backend().max_in_flight().max(1));
        let floor_s = ctxs
            .iter()
            .map(|&c| decode_floor_seconds(&shape, elem_bytes, kv_elem_bytes, b, c, bandwidth))
            .sum::<f64>()
            / ctxs.len().max(1) as f64;
        let breakdown = match &mut backend {
            Bench::Cuda(w) if a.breakdown => profile_decode_step(
                w,
                &tables,
                &mut seq,
                b,
                a.prompt_len + a.gen_len - 1,
                a.block_size,
                params,
            )?,
            _ => Vec::new(),
        };
        points.push(DecodePoint {
            batch: b,
            ms_per_step: step_s * 1e3,
            device_ms_per_step: device_step_s.map(|s| s * 1e3),
            output_tokens_per_s: b as f64 / step_s.max(1e-12),
            floor_ms: floor_s * 1e3,
            ratio: step_s / floor_s.max(1e-15),
            in_flight,
            breakdown,
            launch_trace: a.launch_trace.then(|| {
                summarize(
                    &traces.iter().map(StepTrace::launches).collect::<Vec<_>>(),
                    traces.first().map_or(0, |t| t.tick_ns),
                )
            }),
        });
    }
    // The weights a step reads (the embedding table but one row each aside); a
    // mixture-of-experts step reads only its tokens' experts, so both figures are given.
    let gb = |elems: usize| elems as f64 * elem_bytes / 1e9;
    let read = gb(shape.weight_elems_read_per_step(1));
    let weights = match shape.moe {
        None => format!("weights {read:.2} GB"),
        Some(_) => format!(
            "weights {:.2} GB, {read:.2} GB of them read by a batch-1 step",
            gb(shape.weight_elems_resident() - shape.vocab * shape.hidden)
        ),
    };
    outln!(
        "decode on {label}: prompt {} gen {}, {sampling}, {} in flight, copy bandwidth {:.1} GB/s, \
         {weights}",
        a.prompt_len,
        a.gen_len,
        points.first().map_or(1, |p| p.in_flight),
        bandwidth / 1e9,
    );
    let device = points.iter().any(|p| p.device_ms_per_step.is_some());
    outln!(
        "{:>6} {:>12} {:>14} {:>12} {:>14}{}",
        "batch",
        "ms/step",
        "tokens/s",
        "floor ms",
        "measured/floor",
        if device { "  device ms/step" } else { "" }
    );
    for p in &points {
        let dev = match p.device_ms_per_step {
            Some(ms) if device => format!(" {ms:>16.3}"),
            _ if device => format!(" {:>16}", "-"),
            _ => String::new(),
        };
        outln!(
            "{:>6} {:>12.3} {:>14.1} {:>12.3} {:>14.2}{dev}",
            p.batch,
            p.ms_per_step,
            p.output_tokens_per_s,
            p.floor_ms,
            p.ratio
        );
    }
    for p in points.iter().filter(|p| !p.breakdown.is_empty()) {
        let total: f64 = p.breakdown.iter().map(|k| k.total_us).sum();
        outln!(
            "\nbatch {}: one eager decode step, kernel by kernel ({:.1} us in all)",
            p.batch,
            total
        );
        outln!(
            "{:>40} {:>6} {:>10} {:>6}",
            "kernel",
            "calls",
            "us",
            "share"
        );
        for k in &p.breakdown {
            outln!(
                "{:>40} {:>6} {:>10.1} {:>5.1}%",
                k.name,
                k.calls,
                k.total_us,
                100.0 * k.total_us / total.max(1e-9)
            );
        }
    }
    for p in &points {
        if let Some(t) = &p.launch_trace {
            print_launch_trace(p.batch, t);
        }
    }
    if let Some(path) = &a.out {
        let j = serde_json::json!({
            "device": label,
            "prompt_len": a.prompt_len,
            "gen_len": a.gen_len,
            "sampling": sampling,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "weight_bytes_per_step": shape.weight_elems_read_per_step(1) as f64 * elem_bytes,
            "points": points,
        });
        std::fs::write(path, serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Launch positions of a step printed one by one after the per-site table (the first layer's
/// pattern and a little more; `--out` has them all).
const TRACE_POSITIONS_PRINTED: usize = 16;

/// Prints a [`TraceSummary`]: per wait site, then the step's first launches one by one.
fn print_launch_trace(batch: usize, t: &TraceSummary) {
    outln!(
        "\nbatch {batch}: launch trace over {} steps ({} left out: another launch sequence or a \
         shared slot), {:.1} us from the first launch's release to the last's, {:.1} us of it \
         between a launch's last exit and the next one's release; clock tick {} ns",
        t.steps,
        t.skipped,
        t.span_us,
        t.handoff_us,
        t.tick_ns
    );
    if t.steps == 0 {
        return;
    }
    outln!(
        "{:>32} {:>8} {:>10} {:>10} {:>6}",
        "wait site",
        "launches",
        "us/step",
        "us/launch",
        "share"
    );
    for site in &t.sites {
        outln!(
            "{:>32} {:>8} {:>10.1} {:>10.2} {:>5.1}%",
            site.site,
            site.launches,
            site.share_us,
            site.share_us / site.launches.max(1) as f64,
            100.0 * site.share_us / t.span_us.max(1e-9)
        );
    }
    outln!(
        "{:>5} {:>32} {:>12} {:>9} {:>8} {:>8} {:>9} {:>9}",
        "#",
        "wait site",
        "blocks",
        "share us",
        "body us",
        "hand us",
        "early us",
        "spread us"
    );
    let us = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    for p in t.positions.iter().take(TRACE_POSITIONS_PRINTED) {
        outln!(
            "{:>5} {:>32} {:>12} {:>9} {:>8} {:>8} {:>9.2} {:>9.2}",
            p.index,
            p.site,
            format!("{:.0}/{}", p.blocks, p.nblocks),
            us(p.share_us),
            us(p.body_us),
            us(p.handoff_us),
            p.early_us,
            p.spread_us
        );
    }
}
