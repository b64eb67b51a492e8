//! A CPU emulator for Baton's CUDA C kernels (`kernels/*.cu`): runs the exact kernel source on
//! the host, so kernel logic, launch geometry and host-side argument lists can be tested on a
//! machine without a GPU (`cargo test -p baton-cuda-emu`).
//!
//! # How it works
//!
//! `build.rs` compiles every kernel file as C++17 (g++, -O2 in every profile) once per
//! [`Dtype`], each copy in its own namespace (`baton_emu_d0` bf16, `_d1` f16, `_d2` f32), after
//! a prelude (`csrc/prelude.h`) that supplies the CUDA surface the kernels use: `__global__` and
//! friends, `threadIdx`/`blockIdx`/`blockDim`/`gridDim`, `uint2`/`uint4`, `__syncthreads`,
//! `__shfl_xor_sync`, `atomicAdd`, `__umulhi` and bit casts, `__nv_bfloat16`/`__half` with
//! round-to-nearest-even conversions, and the libm float functions. Under `BATON_EMU`,
//! `kernels/common.cuh` includes no CUDA header and `BATON_ENTRY` gives entry points C++
//! linkage. Entry points are found by scanning the preprocessed sources, so a new kernel is
//! registered without touching this crate. A generated registry maps (dtype, entry name) to an
//! invoker that reads parameter `i` from `args[i]` exactly as `cuLaunchKernel` reads
//! `kernelParams`, so a launch here takes the argument array a GPU launch takes ([`Params`]
//! builds one the way the executor's `KArgs` does). Linux only (ELF sections, `objcopy`); the
//! fiber switch is x86-64 assembly, with a `swapcontext` fallback elsewhere (or with
//! `BATON_EMU_UCONTEXT=1` at build time).
//!
//! ```
//! use baton_cuda_emu::{launch, Dtype, Params};
//! let (t, h) = (2usize, 64usize);
//! let (x, w) = (vec![1.0f32; t * h], vec![1.0f32; h]);
//! let mut out = vec![0.0f32; t * h];
//! let mut p = Params::new();
//! // rmsnorm(out, in, weight, num_tokens, hidden, eps)
//! p.ptr_mut(out.as_mut_ptr()).ptr(x.as_ptr()).ptr(w.as_ptr()).int(t as i32).int(h as i32).float(1e-5);
//! let args = p.as_args();
//! // SAFETY: the argument list matches baton_rmsnorm's C signature; the buffers hold t * h floats.
//! unsafe { launch(Dtype::F32, "baton_rmsnorm", (t as u32, 1, 1), (256, 1, 1), &args) }.unwrap();
//! assert!(out.iter().all(|&y| (y - 1.0).abs() < 1e-5));
//! ```
//!
//! # Execution model
//!
//! - **Threads are fibers.** A block runs all `block.x * block.y * block.z` threads
//!   cooperatively on the calling OS thread, each on its own stack (128 KiB, guard page below,
//!   reused across blocks). A fiber runs until it finishes or reaches a barrier, then hands over
//!   to the next ready fiber; nothing is preempted. Blocks run one after another in `blockIdx`
//!   order (x fastest, then y, then z). The [`Schedule`] says in which order the threads a
//!   barrier releases are resumed (thread order, reverse, a seeded shuffle, or ahead of all
//!   other threads); a race-free kernel gives bit-identical results under all of them, so
//!   running a kernel under each is a cheap race check.
//! - **`__syncthreads()`** waits until every thread of the block that has not finished has
//!   arrived (exited threads do not count, as on the hardware). All threads must wait at the
//!   same textual barrier (file and line): two halves of a block syncing at different
//!   `__syncthreads()` calls is reported as [`EmuError::Divergence`].
//! - **`__shfl_xor_sync(mask, v, laneMask)`**: each lane writes its value into a per-warp buffer,
//!   waits at a warp barrier (a warp is 32 consecutive linear thread ids), then reads lane
//!   `lane ^ laneMask`'s value (the buffer is double-buffered, which makes the second warp
//!   barrier unnecessary). Only the full mask, width 32 and laneMask in `[0, 32)` are modelled;
//!   every lane of the warp must exist, be alive and call the same shuffle (same line, laneMask
//!   and value size), else [`EmuError::Divergence`].
//! - **Deadlock**: when no fiber can run but some are unfinished (for example some lanes of a
//!   warp wait at a shuffle and the others at `__syncthreads`), the launch fails with
//!   [`EmuError::Deadlock`] naming where each group of threads waits, instead of hanging.
//! - **Shared memory**: `__shared__` is `static`. Blocks run one at a time and launches are
//!   serialized by a global mutex, so a function-local static is exactly one block's shared
//!   memory. It is filled with `0xff` bytes (NaN floats, all-ones integers) before every block,
//!   so reading shared memory before writing it shows up as NaNs or wild values.
//! - **Device memory** is host memory: a device pointer argument is a plain host address.
//! - **The launch trace** (`kernels/common.cuh`, `baton_cuda::trace`) is always compiled in:
//!   `%globaltimer` is the host's monotonic clock, `%gridid` a counter of launches, and the
//!   table is the one [`EmuDevice::set_launch_trace`] allocates (none: off). Launches run one
//!   after another, so the times order launches but say nothing about a GPU's overlap.
//!
//! # What it does not model
//!
//! - **Memory races between threads** are not detected as such. Fibers switch only at
//!   barriers, so a missing `__syncthreads` between one thread's shared-memory write and another
//!   thread's read shows only when the reader happens to run first (then it reads poison or a
//!   stale value): run under every schedule of [`Schedule::ALL`] to make that likely. Atomics
//!   are plain read-modify-writes (never contended).
//! - **Warp-synchronous code without shuffles** (lanes relying on lockstep execution, or
//!   `__syncwarp`): not emulated.
//! - **Timing, occupancy, `__launch_bounds__`, register or shared-memory limits.**
//! - **GPU floating point**: host `expf`/`exp2f`/`logf`/`sincosf` are glibc's (nearly correctly
//!   rounded), not the GPU's (up to 2 ulp); the GPU compiler contracts `a * b + c` into FMAs
//!   while the host build does not (`-ffp-contract=off`), so f32 results can differ from a GPU's
//!   in the last bits. Reduction order across threads is the kernel's own, as on the GPU.
//! - **Out-of-bounds accesses** are not checked: they read or corrupt host memory (or crash the
//!   test process), as they would corrupt device memory. A spin loop waiting for another
//!   thread without a barrier hangs.
//!
//! The emulator also carries a few test kernels of its own (`emu_test_*`, from
//! `csrc/selftest.cu`) in every dtype module.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, OnceLock};

