//! baton-cuda: the CUDA side of the worker.
//!
//! - [`kernels`]: the CUDA C kernels of `kernels/` (embedded), compiled to PTX with NVRTC at
//!   worker start. NVRTC and the driver are loaded dynamically, so this crate builds and its
//!   CPU tests run on machines with no CUDA at all.
//! - [`plan`]: flattening a launch's rows into the kernels' input arrays; CUDA-graph buckets.
//! - [`memory`]: KV-cache sizing under `gpu_memory_utilization`.
//! - [`backend`]: `CudaBackend` skeleton (device, stream, loaded kernels, sampler launcher);
//!   needs a GPU, untested so far.
//!
//! The numerical reference for the device sampler is `baton_worker::sampling`.

pub mod backend;
pub mod executor;
pub mod kernels;
pub mod memory;
pub mod plan;
pub mod staging;

pub use executor::{CudaWorker, CudaWorkerError, CudaWorkerOptions, KvBlocks};
pub use kernels::{
    compile_ptx, compile_ptx_for, include_dir_from_env, kernel_entry_points, kernel_sources,
    nvrtc_available, Dtype, KernelError, Ptx,
};
pub use memory::{
    decode_floor_seconds, kv_bytes_per_block, kv_num_blocks, KvSizingError, ModelShape,
};
pub use plan::{
    default_graph_buckets, graph_bucket, plan_launch, LaunchPlan, PlanError,
    DEFAULT_MAX_GRAPH_BATCH,
};
