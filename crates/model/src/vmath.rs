//! Vectorizable f32 `exp` and SiLU for the CPU reference, with one exact order of operations.
//!
//! Invariant: [`exp_order`] is the reference; the AVX2 + FMA path ([`avx2::exp8`]) performs
//! the same IEEE operations on each lane (fused multiply-adds where the reference uses
//! `f32::mul_add`, round-to-nearest-even, the same clamps), so both give the same bits for
//! every finite or infinite input, and a result never depends on the lane an input falls in
//! or on its neighbours. libm's `expf` (what `f32::exp` calls) is scalar and cost about 20 ns
//! a call, which made the softmax of a long context and the MLP's SiLU a large share of a
//! decode step.
//!
//! Numerics: Cephes `expf` (S. L. Moshier, Cephes Math Library 2.2, `expf.c`): `x = n ln 2 +
//! r` with `n = round(x log2 e)`, `ln 2` split into a short high part (exact products) and a
//! low part, `|r| <= ln(2)/2`, `e^r ≈ 1 + r + r² P(r)` with Cephes' degree-5 `P`; then
//! `2^n` applied as two exact power-of-two scalings (so results overflow to `+inf` and
//! underflow through the subnormals to `+0` as `expf` does). Within 2 ulp of the true value
//! over the normal range (tested against f64).

