//! The run-queue latency of a watched cgroup, for latency triggers.
//!
//! No BPF of its own: a latency watch is a long-running target of the node's runqlat sampler
//! (`bpf/runqlat.bpf.c`, the programs and maps runqlat captures use). The kernel counts the
//! waits of the cgroup's tasks (and of its descendants) in a log2 histogram per target,
//! per CPU; tasks of cgroups no capture or trigger targets cost `sched_switch` one target
//! lookup (a per-CPU cache hit, else one cgroup-storage lookup) and nothing else. While a
//! latency trigger watches any cgroup the sampler stays loaded, so every context switch of
//! the node runs its program: that is the price of watching, measured by the `trigger_cost`
//! bench (docs/triggers.md, "Cost").
//!
//! The watcher reads the histogram on its tick (one per-CPU map lookup per watched cgroup)
//! and keeps a snapshot of the cumulative counts every sixteenth of the window (at least a
//! tick): the waits of the last window are the counts now less those of the newest snapshot
//! at least a window old, so memory is bounded (at most 18 snapshots of 27 counters per
//! cgroup) and the window slides in steps of a sixteenth of itself.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Result, TriggerError};
use crate::capture::runqlat::{LatencyUnit, RunqlatCapture, RunqlatOptions};
use crate::capture::{CaptureTarget, Samplers};
use crate::cgroup::Cgroup;

/// Fewest waits in a window for its p99 to be judged: the p99 of a handful of waits is
/// their maximum, which one unlucky wakeup sets.
pub const MIN_WAITS: u64 = 50;
/// Snapshots per window.
const STEPS: u32 = 16;

/// The waits of one window.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowWaits {
    /// Counts per log2 bucket of microseconds (`flamefleet_proto::latency::bucket_bounds`).
    pub slots: Vec<u64>,
    /// How long the window actually spans (shorter than asked while the watch is young).
    pub span: Duration,
}

impl WindowWaits {
    /// Number of waits.
    pub fn count(&self) -> u64 {
        self.slots.iter().sum()
    }

    /// The `q` quantile in microseconds, interpolated inside its bucket as a runqlat
    /// capture's percentiles are (`None` without waits).
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        flamefleet_proto::latency::quantile(&self.slots, q)
    }
}

/// The run-queue latency of one watched cgroup.
pub struct LatencyWatch {
    capture: RunqlatCapture,
    counts: WindowCounts,
}

impl std::fmt::Debug for LatencyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyWatch")
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl LatencyWatch {
    /// Starts counting the waits of `cgroup`'s tasks (and its descendants') on the node's
    /// runqlat sampler (loading it when no capture runs); `window` is the longest window
    /// asked, `tick` how often [`Self::read`] is called.
    pub fn start(
        samplers: &Arc<Samplers>,
        cgroup: &Cgroup,
        window: Duration,
        tick: Duration,
        now: Instant,
    ) -> Result<Self> {
        let capture = samplers
            .start_runqlat(
                &[CaptureTarget::raw(cgroup.clone())],
                &RunqlatOptions {
                    per_process: false,
                    unit: LatencyUnit::Micros,
                },
            )
            .map_err(|e| TriggerError::Runqlat(e.to_string()))?;
        Ok(Self {
            capture,
            counts: WindowCounts::new(window, tick, now),
        })
    }

    /// Reads the counts now and returns the waits of the last `window` (or since the
    /// watch began, when that is shorter).
    pub fn read(&mut self, now: Instant, window: Duration) -> Result<WindowWaits> {
        let current = self
            .capture
            .totals()
            .map_err(|e| TriggerError::Runqlat(e.to_string()))?;
        Ok(self.counts.observe(now, current, window))
    }
}

/// Cumulative counts kept at steps of a sixteenth of the longest window: what a window's
/// waits are computed from.
#[derive(Debug)]
pub struct WindowCounts {
    /// (when, cumulative counts since the watch began), oldest first.
    snapshots: VecDeque<(Instant, Vec<u64>)>,
    /// The longest window asked.
    window: Duration,
    /// Least time between two snapshots.
    step: Duration,
}

impl WindowCounts {
    /// Nothing counted at `now`; windows up to `window`, observed every `tick`.
    pub fn new(window: Duration, tick: Duration, now: Instant) -> Self {
        Self {
            snapshots: VecDeque::from([(now, Vec::new())]),
            window,
            step: (window / STEPS).max(tick),
        }
    }

    /// The waits of the last `window` given the cumulative counts `current` at `now`; keeps
    /// `current` when a step has passed since the last snapshot kept.
    pub fn observe(&mut self, now: Instant, current: Vec<u64>, window: Duration) -> WindowWaits {
        let start = now.checked_sub(window);
        let base = self
            .snapshots
            .iter()
            .rev()
            .find(|(at, _)| start.is_some_and(|s| *at <= s))
            .or(self.snapshots.front());
        let (at, base) = match base {
            Some((at, b)) => (*at, b.as_slice()),
            None => (now, &[][..]),
        };
        let waits = WindowWaits {
            slots: current
                .iter()
                .enumerate()
                .map(|(i, &n)| n.saturating_sub(base.get(i).copied().unwrap_or(0)))
                .collect(),
            span: now.saturating_duration_since(at),
        };
        if self
            .snapshots
            .back()
            .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= self.step)
        {
            self.snapshots.push_back((now, current));
        }
        // Keep one snapshot at least the longest window old, none older.
        if let Some(start) = now.checked_sub(self.window) {
            while self.snapshots.get(1).is_some_and(|(at, _)| *at <= start) {
                self.snapshots.pop_front();
            }
        }
        waits
    }

    /// Snapshots kept now (at most the window's steps and two).
    pub fn snapshots(&self) -> usize {
        self.snapshots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_the_waits_of_its_last_span_from_bounded_snapshots() {
        let t0 = Instant::now();
        let tick = Duration::from_secs(1);
        let mut c = WindowCounts::new(Duration::from_secs(32), tick, t0);
        // 10 waits a second in bucket 3 for 100 s, then 1000 a second in bucket 15.
        let mut total = vec![0u64; 27];
        let mut last = None;
        for s in 1..=130u64 {
            if s <= 100 {
                total[3] += 10;
            } else {
                total[15] += 1000;
            }
            let w = c.observe(t0 + tick * s as u32, total.clone(), Duration::from_secs(10));
            assert!(c.snapshots() <= 18, "{} snapshots at {s} s", c.snapshots());
            if s == 5 {
                // Younger than the window: since the start.
                assert_eq!((w.count(), w.span), (50, Duration::from_secs(5)));
            }
            last = Some(w);
        }
        let w = last.unwrap();
        // The last 10 s (to within a step of 2 s): only the slow waits.
        assert!((10..=12).contains(&w.span.as_secs()), "{:?}", w.span);
        assert_eq!(w.slots[3], 0);
        assert_eq!(w.slots[15], w.span.as_secs() * 1000);
        let p99 = w.quantile_us(0.99).unwrap();
        assert!((32_768.0..65_536.0).contains(&p99), "{p99}");
    }
}
