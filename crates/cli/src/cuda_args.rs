//! Flags of the CUDA backend and the one place that builds it for the CLI.

use anyhow::{Context, Result};
use baton_cuda::{CudaWorker, CudaWorkerOptions, Dtype, KvBlocks, Tuning};
use baton_model::{ModelConfig, ModelWeights};
use clap::Args;

/// Refuses a `--kv-cache-dtype` the CUDA backend does not store: its KV cache is in --dtype.
///
/// # Errors
/// `kv` names another dtype than `cuda.dtype`.
pub fn check_cuda_kv_dtype(kv: crate::args::KvCacheDtype, cuda: &CudaArgs) -> Result<()> {
    let same = match kv {
        crate::args::KvCacheDtype::Auto => true,
        crate::args::KvCacheDtype::Is(d) => d == model_dtype(cuda.dtype),
    };
    anyhow::ensure!(
        same,
        "--kv-cache-dtype {} with --device cuda: the CUDA KV cache is stored in --dtype ({}); \
         give --kv-cache-dtype auto or --dtype {}",
        kv.name(),
        cuda.dtype.name(),
        kv.name()
    );
    Ok(())
}

/// The model crate's name for a CUDA element type.
pub fn model_dtype(d: Dtype) -> baton_model::DType {
    match d {
        Dtype::Bf16 => baton_model::DType::BF16,
        Dtype::F16 => baton_model::DType::F16,
        Dtype::F32 => baton_model::DType::F32,
    }
}

/// Flags of `--device cuda` (vLLM's names).
#[derive(Args, Clone, Debug)]
pub struct CudaArgs {
    /// Element type of weights, activations and KV on the GPU: `auto` (vLLM's default: the
    /// model's `torch_dtype` when it is bfloat16 or float16, else bf16, as vLLM runs float32
    /// checkpoints in bf16 on GPUs), bf16, f16 or f32 (f32 matches the CPU reference); vLLM's
    /// names (`bfloat16`, `half`, `float16`, `float`, `float32`) too.
    #[arg(long = "dtype", default_value = "auto", value_parser = parse_dtype_flag)]
    pub dtype_flag: DtypeFlag,
    /// The dtype in use: `--dtype`, with `auto` resolved against the model by
    /// [`CudaArgs::resolve_dtype`] (bf16 until then).
    #[arg(skip = Dtype::Bf16)]
    pub dtype: Dtype,
    /// Share of the GPU's memory this instance may use (weights + activations + KV cache);
    /// the KV pool gets what is left, unless --num-blocks is given.
    #[arg(long, default_value_t = 0.9, value_parser = crate::args::parse_fraction)]
    pub gpu_memory_utilization: f64,
    /// Run every launch eagerly: no CUDA graphs for decode batches.
    #[arg(long)]
    pub enforce_eager: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub cuda_device: usize,
    /// Run small decode batches (at most 8 sequences) through cuBLAS and separate norm and
    /// activation kernels instead of Baton's fused GEMV kernels (for comparison).
    #[arg(long)]
    pub no_fused_decode: bool,
}

impl Default for CudaArgs {
    fn default() -> Self {
        Self {
            dtype_flag: DtypeFlag::Auto,
            dtype: Dtype::Bf16,
            gpu_memory_utilization: 0.9,
            enforce_eager: false,
            cuda_device: 0,
            no_fused_decode: false,
        }
    }
}

/// What to tell a user who gave `--dtype` to a CPU command: the flag sets the GPU's type, and
/// the CPU backend computes in f32 whatever it says (vLLM's CPU backend would run in it).
/// `None` for `auto`.
pub fn cpu_dtype_note(a: &CudaArgs) -> Option<String> {
    match a.dtype_flag {
        DtypeFlag::Auto => None,
        DtypeFlag::Is(d) => Some(format!(
            "note: --dtype {} applies to --device cuda; the CPU backend computes in f32 (a \
             16-bit checkpoint's weights stay 2 bytes each in memory; --kv-cache-dtype sets \
             the KV cache's type)",
            d.name()
        )),
    }
}

