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
//! x86-64 with AVX2 and FMA takes the vector path (detected at run time); every other machine
//! takes the portable path, which gives the same bits (`f32::mul_add` is the same fused
//! operation).

use rayon::prelude::*;

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
fn combine(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
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
type BlockFn = unsafe fn(*const f32, usize, *const f32, usize, usize, usize, usize, *mut f32);

/// `out[t, n] = x[t, k] · W[n, k]ᵀ`, all row-major (`x` row stride `k`, `W` row stride `k`,
/// `out` row stride `n`), on the current rayon pool's threads when the product is large
/// enough. Every element is bit-identical to [`dot_order`] of its row and column.
///
/// # Panics
/// If `x` has fewer than `t * k` values, `w` is not `n * k` values, or `out` has fewer than
/// `t * n` (a caller bug: the forward pass sizes these from the config).
pub(crate) fn linear(x: &[f32], t: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= t * k && w.len() == n * k && out.len() >= t * n);
    if t == 0 || n == 0 {
        return;
    }
    let kernel = block_kernel();
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
        // SAFETY: the assert above gives `x` t×k, `w` n×k and `out` t×n values, and the
        // kernel touches only x[r, ..k], W[j, ..k] and out[r, j] for r in r0..r1 ⊆ 0..t and j
        // in j0..j1 ⊆ 0..n. Tasks cover disjoint (row chunk, column block) rectangles, so
        // concurrent tasks never write one element, and `out` stays mutably borrowed by this
        // call until every task has returned. The AVX2 kernel is chosen only where the CPU
        // has AVX2 and FMA (`block_kernel`).
        unsafe {
            kernel(
                x.as_ptr().add(r0 * k),
                r1 - r0,
                w.as_ptr(),
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

/// The fastest block kernel this CPU runs.
fn block_kernel() -> BlockFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return avx2::block;
        }
    }
    portable_block
}

/// The portable block kernel: [`dot_order`] per element.
///
/// # Safety
/// `x` points to `t * k` values, `w` to `n * k`, `out` to `t * n` writable values that no one
/// else accesses in columns `j0..j1`, and `j0 <= j1 <= n`.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_block(
    x: *const f32,
    t: usize,
    w: *const f32,
    n: usize,
    k: usize,
    j0: usize,
    j1: usize,
    out: *mut f32,
) {
    for r in 0..t {
        // SAFETY: row r of x and rows j of W lie inside the extents the caller guarantees.
        let xr = unsafe { std::slice::from_raw_parts(x.add(r * k), k) };
        for j in j0..j1 {
            // SAFETY: as above; out[r, j] is inside out and in this block's columns.
            unsafe {
                let wj = std::slice::from_raw_parts(w.add(j * k), k);
                *out.add(r * n + j) = dot_order(xr, wj);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 + FMA block kernel: register tiles of `R` rows by `C` columns, each output one
    //! 8-lane accumulator in [`super::dot_order`]'s order.

    use std::arch::x86_64::*;

    /// As [`super::portable_block`], with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`super::portable_block`], and the CPU has AVX2 and FMA.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(
        x: *const f32,
        t: usize,
        w: *const f32,
        n: usize,
        k: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        let mut r = 0;
        // SAFETY (every call below): rows r..r + R < t of x, columns j0..j1 of W and out,
        // within the caller's extents.
        while r + 4 <= t {
            unsafe { rows::<4, 2>(x, r, w, n, k, j0, j1, out) };
            r += 4;
        }
        match t - r {
            3 => unsafe { rows::<3, 2>(x, r, w, n, k, j0, j1, out) },
            2 => unsafe { rows::<2, 4>(x, r, w, n, k, j0, j1, out) },
            1 => unsafe { rows::<1, 8>(x, r, w, n, k, j0, j1, out) },
            _ => {}
        }
    }

    /// Rows `r..r + R`, columns `j0..j1`: tiles of `C` columns, then single columns.
    ///
    /// # Safety
    /// As [`block`], with `r + R <= t`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const R: usize, const C: usize>(
        x: *const f32,
        r: usize,
        w: *const f32,
        n: usize,
        k: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        // SAFETY (both loops): the tile's rows and columns are inside the caller's extents.
        unsafe {
            let xr = x.add(r * k);
            let mut j = j0;
            while j + C <= j1 {
                tile::<R, C>(xr, w.add(j * k), k, out.add(r * n + j), n);
                j += C;
            }
            while j < j1 {
                tile::<R, 1>(xr, w.add(j * k), k, out.add(r * n + j), n);
                j += 1;
            }
        }
    }

    /// `out[a * ldo + c] = x[a, ..k] · w[c, ..k]` for `a < R`, `c < C` (`x` and `w` row
    /// stride `k`), each in [`super::dot_order`]'s order.
    ///
    /// # Safety
    /// `x` points to `R * k` values, `w` to `C * k`, `out` to the `R x C` tile (row stride
    /// `ldo`); the CPU has AVX2 and FMA.
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc[a][c]: a register tile, indexed as one
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
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
                let wv = unsafe { _mm256_loadu_ps(w.add(c * k + i)) };
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
                // SAFETY: as for x.
                let wv = unsafe {
                    std::ptr::copy_nonoverlapping(w.add(c * k + full), buf.as_mut_ptr(), rem);
                    _mm256_loadu_ps(buf.as_ptr())
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

    /// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, as `super::combine`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        // (s0 + s2, s1 + s3, ..)
        let p = _mm_add_ps(s, _mm_movehl_ps(s, s));
        // (s0 + s2) + (s1 + s3)
        _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(n: usize, s: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *s ^= *s << 13;
                *s ^= *s >> 7;
                *s ^= *s << 17;
                ((*s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Every element of a `t`-row linear equals [`dot_order`] of its row and column, bit for
    /// bit, for every `t` (all register-tile shapes and their remainders), for `k` with and
    /// without a partial last group of eight, for `n` across one and several column blocks,
    /// on one thread and on a pool of three; and `dot_order` is a real dot product.
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
            let w = rnd(n * k, &mut s);
            let x = rnd(max_t * k, &mut s);
            let reference: Vec<f32> = (0..max_t)
                .flat_map(|r| {
                    let (x, w) = (&x, &w);
                    (0..n).map(move |j| dot_order(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]))
                })
                .collect();
            let exact: f64 = (0..k).map(|i| x[i] as f64 * w[i] as f64).sum();
            assert!((reference[0] as f64 - exact).abs() < 1e-4, "n={n} k={k}");
            for t in 1..=max_t {
                for threads in [1, 3] {
                    let mut out = vec![f32::NAN; t * n];
                    if threads == 1 {
                        linear(&x, t, &w, n, k, &mut out);
                    } else {
                        pool.install(|| linear(&x, t, &w, n, k, &mut out));
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&out) == bits(&reference[..t * n]),
                        "n={n} k={k} t={t} threads={threads}"
                    );
                }
            }
        }
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
