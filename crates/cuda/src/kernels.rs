//! The CUDA C kernels in `kernels/`, embedded at build time and compiled to PTX with NVRTC at
//! worker start (DESIGN.md section 8).
//!
//! Every `.cu` file is compiled as its own NVRTC program, with `kernels/common.cuh` prepended
//! textually (followed by a `#line 1 "<file>"` directive so compiler messages point at the
//! right file and line). A kernel file may include one of our headers (`#include "gemv.cuh"`,
//! see [`kernel_headers`]): [`full_source`] inlines it, since NVRTC compiles from memory. The
//! only other header is `cuda_bf16.h` (and what it includes), found through `-I<include_dir>`;
//! see [`include_dir_from_env`].
//!
//! NVRTC is loaded dynamically (cudarc `dynamic-loading`): building this crate needs no CUDA,
//! and [`compile_ptx`] reports [`KernelError::NvrtcUnavailable`] instead of panicking when
//! `libnvrtc.so*` cannot be found on the loader path.

use std::path::{Path, PathBuf};

pub use cudarc::nvrtc::Ptx;

/// The shared prelude (`kernels/common.cuh`) prepended to every kernel source.
pub const COMMON_HEADER: &str = include_str!("../../../kernels/common.cuh");

/// `(file name, CUDA C source)` of every kernel file, in a fixed order.
static SOURCES: &[(&str, &str)] = &[
    (
        "embedding.cu",
        include_str!("../../../kernels/embedding.cu"),
    ),
    ("rmsnorm.cu", include_str!("../../../kernels/rmsnorm.cu")),
    ("rope.cu", include_str!("../../../kernels/rope.cu")),
    ("qkv_post.cu", include_str!("../../../kernels/qkv_post.cu")),
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
    ),
    (
        "activation.cu",
        include_str!("../../../kernels/activation.cu"),
    ),
    ("gemv.cu", include_str!("../../../kernels/gemv.cu")),
    ("sampling.cu", include_str!("../../../kernels/sampling.cu")),
    (
        "token_mask.cu",
        include_str!("../../../kernels/token_mask.cu"),
    ),
    ("moe.cu", include_str!("../../../kernels/moe.cu")),
    ("lora.cu", include_str!("../../../kernels/lora.cu")),
    ("trace.cu", include_str!("../../../kernels/trace.cu")),
];

/// `(file name, CUDA C source)` of the headers that kernel files include.
static HEADERS: &[(&str, &str)] = &[("gemv.cuh", include_str!("../../../kernels/gemv.cuh"))];

/// `(file name, extern "C" entry points it must define)`, same order as [`kernel_sources`].
static ENTRY_POINTS: &[(&str, &[&str])] = &[
    (
        "embedding.cu",
        &["baton_embedding_gather", "baton_gather_rows"],
    ),
    ("rmsnorm.cu", &["baton_rmsnorm", "baton_add_rmsnorm"]),
    ("rope.cu", &["baton_rope_and_cache"]),
    ("qkv_post.cu", &["baton_qkv_post"]),
    (
        "attention.cu",
        &[
            "baton_paged_attention_decode_hd64",
            "baton_paged_attention_decode_hd128",
            "baton_paged_attention_decode_hd256",
            "baton_paged_attention_prefill_hd64",
            "baton_paged_attention_prefill_hd128",
            "baton_paged_attention_prefill_hd256",
            "baton_paged_attention_generic",
            "baton_decode_layers_hd64",
            "baton_decode_layers_hd128",
        ],
    ),
    (
        "activation.cu",
        &["baton_silu_and_mul", "baton_gelu_tanh_and_mul"],
    ),
    (
        "gemv.cu",
        &[
            "baton_gemv",
            "baton_gemv_t1",
            "baton_gemv_silu_t1",
            "baton_gemv_t1_async",
            "baton_gemv_silu_t1_async",
        ],
    ),
    (
        "sampling.cu",
        &[
            "baton_sample_f32",
            "baton_score_rows",
            "baton_sampling_uniform_bits",
            "baton_philox4x32_10_probe",
        ],
    ),
    ("token_mask.cu", &["baton_apply_token_mask"]),
    (
        "moe.cu",
        &[
            "baton_moe_route",
            "baton_moe_align",
            "baton_moe_gemm",
            "baton_moe_combine",
        ],
    ),
    ("lora.cu", &["baton_lora_shrink", "baton_lora_expand"]),
    ("trace.cu", &["baton_trace_tick"]),
];