/// `ln 2`, high part: few significant bits, so `n * LN2_HI` is exact for `|n| <= 256`.
const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 - LN2_HI`.
const LN2_LO: f32 = -2.121_944_4e-4;
/// `log2 e`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// Inputs above this give `+inf` (`e^89` overflows f32).
const HI: f32 = 89.0;
/// Inputs below this give `+0` (`e^-110` is below half the smallest subnormal).
const LO: f32 = -110.0;
/// Cephes `expf` polynomial `P`, highest degree first (its last coefficient,
/// `5.0000001201E-1`, is `0.5` in f32).
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `2^i` for an integer `i` in `-126..=127`, from its exponent bits.
#[inline(always)]
fn pow2i(i: i32) -> f32 {
    f32::from_bits(((i + 127) as u32) << 23)
}

/// `e^x` in the reference order (see the module documentation). `exp_order(0.0) == 1.0`
/// exactly, `-inf` gives `+0`, `+inf` gives `+inf`.
#[inline(always)]
pub(crate) fn exp_order(x: f32) -> f32 {
    // Clamps by comparison (a NaN passes through both and stays NaN).
    let x = if x > HI { HI } else { x };
    let x = if x < LO { LO } else { x };
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let z = r * r;
    let mut p = P[0];
    for &c in &P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(z, r) + 1.0;
    // n in -159..=128: two scalings by 2^(n >> 1) and 2^(n - (n >> 1)), both in range.
    let n = n as i32;
    let n1 = n >> 1;
    y * pow2i(n1) * pow2i(n - n1)
}

/// `out[i] = g[i] / (1 + e^-g[i]) * u[i]` (SwiGLU's `silu(gate) * up`, HF `LlamaMLP`), with
/// `e^x` from [`exp_order`]; bit-identical on every path.
///
/// # Panics
/// If the three slices differ in length (a caller bug).
pub(crate) fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && u.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above); the slices have equal lengths.
        unsafe { avx2::silu_mul(g, u, out) };
        return;
    }
    silu_mul_portable(g, u, out);
}

/// `out[i] = gelu_tanh(g[i]) * u[i]` (Gemma's `gelu_pytorch_tanh(gate) * up`, HF `Gemma3MLP`)
/// with PyTorch's tanh approximation in f32: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`,
/// `x³` as `x * x * x` (PyTorch's `GeluCUDAKernelImpl` / CPU kernel order) and `tanh` from the
/// platform's libm, one fixed sequence per value.
///
/// # Panics
/// If the three slices differ in length (a caller bug).
pub(crate) fn gelu_tanh_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && u.len() == out.len());
    // sqrt(2) * (2 / sqrt(pi)) * 0.5 = sqrt(2 / pi), as PyTorch's kBeta.
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    const KAPPA: f32 = 0.044715;
    for ((o, &x), &u) in out.iter_mut().zip(g).zip(u) {
        let inner = BETA * (x + KAPPA * (x * x * x));
        *o = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// [`silu_mul`]'s reference loop.
#[inline(always)]
fn silu_mul_portable(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + exp_order(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! [`super::exp_order`] on 8 lanes with AVX2 + FMA.

    use super::{HI, LN2_HI, LN2_LO, LO, LOG2E, P};
    use std::arch::x86_64::*;

    /// Whether this CPU runs the AVX2 + FMA paths (detected once by std, cached).
    #[inline]
    pub(crate) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// [`super::exp_order`] of each lane.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        // Ordered, quiet compares: false for a NaN lane, which then keeps its value.
        let hi = _mm256_set1_ps(HI);
        let lo = _mm256_set1_ps(LO);
        let x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi));
        let x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let z = _mm256_mul_ps(r, r);
        let mut p = _mm256_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0));
        let n = _mm256_cvtps_epi32(n);
        let n1 = _mm256_srai_epi32::<1>(n);
        let n2 = _mm256_sub_epi32(n, n1);
        let bias = _mm256_set1_epi32(127);
        let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
        let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
        _mm256_mul_ps(_mm256_mul_ps(y, s1), s2)
    }

    /// [`super::silu_mul`] with [`exp8`].
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; the slices have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n8 = g.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let zero = _mm256_setzero_ps();
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= len for all three slices.
            unsafe {
                let gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let uv = _mm256_loadu_ps(u.as_ptr().add(i));
                let e = exp8(_mm256_sub_ps(zero, gv));
                let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, uv));
            }
            i += 8;
        }
        super::silu_mul_portable(&g[n8..], &u[n8..], &mut out[n8..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs across the whole range: a dense sweep, the clamps' neighbourhoods, the
    /// subnormal results, zeros and infinities.
    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (-120_000..=100_000).map(|i| i as f32 * 1e-3).collect();
        v.extend((-2000..2000).map(|i| i as f32 * 1.37e-5));
        v.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            88.72,
            88.73,
            89.0,
            89.5,
            -87.3,
            -103.9,
            -104.0,
            -109.9,
            -110.5,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-30,
            -1e-30,
        ]);
        v
    }

    /// The reference is `e^x` to within 2 ulp wherever the result is normal, and its special
    /// values are `expf`'s.
    #[test]
    fn exp_order_is_exp() {
        for x in inputs() {
            let got = exp_order(x);
            let want = (x as f64).exp();
            if want > f32::MAX as f64 {
                assert_eq!(got, f32::INFINITY, "x={x}");
            } else if want >= f32::MIN_POSITIVE as f64 {
                let ulp = (want as f32).to_bits().abs_diff(got.to_bits());
                assert!(ulp <= 2, "x={x}: {got} vs {want} ({ulp} ulp)");
            } else {
                assert!((got as f64 - want).abs() <= 2f64.powi(-149), "x={x}: {got}");
            }
        }
        assert_eq!(exp_order(0.0).to_bits(), 1.0f32.to_bits());
        assert_eq!(exp_order(f32::NEG_INFINITY).to_bits(), 0.0f32.to_bits());
        assert!(exp_order(f32::NAN).is_nan());
    }

    /// Every lane of the AVX2 path has the reference's bits, and SiLU's vector loop and tail
    /// agree with the reference loop.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_path_has_the_reference_bits() {
        use std::arch::x86_64::*;
        if !avx2::available() {
            eprintln!("no AVX2 + FMA here; only the reference runs");
            return;
        }
        let xs = inputs();
        for chunk in xs.chunks_exact(8) {
            let mut out = [0.0f32; 8];
            // SAFETY: AVX2 and FMA are available (checked above); chunk and out hold 8 values.
            unsafe {
                _mm256_storeu_ps(
                    out.as_mut_ptr(),
                    avx2::exp8(_mm256_loadu_ps(chunk.as_ptr())),
                )
            };
            for (x, y) in chunk.iter().zip(out) {
                assert_eq!(exp_order(*x).to_bits(), y.to_bits(), "x={x}");
            }
        }
        let g: Vec<f32> = xs.iter().map(|x| x * 0.5).take(1003).collect();
        let u: Vec<f32> = xs.iter().rev().take(1003).copied().collect();
        let mut fast = vec![0.0; g.len()];
        let mut reference = vec![0.0; g.len()];
        silu_mul(&g, &u, &mut fast);
        silu_mul_portable(&g, &u, &mut reference);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&reference));
    }
}
