//! One off-CPU capture: its targets in the shared sampler, read back as the difference
//! since it started.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use libbpf_rs::MapHandle;

use super::sampler::{
    OffcpuSampler, Shared, Totals, drop_unreferenced_stacks, read_counts, read_short, read_stats,
};
use super::{OffcpuSample, OffcpuSamples, OffcpuStats, ShortBlocks};
use crate::bpf::from_bytes;
use crate::bpf::offcpu::types::offcpu_key;
use crate::capture::target_table::{CaptureCgroups, delete_target_entries};
use crate::capture::{CaptureTarget, Result, stack_maps};
use crate::python::{PyFrame, PyStats};
use crate::unwind::WalkStats;

/// A running off-CPU capture; [`OffcpuCapture::finish`] returns its samples. Dropping it
/// without finishing releases its targets.
pub struct OffcpuCapture {
    pub(super) sampler: Arc<OffcpuSampler>,
    pub(super) targets: Vec<CaptureTarget>,
    /// The target cgroups and which target each belongs to.
    pub(super) cgroups: CaptureCgroups,
    pub(super) baseline: HashMap<Vec<u8>, Totals>,
    pub(super) short_before: HashMap<u32, Totals>,
    pub(super) stats_before: OffcpuStats,
    pub(super) walk_before: WalkStats,
    pub(super) py_before: PyStats,
    pub(super) started: SystemTime,
    pub(super) started_at: Instant,
}

impl std::fmt::Debug for OffcpuCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffcpuCapture")
            .field("targets", &self.targets)
            .finish()
    }
}

impl Drop for OffcpuCapture {
    fn drop(&mut self) {
        let mut shared = self.sampler.lock();
        let Shared {
            maps,
            table,
            unreferenced,
        } = &mut *shared;
        let removed = table.release(&maps.target_maps(), self.cgroups.ids());
        delete_target_entries::<offcpu_key>(&maps.counts, &removed, |k| k.target);
        if !removed.is_empty() {
            let freed = drop_unreferenced_stacks(maps, unreferenced);
            tracing::debug!(?freed, "off-CPU sampler: stacks no total refers to removed");
        }
    }
}

impl OffcpuCapture {
    /// The sampler this capture runs on.
    pub fn sampler(&self) -> &Arc<OffcpuSampler> {
        &self.sampler
    }

    /// The counters of the sampler since this capture started (all targets of the node),
    /// as the overhead guard reads them after its first window.
    pub fn stats(&self) -> OffcpuStats {
        read_stats(&self.sampler.lock().maps.cpus).since(self.stats_before)
    }

    /// Stops the capture and reads its samples (only this capture's: totals from before
    /// it started, or of other captures' targets, are excluded).
    pub fn finish(self) -> Result<OffcpuSamples> {
        self.read()
    }

    /// The samples so far, as [`Self::finish`] would read them now, without stopping the
    /// capture.
    pub fn peek(&self) -> Result<OffcpuSamples> {
        self.read()
    }

    fn read(&self) -> Result<OffcpuSamples> {
        let duration = self.started_at.elapsed();
        let shared = self.sampler.lock();
        // Indices nested below a target (another capture's) count for it too.
        let target_of_index = self.cgroups.owners(&shared.table);
        let own: HashSet<u32> = target_of_index.keys().copied().collect();
        let now = read_counts(&shared.maps.counts, &own)?;
        let short_now = read_short(&shared.maps.short_blocks, &own)?;
        let stats = read_stats(&shared.maps.cpus).since(self.stats_before);
        let walk = WalkStats::read(&shared.maps.unwind_stats).since(self.walk_before);
        let mut kernel_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut user_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut py_cache: HashMap<(u32, u64), Vec<PyFrame>> = HashMap::new();
        let python = self.sampler.tracker.python();
        let py_stats = PyStats::read(&shared.maps.py_stats).since(self.py_before);
        let mut samples = Vec::new();
        let mut expired_user_stacks = 0;
        for (raw, totals) in now {
            let t = totals.since(self.baseline.get(&raw).copied().unwrap_or_default());
            let Some(key) = from_bytes::<offcpu_key>(&raw) else {
                continue;
            };
            if t.blocks == 0 {
                continue;
            }
            let stack = |cache: &mut HashMap<u64, Vec<u64>>, map: &MapHandle, key: u64| {
                cache
                    .entry(key)
                    .or_insert_with(|| stack_maps::read(map, key))
                    .clone()
            };
            let user_stack = stack(&mut user_cache, &shared.maps.user_stacks, key.user_stack);
            if key.user_stack != 0 && user_stack.is_empty() {
                expired_user_stacks += t.blocks;
            }
            samples.push(OffcpuSample {
                target: target_of_index.get(&key.target).copied().unwrap_or(0),
                tgid: key.tgid,
                pid: key.pid,
                comm: crate::capture::comm_string(&key.comm),
                user_stack,
                kernel_stack: stack(
                    &mut kernel_cache,
                    &shared.maps.kernel_stacks,
                    key.kernel_stack,
                ),
                python: stack_maps::python_frames(
                    python,
                    &mut py_cache,
                    &shared.maps.py_stacks,
                    key.tgid,
                    key.py_stack,
                ),
                blocked_ns: t.blocked_ns,
                blocks: t.blocks,
                queued_ns: t.queued_ns,
            });
        }
        let mut short: Vec<ShortBlocks> = Vec::new();
        for (index, totals) in short_now {
            let t = totals.since(self.short_before.get(&index).copied().unwrap_or_default());
            let target = target_of_index.get(&index).copied().unwrap_or(0);
            match short.iter_mut().find(|s| s.target == target) {
                Some(s) => {
                    s.blocked_ns += t.blocked_ns;
                    s.blocks += t.blocks;
                    s.queued_ns += t.queued_ns;
                }
                None => short.push(ShortBlocks {
                    target,
                    blocked_ns: t.blocked_ns,
                    blocks: t.blocks,
                    queued_ns: t.queued_ns,
                }),
            }
        }
        short.retain(|s| s.blocks > 0);
        short.sort_by_key(|s| s.target);
        drop(shared);
        let mut tgids: Vec<u32> = samples.iter().map(|s| s.tgid).collect();
        tgids.sort_unstable();
        tgids.dedup();
        let python_status = python.map_or_else(Vec::new, |py| {
            tgids.iter().filter_map(|&t| py.status(t)).collect()
        });
        Ok(OffcpuSamples {
            targets: self.targets.clone(),
            samples,
            short,
            stats,
            expired_user_stacks,
            walk,
            python: python_status,
            py_stats,
            unwinder: self.sampler.unwinder().map(|u| u.stats()),
            options: self.sampler.options,
            started: self.started,
            duration,
        })
    }
}