pub use baton_cuda::kernels::Dtype;

pub mod device;
pub use device::EmuDevice;

/// Opaque `baton_emu::Entry` (runtime.h): one entry point of one dtype module.
#[repr(C)]
struct RawEntry {
    _opaque: [u8; 0],
}

extern "C" {
    fn baton_emu_entry_at(dtype: c_int, i: usize) -> *const RawEntry;
    fn baton_emu_entry_name(e: *const RawEntry) -> *const c_char;
    fn baton_emu_entry_params(e: *const RawEntry) -> c_uint;
    fn baton_emu_set_trace(table: u64, grid: u64);
    fn baton_emu_run(
        entry: *const RawEntry,
        grid: *const c_uint,
        block: *const c_uint,
        args: *mut *mut c_void,
        schedule: c_int,
        seed: u64,
        cooperative: c_int,
        err: *mut c_char,
        cap: usize,
        bad_block: *mut c_uint,
    ) -> c_int;
}

/// Errors of [`launch`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EmuError {
    /// No entry point `name` in the `dtype` module (see [`entry_points`]).
    #[error("no kernel {name} in the {} module", dtype.name())]
    UnknownKernel {
        /// The module asked for.
        dtype: Dtype,
        /// The entry name asked for.
        name: String,
    },
    /// The argument array's length differs from the kernel's parameter count.
    #[error("kernel {name} takes {expected} parameters but {got} were passed")]
    ArgCount {
        /// The kernel.
        name: String,
        /// Parameters of its C signature.
        expected: usize,
        /// Length of the `args` array passed.
        got: usize,
    },
    /// A block size CUDA would refuse: a dimension of 0, x or y over 1024, z over 64, or more
    /// than 1024 threads in all.
    #[error("kernel {name}: invalid block size {block:?}")]
    InvalidBlock {
        /// The kernel.
        name: String,
        /// The block size passed.
        block: (u32, u32, u32),
    },
    /// A grid CUDA would refuse: a dimension of 0, x over 2^31 - 1, y or z over 65535.
    #[error("kernel {name}: invalid grid {grid:?}")]
    InvalidGrid {
        /// The kernel.
        name: String,
        /// The grid passed.
        grid: (u32, u32, u32),
    },
    /// No thread of a block could make progress while some were unfinished.
    #[error("kernel {name}, block {block_idx:?}: {detail}")]
    Deadlock {
        /// The kernel.
        name: String,
        /// `blockIdx` of the block that deadlocked (later blocks did not run).
        block_idx: (u32, u32, u32),
        /// Which barriers the unfinished threads wait at (file:line and thread counts).
        detail: String,
    },
    /// Threads reached a barrier inconsistently: different `__syncthreads` calls, a shuffle
    /// with missing or exited partner lanes, lanes disagreeing on the shuffle, or a shuffle
    /// form the emulator does not model (partial mask, width < 32).
    #[error("kernel {name}, block {block_idx:?}: {detail}")]
    Divergence {
        /// The kernel.
        name: String,
        /// `blockIdx` of the failing block (later blocks did not run).
        block_idx: (u32, u32, u32),
        /// What disagreed, with file:line.
        detail: String,
    },
    /// The emulator itself failed (stacks could not be mapped, overlapping launches).
    #[error("kernel {name}: emulator failure: {detail}")]
    Runtime {
        /// The kernel.
        name: String,
        /// What failed.
        detail: String,
    },
}

