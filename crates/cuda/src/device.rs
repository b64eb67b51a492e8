//! The device interface the executor runs on, and its CUDA implementation.
//!
//! [`crate::CudaWorker`] does all of its device work through the [`Device`] trait: allocate,
//! copy, launch a kernel by entry name with a `cuLaunchKernel`-style parameter array, run a
//! cuBLAS-style GEMM, synchronize, record and wait on the fence, capture and replay graphs.
//! [`CudaDevice`] implements it with cudarc (driver API, NVRTC, cuBLAS); the `baton-cuda-emu`
//! crate implements it on the host, running the same CUDA C kernels under an emulator, so the
//! whole executor (planning, staging, argument lists, GEMM layouts, the pending-id ring, graph
//! replay) is tested on machines without a GPU.
//!
//! Semantics every implementation keeps: one in-order stream; `*_async` calls and launches are
//! ordered on it; synchronous copies and [`Device::synchronize`] return with the stream idle;
//! between [`Device::begin_capture`] and [`Device::end_capture`] nothing executes, the calls are
//! recorded into a graph that [`Device::launch_graph`] replays with the recorded arguments (the
//! same device addresses; host sources of async copies are read again at replay).

use crate::executor::CudaWorkerError;
use crate::kernels::{compile_with_defines, kernel_entry_points, Dtype};
use crate::trace::{StepTrace, TraceSlot, TRACE_SLOTS};
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::sys as cu;
use cudarc::driver::DriverError;
use cudarc::driver::{result as cu_result, CudaContext, CudaEvent, CudaFunction, CudaStream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A device address: a `CUdeviceptr` on CUDA, a host address under emulation.
pub type DevPtr = u64;

/// Index of a captured graph on its device.
pub type GraphId = usize;

/// One GEMM in cuBLAS's column-major convention, `alpha = 1`, `beta = 0`, fp32 accumulation
/// (`cublasGemmEx` with `CUBLAS_COMPUTE_32F`):
/// `C[m x n] = op(A)[m x k] · op(B)[k x n]` where `op(X)` is `Xᵀ` when `trans_*` is set.
/// Element `(i, j)` of a stored matrix `X` with leading dimension `ld` is `x[i + j * ld]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// What the product is, for profiles (e.g. `"gemm qkv"`).
    pub what: &'static str,
    /// Use `Aᵀ` (A stored `k x m`).
    pub trans_a: bool,
    /// Use `Bᵀ` (B stored `n x k`).
    pub trans_b: bool,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// A's address.
    pub a: DevPtr,
    /// A's leading dimension, in elements.
    pub lda: usize,
    /// B's address.
    pub b: DevPtr,
    /// B's leading dimension, in elements.
    pub ldb: usize,
    /// Element type of A and B.
    pub ab_type: Dtype,
    /// C's address.
    pub c: DevPtr,
    /// C's leading dimension, in elements.
    pub ldc: usize,
    /// Element type of C.
    pub c_type: Dtype,
}