/// Element type of weights, activations and the KV cache; selects `elem_t` in
/// `kernels/common.cuh` through `-DBATON_DTYPE=<n>`. Logits and sampling are always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Dtype {
    /// bfloat16 (the default, as vLLM's `--dtype auto` for bf16 checkpoints).
    #[default]
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single: for exact comparison with the CPU reference.
    F32,
}

impl Dtype {
    /// Bytes per element (2, 2, 4).
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The `BATON_DTYPE` value `common.cuh` expects (0 bf16, 1 f16, 2 f32).
    pub fn macro_value(self) -> u32 {
        match self {
            Dtype::Bf16 => 0,
            Dtype::F16 => 1,
            Dtype::F32 => 2,
        }
    }

    /// `bf16`, `f16` or `f32`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        }
    }

    /// Parses `bf16`/`bfloat16`, `f16`/`float16`/`half`, `f32`/`float32`/`float`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(Dtype::Bf16),
            "f16" | "fp16" | "float16" | "half" => Some(Dtype::F16),
            "f32" | "fp32" | "float32" | "float" => Some(Dtype::F32),
            _ => None,
        }
    }

    /// `x` rounded to this type (round to nearest even, as weights are uploaded) and back.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
            Dtype::F32 => x,
        }
    }

    /// Every dtype, for tests.
    pub const ALL: [Dtype; 3] = [Dtype::Bf16, Dtype::F16, Dtype::F32];
}

/// Keys per attention chunk (`BATON_ATTN_PART` in `attention.cu`). The executor sizes the
/// split-K partial buffers for at least `ceil(max_model_len / ATTN_PARTITION)` partitions per
/// row and head (`plan::decode_partition_slots`); a launch shares them out among its rows
/// (`plan::decode_partitions`).
pub const ATTN_PARTITION: usize = 512;

/// Most tokens a `baton_gemv` launch takes (`BATON_GEMV_MAX_T` in `gemv.cu`): decode batches
/// up to this size run the fused small-batch path.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Entries per row of the sampler's top-log-prob outputs (`BATON_MAX_TOP_LOGPROBS`).
pub const SAMPLER_TOP_SLOTS: usize = 20;

/// Environment variable naming the CUDA include directory (the one holding `cuda_bf16.h`).
pub const INCLUDE_ENV: &str = "BATON_CUDA_INCLUDE";

/// Include directory used when [`INCLUDE_ENV`] is unset.
pub const DEFAULT_INCLUDE_DIR: &str = "/usr/local/cuda/include";

/// Errors from loading NVRTC or compiling a kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No `libnvrtc.so*` could be loaded (not installed, or not on `LD_LIBRARY_PATH`).
    #[error(
        "NVRTC is not available: no libnvrtc.so* on the loader path \
         (install the CUDA toolkit or the nvidia-cuda-nvrtc wheel and set LD_LIBRARY_PATH)"
    )]
    NvrtcUnavailable,
    /// NVRTC rejected a kernel file; `log` is the compiler's log.
    #[error("NVRTC failed to compile {file} for {arch} (include dir {include_dir}): {log}")]
    Compile {
        /// The kernel file, e.g. `attention.cu`.
        file: String,
        /// Target architecture, e.g. `sm_90`.
        arch: String,
        /// The include directory passed with `-I`.
        include_dir: String,
        /// The compiler log (or the NVRTC error when there is no log).
        log: String,
    },
}

