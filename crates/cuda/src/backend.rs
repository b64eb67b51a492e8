//! `CudaBackend`: a device probe for `tests/gpu_smoke.rs`: one device context and stream, with
//! every kernel of `kernels/` compiled by NVRTC for the device's own architecture and loaded by
//! entry-point name, and typed launchers for the sampler and its Philox RNG. It is not the
//! worker: the model runs in [`crate::executor::CudaWorker`] through the [`crate::device`]
//! trait. The sampler here applies no penalties and no structured-output mask.

use crate::kernels::{compile_ptx, kernel_entry_points, KernelError, SAMPLER_TOP_SLOTS};
use baton_proto::SamplingParams;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// Errors from bringing up or using the backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No `libcuda.so*` on the loader path (no NVIDIA driver on this machine).
    #[error("the CUDA driver library (libcuda.so) cannot be loaded")]
    DriverUnavailable,
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// NVRTC is missing or a kernel failed to compile.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// An argument does not match the launch's shapes.
    #[error("bad launch arguments: {0}")]
    BadArgs(String),
}

/// True when the CUDA driver library can be loaded (says nothing about devices).
pub fn driver_available() -> bool {
    // SAFETY: `is_culib_present` only dlopen()s candidate names of libcuda and drops the handles.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A device, its stream, and the loaded kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    functions: HashMap<&'static str, CudaFunction>,
}