/// What [`crate::CudaWorker`] needs from a device. See the module docs for the ordering rules.
///
/// Errors are [`CudaWorkerError`]s naming the failed call.
pub trait Device: Send + Sync {
    /// A short description for logs (e.g. `"cuda:0 sm_90"`).
    fn describe(&self) -> String;
    /// Streaming multiprocessors (132 on an H100 or H200): launch planning sizes one-wave
    /// grids from it.
    fn multiprocessor_count(&self) -> usize;
    /// Makes the device current on the calling thread (the driver's context binding).
    fn bind(&self) -> Result<(), CudaWorkerError>;
    /// `(free, total)` device memory in bytes.
    fn mem_info(&self) -> Result<(usize, usize), CudaWorkerError>;
    /// Allocates `bytes` (at least 16) of zeroed device memory, 256-byte aligned; returns with
    /// the zeroing complete.
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevPtr, CudaWorkerError>;
    /// Frees an allocation.
    ///
    /// # Safety
    /// `ptr` came from [`Device::alloc_zeroed`] on this device, is freed once, and no pending
    /// or captured work uses it any more.
    unsafe fn free(&self, ptr: DevPtr);
    /// Allocates `bytes` (at least 16) of zeroed page-locked host memory.
    fn alloc_host(&self, bytes: usize) -> Result<*mut u8, CudaWorkerError>;
    /// Frees page-locked host memory.
    ///
    /// # Safety
    /// `ptr` came from [`Device::alloc_host`] on this device and is freed once, with no
    /// pending copy touching it.
    unsafe fn free_host(&self, ptr: *mut u8);
    /// Synchronous host-to-device copy of `src` to `dst`.
    ///
    /// # Safety
    /// `dst` addresses at least `src.len()` bytes of a live allocation.
    unsafe fn copy_htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), CudaWorkerError>;
    /// Synchronous device-to-host copy of `dst.len()` bytes; waits for the stream first.
    ///
    /// # Safety
    /// `src` addresses at least `dst.len()` bytes of a live allocation.
    unsafe fn copy_dtoh(&self, dst: &mut [u8], src: DevPtr) -> Result<(), CudaWorkerError>;
    /// Stream-ordered host-to-device copy.
    ///
    /// # Safety
    /// `src` is page-locked host memory from [`Device::alloc_host`] holding `bytes` bytes that
    /// stay valid and unchanged until the stream passes this copy; `dst` holds `bytes`.
    unsafe fn copy_htod_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), CudaWorkerError>;
    /// Stream-ordered device-to-host copy.
    ///
    /// # Safety
    /// `dst` is page-locked host memory from [`Device::alloc_host`] with room for `bytes`,
    /// not read or written by the host until the stream passes this copy; `src` holds `bytes`.
    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), CudaWorkerError>;
    /// Stream-ordered device-to-device copy.
    ///
    /// # Safety
    /// Both addresses hold `bytes` bytes of live allocations.
    unsafe fn copy_dtod_async(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), CudaWorkerError>;
    /// Launches kernel `name` on `grid` blocks of `block` threads (x only), no dynamic shared
    /// memory. `params` is `cuLaunchKernel`'s `kernelParams`: one pointer per kernel
    /// parameter, each pointing at the value (read before this returns).
    ///
    /// # Safety
    /// `params` matches `name`'s C signature in count, order and types, and every device
    /// pointer among the values addresses live memory large enough for the launch.
    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaWorkerError>;
    /// The most blocks of kernel `name`, `block` threads each and no dynamic shared memory,
    /// that one SM holds at once (`cuOccupancyMaxActiveBlocksPerMultiprocessor`): a cooperative
    /// launch may have at most this many times [`Device::multiprocessor_count`] blocks.
    ///
    /// # Errors
    /// The kernel is not loaded, or the driver call fails.
    fn max_resident_blocks(&self, name: &str, block: u32) -> Result<usize, CudaWorkerError>;
    /// [`Device::launch`] as a cooperative launch (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`, no
    /// programmatic dependent launch): every block of the grid is resident at once, so the
    /// kernel may wait at grid barriers (`BATON_GRID_SYNC`, kernels/common.cuh). The driver
    /// refuses a grid larger than [`Device::max_resident_blocks`] times the SM count
    /// (`CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`).
    ///
    /// # Safety
    /// As for [`Device::launch`].
    unsafe fn launch_cooperative(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaWorkerError>;
    /// Enqueues `g`.
    ///
    /// # Safety
    /// Every matrix lies inside a live allocation for the given shapes and leading dimensions.
    unsafe fn gemm(&self, g: &Gemm) -> Result<(), CudaWorkerError>;
    /// Waits until the stream is idle.
    fn synchronize(&self) -> Result<(), CudaWorkerError>;
    /// Records fence `frame` (a CUDA event; `frame < FENCE_FRAMES`) after everything
    /// enqueued so far. Each frame is one launch in flight: recording a frame again moves it
    /// to the new point of the stream.
    fn record_fence(&self, frame: usize) -> Result<(), CudaWorkerError>;
    /// Waits until the last record of fence `frame` has passed (everything enqueued before it
    /// is complete, host copies included).
    fn wait_fence(&self, frame: usize) -> Result<(), CudaWorkerError>;
    /// Whether fence `frame` has passed, without waiting (`cuEventQuery`).
    ///
    /// # Errors
    /// A device error, including one of earlier asynchronous work.
    fn fence_passed(&self, frame: usize) -> Result<bool, CudaWorkerError>;
    /// Starts capturing the stream's work into a graph (the stream must be idle).
    fn begin_capture(&self) -> Result<(), CudaWorkerError>;
    /// Ends the capture begun by [`Device::begin_capture`] and instantiates the graph. Always
    /// leaves capture mode, even when it fails.
    fn end_capture(&self) -> Result<GraphId, CudaWorkerError>;
    /// Replays a captured graph on the stream.
    ///
    /// # Safety
    /// Every allocation the capture used is still live.
    unsafe fn launch_graph(&self, graph: GraphId) -> Result<(), CudaWorkerError>;
    /// Destroys a captured graph (its id is never reused; replaying it is then an error). A
    /// replay still in flight completes first (`cuGraphExecDestroy`).
    ///
    /// # Errors
    /// No such graph, or one destroyed already.
    fn destroy_graph(&self, graph: GraphId) -> Result<(), CudaWorkerError>;
    /// Device-to-device copy bandwidth in bytes/s (read + write counted, best of `iters`
    /// copies of `bytes`).
    fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64, CudaWorkerError>;
    /// Starts (`true`, discarding earlier timings) or stops timing every launch and GEMM on
    /// its own (an event pair around each on CUDA: a diagnostic that slows the stream; never
    /// while capturing a graph).
    fn set_profiling(&self, on: bool);
    /// The calls timed since profiling started, in order: `(kernel name or GEMM label,
    /// milliseconds)`. Waits for the stream.
    fn take_profile(&self) -> Result<Vec<(String, f64)>, CudaWorkerError>;
    /// Starts (`true`) or stops step timing: with it on, [`Device::mark_step_start`] and the
    /// next [`Device::record_fence`] bracket a step's device work with a pair of timing
    /// events (two event records per step; off by default).
    ///
    /// # Errors
    /// The timing events cannot be created (step timing stays off).
    fn set_step_timing(&self, _on: bool) -> Result<(), CudaWorkerError> {
        Ok(())
    }
    /// Marks the start of a step's device work on the stream (when step timing is on).
    fn mark_step_start(&self) -> Result<(), CudaWorkerError> {
        Ok(())
    }
    /// Milliseconds on the stream from the last [`Device::mark_step_start`] to the last fence,
    /// once [`Device::wait_fence`] has returned; `None` with step timing off. It counts the
    /// stream's idle gaps while the host submits the step's work after the mark, not the host
    /// work before it.
    fn step_device_ms(&self) -> Option<f64> {
        None
    }
    /// The launch trace of the last step ([`crate::trace`]): the slots the kernels wrote
    /// since the last [`Device::mark_step_start`] (which empties the table), read once the
    /// stream is idle. `None` unless the trace is on: on a GPU, kernels compiled with
    /// `BATON_TRACE=1` ([`KERNEL_DEFINES_ENV`](crate::kernels::KERNEL_DEFINES_ENV)); in the
    /// host emulator, after `EmuDevice::set_launch_trace(true)`.
    ///
    /// # Errors
    /// Device errors.
    fn take_launch_trace(&self) -> Result<Option<StepTrace>, CudaWorkerError> {
        Ok(None)
    }
}

