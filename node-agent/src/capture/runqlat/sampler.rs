//! The node's runqlat sampler: raw tracepoints on the scheduler, loaded once and shared by
//! every runqlat capture.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime};

use libbpf_rs::skel::{OpenSkel as _, Skel as _, SkelBuilder as _};
use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::{
    ClockStats, FLAG_PER_PROCESS, FLAG_UNIT_MS, LatencyUnit, RUNQLAT_SLOTS, RunqlatCapture,
    RunqlatDrops, RunqlatMapFill, RunqlatOptions, StartStorage,
};
use crate::bpf::runqlat::types::{
    ff_target, runqlat_cpu, runqlat_drops, runqlat_hist, runqlat_key, runqlat_slots,
};
use crate::bpf::runqlat::{RunqlatSkel, RunqlatSkelBuilder};
use crate::bpf::{from_bytes, per_cpu};
use crate::capture::sampler_thread::{self, OwnerThread, Woken};
use crate::capture::target_table::{CaptureCgroups, TargetMaps, TargetTable};
use crate::capture::{CaptureError, CaptureTarget, Result, RunqlatClock, SamplerConfig};

pub(super) struct Maps {
    pub(super) targets: MapHandle,
    pub(super) generation: MapHandle,
    /// Per-CPU histogram per target index.
    pub(super) target_hists: MapHandle,
    /// Per-process histograms.
    pub(super) hists: MapHandle,
    pub(super) drops: MapHandle,
    /// The start map of the hash-map fallback (`None` with task storage).
    pub(super) start_hash: Option<MapHandle>,
    /// The hybrid variant's per-CPU state (`None` for the others).
    pub(super) rq_cpu: Option<MapHandle>,
}

impl Maps {
    pub(super) fn target_maps(&self) -> TargetMaps<'_> {
        TargetMaps {
            targets: &self.targets,
            generation: &self.generation,
        }
    }
}

pub(super) struct Shared {
    pub(super) maps: Maps,
    pub(super) table: TargetTable,
}

/// The node's runqlat sampler, shared by every runqlat capture.
pub struct RunqlatSampler {
    pub(super) shared: Mutex<Shared>,
    pub(super) storage: StartStorage,
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
        crate::capture::check_btf()?;
        // Our own clock keeps its start stamps in task storage (Linux 5.11+) or else in a
        // hash map; the scheduler-clock variant keeps its baselines in task storage. The
        // hybrid variant needs neither (its baselines are an array), so it is the default on
        // every kernel with BTF tracepoints.
        let task_storage = task_storage_supported();
        let own = if config.force_start_hash || !task_storage {
            StartStorage::HashMap
        } else {
            StartStorage::TaskStorage
        };
        let preferred = if config.force_start_hash {
            StartStorage::HashMap
        } else {
            match config.runqlat_clock {
                RunqlatClock::Hybrid | RunqlatClock::HybridNoPsi => StartStorage::Hybrid,
                RunqlatClock::Scheduler if task_storage => StartStorage::SchedInfo,
                RunqlatClock::Scheduler | RunqlatClock::Own => own,
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
                    load(&mut fallback_object, &config, own).map(|(skel, maps)| (skel, maps, own))
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

    /// The hybrid variant's counters now, node-wide (`None` for the other variants): a
    /// window's are the difference of two readings ([`ClockStats::since`]).
    pub fn clock_stats(&self) -> Option<ClockStats> {
        read_clock_stats(&self.lock().maps)
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
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
        let (own_cgroups, cgroups) = CaptureCgroups::of(targets);
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
        let own = own_cgroups.covered(table);
        let baseline = read_hists(maps, &own)?;
        let drops_before = read_drops(&maps.drops);
        let clock_before = read_clock_stats(maps);
        drop(shared);
        Ok(RunqlatCapture {
            sampler: self.clone(),
            targets: targets.to_vec(),
            options: *options,
            cgroups: own_cgroups,
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
    let cache = crate::capture::target_cache_enabled(config);
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
    let mut skel = CaptureError::load("loading the runqlat BPF programs", || open.load())?;
    skel.attach()
        .map_err(|e| CaptureError::bpf("attaching runqlat to the sched tracepoints", e))?;
    let handle = CaptureError::map_handle;
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

/// A histogram as read from the kernel (summed over CPUs).
#[derive(Debug, Clone)]
pub(super) struct RawHist {
    pub(super) slots: Vec<u64>,
    pub(super) comm: [i8; 16],
}

/// The histograms of the given target indices, keyed by (index, tgid):
/// tgid 0 for the per-CPU per-target histograms, the process for
/// per-process ones.
pub(super) fn read_hists(maps: &Maps, own: &HashSet<u32>) -> Result<HashMap<(u32, u32), RawHist>> {
    let mut out = HashMap::new();
    for &index in own {
        let cpus = per_cpu::<runqlat_slots>(&maps.target_hists, index)
            .map_err(|e| CaptureError::bpf("reading runqlat histograms", e))?;
        let mut slots = vec![0u64; RUNQLAT_SLOTS];
        for h in cpus {
            for (a, b) in slots.iter_mut().zip(h.slots) {
                *a += b;
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
pub(super) fn read_clock_stats(maps: &Maps) -> Option<ClockStats> {
    let cpus = per_cpu::<runqlat_cpu>(maps.rq_cpu.as_ref()?, 0).unwrap_or_default();
    let mut sum = ClockStats::default();
    for c in cpus {
        sum.waits += c.waits;
        sum.after_idle += c.after_idle;
        sum.clock_reads += c.clock_reads;
        sum.uncalibrated += c.uncalibrated;
        sum.split += c.split;
        sum.psi_stamps += c.psi_stamps;
        sum.psi_checks += c.psi_checks;
        sum.psi_rejects += c.psi_rejects;
    }
    Some(sum)
}

pub(super) fn read_drops(drops: &MapHandle) -> RunqlatDrops {
    let mut sum = RunqlatDrops::default();
    for d in per_cpu::<runqlat_drops>(drops, 0).unwrap_or_default() {
        sum.hists_full += d.hists_full;
        sum.start_full += d.start_full;
    }
    sum
}
