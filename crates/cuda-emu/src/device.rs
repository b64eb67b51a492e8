//! [`EmuDevice`]: a [`baton_cuda::Device`] on the host, so the whole CUDA executor
//! ([`baton_cuda::CudaWorker`]) runs without a GPU.
//!
//! - **Memory**: device allocations are host allocations (256-byte aligned, zeroed); a device
//!   address is the host address. Every allocation is followed by [`CANARY_BYTES`] of a fixed
//!   pattern, checked at every synchronization point and at free: a kernel or copy that writes
//!   past the end of a buffer is reported as an error naming the allocation.
//! - **Stream**: one in-order stream, executed eagerly by default: an `*_async` call or a
//!   launch has run when it returns (a valid schedule of a single stream), so fences are
//!   no-ops. [`EmuDevice::set_deferred`] switches to the other extreme: nothing enqueued runs
//!   until something waits for it (a fence wait runs the stream up to that fence's record, or
//!   all of it under [`EmuDevice::set_run_ahead`]; a synchronous copy, `synchronize` or a
//!   capture runs all of it). A host buffer the host rewrites before the fence of the copy
//!   that reads it then shows up as wrong data, a host read of results before their fence
//!   reads stale bytes, and (run ahead) results the next launch's copy overwrote before the
//!   host read them show up too: the ways a caller that keeps several launches in flight can
//!   get its buffers wrong. Freeing a device or host buffer that queued work still uses
//!   panics (CUDA may wait inside the free; relying on that is the bug). The first failure
//!   of deferred work is sticky, as a CUDA stream's: every later wait reports it.
//! - **Kernels**: [`crate::launch`] runs the CUDA C kernels of `kernels/` for the device's
//!   dtype under the fiber emulator; it checks the parameter count against the kernel's
//!   signature.
//! - **GEMM**: the `cublasGemmEx` contract of [`Gemm`] (column-major, `op(A) · op(B)`, fp32
//!   accumulation, result rounded once to C's type), computed by a plain loop.
//! - **Graphs**: between `begin_capture` and `end_capture` nothing runs; launches (with their
//!   parameter values copied, 8 bytes per slot), GEMMs and copies are recorded and
//!   `launch_graph` replays them, reading the host sources of async copies again, as CUDA does.
//!
//! Contract beyond [`Device`]'s: each kernel parameter pointer addresses an 8-byte slot (the
//! executor's argument packing), so a capture can copy the values.

use baton_cuda::trace::{StepTrace, TraceSlot, TRACE_SLOTS};
use baton_cuda::{CudaWorkerError, DevPtr, Device, Dtype, Gemm, GraphId};
use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// Bytes of guard pattern after every allocation.
pub const CANARY_BYTES: usize = 256;
const CANARY: u8 = 0xA5;
/// Blocks of any kernel that one emulated SM holds at once ([`Device::max_resident_blocks`]).
pub const EMU_RESIDENT_BLOCKS: usize = 4;
const ALIGN: usize = 256;

/// One recorded stream operation (graph capture).
#[derive(Clone, Debug)]
enum Op {
    Launch {
        name: String,
        grid: (u32, u32, u32),
        block: u32,
        vals: Vec<u64>,
        /// Launched through `Device::launch_cooperative` (grid barriers allowed).
        cooperative: bool,
    },
    Gemm(Gemm),
    /// Any copy (host addresses on both sides under emulation).
    Copy {
        dst: usize,
        src: usize,
        bytes: usize,
    },
    /// Empties the launch trace's table (`Device::mark_step_start` with the trace on).
    ClearTrace,
}

#[derive(Default)]
struct State {
    /// Deferred mode ([`EmuDevice::set_deferred`]): the stream's enqueued, not yet run work.
    deferred: Option<std::collections::VecDeque<Op>>,
    /// Operations enqueued and operations run in deferred mode (stream positions).
    enqueued: u64,
    executed: u64,
    /// Stream position of each fence's last record.
    fences: [u64; baton_cuda::FENCE_FRAMES],
    /// Deferred mode: a fence wait runs the whole queue ([`EmuDevice::set_run_ahead`]).
    run_ahead: bool,
    /// Thread and block order of every launch ([`EmuDevice::set_schedule`]).
    schedule: crate::Schedule,
    /// The first failure of deferred work (sticky).
    failed: Option<String>,
    /// Device allocations: address -> requested bytes.
    allocs: HashMap<u64, usize>,
    /// Host (pinned) allocations: address -> bytes.
    host: HashMap<usize, usize>,
    used: usize,
    capture: Option<Vec<Op>>,
    /// Captured graphs by id (`None`: destroyed).
    graphs: Vec<Option<Vec<Op>>>,
    launches: u64,
    /// Kernel launches run so far, by entry name.
    launches_by_name: HashMap<String, u64>,
    /// Graph replays so far.
    graph_launches: u64,
    /// Wall time of each launch and GEMM while profiling.
    profile: Option<Vec<(String, f64)>>,
    /// Step timing: on, the last step mark, and the wall time from it to the last fence.
    step_timing: Option<(Option<std::time::Instant>, Option<f64>)>,
    /// The launch trace's table ([`EmuDevice::set_launch_trace`]) and the clock's tick (ns);
    /// kernels write the table through its address while they run, so it is never moved or
    /// resized while on.
    trace: Option<(Box<[TraceSlot]>, u64)>,
}