pub(crate) fn drv<T>(what: &'static str, r: Result<T, DriverError>) -> Result<T, CudaWorkerError> {
    r.map_err(|err| CudaWorkerError::Driver { what, err })
}

fn blas(what: &'static str, s: cublas_sys::cublasStatus_t) -> Result<(), CudaWorkerError> {
    if s == cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaWorkerError::Cublas { what, status: s })
    }
}

/// Bytes of cuBLAS workspace (set explicitly so graph capture never allocates).
pub const CUBLAS_WORKSPACE: usize = 32 << 20;

/// A CUDA device through cudarc: one context, one created stream (never the legacy default
/// stream), the kernels of one [`Dtype`] compiled with NVRTC for the device's architecture,
/// a cuBLAS handle on the stream with its own workspace, and [`FENCE_FRAMES`] events as the
/// fences.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cublas: cublas_sys::cublasHandle_t,
    workspace: DevPtr,
    functions: HashMap<&'static str, CudaFunction>,
    fences: Vec<CudaEvent>,
    graphs: Mutex<Vec<cu::CUgraphExec>>,
    /// Event pairs around each call while profiling.
    profile: Mutex<Option<Vec<(String, CudaEvent, CudaEvent)>>>,
    /// Step timing: (start, end) timing events, recorded by `mark_step_start` and
    /// `record_fence` while on.
    step_timing: Mutex<Option<(CudaEvent, CudaEvent)>>,
    arch: String,
    ordinal: usize,
    sm_count: usize,
    /// Launch every kernel with programmatic stream serialization (PDL; see
    /// `kernels/common.cuh`): compute capability 9.0 or newer, unless [`NO_PDL_ENV`] is set.
    pdl: bool,
    /// The launch trace's table ([`crate::trace`]: [`TRACE_SLOTS`] slots) and the clock's
    /// tick in ns (`baton_trace_tick`) when the kernels were compiled with `BATON_TRACE=1`.
    trace: Option<(DevPtr, u64)>,
}

/// Fences a [`Device`] keeps: how many launches the executor can have in flight at once (one
/// fence per launch, see `CudaWorker::submit`).
pub const FENCE_FRAMES: usize = 2;

/// Set (to anything but `0` or empty) to launch kernels without programmatic dependent launch,
/// for A/B measurements (`baton bench decode`).
pub const NO_PDL_ENV: &str = "BATON_NO_PDL";

// SAFETY: the driver API is thread-safe; the raw cuBLAS handle and graph execs are used by the
// one worker thread that owns the `CudaWorker` (every entry point binds the context first), and
// the graph list is behind a mutex.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; `&self` methods never hand out aliases to interior state.
unsafe impl Sync for CudaDevice {}

/// Changes of `%globaltimer` `baton_trace_tick` waits for (kernels/trace.cu).
const TRACE_TICK_CHANGES: i32 = 64;

impl CudaDevice {
    /// The smallest step of `%globaltimer` on this device, ns (kernels/trace.cu), for the
    /// launch trace's report.
    ///
    /// # Errors
    /// Device errors.
    fn measure_trace_tick(&self) -> Result<u64, CudaWorkerError> {
        let out = self.alloc_zeroed(16)?;
        let mut ptr = out;
        let mut changes = TRACE_TICK_CHANGES;
        let mut params = [
            &mut ptr as *mut DevPtr as *mut c_void,
            &mut changes as *mut i32 as *mut c_void,
        ];
        // SAFETY: baton_trace_tick(u64* out, int changes): the two parameters in order; `out`
        // holds two u64.
        let run = unsafe { self.launch("baton_trace_tick", (1, 1, 1), 32, &mut params) }
            .and_then(|()| self.synchronize());
        let mut got = [0u8; 16];
        // SAFETY: `out` holds 16 bytes; read after the kernel (stream order).
        let read = run.and_then(|()| unsafe { self.copy_dtoh(&mut got, out) });
        // SAFETY: allocated above, used by nothing else now the stream is idle.
        unsafe { self.free(out) };
        read?;
        Ok(u64::from_le_bytes(got[..8].try_into().expect("8 bytes")))
    }