/// `--dtype`: a dtype, or `auto` (the model's, [`CudaArgs::resolve_dtype`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeFlag {
    /// vLLM's `auto`.
    Auto,
    /// A dtype given by name.
    Is(Dtype),
}

impl CudaArgs {
    /// Sets [`CudaArgs::dtype`] from `--dtype`: a named dtype as it is; `auto` as vLLM
    /// resolves it, the model's `torch_dtype` when it is bfloat16 or float16, else bf16
    /// (a float32 checkpoint, or none known).
    pub fn resolve_dtype(&mut self, cfg: Option<&baton_model::ModelConfig>) {
        self.dtype = match self.dtype_flag {
            DtypeFlag::Is(d) => d,
            DtypeFlag::Auto => match cfg
                .and_then(|c| c.torch_dtype.as_deref())
                .and_then(baton_model::DType::from_name)
            {
                Some(baton_model::DType::F16) => Dtype::F16,
                _ => Dtype::Bf16,
            },
        };
    }

    /// The flags that reproduce these values (for a child process).
    pub fn to_flags(&self) -> Vec<String> {
        let mut v = vec![
            "--dtype".into(),
            self.dtype.name().into(),
            "--gpu-memory-utilization".into(),
            self.gpu_memory_utilization.to_string(),
            "--cuda-device".into(),
            self.cuda_device.to_string(),
        ];
        if self.enforce_eager {
            v.push("--enforce-eager".into());
        }
        if self.no_fused_decode {
            v.push("--no-fused-decode".into());
        }
        v
    }
}

/// Parses a dtype name (not `auto`).
///
/// # Errors
/// A message naming the accepted values.
pub fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::parse(s).ok_or_else(|| format!("unknown dtype {s:?}: use auto, bf16, f16 or f32"))
}

/// Parses `--dtype`: `auto` or a dtype name.
///
/// # Errors
/// A message naming the accepted values.
pub fn parse_dtype_flag(s: &str) -> Result<DtypeFlag, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        Ok(DtypeFlag::Auto)
    } else {
        parse_dtype(s).map(DtypeFlag::Is)
    }
}

/// Sizes of the worker's buffers.
#[derive(Clone, Copy, Debug)]
pub struct CudaSizes {
    /// Tokens per KV page.
    pub block_size: usize,
    /// Fixed page count, or `None` to size from --gpu-memory-utilization.
    pub num_blocks: Option<usize>,
    /// Most tokens per launch.
    pub max_tokens: usize,
    /// Most rows per launch.
    pub max_rows: usize,
    /// Longest sequence.
    pub max_model_len: usize,
}

/// The worker options for the flags `a` and the sizes `s` (KV pages fixed by `s.num_blocks`,
/// else sized from `--gpu-memory-utilization`, capped at what `max_rows` sequences of
/// `max_model_len` can use). The include dir comes from `BATON_CUDA_INCLUDE`, the tuning
/// overrides from `BATON_ATTN_TARGET_BLOCKS` and `BATON_KERNEL_DEFINES` ([`Tuning::from_env`]:
/// knobs for A/B runs, unset in normal use).
///
/// # Errors
/// A tuning variable that does not parse.
pub fn cuda_options(a: &CudaArgs, s: CudaSizes) -> Result<CudaWorkerOptions> {
    Ok(CudaWorkerOptions {
        device: a.cuda_device,
        dtype: a.dtype,
        include_dir: baton_cuda::include_dir_from_env(),
        block_size: s.block_size,
        kv_blocks: match s.num_blocks {
            Some(n) => KvBlocks::Fixed(n),
            None => KvBlocks::Utilization {
                fraction: a.gpu_memory_utilization,
                max_blocks: s.max_rows * s.max_model_len.div_ceil(s.block_size.max(1)),
            },
        },
        max_tokens: s.max_tokens,
        max_rows: s.max_rows,
        max_model_len: s.max_model_len,
        enforce_eager: a.enforce_eager,
        fused_decode: !a.no_fused_decode,
        tuning: Tuning::from_env().map_err(anyhow::Error::msg)?,
    })
}

