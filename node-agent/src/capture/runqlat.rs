//! Run-queue latency: the shared runqlat sampler (raw tracepoints
//! `sched_wakeup`, `sched_wakeup_new`, `sched_switch`), captures on top of it,
//! and their outputs (pprof, the classic text histogram, percentiles).
//!
//! A wait is attributed to the cgroup of the task that waits (libbpf-tools'
//! `runqlat -c` tests the cgroup of the waker instead).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use libbpf_rs::skel::{OpenSkel as _, Skel as _, SkelBuilder as _};
use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use flamefleet_proto::pprof::Profile;

use super::sampler_thread::{self, OwnerThread, Woken};
use super::target_table::{TargetMaps, TargetTable, delete_target_entries};
use super::{CaptureError, CaptureTarget, Result, RunqlatClock, SamplerConfig};
use crate::bpf::from_bytes;
use crate::bpf::runqlat::types::{
    ff_target, runqlat_cpu, runqlat_drops, runqlat_hist, runqlat_key, runqlat_slots,
};
use crate::bpf::runqlat::{RunqlatSkel, RunqlatSkelBuilder};
use crate::pprof::{Frame, FrameLine, Label, ProfileBuilder};

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
    fn since(self, before: Self) -> Self {
        Self {
            waits: self.waits.saturating_sub(before.waits),
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

struct Maps {
    targets: MapHandle,
    generation: MapHandle,
    /// Per-CPU histogram per target index.
    target_hists: MapHandle,
    /// Per-process histograms.
    hists: MapHandle,
    drops: MapHandle,
    /// The start map of the hash-map fallback (`None` with task storage).
    start_hash: Option<MapHandle>,
    /// The hybrid variant's per-CPU state (`None` for the others).
    rq_cpu: Option<MapHandle>,
}

impl Maps {
    fn target_maps(&self) -> TargetMaps<'_> {
        TargetMaps {
            targets: &self.targets,
            generation: &self.generation,
        }
    }
}

struct Shared {
    maps: Maps,
    table: TargetTable,
}

/// The node's runqlat sampler, shared by every runqlat capture.
pub struct RunqlatSampler {
    shared: Mutex<Shared>,
    storage: StartStorage,
    owner: OwnerThread,
}

impl std::fmt::Debug for RunqlatSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunqlatSampler")
            .field("storage", &self.storage)
            .finish()
    }
}

fn task_storage_supported() -> bool {
    use libbpf_rs::libbpf_sys as sys;
    // SAFETY: probing takes no pointers besides the (null) options.
    unsafe { sys::libbpf_probe_bpf_map_type(sys::BPF_MAP_TYPE_TASK_STORAGE, std::ptr::null()) == 1 }
}

impl RunqlatSampler {
    /// Whether the thread that owns the loaded programs still runs.
    pub fn is_alive(&self) -> bool {
        self.owner.is_alive()
    }

