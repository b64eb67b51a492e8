//! baton-cuda: the CUDA side of the worker.
//!
//! - [`kernels`]: the CUDA C kernels of `kernels/` (embedded), compiled to PTX with NVRTC at
//!   worker start, once per element type ([`Dtype`]: bf16 default, f16, f32). NVRTC, the driver
//!   and cuBLAS are loaded dynamically, so this crate builds and its CPU tests run on machines
//!   with no CUDA at all; without a driver [`CudaWorker::new`] returns
//!   [`CudaWorkerError::DriverUnavailable`] (never a panic).
//! - [`plan`]: flattening a launch's rows into the kernels' input arrays; CUDA-graph buckets.
//! - [`staging`]: the per-step input block at fixed offsets (one host-to-device copy per step;
//!   fixed device addresses for graph replay).
//! - [`memory`]: KV-cache sizing under `gpu_memory_utilization`; weight/KV byte accounting for
//!   the decode HBM floor.
//! - [`device`]: the [`Device`] trait the executor runs on and [`CudaDevice`], its cudarc
//!   implementation (context, created stream, NVRTC modules, cuBLAS, fence event, graphs).
//! - [`executor`]: [`CudaWorker`], the `baton_worker::Backend` for `--device cuda`: cuBLAS
//!   `GemmEx` linears (fp32 accumulate) on a created stream, the kernels, the device ring of
//!   sampled ids that `PendingFrom` rows gather from, an event fence per launch, decode CUDA
//!   graphs per batch bucket, debug dumps of logits and per-layer outputs.
//! - [`lora`]: LoRA adapters on the device (`kernels/lora.cu`): their matrices in the worker's
//!   dtype, the part tables, the per-step id and scratch buffers, and the checks that refuse
//!   adapters for another model.
//! - [`trace`]: the launch trace (`BATON_TRACE=1` kernels): where a graph replay's time goes,
//!   launch by launch, with the kernels overlapping.
//! - [`backend`]: the older `CudaBackend` probe (sampler and Philox launchers for
//!   `tests/gpu_smoke.rs`).
//!
//! The numerical reference for the device sampler is `baton_worker::sampling`; for the forward
//! pass, `baton_model::CpuModel`.
//!
//! # Tested here vs. pending a GPU
//!
//! Tested on CPU: NVRTC compilation of every kernel for sm_90 in all three dtypes
//! (`scripts/nvrtc-check.sh`), launch planning, graph buckets, staging layout, KV sizing and the
//! device plan, weight-byte accounting, the sampler's selection model, host dtype conversion,
//! kernel argument packing, the ring of kept launches, and the clean error without a driver.
//!
//! Tested on CPU through the host emulator (`baton-cuda-emu`: the kernels of `kernels/`
//! compiled as C++ and run with one fiber per GPU thread, behind the same [`Device`] trait):
//! the whole executor — weight upload layout, every kernel launch and its argument list (count
//! checked), the GEMM layouts (the `cublasGemmEx` contract), graph capture and replay, the
//! pending-id gather, the fence order — and the kernels' numerics: f32 goldens exact, bf16
//! logits and per-layer outputs against the CPU reference, seeded sampling alone vs batched
//! (`crates/cli/tests/cuda_emu.rs`, `crates/cuda-emu/tests`).
//!
//! Run on a lent H200 (sessions 7-9 and 35; figures in `bench/RESULTS.md`): [`CudaDevice`]
//! itself (the cudarc, cuBLAS and NVRTC calls), real timing, races between GPU threads and the
//! GPU's own rounding, through `scripts/gpu-check.sh` (the same checks plus `baton bench
//! decode` in one go) and `scripts/gpu-ab.sh` (tuning variants). Most machines have no GPU,
//! so a change lands on the emulator's word and waits for the next lent device.

pub mod backend;
pub mod device;
pub mod executor;
pub mod kernels;
pub mod lora;
pub mod memory;
pub mod plan;
pub mod staging;
pub mod trace;

pub use device::{CudaDevice, DevPtr, Device, Gemm, GraphId, FENCE_FRAMES};
pub use executor::{check_model, CudaWorker, CudaWorkerError, CudaWorkerOptions, KvBlocks};
pub use kernels::{
    compile_ptx, compile_ptx_for, include_dir_from_env, kernel_entry_points, kernel_sources,
    nvrtc_available, Dtype, KernelError, Ptx,
};
pub use memory::{
    decode_floor_seconds, kv_bytes_per_block, kv_num_blocks, KvSizingError, ModelShape, MoeShape,
};
pub use plan::{
    default_graph_buckets, graph_bucket, plan_launch, LaunchPlan, PlanError, Tuning,
    DEFAULT_MAX_GRAPH_BATCH,
};
