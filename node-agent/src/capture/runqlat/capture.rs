//! One runqlat capture: its targets in the shared sampler, read back as the difference
//! since it started.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use super::sampler::{RawHist, RunqlatSampler, Shared, read_clock_stats, read_drops, read_hists};
use super::{ClockStats, Histogram, RUNQLAT_SLOTS, RunqlatDrops, RunqlatOptions, RunqlatResult};
use crate::bpf::per_cpu;
use crate::bpf::runqlat::types::{runqlat_key, runqlat_slots};
use crate::capture::target_table::{CaptureCgroups, delete_target_entries};
use crate::capture::{CaptureError, CaptureTarget, Result};

/// A running runqlat capture; [`RunqlatCapture::finish`] returns its histograms.
pub struct RunqlatCapture {
    pub(super) sampler: Arc<RunqlatSampler>,
    pub(super) targets: Vec<CaptureTarget>,
    pub(super) options: RunqlatOptions,
    /// The target cgroups and which target each belongs to.
    pub(super) cgroups: CaptureCgroups,
    pub(super) baseline: HashMap<(u32, u32), RawHist>,
    pub(super) drops_before: RunqlatDrops,
    pub(super) clock_before: Option<ClockStats>,
    pub(super) started: SystemTime,
    pub(super) started_at: Instant,
}

impl std::fmt::Debug for RunqlatCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunqlatCapture")
            .field("targets", &self.targets)
            .finish()
    }
}

impl Drop for RunqlatCapture {
    fn drop(&mut self) {
        let mut shared = self.sampler.lock();
        let Shared { maps, table } = &mut *shared;
        let removed = table.release(&maps.target_maps(), self.cgroups.ids());
        delete_target_entries::<runqlat_key>(&maps.hists, &removed, |k| k.target);
        // Per-target slots stay: indices are never reused by this sampler.
    }
}

impl RunqlatCapture {
    /// The sampler this capture runs on.
    pub fn sampler(&self) -> &Arc<RunqlatSampler> {
        &self.sampler
    }

    /// The waits counted since the capture started, summed over its targets (and the
    /// cgroups nested in them), bucket by bucket in its unit, without ending it: one
    /// per-CPU map lookup per target index (per-process histograms are not read).
    pub fn totals(&self) -> Result<Vec<u64>> {
        let shared = self.sampler.lock();
        let indices: Vec<u32> = self.cgroups.owners(&shared.table).into_keys().collect();
        let mut slots = vec![0u64; RUNQLAT_SLOTS];
        for index in indices {
            let cpus = per_cpu::<runqlat_slots>(&shared.maps.target_hists, index)
                .map_err(|e| CaptureError::bpf("reading runqlat histograms", e))?;
            let base = self.baseline.get(&(index, 0));
            for h in cpus {
                for (a, b) in slots.iter_mut().zip(h.slots) {
                    *a += b;
                }
            }
            if let Some(base) = base {
                for (a, b) in slots.iter_mut().zip(&base.slots) {
                    *a = a.saturating_sub(*b);
                }
            }
        }
        Ok(slots)
    }

    /// Stops the capture and returns its histograms (the difference since it
    /// started, folded per target unless per-process was asked for).
    pub fn finish(self) -> Result<RunqlatResult> {
        let duration = self.started_at.elapsed();
        let shared = self.sampler.lock();
        // Indices nested below a target (another capture's) count for it too.
        let target_of_index = self.cgroups.owners(&shared.table);
        let own: HashSet<u32> = target_of_index.keys().copied().collect();
        let now = read_hists(&shared.maps, &own)?;
        let drops = read_drops(&shared.maps.drops);
        let clock = read_clock_stats(&shared.maps)
            .zip(self.clock_before)
            .map(|(now, before)| now.since(before));
        drop(shared);
        let mut merged: HashMap<(usize, u32), Histogram> = HashMap::new();
        for ((index, tgid), h) in now {
            let base = self.baseline.get(&(index, tgid));
            let target = target_of_index.get(&index).copied().unwrap_or(0);
            let tgid = if self.options.per_process { tgid } else { 0 };
            let entry = merged.entry((target, tgid)).or_insert_with(|| Histogram {
                target,
                tgid: (tgid != 0).then_some(tgid),
                comm: String::new(),
                slots: vec![0; h.slots.len()],
            });
            for (i, &n) in h.slots.iter().enumerate() {
                entry.slots[i] += n.saturating_sub(base.map_or(0, |b| b.slots[i]));
            }
            if self.options.per_process && entry.comm.is_empty() {
                entry.comm = crate::capture::comm_string(&h.comm);
            }
        }
        let mut histograms: Vec<Histogram> =
            merged.into_values().filter(|h| h.count() > 0).collect();
        histograms.sort_by_key(|h| (h.target, h.tgid));
        Ok(RunqlatResult {
            targets: self.targets.clone(),
            histograms,
            unit: self.options.unit,
            drops: RunqlatDrops {
                hists_full: drops
                    .hists_full
                    .saturating_sub(self.drops_before.hists_full),
                start_full: drops
                    .start_full
                    .saturating_sub(self.drops_before.start_full),
            },
            storage: self.sampler.storage,
            clock,
            started: self.started,
            duration,
        })
    }
}
