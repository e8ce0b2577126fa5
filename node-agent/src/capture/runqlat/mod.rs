//! Run-queue latency: the shared runqlat sampler (raw tracepoints
//! `sched_wakeup`, `sched_wakeup_new`, `sched_switch`), captures on top of it,
//! and their outputs (pprof, the classic text histogram, percentiles).
//!
//! A wait is attributed to the cgroup of the task that waits (libbpf-tools'
//! `runqlat -c` tests the cgroup of the waker instead).
//!
//! Layout: `sampler.rs` (the loaded programs and their maps), `capture.rs` (one capture's
//! window on the sampler), `profile.rs` (histograms, text report, pprof).

mod capture;
mod profile;
mod sampler;

pub use self::capture::RunqlatCapture;
pub use self::profile::{Histogram, Percentiles, RunqlatResult, bucket_bounds};
pub use self::sampler::RunqlatSampler;

/// `FF_TARGET_PER_PROCESS` of bpf/targets.h.
const FLAG_PER_PROCESS: u32 = 1;

/// `FF_TARGET_UNIT_MS` of bpf/targets.h.
const FLAG_UNIT_MS: u32 = 2;

/// `RUNQLAT_SLOTS` of bpf/runqlat.h.
const RUNQLAT_SLOTS: usize = 27;

/// Unit of the histogram buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LatencyUnit {
    /// Microseconds (libbpf-tools' default).
    #[default]
    Micros,
    /// Milliseconds (`runqlat -m`).
    Millis,
}

impl LatencyUnit {
    /// Nanoseconds per unit.
    pub fn nanos(self) -> u64 {
        match self {
            Self::Micros => 1_000,
            Self::Millis => 1_000_000,
        }
    }

    /// Column title of the text histogram.
    pub fn title(self) -> &'static str {
        match self {
            Self::Micros => "usecs",
            Self::Millis => "msecs",
        }
    }
}

/// How full a runqlat sampler's maps are (entries in use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunqlatMapFill {
    /// Target cgroups in the target map.
    pub targets: usize,
    /// Per-process histograms.
    pub histograms: usize,
    /// Start timestamps of the hash-map fallback (`None` with task storage, which the
    /// kernel frees with the task).
    pub starts: Option<usize>,
}

/// Options of one runqlat capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunqlatOptions {
    /// One histogram per process instead of one per target.
    pub per_process: bool,
    /// Bucket unit.
    pub unit: LatencyUnit,
}

/// Where the sampler gets "became runnable" timestamps from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartStorage {
    /// The scheduler's queue stamps, checked (the default, `--runqlat-clock hybrid`): one
    /// program on `sched_switch`, which reads the clock only where the run-queue clock is
    /// stale (after a wakeup preemption), so waits read as long as with our own clock.
    Hybrid,
    /// The scheduler's own (`task->sched_info.last_queued` and `run_delay`,
    /// `CONFIG_SCHED_INFO`, asked for with `--runqlat-clock scheduler`): one program on
    /// `sched_switch`, no clock read, no wakeup programs (`bpf/runqlat.bpf.c` explains).
    /// Task storage keeps only a per-task baseline for waits split by a migration.
    SchedInfo,
    /// Our own clock reads at wakeup and preemption, in BPF task storage (Linux 5.11+):
    /// no size limit, freed with the task.
    TaskStorage,
    /// A bounded hash map keyed by thread ID (older kernels, or forced).
    HashMap,
}

/// Where the hybrid variant took the ends of waits from, over a capture's window
/// (node-wide counters: the sampler is shared).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClockStats {
    /// Waits recorded.
    pub waits: u64,
    /// Of those, waits that ended on a CPU that was idle (the switch came from the idle
    /// task): each took PSI's stamp of the switch or read the clock. None where no CPU
    /// of the targets ever idles (a saturated node).
    pub after_idle: u64,
    /// Waits that ended while the run-queue clock was stale (a wakeup preemption): their
    /// end was read from the clock (`bpf_ktime_get_ns`) instead.
    pub clock_reads: u64,
    /// Of those, on a CPU with no calibration sample yet: the stale run-queue clock was
    /// used, and the wait may read short.
    pub uncalibrated: u64,
    /// Waits split by a migration (queued on one CPU, run on another), counted whole.
    pub split: u64,
    /// Waits that ended on a CPU that was idle, whose end was the kernel's PSI stamp of
    /// that very switch (no clock read).
    pub psi_stamps: u64,
    /// PSI stamps checked against the clock (at most one per CPU per 0.5 ms).
    pub psi_checks: u64,
    /// Of those, too far from the clock: the clock was used (and, after four, PSI stamps
    /// are no longer used on that CPU).
    pub psi_rejects: u64,
}

impl ClockStats {
    /// The counts of a window: these less those `before` it.
    pub fn since(self, before: Self) -> Self {
        Self {
            waits: self.waits.saturating_sub(before.waits),
            after_idle: self.after_idle.saturating_sub(before.after_idle),
            clock_reads: self.clock_reads.saturating_sub(before.clock_reads),
            uncalibrated: self.uncalibrated.saturating_sub(before.uncalibrated),
            split: self.split.saturating_sub(before.split),
            psi_stamps: self.psi_stamps.saturating_sub(before.psi_stamps),
            psi_checks: self.psi_checks.saturating_sub(before.psi_checks),
            psi_rejects: self.psi_rejects.saturating_sub(before.psi_rejects),
        }
    }
}

/// Loss counters over a capture's window (node-wide: maps are shared).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunqlatDrops {
    /// Events lost because the histogram map was full.
    pub hists_full: u64,
    /// Events lost because the start map was full (or task storage failed).
    pub start_full: u64,
}