/// Outputs of [`CudaBackend::sample`], copied back to the host.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSamples {
    /// `[rows]` sampled ids.
    pub tokens: Vec<u32>,
    /// `[rows]` raw log-probability of each id (0 unless asked).
    pub logprobs: Vec<f32>,
    /// `[rows * 20]` top ids (`u32::MAX` past each row's count).
    pub top_ids: Vec<u32>,
    /// `[rows * 20]` top log-probabilities (`-inf` past each row's count).
    pub top_logprobs: Vec<f32>,
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles every kernel for its `sm_XY` with `-I<include_dir>`, and
    /// loads every entry point listed by [`kernel_entry_points`].
    ///
    /// Errors: [`BackendError::DriverUnavailable`] without a driver; driver errors (no such
    /// device, module load failure, missing entry point); NVRTC errors from [`compile_ptx`].
    pub fn new(ordinal: usize, include_dir: &Path) -> Result<Self, BackendError> {
        if !driver_available() {
            return Err(BackendError::DriverUnavailable);
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let mut functions = HashMap::new();
        for ((file, ptx), &(efile, entries)) in compile_ptx(&arch, include_dir)?
            .into_iter()
            .zip(kernel_entry_points())
        {
            debug_assert_eq!(file, efile);
            let module = ctx.load_module(ptx)?;
            for &entry in entries {
                functions.insert(entry, module.load_function(entry)?);
            }
        }
        let stream = ctx.new_stream()?;
        Ok(Self {
            ctx,
            stream,
            arch,
            functions,
        })
    }

    /// The architecture the kernels were compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The backend's stream (all launches go here, in order).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A loaded kernel by entry-point name.
    pub fn function(&self, name: &str) -> Option<&CudaFunction> {
        self.functions.get(name)
    }

    /// `(free, total)` device memory in bytes (input of [`crate::kv_num_blocks`]).
    pub fn mem_info(&self) -> Result<(usize, usize), BackendError> {
        Ok(self.ctx.mem_get_info()?)
    }

    fn func(&self, name: &str) -> Result<&CudaFunction, BackendError> {
        self.function(name)
            .ok_or_else(|| BackendError::BadArgs(format!("kernel {name} not loaded")))
    }

    /// Runs `baton_philox4x32_10_probe` on `(counter, key)` pairs and returns the outputs
    /// (device known-answer check against the CPU Philox).
    pub fn philox_probe(
        &self,
        inputs: &[([u32; 4], [u32; 2])],
    ) -> Result<Vec<[u32; 4]>, BackendError> {
        let n = inputs.len();
        let ctr: Vec<u32> = inputs.iter().flat_map(|(c, _)| *c).collect();
        let key: Vec<u32> = inputs.iter().flat_map(|(_, k)| *k).collect();
        let d_ctr = self.stream.clone_htod(&ctr)?;
        let d_key = self.stream.clone_htod(&key)?;
        let mut d_out = self.stream.alloc_zeros::<u32>(4 * n.max(1))?;
        let n_i32 = i32::try_from(n).map_err(|_| BackendError::BadArgs("too many".into()))?;
        let f = self.func("baton_philox4x32_10_probe")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut d_out).arg(&d_ctr).arg(&d_key).arg(&n_i32);
        // SAFETY: the argument list matches `baton_philox4x32_10_probe(uint4* out, const uint4*
        // ctr, const uint2* key, int n)`: the buffers hold 4n, 4n and 2n u32 (cudaMalloc
        // alignment satisfies uint4/uint2), and the grid covers exactly n threads' worth.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        let out = self.stream.clone_dtoh(&d_out)?;
        Ok(out
            .chunks_exact(4)
            .take(n)
            .map(|c| [c[0], c[1], c[2], c[3]])
            .collect())
    }

    /// Samples one token per row of `logits` (`[rows, vocab]` f32, row-major) with the device
    /// sampler (`baton_sample_f32`, no penalties) and copies the results back. For tests and the
    /// eager path; the production path keeps ids on the device.
    pub fn sample(
        &self,
        logits: &[f32],
        vocab: usize,
        params: &[SamplingParams],
        output_index: &[u32],
    ) -> Result<DeviceSamples, BackendError> {
        let rows = params.len();
        if vocab == 0 || logits.len() != rows * vocab || output_index.len() != rows {
            return Err(BackendError::BadArgs(format!(
                "logits {} != rows {rows} * vocab {vocab}, or output_index {} != rows",
                logits.len(),
                output_index.len()
            )));
        }
        let vocab_i32 =
            i32::try_from(vocab).map_err(|_| BackendError::BadArgs("vocab > i32::MAX".into()))?;
        let mut d_logits = self.stream.clone_htod(logits)?;
        // No row is penalized: the table address is never dereferenced, no input id read.
        let d_pen_table = self.stream.alloc_zeros::<u64>(1)?;
        let no_rows = vec![crate::staging::PenaltyRow::NONE; rows.max(1)];
        let d_pen_rows = self
            .stream
            .clone_htod(bytemuck::cast_slice::<_, u8>(&no_rows))?;
        let d_input_ids = self.stream.alloc_zeros::<u32>(1)?;
        let d_params = self
            .stream
            .clone_htod(bytemuck::cast_slice::<_, u8>(params))?;
        let d_index = self.stream.clone_htod(output_index)?;
        let mut d_tokens = self.stream.alloc_zeros::<u32>(rows.max(1))?;
        let mut d_lp = self.stream.alloc_zeros::<f32>(rows.max(1))?;
        let mut d_top_ids = self
            .stream
            .alloc_zeros::<u32>((rows * SAMPLER_TOP_SLOTS).max(1))?;
        let mut d_top_lp = self
            .stream
            .alloc_zeros::<f32>((rows * SAMPLER_TOP_SLOTS).max(1))?;
        let splits = crate::plan::sample_splits(vocab);
        let d_partials = self.stream.alloc_zeros::<u64>(2 * rows.max(1) * splits)?;
        let d_counters = self.stream.alloc_zeros::<i32>(rows.max(1))?;
        if rows > 0 {
            let f = self.func("baton_sample_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut d_tokens)
                .arg(&mut d_lp)
                .arg(&mut d_top_ids)
                .arg(&mut d_top_lp)
                .arg(&mut d_logits)
                .arg(&vocab_i32)
                .arg(&d_params)
                .arg(&d_index)
                .arg(&d_pen_table)
                .arg(&d_pen_rows)
                .arg(&d_input_ids)
                .arg(&d_partials)
                .arg(&d_counters)
                .arg(&vocab_i32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, splits as u32, 1),
                block_dim: (crate::plan::SAMPLE_BLOCK as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match `baton_sample_f32(u32* tokens, float* logprob, u32*
            // top_ids, float* top_lp, float* logits, int logits_stride, const
            // BatonSamplingParams* params, const u32* output_index, BatonPenaltyEntry* const*
            // penalty_table, const BatonPenaltyRow* penalty_rows, const u32* input_ids,
            // BatonSamplePartial* partials, int* counters, int vocab)`; every buffer holds
            // `rows` (or `rows * 20`) entries, logits `rows * vocab`, partials `rows * splits`
            // 16-byte records and counters `rows` zeroed ints (grid.y = splits), params `rows` 64-byte records with the layout checked by
            // `kernels::tests::sampling_params_layout_matches_the_cuda_struct`, penalty rows
            // `rows` 16-byte records that penalize nothing (so the table is not read).
            unsafe { b.launch(cfg) }?;
        }
        Ok(DeviceSamples {
            tokens: self.stream.clone_dtoh(&d_tokens)?[..rows].to_vec(),
            logprobs: self.stream.clone_dtoh(&d_lp)?[..rows].to_vec(),
            top_ids: self.stream.clone_dtoh(&d_top_ids)?[..rows * SAMPLER_TOP_SLOTS].to_vec(),
            top_logprobs: self.stream.clone_dtoh(&d_top_lp)?[..rows * SAMPLER_TOP_SLOTS].to_vec(),
        })
    }

    /// Allocates `n` zeroed elements on the backend's stream.
    pub fn alloc_zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, BackendError> {
        Ok(self.stream.alloc_zeros::<T>(n)?)
    }
}