#[derive(Clone, Copy)]
struct Kernel {
    entry: *const RawEntry,
    params: usize,
}

// SAFETY: `entry` points at a `static const` table entry of the native library: immutable data
// that lives for the whole program, so sharing the pointer between threads is sound.
unsafe impl Send for Kernel {}
// SAFETY: as for Send; the pointee is never mutated.
unsafe impl Sync for Kernel {}

type Registry = HashMap<(Dtype, &'static str), Kernel>;
/// Entries per dtype, in registry order (file, then source order).
type Names = HashMap<Dtype, Vec<&'static str>>;

fn registry() -> &'static (Registry, Names) {
    static REG: OnceLock<(Registry, Names)> = OnceLock::new();
    REG.get_or_init(|| {
        let mut map = Registry::new();
        let mut names = Names::new();
        for dtype in Dtype::ALL {
            let list = names.entry(dtype).or_default();
            for i in 0.. {
                // SAFETY: baton_emu_entry_at only reads the generated static tables and returns
                // null past the end.
                let entry = unsafe { baton_emu_entry_at(dtype.macro_value() as c_int, i) };
                if entry.is_null() {
                    break;
                }
                // SAFETY: `entry` is a valid entry (non-null from baton_emu_entry_at); its name
                // is a NUL-terminated string literal with static storage duration.
                let (name, params) = unsafe {
                    (
                        CStr::from_ptr(baton_emu_entry_name(entry)),
                        baton_emu_entry_params(entry) as usize,
                    )
                };
                let name = name.to_str().expect("entry names are ASCII identifiers");
                map.insert((dtype, name), Kernel { entry, params });
                list.push(name);
            }
        }
        (map, names)
    })
}