/// Checks that the CUDA backend runs `cfg`'s model when given ([`baton_cuda::check_model`]),
/// then opens the GPU `a` names and returns, so a command fails at once on a model the
/// backend does not run or a machine without a driver or device, before it spends time (and
/// host memory) loading or generating weights.
///
/// # Errors
/// An architecture the backend does not run; no driver, no such device, a context that
/// cannot be created; with a hint.
pub fn check_cuda_device(a: &CudaArgs, cfg: Option<&ModelConfig>) -> Result<()> {
    if let Some(cfg) = cfg {
        baton_cuda::check_model(cfg).context("--device cuda")?;
    }
    baton_cuda::CudaDevice::probe_memory(a.cuda_device)
        .map(|_| ())
        .context("opening the GPU for --device cuda")
}

/// Builds the CUDA worker. Without a driver (or cuBLAS, or NVRTC) this is an error that says
/// so, never a panic.
///
/// # Errors
/// Every [`baton_cuda::CudaWorkerError`], with context.
pub fn build_cuda(
    cfg: ModelConfig,
    weights: impl Into<ModelWeights>,
    a: &CudaArgs,
    s: CudaSizes,
) -> Result<CudaWorker> {
    build_cuda_with(cfg, weights, cuda_options(a, s)?)
}

/// [`build_cuda`] with the worker options given (a caller that adjusts [`cuda_options`]'s).
///
/// # Errors
/// Every [`baton_cuda::CudaWorkerError`], with context.
pub fn build_cuda_with(
    cfg: ModelConfig,
    weights: impl Into<ModelWeights>,
    opts: CudaWorkerOptions,
) -> Result<CudaWorker> {
    CudaWorker::new(cfg, weights, opts).context("starting the CUDA backend (--device cuda)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_auto_follows_the_models_16_bit_dtype_and_else_is_bf16() {
        assert_eq!(parse_dtype_flag("auto"), Ok(DtypeFlag::Auto));
        assert_eq!(parse_dtype_flag("AUTO"), Ok(DtypeFlag::Auto));
        assert_eq!(parse_dtype_flag("half"), Ok(DtypeFlag::Is(Dtype::F16)));
        assert_eq!(parse_dtype_flag("float"), Ok(DtypeFlag::Is(Dtype::F32)));
        assert!(parse_dtype_flag("fp8").unwrap_err().contains("auto"));
        let cfg = |dtype: Option<&str>| {
            let mut c = serde_json::json!({"architectures": ["LlamaForCausalLM"],
                "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 32,
                "max_position_embeddings": 64});
            if let Some(d) = dtype {
                c["torch_dtype"] = d.into();
            }
            ModelConfig::from_json_str(&c.to_string()).unwrap()
        };
        for (model, flag, want) in [
            (Some("bfloat16"), DtypeFlag::Auto, Dtype::Bf16),
            (Some("float16"), DtypeFlag::Auto, Dtype::F16),
            (Some("float32"), DtypeFlag::Auto, Dtype::Bf16),
            (None, DtypeFlag::Auto, Dtype::Bf16),
            (Some("float16"), DtypeFlag::Is(Dtype::F32), Dtype::F32),
            (Some("bfloat16"), DtypeFlag::Is(Dtype::F16), Dtype::F16),
        ] {
            let mut a = CudaArgs {
                dtype_flag: flag,
                ..CudaArgs::default()
            };
            a.resolve_dtype(Some(&cfg(model)));
            assert_eq!(a.dtype, want, "{model:?} {flag:?}");
            assert!(a.to_flags().contains(&want.name().to_string()));
        }
        let mut a = CudaArgs::default();
        a.resolve_dtype(None);
        assert_eq!(a.dtype, Dtype::Bf16);
    }
}
