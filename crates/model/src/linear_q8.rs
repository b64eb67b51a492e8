//! A GGUF file's quantized matrices times activations quantized to 8 bits: llama.cpp's CPU
//! scheme (`ggml-cpu`'s `ggml_vec_dot_*_q8_0` and `*_q8_K`: integer products summed exactly,
//! few float operations), for the CPU backend's `--cpu-int8-activations` (its default).
//! [`crate::linear`] keeps the activations f32 and gives the bits of the f32 kernel over
//! ggml's dequantized matrix; this path gives that up for less vector work per weight: batch-1 decode
//! 1.1-2.5x faster; steps of 6+ tokens (prefill, large decode batches) run a panel kernel,
//! 1.3-2.5x faster than the f32 path at 64 tokens (bench/RESULTS.md, sessions 42-44).
//!
//! Activations. Each token's values are quantized per block: `amax` the block's largest
//! magnitude, `d = amax / 127`, `q = round_ties_even(x · (127 / amax))` (so `|q| <= 127`; a
//! block of zeros, or of values so small that `127 / amax` overflows, is all zeros), `d` kept
//! as f32. A block holding a NaN or an infinity gets `d = NaN`, so every output it meets is
//! NaN, as the f32 path's would be. Blocks are of 32 values for the types of blocks of 32
//! (llama.cpp's `block_q8_0`, whose `d` is f16), and of 256 for the K-quants and IQ4_XS
//! (`block_q8_K`, with the sum of each 16 `q`), whose integer sub-scales then multiply in
//! integers. The error against the f32 result is at most that of rounding each activation to
//! within `amax / 254` of its value (the tests check this bound on every type).
//!
//! Invariant, as [`crate::linear`]'s: `out[r, j]` is computed by one fixed sequence of
//! operations whatever the batch, the row's place in it, the register tile and the thread
//! count, and the AVX2 kernel and the portable reference ([`dot_reference`]) give the same
//! bits, so a machine without AVX2 gives the same tokens. The sequences, for x row `r` and W
//! row `j` (of its part's type):
//! - Blocks of 32 ([`IntRun`]: a run is `scale·v + min`): per run `b`, the exact i32 sum
//!   `isum_b = Σ_{i < 32} v[i]·q[i]` and `P_b = f32(isum_b)·(scale·d_b)`, for Q4_1 and Q5_1
//!   (one min a run) `Q_b = fma(min_b, s32_b, P_b)` with `s32_b = f32(Σ_32 q)·d_b`, for the
//!   other types `Q_b = P_b`; per group of 8 runs in order (past the row's end `Q = 0`),
//!   `acc = acc + (((Q_0 + Q_1) + (Q_2 + Q_3)) + ((Q_4 + Q_5) + (Q_6 + Q_7)))`; `out = acc`.
//! - Super-blocks of 256 ([`KInts`]: `d·sc·v + cm·mc` per 16 values): per super-block `b` in
//!   order, the exact i32 sum `isum = Σ_j sc[j]·Σ_{i in 16j..16j+16} v[i]·q[i]`, then
//!   `acc = fma(f32(isum), d·d_b, acc)`, and (not IQ4_XS)
//!   `accm = fma(f32(Σ_j mc[j]·bsum_j), cm·d_b, accm)`; `out = acc + accm` (IQ4_XS: `acc`).
//!
//! One float accumulator per output, so a kernel may hold eight W rows' outputs for one x
//! row in the lanes of one vector: the panel kernels of prefill-sized batches, whose W rows
//! are repacked so that one `maddubs` multiplies four values of each. The decode tiles of
//! the types of blocks of 32 fold each run's lane sums by `hadd` until one vector holds the
//! exact totals of four runs of two W rows, then take the products and the sum tree there.

#[allow(unused_imports)] // named by the documentation
use crate::gguf_quant::KInts;
use crate::gguf_quant::{GgmlType, IntRun, Mins};
use crate::linear::GgmlRows;

/// A batch of `t` activation rows of `k` values (`k` a multiple of 32) quantized to 8 bits
/// in blocks of 32, in super-blocks of 256, or both, as the matrix's parts need (see the
/// module documentation), with the sums the min terms read. Rows are independent: a row's
/// bytes do not depend on the others.
pub(crate) struct QuantRows {
    /// Values per row.
    k: usize,
    /// Blocks of 32 per row, `k / 32`.
    kb: usize,
    /// Groups of 8 blocks per row, `kb.div_ceil(8)` (the sums are padded to whole groups).
    kg: usize,
    /// `[t, k]` quants, `-127..=127`.
    q: Vec<i8>,
    /// `[t, 8 kg]` block scales `d`, zero past `kb`.
    d: Vec<f32>,
    /// `[t, 8 kg]`: `f32(Σ q)·d` per block, zero past `kb`.
    s32: Vec<f32>,
    /// `[t, 8 kg]`: `Σ q` per block, zero past `kb` (what a type whose decoded values carry
    /// an offset subtracts: Q4_0's 8, Q5_0's 16).
    qsum: Vec<i32>,
    /// `[t, k]` quants of the super-block format (one scale per 256 values, llama.cpp's
    /// `block_q8_K`), for the K-quants and IQ4_XS; empty when no part needs them.
    kq: Vec<i8>,
    /// `[t, k / 256]` super-block scales.
    kd: Vec<f32>,
    /// `[t, k / 16]` sums of each 16 `kq`.
    bsum: Vec<i16>,
}

impl QuantRows {
    /// Quantizes rows `0..t` of `x` (row stride `k`): in blocks of 32 when `per32`, and
    /// in super-blocks of 256 when `per256` (`k` then a multiple of 256).
    ///
    /// # Panics
    /// If `k` is not a multiple of 32 (or 256 with `per256`) or `x` has fewer than `t * k`
    /// values (a caller bug: quantized rows are whole blocks).
    pub(crate) fn new(x: &[f32], t: usize, k: usize, per32: bool, per256: bool) -> Self {
        assert!(k.is_multiple_of(32) && x.len() >= t * k);
        assert!(!per256 || k.is_multiple_of(256));
        let (kb, kg) = (k / 32, (k / 32).div_ceil(8));
        let n32 = if per32 { t } else { 0 };
        let n256 = if per256 { t } else { 0 };
        let mut qr = QuantRows {
            k,
            kb,
            kg,
            q: vec![0; n32 * k],
            d: vec![0.0; n32 * 8 * kg],
            s32: vec![0.0; n32 * 8 * kg],
            qsum: vec![0; n32 * 8 * kg],
            kq: vec![0; n256 * k],
            kd: vec![0.0; n256 * k / 256],
            bsum: vec![0; n256 * k / 16],
        };
        let sum = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>();
        for r in 0..n32 {
            for b in 0..kb {
                let xs = &x[r * k + 32 * b..r * k + 32 * b + 32];
                let q = &mut qr.q[r * k + 32 * b..r * k + 32 * b + 32];
                let d = quantize_any(xs, q);
                let qs = sum(q);
                qr.d[r * 8 * kg + b] = d;
                qr.qsum[r * 8 * kg + b] = qs;
                qr.s32[r * 8 * kg + b] = qs as f32 * d;
            }
        }
        for r in 0..n256 {
            for b in 0..k / 256 {
                let xs = &x[r * k + 256 * b..r * k + 256 * b + 256];
                let q = &mut qr.kq[r * k + 256 * b..r * k + 256 * b + 256];
                qr.kd[r * k / 256 + b] = quantize_any(xs, q);
                for (j, h) in q.chunks_exact(16).enumerate() {
                    qr.bsum[r * k / 16 + 16 * b + j] = sum(h) as i16;
                }
            }
        }
        qr
    }
}

/// [`quantize_block`] of `x` (a multiple of 32 values) into `q`, with AVX2 where the CPU has
/// it (the same bits).
fn quantize_any(x: &[f32], q: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert!(x.len().is_multiple_of(32) && q.len() == x.len());
        // SAFETY: the CPU has AVX2; x and q hold x.len() values each, a multiple of 32.
        return unsafe { avx2::quantize_block(x.as_ptr(), q.as_mut_ptr(), x.len()) };
    }
    quantize_block(x, q)
}

/// Quantizes a block of values (32, or 256 for the super-block format) into `q`, returning
/// the block's `d` (the module documentation's rule; [`avx2::quantize_block`] matches it bit
/// for bit).
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    if x.iter().any(|v| !v.is_finite()) {
        q.fill(0);
        return f32::NAN;
    }
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let id = 127.0 / amax;
    let id = if id.is_finite() { id } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * id).round_ties_even() as i8;
    }
    amax / 127.0
}

/// Whether [`gemv`] reads a matrix of these parts: every part quantized.
pub(crate) fn reads(parts: &[GgmlRows]) -> bool {
    parts.iter().all(|p| p.ty.is_quantized())
}

