//! One CPU capture: its targets in the shared sampler, read back as the difference since
//! it started.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use libbpf_rs::MapHandle;

use super::sampler::{CpuSampler, Shared, drop_unreferenced_stacks, read_counts, read_drops};
use super::{CpuDrops, CpuSample, CpuSamples};
use crate::bpf::cpu_sampler::types::cpu_sample_key;
use crate::bpf::from_bytes;
use crate::capture::target_table::{CaptureCgroups, delete_target_entries};
use crate::capture::{CaptureTarget, Result, stack_maps};
use crate::python::{PyFrame, PyStats};
use crate::unwind::WalkStats;

/// A running CPU capture; [`CpuCapture::finish`] returns its samples.
/// Dropping it without finishing releases its targets.
pub struct CpuCapture {
    pub(super) sampler: Arc<CpuSampler>,
    pub(super) targets: Vec<CaptureTarget>,
    /// The target cgroups and which target each belongs to.
    pub(super) cgroups: CaptureCgroups,
    pub(super) baseline: HashMap<Vec<u8>, u64>,
    pub(super) drops_before: CpuDrops,
    pub(super) walk_before: WalkStats,
    pub(super) py_before: PyStats,
    pub(super) started: SystemTime,
    pub(super) started_at: Instant,
    pub(super) opens_spell: bool,
}

impl std::fmt::Debug for CpuCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuCapture")
            .field("targets", &self.targets)
            .finish()
    }
}

impl Drop for CpuCapture {
    fn drop(&mut self) {
        let mut shared = self.sampler.lock();
        let Shared { maps, table, .. } = &mut *shared;
        let removed = table.release(&maps.target_maps(), self.cgroups.ids());
        delete_target_entries::<cpu_sample_key>(&maps.counts, &removed, |k| k.target);
        if !removed.is_empty() {
            let freed = drop_unreferenced_stacks(maps);
            tracing::debug!(?freed, "cpu sampler: stacks no count refers to removed");
        }
        CpuSampler::end_capture(&mut shared);
    }
}

impl CpuCapture {
    /// The sampler this capture runs on.
    pub fn sampler(&self) -> &Arc<CpuSampler> {
        &self.sampler
    }

    /// Stops the capture and reads its samples (only this capture's: counts
    /// from before it started, or of other captures' targets, are excluded).
    pub fn finish(self) -> Result<CpuSamples> {
        self.read()
    }

    /// Whether this capture found the sampler idle (no capture running on it): the
    /// first of a busy spell, as opposed to one that joined running captures, as
    /// back-to-back captures of a continuous profile do.
    pub fn opened_busy_spell(&self) -> bool {
        self.opens_spell
    }

    /// Starts the capture's window again now: only samples and losses from here on count.
    /// For a capture that runs beside another one over the same window (the wall-clock
    /// view's on-CPU half): started first, it restarts once the other has started, so
    /// that neither window includes the other's load.
    pub fn restart_window(&mut self) -> Result<()> {
        let shared = self.sampler.lock();
        let covered = self.cgroups.covered(&shared.table);
        self.baseline = read_counts(&shared.maps.counts, &covered)?;
        self.drops_before = read_drops(&shared.maps.drops);
        self.walk_before = WalkStats::read(&shared.maps.unwind_stats);
        self.py_before = PyStats::read(&shared.maps.py_stats);
        drop(shared);
        self.started = SystemTime::now();
        self.started_at = Instant::now();
        Ok(())
    }

    /// The samples so far, as [`Self::finish`] would read them now, without
    /// stopping the capture.
    pub fn peek(&self) -> Result<CpuSamples> {
        self.read()
    }

    fn read(&self) -> Result<CpuSamples> {
        let duration = self.started_at.elapsed();
        let shared = self.sampler.lock();
        // Indices nested below a target (another capture's) count for it too.
        let target_of_index = self.cgroups.owners(&shared.table);
        let own: HashSet<u32> = target_of_index.keys().copied().collect();
        let now = read_counts(&shared.maps.counts, &own)?;
        let mut drops = read_drops(&shared.maps.drops).since(self.drops_before);
        let walk = WalkStats::read(&shared.maps.unwind_stats).since(self.walk_before);
        drops.user_stack += walk.stack_lost;
        let mut kernel_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut user_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut py_cache: HashMap<(u32, u64), Vec<PyFrame>> = HashMap::new();
        let python = self.sampler.tracker.python();
        let py_stats = PyStats::read(&shared.maps.py_stats).since(self.py_before);
        let mut samples = Vec::new();
        for (raw, count) in now {
            let count = count.saturating_sub(self.baseline.get(&raw).copied().unwrap_or(0));
            let Some(key) = from_bytes::<cpu_sample_key>(&raw) else {
                continue;
            };
            if count == 0 {
                continue;
            }
            let stack = |cache: &mut HashMap<u64, Vec<u64>>, map: &MapHandle, key: u64| {
                cache
                    .entry(key)
                    .or_insert_with(|| stack_maps::read(map, key))
                    .clone()
            };
            samples.push(CpuSample {
                target: target_of_index.get(&key.target).copied().unwrap_or(0),
                tgid: key.tgid,
                pid: key.pid,
                comm: crate::capture::comm_string(&key.comm),
                user_stack: stack(&mut user_cache, &shared.maps.user_stacks, key.user_stack),
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
                count,
            });
        }
        drop(shared);
        let mut tgids: Vec<u32> = samples.iter().map(|s| s.tgid).collect();
        tgids.sort_unstable();
        tgids.dedup();
        let python_status = python.map_or_else(Vec::new, |py| {
            tgids.iter().filter_map(|&t| py.status(t)).collect()
        });
        let options = self.sampler.options;
        Ok(CpuSamples {
            targets: self.targets.clone(),
            samples,
            drops,
            walk,
            python: python_status,
            py_stats,
            unwinder: self.sampler.unwinder().map(|u| u.stats()),
            options,
            started: self.started,
            duration,
        })
    }
}