    /// Loads and attaches the programs, choosing task storage when the kernel
    /// has it (and the config does not force the hash-map fallback).
    pub fn start(config: &SamplerConfig) -> Result<Self> {
        super::check_btf()?;
        let preferred = if config.force_start_hash || !task_storage_supported() {
            StartStorage::HashMap
        } else {
            match config.runqlat_clock {
                RunqlatClock::Hybrid | RunqlatClock::HybridNoPsi => StartStorage::Hybrid,
                RunqlatClock::Scheduler => StartStorage::SchedInfo,
                RunqlatClock::Own => StartStorage::TaskStorage,
            }
        };
        let (max_targets, max_indices) = (config.max_targets, config.max_target_indices);
        let config = config.clone();
        let ((maps, storage), owner) = sampler_thread::spawn("runqlat", move |ready, stop| {
            let mut object = MaybeUninit::uninit();
            let mut fallback_object = MaybeUninit::uninit();
            let loaded = match load(&mut object, &config, preferred) {
                Err(e) if matches!(preferred, StartStorage::SchedInfo | StartStorage::Hybrid) => {
                    // A kernel without CONFIG_SCHED_INFO or CONFIG_FAIR_GROUP_SCHED (the
                    // run queue is reached through the task's cfs_rq): our own
                    // timestamps work there.
                    tracing::warn!(
                        error = %e,
                        clock = ?preferred,
                        "runqlat: the scheduler's sched_info timestamps are not usable on this kernel; reading the clock at wakeup instead (--runqlat-clock own)"
                    );
                    load(&mut fallback_object, &config, StartStorage::TaskStorage)
                        .map(|(skel, maps)| (skel, maps, StartStorage::TaskStorage))
                }
                r => r.map(|(skel, maps)| (skel, maps, preferred)),
            };
            match loaded {
                Ok((skel, maps, storage)) => {
                    if ready.send(Ok((maps, storage))).is_err() {
                        return;
                    }
                    while stop.wait(None, None) == Woken::Look {}
                    drop(skel);
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                }
            }
        })?;
        Ok(Self {
            shared: Mutex::new(Shared {
                maps,
                table: TargetTable::new(max_targets, max_indices),
            }),
            storage,
            owner,
        })
    }

    /// Where start timestamps are kept.
    pub fn storage(&self) -> StartStorage {
        self.storage
    }

