//! Flags shared by the commands that build an engine (vLLM's names where they exist).

use baton_model::{DType, ModelConfig, PagedKvCache};
use baton_scheduler::{SchedulerConfig, SchedulingPolicy};
use clap::Args;

/// Scheduler and KV-cache flags.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Most sequences running at once (at most 65536).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens computed per step (prefill chunks plus decodes).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV pages in the pool (default: enough for every sequence at full length, capped by
    /// --kv-cache-memory).
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Host memory for the CPU KV cache when --num-blocks is not given, in GiB.
    #[arg(long, default_value_t = 2.0, value_parser = parse_positive)]
    pub kv_cache_memory: f64,
    /// Data type of the KV cache (vLLM's flag): `auto`, the model's (config.json's
    /// torch_dtype; float32 when it has none), or `bfloat16`, `float16`, `float32`. A 16-bit
    /// cache holds twice the tokens in the same memory and halves what a decode step reads;
    /// float32 is the exact reference. Under --device cuda the cache has the --dtype.
    #[arg(long, default_value = "auto", value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Maximum tokens per sequence (default: the model's max_position_embeddings).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Publish launch s+1 before launch s completes (at most 2 in flight).
    #[arg(long, default_value_t = true, overrides_with = "no_async_scheduling")]
    pub async_scheduling: bool,
    /// Turn asynchronous scheduling off.
    #[arg(long, overrides_with = "async_scheduling")]
    pub no_async_scheduling: bool,
    /// Reuse the KV cache of full blocks whose whole prefix matches an earlier request's
    /// (automatic prefix caching; on by default, as in vLLM).
    #[arg(
        long,
        default_value_t = true,
        overrides_with = "no_enable_prefix_caching"
    )]
    pub enable_prefix_caching: bool,
    /// Turn prefix caching off: every request computes its whole prompt.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// The order requests start in and are preempted in (vLLM's `--scheduling-policy`):
    /// `fcfs`, first come first served; `priority`, by each request's `priority` field (lower
    /// first), then arrival. Under `fcfs` a request's `priority` must be 0.
    #[arg(long, default_value = "fcfs", value_parser = parse_policy)]
    pub scheduling_policy: SchedulingPolicy,
    /// Write the scheduler's lifecycle trace (JSON lines) to this file.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// Step watchdog of the scheduler daemon: with launches in flight and no completion for
    /// this many seconds, the worker is taken as hung, killed, and its requests requeued
    /// (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S). 0 turns it off. Default: 120 under `serve
    /// --device cuda`, else off (a CPU worker's prefill of a large model can legitimately take
    /// minutes, and killing it would only repeat the launch).
    #[arg(long, value_parser = crate::frontend_cmd::parse_seconds)]
    pub launch_timeout: Option<f64>,
}

/// The step watchdog's limit under `serve --device cuda` when `--launch-timeout` is not given.
pub const CUDA_LAUNCH_TIMEOUT_S: f64 = 120.0;

impl EngineArgs {
    /// The step watchdog's limit (`None` when off).
    pub fn launch_timeout(&self) -> Option<std::time::Duration> {
        self.launch_timeout
            .filter(|&s| s > 0.0)
            .map(std::time::Duration::from_secs_f64)
    }
}

