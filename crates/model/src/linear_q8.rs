//! A GGUF file's quantized matrices times activations quantized to 8 bits: llama.cpp's CPU
//! scheme (`ggml-cpu`'s `ggml_vec_dot_*_q8_*`: each activation row in blocks of 32 signed
//! bytes with one scale, integer products summed exactly, one float multiply-add per four
//! products), for the CPU backend's `--cpu-int8-activations`. [`crate::linear`] keeps the
//! activations f32 and gives the bits of the f32 kernel over ggml's dequantized matrix; this
//! path gives that up for less vector work per weight when a step has few tokens (a run of
//! 32 weights is decoded into one vector of bytes, not four of floats): batch-1 decode
//! 1.1-2.1x faster, batches of 4 about even, 16-token steps up to 1.4x slower
//! (bench/RESULTS.md, session 42).
//!
//! Numerics. Each token's activations are quantized per block of 32 values: `amax` the
//! block's largest magnitude, `d = amax / 127`, `q = round_ties_even(x · (127 / amax))` (so
//! `|q| <= 127`; a block of zeros, or of values so small that `127 / amax` overflows, is all
//! zeros), kept with an f32 `d` (llama.cpp's `block_q8_0` rounds `d` to f16 as well; its
//! K-quant products use one scale per 256 activations, coarser). A block holding a NaN or
//! an infinity gets `d = NaN`, so every output it meets is NaN, as the f32 path's would be.
//! A weight run of 32 is `scale·v + min` ([`IntRun`]), so a row's dot product is
//! `Σ_runs (scale·d)·Σ v·q + min·(d·Σ q)`. Against the f32 result the error is at most that
//! of rounding each activation to within `amax / 254` of its value (the tests check this
//! bound on every type).
//!
//! Invariant, as [`crate::linear`]'s: `out[r, j]` is computed by one fixed sequence of
//! operations whatever the batch, the row's place in it, the register tile and the thread
//! count, and the AVX2 kernel and the portable reference ([`dot_reference`]) give the same
//! bits, so a machine without AVX2 gives the same tokens. The sequence, for x row `r`, W
//! row `j` (its part's type), runs `b` of 32 values and groups `g` of 8 runs:
//! - eight f32 lane sums `acc`, lane `l` taking values `4l..4l + 4` of each run: per run,
//!   in order, `acc[l] = fma(f32(Σ_{i in 4l..4l+4} v[i]·q[i]), scale[l / 4]·d_b, acc[l])`
//!   (the integer sum is exact);
//! - for a type with mins ([`Mins`]), eight more, `accm`, per group `g` in order:
//!   `accm[l] = fma(min_{8g+l}, s32_{8g+l}, accm[l])` for one min a run, or
//!   `accm[l] = fma(min_{16g+l}, s16_{16g+l}, accm[l])` then the same with `8 + l` for one
//!   a half run (Q2_K), where `s32_b = f32(Σ_32 q)·d_b` and `s16_{2b+h} = f32(Σ_{half h}
//!   q)·d_b`, and runs past the row's end count as `min = 0`, `s = 0`;
//! - `out = combine(acc)`, plus `combine(accm)` for a type with mins
//!   ([`crate::linear`]'s lane combination).

use crate::gguf_quant::{GgmlType, IntRun, Mins};
use crate::linear::{combine, GgmlRows};

/// A batch of `t` activation rows of `k` values (`k` a multiple of 32) quantized to 8 bits
/// in blocks of 32 (see the module documentation), with the per-block sums the min terms
/// read. Rows are independent: a row's bytes do not depend on the others.
pub(crate) struct QuantRows {
    /// Values per row.
    k: usize,
    /// Blocks of 32 per row, `k / 32`.
    kb: usize,
    /// Groups of 8 blocks per row, `kb.div_ceil(8)` (the sums are padded to whole groups).
    kg: usize,
    /// `[t, k]` quants, `-127..=127`.
    q: Vec<i8>,
    /// `[t, kb]` block scales `d`.
    d: Vec<f32>,
    /// `[t, 8 kg]`: `f32(Σ q)·d` per block, zero past `kb`.
    s32: Vec<f32>,
    /// `[t, 16 kg]`: `f32(Σ q)·d` per half block, zero past `2 kb`.
    s16: Vec<f32>,
}