    /// Counts the entries of the sampler's maps (walks their keys: O(entries)).
    pub fn map_fill(&self) -> RunqlatMapFill {
        let shared = self.lock();
        let maps = &shared.maps;
        RunqlatMapFill {
            targets: maps.targets.keys().count(),
            histograms: maps.hists.keys().count(),
            starts: maps.start_hash.as_ref().map(|m| m.keys().count()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a capture of `targets`. Fails when a target is being captured
    /// concurrently in the other unit (the kernel keeps one unit per cgroup).
    pub fn capture(
        self: &Arc<Self>,
        targets: &[CaptureTarget],
        options: &RunqlatOptions,
    ) -> Result<RunqlatCapture> {
        if targets.is_empty() {
            return Err(CaptureError::InvalidOptions(
                "no target cgroup given".into(),
            ));
        }
        let mut flags = 0;
        if options.per_process {
            flags |= FLAG_PER_PROCESS;
        }
        if options.unit == LatencyUnit::Millis {
            flags |= FLAG_UNIT_MS;
        }
        let (cgroups, owner_of) = super::expand_targets(targets);
        let mut shared = self.lock();
        let Shared { maps, table } = &mut *shared;
        table.acquire::<ff_target>(&maps.target_maps(), &cgroups, flags, |old, new| {
            if (old ^ new) & FLAG_UNIT_MS != 0 {
                return Err(CaptureError::InvalidOptions(
                    "a runqlat capture in the other unit (us/ms) is running on the same cgroup; use the same unit or wait for it to finish".into(),
                ));
            }
            Ok(old | new)
        })?;
        let cgroup_ids: Vec<u64> = cgroups.iter().map(|c| c.id).collect();
        let own: HashSet<u32> = table.covered(&cgroup_ids).into_keys().collect();
        let baseline = read_hists(maps, &own)?;
        let drops_before = read_drops(&maps.drops);
        let clock_before = read_clock_stats(maps);
        drop(shared);
        Ok(RunqlatCapture {
            sampler: self.clone(),
            targets: targets.to_vec(),
            options: *options,
            cgroup_ids,
            owner_of,
            baseline,
            drops_before,
            clock_before,
            started: SystemTime::now(),
            started_at: Instant::now(),
        })
    }
}

fn load<'obj>(
    object: &'obj mut MaybeUninit<libbpf_rs::OpenObject>,
    config: &SamplerConfig,
    storage: StartStorage,
) -> Result<(RunqlatSkel<'obj>, Maps)> {
    let mut open = RunqlatSkelBuilder::default()
        .open(object)
        .map_err(|e| CaptureError::bpf("opening the runqlat BPF object", e))?;
    let hybrid = storage == StartStorage::Hybrid;
    let sched_info = storage == StartStorage::SchedInfo;
    let task = storage == StartStorage::TaskStorage;
    let hash = storage == StartStorage::HashMap;
    let p = &mut open.progs;
    p.switch_hybrid.set_autoload(hybrid);
    p.switch_queued.set_autoload(sched_info);
    p.wakeup_task.set_autoload(task);
    p.wakeup_new_task.set_autoload(task);
    p.switch_task.set_autoload(task);
    p.wakeup_hash.set_autoload(hash);
    p.wakeup_new_hash.set_autoload(hash);
    p.switch_hash.set_autoload(hash);
    p.exit_hash.set_autoload(hash);
    let cache = super::target_cache_enabled(config);
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.ff_cgrp_cache = cache;
        ro.ff_runqlat_psi = config.runqlat_clock != RunqlatClock::HybridNoPsi;
    }
    let m = &mut open.maps;
    let sizing = (|| {
        m.target_cache.set_autocreate(cache)?;
        m.seen_task.set_autocreate(sched_info)?;
        m.rq_cpu.set_autocreate(hybrid)?;
        m.seen_slots.set_autocreate(hybrid)?;
        m.start_task.set_autocreate(task)?;
        m.start_hash
            .set_max_entries(config.max_start_entries.max(1))?;
        m.start_hash.set_autocreate(hash)?;
        m.targets.set_max_entries(config.max_targets.max(1))?;
        // Element i is target index i; index 0 is never handed out.
        m.target_hists
            .set_max_entries(config.max_target_indices.saturating_add(1))?;
        m.hists.set_max_entries(config.max_histograms.max(1))
    })();
    sizing.map_err(|e| CaptureError::bpf("sizing runqlat maps", e))?;
    let mut skel = open
        .load()
        .map_err(|e| CaptureError::bpf("loading the runqlat BPF programs", e))?;
    skel.attach()
        .map_err(|e| CaptureError::bpf("attaching runqlat to the sched tracepoints", e))?;
    let handle = |m: &libbpf_rs::MapMut<'_>, what: &str| {
        MapHandle::try_from(m).map_err(|e| CaptureError::bpf(format!("duplicating map {what}"), e))
    };
    let maps = Maps {
        targets: handle(&skel.maps.targets, "targets")?,
        generation: handle(&skel.maps.target_generation, "target_generation")?,
        target_hists: handle(&skel.maps.target_hists, "target_hists")?,
        hists: handle(&skel.maps.hists, "hists")?,
        drops: handle(&skel.maps.drops, "drops")?,
        start_hash: if hash {
            Some(handle(&skel.maps.start_hash, "start_hash")?)
        } else {
            None
        },
        rq_cpu: if hybrid {
            Some(handle(&skel.maps.rq_cpu, "rq_cpu")?)
        } else {
            None
        },
    };
    Ok((skel, maps))
}

/// A running runqlat capture; [`RunqlatCapture::finish`] returns its histograms.
pub struct RunqlatCapture {
    sampler: Arc<RunqlatSampler>,
    targets: Vec<CaptureTarget>,
    options: RunqlatOptions,
    /// The target cgroups, deduplicated; `owner_of[i]` is the position in
    /// `targets` of `cgroup_ids[i]`.
    cgroup_ids: Vec<u64>,
    owner_of: Vec<usize>,
    baseline: HashMap<(u32, u32), RawHist>,
    drops_before: RunqlatDrops,
    clock_before: Option<ClockStats>,
    started: SystemTime,
    started_at: Instant,
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
        let removed = table.release(&maps.target_maps(), &self.cgroup_ids);
        delete_target_entries::<runqlat_key>(&maps.hists, &removed, |k| k.target);
        // Per-target slots stay: indices are never reused by this sampler.
    }
}

impl RunqlatCapture {
    /// The sampler this capture runs on.
    pub fn sampler(&self) -> &Arc<RunqlatSampler> {
        &self.sampler
    }

