//! One CPU capture: its targets in the shared sampler, read back as the difference since
//! it started.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::sampler::{CpuSampler, Shared, drop_unreferenced_stacks, read_counts, read_drops};
use super::{CpuDrops, CpuSample, CpuSamples};
use crate::bpf::cpu_sampler::types::cpu_sample_key;
use crate::bpf::from_bytes;
use crate::capture::process_tracker::ProcessTracker;
use crate::capture::target_table::{CaptureCgroups, delete_target_entries};
use crate::capture::{CaptureError, CaptureTarget, Result, stack_maps};
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

/// The maps as one read found them: the end of a window, the next one's baseline.
struct Snapshot {
    counts: HashMap<Vec<u8>, u64>,
    drops: CpuDrops,
    walk: WalkStats,
    py: PyStats,
    /// Where the window's span ended.
    ended_at: Instant,
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

    /// Ends the capture's window now and starts the next one at the same instant, without
    /// stopping the capture: the sampler stays attached, so the next window costs nothing
    /// to start. The counts are read once: what they hold is this window's, and the next
    /// window counts from that same read, so no sample is in both windows or in neither,
    /// and the windows' spans (each from its start to the read that ends it, or to where
    /// the sampler was paused) follow each other with no gap.
    ///
    /// The sole capture of its sampler also removes the counts that did not move over the
    /// window (a stack no longer sampled, a process gone) and the stacks only they referred
    /// to, so that a capture held for days keeps its maps to what it samples now. A count
    /// is removed only if it still holds the value read; a sample counted in the instant
    /// between that check and the removal is lost (the next sample of that stack starts it
    /// again at one).
    ///
    /// # Errors
    /// Reading the sampler's maps.
    pub fn cut(&mut self) -> Result<CpuSamples> {
        let (samples, snapshot) = self.read_with_snapshot()?;
        let Snapshot {
            mut counts,
            drops,
            walk,
            py,
            ended_at,
        } = snapshot;
        let shared = self.sampler.lock();
        if shared.active == 1 {
            let stale: Vec<Vec<u8>> = counts
                .iter()
                .filter(|(raw, count)| self.baseline.get(*raw) == Some(*count))
                .map(|(raw, _)| raw.clone())
                .collect();
            let mut removed = 0usize;
            for raw in stale {
                let still = shared
                    .maps
                    .counts
                    .lookup(&raw, MapFlags::ANY)
                    .ok()
                    .flatten()
                    .and_then(|v| v.get(..8).and_then(|b| b.try_into().ok()))
                    .map(u64::from_ne_bytes);
                if still == counts.get(&raw).copied() && shared.maps.counts.delete(&raw).is_ok() {
                    counts.remove(&raw);
                    removed += 1;
                }
            }
            if removed > 0 {
                let freed = drop_unreferenced_stacks(&shared.maps);
                tracing::debug!(
                    removed,
                    ?freed,
                    "cpu capture: counts idle over a window removed"
                );
            }
        }
        drop(shared);
        self.baseline = counts;
        self.drops_before = drops;
        self.walk_before = walk;
        self.py_before = py;
        self.started = samples.started + samples.duration;
        self.started_at = ended_at;
        Ok(samples)
    }

    /// The tracker that feeds the catalog and the unwinder with the targets' processes.
    pub(crate) fn tracker(&self) -> &ProcessTracker {
        &self.sampler.tracker
    }

    /// Stops sampling (the sampler's perf events are disabled, not closed) until
    /// [`Self::resume`]; the window's span ends here. For the sole capture of its sampler
    /// (the always-on windows' gaps): pausing would stop other captures' sampling too.
    ///
    /// # Errors
    /// Another capture runs on the sampler; the kernel refused to disable an event.
    pub fn pause(&mut self) -> Result<()> {
        let mut shared = self.sampler.lock();
        if shared.active != 1 {
            return Err(CaptureError::InvalidOptions(format!(
                "only the sole capture of a sampler may pause it; {} captures run on it",
                shared.active
            )));
        }
        if shared.paused_at.is_none() {
            CpuSampler::set_enabled(&shared, false)?;
            shared.paused_at = Some(Instant::now());
        }
        Ok(())
    }

    /// Starts sampling again after [`Self::pause`]; the next window's span starts here.
    ///
    /// # Errors
    /// The kernel refused to enable an event.
    pub fn resume(&mut self) -> Result<()> {
        let mut shared = self.sampler.lock();
        if shared.paused_at.is_some() {
            CpuSampler::set_enabled(&shared, true)?;
            shared.paused_at = None;
            self.started = SystemTime::now();
            self.started_at = Instant::now();
        }
        Ok(())
    }

    /// The samples so far, as [`Self::finish`] would read them now, without
    /// stopping the capture.
    pub fn peek(&self) -> Result<CpuSamples> {
        self.read()
    }

    fn read(&self) -> Result<CpuSamples> {
        Ok(self.read_with_snapshot()?.0)
    }

    /// The samples since the window started, and the maps as read for them (the next
    /// window's baseline, [`Self::cut`]).
    fn read_with_snapshot(&self) -> Result<(CpuSamples, Snapshot)> {
        let shared = self.sampler.lock();
        // The window ends at this read (or where its sampler was paused: nothing was
        // sampled after that).
        let read_at = Instant::now();
        let ended_at = shared.paused_at.unwrap_or(read_at);
        let duration = ended_at.saturating_duration_since(self.started_at);
        // Indices nested below a target (another capture's) count for it too.
        let target_of_index = self.cgroups.owners(&shared.table);
        let own: HashSet<u32> = target_of_index.keys().copied().collect();
        let now = read_counts(&shared.maps.counts, &own)?;
        let drops_now = read_drops(&shared.maps.drops);
        let walk_now = WalkStats::read(&shared.maps.unwind_stats);
        let py_now = PyStats::read(&shared.maps.py_stats);
        let mut drops = drops_now.since(self.drops_before);
        let walk = walk_now.since(self.walk_before);
        drops.user_stack += walk.stack_lost;
        let mut kernel_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut user_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut py_cache: HashMap<(u32, u64), Vec<PyFrame>> = HashMap::new();
        let python = self.sampler.tracker.python();
        let py_stats = py_now.since(self.py_before);
        let mut samples = Vec::new();
        for (raw, &count) in &now {
            let count = count.saturating_sub(self.baseline.get(raw).copied().unwrap_or(0));
            let Some(key) = from_bytes::<cpu_sample_key>(raw) else {
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
        let samples = CpuSamples {
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
        };
        let snapshot = Snapshot {
            counts: now,
            drops: drops_now,
            walk: walk_now,
            py: py_now,
            ended_at,
        };
        Ok((samples, snapshot))
    }
}
