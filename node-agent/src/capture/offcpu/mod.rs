//! Off-CPU profiles: where the targets' threads wait. The shared off-CPU sampler (one
//! program on `sched_switch`: a thread that blocks is stamped and its user stack walked in
//! its own context; when it runs again the time it was blocked goes to its stacks, summed in
//! the kernel), captures on top of it, and their pprof output.
//!
//! Blocked means off the CPU and not runnable: sleeping, waiting on a lock, a pipe, a
//! socket, I/O. Once woken, the time a thread waits for a CPU is the run queue's, which
//! runqlat measures; it is kept apart here (`queued_ns`), never counted as off-CPU time.
//!
//! Layout: [`sampler`] (the loaded program and its maps), [`capture`] (one capture's window
//! on the sampler), [`profile`] (samples, symbolization, pprof), [`overhead`] (the guard of
//! a capture's first window).

mod capture;
pub mod overhead;
mod profile;
mod sampler;

use std::time::Duration;

pub use self::capture::OffcpuCapture;
pub use self::profile::{OffcpuProfile, OffcpuSample, OffcpuSamples, ShortBlocks};
pub use self::sampler::OffcpuSampler;
use super::{CaptureError, Result};

/// Default of [`OffcpuOptions::min_block`] (docs/offcpu.md says how it was chosen).
pub const DEFAULT_MIN_BLOCK: Duration = Duration::from_micros(1000);

/// Longest minimum block accepted: above it a capture would attribute almost nothing.
pub const MAX_MIN_BLOCK: Duration = Duration::from_secs(10);

/// Options of the off-CPU sampler, set when it is loaded: captures that join a running
/// sampler get its options (their result says which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffcpuOptions {
    /// Blocks shorter than this are counted per target but not attributed to stacks.
    pub min_block: Duration,
    /// Whether to record kernel stacks (they name why a thread blocked).
    pub kernel_stacks: bool,
    /// Walk user stacks with CFI tables; `false` loads no tables, so the walk follows frame
    /// pointers only.
    pub cfi_unwind: bool,
}

impl Default for OffcpuOptions {
    fn default() -> Self {
        Self {
            min_block: DEFAULT_MIN_BLOCK,
            kernel_stacks: true,
            cfi_unwind: true,
        }
    }
}

impl OffcpuOptions {
    /// Checks ranges; errors say what is accepted.
    pub fn validate(&self) -> Result<()> {
        if self.min_block > MAX_MIN_BLOCK {
            return Err(CaptureError::InvalidOptions(format!(
                "the minimum block time must be at most {}, found {}",
                humantime::format_duration(MAX_MIN_BLOCK),
                humantime::format_duration(self.min_block)
            )));
        }
        Ok(())
    }
}

/// The overhead guard of one capture (not a sampler option: each capture judges the cost
/// to its own targets, see [`overhead`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OffcpuGuard {
    /// Refuse above this projected percent of the targets' CPU time; 0: no guard.
    pub max_overhead_percent: f64,
    /// Capture even above the limit.
    pub force: bool,
}

impl Default for OffcpuGuard {
    fn default() -> Self {
        Self {
            max_overhead_percent: overhead::DEFAULT_MAX_OVERHEAD_PERCENT,
            force: false,
        }
    }
}

impl OffcpuGuard {
    /// Whether the guard judges a first window at all.
    pub fn active(&self) -> bool {
        self.max_overhead_percent > 0.0 && !self.force
    }
}

/// The sampler's counters over a capture's window (all targets of the node: the counters
/// are shared). Losses are never silent: each has its counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffcpuStats {
    /// Blocks of target threads that began (stamped at the switch-out).
    pub blocks: u64,
    /// Blocks that ended at or above the minimum: attributed to their stacks.
    pub walked: u64,
    /// Blocks that ended below the minimum: only counted.
    pub short_blocks: u64,
    /// Blocks that ended after their target had left the sampler (ignored).
    pub stale: u64,
    /// Walked blocks lost because the count map was full.
    pub counts_full: u64,
    /// Blocks lost because no stamp could be kept.
    pub stamp_full: u64,
    /// Kernel stacks lost (stack map full).
    pub kernel_stack: u64,
    /// New processes not announced to the symbolizer (ring buffer full).
    pub notify: u64,
}

impl OffcpuStats {
    fn since(self, before: Self) -> Self {
        Self {
            blocks: self.blocks.saturating_sub(before.blocks),
            walked: self.walked.saturating_sub(before.walked),
            short_blocks: self.short_blocks.saturating_sub(before.short_blocks),
            stale: self.stale.saturating_sub(before.stale),
            counts_full: self.counts_full.saturating_sub(before.counts_full),
            stamp_full: self.stamp_full.saturating_sub(before.stamp_full),
            kernel_stack: self.kernel_stack.saturating_sub(before.kernel_stack),
            notify: self.notify.saturating_sub(before.notify),
        }
    }

    /// Blocks lost (map full, no stamp) over the window.
    pub fn lost(&self) -> u64 {
        self.counts_full + self.stamp_full
    }
}

/// How full an off-CPU sampler's maps are (entries in use), for leak checks and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OffcpuMapFill {
    /// Target cgroups in the target map.
    pub targets: usize,
    /// (target, thread, stacks) totals.
    pub counts: usize,
    /// Kernel stacks.
    pub kernel_stacks: usize,
    /// User stacks.
    pub user_stacks: usize,
}