    /// Stops the capture and returns its histograms (the difference since it
    /// started, folded per target unless per-process was asked for).
    pub fn finish(self) -> Result<RunqlatResult> {
        let duration = self.started_at.elapsed();
        let shared = self.sampler.lock();
        // Indices nested below a target (another capture's) count for it too.
        let target_of_index: HashMap<u32, usize> = shared
            .table
            .covered(&self.cgroup_ids)
            .into_iter()
            .map(|(index, pos)| (index, self.owner_of[pos]))
            .collect();
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
                entry.comm = super::comm_string(&h.comm);
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
        let start = self
            .started
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        b.time(start, self.duration.as_nanos() as i64);
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
                "hybrid clock (node-wide): {} waits, {} ended on a stale run-queue clock and were read from the clock ({} before calibration), {} ended after idle at PSI's switch stamp ({} checked against the clock, {} rejected), {} counted whole across a migration",
                c.waits, c.clock_reads, c.uncalibrated, c.psi_stamps, c.psi_checks, c.psi_rejects, c.split
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
            let mut labels = super::target_labels(target, node);
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

/// A histogram as read from the kernel (summed over CPUs).
#[derive(Debug, Clone)]
struct RawHist {
    slots: Vec<u64>,
    comm: [i8; 16],
}

/// The histograms of the given target indices, keyed by (index, tgid):
/// tgid 0 for the per-CPU per-target histograms, the process for
/// per-process ones.
fn read_hists(maps: &Maps, own: &HashSet<u32>) -> Result<HashMap<(u32, u32), RawHist>> {
    let mut out = HashMap::new();
    for &index in own {
        let per_cpu = maps
            .target_hists
            .lookup_percpu(&index.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading runqlat histograms", e))?
            .unwrap_or_default();
        let mut slots = vec![0u64; RUNQLAT_SLOTS];
        for cpu in &per_cpu {
            if let Some(h) = from_bytes::<runqlat_slots>(cpu) {
                for (a, b) in slots.iter_mut().zip(h.slots) {
                    *a += b;
                }
            }
        }
        out.insert(
            (index, 0),
            RawHist {
                slots,
                comm: [0; 16],
            },
        );
    }
    for key in maps.hists.keys() {
        let Some(k) = from_bytes::<runqlat_key>(&key) else {
            continue;
        };
        if !own.contains(&k.target) {
            continue;
        }
        let value = maps
            .hists
            .lookup(&key, MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading runqlat histograms", e))?;
        if let Some(h) = value.as_deref().and_then(from_bytes::<runqlat_hist>) {
            // A process's tgid is never 0, so this never collides with the
            // per-target histogram above.
            out.insert(
                (k.target, k.tgid),
                RawHist {
                    slots: h.slots.to_vec(),
                    comm: h.comm,
                },
            );
        }
    }
    Ok(out)
}

/// The hybrid variant's counters, summed over CPUs (`None` for the other variants).
fn read_clock_stats(maps: &Maps) -> Option<ClockStats> {
    let per_cpu = maps
        .rq_cpu
        .as_ref()?
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .ok()
        .flatten();
    let mut sum = ClockStats::default();
    for v in per_cpu.unwrap_or_default() {
        if let Some(c) = from_bytes::<runqlat_cpu>(&v) {
            sum.waits += c.waits;
            sum.clock_reads += c.clock_reads;
            sum.uncalibrated += c.uncalibrated;
            sum.split += c.split;
            sum.psi_stamps += c.psi_stamps;
            sum.psi_checks += c.psi_checks;
            sum.psi_rejects += c.psi_rejects;
        }
    }
    Some(sum)
}

fn read_drops(drops: &MapHandle) -> RunqlatDrops {
    let per_cpu = drops
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .ok()
        .flatten();
    let mut sum = RunqlatDrops::default();
    for v in per_cpu.unwrap_or_default() {
        if let Some(d) = from_bytes::<runqlat_drops>(&v) {
            sum.hists_full += d.hists_full;
            sum.start_full += d.start_full;
        }
    }
    sum
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