impl EngineArgs {
    /// The scheduler configuration for `model`.
    ///
    /// # Errors
    /// A message when a flag is out of range.
    pub fn scheduler_config(&self, model: &ModelConfig) -> Result<SchedulerConfig, String> {
        if self.block_size == 0 {
            return Err("--block-size must be at least 1".into());
        }
        if self.max_num_seqs == 0 {
            return Err("--max-num-seqs must be at least 1".into());
        }
        if self.max_num_seqs > MAX_NUM_SEQS {
            return Err(format!(
                "--max-num-seqs {} exceeds {MAX_NUM_SEQS}, the most request slots a scheduler \
                 holds (vLLM's default is 256)",
                self.max_num_seqs
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err("--max-num-batched-tokens must be at least 1".into());
        }
        let max_model_len = match self.max_model_len {
            Some(n @ (0 | 1)) => {
                return Err(format!(
                    "--max-model-len must be at least 2 (a prompt token and a new one), got {n}"
                ))
            }
            Some(n) if n > model.max_position_embeddings => {
                return Err(format!(
                    "--max-model-len {n} exceeds {}",
                    model.context_limit()
                ))
            }
            Some(n) => n,
            None => model.max_position_embeddings,
        };
        let mut cfg = SchedulerConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            block_size: self.block_size,
            num_blocks: 0,
            max_model_len,
            max_inflight: if self.async_scheduling && !self.no_async_scheduling {
                2
            } else {
                1
            },
            enable_prefix_caching: self.enable_prefix_caching && !self.no_enable_prefix_caching,
            policy: self.scheduling_policy,
            // A window as long as the served length releases nothing.
            kv_window: baton_scheduler::sliding_window_kv(&model.sliding_window)
                .filter(|&w| w < max_model_len),
        };
        // Without a window a request holds a page per position; with one, about a window.
        let per_request = match cfg.kv_window {
            None => max_model_len.div_ceil(self.block_size),
            Some(_) => cfg.max_request_pages(),
        };
        cfg.num_blocks = match self.num_blocks {
            Some(0) => return Err("--num-blocks must be at least 1".into()),
            Some(n) => n,
            None => {
                let dtype = self.kv_cache_dtype.resolve(model);
                let per_block = PagedKvCache::bytes_per_block(model, self.block_size, dtype).max(1);
                let budget = (self.kv_cache_memory * (1u64 << 30) as f64) as usize / per_block;
                (self.max_num_seqs.saturating_mul(per_request))
                    .min(budget)
                    .max(1)
            }
        };
        let num_blocks = cfg.num_blocks;
        // Page ids are u32 in the block tables, u32::MAX marking a page not held.
        if num_blocks >= u32::MAX as usize {
            return Err(format!(
                "--num-blocks {num_blocks} exceeds {}, the most pages a pool can number",
                u32::MAX - 1
            ));
        }
        // The scheduler's own bookkeeping per page (free list, holders, last use, prefix key,
        // LRU tick), before any worker allocates the KV itself.
        let bookkeeping = num_blocks as u64 * baton_kv::PagePool::BYTES_PER_PAGE as u64;
        if let Some(avail) = baton_model::host_memory_available() {
            if bookkeeping > avail {
                return Err(format!(
                    "--num-blocks {num_blocks}: the scheduler's bookkeeping of that many pages \
                     alone needs {:.1} GiB, more than the {:.1} GiB of memory available",
                    bookkeeping as f64 / (1u64 << 30) as f64,
                    avail as f64 / (1u64 << 30) as f64
                ));
            }
        }
        if num_blocks < cfg.max_request_pages() {
            let half =
                if self.num_blocks.is_none() && self.kv_cache_dtype.resolve(model) == DType::F32 {
                    ", a 16-bit --kv-cache-dtype"
                } else {
                    ""
                };
            let (what, smaller) = match cfg.kv_window {
                None => (
                    format!("one sequence of the maximum model length {max_model_len}"),
                    "--max-model-len",
                ),
                Some(w) => {
                    let n = self.max_num_batched_tokens;
                    // Prefix caching holds the chunks in flight until they are registered.
                    let lag = if cfg.unregistered_positions() >= w {
                        ", and the chunk in flight, which prefix caching holds until it \
                         completes (--no-enable-prefix-caching or --no-async-scheduling lets \
                         it go)"
                    } else {
                        ""
                    };
                    (
                        format!(
                            "the {} one sequence holds at once (its sliding window of {w} keys \
                             plus a chunk of --max-num-batched-tokens {n}{lag})",
                            count(cfg.max_request_pages(), "block"),
                        ),
                        "--max-num-batched-tokens",
                    )
                }
            };
            return Err(format!(
                "the KV cache ({} of {} = {}) cannot hold {what}; give more --num-blocks (or \
                 --kv-cache-memory{half}) or a smaller {smaller}",
                count(num_blocks, "block"),
                count(self.block_size, "token"),
                count(num_blocks.saturating_mul(self.block_size), "token"),
            ));
        }
        Ok(cfg)
    }
}

/// `n` and `noun`, plural unless `n` is 1: `count(1, "page")` is "1 page", `count(5,
/// "page")` "5 pages".
pub fn count(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// `--kv-cache-dtype`: vLLM's `auto` (the model's dtype) or a storage type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The model's dtype ([`PagedKvCache::auto_dtype`]).
    Auto,
    /// This dtype.
    Is(DType),
}

impl KvCacheDtype {
    /// The dtype the CPU cache of `model` is stored in.
    pub fn resolve(self, model: &ModelConfig) -> DType {
        match self {
            KvCacheDtype::Auto => PagedKvCache::auto_dtype(model),
            KvCacheDtype::Is(d) => d,
        }
    }

