//! Percentiles and exact merging of [`LatencyHistogram`]s: the one definition the agent's
//! per-node summary and the operator's cluster-wide summary share.

use crate::agent::LatencyHistogram;

/// Bounds of bucket `i` in units: `[low, high)`.
pub fn bucket_bounds(i: usize) -> (u64, u64) {
    if i == 0 {
        (0, 2)
    } else {
        let low = 1u64.checked_shl(i as u32).unwrap_or(u64::MAX);
        (low, low.saturating_mul(2))
    }
}

/// The `q` quantile (0..=1) of log2 bucket counts (`buckets[i]` counts values in
/// [`bucket_bounds`]`(i)`), in bucket units, interpolated linearly inside its bucket; `None`
/// when every bucket is empty. The one definition every latency summary uses.
pub fn quantile(buckets: &[u64], q: f64) -> Option<f64> {
    let total = buckets.iter().fold(0u64, |a, &b| a.saturating_add(b));
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut seen = 0.0;
    for (i, &n) in buckets.iter().enumerate() {
        let next = seen + n as f64;
        if n > 0 && next >= rank {
            let (lo, hi) = bucket_bounds(i);
            let frac = ((rank - seen) / n as f64).clamp(0.0, 1.0);
            return Some(lo as f64 + frac * (hi - lo) as f64);
        }
        seen = next;
    }
    None
}

/// Two histograms in different units cannot be merged exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitMismatch {
    /// Nanoseconds per unit of the histogram merged into.
    pub into_ns: u64,
    /// Nanoseconds per unit of the other.
    pub other_ns: u64,
}

impl LatencyHistogram {
    /// Number of waits counted.
    pub fn count(&self) -> u64 {
        self.buckets.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Adds `other`'s counts bucket by bucket (exact: the buckets are the same on every
    /// node). An empty histogram (`unit_ns == 0`) takes `other`'s unit.
    ///
    /// # Errors
    /// [`UnitMismatch`] when both have a unit and they differ; `self` is unchanged.
    pub fn merge(&mut self, other: &LatencyHistogram) -> Result<(), UnitMismatch> {
        if self.unit_ns == 0 {
            self.unit_ns = other.unit_ns;
        } else if other.unit_ns != 0 && other.unit_ns != self.unit_ns {
            return Err(UnitMismatch {
                into_ns: self.unit_ns,
                other_ns: other.unit_ns,
            });
        }
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a = a.saturating_add(*b);
        }
        Ok(())
    }

    /// The `q` quantile (0..=1) in microseconds, interpolated linearly inside its bucket;
    /// `None` when the histogram is empty.
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        quantile(&self.buckets, q).map(|units| self.units_to_us(units))
    }

    /// The upper bound (exclusive) of the highest non-empty bucket, in microseconds: no
    /// wait was this long.
    pub fn max_us(&self) -> Option<f64> {
        let last = self.buckets.iter().rposition(|&n| n > 0)?;
        Some(self.units_to_us(bucket_bounds(last).1 as f64))
    }

    fn units_to_us(&self, units: f64) -> f64 {
        units * self.unit_ns as f64 / 1e3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(unit_ns: u64, pairs: &[(usize, u64)]) -> LatencyHistogram {
        let mut buckets = vec![0; 27];
        for &(i, n) in pairs {
            buckets[i] = n;
        }
        LatencyHistogram { unit_ns, buckets }
    }

    #[test]
    fn quantiles_follow_the_buckets() {
        let h = hist(1000, &[(2, 50), (4, 50)]);
        assert_eq!(h.count(), 100);
        assert_eq!(h.quantile_us(0.5), Some(8.0));
        assert!(
            h.quantile_us(0.99)
                .is_some_and(|q| (16.0..32.0).contains(&q))
        );
        assert_eq!(h.max_us(), Some(32.0));
        let ms = hist(1_000_000, &[(0, 1)]);
        assert_eq!(ms.max_us(), Some(2000.0));
        assert_eq!(LatencyHistogram::default().quantile_us(0.5), None);
        assert_eq!(LatencyHistogram::default().max_us(), None);
        assert_eq!(bucket_bounds(3), (8, 16));
    }

    #[test]
    fn merging_is_exact_where_max_over_nodes_is_not() {
        // Node a: 90 short waits; node b: 10 long ones. The cluster's p50 is short, while
        // the worst node's p50 is long.
        let a = hist(1000, &[(1, 90)]);
        let b = hist(1000, &[(10, 10)]);
        let mut all = LatencyHistogram::default();
        all.merge(&a).unwrap();
        all.merge(&b).unwrap();
        assert_eq!(all.count(), 100);
        assert!(all.quantile_us(0.5).unwrap() < 4.0);
        assert!(b.quantile_us(0.5).unwrap() >= 1024.0);
        assert!(all.quantile_us(0.95).unwrap() >= 1024.0);
        let err = all.merge(&hist(1_000_000, &[(1, 1)])).unwrap_err();
        assert_eq!(err.other_ns, 1_000_000);
        assert_eq!(all.count(), 100);
    }
}
