//! Batch-invariant f32 linear layers for the CPU reference: `out[t, n] = x[t, k] · W[n, k]ᵀ`.
//!
//! Invariant: `out[r, j]` is computed by the same sequence of floating-point operations
//! whatever `t`, the row's place in the batch, the column's place in its block, the thread
//! count and the register tile it falls in. Each output is one dot product of `x[r, ..]` with
//! `W[j, ..]` in the order of [`dot_order`]: eight lane sums (lane `l` takes the `d` with
//! `d mod 8 = l`, ascending `d`, each step a fused multiply-add; the last partial group of
//! eight is zero-padded), then the lanes combined as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
//! (l3 + l7))`. So a sequence's logits do not depend on its batchmates (what the seeded
//! sampler's promise and the cross-backend checks rest on), and any tiling or split over
//! threads is a pure speed choice.
//!
//! Speed: rows are computed in register tiles of up to 4 rows by 2 columns (8 accumulators,
//! each weight vector loaded once per tile and used for 4 rows), over column blocks of about
//! 64 KiB of `W` that stay in L2 while every row tile passes over them; the blocks are spread
//! over the current rayon pool. Nothing is packed or copied: a decode step (`t` of 1 to a few)
//! streams each weight once, split over the threads, where a GEMM library packs `W` first.
//! x86-64 with AVX2, FMA and F16C takes the vector path (detected at run time); every other
//! machine takes the portable path, which gives the same bits
//! (`f32::mul_add` is the same fused operation).
//!
//! Weights are kept in the narrowest type that holds every value of the matrix exactly
//! ([`Store::compact`]): a bf16 or f16 checkpoint's matrices, which the loader widened to f32,
//! go back to 2 bytes per weight, and the kernel widens each vector as it loads it. Widening is
//! exact, so the results are the bits of the f32 path, with half the memory and, for a decode
//! step that streams the weights, half the traffic.
//!
//! A GGUF file's quantized matrices stay in ggml's blocks ([`Store::Ggml`]: Q4_K is 4.5 bits a
//! weight). Each task dequantizes its column block's rows into a per-thread f32 scratch
//! (ggml's reference formulas, [`GgmlType::dequantize`]) and runs the f32 kernel over it, so
//! the results are the bits of the f32 path over the dequantized matrix: the same whatever the
//! batch and thread count, and the same values llama.cpp's reference dequantization gives
//! (llama.cpp itself quantizes the activations to 8 bits for its dot products; Baton keeps
//! them f32 unless asked, [`crate::linear_q8`]).

use crate::gguf_quant::GgmlType;
use rayon::prelude::*;
use std::cell::RefCell;

/// Bytes of `W` per column block (its columns' rows): sized for L2, so the block stays
/// resident while every row tile of a prefill passes over it.
const BLOCK_BYTES: usize = 64 * 1024;

/// Multiply-adds below which a linear runs on the calling thread (a fork costs a few µs).
const PAR_MIN_MACS: usize = 1 << 17;

/// Columns per block for reduction length `k`: [`BLOCK_BYTES`] of `W` rows, a multiple of 8
/// (every register tile's column count divides it), at least 8.
fn block_cols(k: usize) -> usize {
    (BLOCK_BYTES / 4 / k.max(1)).clamp(8, 1024) / 8 * 8
}

/// The reference order of one output: what every path computes, bit for bit (see the module
/// documentation). `a` and `b` have the same length.
pub(crate) fn dot_order(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let full = a.len() / 8 * 8;
    for (ca, cb) in a[..full].chunks_exact(8).zip(b[..full].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    if full < a.len() {
        let mut ta = [0.0f32; 8];
        let mut tb = [0.0f32; 8];
        ta[..a.len() - full].copy_from_slice(&a[full..]);
        tb[..a.len() - full].copy_from_slice(&b[full..]);
        for l in 0..8 {
            acc[l] = ta[l].mul_add(tb[l], acc[l]);
        }
    }
    combine(acc)
}

/// The fixed combination of the eight lane sums.
#[inline(always)]
pub(crate) fn combine(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Element types of a [`Store`], as the kernels' `E` parameter.
const F32: u8 = 0;
/// bfloat16: the top half of an f32's bits.
const BF16: u8 = 1;
/// IEEE binary16.
const F16: u8 = 2;

/// A row-major weight matrix in the narrowest type that holds all of its values exactly, or
/// in ggml's blocks as a GGUF file stores it.
#[derive(Clone)]
pub(crate) enum Store {
    /// f32 values (some value is neither bf16 nor f16).
    F32(Vec<f32>),
    /// bfloat16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE binary16 bit patterns.
    F16(Vec<u16>),
    /// Runs of rows in ggml's types ([`GgmlRows`]), top to bottom, all of one row length: a
    /// fused q/k/v of a Q4_K_M file is Q4_K rows then Q6_K rows. Read by dequantizing whole
    /// rows.
    Ggml(Vec<GgmlRows>),
}

/// `rows` rows of `cols` values stored as ggml blocks of type `ty` (a GGUF tensor's data as
/// the file stores it, little-endian; `bytes` is `rows` times `ty.row_bytes(cols)`). F32, F16
/// and BF16 are ggml types too, so a matrix of mixed parts is one list of these.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GgmlRows {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) bytes: Vec<u8>,
}

impl GgmlRows {
    /// `rows` x `cols` blocks of `ty` in `bytes`.
    ///
    /// # Errors
    /// A message when `cols` is not a whole number of `ty`'s blocks or `bytes` is not
    /// `rows` rows of them.
    pub(crate) fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, String> {
        let row = ty.row_bytes(cols).ok_or_else(|| {
            format!(
                "{}: a row of {cols} values is not a whole number of {}-value blocks",
                ty.name(),
                ty.block_size()
            )
        })?;
        if rows.checked_mul(row) != Some(bytes.len()) {
            return Err(format!(
                "{}: {rows} rows of {cols} values take {row} bytes each, got {} bytes",
                ty.name(),
                bytes.len()
            ));
        }
        Ok(GgmlRows {
            ty,
            rows,
            cols,
            bytes,
        })
    }

    /// f32 rows, as ggml's F32 type (for a matrix whose other parts are quantized).
    pub(crate) fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Self {
        GgmlRows {
            ty: GgmlType::F32,
            rows,
            cols,
            bytes: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// Bytes of one row.
    fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }
}

/// Rows `r0..r1` of the matrix `parts` (rows of `k` values) dequantized into `out` (`(r1 -
/// r0) * k` values), in [`GgmlType::dequantize`]'s values, by the portable per-block loops
/// ([`avx2::dequantize_rows`] is the fast path).
fn dequantize_rows(parts: &[GgmlRows], r0: usize, r1: usize, k: usize, out: &mut [f32]) {
    let mut first = 0;
    for p in parts {
        let (lo, hi) = (r0.max(first), r1.min(first + p.rows));
        if lo < hi {
            let rb = p.row_bytes();
            let src = &p.bytes[(lo - first) * rb..(hi - first) * rb];
            p.ty.dequantize_blocks(src, &mut out[(lo - r0) * k..(hi - r0) * k]);
        }
        first += p.rows;
    }
}

/// Rows `r0..r1` of `parts` dequantized on the fastest path this CPU has (the same values).
fn dequantize_rows_fast(parts: &[GgmlRows], r0: usize, r1: usize, k: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { avx2::dequantize_rows(parts, r0, r1, k, out) };
        }
    }
    dequantize_rows(parts, r0, r1, k, out)
}