    /// The code the scheduler publishes for `dtype` (`baton_proto::plane::KV_DTYPE_*`).
    pub fn code(dtype: DType) -> u8 {
        use baton_proto::plane::{KV_DTYPE_BF16, KV_DTYPE_F16, KV_DTYPE_F32};
        match dtype {
            DType::F32 => KV_DTYPE_F32,
            DType::BF16 => KV_DTYPE_BF16,
            DType::F16 => KV_DTYPE_F16,
        }
    }

    /// The dtype a published code names (`None`: unknown, not published).
    pub fn from_code(code: u8) -> Option<DType> {
        use baton_proto::plane::{KV_DTYPE_BF16, KV_DTYPE_F16, KV_DTYPE_F32};
        match code {
            KV_DTYPE_F32 => Some(DType::F32),
            KV_DTYPE_BF16 => Some(DType::BF16),
            KV_DTYPE_F16 => Some(DType::F16),
            _ => None,
        }
    }

    /// The dtype a CPU worker given this flag stores its cache in, under a scheduler that
    /// published `published` (a `KV_DTYPE_*` code) for `model`: `auto` follows the scheduler
    /// (else the model's dtype); an explicit dtype must be the published one.
    ///
    /// # Errors
    /// An explicit dtype other than the scheduler's.
    pub fn for_worker(self, published: u8, model: &ModelConfig) -> Result<DType, String> {
        match (self, Self::from_code(published)) {
            (KvCacheDtype::Auto, Some(d)) => Ok(d),
            (KvCacheDtype::Auto, None) => Ok(PagedKvCache::auto_dtype(model)),
            (KvCacheDtype::Is(mine), Some(theirs)) if mine != theirs => Err(format!(
                "--kv-cache-dtype {}: the scheduler sized its KV pool for a {} cache; give the \
                 worker --kv-cache-dtype auto (to follow it) or start both with the same value",
                self.name(),
                KvCacheDtype::Is(theirs).name()
            )),
            (KvCacheDtype::Is(mine), _) => Ok(mine),
        }
    }

    /// The flag's value that parses back to `self`.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Is(DType::BF16) => "bfloat16",
            KvCacheDtype::Is(DType::F16) => "float16",
            KvCacheDtype::Is(DType::F32) => "float32",
        }
    }
}

/// Parses `--kv-cache-dtype`: `auto`, `bfloat16`/`bf16`, `float16`/`fp16`/`f16`/`half`,
/// `float32`/`fp32`/`f32`/`float`.
///
/// # Errors
/// Anything else; vLLM's fp8 types get their own message (not supported).
pub fn parse_kv_cache_dtype(s: &str) -> Result<KvCacheDtype, String> {
    if let Some(d) = DType::from_name(s) {
        return Ok(KvCacheDtype::Is(d));
    }
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "auto" => KvCacheDtype::Auto,
        x if x.starts_with("fp8") => {
            return Err(format!(
                "{s:?}: fp8 KV caches are not supported; use auto, bfloat16, float16 or float32"
            ))
        }
        _ => {
            return Err(format!(
                "unknown KV cache dtype {s:?}: use auto, bfloat16, float16 or float32"
            ))
        }
    })
}