/// `out[r, j] (row stride n) = x[r, ..] · W[j]` for `r` in `r0..r1` (rows of `qx`) and `j`
/// in `j0..j1` (W's rows in `parts`, every one quantized: [`reads`]), each by the module
/// documentation's sequence.
///
/// # Safety
/// `out` points to at least `r1` rows of `n` writable values that no one else accesses in
/// columns `j0..j1`; `j1 <= n` is at most the parts' rows; the parts' rows are `qx`'s `k`
/// values each.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemv(
    parts: &[GgmlRows],
    qx: &QuantRows,
    r0: usize,
    r1: usize,
    n: usize,
    j0: usize,
    j1: usize,
    out: *mut f32,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            // SAFETY: the caller's extents; the CPU has the features.
            unsafe { avx2::gemv(parts, qx, r0, r1, n, j0, j1, out) };
            return;
        }
    }
    let mut first = 0;
    for p in parts {
        let rb = p.bytes.len() / p.rows.max(1);
        for j in j0.max(first)..j1.min(first + p.rows) {
            let row = &p.bytes[(j - first) * rb..(j - first + 1) * rb];
            for r in r0..r1 {
                // SAFETY: out[r, j] is the caller's (r < r1, j in j0..j1).
                unsafe { *out.add(r * n + j) = dot_reference(p.ty, row, qx, r) };
            }
        }
        first += p.rows;
    }
}

/// The reference of the module documentation's sequences: x row `r` of `qx` times `row`, a
/// row of the quantized type `ty` of `qx`'s `k` values; a type of blocks of 32 decoded a run
/// at a time by [`GgmlType::int_run`], a super-block type by [`dot_k_reference`].
///
/// # Panics
/// If `ty` is a float type or `row` is shorter than `k` values (caller bugs).
pub(crate) fn dot_reference(ty: GgmlType, row: &[u8], qx: &QuantRows, r: usize) -> f32 {
    if ty.super_blocks() {
        return dot_k_reference(ty, row, qx, r);
    }
    let (k, kb, kg) = (qx.k, qx.kb, qx.kg);
    assert!(ty.is_quantized(), "a quantized type");
    // Among the types of blocks of 32, Q4_1 and Q5_1 have mins, one a run.
    let mins = ty.mins() == Mins::Per32;
    let mut acc = 0f32;
    for g in 0..kg {
        let mut q8 = [0f32; 8];
        for (i, qb) in q8.iter_mut().enumerate() {
            let b = 8 * g + i;
            if b >= kb {
                break;
            }
            let IntRun { v, scale, min } = ty.int_run(row, b).expect("a quantized type");
            let d = qx.d[r * 8 * kg + b];
            let q = &qx.q[r * k + 32 * b..r * k + 32 * b + 32];
            let isum: i32 = v
                .iter()
                .zip(q)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
            let p = isum as f32 * (scale[0] * d);
            *qb = if mins {
                min[0].mul_add(qx.s32[r * 8 * kg + b], p)
            } else {
                p
            };
        }
        acc += ((q8[0] + q8[1]) + (q8[2] + q8[3])) + ((q8[4] + q8[5]) + (q8[6] + q8[7]));
    }
    acc
}