    /// The loaded kernel `name`.
    fn function(&self, name: &str) -> Result<&CudaFunction, CudaWorkerError> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaWorkerError::Unsupported(format!("kernel {name} not loaded")))
    }

    /// `cuLaunchKernelEx` of `f` on the worker's stream with one launch attribute `id`, its
    /// value set by `set` (from all zeros), no dynamic shared memory.
    ///
    /// # Safety
    /// As for [`Device::launch`]: `params` matches `f`'s signature and its pointers address
    /// live memory.
    unsafe fn launch_ex(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
        id: cu::CUlaunchAttributeID,
        set: impl FnOnce(&mut cu::CUlaunchAttributeValue),
    ) -> Result<(), CudaWorkerError> {
        let mut attr = cu::CUlaunchAttribute {
            id,
            pad: [0; 4],
            // SAFETY: an all-zero attribute value is valid plain data; `set` fills the field
            // that `id` selects.
            value: unsafe { std::mem::zeroed() },
        };
        set(&mut attr.value);
        let config = cu::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: per the contract, `params` matches the kernel's signature and its pointers
        // address live memory; `config` and `attr` outlive the call, which copies them and the
        // parameters.
        drv("cuLaunchKernelEx", unsafe {
            cu::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        })
    }

    /// Opens device `ordinal`: checks the driver and cuBLAS can be loaded, creates the context
    /// and stream, compiles every kernel for the device's architecture and `dtype` (headers
    /// from `include_dir`, extra `-D` definitions `defines`, usually none: see
    /// [`KERNEL_DEFINES_ENV`](crate::kernels::KERNEL_DEFINES_ENV)), loads them, and sets up
    /// cuBLAS.
    ///
    /// # Errors
    /// [`CudaWorkerError::DriverUnavailable`], [`CudaWorkerError::CublasUnavailable`], driver,
    /// NVRTC and cuBLAS failures.
    pub fn new(
        ordinal: usize,
        include_dir: &Path,
        dtype: Dtype,
        defines: &[String],
    ) -> Result<Self, CudaWorkerError> {
        if !crate::backend::driver_available() {
            return Err(CudaWorkerError::DriverUnavailable);
        }
        // SAFETY: only dlopen()s candidate names of libcublas and drops the handles.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(CudaWorkerError::CublasUnavailable);
        }
        let ctx = drv("cuInit / context", CudaContext::new(ordinal))?;
        // SAFETY: this device uses one stream for everything and synchronizes at every fence;
        // no CudaSlice is shared across streams, so cudarc's per-slice events are not needed
        // (and would add event records inside graph capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = drv("cuStreamCreate", ctx.new_stream())?;
        let (major, minor) = drv("compute capability", ctx.compute_capability())?;
        let arch = format!("sm_{major}{minor}");
        let sm_count = drv(
            "multiprocessor count",
            ctx.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )?
        .max(1) as usize;
        let no_pdl = std::env::var(NO_PDL_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        let pdl = major >= 9 && !no_pdl;
        let mut functions = HashMap::new();
        let tracing = defines.iter().any(|d| {
            d.split_once('=')
                .is_some_and(|(n, v)| n == "BATON_TRACE" && v != "0")
        });
        // Each module's `baton_trace_buf` (kernels/common.cuh) when tracing.
        let mut trace_globals = Vec::new();
        for ((file, compiled), &(_, entries)) in
            compile_with_defines(&arch, include_dir, dtype, defines)?
                .into_iter()
                .zip(kernel_entry_points())
        {
            // The CUBIN for this exact architecture: no driver JIT at start-up.
            let image = cudarc::nvrtc::Ptx::from_binary(compiled.cubin);
            let module = drv("cuModuleLoadData", ctx.load_module(image))
                .map_err(|e| CudaWorkerError::Unsupported(format!("{file}: {e}")))?;
            if tracing {
                use cudarc::driver::DevicePtr as _;
                let global = drv(
                    "cuModuleGetGlobal baton_trace_buf",
                    module.get_global("baton_trace_buf", &stream),
                )?;
                if global.len() != 8 {
                    return Err(CudaWorkerError::Unsupported(format!(
                        "{file}: baton_trace_buf is {} bytes, not 8",
                        global.len()
                    )));
                }
                let (ptr, _record) = global.device_ptr(&stream);
                trace_globals.push(ptr);
            }
            for &entry in entries {
                functions.insert(
                    entry,
                    drv("cuModuleGetFunction", module.load_function(entry))?,
                );
            }
        }
        let fences = (0..FENCE_FRAMES)
            .map(|_| drv("cuEventCreate", ctx.new_event(None)))
            .collect::<Result<Vec<_>, _>>()?;
        let cublas =
            cudarc::cublas::result::create_handle().map_err(|e| CudaWorkerError::Cublas {
                what: "cublasCreate",
                status: e.0,
            })?;
        let mut dev = CudaDevice {
            ctx,
            stream,
            cublas,
            workspace: 0,
            functions,
            fences,
            graphs: Mutex::new(Vec::new()),
            profile: Mutex::new(None),
            step_timing: Mutex::new(None),
            arch,
            ordinal,
            sm_count,
            pdl,
            trace: None,
        };
        dev.workspace = dev.alloc_zeroed(CUBLAS_WORKSPACE)?;
        if tracing {
            let buf = dev.alloc_zeroed(TRACE_SLOTS * std::mem::size_of::<TraceSlot>())?;
            dev.trace = Some((buf, 0));
            // SAFETY: each global is a module's 8-byte `baton_trace_buf` (its size checked
            // above), which no kernel has read yet (none has run).
            unsafe {
                for &g in &trace_globals {
                    dev.copy_htod(g, &buf.to_le_bytes())?;
                }
            }
            let tick = dev.measure_trace_tick()?;
            dev.trace = Some((buf, tick));
        }
        // SAFETY: `cublas` was just created; the stream and workspace outlive the handle (the
        // handle is destroyed first in Drop).
        unsafe {
            blas(
                "cublasSetStream",
                cublas_sys::cublasSetStream_v2(
                    dev.cublas,
                    dev.stream.cu_stream() as cublas_sys::cudaStream_t,
                ),
            )?;
            blas(
                "cublasSetWorkspace",
                cublas_sys::cublasSetWorkspace_v2(
                    dev.cublas,
                    dev.workspace as *mut c_void,
                    CUBLAS_WORKSPACE,
                ),
            )?;
            // Plain fp32 math (no TF32) for f32 runs.
            blas(
                "cublasSetMathMode",
                cublas_sys::cublasSetMathMode(
                    dev.cublas,
                    cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
                ),
            )?;
        }
        drv("synchronize", dev.stream.synchronize())?;
        Ok(dev)
    }

    /// `(free, total)` memory of device `ordinal` in bytes, as a worker starting there would see
    /// it: measured under a context of its own (dropped on return), minus the cuBLAS workspace
    /// a [`CudaDevice`] allocates before the worker measures.
    ///
    /// # Errors
    /// [`CudaWorkerError::DriverUnavailable`]; driver errors (no such device).
    pub fn probe_memory(ordinal: usize) -> Result<(usize, usize), CudaWorkerError> {
        if !crate::backend::driver_available() {
            return Err(CudaWorkerError::DriverUnavailable);
        }
        let ctx = drv("cuInit / context", CudaContext::new(ordinal))?;
        let (free, total) = drv("cuMemGetInfo", ctx.mem_get_info())?;
        Ok((free.saturating_sub(CUBLAS_WORKSPACE), total))
    }

    /// Runs `call` between two recorded events when profiling.
    fn timed(
        &self,
        label: impl FnOnce() -> String,
        call: impl FnOnce() -> Result<(), CudaWorkerError>,
    ) -> Result<(), CudaWorkerError> {
        let on = self
            .profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if !on {
            return call();
        }
        let event = || {
            drv(
                "cuEventCreate",
                self.ctx
                    .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT)),
            )
        };
        let (start, end) = (event()?, event()?);
        drv("cuEventRecord", start.record(&self.stream))?;
        call()?;
        drv("cuEventRecord", end.record(&self.stream))?;
        if let Some(p) = self
            .profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            p.push((label(), start, end));
        }
        Ok(())
    }

    /// Fence `frame`, or an error naming the bad index.
    fn fence(&self, frame: usize) -> Result<&CudaEvent, CudaWorkerError> {
        self.fences
            .get(frame)
            .ok_or_else(|| CudaWorkerError::Device {
                what: "fence",
                msg: format!("no fence frame {frame} (the device keeps {FENCE_FRAMES})"),
            })
    }

    /// The device's architecture, e.g. `"sm_90"`.
    pub fn arch(&self) -> &str {
        &self.arch
    }
}