thread_local! {
    /// Per thread: a column block of a [`Store::Ggml`] matrix, dequantized (see [`linear`]).
    static DEQUANTIZED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Store {
    /// `w` as bf16 when every value is one (its low 16 bits are zero), else as f16 when every
    /// value survives the round trip through f16 bit for bit, else as f32. Lossless: the
    /// values read back are `w`'s, bit for bit.
    pub(crate) fn compact(w: Vec<f32>) -> Self {
        if w.iter().all(|v| v.to_bits() & 0xffff == 0) {
            return Store::Bf16(w.iter().map(|v| (v.to_bits() >> 16) as u16).collect());
        }
        let f16 = |v: f32| half::f16::from_f32(v);
        if w.iter().all(|&v| f16(v).to_f32().to_bits() == v.to_bits()) {
            return Store::F16(w.iter().map(|&v| f16(v).to_bits()).collect());
        }
        Store::F32(w)
    }

    /// `parts` (top to bottom) as one matrix of rows of `k` values: ggml blocks when some part
    /// is quantized, else the f32 values compacted ([`Store::compact`]).
    ///
    /// # Panics
    /// If a part's rows are not `k` values long (a caller bug: the loader checks shapes).
    pub(crate) fn of_parts(parts: Vec<GgmlRows>, k: usize) -> Self {
        assert!(
            parts.iter().all(|p| p.cols == k),
            "parts of another row length"
        );
        let float = |p: &GgmlRows| matches!(p.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if parts.iter().all(float) {
            let n: usize = parts.iter().map(|p| p.rows * k).sum();
            let mut w = vec![0.0f32; n];
            dequantize_rows(&parts, 0, n / k.max(1), k, &mut w);
            return Store::compact(w);
        }
        Store::Ggml(parts)
    }

    /// Number of values.
    pub(crate) fn len(&self) -> usize {
        match self {
            Store::F32(v) => v.len(),
            Store::Bf16(v) | Store::F16(v) => v.len(),
            Store::Ggml(parts) => parts.iter().map(|p| p.rows * p.cols).sum(),
        }
    }

    /// Whether the 8-bit activation path ([`crate::linear_q8`]) multiplies this matrix when
    /// asked to: ggml blocks, every part quantized.
    pub(crate) fn int8_reads(&self) -> bool {
        matches!(self, Store::Ggml(parts) if crate::linear_q8::reads(parts))
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Store::F32(v) => 4 * v.len(),
            Store::Bf16(v) | Store::F16(v) => 2 * v.len(),
            Store::Ggml(parts) => parts.iter().map(|p| p.bytes.len()).sum(),
        }
    }

    /// Values `start..start + out.len()`, widened to f32 into `out`.
    ///
    /// # Panics
    /// If the range is past the end (a caller bug).
    pub(crate) fn read(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            Store::F32(v) => out.copy_from_slice(&v[start..end]),
            Store::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[start..end]) {
                    *o = widen::<BF16>(b);
                }
            }
            Store::F16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[start..end]) {
                    *o = widen::<F16>(b);
                }
            }
            Store::Ggml(parts) => {
                let k = parts.first().map_or(1, |p| p.cols.max(1));
                assert!(end <= self.len(), "values {start}..{end} past the matrix");
                let (r0, r1) = (start / k, end.div_ceil(k));
                let mut rows = vec![0.0f32; (r1 - r0) * k];
                dequantize_rows(parts, r0, r1, k, &mut rows);
                out.copy_from_slice(&rows[start - r0 * k..end - r0 * k]);
            }
        }
    }

    /// The element type code and the address of the first value; `None` for ggml blocks.
    fn raw(&self) -> Option<(u8, *const u8)> {
        match self {
            Store::F32(v) => Some((F32, v.as_ptr().cast())),
            Store::Bf16(v) => Some((BF16, v.as_ptr().cast())),
            Store::F16(v) => Some((F16, v.as_ptr().cast())),
            Store::Ggml(_) => None,
        }
    }
}

/// A 16-bit weight of type `E` (BF16 or F16) as the f32 it stands for (exact).
#[inline(always)]
fn widen<const E: u8>(b: u16) -> f32 {
    if E == BF16 {
        f32::from_bits((b as u32) << 16)
    } else {
        half::f16::from_bits(b).to_f32()
    }
}

/// Bytes per value of element type `E`.
const fn elem_bytes<const E: u8>() -> usize {
    if E == F32 {
        4
    } else {
        2
    }
}

/// Value `i` at `p`, of element type `E`, as f32.
///
/// # Safety
/// `p` points to at least `i + 1` values of type `E`.
#[inline(always)]
unsafe fn load_elem<const E: u8>(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees value i exists; unaligned reads need no alignment.
    unsafe {
        if E == F32 {
            p.cast::<f32>().add(i).read_unaligned()
        } else {
            widen::<E>(p.cast::<u16>().add(i).read_unaligned())
        }
    }
}