/// `(file name, CUDA C source)` of every kernel file (without the [`COMMON_HEADER`] prelude).
pub fn kernel_sources() -> &'static [(&'static str, &'static str)] {
    SOURCES
}

/// `(file name, CUDA C source)` of the headers kernel files may include (`#include "name"`).
pub fn kernel_headers() -> &'static [(&'static str, &'static str)] {
    HEADERS
}

/// `source` with each `#include "name"` line of a [`kernel_headers`] header replaced by the
/// header's text, between `#line` directives that keep compiler messages pointing at the right
/// file and line. Headers hold no includes of their own. Other lines are kept as they are.
pub fn expand_includes(file: &str, source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    for (i, line) in source.split_inclusive('\n').enumerate() {
        let header = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .and_then(|name| HEADERS.iter().find(|(n, _)| *n == name));
        match header {
            Some((name, text)) => {
                out.push_str(&format!("#line 1 \"{name}\"\n{text}\n"));
                out.push_str(&format!("#line {} \"{file}\"\n", i + 2));
            }
            None => out.push_str(line),
        }
    }
    out
}

/// `(file name, entry points)` that each kernel file must define, for loaders and tests.
pub fn kernel_entry_points() -> &'static [(&'static str, &'static [&'static str])] {
    ENTRY_POINTS
}

/// The text NVRTC compiles for `file`: the prelude, a `#line` reset, then the file with its
/// headers inlined ([`expand_includes`]).
pub fn full_source(file: &str, source: &str) -> String {
    format!(
        "{COMMON_HEADER}\n#line 1 \"{file}\"\n{}",
        expand_includes(file, source)
    )
}

/// The CUDA include directory: `$BATON_CUDA_INCLUDE`, else `/usr/local/cuda/include`.
pub fn include_dir_from_env() -> PathBuf {
    std::env::var_os(INCLUDE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_INCLUDE_DIR))
}

/// True when a `libnvrtc.so*` can be loaded (cudarc searches plain sonames such as
/// `libnvrtc.so.13` through the dynamic loader's path).
pub fn nvrtc_available() -> bool {
    // SAFETY: `is_culib_present` only dlopen()s candidate library names and drops the handles;
    // loading libnvrtc runs no initialisation with preconditions on our side.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Environment variable with extra kernel macro definitions for tuning runs:
/// `NAME=VALUE[,NAME=VALUE...]`, each becoming an NVRTC `-DNAME=VALUE` (see
/// [`parse_kernel_defines`]). Only constants a kernel file guards with `#ifndef` can be
/// overridden; `scripts/gpu-ab.sh` uses it to compare variants without a rebuild.
pub const KERNEL_DEFINES_ENV: &str = "BATON_KERNEL_DEFINES";

/// The kernel constants [`KERNEL_DEFINES_ENV`] may set: each is guarded with `#ifndef` in a
/// kernel file (a test checks), so a definition on the command line replaces the default.
pub const KERNEL_TUNABLES: &[&str] = &[
    "BATON_GEMV_T1_U",
    "BATON_GEMV_PREWAIT_L2",
    "BATON_SAMPLE_BIN_CACHE",
    "BATON_SAMPLE_HIST",
    "BATON_SELECT_U",
    "BATON_TRACE",
];

/// Parses `NAME=VALUE[,NAME=VALUE...]` (whitespace around items ignored) into `NAME=VALUE`
/// strings. A name must be one of [`KERNEL_TUNABLES`] (any other would be ignored by the
/// kernels, or clash with their own definition), at most once; a value is a decimal integer
/// (optionally negative).
///
/// # Errors
/// A message naming the first bad item.
pub fn parse_kernel_defines(s: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?}: expected NAME=VALUE"))?;
        let (name, value) = (name.trim(), value.trim());
        if !KERNEL_TUNABLES.contains(&name) {
            return Err(format!(
                "{name:?} is not a tunable kernel constant (one of {})",
                KERNEL_TUNABLES.join(", ")
            ));
        }
        if out
            .iter()
            .any(|d| d.split_once('=').is_some_and(|(n, _)| n == name))
        {
            return Err(format!("{name} is set twice"));
        }
        if value.parse::<i64>().is_err() {
            return Err(format!(
                "{name}={value:?}: the value must be a decimal integer"
            ));
        }
        out.push(format!("{name}={value}"));
    }
    Ok(out)
}