fn cuda_type(d: Dtype) -> cublas_sys::cudaDataType_t {
    use cublas_sys::cudaDataType_t as D;
    match d {
        Dtype::Bf16 => D::CUDA_R_16BF,
        Dtype::F16 => D::CUDA_R_16F,
        Dtype::F32 => D::CUDA_R_32F,
    }
}

impl Device for CudaDevice {
    fn describe(&self) -> String {
        let pdl = if self.pdl { ", PDL" } else { "" };
        format!(
            "cuda:{} {} ({} SMs{pdl})",
            self.ordinal, self.arch, self.sm_count
        )
    }

    fn multiprocessor_count(&self) -> usize {
        self.sm_count
    }

    fn bind(&self) -> Result<(), CudaWorkerError> {
        drv("cuCtxSetCurrent", self.ctx.bind_to_thread())
    }

    fn mem_info(&self) -> Result<(usize, usize), CudaWorkerError> {
        drv("cuMemGetInfo", self.ctx.mem_get_info())
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevPtr, CudaWorkerError> {
        self.bind()?;
        let bytes = bytes.max(16);
        // SAFETY: a plain allocation on the current context; zeroed before use.
        let ptr = drv("cuMemAlloc", unsafe { cu_result::malloc_sync(bytes) })?;
        // Zero on our stream and wait: cuMemsetD8 would run on the legacy stream, which our
        // non-blocking stream does not wait for, and may return before it is done.
        // SAFETY: `ptr` holds `bytes` bytes just allocated.
        let zeroed = drv("cuMemsetD8Async", unsafe {
            cu_result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream())
        })
        .and_then(|()| self.synchronize());
        if let Err(e) = zeroed {
            // SAFETY: allocated above, never used.
            let _ = unsafe { cu_result::free_sync(ptr) };
            return Err(e);
        }
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: DevPtr) {
        // The context must be current on this thread (a buffer may be dropped on another
        // thread than the one that allocated it); a failure here only leaks.
        let _ = self.bind();
        // SAFETY: per the contract, `ptr` is ours, freed once and unused.
        let _ = unsafe { cu_result::free_sync(ptr) };
    }