impl QuantRows {
    /// Quantizes rows `0..t` of `x` (row stride `k`).
    ///
    /// # Panics
    /// If `k` is not a multiple of 32 or `x` has fewer than `t * k` values (a caller bug:
    /// quantized rows are whole blocks of 32).
    pub(crate) fn new(x: &[f32], t: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(32) && x.len() >= t * k);
        let (kb, kg) = (k / 32, (k / 32).div_ceil(8));
        let mut qr = QuantRows {
            k,
            kb,
            kg,
            q: vec![0; t * k],
            d: vec![0.0; t * kb],
            s32: vec![0.0; t * 8 * kg],
            s16: vec![0.0; t * 16 * kg],
        };
        #[cfg(target_arch = "x86_64")]
        let fast = std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let fast = false;
        for r in 0..t {
            for b in 0..kb {
                let xs = &x[r * k + 32 * b..r * k + 32 * b + 32];
                let q = &mut qr.q[r * k + 32 * b..r * k + 32 * b + 32];
                #[cfg(target_arch = "x86_64")]
                let d = if fast {
                    // SAFETY: the CPU has AVX2 (checked above); xs and q are 32 values each.
                    unsafe { avx2::quantize_block(xs.as_ptr(), q.as_mut_ptr()) }
                } else {
                    quantize_block(xs, q)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let d = {
                    let _ = fast;
                    quantize_block(xs, q)
                };
                let sum = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>() as f32;
                qr.d[r * kb + b] = d;
                qr.s32[r * 8 * kg + b] = sum(q) * d;
                qr.s16[r * 16 * kg + 2 * b] = sum(&q[..16]) * d;
                qr.s16[r * 16 * kg + 2 * b + 1] = sum(&q[16..]) * d;
            }
        }
        qr
    }
}

/// Quantizes 32 values into `q`, returning the block's `d` (the module documentation's
/// rule; the reference [`avx2::quantize_block`] matches bit for bit).
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