/// NVRTC options for `arch` (e.g. `"sm_90"`), `include_dir` and the element type.
pub fn nvrtc_options(arch: &str, include_dir: &Path, dtype: Dtype) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", include_dir.display()),
        format!("-DBATON_DTYPE={}", dtype.macro_value()),
        "--std=c++17".to_owned(),
        "-lineinfo".to_owned(),
    ]
}

/// Compiles every kernel file to PTX for `arch` (e.g. `"sm_90"`), with `-I<include_dir>`, for
/// bf16 (see [`compile_ptx_for`]).
pub fn compile_ptx(arch: &str, include_dir: &Path) -> Result<Vec<(String, Ptx)>, KernelError> {
    compile_ptx_for(arch, include_dir, Dtype::Bf16)
}

/// Compiles every kernel file to PTX for `arch` (e.g. `"sm_90"`), with `-I<include_dir>` and
/// `elem_t` = `dtype`.
///
/// Returns `(file name, PTX)` in [`kernel_sources`] order. Errors: [`KernelError::NvrtcUnavailable`]
/// when NVRTC cannot be loaded, [`KernelError::Compile`] with the compiler log for the first file
/// that fails. Takes about a second per file with NVRTC 13 on one CPU core.
pub fn compile_ptx_for(
    arch: &str,
    include_dir: &Path,
    dtype: Dtype,
) -> Result<Vec<(String, Ptx)>, KernelError> {
    Ok(compile_for(arch, include_dir, dtype)?
        .into_iter()
        .map(|(file, c)| (file, Ptx::from_src(c.ptx)))
        .collect())
}

/// One kernel file compiled by NVRTC for a real architecture.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The PTX text.
    pub ptx: String,
    /// The CUBIN (an ELF image for exactly `arch`): what the worker loads, so the driver does
    /// no JIT at start-up and assembler errors surface here, in the NVRTC log, rather than as
    /// a bare `CUDA_ERROR_INVALID_PTX` at module load.
    pub cubin: Vec<u8>,
    /// NVRTC's log of the successful compile: warnings, and with [`PTXAS_VERBOSE`] the
    /// assembler's resource report ([`ptxas_usage`] reads it).
    pub log: String,
}

/// The NVRTC option that makes ptxas report each function's registers, spills, stack and
/// shared memory in the program log ([`compile_with_options`], [`ptxas_usage`]).
pub const PTXAS_VERBOSE: &str = "--ptxas-options=-v";

/// One function's resources as ptxas reports them under [`PTXAS_VERBOSE`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasUsage {
    /// The function's name (an entry point or a `__noinline__` device function).
    pub function: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes per thread stored to local memory because registers ran out.
    pub spill_store_bytes: u32,
    /// Bytes per thread loaded back from those spills.
    pub spill_load_bytes: u32,
    /// Bytes of stack frame per thread.
    pub stack_bytes: u32,
    /// Bytes of static shared memory per block.
    pub smem_bytes: u32,
}

