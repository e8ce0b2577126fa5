//! The math of byte-based allocation sampling: the exponential gap table the
//! BPF program draws from, and the weights that scale samples back up.
//!
//! Sample points form a Poisson process over allocated bytes with mean gap
//! `rate` bytes (Go's `MemProfileRate`, jemalloc's `lg_prof_sample`), so an
//! allocation of `s` bytes is sampled with probability `1 - exp(-s / rate)`.
//! Dividing by that probability gives unbiased counts and bytes, exactly what
//! pprof does for Go heap profiles (`scaleHeapSample` in Go's runtime/pprof).

/// Default mean number of bytes between samples (512 KiB, as Go and jemalloc).
pub const DEFAULT_SAMPLE_BYTES: u64 = 512 * 1024;

/// Exponential quantiles of mean `rate`, at the midpoints `(i + 0.5) / n`.
///
/// A random index into this table is a draw from a discretized exponential
/// distribution; with 4096 entries its mean is within 0.2% of `rate` and the
/// tail is cut at about 8.7 × `rate`, which no realistic workload notices.
/// `rate == 0` gives all zeros: every allocation is sampled.
pub fn gap_table(rate: u64, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let u = (i as f64 + 0.5) / n as f64;
            // Largest gaps first or last does not matter: the index is random.
            (-(1.0 - u).ln() * rate as f64).round() as u64
        })
        .collect()
}

/// Probability that one allocation of `size` bytes is sampled at `rate`.
pub fn sample_probability(size: f64, rate: u64) -> f64 {
    if rate == 0 || size <= 0.0 {
        return 1.0;
    }
    -(-size / rate as f64).exp_m1()
}

/// Scales a row of `count` sampled allocations totalling `bytes` back to an
/// estimate of all allocations, using the row's average size like pprof does
/// for Go. Rows are split by size class in the kernel, so the average is
/// close to every member's size and the nonlinearity of the weight costs
/// little. Returns `(count, bytes)`.
pub fn scale(count: u64, bytes: u64, rate: u64) -> (f64, f64) {
    if count == 0 {
        return (0.0, 0.0);
    }
    let avg = bytes as f64 / count as f64;
    let w = 1.0 / sample_probability(avg, rate);
    (count as f64 * w, bytes as f64 * w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gap_table_is_exponential_with_the_requested_mean() {
        let rate = DEFAULT_SAMPLE_BYTES;
        let t = gap_table(rate, 4096);
        let mean = t.iter().map(|&g| g as f64).sum::<f64>() / t.len() as f64;
        assert!((mean / rate as f64 - 1.0).abs() < 0.003, "mean {mean}");
        // Median of an exponential is rate * ln 2.
        let mut sorted = t.clone();
        sorted.sort_unstable();
        let median = sorted[2048] as f64;
        assert!(
            (median / (rate as f64 * 2f64.ln()) - 1.0).abs() < 0.01,
            "median {median}"
        );
        assert!(gap_table(0, 16).iter().all(|&g| g == 0));
    }

    #[test]
    fn weights_undo_the_sampling_probability() {
        // Tiny allocations: probability ~ size / rate, weight ~ rate / size.
        let (c, b) = scale(10, 160, 512 * 1024);
        assert!((c / 10.0 - 512.0 * 1024.0 / 16.0).abs() / c < 0.01);
        assert!((b - c * 16.0).abs() < 1e-6 * b);
        // Huge allocations are always sampled: weight 1.
        let (c, b) = scale(3, 3 * 64 * 1024 * 1024, 512 * 1024);
        assert!((c - 3.0).abs() < 1e-9 && (b - 3.0 * 64.0 * 1024.0 * 1024.0).abs() < 1e-3);
        // Rate 0 samples everything.
        assert_eq!(scale(5, 50, 0), (5.0, 50.0));
        assert_eq!(scale(0, 0, 512), (0.0, 0.0));
    }

    #[test]
    fn simulated_sampling_is_unbiased() {
        // Drive the countdown the BPF program runs over a known allocation
        // sequence, weight each sample, and compare with the truth.
        let rate = 64 * 1024;
        let table = gap_table(rate, 4096);
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut draw = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            table[(state % 4096) as usize] as i64
        };
        let mut countdown = draw();
        let (mut truth, mut estimate) = (0u64, 0.0);
        for i in 0..200_000u64 {
            let size = 1024 + (i * 7919) % (256 * 1024);
            truth += size;
            countdown -= size as i64;
            if countdown <= 0 {
                countdown = draw();
                estimate += scale(1, size, rate).1;
            }
        }
        let err = estimate / truth as f64 - 1.0;
        assert!(err.abs() < 0.03, "estimate off by {:.1}%", err * 100.0);
    }
}