/// Parses a positive finite number (`--kv-cache-memory`).
///
/// # Errors
/// Zero, negative, NaN, infinite or not a number.
pub fn parse_positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("expected a positive number, found {s:?}")),
    }
}

/// Parses a share in (0, 1] (`--gpu-memory-utilization`, which vLLM also bounds by 1).
///
/// # Errors
/// Outside (0, 1], or not a number.
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("expected a number in (0, 1], found {s:?}")),
    }
}

/// Parses `--scheduling-policy`.
fn parse_policy(s: &str) -> Result<SchedulingPolicy, String> {
    s.parse()
}

/// Checks a `--tokenizer DIR` flag before anything is started: DIR must be a directory holding
/// a tokenizer.json (a typo must not leave a scheduler without its tokenizer's fingerprint,
/// which would let any frontend attach).
///
/// # Errors
/// DIR is not a directory, or has no tokenizer.json.
pub fn check_tokenizer_dir(flag: Option<&std::path::Path>) -> anyhow::Result<()> {
    let Some(d) = flag else { return Ok(()) };
    if !d.is_dir() {
        anyhow::bail!(
            "--tokenizer {}: not a directory (give the directory holding tokenizer.json)",
            d.display()
        );
    }
    if !d.join("tokenizer.json").is_file() {
        anyhow::bail!("--tokenizer {}: it holds no tokenizer.json", d.display());
    }
    Ok(())
}

/// [`check_quantization`] on the config.json of `model` (read only when the flag is given).
///
/// # Errors
/// As [`check_quantization`], and a config.json that does not load.
pub fn check_quantization_of(flag: Option<&str>, model: &std::path::Path) -> anyhow::Result<()> {
    let Some(m) = flag else { return Ok(()) };
    // vLLM's `--quantization gguf` names the format of a GGUF `--model`.
    if crate::gguf_model::served_file(model).is_some() {
        if m.trim().eq_ignore_ascii_case("gguf") {
            return Ok(());
        }
        anyhow::bail!(
            "--quantization {m}: the model is a GGUF file; give `gguf` or leave the flag out"
        );
    }
    let cfg = baton_model::ModelConfig::from_file(&model.join("config.json"))?;
    check_quantization(flag, &cfg)
}

/// Checks vLLM's `--quantization METHOD` against the model's config: accepted when it names
/// the checkpoint's `quantization_config.quant_method` (case-insensitively; Baton needs no
/// flag to load them, [`baton_model::quant`]), refused otherwise, as vLLM refuses a method
/// that differs from the checkpoint's. An unquantized checkpoint with `fp8` would ask for
/// vLLM's online FP8 quantization, which Baton does not do.
///
/// # Errors
/// The flag names another method than the checkpoint's, or any method for an unquantized
/// checkpoint.
pub fn check_quantization(
    flag: Option<&str>,
    cfg: &baton_model::ModelConfig,
) -> anyhow::Result<()> {
    let Some(m) = flag else { return Ok(()) };
    match &cfg.quantization {
        Some(q) if q.method.eq_ignore_ascii_case(m.trim()) => Ok(()),
        Some(q) => anyhow::bail!(
            "--quantization {m}: the checkpoint's quantization_config says quant_method {:?}; \
             give that, or leave the flag out (the checkpoint's method is used)",
            q.method
        ),
        None if m.trim().eq_ignore_ascii_case("fp8") => anyhow::bail!(
            "--quantization fp8: the checkpoint is not quantized (config.json has no \
             quantization_config), and online FP8 quantization is not supported; leave the \
             flag out to serve it in its own dtype, or give an FP8 checkpoint"
        ),
        None => anyhow::bail!(
            "--quantization {m}: the checkpoint is not quantized (config.json has no \
             quantization_config), and Baton quantizes nothing itself; leave the flag out"
        ),
    }
}

