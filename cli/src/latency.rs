//! Run-queue latency read back from a runqlat profile: the agent writes one sample per
//! (target, log2 bucket) whose `count` is the bucket's waits and whose numeric labels
//! `bucket_low`/`bucket_high` are the bucket's bounds in nanoseconds. Summed per bucket, they
//! are the histogram again, with the percentiles of `flamefleet_proto`'s
//! [`LatencyHistogram`] (the one definition the agent and the operator use too).

use std::collections::BTreeMap;
use std::fmt::Write;

use flamefleet_proto::agent::LatencyHistogram;
use flamefleet_proto::latency::bucket_bounds;
use flamefleet_proto::pprof::Profile;

use crate::profile_file::string;

/// The bucket units the agent writes: microseconds, then milliseconds.
const UNITS_NS: [u64; 2] = [1_000, 1_000_000];

/// The percentiles every latency view marks.
pub const QUANTILES: [(f64, &str); 3] = [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")];

/// One sample of a runqlat profile: its bucket's bounds (nanoseconds) and waits.
struct BucketSample {
    low: u64,
    high: u64,
    count: u64,
    /// Its index in the profile's samples.
    sample: usize,
}

/// The samples that have both bucket bounds; `None` when the profile has no `count` sample
/// type.
fn bucket_samples(profile: &Profile) -> Option<Vec<BucketSample>> {
    let count = profile
        .sample_type
        .iter()
        .position(|vt| string(profile, vt.r#type) == "count")?;
    let mut out = Vec::new();
    for (i, sample) in profile.sample.iter().enumerate() {
        let num = |key: &str| {
            sample
                .label
                .iter()
                .find(|l| string(profile, l.key) == key)
                .and_then(|l| u64::try_from(l.num).ok())
        };
        let (Some(low), Some(high)) = (num("bucket_low"), num("bucket_high")) else {
            continue;
        };
        let n = sample
            .value
            .get(count)
            .and_then(|v| u64::try_from(*v).ok())
            .unwrap_or(0);
        out.push(BucketSample {
            low,
            high,
            count: n,
            sample: i,
        });
    }
    Some(out)
}

/// The log2 bucket index of `[low, high)` nanoseconds in `unit_ns` units, if it is one.
fn bucket_index(low: u64, high: u64, unit_ns: u64) -> Option<usize> {
    let index = if low == 0 {
        0
    } else {
        if !low.is_multiple_of(unit_ns) || !(low / unit_ns).is_power_of_two() {
            return None;
        }
        (low / unit_ns).trailing_zeros() as usize
    };
    let (lo, hi) = bucket_bounds(index);
    (lo.checked_mul(unit_ns) == Some(low) && hi.checked_mul(unit_ns) == Some(high)).then_some(index)
}

/// The unit in which every `(low, high)` is a log2 bucket.
fn unit_of(bounds: impl Iterator<Item = (u64, u64)> + Clone) -> Option<u64> {
    UNITS_NS.into_iter().find(|&unit| {
        bounds
            .clone()
            .all(|(lo, hi)| bucket_index(lo, hi, unit).is_some())
    })
}

fn add(h: &mut LatencyHistogram, index: usize, n: u64) {
    if h.buckets.len() <= index {
        h.buckets.resize(index + 1, 0);
    }
    h.buckets[index] = h.buckets[index].saturating_add(n);
}

/// The histogram of a runqlat profile, all targets together; `None` when `profile` is not
/// one (no sample with bucket bounds, or bounds that are not log2 buckets).
pub fn histogram(profile: &Profile) -> Option<LatencyHistogram> {
    let samples = bucket_samples(profile)?;
    if samples.is_empty() {
        return None;
    }
    let unit_ns = unit_of(samples.iter().map(|s| (s.low, s.high)))?;
    let mut h = LatencyHistogram {
        unit_ns,
        buckets: Vec::new(),
    };
    for s in samples {
        add(&mut h, bucket_index(s.low, s.high, unit_ns)?, s.count);
    }
    Some(h)
}

/// The histograms of a runqlat profile per value of its string label `key` (e.g. `run` in a
/// policy's merged profile); samples without the label are left out. Empty when `profile`
/// is not a runqlat profile.
pub fn histograms_by(profile: &Profile, key: &str) -> BTreeMap<String, LatencyHistogram> {
    let mut out: BTreeMap<String, LatencyHistogram> = BTreeMap::new();
    let Some(samples) = bucket_samples(profile) else {
        return out;
    };
    let Some(unit_ns) = unit_of(samples.iter().map(|s| (s.low, s.high))) else {
        return out;
    };
    for s in samples {
        let Some(value) = profile.sample[s.sample]
            .label
            .iter()
            .find(|l| string(profile, l.key) == key && l.str != 0)
            .map(|l| string(profile, l.str).to_owned())
        else {
            continue;
        };
        let Some(index) = bucket_index(s.low, s.high, unit_ns) else {
            continue;
        };
        let h = out.entry(value).or_insert_with(|| LatencyHistogram {
            unit_ns,
            buckets: Vec::new(),
        });
        add(h, index, s.count);
    }
    out
}

/// A latency in microseconds, short: `850us`, `1.2ms`, `3.40s`.
pub fn format_us(us: f64) -> String {
    if us < 1_000.0 {
        if us < 10.0 {
            format!("{us:.1}us")
        } else {
            format!("{us:.0}us")
        }
    } else if us < 1_000_000.0 {
        format!("{:.1}ms", us / 1e3)
    } else {
        format!("{:.2}s", us / 1e6)
    }
}

/// A bucket bound in nanoseconds, short: `0`, `2us`, `512us`, `1.02ms`, `4.29s`.
pub fn format_bound_ns(ns: u64) -> String {
    match ns {
        0 => "0".to_owned(),
        n if n < 1_000 => format!("{n}ns"),
        n if n < 1_000_000 => format!("{}us", trim(n as f64 / 1e3)),
        n if n < 1_000_000_000 => format!("{}ms", trim(n as f64 / 1e6)),
        n => format!("{}s", trim(n as f64 / 1e9)),
    }
}

/// Three significant digits, without trailing zeros: log2 bounds are rarely round in
/// decimal (1024 us is `1.02ms`).
fn trim(v: f64) -> String {
    let s = if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// The percentiles line: `N waits; p50 X, p90 Y, p99 Z; none longer than M`.
pub fn summary(h: &LatencyHistogram) -> String {
    let mut line = format!("{} waits", h.count());
    let marks: Vec<String> = QUANTILES
        .iter()
        .filter_map(|&(q, name)| h.quantile_us(q).map(|v| format!("{name} {}", format_us(v))))
        .collect();
    if !marks.is_empty() {
        let _ = write!(line, "; {}", marks.join(", "));
    }
    if let Some(max) = h.max_us() {
        let _ = write!(line, "; none longer than {}", format_us(max));
    }
    line
}

/// The percentiles line and the histogram as runqlat prints it (`usecs : count
/// distribution`).
pub fn text(h: &LatencyHistogram) -> String {
    let mut out = summary(h);
    out.push('\n');
    let unit = if h.unit_ns == 1_000_000 {
        "msecs"
    } else {
        "usecs"
    };
    let Some(last) = h.buckets.iter().rposition(|&n| n > 0) else {
        return out;
    };
    let max = h.buckets.iter().copied().max().unwrap_or(1).max(1);
    let _ = writeln!(out, "{unit:>10}               : count    distribution");
    for (i, &n) in h.buckets.iter().enumerate().take(last + 1) {
        let (lo, hi) = bucket_bounds(i);
        let stars = usize::try_from(n.saturating_mul(40) / max).unwrap_or(40);
        let _ = writeln!(
            out,
            "{lo:>10} -> {:<10} : {n:<8} |{:<40}|",
            hi - 1,
            "*".repeat(stars)
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use flamefleet_proto::pprof::{Label, Sample, ValueType};

    /// A runqlat profile as the agent writes it: `(run label, bucket index, count)` in
    /// microsecond buckets.
    pub(crate) fn runqlat_profile(samples: &[(&str, usize, i64)]) -> Profile {
        let mut p = Profile {
            string_table: [
                "",
                "count",
                "latency",
                "nanoseconds",
                "bucket_low",
                "bucket_high",
                "run",
            ]
            .map(String::from)
            .to_vec(),
            sample_type: vec![
                ValueType { r#type: 1, unit: 1 },
                ValueType { r#type: 2, unit: 3 },
            ],
            ..Default::default()
        };
        for &(run, i, n) in samples {
            let (lo, hi) = bucket_bounds(i);
            p.string_table.push(run.to_owned());
            let run_index = (p.string_table.len() - 1) as i64;
            p.sample.push(Sample {
                location_id: vec![],
                value: vec![n, n * (lo + hi) as i64 * 500],
                label: vec![
                    Label {
                        key: 4,
                        num: (lo * 1000) as i64,
                        num_unit: 3,
                        ..Default::default()
                    },
                    Label {
                        key: 5,
                        num: (hi * 1000) as i64,
                        num_unit: 3,
                        ..Default::default()
                    },
                    Label {
                        key: 6,
                        str: run_index,
                        ..Default::default()
                    },
                ],
            });
        }
        p
    }

    #[test]
    fn the_histogram_comes_back_from_the_samples() {
        let p = runqlat_profile(&[("a", 1, 90), ("a", 4, 8), ("b", 4, 2), ("b", 10, 1)]);
        let h = histogram(&p).unwrap();
        assert_eq!(h.unit_ns, 1000);
        assert_eq!(h.count(), 101);
        assert_eq!(h.buckets[1], 90);
        assert_eq!(h.buckets[4], 10);
        assert_eq!(h.buckets[10], 1);
        let by_run = histograms_by(&p, "run");
        assert_eq!(by_run.len(), 2);
        assert_eq!(by_run["a"].count(), 98);
        assert_eq!(by_run["b"].buckets[10], 1);
        let text = text(&h);
        assert!(text.starts_with("101 waits; p50 "), "{text}");
        assert!(text.contains("none longer than 2.0ms"), "{text}");
        assert!(text.contains("         2 -> 3          : 90"), "{text}");
        // Not a runqlat profile: no histogram.
        let cpu = crate::stacks::tests::profile(&[("cpu", "nanoseconds")], &[(&["f"], &[1])]);
        assert!(histogram(&cpu).is_none());
    }

    #[test]
    fn bounds_and_units() {
        assert_eq!(bucket_index(0, 2_000, 1_000), Some(0));
        assert_eq!(bucket_index(8_000, 16_000, 1_000), Some(3));
        assert_eq!(bucket_index(8_000, 16_000, 1_000_000), None);
        assert_eq!(bucket_index(3_000, 6_000, 1_000), None);
        assert_eq!(format_bound_ns(0), "0");
        assert_eq!(format_bound_ns(2_000), "2us");
        assert_eq!(format_bound_ns(1_024_000), "1.02ms");
        assert_eq!(format_bound_ns(4_096_000), "4.1ms");
        assert_eq!(format_bound_ns(512_000), "512us");
        assert_eq!(format_bound_ns(16_384_000), "16.4ms");
        assert_eq!(format_us(850.0), "850us");
        assert_eq!(format_us(1_260.0), "1.3ms");
    }
}