/// The host-emulated device. See the module docs.
pub struct EmuDevice {
    dtype: Dtype,
    total: usize,
    state: Mutex<State>,
}

fn err(what: &'static str, msg: impl Into<String>) -> CudaWorkerError {
    CudaWorkerError::Device {
        what,
        msg: msg.into(),
    }
}

fn layout(bytes: usize) -> Result<Layout, CudaWorkerError> {
    Layout::from_size_align(bytes + CANARY_BYTES, ALIGN)
        .map_err(|e| err("alloc", format!("{bytes} bytes: {e}")))
}

impl EmuDevice {
    /// A device whose kernels are those of `dtype`, reporting `total_bytes` of memory to
    /// KV sizing (allocations count against it; exceeding it is an out-of-memory error).
    pub fn new(dtype: Dtype, total_bytes: usize) -> Self {
        EmuDevice {
            dtype,
            total: total_bytes,
            state: Mutex::new(State::default()),
        }
    }

    /// Kernel launches run so far (eager and replayed).
    pub fn launches(&self) -> u64 {
        self.lock().launches
    }

    /// Graphs captured so far.
    pub fn graphs(&self) -> usize {
        self.lock().graphs.len()
    }

    /// Graphs captured and not destroyed.
    pub fn live_graphs(&self) -> usize {
        self.lock().graphs.iter().flatten().count()
    }

    /// Launches of kernel `name` run so far (eager and replayed).
    pub fn launches_of(&self, name: &str) -> u64 {
        self.lock().launches_by_name.get(name).copied().unwrap_or(0)
    }

    /// Graph replays so far.
    pub fn graph_launches(&self) -> u64 {
        self.lock().graph_launches
    }