/// Checks that a `--tokenizer` given by flag fits the model: its `tokens` ids must all be
/// logits of the model's `logits` (a larger vocabulary encodes text to ids the model never
/// learnt, or refuses them, so it is another model's tokenizer). A vocabulary under half the
/// logits is allowed (vLLM checks nothing) but warned about: the ids past it decode to no
/// text. Checkpoints pad their logits only to a multiple of 64 or so. Without the flag nothing
/// is checked (a model's own tokenizer is taken as it ships).
///
/// # Errors
/// The flag is given and `tokens > logits`.
pub fn check_tokenizer_fits(
    flag: Option<&std::path::Path>,
    tokens: usize,
    logits: usize,
) -> anyhow::Result<()> {
    if let Some(d) = flag {
        if tokens > logits {
            anyhow::bail!(
                "--tokenizer {}: its vocabulary has {tokens} tokens but the model has {logits} \
                 logits; it is another model's tokenizer",
                d.display()
            );
        }
        if tokens < logits / 2 {
            tracing::warn!(
                "--tokenizer {}: its vocabulary has {tokens} tokens but the model has {logits} \
                 logits; ids it does not have decode to no text (is it another model's \
                 tokenizer?)",
                d.display()
            );
        }
    }
    Ok(())
}

/// Most request slots `--max-num-seqs` takes: 256 times vLLM's default, and few enough that a
/// typo cannot ask for a segment of terabytes.
pub const MAX_NUM_SEQS: usize = 65536;

/// Most frontend slots `--frontends` takes (each is a pair of rings in the segment).
pub const MAX_FRONTENDS: usize = 1024;

/// Parses `--frontends`: 1 to [`MAX_FRONTENDS`].
pub fn parse_frontends(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_FRONTENDS).contains(&n) => Ok(n),
        _ => Err(format!("expected 1 to {MAX_FRONTENDS}, got {s:?}")),
    }
}

/// Most threads `--cpu-threads` takes: far past any host's cores, and few enough that a typo
/// cannot start tens of thousands of threads.
pub const MAX_CPU_THREADS: usize = 1024;

/// Parses `--cpu-threads`: 0 (one per CPU) to [`MAX_CPU_THREADS`].
pub fn parse_cpu_threads(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n <= MAX_CPU_THREADS => Ok(n),
        _ => Err(format!(
            "expected 0 (one thread per CPU) to {MAX_CPU_THREADS}, got {s:?}"
        )),
    }
}

/// The CPU backend's activations for a GGUF file's quantized matrices (`baton serve`,
/// `worker`, `generate` and `bench decode`).
#[derive(Args, Clone, Copy, Debug)]
pub struct Int8Args {
    /// CPU backend (the default): run a GGUF file's quantized matrices as llama.cpp's CPU
    /// backend does, each token's activations quantized to 8 bits (blocks of 32, an f32
    /// scale each; blocks of 256 for the K-quants and IQ4_XS) and integer dot products. Each
    /// product is then off by at most what rounding the activations to 8 bits costs;
    /// outputs stay the same whatever the batch. No effect on other weights or under
    /// --device cuda.
    #[arg(long, overrides_with = "no_cpu_int8_activations")]
    pub cpu_int8_activations: bool,
    /// CPU backend: keep f32 activations over ggml's dequantized values instead, the exact
    /// product of the dequantized model (what the CUDA backend's weights, dequantized at
    /// load, compute); 1.0-2.5x slower at batch-1 decode (Q8_0 the least), 1.3-2.4x on
    /// 64-token steps.
    #[arg(long, overrides_with = "cpu_int8_activations")]
    pub no_cpu_int8_activations: bool,
}

impl Int8Args {
    /// Whether quantized matrices take 8-bit activations (the last of the two flags given
    /// wins; on when neither is).
    pub fn on(&self) -> bool {
        !self.no_cpu_int8_activations
    }

    /// The flag that gives a child process the same choice.
    pub fn to_flag(&self) -> &'static str {
        if self.on() {
            "--cpu-int8-activations"
        } else {
            "--no-cpu-int8-activations"
        }
    }
}