/// The reference of the module documentation's sequence: x row `r` of `qx` times `row`, a
/// row of the quantized type `ty` of `qx`'s `k` values, decoded a run at a time by
/// [`GgmlType::int_run`].
///
/// # Panics
/// If `ty` is a float type or `row` is shorter than `k` values (caller bugs).
pub(crate) fn dot_reference(ty: GgmlType, row: &[u8], qx: &QuantRows, r: usize) -> f32 {
    let (k, kb, kg) = (qx.k, qx.kb, qx.kg);
    assert!(ty.is_quantized(), "a quantized type");
    let mins = ty.mins();
    let mut acc = [0f32; 8];
    let mut accm = [0f32; 8];
    for g in 0..kg {
        let mut m = [0f32; 16];
        for l in 0..8 {
            let b = 8 * g + l;
            if b >= kb {
                break;
            }
            let IntRun { v, scale, min } = ty.int_run(row, b).expect("a quantized type");
            let d = qx.d[r * kb + b];
            let q = &qx.q[r * k + 32 * b..r * k + 32 * b + 32];
            for (lane, a) in acc.iter_mut().enumerate() {
                let isum: i32 = (4 * lane..4 * lane + 4)
                    .map(|i| i32::from(v[i]) * i32::from(q[i]))
                    .sum();
                *a = (isum as f32).mul_add(scale[lane / 4] * d, *a);
            }
            m[2 * l] = min[0];
            m[2 * l + 1] = min[1];
        }
        match mins {
            Mins::None => {}
            Mins::Per32 => {
                for (l, a) in accm.iter_mut().enumerate() {
                    *a = m[2 * l].mul_add(qx.s32[(r * kg + g) * 8 + l], *a);
                }
            }
            Mins::Per16 => {
                for h in [0, 8] {
                    for (l, a) in accm.iter_mut().enumerate() {
                        *a = m[h + l].mul_add(qx.s16[(r * kg + g) * 16 + h + l], *a);
                    }
                }
            }
        }
    }
    if mins == Mins::None {
        combine(acc)
    } else {
        combine(acc) + combine(accm)
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
        block_bytes, block_scales, by_type, f16_at, hsum, small_blocks, IQ4_NL, IQ4_XS, PREFETCH,
        Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
    };
    use std::arch::x86_64::*;

    /// [`super::quantize_block`] for AVX2, with the same bits: `x` and `q` point to 32
    /// values each; returns `d`.
    ///
    /// # Safety
    /// As above; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(x: *const f32, q: *mut i8) -> f32 {
        // SAFETY: the caller's 32 values each side; unaligned loads and store. (Loops, not
        // closures: a closure may be compiled without the features.)
        unsafe {
            let sign = _mm256_set1_ps(-0.0);
            let inf = _mm256_set1_ps(f32::INFINITY);
            let mut v = [_mm256_setzero_ps(); 4];
            let mut a = [_mm256_setzero_ps(); 4];
            let mut bad = 0;
            for i in 0..4 {
                v[i] = _mm256_loadu_ps(x.add(8 * i));
                a[i] = _mm256_andnot_ps(sign, v[i]);
                // Not (|x| < inf): NaN or infinite.
                bad |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(a[i], inf));
            }
            if bad != 0 {
                _mm256_storeu_si256(q.cast(), _mm256_setzero_si256());
                return f32::NAN;
            }
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let id = 127.0 / amax;
            let id = _mm256_set1_ps(if id.is_finite() { id } else { 0.0 });
            let mut i = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(v[j], id),
                );
                i[j] = _mm256_cvtps_epi32(r);
            }
            // packs interleave 128-bit lanes: bytes come out as 4-byte groups 0,2,4,6,1,3,5,7
            // of the values' eights; the permute puts them back in order.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(i[0], i[1]),
                _mm256_packs_epi32(i[2], i[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.cast(), p);
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
            while j < cols {
                let two = j + 2 <= cols;
                let mut r = r0;
                while r < r1 {
                    let o = out.add(r * n + j);
                    let (w0, w1) = (w.add(j * rb), w.add((j + 1) * rb));
                    let left = r1 - r;
                    match (left, two) {
                        (1, true) => tile::<T, 1, 2>(qx, r, [w0, w1], o, n),
                        (2, true) => tile::<T, 2, 2>(qx, r, [w0, w1], o, n),
                        (3, true) => tile::<T, 3, 2>(qx, r, [w0, w1], o, n),
                        (_, true) => tile::<T, 4, 2>(qx, r, [w0, w1], o, n),
                        (1, false) => tile::<T, 1, 1>(qx, r, [w0], o, n),
                        (2, false) => tile::<T, 2, 1>(qx, r, [w0], o, n),
                        (3, false) => tile::<T, 3, 1>(qx, r, [w0], o, n),
                        (_, false) => tile::<T, 4, 1>(qx, r, [w0], o, n),
                    }
                    r += left.min(4);
                }
                j += if two { 2 } else { 1 };
            }
        }
    }

    /// Whether type `T`'s decoded bytes are signed (products through `sign`), not
    /// unsigned with a min.
    const fn signed<const T: u8>() -> bool {
        !matches!(T, Q4_1 | Q5_1 | Q4_K | Q5_K | Q2_K)
    }

    /// `out[a * ldo + c] = x row r + a · W row c` for `a < R`, `c < C`, by [`super`]'s
    /// sequence.
    ///
    /// # Safety
    /// `rows` are rows of type `T` of `qx.k` values; x rows `r..r + R` exist in `qx`; `out`
    /// points to the `R x C` tile (row stride `ldo`); the CPU has AVX2, FMA and F16C.
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc[a][c]: a register tile, indexed as one
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const T: u8, const R: usize, const C: usize>(
        qx: &QuantRows,
        r: usize,
        rows: [*const u8; C],
        out: *mut f32,
        ldo: usize,
    ) {
        let (k, kb, kg) = (qx.k, qx.kb, qx.kg);
        let runs = if small_blocks::<T>() { 1 } else { 8 };
        let mins = matches!(T, Q4_1 | Q5_1 | Q4_K | Q5_K | Q2_K);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut accm = [[_mm256_setzero_ps(); C]; R];
        // Q4_1 and Q5_1: the mins of the current group of 8 runs.
        let mut mbuf = [[0f32; 8]; C];
        let (xq, xd) = (qx.q.as_ptr(), qx.d.as_ptr());
        // SAFETY (the reads below): blocks of rows inside their k values, x rows r..r + R
        // of qx (q, d and the padded sums), at the offsets of the struct's layout.
        unsafe {
            let (s32, s16) = (qx.s32.as_ptr(), qx.s16.as_ptr());
            for blk in 0..kb / runs {
                let bb = block_bytes::<T>();
                let lo = bb * blk + PREFETCH;
                let mut line = lo.next_multiple_of(64);
                while line < lo + bb {
                    for &w in &rows {
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(line).cast());
                    }
                    line += 64;
                }
                let mut scales = [[0f32; 32]; C];
                if runs > 1 {
                    for (sc, &w) in scales.iter_mut().zip(&rows) {
                        *sc = block_scales::<T>(w, blk);
                    }
                }
                for s in 0..runs {
                    let b = blk * runs + s;
                    let mut v = [_mm256_setzero_si256(); C];
                    let mut av = [_mm256_setzero_si256(); C];
                    let mut sl = [_mm256_setzero_ps(); C];
                    for c in 0..C {
                        let m;
                        (v[c], sl[c], m) = runq::<T>(rows[c], b, &scales[c]);
                        av[c] = if signed::<T>() {
                            _mm256_abs_epi8(v[c])
                        } else {
                            v[c]
                        };
                        if runs == 1 && mins {
                            mbuf[c][b % 8] = m;
                        }
                    }
                    for a in 0..R {
                        let xv = _mm256_loadu_si256(xq.add((r + a) * k + 32 * b).cast());
                        let d = _mm256_set1_ps(*xd.add((r + a) * kb + b));
                        for c in 0..C {
                            let sx = if signed::<T>() {
                                _mm256_sign_epi8(xv, v[c])
                            } else {
                                xv
                            };
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(av[c], sx), ones);
                            let sd = _mm256_mul_ps(sl[c], d);
                            acc[a][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sd, acc[a][c]);
                        }
                    }
                    if runs == 1 && mins && (b % 8 == 7 || b + 1 == kb) {
                        for c in 0..C {
                            let m = _mm256_loadu_ps(mbuf[c].as_ptr());
                            for a in 0..R {
                                let sv = _mm256_loadu_ps(s32.add((r + a) * 8 * kg + 8 * (b / 8)));
                                accm[a][c] = _mm256_fmadd_ps(m, sv, accm[a][c]);
                            }
                            mbuf[c] = [0.0; 8];
                        }
                    }
                }
                // The K-quants' mins, a super-block (one group of 8 runs) at a time;
                // block_scales gives them positive, so fnmadd (−(m·s) + acc, one rounding,
                // as fma(−m, s, acc)).
                if T == Q4_K || T == Q5_K {
                    for c in 0..C {
                        let m = _mm256_loadu_ps(scales[c].as_ptr().add(8));
                        for a in 0..R {
                            let sv = _mm256_loadu_ps(s32.add((r + a) * 8 * kg + 8 * blk));
                            accm[a][c] = _mm256_fnmadd_ps(m, sv, accm[a][c]);
                        }
                    }
                } else if T == Q2_K {
                    for h in [0, 8] {
                        for c in 0..C {
                            let m = _mm256_loadu_ps(scales[c].as_ptr().add(16 + h));
                            for a in 0..R {
                                let sv = _mm256_loadu_ps(s16.add((r + a) * 16 * kg + 16 * blk + h));
                                accm[a][c] = _mm256_fnmadd_ps(m, sv, accm[a][c]);
                            }
                        }
                    }
                }
            }
            for a in 0..R {
                for c in 0..C {
                    let v = if mins {
                        hsum(acc[a][c]) + hsum(accm[a][c])
                    } else {
                        hsum(acc[a][c])
                    };
                    *out.add(a * ldo + c) = v;
                }
            }
        }
    }

    /// Run `b` of a row of type `T` as [`GgmlType::int_run`] gives it: the 32 bytes `v`, the
    /// scale of each half in lanes (lanes 0..4 the first 16 values' scale, 4..8 the second's,
    /// matching the four-byte sums of `madd`), and, for Q4_1 and Q5_1, the run's min
    /// (the K-quants' mins come from `scales`, the block's [`block_scales`]).
    ///
    /// # Safety
    /// The row holds run `b` of type `T`; the CPU has AVX2 and F16C.
    #[inline(always)]
    unsafe fn runq<const T: u8>(
        row: *const u8,
        b: usize,
        scales: &[f32; 32],
    ) -> (__m256i, __m256, f32) {
        let nib = _mm256_set1_epi8(0x0F);
        // SAFETY (the block reads below): block b / (runs per block) of the row, inside it
        // by the caller's guarantee; offsets are those of ggml's block structs.
        unsafe {
            if T == Q8_0 {
                let blk = row.add(block_bytes::<T>() * b);
                let v = _mm256_loadu_si256(blk.add(2).cast());
                (v, _mm256_set1_ps(f16_at(blk)), 0.0)
            } else if T == Q4_0 || T == Q4_1 || T == IQ4_NL {
                let blk = row.add(block_bytes::<T>() * b);
                let d = _mm256_set1_ps(f16_at(blk));
                if T == Q4_0 {
                    (
                        _mm256_sub_epi8(split16(blk.add(2)), _mm256_set1_epi8(8)),
                        d,
                        0.0,
                    )
                } else if T == IQ4_NL {
                    (
                        _mm256_shuffle_epi8(iq4_levels(), split16(blk.add(2))),
                        d,
                        0.0,
                    )
                } else {
                    (split16(blk.add(4)), d, f16_at(blk.add(2)))
                }
            } else if T == Q5_0 || T == Q5_1 {
                // Bit i of the u32 qh is bit 4 of value i: byte i of the broadcast holds
                // qh's byte i / 8 (within each 128-bit lane, which holds all four), tested
                // against bit i % 8.
                let blk = row.add(block_bytes::<T>() * b);
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
                let d = _mm256_set1_ps(f16_at(blk));
                if T == Q5_0 {
                    (_mm256_sub_epi8(v, _mm256_set1_epi8(16)), d, 0.0)
                } else {
                    (v, d, f16_at(blk.add(2)))
                }
            } else if T == Q2_K || T == Q3_K {
                // As `linear`'s run32: run s = 4n + j of half n, bits 2j.. of the 32 bytes;
                // scales 8n + 2j and + 1 for the halves; Q3_K less 4 where bit s of hmask is
                // clear.
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let (n, j) = (s / 4, s % 4);
                let qs = sb.add(if T == Q2_K { 16 } else { 32 } + 32 * n);
                let v = _mm256_srl_epi16(
                    _mm256_loadu_si256(qs.cast()),
                    _mm_cvtsi32_si128(2 * j as i32),
                );
                let mut q = _mm256_and_si256(v, _mm256_set1_epi8(3));
                if T == Q3_K {
                    let hm = _mm256_loadu_si256(sb.cast());
                    let bit = _mm256_set1_epi8((1u8 << s) as i8);
                    let clear =
                        _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                    q = _mm256_sub_epi8(q, _mm256_and_si256(clear, _mm256_set1_epi8(4)));
                }
                let is = 8 * n + 2 * j;
                let sl = _mm256_set_m128(_mm_set1_ps(scales[is + 1]), _mm_set1_ps(scales[is]));
                (q, sl, 0.0)
            } else if T == Q4_K || T == Q5_K {
                // Run s: nibble s % 2 of the 32 bytes 32 (s / 2).. of qs; Q5_K's bit s of
                // qh[i] as bit 4.
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let qs = sb.add(if T == Q4_K { 16 } else { 48 } + 32 * (s / 2));
                let v = _mm256_loadu_si256(qs.cast());
                let v = if s % 2 == 0 {
                    v
                } else {
                    _mm256_srli_epi16::<4>(v)
                };
                let mut q = _mm256_and_si256(v, nib);
                if T == Q5_K {
                    let qh = _mm256_loadu_si256(sb.add(16).cast());
                    let bit = _mm256_set1_epi8((1u8 << s) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                }
                (q, _mm256_set1_ps(scales[s]), 0.0)
            } else if T == IQ4_XS {
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
                let q = _mm256_shuffle_epi8(iq4_levels(), split16(sb.add(8 + 16 * s)));
                (q, _mm256_set1_ps(scales[s]), 0.0)
            } else {
                // Q6_K, as `linear`'s run32: run s = 4n + r of half n, nibble r / 2 of
                // ql[64n + 32(r % 2) + i], bits 2r.. of qh[32n + i] as bits 4..6, less 32;
                // scales 8n + 2r and + 1 for the halves.
                let (sb, s) = (row.add(block_bytes::<T>() * (b / 8)), b % 8);
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
                let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
                let i = 8 * n + 2 * r;
                let sl = _mm256_set_m128(_mm_set1_ps(scales[i + 1]), _mm_set1_ps(scales[i]));
                (q, sl, 0.0)
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
        // SAFETY: the caller's 16 bytes; an unaligned load.
        let v = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
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
    use crate::linear::{linear, random_ggml, rnd, Store};

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
                let dv = unsafe { avx2::quantize_block(x.as_ptr(), qv.as_mut_ptr()) };
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
            let mut dense = vec![0.0f32; n * k];
            let mut at = 0;
            for p in &parts {
                p.ty.dequantize(&p.bytes, &mut dense[at..at + p.rows * k])
                    .unwrap();
                at += p.rows * k;
            }
            let x: Vec<f32> = rnd(13 * k, &mut s);
            // Per row: each W row's reference and its bound.
            let mut want = vec![0.0f32; 13 * n];
            for r in 0..13 {
                let xr = &x[r * k..(r + 1) * k];
                let qx = QuantRows::new(xr, 1, k);
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
                        for b in 0..k / 32 {
                            let amax = xr[32 * b..32 * b + 32]
                                .iter()
                                .fold(0f32, |m, v| m.max(v.abs()));
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
            for t in [1, 2, 3, 4, 5, 8, 9, 13] {
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
