//! Heap profiles from eBPF allocation sampling: uprobes on the allocators of
//! the target cgroups' processes (`bpf/heap.bpf.c`), byte-based sampling in
//! the kernel, aggregation per (target, process, stack, size class), and a
//! pprof in Go's heap layout, scaled back up like Go's.
//!
//! Probes attach by binary path with pid = -1: every process mapping that
//! allocator is covered, including processes started during the capture; the
//! BPF programs keep only target cgroups. The capture rescans the targets'
//! processes every [`EbpfHeapOptions::rescan`] for allocators not yet probed
//! (a new container image, a `dlopen`ed jemalloc).
//!
//! Stacks are walked with the node's CFI unwind tables ([`crate::unwind`],
//! shared with the CPU sampler), so allocation sites in code built without
//! frame pointers keep their callers.
//!
//! What the profile means: `alloc_*` counts allocations made during the
//! capture; `inuse_*` those of them still live at its end. Allocations made
//! before the capture started are not seen (use the endpoint source for a
//! process's whole heap).
//!
//! The programs and probes are the node's one [`sampler::HeapSampler`],
//! shared by concurrent captures: a capture adds its targets to it, holds the
//! probes of the allocators its targets use, and reads only its own counts.
//!
//! Layout: `sampler.rs` (the node's loaded programs, probes and maps), `capture.rs` (one
//! capture's window on it), `profile.rs` (the pprof in Go's heap layout).

mod capture;
mod profile;
pub mod sampler;

use std::time::Duration;

pub use self::capture::{EbpfCapture, capture};
use super::sampling;
use crate::bpf::Pod;
use crate::bpf::heap::types;
use crate::unwind::WalkStats;

// SAFETY: generated from BTF of plain C structs of integers and arrays.
unsafe impl Pod for types::heap_agg_key {}
unsafe impl Pod for types::heap_agg_val {}
unsafe impl Pod for types::heap_live_val {}

/// Settings of one eBPF heap capture.
#[derive(Debug, Clone)]
pub struct EbpfHeapOptions {
    /// How long to sample.
    pub duration: Duration,
    /// Mean bytes between samples (`heap.sampleBytes`); 0 samples every allocation.
    /// The node's sampler runs at its first capture's rate: a capture joining it samples
    /// at that rate and says so ([`EbpfHeapStats::sample_bytes`]).
    pub sample_bytes: u64,
    /// How often to look for allocators not yet probed.
    pub rescan: Duration,
    /// The node name put in the `node` label.
    pub node: String,
    /// Use classic entry + return probes even where session uprobes exist
    /// (what kernels before 6.13 get; tests cover both paths with it).
    pub force_classic_uprobes: bool,
    /// Walk stacks with CFI tables (code without frame pointers); `false`
    /// keeps the kernel's frame-pointer walk.
    pub cfi_unwind: bool,
    /// Told once the probes are attached to the allocators of the targets'
    /// processes running at the start (allocations from then on are seen).
    pub ready: Option<std::sync::mpsc::SyncSender<()>>,
    /// Refuse when the first window projects more uprobe overhead than this
    /// (percent of the targets' CPU time); 0 turns the guard off.
    pub max_overhead_percent: f64,
    /// Capture even above `max_overhead_percent`.
    pub force: bool,
    /// Length of the first window that measures the allocation rate.
    pub overhead_window: Duration,
}

impl Default for EbpfHeapOptions {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(10),
            sample_bytes: sampling::DEFAULT_SAMPLE_BYTES,
            rescan: Duration::from_millis(500),
            node: String::new(),
            force_classic_uprobes: false,
            cfi_unwind: true,
            ready: None,
            max_overhead_percent: super::overhead::DEFAULT_MAX_OVERHEAD_PERCENT,
            force: false,
            overhead_window: Duration::from_millis(300),
        }
    }
}

/// Counters of one capture, reported with the profile; drops are never silent. The call,
/// sample and drop counters are the node's sampler's over the capture's window (all
/// captures running then: their maps are shared).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EbpfHeapStats {
    /// The sampling rate in effect (the node sampler's, set by its first capture; it can
    /// differ from the rate this capture asked for).
    pub sample_bytes: u64,
    /// Other captures sharing the sampler when this one started.
    pub shared_with: usize,
    /// Allocation calls made by target threads.
    pub calls: u64,
    /// Sampled allocations recorded.
    pub sampled: u64,
    /// Sampled allocations seen freed.
    pub freed: u64,
    /// Sampled allocations whose frees could not be tracked (live map full).
    pub dropped_live_full: u64,
    /// Samples lost to a full aggregation map.
    pub dropped_rows_full: u64,
    /// Samples whose stack was lost (stack map collision or full).
    pub dropped_stacks: u64,
    /// Calls not sampled for lack of per-thread state.
    pub dropped_thread_state: u64,
    /// Process notifications lost (ring buffer full).
    pub dropped_notifications: u64,
    /// Allocator binaries probed for this capture (paths inside the processes'
    /// namespaces), whether it attached them or joined probes already attached.
    pub allocators: Vec<String>,
    /// Uprobes on those binaries.
    pub probes: usize,
    /// Whether malloc-like entry points used session uprobes (Linux 6.13+),
    /// which skip the return trap for unsampled calls.
    pub session_uprobes: bool,
    /// How sampled stacks were walked (`None`: frame pointers only).
    pub walk: Option<WalkStats>,
    /// Uprobe overhead projected from the first window, in hundredths of a
    /// percent of the targets' CPU time (`None` when the guard was off).
    pub projected_overhead_basis_points: Option<u64>,
}

impl EbpfHeapStats {
    /// The counters as the capture summary carries them.
    pub fn summary(&self) -> flamefleet_proto::agent::HeapEbpfStats {
        flamefleet_proto::agent::HeapEbpfStats {
            sample_bytes: self.sample_bytes,
            shared_with: self.shared_with as u64,
            calls: self.calls,
            sampled: self.sampled,
            freed: self.freed,
            dropped_live_full: self.dropped_live_full,
            dropped_rows_full: self.dropped_rows_full,
            dropped_stacks: self.dropped_stacks,
            dropped_thread_state: self.dropped_thread_state,
            dropped_notifications: self.dropped_notifications,
            allocators: self.allocators.clone(),
            probes: self.probes as u64,
            session_uprobes: self.session_uprobes,
            projected_overhead_basis_points: self.projected_overhead_basis_points,
        }
    }
}