/// Parses ptxas' `-v` report (NVRTC's log under [`PTXAS_VERBOSE`]): one entry per function, in
/// log order. Lines it does not know are skipped. The report's shape (CUDA 12 and 13):
///
/// ```text
/// ptxas info    : Function properties for baton_gemv_t1
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 128 registers, used 1 barriers, 33152 bytes smem, 400 bytes cmem[0]
/// ```
pub fn ptxas_usage(log: &str) -> Vec<PtxasUsage> {
    // The number before `unit` in `text` (`"128 registers"` -> 128).
    let before = |text: &str, unit: &str| -> Option<u32> {
        let i = text.find(unit)?;
        text[..i].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<PtxasUsage> = Vec::new();
    for line in log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            out.push(PtxasUsage {
                function: name.trim().to_owned(),
                ..PtxasUsage::default()
            });
        } else if let Some(u) = out.last_mut() {
            if line.contains("bytes stack frame") {
                u.stack_bytes = before(line, " bytes stack frame").unwrap_or(0);
                u.spill_store_bytes = before(line, " bytes spill stores").unwrap_or(0);
                u.spill_load_bytes = before(line, " bytes spill loads").unwrap_or(0);
            } else if line.contains("Used ") && line.contains(" registers") {
                u.registers = before(line, " registers").unwrap_or(0);
                u.smem_bytes = before(line, " bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// Compiles every kernel file for `arch` (a real architecture such as `"sm_90"`), with
/// `-I<include_dir>` and `elem_t` = `dtype`, to both PTX and CUBIN.
///
/// # Errors
/// As [`compile_ptx_for`].
pub fn compile_for(
    arch: &str,
    include_dir: &Path,
    dtype: Dtype,
) -> Result<Vec<(String, Compiled)>, KernelError> {
    compile_with_defines(arch, include_dir, dtype, &[])
}

/// [`compile_for`] with extra `-D` definitions (`NAME=VALUE` strings, as
/// [`parse_kernel_defines`] returns them).
///
/// # Errors
/// As [`compile_ptx_for`].
pub fn compile_with_defines(
    arch: &str,
    include_dir: &Path,
    dtype: Dtype,
    defines: &[String],
) -> Result<Vec<(String, Compiled)>, KernelError> {
    let defines: Vec<String> = defines.iter().map(|d| format!("-D{d}")).collect();
    compile_with_options(arch, include_dir, dtype, &defines)
}

/// [`compile_for`] with extra NVRTC options (for example [`PTXAS_VERBOSE`], or `-DNAME=VALUE`).
///
/// # Errors
/// As [`compile_ptx_for`].
pub fn compile_with_options(
    arch: &str,
    include_dir: &Path,
    dtype: Dtype,
    extra: &[String],
) -> Result<Vec<(String, Compiled)>, KernelError> {
    if !nvrtc_available() {
        return Err(KernelError::NvrtcUnavailable);
    }
    let mut opts = nvrtc_options(arch, include_dir, dtype);
    opts.extend(extra.iter().cloned());
    // One thread per file (NVRTC programs are independent): worker start-up waits for the
    // slowest file rather than for the sum.
    let results: Vec<Result<Compiled, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = SOURCES
            .iter()
            .map(|&(file, src)| {
                let opts = &opts;
                scope.spawn(move || compile_one(file, src, opts))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    SOURCES
        .iter()
        .zip(results)
        .map(|(&(file, _), r)| {
            r.map(|c| (file.to_owned(), c))
                .map_err(|log| KernelError::Compile {
                    file: file.to_owned(),
                    arch: format!("{arch} ({})", dtype.name()),
                    include_dir: include_dir.display().to_string(),
                    log,
                })
        })
        .collect()
}

/// Compiles one file; the error is NVRTC's log (or its error code when the log is empty).
fn compile_one(file: &str, src: &str, opts: &[String]) -> Result<Compiled, String> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::CString;
    let text = |v: Vec<std::ffi::c_char>| -> String {
        let bytes: Vec<u8> = v
            .into_iter()
            .map(|c| c as u8)
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let source = CString::new(full_source(file, src)).map_err(|e| e.to_string())?;
    let name = CString::new(file).map_err(|e| e.to_string())?;
    let prog = result::create_program(&source, Some(&name)).map_err(|e| e.to_string())?;
    // SAFETY: `prog` comes from `create_program` above and is destroyed exactly once, at the
    // end of this block; `source` and `name`, which it may reference, outlive it. The CUBIN
    // buffer is sized by nvrtcGetCUBINSize before nvrtcGetCUBIN writes into it.
    unsafe {
        let out = match result::compile_program(prog, opts) {
            Err(e) => Err(match result::get_program_log(prog).map(text) {
                Ok(log) if !log.trim().is_empty() => log,
                _ => format!("{e} (options {opts:?})"),
            }),
            Ok(()) => (|| {
                let log = result::get_program_log(prog).map(text).unwrap_or_default();
                let ptx = text(result::get_ptx(prog).map_err(|e| e.to_string())?);
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBINSize: {e}"))?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBIN: {e}"))?;
                Ok(Compiled { ptx, cubin, log })
            })(),
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// Names of the `.entry` (kernel) functions declared in PTX text.
pub fn ptx_entry_points(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|line| {
            let rest = line.trim_start();
            let rest = rest
                .strip_prefix(".visible .entry ")
                .or_else(|| rest.strip_prefix(".entry "))?;
            let name = rest.split(['(', ' ']).next()?;
            (!name.is_empty()).then(|| name.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_usage_reads_each_functions_report() {
        let log = "\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'baton_gemv_t1' for 'sm_90'
ptxas info    : Function properties for baton_gemv_t1
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 33064 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for _Z18baton_radix_select
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'baton_sample_f32' for 'sm_90'
ptxas info    : Function properties for baton_sample_f32
    64 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 64 bytes cumulative stack size, 3496 bytes smem
";
        let u = ptxas_usage(log);
        assert_eq!(
            u,
            vec![
                PtxasUsage {
                    function: "baton_gemv_t1".into(),
                    registers: 128,
                    smem_bytes: 33064,
                    ..PtxasUsage::default()
                },
                PtxasUsage {
                    function: "_Z18baton_radix_select".into(),
                    stack_bytes: 8,
                    ..PtxasUsage::default()
                },
                PtxasUsage {
                    function: "baton_sample_f32".into(),
                    registers: 64,
                    spill_store_bytes: 16,
                    spill_load_bytes: 12,
                    stack_bytes: 64,
                    smem_bytes: 3496,
                },
            ]
        );
        assert!(ptxas_usage("").is_empty());
    }

    #[test]
    fn every_source_has_an_entry_point_list_and_defines_each_entry_extern_c() {
        assert_eq!(SOURCES.len(), ENTRY_POINTS.len());
        for (&(file, src), &(efile, entries)) in SOURCES.iter().zip(ENTRY_POINTS) {
            assert_eq!(file, efile);
            assert!(!entries.is_empty(), "{file}");
            // BATON_ENTRY (common.cuh) is extern "C" for NVRTC but C++ linkage for the host
            // emulator (crates/cuda-emu), which links every dtype's copy into one binary.
            assert!(
                !src.contains("extern \"C\""),
                "{file}: declare entry points with BATON_ENTRY, not extern \"C\" __global__"
            );
            for entry in entries {
                // Either a literal definition (possibly after `__launch_bounds__(N)`) or a
                // macro that pastes the suffix.
                let literal = src.contains(&format!("void {entry}("))
                    || src.contains(&format!(") {entry}("))
                    || src.contains(&format!("{entry}(\n"));
                let pasted = entry.rsplit_once("_hd").is_some_and(|(stem, d)| {
                    src.contains(&format!("{stem}_hd##D")) && src.contains(&format!("({d})"))
                });
                assert!(literal || pasted, "{file} does not define {entry}");
            }
        }
    }

    /// `BatonSamplingParams` in sampling.cu is read straight from an array of
    /// `baton_proto::SamplingParams`; its natural C layout must match field for field.
    #[test]
    fn sampling_params_layout_matches_the_cuda_struct() {
        use baton_proto::SamplingParams as P;
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!((size_of::<P>(), align_of::<P>()), (64, 8));
        assert_eq!(offset_of!(P, temperature), 0);
        assert_eq!(offset_of!(P, top_p), 4);
        assert_eq!(offset_of!(P, top_k), 8);
        assert_eq!(offset_of!(P, min_p), 12);
        assert_eq!(offset_of!(P, seed), 16);
        assert_eq!(offset_of!(P, top_logprobs), 24);
        assert_eq!(offset_of!(P, want_logprob), 28);
        assert_eq!(offset_of!(P, presence_penalty), 32);
        assert_eq!(offset_of!(P, frequency_penalty), 36);
        assert_eq!(offset_of!(P, repetition_penalty), 40);
        assert_eq!(offset_of!(P, logit_bias_len), 44);
        assert_eq!(offset_of!(P, allowed_only), 48);
        assert_eq!(offset_of!(P, prompt_logprobs), 52);
        assert_eq!(offset_of!(P, token_mask), 56);
        assert_eq!(offset_of!(P, reserved), 60);
        let (_, src) = SOURCES.iter().find(|s| s.0 == "sampling.cu").unwrap();
        let body = src
            .split("struct BatonSamplingParams {")
            .nth(1)
            .and_then(|rest| rest.split("};").next())
            .expect("sampling.cu defines struct BatonSamplingParams");
        let fields: Vec<&str> = body
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(
            fields,
            [
                "float temperature;",
                "float top_p;",
                "int top_k;",
                "float min_p;",
                "u64 seed;",
                "u32 top_logprobs;",
                "u32 want_logprob;",
                "float presence_penalty;",
                "float frequency_penalty;",
                "float repetition_penalty;",
                "u32 logit_bias_len;",
                "u32 allowed_only;",
                "u32 prompt_logprobs;",
                "u32 token_mask;",
                "u32 reserved;"
            ]
        );
    }

    /// `BatonPenaltyEntry` and `BatonPenaltyRow` in sampling.cu are read straight from arrays of
    /// `staging::DevicePenaltyEntry` and `staging::PenaltyRow`.
    #[test]
    fn penalty_layouts_match_the_cuda_structs() {
        use crate::staging::{DevicePenaltyEntry as E, PenaltyRow as R};
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!((size_of::<E>(), align_of::<E>()), (20, 4));
        assert_eq!((size_of::<R>(), align_of::<R>()), (16, 4));
        assert_eq!(
            [
                offset_of!(E, token),
                offset_of!(E, output_count),
                offset_of!(E, flags),
                offset_of!(E, bias),
                offset_of!(E, saved)
            ],
            [0, 4, 8, 12, 16]
        );
        assert_eq!(
            [
                offset_of!(R, offset),
                offset_of!(R, count),
                offset_of!(R, pending_index),
                offset_of!(R, reserved)
            ],
            [0, 4, 8, 12]
        );
        let (_, src) = SOURCES.iter().find(|s| s.0 == "sampling.cu").unwrap();
        let fields = |name: &str| -> Vec<String> {
            src.split(&format!("struct {name} {{"))
                .nth(1)
                .and_then(|rest| rest.split("};").next())
                .unwrap_or_else(|| panic!("sampling.cu defines struct {name}"))
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(
            fields("BatonPenaltyEntry"),
            [
                "u32 token;",
                "u32 output_count;",
                "u32 flags;",
                "float bias;",
                "float saved;"
            ]
        );
        assert_eq!(
            fields("BatonPenaltyRow"),
            [
                "u32 offset;",
                "u32 count;",
                "int pending_index;",
                "u32 reserved;"
            ]
        );
    }

    #[test]
    fn dtype_names_sizes_and_macro_values() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::parse(d.name()), Some(d));
        }
        assert_eq!(Dtype::parse("bfloat16"), Some(Dtype::Bf16));
        assert_eq!(Dtype::parse("float32"), Some(Dtype::F32));
        assert_eq!(Dtype::parse("int8"), None);
        assert_eq!(
            Dtype::ALL.map(|d| (d.size(), d.macro_value())),
            [(2, 0), (2, 1), (4, 2)]
        );
        assert!(COMMON_HEADER.contains("#if BATON_DTYPE == 0"));
        assert!(COMMON_HEADER.contains("#elif BATON_DTYPE == 2"));
    }

    #[test]
    fn full_source_resets_line_numbers_after_the_prelude() {
        let s = full_source("x.cu", "int y;");
        assert!(s.starts_with(COMMON_HEADER));
        assert!(s.ends_with("\n#line 1 \"x.cu\"\nint y;"));
    }

    #[test]
    fn our_headers_are_inlined_between_line_directives_and_other_includes_kept() {
        let s = expand_includes(
            "k.cu",
            "a\n#include \"gemv.cuh\"\nb\n#include <cuda_bf16.h>\n",
        );
        let gemv = kernel_headers()[0].1;
        assert_eq!(
            s,
            format!(
                "a\n#line 1 \"gemv.cuh\"\n{gemv}\n#line 3 \"k.cu\"\nb\n#include <cuda_bf16.h>\n"
            )
        );
        // Every kernel file that includes a header gets it, and no header includes another.
        for (file, src) in SOURCES {
            assert!(
                !expand_includes(file, src).contains("#include \""),
                "{file}"
            );
        }
        for (name, text) in HEADERS {
            assert!(!text.contains("#include \""), "{name} includes a header");
        }
    }

    #[test]
    fn ptx_entry_points_parses_visible_entries() {
        let ptx = "//\n.visible .entry baton_a(\n\t.param .u64 x\n)\n.entry baton_b(\n.func f(\n";
        assert_eq!(ptx_entry_points(ptx), vec!["baton_a", "baton_b"]);
    }

    #[test]
    fn kernel_defines_parse_names_and_integers_and_refuse_the_rest() {
        assert_eq!(
            parse_kernel_defines(" BATON_GEMV_T1_U=2, BATON_GEMV_PREWAIT_L2 = -4 ,").unwrap(),
            vec![
                "BATON_GEMV_T1_U=2".to_string(),
                "BATON_GEMV_PREWAIT_L2=-4".to_string()
            ]
        );
        assert_eq!(parse_kernel_defines("").unwrap(), Vec::<String>::new());
        for bad in [
            "BATON_GEMV_T1_U",
            "GEMV=2",
            "BATON_SAMPLE_U=4",
            "BATON_DTYPE=2",
            "baton_gemv_t1_u=2",
            "BATON_GEMV_T1_U=2.5",
            "BATON_GEMV_T1_U=1;rm",
            "BATON_GEMV_T1_U=",
            "BATON_GEMV_T1_U=2,BATON_GEMV_T1_U=4",
        ] {
            assert!(parse_kernel_defines(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn every_tunable_kernel_constant_is_guarded_in_a_kernel_file() {
        for name in KERNEL_TUNABLES {
            let guard = format!("#ifndef {name}");
            let define = format!("#define {name} ");
            let (file, src) = SOURCES
                .iter()
                .chain(HEADERS)
                .chain(&[("common.cuh", COMMON_HEADER)])
                .find(|(_, src)| src.contains(&guard))
                .unwrap_or_else(|| panic!("no kernel file guards {name} with #ifndef"));
            let g = src.find(&guard).unwrap();
            let d = src[g..]
                .find(&define)
                .unwrap_or_else(|| panic!("{file}: {name} guarded but not defined after"));
            assert!(
                !src[g..g + d].contains("#endif"),
                "{file}: the default of {name} is outside its #ifndef"
            );
            assert_eq!(
                src.matches(&define).count(),
                1,
                "{file}: {name} defined more than once"
            );
        }
    }

    #[test]
    fn nvrtc_options_carry_arch_and_include_dir() {
        let o = nvrtc_options("sm_90", Path::new("/x/include"), Dtype::F32);
        assert!(o.contains(&"--gpu-architecture=sm_90".to_owned()));
        assert!(o.contains(&"-DBATON_DTYPE=2".to_owned()));
        assert!(o.contains(&"--include-path=/x/include".to_owned()));
    }
}