    fn alloc_host(&self, bytes: usize) -> Result<*mut u8, CudaWorkerError> {
        self.bind()?;
        let bytes = bytes.max(16);
        // SAFETY: a plain allocation call on the current context.
        let ptr = drv("cuMemHostAlloc", unsafe {
            cu_result::malloc_host(bytes, 0)
        })? as *mut u8;
        // SAFETY: `ptr` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(ptr)
    }

    unsafe fn free_host(&self, ptr: *mut u8) {
        let _ = self.bind();
        // SAFETY: per the contract, allocated by cuMemHostAlloc and freed once.
        let _ = unsafe { cu_result::free_host(ptr as *mut c_void) };
    }

    // The synchronous copies are async copies on our stream followed by a stream
    // synchronize: cuMemcpyHtoD runs on the legacy stream (which our non-blocking stream does
    // not wait for) and, from pageable memory, may return before the DMA has landed.
    unsafe fn copy_htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), CudaWorkerError> {
        // SAFETY: per the contract `dst` holds `src.len()` bytes; the synchronize below keeps
        // `src` borrowed until the copy is done.
        drv("cuMemcpyHtoDAsync", unsafe {
            cu_result::memcpy_htod_async(dst, src, self.stream.cu_stream())
        })?;
        self.synchronize()
    }

    unsafe fn copy_dtoh(&self, dst: &mut [u8], src: DevPtr) -> Result<(), CudaWorkerError> {
        // SAFETY: per the contract `src` holds `dst.len()` bytes; stream-ordered after every
        // earlier launch, and the synchronize below keeps `dst` borrowed until it is written.
        drv("cuMemcpyDtoHAsync", unsafe {
            cu_result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
        })?;
        self.synchronize()
    }

    unsafe fn copy_htod_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), CudaWorkerError> {
        // SAFETY: per the contract, `src` is pinned, holds `bytes` and stays valid until the
        // stream passes the copy.
        drv("cuMemcpyHtoDAsync", unsafe {
            let s = std::slice::from_raw_parts(src, bytes);
            cu_result::memcpy_htod_async(dst, s, self.stream.cu_stream())
        })
    }

    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), CudaWorkerError> {
        // SAFETY: per the contract, `dst` is pinned with room for `bytes` and untouched by the
        // host until the stream passes the copy.
        drv("cuMemcpyDtoHAsync", unsafe {
            let d = std::slice::from_raw_parts_mut(dst, bytes);
            cu_result::memcpy_dtoh_async(d, src, self.stream.cu_stream())
        })
    }

    unsafe fn copy_dtod_async(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), CudaWorkerError> {
        // SAFETY: per the contract, both ranges are live.
        drv("cuMemcpyDtoDAsync", unsafe {
            cu_result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        })
    }

    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaWorkerError> {
        let f = self.function(name)?;
        self.timed(
            || name.to_owned(),
            || {
                if !self.pdl {
                    // SAFETY: per the contract, `params` matches the kernel's signature and
                    // its pointers address live memory; cuLaunchKernel copies the parameters
                    // before returning.
                    return drv("cuLaunchKernel", unsafe {
                        cu_result::launch_kernel(
                            f.cu_function(),
                            grid,
                            (block, 1, 1),
                            0,
                            self.stream.cu_stream(),
                            params,
                        )
                    });
                }
                // Programmatic dependent launch: this kernel's blocks may start once the
                // previous kernel in the stream has run BATON_PDL_LAUNCH; every kernel waits
                // for its predecessor (BATON_PDL_WAIT) before its first global write and
                // before reading anything but weights and memory written two or more kernels
                // back (the rule in kernels/common.cuh).
                let id =
                    cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                // SAFETY: per the contract (launch_ex's is this function's).
                unsafe {
                    self.launch_ex(f, grid, block, params, id, |v| {
                        v.programmaticStreamSerializationAllowed = 1
                    })
                }
            },
        )
    }

    fn max_resident_blocks(&self, name: &str, block: u32) -> Result<usize, CudaWorkerError> {
        drv(
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            self.function(name)?
                .occupancy_max_active_blocks_per_multiprocessor(block, 0, None),
        )
        .map(|n| n as usize)
    }

    unsafe fn launch_cooperative(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaWorkerError> {
        let f = self.function(name)?;
        let id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        self.timed(
            || name.to_owned(),
            // SAFETY: per the contract (launch_ex's is this function's).
            || unsafe { self.launch_ex(f, grid, block, params, id, |v| v.cooperative = 1) },
        )
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), CudaWorkerError> {
        use cublas_sys::cublasOperation_t as Op;
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ab = cuda_type(g.ab_type);
        self.timed(
            || g.what.to_owned(),
            || {
                // SAFETY: per the contract the matrices are live for these shapes; alpha/beta are host
                // f32 scalars (CUBLAS_COMPUTE_32F, default host pointer mode) read before the call
                // returns.
                let s = unsafe {
                    cublas_sys::cublasGemmEx(
                        self.cublas,
                        op(g.trans_a),
                        op(g.trans_b),
                        g.m as i32,
                        g.n as i32,
                        g.k as i32,
                        &alpha as *const f32 as *const c_void,
                        g.a as *const c_void,
                        ab,
                        g.lda as i32,
                        g.b as *const c_void,
                        ab,
                        g.ldb as i32,
                        &beta as *const f32 as *const c_void,
                        g.c as *mut c_void,
                        cuda_type(g.c_type),
                        g.ldc as i32,
                        cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                    )
                };
                blas("cublasGemmEx", s)
            },
        )
    }

    fn synchronize(&self) -> Result<(), CudaWorkerError> {
        drv("cuStreamSynchronize", self.stream.synchronize())
    }

    fn record_fence(&self, frame: usize) -> Result<(), CudaWorkerError> {
        let fence = self.fence(frame)?;
        if let Some((_, end)) = self
            .step_timing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            drv("cuEventRecord", end.record(&self.stream))?;
        }
        drv("cuEventRecord", fence.record(&self.stream))
    }

    fn fence_passed(&self, frame: usize) -> Result<bool, CudaWorkerError> {
        drv("cuEventQuery", self.fence(frame)?.try_is_complete())
    }

    fn wait_fence(&self, frame: usize) -> Result<(), CudaWorkerError> {
        drv("cuEventSynchronize", self.fence(frame)?.synchronize())
    }

    fn begin_capture(&self) -> Result<(), CudaWorkerError> {
        // SAFETY: the stream is ours and idle; THREAD_LOCAL mode forbids unsafe calls (e.g.
        // cuMemAlloc) from this thread only while capturing, and the executor makes none
        // between begin and end (all buffers exist, cuBLAS has its workspace).
        drv("cuStreamBeginCapture", unsafe {
            cu_result::stream::begin_capture(
                self.stream.cu_stream(),
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })
    }

    fn end_capture(&self) -> Result<GraphId, CudaWorkerError> {
        // SAFETY: ends the capture begun on the same stream.
        let graph = drv("cuStreamEndCapture", unsafe {
            cu_result::stream::end_capture(self.stream.cu_stream())
        })?;
        // SAFETY: `graph` is the valid graph just captured; it is destroyed right after
        // instantiation (the exec keeps its own copy).
        let exec = unsafe {
            let e = cu_result::graph::instantiate(graph, cu::CUgraphInstantiate_flags(0));
            let _ = cu_result::graph::destroy(graph);
            e
        };
        let exec = drv("cuGraphInstantiate", exec)?;
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        graphs.push(exec);
        Ok(graphs.len() - 1)
    }

    unsafe fn launch_graph(&self, graph: GraphId) -> Result<(), CudaWorkerError> {
        let exec = *self
            .graphs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(graph)
            .filter(|e| !e.is_null())
            .ok_or_else(|| CudaWorkerError::Unsupported(format!("no graph {graph}")))?;
        // SAFETY: `exec` was instantiated from a capture on this stream; per the contract its
        // buffers are live.
        drv("cuGraphLaunch", unsafe {
            cu_result::graph::launch(exec, self.stream.cu_stream())
        })
    }

    fn destroy_graph(&self, graph: GraphId) -> Result<(), CudaWorkerError> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let slot = graphs
            .get_mut(graph)
            .filter(|e| !e.is_null())
            .ok_or_else(|| CudaWorkerError::Unsupported(format!("no graph {graph}")))?;
        let exec = std::mem::replace(slot, std::ptr::null_mut());
        self.bind()?;
        // SAFETY: `exec` was instantiated by `end_capture` and is destroyed once (its slot is
        // null from now on); a replay in flight completes before the driver frees it.
        drv("cuGraphExecDestroy", unsafe {
            cu_result::graph::exec_destroy(exec)
        })
    }

    fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64, CudaWorkerError> {
        self.bind()?;
        let a = self.alloc_zeroed(bytes)?;
        let b = match self.alloc_zeroed(bytes) {
            Ok(b) => b,
            Err(e) => {
                // SAFETY: allocated just above, unused.
                unsafe { self.free(a) };
                return Err(e);
            }
        };
        let run = || -> Result<f64, CudaWorkerError> {
            let start = drv(
                "cuEventCreate",
                self.ctx
                    .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT)),
            )?;
            let stop = drv(
                "cuEventCreate",
                self.ctx
                    .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT)),
            )?;
            let mut best = 0f64;
            for _ in 0..iters.max(1) {
                drv("cuEventRecord", start.record(&self.stream))?;
                // SAFETY: both allocations hold `bytes` bytes and stay alive until after the
                // synchronize below.
                unsafe { self.copy_dtod_async(b, a, bytes)? };
                drv("cuEventRecord", stop.record(&self.stream))?;
                drv("cuEventSynchronize", stop.synchronize())?;
                let ms = drv("cuEventElapsedTime", start.elapsed_ms(&stop))? as f64;
                if ms > 0.0 {
                    best = best.max(2.0 * bytes as f64 / (ms * 1e-3));
                }
            }
            Ok(best)
        };
        let r = run();
        let _ = self.synchronize();
        // SAFETY: both allocated above; the stream is idle.
        unsafe {
            self.free(a);
            self.free(b);
        }
        r
    }

    fn set_profiling(&self, on: bool) {
        *self.profile.lock().unwrap_or_else(|p| p.into_inner()) = on.then(Vec::new);
    }

    fn set_step_timing(&self, on: bool) -> Result<(), CudaWorkerError> {
        let mut t = self.step_timing.lock().unwrap_or_else(|p| p.into_inner());
        *t = None;
        if on {
            let ev = || {
                drv(
                    "cuEventCreate",
                    self.ctx
                        .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT)),
                )
            };
            *t = Some((ev()?, ev()?));
        }
        Ok(())
    }

    fn mark_step_start(&self) -> Result<(), CudaWorkerError> {
        if let Some((buf, _)) = self.trace {
            // SAFETY: the table lies in `buf`; stream-ordered before the step's kernels (and
            // after the previous step's, which the trace needs one at a time).
            drv("cuMemsetD8Async", unsafe {
                cu_result::memset_d8_async(
                    buf,
                    0xff,
                    TRACE_SLOTS * std::mem::size_of::<TraceSlot>(),
                    self.stream.cu_stream(),
                )
            })?;
        }
        match self
            .step_timing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some((start, _)) => drv("cuEventRecord", start.record(&self.stream)),
            None => Ok(()),
        }
    }

    fn step_device_ms(&self) -> Option<f64> {
        let t = self.step_timing.lock().unwrap_or_else(|p| p.into_inner());
        let (start, end) = t.as_ref()?;
        start.elapsed_ms(end).ok().map(f64::from)
    }

    fn take_launch_trace(&self) -> Result<Option<StepTrace>, CudaWorkerError> {
        let Some((buf, tick)) = self.trace else {
            return Ok(None);
        };
        let mut table = vec![TraceSlot::EMPTY; TRACE_SLOTS];
        // SAFETY: `buf` holds the whole table; copy_dtoh is stream-ordered after the step.
        unsafe { self.copy_dtoh(bytemuck::cast_slice_mut(&mut table), buf)? };
        Ok(Some(StepTrace::from_table(&table, tick)))
    }

    fn take_profile(&self) -> Result<Vec<(String, f64)>, CudaWorkerError> {
        self.synchronize()?;
        let taken = self
            .profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        taken
            .into_iter()
            .map(|(label, start, end)| {
                let ms = drv("cuEventElapsedTime", start.elapsed_ms(&end))?;
                Ok((label, f64::from(ms)))
            })
            .collect()
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
        for exec in self
            .graphs
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .filter(|e| !e.is_null())
        {
            // SAFETY: each exec was instantiated once and is destroyed once, after the stream
            // went idle.
            let _ = unsafe { cu_result::graph::exec_destroy(exec) };
        }
        // SAFETY: the handle was created in `new` and is destroyed once; the stream is idle.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.cublas) };
        if self.workspace != 0 {
            // SAFETY: allocated in `new`, freed once after the handle that used it is gone.
            unsafe { self.free(self.workspace) };
        }
        if let Some((buf, _)) = self.trace.take() {
            // SAFETY: allocated in `new`, freed once; the stream is idle.
            unsafe { self.free(buf) };
        }
    }
}

