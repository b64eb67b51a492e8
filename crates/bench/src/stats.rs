//! Percentiles and summaries of latency samples.

use serde::Serialize;

/// The `p`-th percentile (`0 ≤ p ≤ 100`) of ascending `sorted` samples, by linear interpolation
/// between closest ranks (numpy's default). `NaN` when there are no samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = p.clamp(0.0, 100.0) / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            let frac = rank - lo as f64;
            sorted[lo] + (sorted[hi] - sorted[lo]) * frac
        }
    }
}

/// Writes a finite number as itself and `NaN`/infinities as `null` (JSON has no `NaN`).
fn finite_or_null<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(*v)
    } else {
        s.serialize_none()
    }
}

/// Mean, median, p90 and p99 of a set of samples, in the samples' unit (the report uses ms).
/// Serialized with `null` figures when there are no samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Arithmetic mean.
    #[serde(serialize_with = "finite_or_null")]
    pub mean: f64,
    /// 50th percentile.
    #[serde(serialize_with = "finite_or_null")]
    pub median: f64,
    /// 90th percentile.
    #[serde(serialize_with = "finite_or_null")]
    pub p90: f64,
    /// 99th percentile.
    #[serde(serialize_with = "finite_or_null")]
    pub p99: f64,
    /// Number of samples.
    pub count: usize,
}

impl Summary {
    /// Summarizes `samples` (any order; sorted in place). All fields are `NaN` (count 0) for
    /// no samples.
    pub fn of(samples: &mut [f64]) -> Summary {
        samples.sort_unstable_by(f64::total_cmp);
        let mean = if samples.is_empty() {
            f64::NAN
        } else {
            samples.iter().sum::<f64>() / samples.len() as f64
        };
        Summary {
            mean,
            median: percentile(samples, 50.0),
            p90: percentile(samples, 90.0),
            p99: percentile(samples, 99.0),
            count: samples.len(),
        }
    }

    /// The same summary with every figure multiplied by `k` (e.g. 1000 for s → ms).
    pub fn scaled(self, k: f64) -> Summary {
        Summary {
            mean: self.mean * k,
            median: self.median * k,
            p90: self.p90 * k,
            p99: self.p99 * k,
            count: self.count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_values() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 5.5);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 10.0);
        assert!((percentile(&v, 90.0) - 9.1).abs() < 1e-12);
        assert!((percentile(&v, 99.0) - 9.91).abs() < 1e-12);
        assert!(percentile(&[], 50.0).is_nan());
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn summary_sorts_and_scales() {
        let mut v = vec![0.003, 0.001, 0.002];
        let s = Summary::of(&mut v).scaled(1000.0);
        assert!((s.mean - 2.0).abs() < 1e-9);
        assert!((s.median - 2.0).abs() < 1e-9);
        assert_eq!(s.count, 3);
        assert!(Summary::of(&mut []).mean.is_nan());
    }

    proptest! {
        #[test]
        fn percentiles_are_monotone_and_bounded(mut v in proptest::collection::vec(-1e6f64..1e6, 1..200), a in 0f64..100.0, b in 0f64..100.0) {
            v.sort_unstable_by(f64::total_cmp);
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let (pl, ph) = (percentile(&v, lo), percentile(&v, hi));
            prop_assert!(pl <= ph);
            prop_assert!(v[0] <= pl && ph <= v[v.len() - 1]);
            let s = Summary::of(&mut v.clone());
            prop_assert!(s.median <= s.p90 && s.p90 <= s.p99);
            prop_assert!(v[0] <= s.mean + 1e-6 && s.mean <= v[v.len() - 1] + 1e-6);
        }
    }
}
