//! CPU profiles: the shared CPU sampler (one perf event per online CPU, a BPF
//! program counting stacks of target cgroups in the kernel), captures on top
//! of it, and their pprof output.
//!
//! Layout: `sampler.rs` (the loaded program, its perf events and maps), `capture.rs` (one
//! capture's window on the sampler), `profile.rs` (samples, symbolization, pprof).

mod capture;
mod profile;
mod sampler;

pub use self::capture::CpuCapture;
pub use self::profile::{CpuSample, CpuSamples};
pub use self::sampler::CpuSampler;
pub use super::perf_event::PerfEventKind;
use super::{CaptureError, Result};

/// Highest sampling frequency accepted. perf's default
/// `kernel.perf_event_max_sample_rate` is higher, but beyond a few kHz the
/// sampler's own overhead stops being "bounded" in any useful sense.
pub const MAX_FREQUENCY: u64 = 10_000;

/// Options of the CPU sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    /// Samples per second per CPU.
    pub frequency: u64,
    /// The perf event driving the samples.
    pub event: PerfEventKind,
    /// Whether to record kernel stacks too.
    pub kernel_stacks: bool,
    /// Walk user stacks with CFI tables (code without frame pointers, frameless
    /// leaves); `false` keeps the kernel's frame-pointer walk.
    pub cfi_unwind: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            frequency: 99,
            event: PerfEventKind::CpuClock,
            kernel_stacks: true,
            cfi_unwind: true,
        }
    }
}

impl CpuOptions {
    /// Checks ranges; errors say what is accepted.
    pub fn validate(&self) -> Result<()> {
        if self.frequency == 0 || self.frequency > MAX_FREQUENCY {
            return Err(CaptureError::InvalidOptions(format!(
                "frequency must be between 1 and {MAX_FREQUENCY} Hz, found {}",
                self.frequency
            )));
        }
        Ok(())
    }
}

/// Loss counters of the CPU sampler over a capture's window (all targets of
/// the node: maps are shared).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuDrops {
    /// Samples lost because the count map was full.
    pub counts_full: u64,
    /// User stacks lost (stack map full).
    pub user_stack: u64,
    /// Kernel stacks lost (stack map full).
    pub kernel_stack: u64,
    /// New processes not announced to the symbolizer (ring buffer full).
    pub notify: u64,
}

impl CpuDrops {
    fn since(self, before: Self) -> Self {
        Self {
            counts_full: self.counts_full.saturating_sub(before.counts_full),
            user_stack: self.user_stack.saturating_sub(before.user_stack),
            kernel_stack: self.kernel_stack.saturating_sub(before.kernel_stack),
            notify: self.notify.saturating_sub(before.notify),
        }
    }

    /// Total of all counters.
    pub fn total(&self) -> u64 {
        self.counts_full + self.user_stack + self.kernel_stack + self.notify
    }
}

/// How full a CPU sampler's maps are (entries in use), for leak checks, the soak benchmark
/// and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuMapFill {
    /// Target cgroups in the target map.
    pub targets: usize,
    /// (target, thread, stacks) counters.
    pub counts: usize,
    /// Kernel stacks.
    pub kernel_stacks: usize,
    /// User stacks.
    pub user_stacks: usize,
}