/// A device allocation that frees itself (after every user of it: the executor synchronizes
/// its stream before dropping its buffers).
pub(crate) struct Buf {
    dev: Arc<dyn Device>,
    /// The allocation's address.
    pub(crate) ptr: DevPtr,
}

impl Buf {
    /// Allocates `bytes` zeroed bytes on `dev`.
    pub(crate) fn new(dev: &Arc<dyn Device>, bytes: usize) -> Result<Self, CudaWorkerError> {
        Ok(Buf {
            ptr: dev.alloc_zeroed(bytes)?,
            dev: Arc::clone(dev),
        })
    }
    /// The address `byte_offset` bytes in.
    pub(crate) fn at(&self, byte_offset: usize) -> DevPtr {
        self.ptr + byte_offset as u64
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` on this device, freed once; the owner synchronized the
        // stream before dropping (see `CudaWorker`'s Drop) and captured graphs die with the
        // device, after every buffer.
        unsafe { self.dev.free(self.ptr) };
    }
}

/// Page-locked host memory that frees itself.
pub(crate) struct Pinned {
    dev: Arc<dyn Device>,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: the pointer is owned exclusively by this value (no aliases are handed out beyond
// borrows of `self`), and page-locked memory may be touched from any thread.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(crate) fn new(dev: &Arc<dyn Device>, len: usize) -> Result<Self, CudaWorkerError> {
        let len = len.max(16);
        Ok(Pinned {
            ptr: dev.alloc_host(len)?,
            len,
            dev: Arc::clone(dev),
        })
    }
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialized (zeroed at allocation) bytes for the
        // life of `self`; device writes into it only happen between an async copy and the
        // fence, during which no borrow is held (the executor waits on the fence first).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with `&mut self` guaranteeing exclusivity on the host side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` on this device and freed once; no copy is pending (the
        // owner synchronized its stream).
        unsafe { self.dev.free_host(self.ptr) };
    }
}