/// [`dot_reference`] for a super-block type ([`GgmlType::super_blocks`]): per super-block
/// `b` in order, the exact i32 sum `isum = Σ_j sc[j]·Σ_{i in 16j..16j+16} v[i]·q[i]`, then
/// `acc = fma(f32(isum), d·d_b, acc)`, and, for a type with min or offset coefficients,
/// `accm = fma(f32(Σ_j mc[j]·bsum_j), cm·d_b, accm)`; the result is `acc + accm` (IQ4_XS:
/// `acc`).
fn dot_k_reference(ty: GgmlType, row: &[u8], qx: &QuantRows, r: usize) -> f32 {
    let (k, nsb) = (qx.k, qx.k / 256);
    let mut acc = 0f32;
    let mut accm = 0f32;
    for b in 0..nsb {
        let ki = ty.k_ints(row, b).expect("a super-block type");
        let q = &qx.kq[r * k + 256 * b..r * k + 256 * b + 256];
        let dx = qx.kd[r * nsb + b];
        let isum: i32 = (0..16)
            .map(|j| {
                let p: i32 = (16 * j..16 * j + 16)
                    .map(|i| i32::from(ki.v[i]) * i32::from(q[i]))
                    .sum();
                i32::from(ki.sc[j]) * p
            })
            .sum();
        acc = (isum as f32).mul_add(ki.d * dx, acc);
        if ty != GgmlType::IQ4_XS {
            let moff: i32 = (0..16)
                .map(|j| i32::from(ki.mc[j]) * i32::from(qx.bsum[r * k / 16 + 16 * b + j]))
                .sum();
            accm = (moff as f32).mul_add(ki.cm * dx, accm);
        }
    }
    if ty == GgmlType::IQ4_XS {
        acc
    } else {
        acc + accm
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 kernel of [`super`]'s sequence: a run's 32 weights decoded once into a
    //! vector of signed bytes and a scale per half, then for each x row one
    //! `maddubs`/`madd` (32 byte products summed in fours, exactly) and one FMA.

    use super::QuantRows;
    use crate::gguf_quant::GgmlType;
    use crate::linear::avx2::{
        block_bytes, by_type, prefetch_block, q3_k_scales, small_blocks, IQ4_NL, IQ4_XS, Q2_K,
        Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
    };
    use std::arch::x86_64::*;

    /// [`super::quantize_block`] for AVX2, with the same bits: `x` and `q` point to `n`
    /// values each (a multiple of 32), one block; returns `d`.
    ///
    /// # Safety
    /// As above; the CPU has AVX2.
    #[allow(clippy::needless_range_loop)] // i[j] a register array
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(x: *const f32, q: *mut i8, n: usize) -> f32 {
        // SAFETY: the caller's n values each side; unaligned loads and stores. (Loops, not
        // closures: a closure may be compiled without the features.)
        unsafe {
            let sign = _mm256_set1_ps(-0.0);
            let inf = _mm256_set1_ps(f32::INFINITY);
            let mut m = _mm256_setzero_ps();
            let mut bad = 0;
            for i in 0..n / 8 {
                let a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(8 * i)));
                // Not (|x| < inf): NaN or infinite.
                bad |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
                m = _mm256_max_ps(m, a);
            }
            if bad != 0 {
                std::ptr::write_bytes(q, 0, n);
                return f32::NAN;
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let id = 127.0 / amax;
            let id = _mm256_set1_ps(if id.is_finite() { id } else { 0.0 });
            for c in 0..n / 32 {
                let mut i = [_mm256_setzero_si256(); 4];
                for j in 0..4 {
                    let v = _mm256_loadu_ps(x.add(32 * c + 8 * j));
                    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                        _mm256_mul_ps(v, id),
                    );
                    i[j] = _mm256_cvtps_epi32(r);
                }
                // packs interleave 128-bit lanes: bytes come out as 4-byte groups 0,2,4,6,1,
                // 3,5,7 of the values' eights; the permute puts them back in order.
                let p = _mm256_packs_epi16(
                    _mm256_packs_epi32(i[0], i[1]),
                    _mm256_packs_epi32(i[2], i[3]),
                );
                let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(q.add(32 * c).cast(), p);
            }
            amax / 127.0
        }
    }

    /// [`super::gemv`] with AVX2, FMA and F16C.
    ///
    /// # Safety
    /// As [`super::gemv`], and the CPU has the features.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv(
        parts: &[crate::linear::GgmlRows],
        qx: &QuantRows,
        r0: usize,
        r1: usize,
        n: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        let mut first = 0;
        for p in parts {
            let (lo, hi) = (j0.max(first), j1.min(first + p.rows));
            if lo < hi {
                type Part =
                    unsafe fn(&QuantRows, usize, usize, *const u8, usize, usize, *mut f32, usize);
                let Some(f): Option<Part> = by_type!(p.ty, |T| Some(part::<T>), None) else {
                    debug_assert!(false, "linear_q8 over a {:?} part", p.ty);
                    first += p.rows;
                    continue;
                };
                let rb = p.bytes.len() / p.rows;
                // SAFETY: rows lo - first..hi - first of the part, each qx.k values of its
                // type (rb bytes); out columns lo..hi ⊆ j0..j1, rows r0..r1, the caller's.
                unsafe {
                    f(
                        qx,
                        r0,
                        r1,
                        p.bytes.as_ptr().add((lo - first) * rb),
                        rb,
                        hi - lo,
                        out.add(lo),
                        n,
                    )
                };
            }
            first += p.rows;
        }
    }

    /// x rows `r0..r1` times `cols` W rows of type `T` at `w` (`rb` bytes each) into `out`
    /// (at the first column; row stride `n`): tiles of up to 4 x rows by 2 W rows, a W tile's
    /// runs decoded once per x tile.
    ///
    /// # Safety
    /// As [`gemv`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn part<const T: u8>(
        qx: &QuantRows,
        r0: usize,
        r1: usize,
        w: *const u8,
        rb: usize,
        cols: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut j = 0;
        // SAFETY (every call): W rows j.. < cols, x rows r.. < r1 and their out elements,
        // the caller's.
        unsafe {
            if r1 - r0 >= panel_rows::<T>() {
                while j + 8 <= cols {
                    panel::<T>(qx, r0, r1, w.add(j * rb), rb, out.add(j), n);
                    j += 8;
                }
            }
            while j < cols {
                let two = j + 2 <= cols;
                let mut r = r0;
                while r < r1 {
                    let o = out.add(r * n + j);
                    let (w0, w1) = (w.add(j * rb), w.add((j + 1) * rb));
                    let left = r1 - r;
                    match (left, two) {
                        (1, true) => tile_any::<T, 1, 2>(qx, r, [w0, w1], o, n),
                        (2, true) => tile_any::<T, 2, 2>(qx, r, [w0, w1], o, n),
                        (3, true) => tile_any::<T, 3, 2>(qx, r, [w0, w1], o, n),
                        (_, true) => tile_any::<T, 4, 2>(qx, r, [w0, w1], o, n),
                        (1, false) => tile_any::<T, 1, 1>(qx, r, [w0], o, n),
                        (2, false) => tile_any::<T, 2, 1>(qx, r, [w0], o, n),
                        (3, false) => tile_any::<T, 3, 1>(qx, r, [w0], o, n),
                        (_, false) => tile_any::<T, 4, 1>(qx, r, [w0], o, n),
                    }
                    r += left.min(4);
                }
                j += if two { 2 } else { 1 };
            }
        }
    }

    /// x rows from which a task runs the panel kernel ([`panel`]): below,
    /// the register tiles (which decode each run once per 4 x rows). On the 167M test files
    /// the two are even at 6 rows and the panel ahead from 8 (sessions 43 and 44), but
    /// Q6_K's repacking costs more (its quants are split over two arrays): its panel took
    /// 21-24 ms a step at 6-8 rows against the tiles' 18.5-22.6, and 28-30 at 12 against
    /// 32-33.
    const fn panel_rows<const T: u8>() -> usize {
        if T == Q6_K {
            10
        } else {
            6
        }
    }

    /// Bytes of one super-block of a panel of 8 W rows ([`pack_k`]): the quants, 8 runs of
    /// 8 chunks of `[row][4 values]` (2048); the integer scales, 16 vectors of `[row][2]`
    /// i16, each row's scale twice (512); the min coefficients, 8 vectors of `[row][2]` i16,
    /// a pair of sub-blocks per vector (256); then `d` and `cm` of the 8 rows as f32 (64).
    const PANEL_SB: usize = 2048 + 512 + 256 + 64;
    /// Offsets in a panel super-block: integer scales, min coefficients, `d`, `cm`.
    const P_SC: usize = 2048;
    const P_MC: usize = P_SC + 512;
    const P_D: usize = P_MC + 256;

    thread_local! {
        /// Per thread: the panel of [`panel`] (8 W rows, repacked).
        static PANEL: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
    }

    /// x rows `r0..r1` times 8 W rows of quantized type `T` at `w` (`rb` bytes each) into
    /// `out` (at the first of the 8 columns; row stride `ldo`), by [`super`]'s sequence: the
    /// W rows are repacked once ([`pack_k`], [`pack_q`]) so that each quant vector holds
    /// four values of each of the 8 rows, then every x row's 4-value groups are broadcast
    /// against them ([`rows_k`], [`rows_q`]): one `maddubs` makes 16 products for 8
    /// outputs, and the lanes of one float vector are the 8 outputs' accumulators
    /// (llama.cpp's repacked `gemm_q4_K_8x8_q8_K` layout, built per call instead of at load).
    ///
    /// # Safety
    /// `w` points to 8 rows of type `T` of `qx.k` values (`rb` bytes apart); x rows
    /// `r0..r1` exist in `qx` in `T`'s block format; `out` points to the `(r1 - r0) x 8`
    /// block (row stride `ldo`, first row r0 at `out + r0 * ldo`); the CPU has AVX2, FMA and
    /// F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn panel<const T: u8>(
        qx: &QuantRows,
        r0: usize,
        r1: usize,
        w: *const u8,
        rb: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let (nsb, kb) = (qx.k / 256, qx.kb);
        let mut buf = PANEL.take();
        buf.clear();
        buf.resize(
            if small_blocks::<T>() {
                kb * PANEL_RUN
            } else {
                nsb * PANEL_SB
            },
            0,
        );
        // SAFETY: the caller's rows, x rows and out block; buf holds the packed panel.
        unsafe {
            if small_blocks::<T>() {
                pack_q::<T>(w, rb, kb, buf.as_mut_ptr());
            } else {
                pack_k::<T>(w, rb, nsb, buf.as_mut_ptr());
            }
            panel_x_rows::<T>(qx, r0, r1, buf.as_ptr(), out, ldo);
        }
        PANEL.set(buf);
    }

    /// x rows `r0..r1` times a packed panel of type `T` ([`panel`]) into
    /// `out` (row stride `ldo`), up to 4 x rows at a time ([`rows_k`], [`rows_q`]).
    ///
    /// # Safety
    /// As [`panel`], with `panel` the packed W rows.
    #[inline(always)]
    unsafe fn panel_x_rows<const T: u8>(
        qx: &QuantRows,
        r0: usize,
        r1: usize,
        panel: *const u8,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut r = r0;
        // SAFETY (every call): x rows r..r + R < r1 and their out rows, the caller's.
        unsafe {
            while r < r1 {
                let o = out.add(r * ldo);
                macro_rules! rows {
                    ($n:literal) => {
                        if small_blocks::<T>() {
                            rows_q::<T, $n>(qx, r, panel, o, ldo)
                        } else {
                            rows_k::<T, $n>(qx, r, panel, o, ldo)
                        }
                    };
                }
                match r1 - r {
                    1 => rows!(1),
                    2 => rows!(2),
                    3 => rows!(3),
                    _ => rows!(4),
                }
                r += (r1 - r).min(4);
            }
        }
    }

    /// Repacks 8 W rows of super-block type `T` (at `w`, `rb` bytes apart, `nsb`
    /// super-blocks each) into `dst` in [`PANEL_SB`]'s layout: quants as [`runk`] decodes
    /// them (unsigned, offsets removed; IQ4_XS's signed levels), scales as [`kscales`].
    ///
    /// # Safety
    /// As [`panel`]; `dst` points to `nsb * PANEL_SB` writable bytes.
    #[allow(clippy::needless_range_loop)] // v[row], t[c]: register arrays
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pack_k<const T: u8>(w: *const u8, rb: usize, nsb: usize, dst: *mut u8) {
        let bb = block_bytes::<T>();
        // SAFETY: super-block blk of each of the 8 rows; dst's nsb super-blocks, written
        // unaligned.
        unsafe {
            let rows: [*const u8; 8] = [0, 1, 2, 3, 4, 5, 6, 7].map(|row| w.add(row * rb));
            for blk in 0..nsb {
                prefetch_block(&rows, bb, blk);
                let base = dst.add(blk * PANEL_SB);
                // Row `row`'s scales twice each, values 0..8 then 8..16 (i32 lanes), and its
                // min coefficients (i32 lane p: the pair 2p, 2p + 1).
                let mut lo = [_mm256_setzero_si256(); 8];
                let mut hi = [_mm256_setzero_si256(); 8];
                let mut mc = [_mm256_setzero_si256(); 8];
                let mut dc = [0f32; 16];
                for row in 0..8 {
                    let (s16, m16, d, cm) = kscales::<T>(rows[row].add(bb * blk));
                    // Quarters 0, 2 | 1, 3: unpacking the low (high) quarter of each half
                    // then gives values 0..8 (8..16), each twice.
                    let q = _mm256_permute4x64_epi64::<0b11_01_10_00>(s16);
                    lo[row] = _mm256_unpacklo_epi16(q, q);
                    hi[row] = _mm256_unpackhi_epi16(q, q);
                    mc[row] = m16;
                    (dc[row], dc[8 + row]) = (d, cm);
                }
                for s in 0..8 {
                    let mut v = [_mm256_setzero_si256(); 8];
                    for row in 0..8 {
                        v[row] = runk::<T>(rows[row].add(bb * blk), s);
                    }
                    let t = transpose8(v);
                    for c in 0..8 {
                        _mm256_storeu_si256(base.add(32 * (8 * s + c)).cast(), t[c]);
                    }
                }
                let (tl, th, tm) = (transpose8(lo), transpose8(hi), transpose8(mc));
                for j in 0..8 {
                    _mm256_storeu_si256(base.add(P_SC + 32 * j).cast(), tl[j]);
                    _mm256_storeu_si256(base.add(P_SC + 32 * (8 + j)).cast(), th[j]);
                    _mm256_storeu_si256(base.add(P_MC + 32 * j).cast(), tm[j]);
                }
                let dp = base.add(P_D).cast::<f32>();
                for (i, &v) in dc.iter().enumerate() {
                    dp.add(i).write_unaligned(v);
                }
            }
        }
    }

    /// The 8x8 transpose of 32-bit lanes: lane `i` of result `c` is lane `c` of `v[i]`.
    ///
    /// # Safety
    /// The CPU has AVX2 (inlined into a caller with it).
    #[inline(always)]
    unsafe fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
        // SAFETY: register operations, the caller's features.
        unsafe {
            let t0 = _mm256_unpacklo_epi32(v[0], v[1]);
            let t1 = _mm256_unpackhi_epi32(v[0], v[1]);
            let t2 = _mm256_unpacklo_epi32(v[2], v[3]);
            let t3 = _mm256_unpackhi_epi32(v[2], v[3]);
            let t4 = _mm256_unpacklo_epi32(v[4], v[5]);
            let t5 = _mm256_unpackhi_epi32(v[4], v[5]);
            let t6 = _mm256_unpacklo_epi32(v[6], v[7]);
            let t7 = _mm256_unpackhi_epi32(v[6], v[7]);
            // Rows 0-3 (u0..u3) and 4-7 (u4..u7) of dwords c | c + 4 for c = 0..4.
            let u0 = _mm256_unpacklo_epi64(t0, t2);
            let u1 = _mm256_unpackhi_epi64(t0, t2);
            let u2 = _mm256_unpacklo_epi64(t1, t3);
            let u3 = _mm256_unpackhi_epi64(t1, t3);
            let u4 = _mm256_unpacklo_epi64(t4, t6);
            let u5 = _mm256_unpackhi_epi64(t4, t6);
            let u6 = _mm256_unpacklo_epi64(t5, t7);
            let u7 = _mm256_unpackhi_epi64(t5, t7);
            [
                _mm256_permute2x128_si256::<0x20>(u0, u4),
                _mm256_permute2x128_si256::<0x20>(u1, u5),
                _mm256_permute2x128_si256::<0x20>(u2, u6),
                _mm256_permute2x128_si256::<0x20>(u3, u7),
                _mm256_permute2x128_si256::<0x31>(u0, u4),
                _mm256_permute2x128_si256::<0x31>(u1, u5),
                _mm256_permute2x128_si256::<0x31>(u2, u6),
                _mm256_permute2x128_si256::<0x31>(u3, u7),
            ]
        }
    }

    /// x rows `r..r + R` times a panel ([`pack_k`]) into `out` (row `r`'s 8 columns first,
    /// row stride `ldo`): per super-block and x row, each group of 4 values broadcast and
    /// multiplied by a quant vector (`maddubs`: 8 rows x 2 pairs), summed in i16 over a
    /// sub-block where that cannot overflow (Q6_K: over half of one; IQ4_XS, signed through
    /// `sign`: not at all), times the integer scales in `madd`, summed in i32; then one FMA
    /// for the 8 outputs, and the min/offset term by `madd` over pairs of sub-blocks.
    ///
    /// # Safety
    /// As [`panel`], with `panel` its packed super-blocks and x rows `r..r + R`.
    #[inline]
    #[allow(clippy::needless_range_loop)] // isum[a]: a register array
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_k<const T: u8, const R: usize>(
        qx: &QuantRows,
        r: usize,
        panel: *const u8,
        out: *mut f32,
        ldo: usize,
    ) {
        let (k, nsb) = (qx.k, qx.k / 256);
        let signed = T == IQ4_XS;
        let mut acc = [_mm256_setzero_ps(); R];
        let mut accm = [_mm256_setzero_ps(); R];
        let (xq, xd, bsum) = (qx.kq.as_ptr(), qx.kd.as_ptr(), qx.bsum.as_ptr());
        // SAFETY: the panel's nsb super-blocks; x rows r..r + R of qx's super-block format
        // at its layout's offsets (4-byte groups and pairs of i16 sums read unaligned).
        unsafe {
            for blk in 0..nsb {
                let base = panel.add(blk * PANEL_SB);
                let mut isum = [_mm256_setzero_si256(); R];
                for j in 0..16 {
                    let scj = _mm256_loadu_si256(base.add(P_SC + 32 * j).cast());
                    let mut s16 = [_mm256_setzero_si256(); R];
                    for c4 in 0..4 {
                        // Values 16j + 4c4.. : chunk 4(j % 2) + c4 of run j / 2.
                        let c = 4 * j + c4;
                        let wv = _mm256_loadu_si256(base.add(32 * c).cast());
                        let aw = if signed { _mm256_abs_epi8(wv) } else { wv };
                        for a in 0..R {
                            let xp = xq.add((r + a) * k + 256 * blk + 4 * c);
                            let xb = _mm256_set1_epi32(xp.cast::<i32>().read_unaligned());
                            if signed {
                                let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, wv));
                                isum[a] = _mm256_add_epi32(isum[a], _mm256_madd_epi16(p, scj));
                            } else {
                                s16[a] = _mm256_add_epi16(s16[a], _mm256_maddubs_epi16(wv, xb));
                                if T == Q6_K && c4 % 2 == 1 {
                                    // Two groups: 2·(2·63·127) < 2^15.
                                    isum[a] =
                                        _mm256_add_epi32(isum[a], _mm256_madd_epi16(s16[a], scj));
                                    s16[a] = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                    if !signed && T != Q6_K {
                        // Four groups: 4·(2·31·127) < 2^15 (Q5_K; the others less).
                        for a in 0..R {
                            isum[a] = _mm256_add_epi32(isum[a], _mm256_madd_epi16(s16[a], scj));
                        }
                    }
                }
                let dv = _mm256_loadu_ps(base.add(P_D).cast());
                let cmv = _mm256_loadu_ps(base.add(P_D + 32).cast());
                for a in 0..R {
                    let dx = _mm256_set1_ps(*xd.add((r + a) * nsb + blk));
                    let dd = _mm256_mul_ps(dv, dx);
                    acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[a]), dd, acc[a]);
                    if !signed {
                        let bs = bsum.add((r + a) * k / 16 + 16 * blk);
                        let mut mo = _mm256_setzero_si256();
                        for p in 0..8 {
                            let m = _mm256_loadu_si256(base.add(P_MC + 32 * p).cast());
                            let b = _mm256_set1_epi32(bs.add(2 * p).cast::<i32>().read_unaligned());
                            mo = _mm256_add_epi32(mo, _mm256_madd_epi16(m, b));
                        }
                        let cd = _mm256_mul_ps(cmv, dx);
                        accm[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mo), cd, accm[a]);
                    }
                }
            }
            for a in 0..R {
                let v = if signed {
                    acc[a]
                } else {
                    _mm256_add_ps(acc[a], accm[a])
                };
                _mm256_storeu_ps(out.add(a * ldo), v);
            }
        }
    }

    /// [`super::dot_k_reference`]'s sequence for an `R x C` tile: per super-block and run,
    /// one `maddubs` (unsigned quants by the activations' bytes) and one `madd` by the
    /// run's two integer scales per x row and W row, summed in i32 lanes over the
    /// super-block; then the lanes' exact total, one scalar FMA and the min/offset term.
    ///
    /// # Safety
    /// `rows` are rows of super-block type `T` of `qx.k` values; x rows `r..r + R` exist in
    /// `qx`; `out` points to the `R x C` tile (row stride `ldo`); the CPU has AVX2, FMA and
    /// F16C.
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc[a][c]: a register tile, indexed as one
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_k<const T: u8, const R: usize, const C: usize>(
        qx: &QuantRows,
        r: usize,
        rows: [*const u8; C],
        out: *mut f32,
        ldo: usize,
    ) {
        let (k, nsb) = (qx.k, qx.k / 256);
        let signed = T == IQ4_XS;
        let mut acc = [[0f32; C]; R];
        let mut accm = [[0f32; C]; R];
        let (xq, xd, bsum) = (qx.kq.as_ptr(), qx.kd.as_ptr(), qx.bsum.as_ptr());
        // SAFETY (the reads below): super-blocks of rows inside their k values, x rows
        // r..r + R of qx's super-block format, at the offsets of its layout.
        unsafe {
            for blk in 0..nsb {
                let bb = block_bytes::<T>();
                prefetch_block(&rows, bb, blk);
                let mut sc = [[0i16; 16]; C];
                let mut mc = [_mm256_setzero_si256(); C];
                let mut dw = [(0f32, 0f32); C];
                for c in 0..C {
                    let s16;
                    (s16, mc[c], dw[c].0, dw[c].1) = kscales::<T>(rows[c].add(bb * blk));
                    _mm256_storeu_si256(sc[c].as_mut_ptr().cast(), s16);
                }
                let mut isum = [[_mm256_setzero_si256(); C]; R];
                for s in 0..8 {
                    let mut v = [_mm256_setzero_si256(); C];
                    let mut av = [_mm256_setzero_si256(); C];
                    let mut scv = [_mm256_setzero_si256(); C];
                    for c in 0..C {
                        v[c] = runk::<T>(rows[c].add(bb * blk), s);
                        av[c] = if signed { _mm256_abs_epi8(v[c]) } else { v[c] };
                        scv[c] = _mm256_set_m128i(
                            _mm_set1_epi16(sc[c][2 * s + 1]),
                            _mm_set1_epi16(sc[c][2 * s]),
                        );
                    }
                    for a in 0..R {
                        let xv =
                            _mm256_loadu_si256(xq.add((r + a) * k + 256 * blk + 32 * s).cast());
                        for c in 0..C {
                            let sx = if signed {
                                _mm256_sign_epi8(xv, v[c])
                            } else {
                                xv
                            };
                            let p = _mm256_maddubs_epi16(av[c], sx);
                            isum[a][c] = _mm256_add_epi32(isum[a][c], _mm256_madd_epi16(p, scv[c]));
                        }
                    }
                }
                for a in 0..R {
                    let dx = *xd.add((r + a) * nsb + blk);
                    let bs = _mm256_loadu_si256(bsum.add((r + a) * k / 16 + 16 * blk).cast());
                    for c in 0..C {
                        let total = hsum_epi32(isum[a][c]) as f32;
                        acc[a][c] = total.mul_add(dw[c].0 * dx, acc[a][c]);
                        if !signed {
                            let moff = hsum_epi32(_mm256_madd_epi16(mc[c], bs));
                            accm[a][c] = (moff as f32).mul_add(dw[c].1 * dx, accm[a][c]);
                        }
                    }
                }
            }
            for a in 0..R {
                for c in 0..C {
                    let v = if signed {
                        acc[a][c]
                    } else {
                        acc[a][c] + accm[a][c]
                    };
                    *out.add(a * ldo + c) = v;
                }
            }
        }
    }

    /// [`GgmlType::k_scales`] of the super-block at `sb` of type `T` in vectors: the 16
    /// integer scales and min coefficients as i16 lanes, then `d` and `cm` (the same
    /// integers and floats: tested against the reference through the kernel).
    ///
    /// # Safety
    /// `sb` points to a whole super-block of type `T`; the CPU has AVX2 and F16C.
    #[inline(always)]
    unsafe fn kscales<const T: u8>(sb: *const u8) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: the super-block's bytes, at ggml's struct offsets.
        unsafe {
            if T == Q4_K || T == Q5_K {
                // `scale_min_k4` four at a time in u32s (llama.cpp's `utmp` masks).
                let u0 = sb.add(4).cast::<u32>().read_unaligned();
                let u1 = sb.add(8).cast::<u32>().read_unaligned();
                let u2 = sb.add(12).cast::<u32>().read_unaligned();
                let (m6, m4, m2) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
                let sc = [u0 & m6, (u2 & m4) | (((u0 >> 6) & m2) << 4)];
                let mn = [u1 & m6, ((u2 >> 4) & m4) | (((u1 >> 6) & m2) << 4)];
                (
                    bytes8_twice(sc),
                    bytes8_twice(mn),
                    f16c_at(sb),
                    -f16c_at(sb.add(2)),
                )
            } else if T == Q6_K {
                let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(sb.add(192).cast()));
                let d = f16c_at(sb.add(208));
                (sc, _mm256_slli_epi16::<5>(sc), d, -d)
            } else if T == Q2_K {
                let v = _mm_loadu_si128(sb.cast());
                let low = _mm_set1_epi8(0x0F);
                let sc = _mm256_cvtepu8_epi16(_mm_and_si128(v, low));
                let mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(v), low));
                (sc, mn, f16c_at(sb.add(80)), -f16c_at(sb.add(82)))
            } else if T == Q3_K {
                let sc = _mm256_cvtepi8_epi16(q3_k_scales(sb.add(96)));
                let d = f16c_at(sb.add(108));
                (sc, _mm256_slli_epi16::<2>(sc), d, -d)
            } else {
                // IQ4_XS: eight 6-bit scales less 32, one per 32 values.
                let head = std::slice::from_raw_parts(sb, 8);
                let mut s8 = [0i16; 8];
                for (g, o) in s8.iter_mut().enumerate() {
                    *o = crate::gguf_quant::iq4_xs_scale(g, head) as i16;
                }
                let sc = twice(_mm_loadu_si128(s8.as_ptr().cast()));
                (sc, _mm256_setzero_si256(), f16c_at(sb), 0.0)
            }
        }
    }

    /// Each of the eight i16 lanes of `v` twice: `[a0, a0, a1, a1, ..., a7, a7]`.
    ///
    /// # Safety
    /// The CPU has AVX2 (inlined into a caller with it).
    #[inline(always)]
    unsafe fn twice(v: __m128i) -> __m256i {
        // SAFETY: register operations, the caller's features.
        unsafe { _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v)) }
    }

    /// The eight bytes of `v[0]` then `v[1]` (little-endian), widened to i16 lanes, each
    /// twice ([`twice`]).
    ///
    /// # Safety
    /// The CPU has AVX2 (inlined into a caller with it).
    #[inline(always)]
    unsafe fn bytes8_twice(v: [u32; 2]) -> __m256i {
        let b = (u64::from(v[1]) << 32 | u64::from(v[0])) as i64;
        // SAFETY: register operations, the caller's features.
        unsafe { twice(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(b))) }
    }

    /// The sum of the eight i32 lanes of `v` (exact, wrapping never: the callers' sums fit).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum_epi32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// Run `s` (values `32s..32s + 32`) of the super-block at `sb` of type `T`, as
    /// [`GgmlType::k_ints`] gives its `v`: unsigned, offsets removed (IQ4_XS: its signed
    /// levels).
    ///
    /// # Safety
    /// `sb` points to a whole super-block of type `T`; the CPU has AVX2.
    #[inline(always)]
    unsafe fn runk<const T: u8>(sb: *const u8, s: usize) -> __m256i {
        let nib = _mm256_set1_epi8(0x0F);
        // SAFETY: the super-block's bytes, at ggml's struct offsets.
        unsafe {
            if T == Q2_K || T == Q3_K {
                // Run s = 4n + j of half n: bits 2j.. of the 32 bytes; Q3_K plus 4 where bit
                // s of hmask is set (ggml's value less 4 where it is clear, offset-free).
                let (n, j) = (s / 4, s % 4);
                let qs = sb.add(if T == Q2_K { 16 } else { 32 } + 32 * n);
                let v = _mm256_srl_epi16(
                    _mm256_loadu_si256(qs.cast()),
                    _mm_cvtsi32_si128(2 * j as i32),
                );
                let q = _mm256_and_si256(v, _mm256_set1_epi8(3));
                if T == Q3_K {
                    let hm = _mm256_loadu_si256(sb.cast());
                    let bit = _mm256_set1_epi8((1u8 << s) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                    _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(4)))
                } else {
                    q
                }
            } else if T == Q4_K || T == Q5_K {
                let qs = sb.add(if T == Q4_K { 16 } else { 48 } + 32 * (s / 2));
                let v = _mm256_loadu_si256(qs.cast());
                let v = if s.is_multiple_of(2) {
                    v
                } else {
                    _mm256_srli_epi16::<4>(v)
                };
                let q = _mm256_and_si256(v, nib);
                if T == Q5_K {
                    let qh = _mm256_loadu_si256(sb.add(16).cast());
                    let bit = _mm256_set1_epi8((1u8 << s) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)))
                } else {
                    q
                }
            } else if T == Q6_K {
                let (n, r) = (s / 4, s % 4);
                let ql = _mm256_loadu_si256(sb.add(64 * n + 32 * (r & 1)).cast());
                let ql = if r / 2 == 0 {
                    ql
                } else {
                    _mm256_srli_epi16::<4>(ql)
                };
                let lo = _mm256_and_si256(ql, nib);
                let qh = _mm256_loadu_si256(sb.add(128 + 32 * n).cast());
                let qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r as i32));
                let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(3)));
                _mm256_or_si256(lo, hi)
            } else {
                // IQ4_XS.
                _mm256_shuffle_epi8(iq4_levels(), split16(sb.add(8 + 16 * s)))
            }
        }
    }

    /// [`tile_q`] for a type of blocks of 32 (a single W row paired with itself, its copy
    /// not written), [`tile_k`] for a super-block type.
    ///
    /// # Safety
    /// As [`tile_k`].
    #[inline(always)]
    unsafe fn tile_any<const T: u8, const R: usize, const C: usize>(
        qx: &QuantRows,
        r: usize,
        rows: [*const u8; C],
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: the caller's.
        unsafe {
            if small_blocks::<T>() {
                tile_q::<T, R>(qx, r, [rows[0], rows[C - 1]], C == 2, out, ldo)
            } else {
                tile_k::<T, R, C>(qx, r, rows, out, ldo)
            }
        }
    }

    /// The f16 at `p` (little-endian, unaligned) as f32, by F16C's `vcvtph2ps` from a
    /// register that `vmovd` wrote whole. [`crate::linear`]'s `f16_at` goes through `half`'s
    /// run-time feature check instead, which made Q4_0 and Q4_1 steps 1.3x slower here at 1
    /// and 4 tokens; and given `_mm_cvtsi32_si128`, the compiler loads the bits by `vpinsrw`
    /// into whatever register it likes, keeping that register's other lanes, so the
    /// conversion waits on its last writer (an accumulator in Q6_K's tile: 10 % slower at
    /// batch 1; session 44).
    ///
    /// # Safety
    /// `p` points to 2 readable bytes; the CPU has F16C (inlined into a caller with it).
    #[inline(always)]
    unsafe fn f16c_at(p: *const u8) -> f32 {
        // SAFETY: the caller's two bytes and features; `vmovd` only writes `h`.
        unsafe {
            let bits = u32::from(p.cast::<u16>().read_unaligned());
            let h: __m128i;
            std::arch::asm!(
                "vmovd {h}, {b:e}",
                h = out(xmm_reg) h,
                b = in(reg) bits,
                options(pure, nomem, nostack, preserves_flags)
            );
            _mm_cvtss_f32(_mm_cvtph_ps(h))
        }
    }

    /// Whether type `T`'s decoded bytes are signed (products through `sign`), not
    /// unsigned (with a min, or an [`offset`]).
    const fn signed<const T: u8>() -> bool {
        !matches!(T, Q4_0 | Q4_1 | Q5_0 | Q5_1)
    }

    /// What [`runq`]'s bytes of type `T` exceed ggml's values by: Q4_0's nibbles and Q5_0's
    /// 5-bit values are taken unsigned (`maddubs` needs no `sign` then), and a run's exact
    /// total is `Σ u·x − offset·Σ x` ([`QuantRows`]'s `qsum`).
    const fn offset<const T: u8>() -> i32 {
        match T {
            Q4_0 => 8,
            Q5_0 => 16,
            _ => 0,
        }
    }

    /// `v` times [`offset`] (8 or 16: a shift).
    ///
    /// # Safety
    /// The CPU has AVX2 (inlined into a caller with it).
    #[inline(always)]
    unsafe fn times_offset<const T: u8>(v: __m256i) -> __m256i {
        // SAFETY: register operations, the caller's features.
        unsafe {
            match offset::<T>() {
                8 => _mm256_slli_epi32::<3>(v),
                16 => _mm256_slli_epi32::<4>(v),
                o => _mm256_mullo_epi32(v, _mm256_set1_epi32(o)),
            }
        }
    }

    /// The 8 i32 lane sums of run `v` (decoded by [`runq`], `av` its absolute values for a
    /// signed type) times the x run `xv`: `maddubs` (through `sign` for a signed type), then
    /// `madd` with ones.
    ///
    /// # Safety
    /// The CPU has AVX2 (inlined into a caller with it).
    #[inline(always)]
    unsafe fn run_dot<const T: u8>(v: __m256i, av: __m256i, xv: __m256i) -> __m256i {
        // SAFETY: register operations, the caller's features.
        unsafe {
            let pr = if signed::<T>() {
                _mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v))
            } else {
                _mm256_maddubs_epi16(v, xv)
            };
            _mm256_madd_epi16(pr, _mm256_set1_epi16(1))
        }
    }

    /// `out[a * ldo + c] = x row r + a · W row c` for `a < R` and the two W rows `rows` (the
    /// second not written unless `both`), by [`super`]'s sequence for a type of blocks of 32,
    /// four runs at a time ([`quad_q`]), each group's two quads added in the lanes of W rows
    /// 0 and 1.
    ///
    /// # Safety
    /// `rows` are rows of type `T` of `qx.k` values; x rows `r..r + R` exist in `qx`; `out`
    /// points to the `R x 2` tile (row stride `ldo`; only its first column unless `both`);
    /// the CPU has AVX2, FMA and F16C.
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc[a]: register arrays indexed by x row
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q<const T: u8, const R: usize>(
        qx: &QuantRows,
        r: usize,
        rows: [*const u8; 2],
        both: bool,
        out: *mut f32,
        ldo: usize,
    ) {
        // Lanes 0 and 1: W rows 0 and 1.
        let mut acc = [_mm_setzero_ps(); R];
        // SAFETY (the reads below): blocks of rows inside their k values, x rows r..r + R of
        // qx (q, and d and the sums padded to whole groups), at the offsets of the struct's
        // layout.
        unsafe {
            for g in 0..qx.kg {
                let q0 = quad_q::<T, R>(qx, r, rows, 8 * g);
                let q1 = quad_q::<T, R>(qx, r, rows, 8 * g + 4);
                for a in 0..R {
                    acc[a] = _mm_add_ps(acc[a], _mm_add_ps(q0[a], q1[a]));
                }
            }
            for a in 0..R {
                *out.add(a * ldo) = _mm_cvtss_f32(acc[a]);
                if both {
                    *out.add(a * ldo + 1) = _mm_cvtss_f32(_mm_movehdup_ps(acc[a]));
                }
            }
        }
    }

    /// Per x row `r + a`, run `b`'s lane sums ([`run_dot`]) for W rows `rows` folded by
    /// `hadd`, with the two rows' scales and mins; zeros past the row's end.
    ///
    /// # Safety
    /// As [`tile_q`].
    #[inline(always)]
    unsafe fn fold_q<const T: u8, const R: usize>(
        qx: &QuantRows,
        r: usize,
        rows: [*const u8; 2],
        b: usize,
    ) -> ([__m256i; R], [f32; 2], [f32; 2]) {
        let mut h = [_mm256_setzero_si256(); R];
        if b >= qx.kb {
            return (h, [0.0; 2], [0.0; 2]);
        }
        // SAFETY: the caller's rows (run b inside them) and x rows.
        unsafe {
            prefetch_block(&rows, block_bytes::<T>(), b);
            let (v0, s0, m0) = runq::<T>(rows[0], b);
            let (v1, s1, m1) = runq::<T>(rows[1], b);
            let abs = |v| if signed::<T>() { _mm256_abs_epi8(v) } else { v };
            let (a0, a1) = (abs(v0), abs(v1));
            for (a, ha) in h.iter_mut().enumerate() {
                let xv = _mm256_loadu_si256(qx.q.as_ptr().add((r + a) * qx.k + 32 * b).cast());
                *ha = _mm256_hadd_epi32(run_dot::<T>(v0, a0, xv), run_dot::<T>(v1, a1, xv));
            }
            (h, [s0, s1], [m0, m1])
        }
    }

    /// Per x row, lanes 0 and 1: W rows 0 and 1's `(Q_b + Q_{b+1}) + (Q_{b+2} + Q_{b+3})`
    /// ([`super`]'s sequence), from the exact totals of the four runs of both rows in the
    /// lanes of one vector; zero past the row's end.
    ///
    /// # Safety
    /// As [`tile_q`], with `b` a multiple of 4.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // t01[a]: register arrays indexed by x row
    unsafe fn quad_q<const T: u8, const R: usize>(
        qx: &QuantRows,
        r: usize,
        rows: [*const u8; 2],
        b: usize,
    ) -> [__m128; R] {
        let mut q = [_mm_setzero_ps(); R];
        if b >= qx.kb {
            return q;
        }
        let mins = matches!(T, Q4_1 | Q5_1);
        let kg = qx.kg;
        // SAFETY: the caller's rows and x rows; x's d and sums are padded to whole groups
        // of 8 runs.
        unsafe {
            let (h0, s0, m0) = fold_q::<T, R>(qx, r, rows, b);
            let (h1, s1, m1) = fold_q::<T, R>(qx, r, rows, b + 1);
            let mut t01 = [_mm256_setzero_si256(); R];
            for a in 0..R {
                t01[a] = _mm256_hadd_epi32(h0[a], h1[a]);
            }
            let (h2, s2, m2) = fold_q::<T, R>(qx, r, rows, b + 2);
            let (h3, s3, m3) = fold_q::<T, R>(qx, r, rows, b + 3);
            let ws = _mm256_setr_ps(s0[0], s0[1], s1[0], s1[1], s2[0], s2[1], s3[0], s3[1]);
            let wm = _mm256_setr_ps(m0[0], m0[1], m1[0], m1[1], m2[0], m2[1], m3[0], m3[1]);
            let twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            for a in 0..R {
                // Lanes: (row 0, run b), (1, b), (0, b + 1), ..., (1, b + 3).
                let t23 = _mm256_hadd_epi32(h2[a], h3[a]);
                let tot = _mm256_add_epi32(
                    _mm256_permute2x128_si256::<0x20>(t01[a], t23),
                    _mm256_permute2x128_si256::<0x31>(t01[a], t23),
                );
                // x's d and sums of runs b..b + 4, each twice.
                let at = (r + a) * 8 * kg + b;
                let tot = if offset::<T>() != 0 {
                    let qs =
                        _mm256_castsi128_si256(_mm_loadu_si128(qx.qsum.as_ptr().add(at).cast()));
                    _mm256_sub_epi32(
                        tot,
                        times_offset::<T>(_mm256_permutevar8x32_epi32(qs, twice)),
                    )
                } else {
                    tot
                };
                let dx = _mm256_castps128_ps256(_mm_loadu_ps(qx.d.as_ptr().add(at)));
                let sd = _mm256_mul_ps(ws, _mm256_permutevar8x32_ps(dx, twice));
                let p = _mm256_mul_ps(_mm256_cvtepi32_ps(tot), sd);
                let qa = if mins {
                    let sx = _mm256_castps128_ps256(_mm_loadu_ps(qx.s32.as_ptr().add(at)));
                    _mm256_fmadd_ps(wm, _mm256_permutevar8x32_ps(sx, twice), p)
                } else {
                    p
                };
                // Lanes 0, 1 and 4, 5: the pairs' sums; then the two pairs'.
                let pairs = _mm256_add_ps(qa, _mm256_permute_ps::<0b1110>(qa));
                q[a] = _mm_add_ps(
                    _mm256_castps256_ps128(pairs),
                    _mm256_extractf128_ps::<1>(pairs),
                );
            }
        }
        q
    }

    /// Bytes of one run of a panel of 8 W rows of a type of blocks of 32 ([`pack_q`]): the
    /// quants, 8 chunks of `[row][4 values]` as [`runq`] decodes them (256), then the 8
    /// rows' scales and mins as f32 (64).
    const PANEL_RUN: usize = 256 + 64;

    /// Chunks of 4 values whose `maddubs` pairs type `T` may sum in i16 before `madd`:
    /// `chunks·2·max|v|·127 < 2^15` (`v` as [`runq`] decodes it: Q4_0 and Q4_1 up to 15,
    /// Q5_0 and Q5_1 up to 31).
    const fn chunks16<const T: u8>() -> usize {
        match T {
            Q4_0 | Q4_1 => 8,
            Q5_0 | Q5_1 => 4,
            _ => 1,
        }
    }

    /// Repacks 8 W rows of type `T` (a type of blocks of 32; at `w`, `rb` bytes apart, `kb`
    /// runs each) into `dst` in [`PANEL_RUN`]'s layout: each run's quants as [`runq`]
    /// decodes them, as 4-value groups of the 8 rows ([`transpose8`]), then the rows' scales
    /// and mins.
    ///
    /// # Safety
    /// As [`panel`]; `dst` points to `kb * PANEL_RUN` writable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pack_q<const T: u8>(w: *const u8, rb: usize, kb: usize, dst: *mut u8) {
        // SAFETY: run b of each of the 8 rows; dst's kb runs, written unaligned.
        unsafe {
            for b in 0..kb {
                let mut v = [_mm256_setzero_si256(); 8];
                let mut sm = [0f32; 16];
                for row in 0..8 {
                    (v[row], sm[row], sm[8 + row]) = runq::<T>(w.add(row * rb), b);
                }
                let t = transpose8(v);
                let base = dst.add(b * PANEL_RUN);
                for (c, tc) in t.iter().enumerate() {
                    _mm256_storeu_si256(base.add(32 * c).cast(), *tc);
                }
                for (i, &x) in sm.iter().enumerate() {
                    base.add(256).cast::<f32>().add(i).write_unaligned(x);
                }
            }
        }
    }

    /// x rows `r..r + R` times a panel of a type of blocks of 32 ([`pack_q`]) into `out`
    /// (row `r`'s 8 columns first, row stride `ldo`): per run and x row, each group of 4
    /// values broadcast against a quant vector (`maddubs`, through `sign` for the signed
    /// types), summed in i16 over [`chunks16`] chunks, then `madd`; the run's products and
    /// mins for the 8 outputs in one vector, and the group's sum tree kept as partial sums.
    ///
    /// # Safety
    /// As [`panel`], with `panel` its packed runs and x rows `r..r + R`.
    #[inline]
    #[allow(clippy::needless_range_loop)] // isum[a]: a register array
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_q<const T: u8, const R: usize>(
        qx: &QuantRows,
        r: usize,
        panel: *const u8,
        out: *mut f32,
        ldo: usize,
    ) {
        let (k, kb, kg) = (qx.k, qx.kb, qx.kg);
        let mins = matches!(T, Q4_1 | Q5_1);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        // The group's pending sums: the last even run's Q, the last pair's sum, the first
        // four's sum.
        let mut one = [_mm256_setzero_ps(); R];
        let mut two = [_mm256_setzero_ps(); R];
        let mut four = [_mm256_setzero_ps(); R];
        let (xq, xd, s32) = (qx.q.as_ptr(), qx.d.as_ptr(), qx.s32.as_ptr());
        // SAFETY: the panel's kb runs; x rows r..r + R of qx (q, and d and the sums padded
        // to whole groups) at its layout's offsets (4-byte groups read unaligned).
        unsafe {
            for g in 0..kg {
                for i in 0..8 {
                    let b = 8 * g + i;
                    let mut q = [_mm256_setzero_ps(); R];
                    if b < kb {
                        let base = panel.add(b * PANEL_RUN);
                        let mut isum = [_mm256_setzero_si256(); R];
                        let mut s16 = [_mm256_setzero_si256(); R];
                        for c in 0..8 {
                            let wv = _mm256_loadu_si256(base.add(32 * c).cast());
                            let aw = if signed::<T>() {
                                _mm256_abs_epi8(wv)
                            } else {
                                wv
                            };
                            for a in 0..R {
                                let xp = xq.add((r + a) * k + 32 * b + 4 * c);
                                let xb = _mm256_set1_epi32(xp.cast::<i32>().read_unaligned());
                                let pr = if signed::<T>() {
                                    _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, wv))
                                } else {
                                    _mm256_maddubs_epi16(wv, xb)
                                };
                                s16[a] = _mm256_add_epi16(s16[a], pr);
                                if (c + 1) % chunks16::<T>() == 0 {
                                    isum[a] =
                                        _mm256_add_epi32(isum[a], _mm256_madd_epi16(s16[a], ones));
                                    s16[a] = _mm256_setzero_si256();
                                }
                            }
                        }
                        let sv = _mm256_loadu_ps(base.add(256).cast());
                        let mv = _mm256_loadu_ps(base.add(288).cast());
                        if offset::<T>() != 0 {
                            for a in 0..R {
                                let qs = *qx.qsum.as_ptr().add((r + a) * 8 * kg + b);
                                isum[a] = _mm256_sub_epi32(
                                    isum[a],
                                    _mm256_set1_epi32(offset::<T>() * qs),
                                );
                            }
                        }
                        for a in 0..R {
                            let d = _mm256_set1_ps(*xd.add((r + a) * 8 * kg + b));
                            let pv =
                                _mm256_mul_ps(_mm256_cvtepi32_ps(isum[a]), _mm256_mul_ps(sv, d));
                            q[a] = if mins {
                                let s = _mm256_set1_ps(*s32.add((r + a) * 8 * kg + b));
                                _mm256_fmadd_ps(mv, s, pv)
                            } else {
                                pv
                            };
                        }
                    }
                    for a in 0..R {
                        match i {
                            1 | 5 => two[a] = _mm256_add_ps(one[a], q[a]),
                            3 => four[a] = _mm256_add_ps(two[a], _mm256_add_ps(one[a], q[a])),
                            7 => {
                                let last = _mm256_add_ps(two[a], _mm256_add_ps(one[a], q[a]));
                                acc[a] = _mm256_add_ps(acc[a], _mm256_add_ps(four[a], last));
                            }
                            _ => one[a] = q[a],
                        }
                    }
                }
            }
            for a in 0..R {
                _mm256_storeu_ps(out.add(a * ldo), acc[a]);
            }
        }
    }

    /// Run `b` of a row of type `T` (a type of blocks of 32) as [`GgmlType::int_run`] gives
    /// it plus [`offset`]: the 32 bytes `v`, its scale, and, for Q4_1 and Q5_1, its min.
    ///
    /// # Safety
    /// The row holds run `b` of type `T`; the CPU has AVX2 and F16C.
    #[inline(always)]
    unsafe fn runq<const T: u8>(row: *const u8, b: usize) -> (__m256i, f32, f32) {
        // SAFETY (the block reads below): block b of the row, inside it by the caller's
        // guarantee; offsets are those of ggml's block structs.
        unsafe {
            let blk = row.add(block_bytes::<T>() * b);
            let d = f16c_at(blk);
            if T == Q8_0 {
                (_mm256_loadu_si256(blk.add(2).cast()), d, 0.0)
            } else if T == Q4_0 {
                (split16(blk.add(2)), d, 0.0)
            } else if T == IQ4_NL {
                (
                    _mm256_shuffle_epi8(iq4_levels(), split16(blk.add(2))),
                    d,
                    0.0,
                )
            } else if T == Q4_1 {
                (split16(blk.add(4)), d, f16c_at(blk.add(2)))
            } else if T == Q5_0 || T == Q5_1 {
                // Bit i of the u32 qh is bit 4 of value i: byte i of the broadcast holds
                // qh's byte i / 8 (within each 128-bit lane, which holds all four), tested
                // against bit i % 8.
                let at = if T == Q5_0 { 2 } else { 4 };
                let qh = _mm256_set1_epi32(blk.add(at).cast::<i32>().read_unaligned());
                let spread = _mm256_shuffle_epi8(
                    qh,
                    _mm256_setr_epi64x(
                        0,
                        0x0101_0101_0101_0101,
                        0x0202_0202_0202_0202,
                        0x0303_0303_0303_0303,
                    ),
                );
                let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
                let v = _mm256_or_si256(
                    split16(blk.add(at + 4)),
                    _mm256_and_si256(set, _mm256_set1_epi8(16)),
                );
                if T == Q5_0 {
                    (v, d, 0.0)
                } else {
                    (v, d, f16c_at(blk.add(2)))
                }
            } else {
                unreachable!("runq of a super-block type")
            }
        }
    }

    /// The 16 bytes at `p` split into 32 nibbles: the low ones values 0..16, the high ones
    /// 16..32 (ggml's layout of a 32-value run's 4-bit quants).
    ///
    /// # Safety
    /// `p` points to 16 readable bytes; the CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn split16(p: *const u8) -> __m256i {
        // SAFETY: the caller's 16 bytes; an unaligned load, broadcast to both 128-bit lanes
        // by the load itself (`vbroadcasti128`), then the upper lane's 64-bit halves
        // shifted by 4 (no lane crossing: one shift, not a shift and an insert).
        let v = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast())) };
        _mm256_and_si256(
            _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)),
            _mm256_set1_epi8(0x0F),
        )
    }

    /// IQ4's 16-level table for `_mm256_shuffle_epi8`: a nibble `q` in either 128-bit lane
    /// looks up `IQ4_LEVELS[q]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn iq4_levels() -> __m256i {
        // SAFETY: IQ4_LEVELS is 16 bytes.
        let l = unsafe { _mm_loadu_si128(crate::gguf_quant::IQ4_LEVELS.as_ptr().cast()) };
        _mm256_set_m128i(l, l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::{dequantized, linear, random_ggml, rnd, Store};

    /// The quantized types, each once.
    fn quantized() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.into_iter().filter(|t| t.is_quantized())
    }

    /// Activation quantization: the rule of the module documentation, checked on values
    /// chosen to hit its edges (ties, zeros, tiny and huge magnitudes, NaN and infinities),
    /// and the AVX2 quantizer equal to the scalar one bit for bit.
    #[test]
    fn activation_blocks_follow_the_rule_on_every_path() {
        let mut s = 7u64;
        let mut blocks: Vec<Vec<f32>> = (0..64).map(|_| rnd(32, &mut s)).collect();
        // Ties: 127/amax = 1, so x.5 rounds to even.
        let mut ties: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
        ties[0] = 127.0;
        blocks.push(ties);
        blocks.push(vec![0.0; 32]);
        blocks.push((0..32).map(|i| f32::from_bits(i + 1)).collect()); // subnormals
        blocks.push((0..32).map(|i| (i as f32 - 16.0) * 1e37).collect());
        let mut nan = rnd(32, &mut s);
        nan[17] = f32::NAN;
        blocks.push(nan);
        let mut inf = rnd(32, &mut s);
        inf[3] = f32::NEG_INFINITY;
        blocks.push(inf);
        for x in &blocks {
            let mut q = [0i8; 32];
            let d = quantize_block(x, &mut q);
            if x.iter().any(|v| !v.is_finite()) {
                assert!(d.is_nan() && q == [0; 32]);
            } else {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(d, amax / 127.0);
                for (&v, &q) in x.iter().zip(&q) {
                    // Within half a step of the value (or zero where no step exists).
                    let step = amax / 127.0;
                    if (127.0 / amax).is_finite() {
                        assert!((f32::from(q) * step - v).abs() <= 0.5001 * step, "{v} {q}");
                    } else {
                        assert_eq!(q, 0);
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                let mut qv = [0i8; 32];
                // SAFETY: the CPU has AVX2; 32 values each side.
                let dv = unsafe { avx2::quantize_block(x.as_ptr(), qv.as_mut_ptr(), 32) };
                assert!(dv.to_bits() == d.to_bits() || (dv.is_nan() && d.is_nan()));
                assert_eq!(qv, q, "{x:?}");
            }
        }
        // Ties to even: -15.5 -> -16, -14.5 -> -14, 0.5 -> 0.
        let mut q = [0i8; 32];
        quantize_block(&blocks[64], &mut q);
        assert_eq!((q[0], q[1], q[2], q[16]), (127, -14, -14, 0));
    }

    /// Every quantized type, and matrices of mixed parts: each element is
    /// [`dot_reference`] of its row quantized alone, bit for bit, whatever the batch (tiles
    /// of 1 to 4 rows, and several) and the thread count; and it is within the bound the
    /// activations' rounding allows of the exact f32 product over ggml's dequantized values.
    #[test]
    fn int8_products_are_the_reference_whatever_the_batch_and_within_the_rounding_bound() {
        let mut s = 0x1234_5678_9abc_def0u64;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let mut cases: Vec<(usize, Vec<GgmlRows>)> = quantized()
            .map(|t| (512, vec![random_ggml(t, 13, 512, &mut s)]))
            .collect();
        // Rows of 11 blocks of 32: a last group of 8 runs that is not whole.
        for t in quantized().filter(|t| t.block_size() == 32) {
            cases.push((352, vec![random_ggml(t, 7, 352, &mut s)]));
        }
        cases.push((
            512,
            vec![
                random_ggml(GgmlType::Q4_K, 37, 512, &mut s),
                random_ggml(GgmlType::Q6_K, 5, 512, &mut s),
                random_ggml(GgmlType::Q2_K, 3, 512, &mut s),
                random_ggml(GgmlType::Q4_1, 6, 512, &mut s),
                random_ggml(GgmlType::IQ4_XS, 9, 512, &mut s),
            ],
        ));
        for (k, parts) in cases {
            let name = format!("{:?} k={k}", parts.iter().map(|p| p.ty).collect::<Vec<_>>());
            let n: usize = parts.iter().map(|p| p.rows).sum();
            let store = Store::of_parts(parts.clone(), k);
            let dense = dequantized(&parts, k);
            let x: Vec<f32> = rnd(17 * k, &mut s);
            // Per row: each W row's reference and its bound.
            let mut want = vec![0.0f32; 17 * n];
            for r in 0..17 {
                let xr = &x[r * k..(r + 1) * k];
                let qx = QuantRows::new(xr, 1, k, true, k.is_multiple_of(256));
                let mut first = 0;
                for p in &parts {
                    let rb = p.bytes.len() / p.rows;
                    for j in 0..p.rows {
                        let got = dot_reference(p.ty, &p.bytes[j * rb..(j + 1) * rb], &qx, 0);
                        want[r * n + first + j] = got;
                        let w = &dense[(first + j) * k..(first + j + 1) * k];
                        let exact: f64 = w.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        // |x − d·q| <= d / 2 per value; then f32 rounding.
                        let mut bound = 0f64;
                        let mut mag = 0f64;
                        // Activation blocks of 32, or of 256 for the super-block types.
                        let bs = if p.ty.super_blocks() { 256 } else { 32 };
                        for b in 0..k / 32 {
                            let blk = 32 * b / bs * bs;
                            let amax = xr[blk..blk + bs].iter().fold(0f32, |m, v| m.max(v.abs()));
                            let wsum: f64 =
                                w[32 * b..32 * b + 32].iter().map(|v| v.abs() as f64).sum();
                            bound += wsum * amax as f64 / 254.0;
                            mag += wsum * amax as f64;
                        }
                        let err = (got as f64 - exact).abs();
                        assert!(
                            err <= 1.0001 * bound + 1e-6 * mag,
                            "{name} row {j}: {got} vs {exact}, bound {bound}"
                        );
                        // And not trivially: the bound is well below the product's scale.
                        assert!(bound < 0.01 * mag, "{name}");
                    }
                    first += p.rows;
                }
            }
            for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17] {
                for threads in [1, 3] {
                    let mut got = vec![f32::NAN; t * n];
                    if threads == 1 {
                        linear(&x, t, &store, n, k, &mut got, true);
                    } else {
                        pool.install(|| linear(&x, t, &store, n, k, &mut got, true));
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want[..t * n]),
                        "{name} t={t} threads={threads}"
                    );
                }
            }
        }
    }

    /// Blocks at the ends of their ranges (every quant at its largest or smallest value,
    /// large integer scales, activations all ±127): the kernels' 16-bit partial sums stay
    /// within range, so every path gives the reference's exact integer sums, for tiles and
    /// panels alike.
    #[test]
    fn extreme_blocks_sum_exactly_on_every_path() {
        // Each type's f16 `d` (and `dmin` or `m`) offsets, set to 1/16.
        let scale_at = |t: GgmlType| match t {
            GgmlType::Q2_K => vec![80, 82],
            GgmlType::Q3_K => vec![108],
            GgmlType::Q6_K => vec![208],
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_1 | GgmlType::Q5_1 => vec![0, 2],
            _ => vec![0],
        };
        let (k, n, t) = (512, 8, 17);
        for ty in quantized() {
            for fill in [0x00u8, 0x7F, 0x80, 0xFF] {
                let mut block = vec![fill; ty.type_size()];
                for at in scale_at(ty) {
                    block[at..at + 2].copy_from_slice(&half::f16::from_f32(0.0625).to_le_bytes());
                }
                let blocks = n * k / ty.block_size();
                let bytes: Vec<u8> = (0..blocks).flat_map(|_| block.clone()).collect();
                let part = GgmlRows::new(ty, n, k, bytes).unwrap();
                let store = Store::of_parts(vec![part.clone()], k);
                for sign in [1.0f32, -1.0] {
                    let x = vec![sign; t * k];
                    let qx = QuantRows::new(&x, t, k, true, true);
                    let rb = part.bytes.len() / n;
                    let mut got = vec![0f32; t * n];
                    linear(&x, t, &store, n, k, &mut got, true);
                    let mut one = vec![0f32; n];
                    linear(&x, 1, &store, n, k, &mut one, true);
                    for r in 0..t {
                        for j in 0..n {
                            let want = dot_reference(ty, &part.bytes[j * rb..(j + 1) * rb], &qx, r);
                            assert_eq!(
                                got[r * n + j].to_bits(),
                                want.to_bits(),
                                "{ty:?} {fill:#x}"
                            );
                        }
                    }
                    assert_eq!(one, got[..n], "{ty:?} {fill:#x}");
                }
            }
        }
    }

    /// A non-finite activation makes its own row's outputs NaN (as the f32 path's), and
    /// only its row's; the portable and AVX2 paths agree (the bits test above).
    #[test]
    fn a_non_finite_activation_poisons_only_its_row() {
        let mut s = 3u64;
        let k = 256;
        let w = random_ggml(GgmlType::Q4_K, 8, k, &mut s);
        let store = Store::of_parts(vec![w], k);
        let mut x = rnd(3 * k, &mut s);
        x[k + 100] = f32::INFINITY;
        let mut out = vec![0.0f32; 3 * 8];
        linear(&x, 3, &store, 8, k, &mut out, true);
        assert!(out[8..16].iter().all(|v| v.is_nan()));
        assert!(out[..8].iter().chain(&out[16..]).all(|v| v.is_finite()));
    }
}