/// A pointer to `out` shared by the column-block tasks.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the tasks that share an `OutPtr` write disjoint elements (each its own column block
// of every row), and `linear` holds the `&mut` borrow of the buffer until they all finish.
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`: no element is written by two tasks, none is read.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so a closure captures the whole `OutPtr`, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One column block's kernel: `out[r, j] (row stride n) = x[r, ..] · W[j, ..]` for every row
/// `r < t` and `j` in `j0..j1`.
type BlockFn = unsafe fn(*const f32, usize, *const u8, usize, usize, usize, usize, *mut f32);

/// `out[t, n] = x[t, k] · W[n, k]ᵀ`, all row-major (`x` row stride `k`, `W` row stride `k`,
/// `out` row stride `n`), on the current rayon pool's threads when the product is large
/// enough. Every element is bit-identical to [`dot_order`] of its row and its column (widened
/// to f32).
///
/// With `int8` and a matrix of ggml blocks, every part quantized, the activations are
/// quantized to 8 bits instead and each element is [`crate::linear_q8`]'s integer dot
/// product (llama.cpp's scheme; its own fixed order, the same whatever the batch and the
/// thread count); `int8` changes nothing for any other matrix.
///
/// # Panics
/// If `x` has fewer than `t * k` values, `w` is not `n * k` values, or `out` has fewer than
/// `t * n` (a caller bug: the forward pass sizes these from the config).
pub(crate) fn linear(
    x: &[f32],
    t: usize,
    w: &Store,
    n: usize,
    k: usize,
    out: &mut [f32],
    int8: bool,
) {
    assert!(x.len() >= t * k && w.len() == n * k && out.len() >= t * n);
    if t == 0 || n == 0 {
        return;
    }
    let q8 = match w {
        Store::Ggml(parts) if int8 && w.int8_reads() => {
            let per256 = parts.iter().any(|p| p.ty.super_blocks());
            let per32 = parts.iter().any(|p| !p.ty.super_blocks());
            Some(crate::linear_q8::QuantRows::new(x, t, k, per32, per256))
        }
        _ => None,
    };
    let kernel = match w.raw() {
        Some((BF16, _)) => block_kernel::<BF16>(),
        Some((F16, _)) => block_kernel::<F16>(),
        // f32, and ggml blocks: each task dequantizes its columns' rows, then runs the f32
        // kernel.
        _ => block_kernel::<F32>(),
    };
    let ggml = match w {
        Store::Ggml(parts) => Some(parts.as_slice()),
        _ => None,
    };
    // A task of up to `avx2::FUSED_ROWS` rows over ggml blocks of the types the AVX2 loaders
    // read dequantizes in registers (`avx2::gemv_ggml`), with no scratch.
    #[cfg(target_arch = "x86_64")]
    let fused_gemv = ggml.is_some_and(|parts| {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("fma") && has!("f16c") && parts.iter().all(|p| avx2::fused(p.ty))
    });
    let nb = block_cols(k);
    let blocks = n.div_ceil(nb);
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && t * n * k >= PAR_MIN_MACS;
    // Tasks are (row chunk, column block) pairs. A layer of few column blocks (a small
    // model, or a narrow projection) is also split by rows, in multiples of the 4-row tile,
    // so every thread gets work; the bits do not depend on the split.
    let row_chunks = if parallel && blocks < 2 * threads {
        (2 * threads).div_ceil(blocks).min(t.div_ceil(4))
    } else {
        1
    };
    let rows_per = t.div_ceil(row_chunks).div_ceil(4) * 4;
    let op = OutPtr(out.as_mut_ptr());
    let run = |task: usize| {
        let (chunk, b) = (task / blocks, task % blocks);
        let r0 = (chunk * rows_per).min(t);
        let r1 = (r0 + rows_per).min(t);
        let j0 = b * nb;
        let j1 = (j0 + nb).min(n);
        if let Some(parts) = ggml {
            if let Some(qx) = &q8 {
                // SAFETY: out[r0..r1, j0..j1] is this task's (as below); the parts' rows are
                // k values, the quantized x rows'.
                unsafe { crate::linear_q8::gemv(parts, qx, r0, r1, n, j0, j1, op.get()) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if r1 - r0 <= avx2::FUSED_ROWS && fused_gemv {
                // SAFETY: rows r0..r1 of x are k values each and out[r0..r1, j0..j1] is this
                // task's (as below); `fused_gemv` checked the CPU's features and the parts'
                // types.
                unsafe {
                    avx2::gemv_ggml(
                        parts,
                        x.as_ptr().add(r0 * k),
                        r1 - r0,
                        k,
                        n,
                        j0,
                        j1,
                        op.get().add(r0 * n),
                    )
                };
                return;
            }
            DEQUANTIZED.with(|buf| {
                let mut buf = buf.borrow_mut();
                let cols = j1 - j0;
                buf.clear();
                buf.resize(cols * k, 0.0);
                dequantize_rows_fast(parts, j0, j1, k, &mut buf);
                // SAFETY: as below, with the f32 kernel over `buf`, rows j0..j1 of W
                // dequantized (cols × k values): its columns 0..cols are out's j0..j1.
                unsafe {
                    kernel(
                        x.as_ptr().add(r0 * k),
                        r1 - r0,
                        buf.as_ptr().cast(),
                        n,
                        k,
                        0,
                        cols,
                        op.get().add(r0 * n + j0),
                    )
                }
            });
            return;
        }
        // A float store here (ggml blocks returned above), so never null.
        let w_ptr = w.raw().map_or(std::ptr::null(), |(_, p)| p);
        // SAFETY: the assert above gives `x` t×k, `w` n×k and `out` t×n values (`w_ptr` is
        // `w`'s first value, of the type the kernel was chosen for), and the kernel touches
        // only x[r, ..k], W[j, ..k] and out[r, j] for r in r0..r1 ⊆ 0..t and j in j0..j1 ⊆
        // 0..n. Tasks cover disjoint (row chunk, column block) rectangles, so concurrent
        // tasks never write one element, `w` is only read, and `out` stays mutably borrowed
        // by this call until every task has returned. The AVX2 kernel is chosen only where
        // the CPU has the features it uses (`block_kernel`).
        unsafe {
            kernel(
                x.as_ptr().add(r0 * k),
                r1 - r0,
                w_ptr,
                n,
                k,
                j0,
                j1,
                op.get().add(r0 * n),
            )
        }
    };
    let tasks = row_chunks * blocks;
    if parallel && tasks > 1 {
        (0..tasks).into_par_iter().for_each(run);
    } else {
        (0..tasks).for_each(run);
    }
}

/// The fastest block kernel for weights of type `E` this CPU runs.
fn block_kernel<const E: u8>() -> BlockFn {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            return avx2::block::<E>;
        }
    }
    portable_block::<E>
}

/// The portable block kernel: [`dot_order`] per element, over the widened weights.
///
/// # Safety
/// `x` points to `t * k` values, `w` to `n * k` values of type `E`, `out` to `t * n` writable
/// values that no one else accesses in columns `j0..j1`, and `j0 <= j1 <= n`.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_block<const E: u8>(
    x: *const f32,
    t: usize,
    w: *const u8,
    n: usize,
    k: usize,
    j0: usize,
    j1: usize,
    out: *mut f32,
) {
    let mut wj = vec![0.0f32; k];
    for j in j0..j1 {
        for (i, v) in wj.iter_mut().enumerate() {
            // SAFETY: row j of W lies inside the extents the caller guarantees.
            *v = unsafe { load_elem::<E>(w, j * k + i) };
        }
        for r in 0..t {
            // SAFETY: row r of x and out[r, j] lie inside the caller's extents; out[r, j] is
            // in this block's columns.
            unsafe {
                let xr = std::slice::from_raw_parts(x.add(r * k), k);
                *out.add(r * n + j) = dot_order(xr, &wj);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! The AVX2 + FMA block kernel: register tiles of `R` rows by `C` columns, each output one
    //! 8-lane accumulator in [`super::dot_order`]'s order; weights of element type `E`
    //! widened as they are loaded (F16C for f16).

    use super::{elem_bytes, BF16, F32};
    use crate::gguf_quant::GgmlType;
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    thread_local! {
        /// Per thread: a column block's 16-bit weights widened to f32 (see [`block`]).
        static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }

    /// Whether [`gemv_ggml`] reads rows of type `ty`: every quantized type.
    pub(super) fn fused(ty: GgmlType) -> bool {
        !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// Most rows [`gemv_ggml`] takes: it dequantizes each W row once for all of them (one W
    /// row a tile from five x rows on, for the registers), and the scratch, which dequantizes
    /// once for every tile, was as fast at 8 and faster beyond (session 40).
    pub(super) const FUSED_ROWS: usize = 8;

    /// `out[r, j] (row stride n) = x[r, ..] · W[j]` for `r < t` (`t` at most [`FUSED_ROWS`])
    /// and `j` in `j0..j1` (W's rows in `parts`, every one of a type [`fused`] accepts), each
    /// in [`super::dot_order`]'s order over the values [`GgmlType::dequantize`] gives: a run
    /// of 32 values at a time is dequantized in registers by [`run32`] (ggml's reference
    /// values) and fed to the lane FMAs, two W rows at a time up to 4 x rows and one from 5
    /// (more spilled registers) so that their accumulator chains overlap, with each row
    /// prefetched [`PREFETCH`] bytes ahead.
    ///
    /// # Safety
    /// `x` points to `t * k` values, `out` to `t` rows of `n` writable values that no one
    /// else accesses in columns `j0..j1`, `j1 <= n` is at most the parts' rows, each part's
    /// rows are `k` values; the CPU has AVX2, FMA and F16C.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_ggml(
        parts: &[super::GgmlRows],
        x: *const f32,
        t: usize,
        k: usize,
        n: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        // One instance per (type, rows): two W rows a tile up to 4 x rows (four ran slower at
        // one, session 40), one from 5 (accumulators for 8 x rows fill the registers). Q5_1
        // takes one throughout: its offset and masks left too few registers for two rows'
        // dequantized runs, which spilled (one token 18.1 -> 15.1 ms, two 20.4 -> 16.8;
        // every other type ran 8-45 % slower with one, session 41).
        macro_rules! go {
            ($rows:expr, $t:expr) => {
                match $t {
                    1 if $rows == Q5_1 => gemv_part::<{ $rows }, 1, 1>,
                    2 if $rows == Q5_1 => gemv_part::<{ $rows }, 2, 1>,
                    3 if $rows == Q5_1 => gemv_part::<{ $rows }, 3, 1>,
                    4 if $rows == Q5_1 => gemv_part::<{ $rows }, 4, 1>,
                    1 => gemv_part::<{ $rows }, 1, 2>,
                    2 => gemv_part::<{ $rows }, 2, 2>,
                    3 => gemv_part::<{ $rows }, 3, 2>,
                    4 => gemv_part::<{ $rows }, 4, 2>,
                    5 => gemv_part::<{ $rows }, 5, 1>,
                    6 => gemv_part::<{ $rows }, 6, 1>,
                    7 => gemv_part::<{ $rows }, 7, 1>,
                    _ => gemv_part::<{ $rows }, 8, 1>,
                }
            };
        }
        let mut first = 0;
        for p in parts {
            let (lo, hi) = (j0.max(first), j1.min(first + p.rows));
            if lo < hi {
                type Part = unsafe fn(*const f32, usize, usize, *const u8, usize, usize, *mut f32);
                // A float part: none, by the caller's guarantee.
                let Some(f): Option<Part> = by_type!(p.ty, |T| Some(go!(T, t)), None) else {
                    debug_assert!(false, "gemv_ggml over a {:?} part", p.ty);
                    first += p.rows;
                    continue;
                };
                let rb = p.row_bytes();
                // SAFETY: rows lo - first..hi - first of the part exist, each k values of its
                // type (rb bytes); x and out as the caller's, columns lo..hi ⊆ j0..j1.
                unsafe {
                    f(
                        x,
                        k,
                        n,
                        p.bytes.as_ptr().add((lo - first) * rb),
                        rb,
                        hi - lo,
                        out.add(lo),
                    )
                };
            }
            first += p.rows;
        }
    }

    /// [`gemv_ggml`] over `cols` consecutive W rows of type `T` at `w` (`rb` bytes each),
    /// `R` x rows: tiles of `C` W rows, then single ones.
    ///
    /// # Safety
    /// As [`gemv_ggml`], with `out` at the first of the `cols` columns.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_part<const T: u8, const R: usize, const C: usize>(
        x: *const f32,
        k: usize,
        n: usize,
        w: *const u8,
        rb: usize,
        cols: usize,
        out: *mut f32,
    ) {
        let mut j = 0;
        // SAFETY (both loops): W rows j.. < cols and out columns j.. < cols, the caller's.
        unsafe {
            while j + C <= cols {
                let rows = std::array::from_fn(|c| w.add((j + c) * rb));
                gemv_rows::<T, R, C>(x, rows, k, out.add(j), n);
                j += C;
            }
            while j < cols {
                gemv_rows::<T, R, 1>(x, [w.add(j * rb)], k, out.add(j), n);
                j += 1;
            }
        }
    }

    /// `$quant` with the type code `$code` (a const item) of the quantized type `$ty`, or
    /// `$float` for a float type: one list of the types [`run32`] decodes, for every
    /// dispatch from a [`GgmlType`] to an instance.
    macro_rules! by_type {
        ($ty:expr, |$code:ident| $quant:expr, $float:expr) => {
            match $ty {
                GgmlType::Q4_0 => {
                    const $code: u8 = Q4_0;
                    $quant
                }
                GgmlType::Q4_1 => {
                    const $code: u8 = Q4_1;
                    $quant
                }
                GgmlType::Q5_0 => {
                    const $code: u8 = Q5_0;
                    $quant
                }
                GgmlType::Q5_1 => {
                    const $code: u8 = Q5_1;
                    $quant
                }
                GgmlType::Q8_0 => {
                    const $code: u8 = Q8_0;
                    $quant
                }
                GgmlType::Q2_K => {
                    const $code: u8 = Q2_K;
                    $quant
                }
                GgmlType::Q3_K => {
                    const $code: u8 = Q3_K;
                    $quant
                }
                GgmlType::Q4_K => {
                    const $code: u8 = Q4_K;
                    $quant
                }
                GgmlType::Q5_K => {
                    const $code: u8 = Q5_K;
                    $quant
                }
                GgmlType::Q6_K => {
                    const $code: u8 = Q6_K;
                    $quant
                }
                GgmlType::IQ4_NL => {
                    const $code: u8 = IQ4_NL;
                    $quant
                }
                GgmlType::IQ4_XS => {
                    const $code: u8 = IQ4_XS;
                    $quant
                }
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => $float,
            }
        };
    }
    pub(crate) use by_type;

    /// [`run32`]'s type codes.
    pub(crate) const Q8_0: u8 = 0;
    pub(crate) const Q4_K: u8 = 1;
    pub(crate) const Q6_K: u8 = 2;
    pub(crate) const Q4_0: u8 = 3;
    pub(crate) const Q5_K: u8 = 4;
    pub(crate) const IQ4_NL: u8 = 5;
    pub(crate) const IQ4_XS: u8 = 6;
    pub(crate) const Q4_1: u8 = 7;
    pub(crate) const Q5_0: u8 = 8;
    pub(crate) const Q5_1: u8 = 9;
    pub(crate) const Q2_K: u8 = 10;
    pub(crate) const Q3_K: u8 = 11;

    /// Whether type `T` comes in blocks of 32 (one scale a block), not super-blocks of 256.
    pub(crate) const fn small_blocks<const T: u8>() -> bool {
        matches!(T, Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | IQ4_NL)
    }

    /// Bytes of one block of type `T` (ggml's `block_*` structs).
    pub(crate) const fn block_bytes<const T: u8>() -> usize {
        match T {
            Q8_0 => 34,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            IQ4_NL => 18,
            IQ4_XS => 136,
            Q6_K => 210,
            _ => panic!("not a type code"),
        }
    }

    /// How far ahead of the block being read [`gemv_rows`] prefetches each row, in bytes.
    pub(crate) const PREFETCH: usize = 2048;

    /// `out[r * ldo + c] = x[r, ..] · row c` for `R` x rows (stride `k`) and `C` W rows of
    /// type `T`, `k` values each.
    ///
    /// # Safety
    /// As [`gemv_ggml`], for `rows` and the `R` x `C` tile of `out`.
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc[r][c]: a register tile, indexed as one
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_rows<const T: u8, const R: usize, const C: usize>(
        x: *const f32,
        rows: [*const u8; C],
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // Runs of 32 per block: a K-quant super-block's scales are decoded once for its 8.
        let runs = if small_blocks::<T>() { 1 } else { 8 };
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for blk in 0..k / (32 * runs) {
            // SAFETY: block blk of every row lies within its k values, as do each x row's
            // values 32b..32b + 32 for the block's runs b.
            unsafe {
                let bb = block_bytes::<T>();
                prefetch_block(&rows, bb, blk);
                // A block of 32's scale is read with its run.
                let mut scales = [[0f32; 32]; C];
                if runs > 1 {
                    for (sc, &r) in scales.iter_mut().zip(&rows) {
                        *sc = block_scales::<T>(r, blk);
                    }
                }
                for s in 0..runs {
                    let b = blk * runs + s;
                    // Dequantized first, so that the FMA loop below is small enough to be
                    // unrolled with `acc` in registers.
                    let mut w = [[_mm256_setzero_ps(); 4]; C];
                    for c in 0..C {
                        w[c] = run32::<T>(rows[c], b, &scales[c]);
                    }
                    for q in 0..4 {
                        for r in 0..R {
                            let xv = _mm256_loadu_ps(x.add(r * k + 32 * b + 8 * q));
                            for c in 0..C {
                                acc[r][c] = _mm256_fmadd_ps(xv, w[c][q], acc[r][c]);
                            }
                        }
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                // SAFETY: out[r, c] is in the caller's tile.
                unsafe { *out.add(r * ldo + c) = hsum(v) };
            }
        }
    }

    /// Prefetches, for block `blk` of `bb` bytes of each row, every 64-byte line [`PREFETCH`]
    /// bytes ahead of it, once, so that a block is in cache when read (loads of a block's
    /// scale came first and waited on memory; without this the quantized kernels ran up to
    /// 3x slower). A prefetch past a row's end does no harm (`wrapping_add`: no access, no
    /// fault).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn prefetch_block<const C: usize>(rows: &[*const u8; C], bb: usize, blk: usize) {
        let lo = bb * blk + PREFETCH;
        let mut line = lo.next_multiple_of(64);
        while line < lo + bb {
            for &r in rows {
                // A hint: it neither faults nor reads into the program (a safe intrinsic).
                _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(line).cast());
            }
            line += 64;
        }
    }

    /// The f16 at `p` (little-endian, unaligned) as f32.
    ///
    /// # Safety
    /// `p` points to 2 readable bytes.
    #[inline(always)]
    pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller's two bytes.
        half::f16::from_bits(unsafe { p.cast::<u16>().read_unaligned() }).to_f32()
    }

    /// The scale factors of block `blk` of a row of type `T` (a K-quant), as ggml's reference
    /// computes them: Q4_K and Q5_K each 32-run's `d1 = d·sc` then its `m1 = dmin·m` (`[d1_0..d1_7,
    /// m1_0..m1_7]`); IQ4_XS each 32-run's `d·(sc − 32)` (`[dl_0..dl_7]`); Q6_K each 16-run's
    /// `d·sc` (in the scales' order); Q2_K each 16-run's `d·sc` then its `dmin·m` (`[dl_0..dl_15,
    /// ml_0..ml_15]`); Q3_K each 16-run's `d·(sc − 32)`. Unused entries are zero.
    ///
    /// # Safety
    /// The row holds block `blk` of type `T`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn block_scales<const T: u8>(row: *const u8, blk: usize) -> [f32; 32] {
        let mut out = [0f32; 32];
        // SAFETY: the block's bytes, at ggml's struct offsets.
        unsafe {
            if T == Q4_K || T == Q5_K {
                // The eight 6-bit scales and mins of `scale_min_k4`, unpacked four at a time
                // in u32s (llama.cpp's `utmp` masks): scales in u[0..2], mins in u[2..4];
                // then widened and scaled in vectors (scalar, the loop took a tenth of the
                // kernel's time).
                let sb = row.add(block_bytes::<T>() * blk);
                let (d, min) = (f16_at(sb), f16_at(sb.add(2)));
                let mut u = [0u32; 4];
                std::ptr::copy_nonoverlapping(sb.add(4), u.as_mut_ptr().cast::<u8>(), 12);
                let (m6, m4, m2) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
                u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
                let mins_low = u[1] & m6;
                u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
                u[2] = mins_low;
                u[0] &= m6;
                let v = _mm_loadu_si128(u.as_ptr().cast());
                let o = out.as_mut_ptr();
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(d), sc));
                let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
                _mm256_storeu_ps(o.add(8), _mm256_mul_ps(_mm256_set1_ps(min), m));
            } else if T == Q2_K {
                // Sixteen bytes, a scale in each low nibble and a min in each high one; in
                // vectors (scalar, these loops took a third of the kernel's time).
                let sb = row.add(block_bytes::<T>() * blk);
                let (d, min) = (f16_at(sb.add(80)), f16_at(sb.add(82)));
                let v = _mm_loadu_si128(sb.cast());
                let low = _mm_set1_epi8(0x0F);
                let sc = _mm_and_si128(v, low);
                let m = _mm_and_si128(_mm_srli_epi16::<4>(v), low);
                let o = out.as_mut_ptr();
                store16::<false>(o, sc, d);
                store16::<false>(o.add(16), m, min);
            } else if T == Q3_K {
                // Scale j: low 4 bits from nibble j / 8 of byte j % 8, high 2 from bits
                // 2(j / 4).. of byte 8 + j % 4 (`gguf_quant::q3_k_scale`), less 32.
                let sb = row.add(block_bytes::<T>() * blk);
                let d = f16_at(sb.add(108));
                store16::<true>(out.as_mut_ptr(), q3_k_scales(sb.add(96)), d);
            } else if T == IQ4_XS {
                let sb = row.add(block_bytes::<T>() * blk);
                let d = f16_at(sb);
                let head = std::slice::from_raw_parts(sb, 8);
                for (g, o) in out.iter_mut().take(8).enumerate() {
                    *o = d * crate::gguf_quant::iq4_xs_scale(g, head) as f32;
                }
            } else {
                let sb = row.add(block_bytes::<T>() * blk);
                let d = f16_at(sb.add(208));
                store16::<true>(out.as_mut_ptr(), _mm_loadu_si128(sb.add(192).cast()), d);
            }
        }
        out
    }

    /// Values `32b..32b + 32` of a row of type `T` (code [`Q4_0`], [`Q8_0`], [`Q4_K`],
    /// [`Q5_K`], [`Q6_K`], [`IQ4_NL`] or [`IQ4_XS`]), with its block's [`block_scales`] (a
    /// super-block's; unused for the others), dequantized to ggml's reference values
    /// (`gguf_quant`'s `dequant_*`: `(q − 8)·d`, `q·d`, `d1·q − m1`, `(d·sc)·q`, `d·level[q]`,
    /// `dl·level[q]`, each unfused; `d1·q − m1` is one fused operation here, the same bits
    /// because `d1·q` is exact), as four vectors of eight. Which way each type's
    /// bytes are widened (eight from memory, or 32 loaded and split) is the faster one measured
    /// (bench/RESULTS.md, session 40).
    ///
    /// # Safety
    /// The row holds at least `32b + 32` values of type `T`; the CPU has AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run32<const T: u8>(row: *const u8, b: usize, scales: &[f32; 32]) -> [__m256; 4] {
        // Written as plain loops: a closure here is its own function, which the compiler may
        // leave uninlined, and without AVX2 (Q5_K ran 4x slower so).
        let mut out = [_mm256_setzero_ps(); 4];
        // SAFETY (the block reads below): block b / (runs per block) of the row, inside it by
        // the caller's guarantee; offsets are those of ggml's block structs.
        unsafe {
            if T == Q8_0 {
                let blk = row.add(block_bytes::<T>() * b);
                let d = _mm256_set1_ps(f16_at(blk));
                for (q, o) in out.iter_mut().enumerate() {
                    let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.add(2 + 8 * q).cast()));
                    *o = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
                }
            } else if T == Q4_0 {
                // Values 0..16 the low nibbles of qs[0..16], 16..32 the high ones. (Eight at a
                // time from memory: faster here than one 32-byte vector split as the
                // K-quants' below.)
                let blk = row.add(block_bytes::<T>() * b);
                let d = _mm256_set1_ps(f16_at(blk));
                let (low, eight) = (_mm256_set1_epi32(0x0F), _mm256_set1_epi32(8));
                for (q, o) in out.iter_mut().enumerate() {
                    let shift = _mm_cvtsi32_si128(4 * (q / 2) as i32);
                    let v = _mm256_srl_epi32(bytes8(blk.add(2 + 8 * (q % 2))), shift);
                    let v = _mm256_sub_epi32(_mm256_and_si256(v, low), eight);
                    *o = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
                }
            } else if T == Q4_1 {
                // Q4_0's nibbles; q·d is exact (4 bits by f16's 11), so one fused q·d + m
                // rounds as ggml's unfused pair does.
                let blk = row.add(block_bytes::<T>() * b);
                let d = _mm256_set1_ps(f16_at(blk));
                let m = _mm256_set1_ps(f16_at(blk.add(2)));
                let low = _mm256_set1_epi32(0x0F);
                for (q, o) in out.iter_mut().enumerate() {
                    let shift = _mm_cvtsi32_si128(4 * (q / 2) as i32);
                    let v = _mm256_srl_epi32(bytes8(blk.add(4 + 8 * (q % 2))), shift);
                    let v = _mm256_and_si256(v, low);
                    *o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m);
                }
            } else if T == Q5_0 || T == Q5_1 {
                // Q4_0's nibbles (eight at a time from memory), bit i of the u32 qh as bit 4
                // of value i (eight bits a time tested in lanes); Q5_0 less 16 and times d,
                // Q5_1 times d plus m (exact products, as Q4_1's). (All 32 bytes split from
                // one vector, with the bits spread by a byte shuffle, ran Q5_0 9 % slower.)
                let blk = row.add(block_bytes::<T>() * b);
                let d = _mm256_set1_ps(f16_at(blk));
                let at = if T == Q5_0 { 2 } else { 4 };
                let qh = _mm256_set1_epi32(blk.add(at).cast::<i32>().read_unaligned());
                let qs = blk.add(at + 4);
                let lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
                let (low, sixteen) = (_mm256_set1_epi32(0x0F), _mm256_set1_epi32(16));
                let m = _mm256_set1_ps(if T == Q5_1 { f16_at(blk.add(2)) } else { 0.0 });
                for (q, o) in out.iter_mut().enumerate() {
                    let shift = _mm_cvtsi32_si128(4 * (q / 2) as i32);
                    let v = _mm256_srl_epi32(bytes8(qs.add(8 * (q % 2))), shift);
                    let v = _mm256_and_si256(v, low);
                    let h = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(8 * q as i32));
                    let set = _mm256_cmpeq_epi32(_mm256_and_si256(h, lanes), lanes);
                    let v = _mm256_or_si256(v, _mm256_and_si256(set, sixteen));
                    *o = if T == Q5_0 {
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, sixteen)), d)
                    } else {
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m)
                    };
                }
            } else if T == Q2_K || T == Q3_K {
                // Run s = 4n + j of a half n: bits 2j..2j + 2 of qs[32n + l] (the 32 bytes at
                // once; a 16-bit shift keeps each byte's two bits), values 0..16 under scale
                // 8n + 2j, 16..32 under 8n + 2j + 1. Q3_K: less 4 where bit s of hmask[l] is
                // clear, times d·sc; Q2_K: d·sc·q − dmin·m, one fused operation (d·sc·q is
                // exact: 15 bits by 2).
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let (n, j) = (s / 4, s % 4);
                let qs = sb.add(if T == Q2_K { 16 } else { 32 } + 32 * n);
                let v = _mm256_loadu_si256(qs.cast());
                let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * j as i32));
                let q = _mm256_and_si256(v, _mm256_set1_epi8(3));
                let is = 8 * n + 2 * j;
                if T == Q2_K {
                    for (i, (o, v)) in out.iter_mut().zip(quarters::<false>(q)).enumerate() {
                        let dl = _mm256_set1_ps(scales[is + i / 2]);
                        let ml = _mm256_set1_ps(scales[16 + is + i / 2]);
                        *o = _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(v), ml);
                    }
                } else {
                    let hm = _mm256_loadu_si256(sb.cast());
                    let bit = _mm256_set1_epi8((1u8 << s) as i8);
                    let clear =
                        _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                    let q = _mm256_sub_epi8(q, _mm256_and_si256(clear, _mm256_set1_epi8(4)));
                    for (i, (o, v)) in out.iter_mut().zip(quarters::<true>(q)).enumerate() {
                        let dl = _mm256_set1_ps(scales[is + i / 2]);
                        *o = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(v));
                    }
                }
            } else if T == IQ4_NL || T == IQ4_XS {
                // The run's 16 quant bytes: low nibbles are values 0..16, high ones 16..32,
                // each an index into the 16 levels, looked up by a byte shuffle (per 128-bit
                // lane: the levels in both lanes, the low nibbles in lane 0, the high in 1).
                let (qs, dl) = if T == IQ4_NL {
                    let blk = row.add(block_bytes::<T>() * b);
                    (blk.add(2), f16_at(blk))
                } else {
                    let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                    (sb.add(8 + 16 * s), scales[s])
                };
                let v = _mm_loadu_si128(qs.cast());
                let v = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
                let v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
                let levels = _mm_loadu_si128(crate::gguf_quant::IQ4_LEVELS.as_ptr().cast());
                let q = _mm256_shuffle_epi8(_mm256_set_m128i(levels, levels), v);
                let dl = _mm256_set1_ps(dl);
                for (o, v) in out.iter_mut().zip(quarters::<true>(q)) {
                    *o = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(v));
                }
            } else if T == Q4_K {
                // Run s: nibble s % 2 of qs[32 (s / 2) + l], eight at a time from memory.
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let d1 = _mm256_set1_ps(scales[s]);
                let m1 = _mm256_set1_ps(scales[8 + s]);
                let qs = sb.add(16 + 32 * (s / 2));
                let shift = _mm_cvtsi32_si128(4 * (s % 2) as i32);
                let low = _mm256_set1_epi32(0x0F);
                // d1·q is exact in f32 (d1 = d·sc has at most 11 + 6 significant bits, q at
                // most 5), so one fused d1·q − m1 rounds as ggml's unfused pair does.
                for (q, o) in out.iter_mut().enumerate() {
                    let v = _mm256_and_si256(_mm256_srl_epi32(bytes8(qs.add(8 * q)), shift), low);
                    *o = _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(v), m1);
                }
            } else if T == Q5_K {
                // Run s: nibble s % 2 of qs[32 (s / 2) + l], bit s of qh[l] as bit 4; the 32
                // bytes at once, then widened a quarter at a time.
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let v = _mm256_loadu_si256(sb.add(48 + 32 * (s / 2)).cast());
                let v = if s % 2 == 0 {
                    v
                } else {
                    _mm256_srli_epi16::<4>(v)
                };
                let q = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
                let qh = _mm256_loadu_si256(sb.add(16).cast());
                let bit = _mm256_set1_epi8((1u8 << s) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                let q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                let d1 = _mm256_set1_ps(scales[s]);
                let m1 = _mm256_set1_ps(scales[8 + s]);
                // Exact products as Q4_K's.
                for (o, v) in out.iter_mut().zip(quarters::<false>(q)) {
                    *o = _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(v), m1);
                }
            } else {
                // Run s = 4n + r of a half n: nibble r / 2 of ql[64n + 32(r % 2) + l], bits
                // 2r..2r + 2 of qh[32n + l] as bits 4..6, less 32; the 32 bytes at once.
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let (n, r) = (s / 4, s % 4);
                let ql = _mm256_loadu_si256(sb.add(64 * n + 32 * (r & 1)).cast());
                let ql = if r / 2 == 0 {
                    ql
                } else {
                    _mm256_srli_epi16::<4>(ql)
                };
                let lo = _mm256_and_si256(ql, _mm256_set1_epi8(0x0F));
                let qh = _mm256_loadu_si256(sb.add(128 + 32 * n).cast());
                let qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r as i32));
                // Two bits per byte, so the 16-bit shift left keeps each in its byte.
                let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(3)));
                let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
                for (i, (o, v)) in out.iter_mut().zip(quarters::<true>(q)).enumerate() {
                    let ds = _mm256_set1_ps(scales[8 * n + i / 2 + 2 * r]);
                    *o = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(v));
                }
            }
        }
        out
    }

    /// The sixteen scales of a Q3_K super-block, less 32, as signed bytes, from its 12 packed
    /// bytes at `packed`: scale j's low 4 bits from nibble j / 8 of byte j % 8, its high 2
    /// from bits 2(j / 4).. of byte 8 + j % 4 (`gguf_quant::q3_k_scale`).
    ///
    /// # Safety
    /// `packed` points to 12 readable bytes; the CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q3_k_scales(packed: *const u8) -> __m128i {
        // SAFETY: the caller's 12 bytes; unaligned loads.
        let (v, h) = unsafe {
            (
                _mm_loadl_epi64(packed.cast()),
                packed.add(8).cast::<i32>().read_unaligned(),
            )
        };
        let low = _mm_set1_epi8(0x0F);
        let lo = _mm_unpacklo_epi64(
            _mm_and_si128(v, low),
            _mm_and_si128(_mm_srli_epi16::<4>(v), low),
        );
        // Bytes 8..12 in each 32-bit lane g, shifted right by 2g (each byte's two bits stay
        // within it).
        let h = _mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 2, 4, 6));
        let hi = _mm_slli_epi16::<4>(_mm_and_si128(h, _mm_set1_epi8(3)));
        _mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32))
    }

    /// `o[i] = d · v[i]` for the 16 bytes of `v` (signed when `SIGNED`) as f32, one rounding
    /// each (as the scalar `d * (v as f32)`).
    ///
    /// # Safety
    /// `o` points to 16 writable f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store16<const SIGNED: bool>(o: *mut f32, v: __m128i, d: f32) {
        let d = _mm256_set1_ps(d);
        for (i, h) in [v, _mm_unpackhi_epi64(v, v)].into_iter().enumerate() {
            let w = if SIGNED {
                _mm256_cvtepi8_epi32(h)
            } else {
                _mm256_cvtepu8_epi32(h)
            };
            // SAFETY: o[8i..8i + 8], the caller's.
            unsafe { _mm256_storeu_ps(o.add(8 * i), _mm256_mul_ps(d, _mm256_cvtepi32_ps(w))) };
        }
    }

    /// Eight bytes at `p` widened to eight i32 lanes.
    ///
    /// # Safety
    /// `p` points to 8 readable bytes; the CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bytes8(p: *const u8) -> __m256i {
        // SAFETY: the caller's 8 bytes; an unaligned 64-bit load.
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p.cast()) })
    }

    /// The four 8-byte quarters of `v` (bytes 0..8, 8..16, 16..24, 24..32), each widened to
    /// eight i32 lanes: sign-extended when `SIGNED`, else zero-extended.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quarters<const SIGNED: bool>(v: __m256i) -> [__m256i; 4] {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256::<1>(v);
        let halves = [
            lo,
            _mm_unpackhi_epi64(lo, lo),
            hi,
            _mm_unpackhi_epi64(hi, hi),
        ];
        let mut out = [_mm256_setzero_si256(); 4];
        for (o, h) in out.iter_mut().zip(halves) {
            *o = if SIGNED {
                _mm256_cvtepi8_epi32(h)
            } else {
                _mm256_cvtepu8_epi32(h)
            };
        }
        out
    }

    /// [`super::dequantize_rows`] for AVX2, FMA and F16C, with the same values: parts of a
    /// type [`fused`] accepts are dequantized by [`run32`], 32 values at a time (the scalar
    /// per-block loops ran Q2_K 6x slower), the float parts by the generic loops compiled
    /// for these features.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize_rows(
        parts: &[super::GgmlRows],
        r0: usize,
        r1: usize,
        k: usize,
        out: &mut [f32],
    ) {
        let mut first = 0;
        for p in parts {
            let (lo, hi) = (r0.max(first), r1.min(first + p.rows));
            if lo < hi {
                let rb = p.row_bytes();
                let src = &p.bytes[(lo - first) * rb..(hi - first) * rb];
                let dst = &mut out[(lo - r0) * k..(hi - r0) * k];
                type Rows = unsafe fn(&[u8], usize, &mut [f32]);
                let f: Option<Rows> = by_type!(p.ty, |T| Some(rows32::<T>), None);
                match f {
                    // SAFETY: the CPU has the features (the caller's); src is whole rows of k
                    // values of the part's type, dst as many values.
                    Some(f) => unsafe { f(src, k, dst) },
                    None => p.ty.dequantize_blocks(src, dst),
                }
            }
            first += p.rows;
        }
    }

    /// The rows of `k` values of type `T` in `src` (whole rows, `k` a multiple of the type's
    /// block) dequantized into `dst` by [`run32`].
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `src` holds `dst.len() / k` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows32<const T: u8>(src: &[u8], k: usize, dst: &mut [f32]) {
        let runs = if small_blocks::<T>() { 1 } else { 8 };
        let rb = k / (32 * runs) * block_bytes::<T>();
        for (row, y) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(k)) {
            let mut scales = [0f32; 32];
            for b in 0..k / 32 {
                // SAFETY: run b of the row (k values), and y's values 32b..32b + 32.
                unsafe {
                    if runs > 1 && b % runs == 0 {
                        scales = block_scales::<T>(row.as_ptr(), b / runs);
                    }
                    let w = run32::<T>(row.as_ptr(), b, &scales);
                    for (q, v) in w.into_iter().enumerate() {
                        _mm256_storeu_ps(y.as_mut_ptr().add(32 * b + 8 * q), v);
                    }
                }
            }
        }
    }

    /// As [`super::portable_block`], with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`super::portable_block`], and the CPU has AVX2, FMA and F16C.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block<const E: u8>(
        x: *const f32,
        t: usize,
        w: *const u8,
        n: usize,
        k: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        if E != F32 && t >= 4 {
            // Four rows or more: widen the block's weights once into an f32 scratch (exact,
            // so the same bits) rather than once per 4-row tile, whose conversions compete
            // with the FMAs for the vector pipes (bf16 at batch 64 was half again slower).
            WIDE.with(|buf| {
                let mut buf = buf.borrow_mut();
                let cols = j1 - j0;
                buf.clear();
                buf.resize(cols * k, 0.0);
                let eb = elem_bytes::<E>();
                let full = cols * k / 8 * 8;
                let mut i = 0;
                // SAFETY: W rows j0..j1 are cols * k values from w + j0 * k * eb, inside the
                // caller's extents; buf holds cols * k values.
                unsafe {
                    let src = w.add(j0 * k * eb);
                    while i < full {
                        _mm256_storeu_ps(buf.as_mut_ptr().add(i), load8::<E>(src.add(i * eb)));
                        i += 8;
                    }
                    for (i, v) in buf.iter_mut().enumerate().skip(full) {
                        *v = super::load_elem::<E>(src, i);
                    }
                    // Columns 0..cols of the scratch are out's columns j0..j1.
                    block::<F32>(x, t, buf.as_ptr().cast(), n, k, 0, cols, out.add(j0));
                }
            });
            return;
        }
        let mut r = 0;
        // SAFETY (every call below): rows r..r + R < t of x, columns j0..j1 of W and out,
        // within the caller's extents.
        while r + 4 <= t {
            unsafe { rows::<E, 4, 2>(x, r, w, n, k, j0, j1, out) };
            r += 4;
        }
        match t - r {
            3 => unsafe { rows::<E, 3, 2>(x, r, w, n, k, j0, j1, out) },
            2 => unsafe { rows::<E, 2, 4>(x, r, w, n, k, j0, j1, out) },
            1 => unsafe { rows::<E, 1, 8>(x, r, w, n, k, j0, j1, out) },
            _ => {}
        }
    }

    /// Rows `r..r + R`, columns `j0..j1`: tiles of `C` columns, then single columns.
    ///
    /// # Safety
    /// As [`block`], with `r + R <= t`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows<const E: u8, const R: usize, const C: usize>(
        x: *const f32,
        r: usize,
        w: *const u8,
        n: usize,
        k: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        let row_bytes = k * elem_bytes::<E>();
        // SAFETY (both loops): the tile's rows and columns are inside the caller's extents.
        unsafe {
            let xr = x.add(r * k);
            let mut j = j0;
            while j + C <= j1 {
                tile::<E, R, C>(xr, w.add(j * row_bytes), k, out.add(r * n + j), n);
                j += C;
            }
            while j < j1 {
                tile::<E, R, 1>(xr, w.add(j * row_bytes), k, out.add(r * n + j), n);
                j += 1;
            }
        }
    }

    /// Eight weights of type `E` at `p`, widened to f32 (exact).
    ///
    /// # Safety
    /// `p` points to 8 values of type `E`; the CPU has AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const E: u8>(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 values (32 or 16 bytes); unaligned loads.
        unsafe {
            if E == F32 {
                _mm256_loadu_ps(p.cast())
            } else if E == BF16 {
                let h = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            }
        }
    }

    /// `out[a * ldo + c] = x[a, ..k] · w[c, ..k]` for `a < R`, `c < C` (`x` and `w` row
    /// stride `k` values), each in [`super::dot_order`]'s order.
    ///
    /// # Safety
    /// `x` points to `R * k` values, `w` to `C * k` values of type `E`, `out` to the `R x C`
    /// tile (row stride `ldo`); the CPU has AVX2, FMA and F16C.
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc[a][c]: a register tile, indexed as one
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const E: u8, const R: usize, const C: usize>(
        x: *const f32,
        w: *const u8,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let eb = elem_bytes::<E>();
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let full = k / 8 * 8;
        let mut i = 0;
        while i < full {
            let mut xv = [_mm256_setzero_ps(); R];
            for (a, v) in xv.iter_mut().enumerate() {
                // SAFETY: i + 8 <= k, inside row a of x.
                *v = unsafe { _mm256_loadu_ps(x.add(a * k + i)) };
            }
            for c in 0..C {
                // SAFETY: i + 8 <= k, inside row c of w.
                let wv = unsafe { load8::<E>(w.add((c * k + i) * eb)) };
                for a in 0..R {
                    acc[a][c] = _mm256_fmadd_ps(xv[a], wv, acc[a][c]);
                }
            }
            i += 8;
        }
        if full < k {
            // The zero-padded last group, as dot_order's.
            let rem = k - full;
            let mut xv = [_mm256_setzero_ps(); R];
            let mut buf = [0.0f32; 8];
            for (a, v) in xv.iter_mut().enumerate() {
                // SAFETY: x[a, full..k] is inside row a; buf holds 8 values.
                unsafe {
                    std::ptr::copy_nonoverlapping(x.add(a * k + full), buf.as_mut_ptr(), rem);
                    *v = _mm256_loadu_ps(buf.as_ptr());
                }
            }
            for c in 0..C {
                // Zero bits are +0 in all three types. SAFETY: w[c, full..k] is inside row
                // c (rem * eb bytes); wbuf holds 32 bytes, 8 values of any type.
                let wv = unsafe {
                    let mut wbuf = [0u8; 32];
                    std::ptr::copy_nonoverlapping(
                        w.add((c * k + full) * eb),
                        wbuf.as_mut_ptr(),
                        rem * eb,
                    );
                    load8::<E>(wbuf.as_ptr())
                };
                for a in 0..R {
                    acc[a][c] = _mm256_fmadd_ps(xv[a], wv, acc[a][c]);
                }
            }
        }
        for (a, row) in acc.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                // SAFETY: (a, c) is inside the R x C tile.
                unsafe { *out.add(a * ldo + c) = hsum(v) };
            }
        }
    }

    /// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, as `super::combine` (also the
    /// attention's lane combine).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        // (s0 + s2, s1 + s3, ..)
        let p = _mm_add_ps(s, _mm_movehl_ps(s, s));
        // (s0 + s2) + (s1 + s3)
        _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
    }
}