/// Serializes launches: shared memory is per-function statics and the scheduler state is
/// global, so only one launch may run at a time in the process.
static LAUNCH_LOCK: Mutex<()> = Mutex::new(());

/// True when the `dtype` module has an entry point `name` (for example
/// `"baton_rmsnorm"`).
pub fn has_entry(dtype: Dtype, name: &str) -> bool {
    registry().0.contains_key(&(dtype, name))
}

/// Parameter count of entry point `name` of the `dtype` module (the length its `args` array
/// must have), or `None` when there is no such entry.
pub fn param_count(dtype: Dtype, name: &str) -> Option<usize> {
    registry().0.get(&(dtype, name)).map(|k| k.params)
}

/// Every entry point of the `dtype` module: the kernels of `kernels/*.cu` (file order, then
/// source order) followed by the emulator's own `emu_test_*` kernels.
pub fn entry_points(dtype: Dtype) -> Vec<&'static str> {
    registry().1.get(&dtype).cloned().unwrap_or_default()
}

/// Order in which the emulator resumes the threads of a block that a barrier releases, and
/// starts them, and the order of the blocks: [`Schedule::Reverse`] also runs the blocks in
/// descending linear order and [`Schedule::Shuffled`] in a seeded shuffled order, so a kernel
/// whose last-finishing block combines the others' partials is checked with different blocks
/// last. A kernel without races computes bit-identical results under every schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Ascending linear thread id (the default).
    #[default]
    InOrder,
    /// Descending linear thread id.
    Reverse,
    /// A pseudo-random permutation per barrier, from this seed and the block index
    /// (reproducible).
    Shuffled(u64),
    /// Threads a barrier releases run before every other ready thread (in thread order): a
    /// warp leaving a shuffle runs ahead until it waits at `__syncthreads`, while the other
    /// warps lag at their previous step. Catches a warp overwriting shared memory that another
    /// warp has not read yet.
    RunAhead,
}

impl Schedule {
    /// One of each kind (the shuffle with a fixed seed), for tests.
    pub const ALL: [Schedule; 4] = [
        Schedule::InOrder,
        Schedule::Reverse,
        Schedule::Shuffled(0x5EED),
        Schedule::RunAhead,
    ];
}

/// [`launch_with`] under [`Schedule::InOrder`].
///
/// # Safety
///
/// As for [`launch_with`].
pub unsafe fn launch(
    dtype: Dtype,
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &[*mut c_void],
) -> Result<(), EmuError> {
    // SAFETY: the caller upholds launch_with's contract (same arguments).
    unsafe { launch_with(dtype, name, grid, block, args, Schedule::InOrder) }
}

/// Runs kernel `name` of the `dtype` module on the host, as
/// `cuLaunchKernel(f, grid, block, 0 shared bytes, stream, args, NULL)` followed by a stream
/// synchronize would: when it returns, every block has run. `schedule` orders the threads
/// within each block and the blocks (see [`Schedule`]).
///
/// `grid` and `block` are (x, y, z) in blocks and threads. `args` is the `kernelParams` array:
/// one pointer per kernel parameter, pointing at the parameter's value (an `int` is read as the
/// 4 bytes at that address, a pointer or `u64` as 8 bytes); device pointers are host addresses.
///
/// Errors: [`EmuError::UnknownKernel`], [`EmuError::ArgCount`] when `args.len()` is not the
/// kernel's parameter count, [`EmuError::InvalidBlock`] / [`EmuError::InvalidGrid`] for sizes
/// CUDA refuses, [`EmuError::Deadlock`] / [`EmuError::Divergence`] when a block's threads do
/// not meet at barriers consistently (that block and the later ones do not finish; memory may
/// be partly written), [`EmuError::Runtime`] when the emulator cannot map fiber stacks.
///
/// # Safety
///
/// As for a real launch, and checked by nothing: `args[i]` must point at a live, readable
/// value of the type of parameter `i` of the kernel's C signature (at least that many bytes);
/// every pointer the kernel dereferences for this grid must address live host memory of the
/// right size and alignment that the kernel may read or write, not aliased by Rust references
/// during the call (except where the kernel's contract allows aliasing). A kernel that reads
/// or writes out of bounds corrupts the process's memory.
pub unsafe fn launch_with(
    dtype: Dtype,
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &[*mut c_void],
    schedule: Schedule,
) -> Result<(), EmuError> {
    // SAFETY: the caller upholds this function's contract, which is launch_traced's with no
    // table.
    unsafe { launch_traced(dtype, name, grid, block, args, schedule, false, 0) }
}