    /// Turns the launch trace ([`baton_cuda::trace`]) on or off: on, every later launch folds
    /// its blocks' waits and warps' exits into a table of [`TRACE_SLOTS`] slots (the
    /// emulator's kernels always have the trace compiled in; a GPU's need `BATON_TRACE=1`),
    /// which [`Device::mark_step_start`] empties and [`Device::take_launch_trace`] reads. Call
    /// it while the stream is idle.
    ///
    /// # Errors
    /// A failure of `baton_trace_tick` (kernels/trace.cu), run once to measure the clock.
    pub fn set_launch_trace(&self, on: bool) -> Result<(), CudaWorkerError> {
        let tick = if on {
            let mut out = [0u64; 2];
            let mut ptr = out.as_mut_ptr() as u64;
            let mut changes = 64i32;
            let args = [
                &mut ptr as *mut u64 as *mut c_void,
                &mut changes as *mut i32 as *mut c_void,
            ];
            // SAFETY: baton_trace_tick(u64* out, int changes): the two parameters in order;
            // `out` holds two u64 and outlives the call.
            unsafe { crate::launch(self.dtype, "baton_trace_tick", (1, 1, 1), (32, 1, 1), &args) }
                .map_err(|e| err("baton_trace_tick", e.to_string()))?;
            out[0]
        } else {
            0
        };
        self.lock().trace =
            on.then(|| (vec![TraceSlot::EMPTY; TRACE_SLOTS].into_boxed_slice(), tick));
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks every allocation's guard bytes.
    fn check_canaries(&self, st: &State, when: &'static str) -> Result<(), CudaWorkerError> {
        for (&ptr, &bytes) in &st.allocs {
            // SAFETY: each live allocation has `bytes + CANARY_BYTES` bytes at `ptr`.
            let guard = unsafe {
                std::slice::from_raw_parts((ptr as usize + bytes) as *const u8, CANARY_BYTES)
            };
            if let Some(i) = guard.iter().position(|&b| b != CANARY) {
                return Err(err(
                    when,
                    format!(
                        "a write past the end of the {bytes}-byte allocation at {ptr:#x} \
                         (guard byte {i} changed)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Runs or records a copy of `bytes` from `src` to `dst` (host addresses).
    fn copy(&self, dst: usize, src: usize, bytes: usize) -> Result<(), CudaWorkerError> {
        self.submit(Op::Copy { dst, src, bytes })
    }

    /// Runs or records `op`.
    fn submit(&self, op: Op) -> Result<(), CudaWorkerError> {
        {
            let mut st = self.lock();
            if let Some(c) = st.capture.as_mut() {
                c.push(op);
                return Ok(());
            }
            if let Some(q) = st.deferred.as_mut() {
                q.push_back(op);
                st.enqueued += 1;
                return Ok(());
            }
        }
        self.run(&op)
    }

    /// Switches deferred execution on or off (see the module docs); switching off first runs
    /// whatever is enqueued.
    ///
    /// # Errors
    /// A failure of the work run while switching off.
    pub fn set_deferred(&self, on: bool) -> Result<(), CudaWorkerError> {
        self.run_enqueued(u64::MAX)?;
        let mut st = self.lock();
        st.deferred = on.then(Default::default);
        Ok(())
    }

    /// Runs every later launch under `schedule` (default [`crate::Schedule::InOrder`]): the
    /// order of a block's threads at barriers and of the blocks, so a worker-level test can
    /// check that no kernel result depends on which block finishes last.
    pub fn set_schedule(&self, schedule: crate::Schedule) {
        self.lock().schedule = schedule;
    }

    /// In deferred mode, makes every fence wait run the whole queue instead of stopping at
    /// the fence: the device running ahead of the host, as a GPU does.
    pub fn set_run_ahead(&self, on: bool) {
        self.lock().run_ahead = on;
    }

    /// Whether queued (deferred, not yet run) work uses memory in `[at, at + bytes)`: a copy
    /// touching it, a launch with a parameter pointing into it, a GEMM matrix inside it.
    fn queued_work_uses(&self, at: usize, bytes: usize) -> bool {
        let inside = |p: u64| (at as u64..(at + bytes) as u64).contains(&p);
        let st = self.lock();
        st.deferred.iter().flatten().any(|op| match op {
            Op::Copy { dst, src, bytes: n } => {
                (*dst < at + bytes && at < dst + n) || (*src < at + bytes && at < src + n)
            }
            Op::Launch { vals, .. } => vals.iter().any(|&v| inside(v)),
            Op::Gemm(g) => [g.a, g.b, g.c].into_iter().any(inside),
            Op::ClearTrace => false,
        })
    }

    /// Runs deferred work in stream order until `upto` operations have run (all of it for
    /// `u64::MAX`). The first failure is returned, the rest of the queue dropped and the
    /// failure kept: every later call reports it, as a CUDA stream's sticky error.
    fn run_enqueued(&self, upto: u64) -> Result<(), CudaWorkerError> {
        if let Some(e) = self.lock().failed.clone() {
            return Err(err("stream", e));
        }
        loop {
            let op = {
                let mut st = self.lock();
                if st.executed >= upto {
                    return Ok(());
                }
                match st.deferred.as_mut().and_then(|q| q.pop_front()) {
                    Some(op) => {
                        st.executed += 1;
                        op
                    }
                    None => return Ok(()),
                }
            };
            if let Err(e) = self.run(&op) {
                let mut st = self.lock();
                if let Some(q) = st.deferred.as_mut() {
                    let dropped = q.len() as u64;
                    q.clear();
                    st.executed += dropped;
                }
                st.failed = Some(e.to_string());
                return Err(e);
            }
        }
    }

    fn run(&self, op: &Op) -> Result<(), CudaWorkerError> {
        let label = match op {
            Op::Launch { name, .. } => Some(name.clone()),
            Op::Gemm(g) => Some(g.what.to_owned()),
            Op::Copy { .. } | Op::ClearTrace => None,
        };
        let t = std::time::Instant::now();
        let r = self.run_untimed(op);
        if let Some(label) = label {
            if let Some(p) = self.lock().profile.as_mut() {
                p.push((label, t.elapsed().as_secs_f64() * 1e3));
            }
        }
        r
    }

    /// Records (or runs) a launch of `name` with the values `params` point at.
    ///
    /// # Safety
    /// Every parameter pointer addresses an 8-byte slot (`Device::launch`'s contract).
    unsafe fn submit_launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &[*mut c_void],
        cooperative: bool,
    ) -> Result<(), CudaWorkerError> {
        if !crate::has_entry(self.dtype, name) {
            return Err(err("kernel launch", format!("kernel {name} not loaded")));
        }
        // SAFETY: per the contract every parameter pointer addresses an 8-byte slot.
        let vals = params
            .iter()
            .map(|&p| unsafe { *(p as *const u64) })
            .collect();
        self.submit(Op::Launch {
            name: name.to_owned(),
            grid,
            block,
            vals,
            cooperative,
        })
    }

    fn run_untimed(&self, op: &Op) -> Result<(), CudaWorkerError> {
        match op {
            Op::Launch {
                name,
                grid,
                block,
                vals,
                cooperative,
            } => {
                let mut vals = vals.clone();
                let ptrs: Vec<*mut c_void> = vals
                    .iter_mut()
                    .map(|v| v as *mut u64 as *mut c_void)
                    .collect();
                {
                    let mut st = self.lock();
                    st.launches += 1;
                    *st.launches_by_name.entry(name.clone()).or_insert(0) += 1;
                }
                let (sched, trace) = {
                    let mut st = self.lock();
                    let trace = st.trace.as_mut().map_or(0, |(t, _)| t.as_mut_ptr() as u64);
                    (st.schedule, trace)
                };
                let block = (*block, 1, 1);
                // SAFETY: the values were copied from the caller's parameter slots (8 bytes
                // each) and the caller guaranteed they match the kernel and address live
                // memory (Device::launch's contract); `trace` is 0 or the boxed table of
                // TRACE_SLOTS slots, which stays in place while the trace is on.
                unsafe {
                    crate::launch_traced(
                        self.dtype,
                        name,
                        *grid,
                        block,
                        &ptrs,
                        sched,
                        *cooperative,
                        trace,
                    )
                }
                .map_err(|e| err("kernel launch", format!("{name}: {e}")))
            }
            Op::Gemm(g) => gemm(g),
            Op::Copy { dst, src, bytes } => {
                // SAFETY: the caller guaranteed both ranges hold `bytes` (the copy contracts).
                unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *bytes) };
                Ok(())
            }
            Op::ClearTrace => {
                if let Some((t, _)) = self.lock().trace.as_mut() {
                    t.fill(TraceSlot::EMPTY);
                }
                Ok(())
            }
        }
    }
}

/// Reads element `i` of a matrix of type `t` at `base` as f32.
///
/// # Safety
/// `base` holds more than `i` elements of `t`.
unsafe fn load(base: DevPtr, t: Dtype, i: usize) -> f32 {
    // SAFETY: per the contract.
    unsafe {
        match t {
            Dtype::F32 => *(base as *const f32).add(i),
            Dtype::Bf16 => half::bf16::from_bits(*(base as *const u16).add(i)).to_f32(),
            Dtype::F16 => half::f16::from_bits(*(base as *const u16).add(i)).to_f32(),
        }
    }
}

/// The [`Gemm`] contract by plain loops (fp32 accumulation in `l` order).
fn gemm(g: &Gemm) -> Result<(), CudaWorkerError> {
    let min_ld = |rows: usize| rows.max(1);
    let (a_rows, b_rows) = (
        if g.trans_a { g.k } else { g.m },
        if g.trans_b { g.n } else { g.k },
    );
    if g.lda < min_ld(a_rows) || g.ldb < min_ld(b_rows) || g.ldc < min_ld(g.m) {
        return Err(err(
            "gemm",
            format!("leading dimension too small for {g:?} (cuBLAS would return INVALID_VALUE)"),
        ));
    }
    for j in 0..g.n {
        for i in 0..g.m {
            let mut acc = 0f32;
            for l in 0..g.k {
                let ai = if g.trans_a {
                    l + i * g.lda
                } else {
                    i + l * g.lda
                };
                let bi = if g.trans_b {
                    j + l * g.ldb
                } else {
                    l + j * g.ldb
                };
                // SAFETY: Device::gemm's contract: the matrices lie in live allocations for
                // these shapes and leading dimensions.
                acc = unsafe { load(g.a, g.ab_type, ai) }
                    .mul_add(unsafe { load(g.b, g.ab_type, bi) }, acc);
            }
            let ci = i + j * g.ldc;
            // SAFETY: as above, for C.
            unsafe {
                match g.c_type {
                    Dtype::F32 => *(g.c as *mut f32).add(ci) = acc,
                    Dtype::Bf16 => *(g.c as *mut u16).add(ci) = half::bf16::from_f32(acc).to_bits(),
                    Dtype::F16 => *(g.c as *mut u16).add(ci) = half::f16::from_f32(acc).to_bits(),
                }
            }
        }
    }
    Ok(())
}

impl Device for EmuDevice {
    fn describe(&self) -> String {
        format!("host emulator ({:?})", self.dtype)
    }

    /// A small made-up count: launch planning then gives the emulated kernels several rows
    /// per block, the case the kernel tests also cover.
    fn multiprocessor_count(&self) -> usize {
        4
    }

    fn bind(&self) -> Result<(), CudaWorkerError> {
        Ok(())
    }

    fn mem_info(&self) -> Result<(usize, usize), CudaWorkerError> {
        let st = self.lock();
        Ok((self.total.saturating_sub(st.used), self.total))
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevPtr, CudaWorkerError> {
        let bytes = bytes.max(16);
        let mut st = self.lock();
        if st.capture.is_some() {
            return Err(err("alloc", "allocation during graph capture"));
        }
        if st.used + bytes > self.total {
            return Err(err(
                "alloc",
                format!(
                    "out of memory: {bytes} bytes requested, {} of {} free",
                    self.total - st.used,
                    self.total
                ),
            ));
        }
        let l = layout(bytes)?;
        // SAFETY: `l` has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(l) };
        if p.is_null() {
            return Err(err(
                "alloc",
                format!("host allocation of {bytes} bytes failed"),
            ));
        }
        // SAFETY: the allocation is `bytes + CANARY_BYTES` long.
        unsafe { std::ptr::write_bytes(p.add(bytes), CANARY, CANARY_BYTES) };
        st.used += bytes;
        st.allocs.insert(p as u64, bytes);
        Ok(p as u64)
    }

    unsafe fn free(&self, ptr: DevPtr) {
        let bytes = self.lock().allocs.get(&ptr).copied().unwrap_or(0);
        assert!(
            !self.queued_work_uses(ptr as usize, bytes),
            "the {bytes}-byte allocation at {ptr:#x} freed while queued work still uses it"
        );
        let mut st = self.lock();
        if let Err(e) = self.check_canaries(&st, "free") {
            // A free has no error path: fail loudly in tests rather than hide corruption.
            panic!("{e}");
        }
        if let Some(bytes) = st.allocs.remove(&ptr) {
            st.used -= bytes;
            if let Ok(l) = layout(bytes) {
                // SAFETY: allocated by `alloc_zeroed` with this layout, freed once.
                unsafe { std::alloc::dealloc(ptr as *mut u8, l) };
            }
        }
    }

    fn alloc_host(&self, bytes: usize) -> Result<*mut u8, CudaWorkerError> {
        let bytes = bytes.max(16);
        let l =
            Layout::from_size_align(bytes, ALIGN).map_err(|e| err("alloc_host", e.to_string()))?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(l) };
        if p.is_null() {
            return Err(err("alloc_host", format!("{bytes} bytes")));
        }
        self.lock().host.insert(p as usize, bytes);
        Ok(p)
    }

    unsafe fn free_host(&self, ptr: *mut u8) {
        let bytes = self.lock().host.get(&(ptr as usize)).copied().unwrap_or(0);
        assert!(
            !self.queued_work_uses(ptr as usize, bytes),
            "the {bytes}-byte host buffer at {ptr:?} freed while queued work still uses it"
        );
        if let Some(bytes) = self.lock().host.remove(&(ptr as usize)) {
            if let Ok(l) = Layout::from_size_align(bytes, ALIGN) {
                // SAFETY: allocated by `alloc_host` with this layout, freed once.
                unsafe { std::alloc::dealloc(ptr, l) };
            }
        }
    }

    unsafe fn copy_htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), CudaWorkerError> {
        self.run_enqueued(u64::MAX)?;
        // SAFETY: Device::copy_htod's contract.
        unsafe { std::ptr::copy(src.as_ptr(), dst as *mut u8, src.len()) };
        self.check_canaries(&self.lock(), "copy_htod")
    }

    unsafe fn copy_dtoh(&self, dst: &mut [u8], src: DevPtr) -> Result<(), CudaWorkerError> {
        self.run_enqueued(u64::MAX)?;
        // SAFETY: Device::copy_dtoh's contract.
        unsafe { std::ptr::copy(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn copy_htod_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), CudaWorkerError> {
        self.copy(dst as usize, src as usize, bytes)
    }

    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), CudaWorkerError> {
        self.copy(dst as usize, src as usize, bytes)
    }

    unsafe fn copy_dtod_async(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), CudaWorkerError> {
        self.copy(dst as usize, src as usize, bytes)
    }

    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaWorkerError> {
        // SAFETY: per this device's contract, as submit_launch's.
        unsafe { self.submit_launch(name, grid, block, params, false) }
    }

    /// The emulator does not model occupancy: every kernel gets [`EMU_RESIDENT_BLOCKS`] blocks
    /// per (emulated) SM, so a cooperative grid has at most 16 blocks (each thread a fiber).
    fn max_resident_blocks(&self, name: &str, _block: u32) -> Result<usize, CudaWorkerError> {
        if !crate::has_entry(self.dtype, name) {
            return Err(err("occupancy", format!("kernel {name} not loaded")));
        }
        Ok(EMU_RESIDENT_BLOCKS)
    }

    unsafe fn launch_cooperative(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaWorkerError> {
        let blocks = u64::from(grid.0) * u64::from(grid.1) * u64::from(grid.2);
        let most = (EMU_RESIDENT_BLOCKS * self.multiprocessor_count()) as u64;
        if blocks > most {
            return Err(err(
                "cooperative launch",
                format!("{name}: {blocks} blocks, but at most {most} are resident at once"),
            ));
        }
        // SAFETY: per this device's contract, as submit_launch's.
        unsafe { self.submit_launch(name, grid, block, params, true) }
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), CudaWorkerError> {
        self.submit(Op::Gemm(*g))
    }

    fn synchronize(&self) -> Result<(), CudaWorkerError> {
        self.run_enqueued(u64::MAX)?;
        self.check_canaries(&self.lock(), "synchronize")
    }

    /// Eager: work runs at enqueue, so the fence has passed when it is recorded; with step
    /// timing on it closes the step's wall-clock interval. Deferred: notes the stream
    /// position the fence's wait runs up to.
    fn record_fence(&self, frame: usize) -> Result<(), CudaWorkerError> {
        let mut st = self.lock();
        let at = st.enqueued;
        *st.fences
            .get_mut(frame)
            .ok_or_else(|| err("record_fence", format!("no fence frame {frame}")))? = at;
        if let Some((Some(t0), ms)) = st.step_timing.as_mut() {
            *ms = Some(t0.elapsed().as_secs_f64() * 1e3);
        }
        Ok(())
    }

    /// Deferred: the work before the fence runs now (the emulated device is never behind a
    /// query), so the fence has passed.
    fn fence_passed(&self, frame: usize) -> Result<bool, CudaWorkerError> {
        self.wait_fence(frame).map(|()| true)
    }

    fn wait_fence(&self, frame: usize) -> Result<(), CudaWorkerError> {
        let (at, ahead) = {
            let st = self.lock();
            let at = *st
                .fences
                .get(frame)
                .ok_or_else(|| err("wait_fence", format!("no fence frame {frame}")))?;
            (at, st.run_ahead)
        };
        self.run_enqueued(if ahead { u64::MAX } else { at })?;
        self.check_canaries(&self.lock(), "fence")
    }

    fn begin_capture(&self) -> Result<(), CudaWorkerError> {
        self.run_enqueued(u64::MAX)?;
        let mut st = self.lock();
        if st.capture.is_some() {
            return Err(err("begin_capture", "already capturing"));
        }
        st.capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<GraphId, CudaWorkerError> {
        let mut st = self.lock();
        let ops = st
            .capture
            .take()
            .ok_or_else(|| err("end_capture", "not capturing"))?;
        st.graphs.push(Some(ops));
        Ok(st.graphs.len() - 1)
    }

    fn destroy_graph(&self, graph: GraphId) -> Result<(), CudaWorkerError> {
        self.lock()
            .graphs
            .get_mut(graph)
            .and_then(Option::take)
            .map(|_| ())
            .ok_or_else(|| err("destroy_graph", format!("no graph {graph}")))
    }

    unsafe fn launch_graph(&self, graph: GraphId) -> Result<(), CudaWorkerError> {
        let ops = {
            let mut st = self.lock();
            if st.capture.is_some() {
                return Err(err("launch_graph", "graph launch during capture"));
            }
            st.graph_launches += 1;
            let ops = st
                .graphs
                .get(graph)
                .cloned()
                .flatten()
                .ok_or_else(|| err("launch_graph", format!("no graph {graph}")))?;
            if let Some(q) = st.deferred.as_mut() {
                let n = ops.len() as u64;
                q.extend(ops);
                st.enqueued += n;
                return Ok(());
            }
            ops
        };
        for op in &ops {
            self.run(op)?;
        }
        Ok(())
    }

    fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64, CudaWorkerError> {
        let a = vec![1u8; bytes];
        let mut b = vec![0u8; bytes];
        let mut best = 0f64;
        for _ in 0..iters.max(1) {
            let t = std::time::Instant::now();
            b.copy_from_slice(&a);
            let s = t.elapsed().as_secs_f64();
            if s > 0.0 {
                best = best.max(2.0 * bytes as f64 / s);
            }
        }
        std::hint::black_box(&b);
        Ok(best)
    }

    fn set_profiling(&self, on: bool) {
        self.lock().profile = on.then(Vec::new);
    }

    fn set_step_timing(&self, on: bool) -> Result<(), CudaWorkerError> {
        self.lock().step_timing = on.then_some((None, None));
        Ok(())
    }

    fn mark_step_start(&self) -> Result<(), CudaWorkerError> {
        let tracing = {
            let mut st = self.lock();
            if let Some((t0, _)) = st.step_timing.as_mut() {
                *t0 = Some(std::time::Instant::now());
            }
            st.trace.is_some()
        };
        if tracing {
            self.submit(Op::ClearTrace)?;
        }
        Ok(())
    }

    fn take_launch_trace(&self) -> Result<Option<StepTrace>, CudaWorkerError> {
        self.run_enqueued(u64::MAX)?;
        Ok(self
            .lock()
            .trace
            .as_ref()
            .map(|(t, tick)| StepTrace::from_table(t, *tick)))
    }

    fn step_device_ms(&self) -> Option<f64> {
        self.lock().step_timing.and_then(|(_, ms)| ms)
    }

    fn take_profile(&self) -> Result<Vec<(String, f64)>, CudaWorkerError> {
        Ok(self
            .lock()
            .profile
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default())
    }
}

impl Drop for EmuDevice {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for (&ptr, &bytes) in &st.allocs {
            if let Ok(l) = layout(bytes) {
                // SAFETY: still-live allocations made by `alloc_zeroed`, freed once here.
                unsafe { std::alloc::dealloc(ptr as *mut u8, l) };
            }
        }
        for (&ptr, &bytes) in &st.host {
            if let Ok(l) = Layout::from_size_align(bytes, ALIGN) {
                // SAFETY: as above, for `alloc_host`.
                unsafe { std::alloc::dealloc(ptr as *mut u8, l) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn gemm_follows_the_cublas_column_major_contract() {
        // Row-major out[t, n] = x[t, k] · W[n, k]ᵀ as the executor issues it.
        let (t, n, k) = (3usize, 4usize, 5usize);
        let x: Vec<f32> = (0..t * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.25).sin()).collect();
        let d = EmuDevice::new(Dtype::F32, 1 << 20);
        let (px, pw, po) = (
            d.alloc_zeroed(4 * t * k).unwrap(),
            d.alloc_zeroed(4 * n * k).unwrap(),
            d.alloc_zeroed(4 * t * n).unwrap(),
        );
        // SAFETY: sizes as allocated.
        unsafe {
            d.copy_htod(px, &to_bytes(&x)).unwrap();
            d.copy_htod(pw, &to_bytes(&w)).unwrap();
            d.gemm(&Gemm {
                what: "test",
                trans_a: true,
                trans_b: false,
                m: n,
                n: t,
                k,
                a: pw,
                lda: k,
                b: px,
                ldb: k,
                ab_type: Dtype::F32,
                c: po,
                ldc: n,
                c_type: Dtype::F32,
            })
            .unwrap();
        }
        let mut out = vec![0u8; 4 * t * n];
        // SAFETY: as allocated.
        unsafe { d.copy_dtoh(&mut out, po).unwrap() };
        let out: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for r in 0..t {
            for c in 0..n {
                let want: f32 = (0..k).map(|l| x[r * k + l] * w[c * k + l]).sum();
                assert!((out[r * n + c] - want).abs() < 1e-4, "({r},{c})");
            }
        }
    }

    #[test]
    fn a_write_past_the_end_is_reported() {
        let d = EmuDevice::new(Dtype::F32, 1 << 20);
        let p = d.alloc_zeroed(64).unwrap();
        d.synchronize().unwrap();
        // SAFETY: the allocation has 64 + CANARY_BYTES bytes; this writes a guard byte on
        // purpose.
        unsafe { *((p + 64) as *mut u8) = 0 };
        let e = d.synchronize().unwrap_err().to_string();
        assert!(e.contains("past the end"), "{e}");
        // Restore the guard so the drop-time free does not panic.
        // SAFETY: as above.
        unsafe { *((p + 64) as *mut u8) = CANARY };
    }

    #[test]
    fn capture_records_and_replay_rereads_host_sources() {
        let d = EmuDevice::new(Dtype::F32, 1 << 20);
        let host = d.alloc_host(16).unwrap();
        let dst = d.alloc_zeroed(16).unwrap();
        d.begin_capture().unwrap();
        // SAFETY: both hold 16 bytes.
        unsafe { d.copy_htod_async(dst, host, 16).unwrap() };
        let g = d.end_capture().unwrap();
        let mut out = [0u8; 16];
        // SAFETY: as allocated.
        unsafe { d.copy_dtoh(&mut out, dst).unwrap() };
        assert_eq!(out, [0; 16], "nothing runs during capture");
        // SAFETY: `host` holds 16 bytes.
        unsafe { std::ptr::write_bytes(host, 7, 16) };
        // SAFETY: the captured buffers are live.
        unsafe { d.launch_graph(g).unwrap() };
        // SAFETY: as allocated.
        unsafe { d.copy_dtoh(&mut out, dst).unwrap() };
        assert_eq!(
            out, [7; 16],
            "the replay read the host buffer's current bytes"
        );
        assert!(d.alloc_zeroed(16).is_ok());
        d.begin_capture().unwrap();
        assert!(d.alloc_zeroed(16).is_err(), "no allocation while capturing");
        d.end_capture().unwrap();
    }

    #[test]
    fn a_deferred_stream_runs_at_its_fences_and_reads_host_sources_then() {
        let d = EmuDevice::new(Dtype::F32, 1 << 20);
        let (a, b) = (d.alloc_host(16).unwrap(), d.alloc_host(16).unwrap());
        let (back_a, back_b) = (d.alloc_host(16).unwrap(), d.alloc_host(16).unwrap());
        let (da, db) = (d.alloc_zeroed(16).unwrap(), d.alloc_zeroed(16).unwrap());
        d.set_deferred(true).unwrap();
        // SAFETY: every buffer holds 16 bytes and lives until the device is dropped.
        unsafe {
            std::ptr::write_bytes(a, 1, 16);
            d.copy_htod_async(da, a, 16).unwrap();
            d.copy_dtoh_async(back_a, da, 16).unwrap();
            d.record_fence(1).unwrap();
            std::ptr::write_bytes(b, 2, 16);
            d.copy_htod_async(db, b, 16).unwrap();
            d.copy_dtoh_async(back_b, db, 16).unwrap();
            d.record_fence(0).unwrap();
            // The host rewrites the first launch's source before its fence: the copy, which
            // has not run yet, reads the new bytes (the bug this mode exists to expose).
            std::ptr::write_bytes(a, 3, 16);
            assert_eq!(*back_a, 0, "nothing runs before a wait");
            d.wait_fence(1).unwrap();
            assert_eq!(
                *back_a, 3,
                "the copy ran at the wait, from the rewritten source"
            );
            assert_eq!(
                *back_b, 0,
                "fence 1's wait ran only the work recorded before it"
            );
            d.wait_fence(0).unwrap();
            assert_eq!(*back_b, 2);
        }
        assert!(d.wait_fence(2).is_err(), "only FENCE_FRAMES fences");
        // Run ahead: a wait runs everything queued, past its own fence.
        d.set_run_ahead(true);
        // SAFETY: as above.
        unsafe {
            d.copy_dtoh_async(back_a, db, 16).unwrap();
            d.record_fence(1).unwrap();
            std::ptr::write_bytes(b, 5, 16);
            d.copy_htod_async(db, b, 16).unwrap();
            d.copy_dtoh_async(back_b, db, 16).unwrap();
            d.record_fence(0).unwrap();
            d.wait_fence(1).unwrap();
            assert_eq!(
                (*back_a, *back_b),
                (2, 5),
                "the wait ran fence 0's work too"
            );
        }
        // Freeing what queued work still uses panics instead of waiting.
        // SAFETY: as above.
        unsafe { d.copy_htod_async(da, a, 16).unwrap() };
        let freed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `da` is live; the free panics before releasing it.
            unsafe { d.free(da) }
        }));
        assert!(freed.is_err(), "a buffer in use by queued work was freed");
        d.synchronize().unwrap();
        // A failure of deferred work is sticky.
        let bad = Gemm {
            what: "bad",
            trans_a: false,
            trans_b: false,
            m: 4,
            n: 1,
            k: 1,
            a: da,
            lda: 1,
            b: da,
            ldb: 1,
            ab_type: Dtype::F32,
            c: db,
            ldc: 4,
            c_type: Dtype::F32,
        };
        // SAFETY: the operands lie in live 16-byte buffers; the GEMM fails on its `lda`.
        unsafe { d.gemm(&bad).unwrap() };
        assert!(d.synchronize().is_err(), "the bad GEMM ran at the sync");
        assert!(d.wait_fence(0).is_err(), "the failure is sticky");
    }

    #[test]
    fn allocations_count_against_the_reported_memory() {
        let d = EmuDevice::new(Dtype::F32, 4096);
        let (free0, total) = d.mem_info().unwrap();
        assert_eq!((free0, total), (4096, 4096));
        let p = d.alloc_zeroed(1000).unwrap();
        assert_eq!(d.mem_info().unwrap().0, 3096);
        assert!(d.alloc_zeroed(4000).is_err());
        // SAFETY: allocated above, unused.
        unsafe { d.free(p) };
        assert_eq!(d.mem_info().unwrap().0, 4096);
    }
}