/// `n` values in `[-0.5, 0.5)` from an xorshift state `s` (the kernels' tests).
#[cfg(test)]
pub(crate) fn rnd(n: usize, s: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            ((*s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

#[cfg(test)]
/// `rows` rows of `cols` random `ty` blocks whose values are finite and moderate (blocks
/// drawn again while a random scale makes some value NaN, infinite or huge).
pub(crate) fn random_ggml(ty: GgmlType, rows: usize, cols: usize, s: &mut u64) -> GgmlRows {
    let mut bytes = Vec::new();
    for _ in 0..rows * cols / ty.block_size() {
        loop {
            let block: Vec<u8> = rnd(ty.type_size(), s)
                .iter()
                .map(|v| ((v + 0.5) * 256.0) as u8)
                .collect();
            let mut y = vec![0.0f32; ty.block_size()];
            ty.dequantize(&block, &mut y).unwrap();
            if y.iter().all(|v| v.abs() < 1e4) {
                bytes.extend(block);
                break;
            }
        }
    }
    GgmlRows::new(ty, rows, cols, bytes).unwrap()
}

/// The parts' rows dequantized by [`GgmlType::dequantize`], top to bottom (`k` values a row).
#[cfg(test)]
pub(crate) fn dequantized(parts: &[GgmlRows], k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; parts.iter().map(|p| p.rows).sum::<usize>() * k];
    let mut at = 0;
    for p in parts {
        p.ty.dequantize(&p.bytes, &mut out[at..at + p.rows * k])
            .unwrap();
        at += p.rows * k;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of a `t`-row linear equals [`dot_order`] of its row and (widened)
    /// column, bit for bit, for every `t` (all register-tile shapes and their remainders), for
    /// `k` with and without a partial last group of eight, for `n` across one and several
    /// column blocks, on one thread and on a pool of three, with f32, bf16 and f16 weights;
    /// and `dot_order` is a real dot product.
    #[test]
    fn every_element_is_the_reference_dot_whatever_the_batch_and_threads() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for &(n, k, max_t) in &[
            (1usize, 1usize, 9usize),
            (3, 7, 9),
            (17, 64, 11),
            (40, 1100, 9),
            (300, 61, 10),
            (1100, 96, 6),
        ] {
            let w32 = rnd(n * k, &mut s);
            let x = rnd(max_t * k, &mut s);
            let bf16: Vec<f32> = w32
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            let f16: Vec<f32> = w32
                .iter()
                .map(|&v| half::f16::from_f32(v).to_f32())
                .collect();
            let stores = [
                (Store::F32(w32.clone()), w32),
                (
                    Store::Bf16(bf16.iter().map(|v| (v.to_bits() >> 16) as u16).collect()),
                    bf16,
                ),
                (
                    Store::F16(
                        f16.iter()
                            .map(|&v| half::f16::from_f32(v).to_bits())
                            .collect(),
                    ),
                    f16,
                ),
            ];
            for (store, w) in &stores {
                let reference: Vec<f32> = (0..max_t)
                    .flat_map(|r| {
                        let x = &x;
                        (0..n)
                            .map(move |j| dot_order(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]))
                    })
                    .collect();
                let exact: f64 = (0..k).map(|i| x[i] as f64 * w[i] as f64).sum();
                assert!((reference[0] as f64 - exact).abs() < 1e-4, "n={n} k={k}");
                for t in 1..=max_t {
                    for threads in [1, 3] {
                        let mut out = vec![f32::NAN; t * n];
                        if threads == 1 {
                            linear(&x, t, store, n, k, &mut out, false);
                        } else {
                            pool.install(|| linear(&x, t, store, n, k, &mut out, false));
                        }
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert!(
                            bits(&out) == bits(&reference[..t * n]),
                            "n={n} k={k} t={t} threads={threads} {} bytes",
                            store.bytes()
                        );
                    }
                }
            }
        }
    }

    /// A matrix of ggml blocks (every quantized type, and one of mixed parts) gives, for every
    /// batch size and on one thread or three, the bits of the f32 kernel over the matrix
    /// dequantized by [`GgmlType::dequantize`]; its reads are the dequantized values.
    #[test]
    fn ggml_blocks_give_the_bits_of_their_dequantized_matrix() {
        let mut s = 0x0bad_cafe_1234_5678u64;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let k = 512;
        let mut cases: Vec<Vec<GgmlRows>> = GgmlType::ALL
            .into_iter()
            .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
            .map(|t| vec![random_ggml(t, 37, k, &mut s)])
            .collect();
        // A Q4_K_M-like fused projection: Q4_K rows, Q6_K rows, f32 rows; 300 rows in all,
        // so column blocks straddle the parts. Then one of only the types the AVX2 path
        // dequantizes in registers, parts of row counts that are not multiples of 4.
        cases.push(vec![
            random_ggml(GgmlType::Q4_K, 130, k, &mut s),
            random_ggml(GgmlType::Q6_K, 90, k, &mut s),
            GgmlRows::from_f32(80, k, &rnd(80 * k, &mut s)),
        ]);
        cases.push(vec![
            random_ggml(GgmlType::Q4_K, 131, k, &mut s),
            random_ggml(GgmlType::Q8_0, 6, k, &mut s),
            random_ggml(GgmlType::IQ4_XS, 7, k, &mut s),
            random_ggml(GgmlType::Q6_K, 89, k, &mut s),
            random_ggml(GgmlType::IQ4_NL, 5, k, &mut s),
        ]);
        for parts in cases {
            let n: usize = parts.iter().map(|p| p.rows).sum();
            let store = Store::of_parts(parts.clone(), k);
            assert!(matches!(store, Store::Ggml(_)));
            let dense = dequantized(&parts, k);
            let mut back = vec![0.0f32; 700];
            store.read(3 * k - 50, &mut back);
            assert!(back
                .iter()
                .zip(&dense[3 * k - 50..])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let f32_store = Store::F32(dense);
            let x = rnd(9 * k, &mut s);
            for t in [1, 2, 3, 4, 5, 6, 7, 8, 9] {
                let mut want = vec![0.0f32; t * n];
                linear(&x, t, &f32_store, n, k, &mut want, false);
                for threads in [1, 3] {
                    let mut got = vec![f32::NAN; t * n];
                    if threads == 1 {
                        linear(&x, t, &store, n, k, &mut got, false);
                    } else {
                        pool.install(|| linear(&x, t, &store, n, k, &mut got, false));
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want),
                        "{:?} t={t} threads={threads}",
                        parts.iter().map(|p| p.ty).collect::<Vec<_>>()
                    );
                }
            }
            assert_eq!(
                store.bytes(),
                parts.iter().map(|p| p.bytes.len()).sum::<usize>()
            );
        }
        // Float parts alone are compacted, not kept as blocks.
        let f = rnd(4 * k, &mut s);
        assert!(matches!(
            Store::of_parts(vec![GgmlRows::from_f32(4, k, &f)], k),
            Store::F32(_)
        ));
    }

    /// The scratch path's dequantization (`dequantize_rows_fast`: AVX2 decoders where the CPU
    /// has them) gives [`GgmlType::dequantize`]'s bits for every type, over row ranges that
    /// start and end inside parts of mixed types.
    #[test]
    fn fast_row_dequantization_gives_the_reference_bits() {
        let mut s = 0x005e_ed0f_0123u64;
        let k = 512;
        let types = GgmlType::ALL.into_iter().filter(|t| *t != GgmlType::F32);
        let mut parts: Vec<GgmlRows> = types
            .map(|t| match t {
                GgmlType::F16 | GgmlType::BF16 => {
                    let f: Vec<u8> = rnd(3 * k, &mut s)
                        .iter()
                        .flat_map(|&v| match t {
                            GgmlType::F16 => half::f16::from_f32(v).to_le_bytes(),
                            _ => half::bf16::from_f32(v).to_le_bytes(),
                        })
                        .collect();
                    GgmlRows::new(t, 3, k, f).unwrap()
                }
                _ => random_ggml(t, 3, k, &mut s),
            })
            .collect();
        parts.push(GgmlRows::from_f32(2, k, &rnd(2 * k, &mut s)));
        let n: usize = parts.iter().map(|p| p.rows).sum();
        let want = dequantized(&parts, k);
        for (r0, r1) in [(0, n), (1, n - 1), (4, 11), (20, 21)] {
            let mut got = vec![f32::NAN; (r1 - r0) * k];
            dequantize_rows_fast(&parts, r0, r1, k, &mut got);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got) == bits(&want[r0 * k..r1 * k]), "rows {r0}..{r1}");
        }
    }

    /// `Store::compact` keeps every value bit for bit and picks the narrowest type that does.
    #[test]
    fn compact_is_lossless_and_narrowest() {
        let mut s = 99u64;
        let w = rnd(1000, &mut s);
        let bf: Vec<f32> = w
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let hf: Vec<f32> = w.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        for (values, bytes) in [(&w, 4000), (&bf, 2000), (&hf, 2000)] {
            let store = Store::compact(values.clone());
            assert_eq!(store.bytes(), bytes);
            let mut back = vec![0.0f32; values.len()];
            store.read(0, &mut back);
            assert!(back
                .iter()
                .zip(values.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut part = [0.0f32; 3];
            store.read(10, &mut part);
            assert_eq!(part, values[10..13]);
        }
        // -0.0, 0, infinities and a subnormal bf16 survive as bf16.
        let special = vec![
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(1 << 16),
        ];
        let store = Store::compact(special.clone());
        assert!(matches!(store, Store::Bf16(_)));
        let mut back = vec![1.0; special.len()];
        store.read(0, &mut back);
        assert!(back
            .iter()
            .zip(&special)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// The lane order matters: a sum in plain index order gives other bits for some inputs,
    /// so the test above would catch a kernel that drifted from the reference order.
    #[test]
    fn the_reference_order_is_not_the_naive_order() {
        let mut s = 7u64;
        let differs = (0..50).any(|_| {
            let a = rnd(100, &mut s);
            let b = rnd(100, &mut s);
            let naive = a
                .iter()
                .zip(&b)
                .fold(0.0f32, |acc, (x, y)| x.mul_add(*y, acc));
            naive.to_bits() != dot_order(&a, &b).to_bits()
        });
        assert!(differs);
    }
}