/// [`launch_with`] as a cooperative launch (`cuLaunchKernelEx` with
/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`): every block of the grid is resident at once, so the
/// kernel may wait at grid barriers (`BATON_GRID_SYNC` in `kernels/common.cuh`). The emulator
/// keeps every block's threads alive (one fiber stack each: keep such grids to a few thousand
/// threads) and runs the blocks in rounds: each unfinished block runs, in the schedule's block
/// order, until it finishes or all its live threads wait at the grid barrier; parked blocks'
/// shared memory is saved and restored around the others' turns; once every block is parked
/// the next round releases them. A block that finishes while others wait at a barrier is
/// [`EmuError::Deadlock`] (on a GPU the barrier would wait for it forever), as is a grid
/// barrier that some of a block's threads reach while others wait at `__syncthreads`. A grid
/// barrier in a launch made through [`launch_with`] is [`EmuError::Divergence`].
///
/// # Safety
///
/// As for [`launch_with`].
pub unsafe fn launch_cooperative(
    dtype: Dtype,
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &[*mut c_void],
    schedule: Schedule,
) -> Result<(), EmuError> {
    // SAFETY: the caller upholds this function's contract, which is launch_traced's with no
    // table.
    unsafe { launch_traced(dtype, name, grid, block, args, schedule, true, 0) }
}

/// Launches counted for the launch trace's `%gridid` (every launch takes the next number).
static GRID_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// [`launch_with`] (or, `cooperative`, [`launch_cooperative`]) with the launch trace's table
/// `trace`: each block's wait and each warp's exit are folded into its slot for this launch
/// (kernels/common.cuh; `baton_cuda::trace`); 0: no trace.
///
/// # Safety
/// As for [`launch_with`], and `trace` addresses a table of `baton_cuda::trace::TRACE_SLOTS`
/// writable slots, or is 0.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_traced(
    dtype: Dtype,
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &[*mut c_void],
    schedule: Schedule,
    cooperative: bool,
    trace: u64,
) -> Result<(), EmuError> {
    let kernel = *registry()
        .0
        .get(&(dtype, name))
        .ok_or_else(|| EmuError::UnknownKernel {
            dtype,
            name: name.to_owned(),
        })?;
    if args.len() != kernel.params {
        return Err(EmuError::ArgCount {
            name: name.to_owned(),
            expected: kernel.params,
            got: args.len(),
        });
    }
    let (bx, by, bz) = block;
    let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
    if threads == 0 || threads > 1024 || bx > 1024 || by > 1024 || bz > 64 {
        return Err(EmuError::InvalidBlock {
            name: name.to_owned(),
            block,
        });
    }
    if grid.0 == 0
        || grid.1 == 0
        || grid.2 == 0
        || grid.0 > i32::MAX as u32
        || grid.1 > 65535
        || grid.2 > 65535
    {
        return Err(EmuError::InvalidGrid {
            name: name.to_owned(),
            grid,
        });
    }
    let grid_a = [grid.0, grid.1, grid.2];
    let block_a = [bx, by, bz];
    let mut ptrs = args.to_vec();
    let (sched, seed) = match schedule {
        Schedule::InOrder => (0, 0),
        Schedule::Reverse => (1, 0),
        Schedule::Shuffled(seed) => (2, seed),
        Schedule::RunAhead => (3, 0),
    };
    let mut err = [0 as c_char; 1024];
    let mut bad = [0 as c_uint; 3];
    let code = {
        let _guard = LAUNCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let grid_id = GRID_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: plain stores of two runtime globals, under the lock that serializes launches.
        unsafe { baton_emu_set_trace(trace, grid_id) };
        // SAFETY: `kernel.entry` comes from the registry; grid, block and the argument count
        // were validated above; the caller guarantees (see # Safety) that every argument and
        // every address the kernel touches is valid. The lock makes this the only launch in
        // flight, which the runtime's global scheduler state and static shared memory need.
        // `err` and `bad` are writable buffers of the sizes passed.
        unsafe {
            baton_emu_run(
                kernel.entry,
                grid_a.as_ptr(),
                block_a.as_ptr(),
                ptrs.as_mut_ptr(),
                sched,
                seed,
                c_int::from(cooperative),
                err.as_mut_ptr(),
                err.len(),
                bad.as_mut_ptr(),
            )
        }
    };
    if code == 0 {
        return Ok(());
    }
    // SAFETY: on failure baton_emu_run wrote a NUL-terminated message into `err` (snprintf
    // truncates to the capacity and always terminates).
    let detail = unsafe { CStr::from_ptr(err.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let name = name.to_owned();
    let block_idx = (bad[0], bad[1], bad[2]);
    Err(match code {
        1 => EmuError::Deadlock {
            name,
            block_idx,
            detail,
        },
        2 => EmuError::Divergence {
            name,
            block_idx,
            detail,
        },
        _ => EmuError::Runtime { name, detail },
    })
}

/// A kernel argument list with stable addresses, built in the order of the kernel's C
/// signature (as the CUDA executor's `KArgs`): every value sits in its own 8-byte slot, ints and
/// floats in the low bytes (little-endian), so [`Params::as_args`] yields the `kernelParams`
/// array [`launch`] takes.
#[derive(Clone, Debug, Default)]
pub struct Params {
    slots: Vec<u64>,
}

impl Params {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// A device pointer (here: a host address).
    pub fn ptr<T>(&mut self, p: *const T) -> &mut Self {
        self.u64(p as usize as u64)
    }

    /// A mutable device pointer.
    pub fn ptr_mut<T>(&mut self, p: *mut T) -> &mut Self {
        self.ptr(p.cast_const())
    }

    /// An `int`.
    pub fn int(&mut self, v: i32) -> &mut Self {
        self.u64(u64::from(v as u32))
    }

    /// A `float`.
    pub fn float(&mut self, v: f32) -> &mut Self {
        self.u64(u64::from(v.to_bits()))
    }

    /// An 8-byte value (`u64`, `size_t`, a pointer).
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.slots.push(v);
        self
    }

    /// Number of parameters so far.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no parameter was added.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The `kernelParams` array: one pointer per slot. It borrows `self`, so the slots cannot
    /// move, change or be dropped while the array is alive.
    pub fn as_args(&mut self) -> KernelParams<'_> {
        KernelParams {
            ptrs: self
                .slots
                .iter_mut()
                .map(|s| (s as *mut u64).cast::<c_void>())
                .collect(),
            _slots: std::marker::PhantomData,
        }
    }
}

/// A `kernelParams` array pointing into a [`Params`]; dereferences to the `&[*mut c_void]`
/// [`launch`] takes.
#[derive(Debug)]
pub struct KernelParams<'a> {
    ptrs: Vec<*mut c_void>,
    _slots: std::marker::PhantomData<&'a mut Params>,
}

impl std::ops::Deref for KernelParams<'_> {
    type Target = [*mut c_void];

    fn deref(&self) -> &[*mut c_void] {
        &self.ptrs
    }
}