/// The thread count for a `--cpu-threads` flag: the flag, or with 0 one thread per CPU this
/// process may run on.
pub fn cpu_threads(flag: usize) -> usize {
    if flag > 0 {
        flag
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Sets what the served context length `max_model_len` decides in `model`
/// ([`ModelConfig::set_max_model_len`]: LongRoPE's factors) and says on stderr, as `who`,
/// which RoPE factors apply ([`ModelConfig::rope_note`]); says nothing without LongRoPE.
pub fn serve_up_to(who: &str, model: &mut ModelConfig, max_model_len: usize) {
    model.set_max_model_len(max_model_len);
    if let Some(note) = model.rope_note() {
        crate::say!("{who}: {note}");
    }
}

/// vLLM's two-letter short flags for `serve` (argparse takes them; clap's short flags are one
/// letter), each with the long flag it stands for.
pub const VLLM_SHORT_FLAGS: [(&str, &str); 3] = [
    ("-tp", "--tensor-parallel-size"),
    ("-pp", "--pipeline-parallel-size"),
    ("-dp", "--data-parallel-size"),
];

/// A command line with vLLM's two-letter short flags ([`VLLM_SHORT_FLAGS`]) spelled long,
/// as `-tp 1` or `-tp=1`, for `serve` only (the first argument after the program); any other
/// command line is returned as it is.
pub fn expand_vllm_short_flags(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if args.get(1).and_then(|a| a.to_str()) != Some("serve") {
        return args;
    }
    args.into_iter()
        .map(|a| {
            let Some(s) = a.to_str() else {
                return a;
            };
            for (short, long) in VLLM_SHORT_FLAGS {
                if s == short {
                    return long.into();
                }
                if let Some(v) = s.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                    return format!("{long}={v}").into();
                }
            }
            a
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_threads_take_zero_to_the_cap() {
        assert_eq!(parse_cpu_threads("0"), Ok(0));
        assert_eq!(parse_cpu_threads("1024"), Ok(1024));
        for bad in ["1025", "100000", "18446744073709551615", "-1", "x", ""] {
            let e = parse_cpu_threads(bad).unwrap_err();
            assert!(e.contains("1024"), "{bad}: {e}");
        }
    }

    #[test]
    fn int8_activations_are_on_unless_the_last_flag_turns_them_off() {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            i: Int8Args,
        }
        let on = |a: &[&str]| {
            let p = P::try_parse_from(std::iter::once("x").chain(a.iter().copied())).unwrap();
            // What a child process is handed gives the same choice.
            let again = P::try_parse_from(["x", p.i.to_flag()]).unwrap();
            assert_eq!(again.i.on(), p.i.on(), "{a:?}");
            p.i.on()
        };
        assert!(on(&[]));
        assert!(on(&["--cpu-int8-activations"]));
        assert!(!on(&["--no-cpu-int8-activations"]));
        assert!(!on(&[
            "--cpu-int8-activations",
            "--no-cpu-int8-activations"
        ]));
        assert!(on(&["--no-cpu-int8-activations", "--cpu-int8-activations"]));
    }

    #[test]
    fn memory_flags_refuse_values_that_cannot_size_a_cache() {
        for bad in ["-1", "0", "nan", "inf", "x"] {
            assert!(parse_positive(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_positive("0.5"), Ok(0.5));
        for bad in ["0", "-0.1", "1.01", "2", "nan", "x"] {
            assert!(parse_fraction(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_fraction("1"), Ok(1.0));
        assert_eq!(parse_fraction("0.9"), Ok(0.9));
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            e: EngineArgs,
        }
        assert!(P::try_parse_from(["x", "--kv-cache-memory", "-1"]).is_err());
        assert!(P::try_parse_from(["x", "--kv-cache-memory", "1.5"]).is_ok());
    }

    /// `--kv-cache-dtype` parses vLLM's names and ours back to themselves, refuses fp8 and
    /// unknown names, and sizes the pool: a 16-bit cache gets twice the pages of f32 in the
    /// same --kv-cache-memory, and `auto` follows config.json's torch_dtype.
    #[test]
    fn the_kv_cache_dtype_sizes_the_pool() {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            e: EngineArgs,
        }
        for (s, want) in [
            ("auto", KvCacheDtype::Auto),
            ("bfloat16", KvCacheDtype::Is(DType::BF16)),
            ("BF16", KvCacheDtype::Is(DType::BF16)),
            ("half", KvCacheDtype::Is(DType::F16)),
            ("float32", KvCacheDtype::Is(DType::F32)),
        ] {
            let d = parse_kv_cache_dtype(s).unwrap();
            assert_eq!(d, want, "{s}");
            assert_eq!(parse_kv_cache_dtype(d.name()), Ok(d));
        }
        assert!(parse_kv_cache_dtype("fp8_e4m3")
            .unwrap_err()
            .contains("not supported"));
        assert!(parse_kv_cache_dtype("int4")
            .unwrap_err()
            .contains("unknown"));
        assert!(P::try_parse_from(["x", "--kv-cache-dtype", "fp8"]).is_err());

        let mut cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":64,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "vocab_size":10,"max_position_embeddings":64}"#,
        )
        .unwrap();
        let blocks = |cfg: &ModelConfig, args: &[&str]| {
            let mut a = vec!["x", "--kv-cache-memory", "0.001", "--max-num-seqs", "1000"];
            a.extend_from_slice(args);
            P::try_parse_from(a)
                .unwrap()
                .e
                .scheduler_config(cfg)
                .unwrap()
                .num_blocks
        };
        // 2 layers * 16 tokens * 2 heads * 16 dims * 2 (K, V) = 2048 values a page.
        let bytes = (0.001 * (1u64 << 30) as f64) as usize;
        let (f32_pages, half_pages) = (bytes / (2048 * 4), bytes / (2048 * 2));
        assert!(half_pages >= 2 * f32_pages && f32_pages > 100);
        assert_eq!(blocks(&cfg, &[]), f32_pages);
        assert_eq!(blocks(&cfg, &["--kv-cache-dtype", "float32"]), f32_pages);
        assert_eq!(blocks(&cfg, &["--kv-cache-dtype", "bf16"]), half_pages);
        cfg.torch_dtype = Some("bfloat16".into());
        assert_eq!(blocks(&cfg, &[]), half_pages);
        assert_eq!(blocks(&cfg, &["--kv-cache-dtype", "float32"]), f32_pages);

        // A worker: `auto` follows the scheduler's published dtype, else the model's; an
        // explicit dtype must be the published one.
        let (bf16, f32) = (KvCacheDtype::Is(DType::BF16), KvCacheDtype::Is(DType::F32));
        let code = KvCacheDtype::code;
        assert_eq!(
            KvCacheDtype::Auto.for_worker(code(DType::F16), &cfg),
            Ok(DType::F16)
        );
        assert_eq!(
            KvCacheDtype::Auto.for_worker(code(DType::F32), &cfg),
            Ok(DType::F32)
        );
        assert_eq!(KvCacheDtype::Auto.for_worker(0, &cfg), Ok(DType::BF16));
        assert_eq!(f32.for_worker(0, &cfg), Ok(DType::F32));
        assert_eq!(bf16.for_worker(code(DType::BF16), &cfg), Ok(DType::BF16));
        let e = f32.for_worker(code(DType::BF16), &cfg).unwrap_err();
        assert!(e.contains("float32") && e.contains("bfloat16"), "{e}");
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert_eq!(KvCacheDtype::from_code(code(d)), Some(d));
        }
    }

    #[test]
    fn vllm_short_parallel_flags_are_spelled_long_for_serve_only() {
        let args = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            expand_vllm_short_flags(args(&["baton", "serve", "m", "-tp", "1", "-pp=2", "-tpx"])),
            args(&[
                "baton",
                "serve",
                "m",
                "--tensor-parallel-size",
                "1",
                "--pipeline-parallel-size=2",
                "-tpx"
            ])
        );
        let other = args(&["baton", "generate", "-tp", "1"]);
        assert_eq!(expand_vllm_short_flags(other.clone()), other);
    }
}

/// LoRA flags (vLLM's names), taken by `serve` and by each daemon: the scheduler publishes
/// the adapters' fingerprint, the worker loads them, the frontend maps request `model`
/// names to adapter ids (`baton serve` passes the same flags to all three).
#[derive(Args, Clone, Debug, Default)]
pub struct LoraArgs {
    /// Serve LoRA adapters (vLLM's `--enable-lora`); needed with --lora-modules.
    #[arg(long)]
    pub enable_lora: bool,
    /// LoRA adapters as NAME=PATH or a JSON object {"name": ..., "path": ...}, each a Hugging
    /// Face PEFT directory (adapter_config.json and adapter_model.safetensors); a request
    /// whose `model` is NAME runs with that adapter. Several may follow one flag, and the
    /// flag may repeat.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// The largest adapter rank accepted (vLLM's `--max-lora-rank`, default 16, at most 512).
    #[arg(long, default_value_t = baton_model::lora::DEFAULT_MAX_LORA_RANK,
          value_parser = parse_lora_rank)]
    pub max_lora_rank: usize,
    /// vLLM's `--max-loras` (adapters in one batch, default 1). Accepted (at least 1) and not
    /// limiting: every adapter stays loaded and a batch mixes any of them.
    #[arg(long, default_value_t = 1, value_parser = parse_at_least_one)]
    pub max_loras: usize,
    /// vLLM's `--max-cpu-loras`. Accepted (at least --max-loras) and not limiting, as
    /// --max-loras.
    #[arg(long, value_parser = parse_at_least_one)]
    pub max_cpu_loras: Option<usize>,
}

