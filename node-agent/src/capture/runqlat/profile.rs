//! What a runqlat capture produced: histograms, percentiles, the classic text rendering
//! and the pprof profile.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use flamefleet_proto::pprof::Profile;

use super::{ClockStats, LatencyUnit, RunqlatDrops, StartStorage};
use crate::capture::CaptureTarget;
use crate::pprof::{Frame, FrameLine, Label, ProfileBuilder};

/// A log2 latency histogram: `slots[i]` counts waits in `[2^i, 2^(i+1))`
/// units, except slot 0 which is `[0, 2)` as in libbpf-tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    /// Index into [`RunqlatResult::targets`].
    pub target: usize,
    /// The process, for per-process histograms.
    pub tgid: Option<u32>,
    /// Process name (per-process histograms only).
    pub comm: String,
    /// Counts per bucket.
    pub slots: Vec<u64>,
}

/// Bounds of bucket `i` in units, `[low, high)`: the one definition the operator's merge
/// shares.
pub use flamefleet_proto::latency::bucket_bounds;

impl Histogram {
    /// Number of waits.
    pub fn count(&self) -> u64 {
        self.slots.iter().sum()
    }

    /// Index of the bucket holding the median wait.
    pub fn median_bucket(&self) -> Option<usize> {
        let total = self.count();
        let mut seen = 0;
        self.slots.iter().position(|&n| {
            seen += n;
            total > 0 && seen * 2 >= total
        })
    }

    /// The `q` quantile (0..1) in units, interpolated linearly inside its bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        flamefleet_proto::latency::quantile(&self.slots, q)
    }

    /// The classic libbpf-tools text rendering.
    pub fn render(&self, unit: LatencyUnit) -> String {
        let last = self.slots.iter().rposition(|&n| n > 0).unwrap_or(0);
        let max = self.slots.iter().copied().max().unwrap_or(0).max(1);
        let mut out = format!("{:5}{:<19} : count    distribution\n", "", unit.title());
        for (i, &n) in self.slots.iter().enumerate().take(last + 1) {
            let (lo, hi) = bucket_bounds(i);
            let stars = (n * 40 / max) as usize;
            let _ = writeln!(
                out,
                "{:>10} -> {:<10} : {:<8} |{:<40}|",
                lo,
                hi - 1,
                n,
                "*".repeat(stars)
            );
        }
        out
    }
}

/// p50/p90/p99 of one target, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50_ns: f64,
    /// 90th percentile.
    pub p90_ns: f64,
    /// 99th percentile.
    pub p99_ns: f64,
}

/// The result of a runqlat capture.
#[derive(Debug, Clone)]
pub struct RunqlatResult {
    /// The capture's targets.
    pub targets: Vec<CaptureTarget>,
    /// Non-empty histograms, sorted by (target, process).
    pub histograms: Vec<Histogram>,
    /// Bucket unit.
    pub unit: LatencyUnit,
    /// Losses during the window.
    pub drops: RunqlatDrops,
    /// Where start timestamps were kept.
    pub storage: StartStorage,
    /// Where the ends of waits came from (the hybrid variant only).
    pub clock: Option<ClockStats>,
    /// Wall-clock start.
    pub started: SystemTime,
    /// Capture length.
    pub duration: Duration,
}

impl RunqlatResult {
    /// One histogram per target (processes folded), in target order; targets
    /// without waits get an empty histogram.
    pub fn per_target(&self) -> Vec<Histogram> {
        let slots = self.histograms.first().map_or(27, |h| h.slots.len());
        let mut out: Vec<Histogram> = (0..self.targets.len())
            .map(|target| Histogram {
                target,
                tgid: None,
                comm: String::new(),
                slots: vec![0; slots],
            })
            .collect();
        for h in &self.histograms {
            if let Some(t) = out.get_mut(h.target) {
                for (a, b) in t.slots.iter_mut().zip(&h.slots) {
                    *a += b;
                }
            }
        }
        out
    }

    /// Every wait of the capture's targets in one histogram, in the wire form the operator
    /// merges across nodes (per-process histograms add up to their target's, so nothing is
    /// counted twice).
    pub fn node_histogram(&self) -> flamefleet_proto::agent::LatencyHistogram {
        let mut all = flamefleet_proto::agent::LatencyHistogram {
            unit_ns: self.unit.nanos(),
            buckets: Vec::new(),
        };
        for h in &self.histograms {
            let part = flamefleet_proto::agent::LatencyHistogram {
                unit_ns: all.unit_ns,
                buckets: h.slots.clone(),
            };
            // Same unit by construction.
            let _ = all.merge(&part);
        }
        all
    }

    /// p50/p90/p99 per target (`None` for a target without waits).
    pub fn percentiles(&self) -> Vec<Option<Percentiles>> {
        let ns = self.unit.nanos() as f64;
        self.per_target()
            .iter()
            .map(|h| {
                Some(Percentiles {
                    p50_ns: h.quantile(0.50)? * ns,
                    p90_ns: h.quantile(0.90)? * ns,
                    p99_ns: h.quantile(0.99)? * ns,
                })
            })
            .collect()
    }