fn parse_lora_rank(s: &str) -> Result<usize, String> {
    let max = baton_model::lora::MAX_LORA_RANK;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("expected a rank from 1 to {max}, not {s:?}")),
    }
}

fn parse_at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("expected an integer of at least 1, not {s:?}")),
    }
}

impl LoraArgs {
    /// The adapters, in flag order (adapter id `i + 1` is entry `i`).
    ///
    /// # Errors
    /// --lora-modules without --enable-lora, a malformed or repeated entry, --max-cpu-loras
    /// below --max-loras.
    pub fn modules(&self) -> anyhow::Result<Vec<baton_model::LoraModule>> {
        if !self.lora_modules.is_empty() && !self.enable_lora {
            anyhow::bail!("--lora-modules needs --enable-lora (as in vLLM)");
        }
        if let Some(c) = self.max_cpu_loras {
            if c < self.max_loras {
                anyhow::bail!(
                    "--max-cpu-loras {c} is below --max-loras {}; it must be at least that",
                    self.max_loras
                );
            }
        }
        baton_model::LoraModule::parse_all(&self.lora_modules).map_err(anyhow::Error::msg)
    }

    /// The modules and their fingerprint (`baton_model::lora::lora_fingerprint`).
    ///
    /// # Errors
    /// As [`LoraArgs::modules`], or an adapter file that cannot be read.
    pub fn fingerprinted(&self) -> anyhow::Result<(Vec<baton_model::LoraModule>, u64)> {
        let m = self.modules()?;
        let f = baton_model::lora::lora_fingerprint(&m)?;
        Ok((m, f))
    }

    /// The flags that reproduce these values, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.enable_lora {
            v.push("--enable-lora".into());
        }
        for m in &self.lora_modules {
            v.push(format!("--lora-modules={m}"));
        }
        v.extend([
            "--max-lora-rank".into(),
            self.max_lora_rank.to_string(),
            "--max-loras".into(),
            self.max_loras.to_string(),
        ]);
        if let Some(c) = self.max_cpu_loras {
            v.extend(["--max-cpu-loras".into(), c.to_string()]);
        }
        v
    }
}