    /// The text report: per target (and process), the classic histogram and
    /// the percentiles.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let pct = self.percentiles();
        for (i, t) in self.targets.iter().enumerate() {
            let waits = pct.get(i).copied().flatten();
            // A pod's catch-all target for containers started during the capture says
            // nothing when none did.
            if waits.is_none() && t.labels.container == crate::capture::STARTED_DURING_CAPTURE {
                continue;
            }
            let l = &t.labels;
            if l.pod.is_empty() {
                let _ = writeln!(out, "cgroup {}", t.cgroup.path.display());
            } else {
                let _ = writeln!(
                    out,
                    "pod {}/{} container {} (cgroup {})",
                    l.namespace,
                    l.pod,
                    l.container,
                    t.cgroup.path.display()
                );
            }
            for h in self
                .histograms
                .iter()
                .filter(|h| h.target == i && h.tgid.is_some())
            {
                let _ = writeln!(out, "\npid = {} {}", h.tgid.unwrap_or(0), h.comm);
                out.push_str(&h.render(self.unit));
            }
            if let Some(all) = self.per_target().get(i) {
                out.push('\n');
                out.push_str(&all.render(self.unit));
            }
            match waits {
                Some(p) => {
                    let _ = writeln!(
                        out,
                        "p50 {:.1} us  p90 {:.1} us  p99 {:.1} us\n",
                        p.p50_ns / 1e3,
                        p.p90_ns / 1e3,
                        p.p99_ns / 1e3
                    );
                }
                None => out.push_str("no run-queue waits recorded\n\n"),
            }
        }
        let _ = writeln!(
            out,
            "drops: hists_full={} start_full={}",
            self.drops.hists_full, self.drops.start_full
        );
        out
    }

    /// The pprof profile: one sample per (target, [process,] bucket) with
    /// values `count` and `latency/nanoseconds` (bucket midpoint × count),
    /// numeric labels `bucket_low`/`bucket_high` (nanoseconds), and a
    /// synthetic stack target → [process →] bucket for flame graphs.
    pub fn to_profile(&self, node: &str) -> Profile {
        let mut b = ProfileBuilder::new(&[("count", "count"), ("latency", "nanoseconds")]);
        b.window(self.started, self.duration);
        b.default_sample_type("count");
        b.comment(&format!(
            "runqlat, {} buckets, start timestamps in {:?}; drops: hists_full={} start_full={}",
            self.unit.title(),
            self.storage,
            self.drops.hists_full,
            self.drops.start_full
        ));
        if let Some(c) = self.clock {
            b.comment(&format!(
                "hybrid clock (node-wide): {} waits, {} ended on a CPU that was idle, {} ended on a stale run-queue clock and were read from the clock ({} before calibration), {} ended after idle at PSI's switch stamp ({} checked against the clock, {} rejected), {} counted whole across a migration",
                c.waits, c.after_idle, c.clock_reads, c.uncalibrated, c.psi_stamps, c.psi_checks, c.psi_rejects, c.split
            ));
        }
        let unit_ns = self.unit.nanos();
        let synthetic = |name: String| Frame {
            address: 0,
            mapping: None,
            lines: vec![FrameLine {
                function: name,
                file: String::new(),
                line: 0,
            }],
        };
        for h in &self.histograms {
            let target = self.targets.get(h.target);
            let root = synthetic(target.map_or_else(String::new, |t| {
                if t.labels.pod.is_empty() {
                    t.cgroup.path.display().to_string()
                } else {
                    format!(
                        "{}/{}/{}",
                        t.labels.namespace, t.labels.pod, t.labels.container
                    )
                }
            }));
            let mut labels = crate::capture::target_labels(target, node);
            if let Some(tgid) = h.tgid {
                labels.push(Label::Num("pid".into(), i64::from(tgid), String::new()));
                labels.push(Label::Str("comm".into(), h.comm.clone()));
            }
            for (i, &n) in h.slots.iter().enumerate().filter(|(_, n)| **n > 0) {
                let (lo, hi) = bucket_bounds(i);
                let (lo_ns, hi_ns) = (lo * unit_ns, hi * unit_ns);
                let mut stack = vec![synthetic(format!(
                    "runqlat [{lo}, {hi}) {}",
                    self.unit.title()
                ))];
                if let Some(tgid) = h.tgid {
                    stack.push(synthetic(format!("{} ({tgid})", h.comm)));
                }
                stack.push(root.clone());
                let mut l = labels.clone();
                l.push(Label::Num(
                    "bucket_low".into(),
                    lo_ns as i64,
                    "nanoseconds".into(),
                ));
                l.push(Label::Num(
                    "bucket_high".into(),
                    hi_ns as i64,
                    "nanoseconds".into(),
                ));
                let mid = (lo_ns + hi_ns) / 2;
                b.add_sample(&stack, &[n as i64, (n * mid) as i64], &l);
            }
        }
        b.build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_rendering_follow_the_buckets() {
        let mut slots = vec![0; 27];
        slots[2] = 50; // [4, 8)
        slots[4] = 50; // [16, 32)
        let h = Histogram {
            target: 0,
            tgid: None,
            comm: String::new(),
            slots,
        };
        assert_eq!(h.count(), 100);
        assert_eq!(h.median_bucket(), Some(2));
        assert_eq!(h.quantile(0.5), Some(8.0));
        assert!(h.quantile(0.99).is_some_and(|q| (16.0..32.0).contains(&q)));
        let text = h.render(LatencyUnit::Micros);
        assert!(text.contains("usecs"));
        assert!(text.contains("4 -> 7"), "{text}");
        assert!(text.contains("16 -> 31"), "{text}");
        assert_eq!(bucket_bounds(0), (0, 2));
        assert_eq!(bucket_bounds(3), (8, 16));
    }
}
