//! The node's off-CPU sampler: one program on `sched_switch`, loaded once and shared by
//! every off-CPU capture; it stops with the last capture.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime};

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::{MapCore as _, MapHandle};

use super::{OffcpuCapture, OffcpuMapFill, OffcpuOptions, OffcpuStats};
use crate::bpf::offcpu::types::{ff_target, offcpu_cpu, offcpu_key, offcpu_short, offcpu_val};
use crate::bpf::offcpu::{OffcpuSkel, OffcpuSkelBuilder};
use crate::bpf::{from_bytes, per_cpu};
use crate::capture::kernel::KernelFeatures;
use crate::capture::process_tracker::ProcessTracker;
use crate::capture::sampler_thread::{self, OwnerThread};
use crate::capture::target_table::{CaptureCgroups, TargetMaps, TargetTable, read_target_entries};
use crate::capture::{CaptureError, CaptureTarget, Result, SamplerConfig, stack_maps};
use crate::process::ProcessCatalog;
use crate::python::{PyStats, PythonRegistry};
use crate::unwind::{Unwinder, WalkStats};

pub(super) struct Maps {
    pub(super) targets: MapHandle,
    pub(super) generation: MapHandle,
    pub(super) counts: MapHandle,
    pub(super) short_blocks: MapHandle,
    pub(super) cpus: MapHandle,
    pub(super) kernel_stacks: MapHandle,
    pub(super) user_stacks: MapHandle,
    pub(super) unwind_stats: MapHandle,
    pub(super) py_stacks: MapHandle,
    pub(super) py_stats: MapHandle,
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
    /// Stacks no total referred to at the last cleanup (see [`drop_unreferenced_stacks`]).
    pub(super) unreferenced: Unreferenced,
}

/// The node's off-CPU sampler, shared by every off-CPU capture. It runs with the options
/// of the capture that loaded it.
pub struct OffcpuSampler {
    shared: Mutex<Shared>,
    pub(super) options: OffcpuOptions,
    /// Feeds the node's catalog and the unwinder with the targets' processes.
    pub(super) tracker: ProcessTracker,
    owner: OwnerThread,
}

impl std::fmt::Debug for OffcpuSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffcpuSampler")
            .field("options", &self.options)
            .finish()
    }
}

impl OffcpuSampler {
    /// Whether the thread that owns the loaded program still runs.
    pub fn is_alive(&self) -> bool {
        self.owner.is_alive()
    }

    /// Loads and attaches the sampler. Fails with [`CaptureError::Privilege`] without
    /// CAP_BPF/CAP_PERFMON, [`CaptureError::KernelFeature`] without BTF or on a kernel
    /// whose stack walk or task storage the program cannot have
    /// ([`KernelFeatures::offcpu_refusal`]).
    pub fn start(
        config: &SamplerConfig,
        options: OffcpuOptions,
        catalog: ProcessCatalog,
    ) -> Result<Self> {
        options.validate()?;
        crate::capture::check_btf()?;
        if let Some(detail) = KernelFeatures::get().offcpu_refusal() {
            return Err(CaptureError::KernelFeature {
                feature: "off-CPU profiles".into(),
                detail,
            });
        }
        let began = Instant::now();
        let (max_targets, max_indices) = (config.max_targets, config.max_target_indices);
        let config = config.clone();
        let unwinder = if options.cfi_unwind {
            Some(Unwinder::shared(&config.unwind)?)
        } else {
            None
        };
        // Python frames are read with the CFI walk, as the CPU sampler reads them.
        let mut tracker = ProcessTracker::new(catalog, unwinder);
        if options.cfi_unwind && config.python_frames && !config.force_bounded_walk {
            let python =
                PythonRegistry::shared().map_err(|e| CaptureError::bpf(e.what, e.source))?;
            tracker = tracker.with_python(python);
        }
        let thread_tracker = tracker.clone();
        let (maps, owner) = sampler_thread::spawn("offcpu", move |ready, stop| {
            let mut object = MaybeUninit::uninit();
            let loaded = load(&mut object, &config, options, &thread_tracker)
                .map(|l| (l.maps, l.ring, (l.links, l.skel)));
            sampler_thread::serve_ring(ready, &stop, loaded);
        })?;
        tracing::info!(
            ms = began.elapsed().as_millis() as u64,
            "off-CPU sampler loaded"
        );
        Ok(Self {
            shared: Mutex::new(Shared {
                maps,
                table: TargetTable::new(max_targets, max_indices),
                unreferenced: Default::default(),
            }),
            options,
            tracker,
            owner,
        })
    }

    /// The options the sampler runs with (the first capture's).
    pub fn options(&self) -> OffcpuOptions {
        self.options
    }

    /// The unwind tables the sampler walks user stacks with (`None` with
    /// `cfi_unwind: false`).
    pub fn unwinder(&self) -> Option<&Arc<Unwinder>> {
        self.tracker.unwinder()
    }

    /// Counts the entries of the sampler's maps (walks their keys: O(entries)).
    pub fn map_fill(&self) -> OffcpuMapFill {
        let shared = self.lock();
        let maps = &shared.maps;
        OffcpuMapFill {
            targets: maps.targets.keys().count(),
            counts: maps.counts.keys().count(),
            kernel_stacks: maps.kernel_stacks.keys().count(),
            user_stacks: maps.user_stacks.keys().count(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a capture of `targets` on this sampler; it gets the sampler's options
    /// whatever it asked for (its result reports them).
    pub fn capture(self: &Arc<Self>, targets: &[CaptureTarget]) -> Result<OffcpuCapture> {
        if targets.is_empty() {
            return Err(CaptureError::InvalidOptions(
                "no target cgroup given".into(),
            ));
        }
        let (own_cgroups, cgroups) = CaptureCgroups::of(targets);
        // Processes running already will not announce themselves by exec. Their tables
        // are loaded before their cgroups become targets, so that even their first
        // blocks unwind fully.
        self.tracker
            .track_running(targets, &mut HashSet::new(), true);
        let mut shared = self.lock();
        let Shared { maps, table, .. } = &mut *shared;
        table.acquire::<ff_target>(&maps.target_maps(), &cgroups, 0, |a, _| Ok(a))?;
        let own = own_cgroups.covered(table);
        let baseline = read_counts(&maps.counts, &own)?;
        let short_before = read_short(&maps.short_blocks, &own)?;
        let stats_before = read_stats(&maps.cpus);
        let walk_before = WalkStats::read(&maps.unwind_stats);
        let py_before = PyStats::read(&maps.py_stats);
        drop(shared);
        Ok(OffcpuCapture {
            sampler: self.clone(),
            targets: targets.to_vec(),
            cgroups: own_cgroups,
            baseline,
            short_before,
            stats_before,
            walk_before,
            py_before,
            started: SystemTime::now(),
            started_at: Instant::now(),
        })
    }
}

/// What the owner thread keeps alive while the sampler runs.
struct Loaded<'obj> {
    skel: OffcpuSkel<'obj>,
    links: Vec<libbpf_rs::Link>,
    maps: Maps,
    ring: libbpf_rs::RingBuffer<'static>,
}

fn load<'obj>(
    object: &'obj mut MaybeUninit<libbpf_rs::OpenObject>,
    config: &SamplerConfig,
    options: OffcpuOptions,
    tracker: &ProcessTracker,
) -> Result<Loaded<'obj>> {
    let unwinder = tracker.unwinder();
    let mut open = OffcpuSkelBuilder::default()
        .open(object)
        .map_err(|e| CaptureError::bpf("opening the off-CPU BPF object", e))?;
    let cache = crate::capture::target_cache_enabled(config);
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.min_block_ns = u64::try_from(options.min_block.as_nanos()).unwrap_or(u64::MAX);
        ro.capture_kernel_stacks = options.kernel_stacks;
        ro.ff_cgrp_cache = cache;
        ro.ff_stack_seed = stack_maps::seed();
        // A Go thread blocked in the scheduler waits for the goroutine that parked on it.
        ro.ff_go_park_stitch = true;
        ro.python_frames = tracker.python().is_some();
    }
    if let Some(u) = unwinder {
        u.share_maps(&mut open.maps.unwind_tables, &mut open.maps.unwind_procs)?;
    }
    if let Some(py) = tracker.python() {
        py.share_maps(&mut open.maps.py_procs, &mut open.maps.py_threads)
            .map_err(|e| CaptureError::bpf(e.what, e.source))?;
    }
    let py_stacks = if tracker.python().is_some() {
        config.max_stacks
    } else {
        1
    };
    // Without kernel stacks their map keeps one entry.
    let kernel_stacks = if options.kernel_stacks {
        config.max_stacks
    } else {
        1
    };
    let m = &mut open.maps;
    let sizing = (|| {
        m.target_cache.set_autocreate(cache)?;
        // sched_switch is not preempted: the walk's per-CPU scratch serves.
        m.unwind_task_scratch.set_autocreate(false)?;
        m.targets.set_max_entries(config.max_targets.max(1))?;
        // Element i is target index i; index 0 is never handed out.
        m.short_blocks
            .set_max_entries(config.max_target_indices.saturating_add(1))?;
        m.counts.set_max_entries(config.max_cpu_entries.max(1))?;
        m.kernel_stacks.set_max_entries(kernel_stacks.max(1))?;
        m.user_stacks.set_max_entries(config.max_stacks.max(1))?;
        m.py_stacks.set_max_entries(py_stacks.max(1))
    })();
    sizing.map_err(|e| CaptureError::bpf("sizing off-CPU maps", e))?;
    let skel = CaptureError::load("loading the off-CPU BPF programs", || open.load())?;
    let links = vec![
        skel.progs
            .offcpu_switch
            .attach()
            .map_err(|e| CaptureError::bpf("attaching the off-CPU program to sched_switch", e))?,
        skel.progs
            .ff_proc_on_exec
            .attach()
            .map_err(|e| CaptureError::bpf("attaching to sched_process_exec", e))?,
    ];
    let handle = CaptureError::map_handle;
    let maps = Maps {
        targets: handle(&skel.maps.targets, "targets")?,
        generation: handle(&skel.maps.target_generation, "target_generation")?,
        counts: handle(&skel.maps.counts, "counts")?,
        short_blocks: handle(&skel.maps.short_blocks, "short_blocks")?,
        cpus: handle(&skel.maps.offcpu_cpus, "offcpu_cpus")?,
        kernel_stacks: handle(&skel.maps.kernel_stacks, "kernel_stacks")?,
        user_stacks: handle(&skel.maps.user_stacks, "user_stacks")?,
        unwind_stats: handle(&skel.maps.unwind_stats, "unwind_stats")?,
        py_stacks: handle(&skel.maps.py_stacks, "py_stacks")?,
        py_stats: handle(&skel.maps.py_stats, "py_stats")?,
    };
    let ring = tracker.event_ring(&handle(&skel.maps.proc_events, "proc_events")?)?;
    Ok(Loaded {
        skel,
        links,
        maps,
        ring,
    })
}

/// One key's totals as read from the kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Totals {
    pub(super) blocked_ns: u64,
    pub(super) blocks: u64,
    pub(super) queued_ns: u64,
}

impl Totals {
    pub(super) fn since(self, before: Self) -> Self {
        Self {
            blocked_ns: self.blocked_ns.saturating_sub(before.blocked_ns),
            blocks: self.blocks.saturating_sub(before.blocks),
            queued_ns: self.queued_ns.saturating_sub(before.queued_ns),
        }
    }
}

/// Totals of the given target indices, keyed by raw key bytes.
pub(super) fn read_counts(
    counts: &MapHandle,
    targets: &HashSet<u32>,
) -> Result<HashMap<Vec<u8>, Totals>> {
    let values = read_target_entries::<offcpu_key, offcpu_val>(
        counts,
        targets,
        |k| k.target,
        "off-CPU totals",
    )?;
    Ok(values
        .into_iter()
        .map(|(key, v)| {
            let totals = Totals {
                blocked_ns: v.blocked_ns,
                blocks: v.blocks,
                queued_ns: v.queued_ns,
            };
            (key, totals)
        })
        .collect())
}

/// The blocks below the minimum of the given target indices (summed over CPUs).
pub(super) fn read_short(map: &MapHandle, targets: &HashSet<u32>) -> Result<HashMap<u32, Totals>> {
    let mut out = HashMap::new();
    for &index in targets {
        let cpus = per_cpu::<offcpu_short>(map, index)
            .map_err(|e| CaptureError::bpf("reading off-CPU short blocks", e))?;
        let mut sum = Totals::default();
        for v in cpus {
            sum.blocked_ns += v.blocked_ns;
            sum.blocks += v.blocks;
            sum.queued_ns += v.queued_ns;
        }
        out.insert(index, sum);
    }
    Ok(out)
}

pub(super) fn read_stats(cpus: &MapHandle) -> OffcpuStats {
    let mut sum = OffcpuStats::default();
    for c in per_cpu::<offcpu_cpu>(cpus, 0).unwrap_or_default() {
        let s = c.stats;
        sum.blocks += s.blocks;
        sum.walked += s.walked;
        sum.short_blocks += s.short_blocks;
        sum.stale += s.stale;
        sum.counts_full += s.counts_full;
        sum.stamp_full += s.stamp_full;
        sum.kernel_stack += s.kernel_stack;
        sum.notify += s.notify;
    }
    sum
}

/// Removes the stacks no total has referred to over two cleanups, so that the stack maps
/// hold only what running captures can read (without it they fill up over a long-lived
/// sampler). Called when a capture released targets.
///
/// Unlike the CPU sampler's, a stack here is stored before anything counts on it: a
/// thread's user stack is walked when it blocks and counted when it runs again. A stack
/// unreferenced at one cleanup may belong to a block still in progress, so it is removed
/// only if it is still unreferenced at the next; only a block spanning two cleanups (two
/// captures ending on the sampler while it lasts) loses its user stack.
pub(super) fn drop_unreferenced_stacks(maps: &Maps, last: &mut Unreferenced) -> (usize, usize) {
    let mut kernel_keys: HashSet<u64> = HashSet::new();
    let mut user_keys: HashSet<u64> = HashSet::new();
    let mut py_keys: HashSet<u64> = HashSet::new();
    for raw in maps.counts.keys() {
        if let Some(k) = from_bytes::<offcpu_key>(&raw) {
            kernel_keys.insert(k.kernel_stack);
            user_keys.insert(k.user_stack);
            py_keys.insert(k.py_stack);
        }
    }
    let sweep = |map: &MapHandle, keep: &HashSet<u64>, last: &mut HashSet<u64>| {
        let unreferenced: HashSet<u64> = map
            .keys()
            .filter_map(|k| from_bytes::<u64>(&k))
            .filter(|k| !keep.contains(k))
            .collect();
        let doomed: HashSet<u64> = unreferenced.intersection(last).copied().collect();
        let removed = doomed
            .iter()
            .filter(|k| map.delete(&k.to_ne_bytes()).is_ok())
            .count();
        *last = unreferenced
            .into_iter()
            .filter(|k| !doomed.contains(k))
            .collect();
        removed
    };
    // Python stacks go with the user stacks they were walked with: one count.
    let user = sweep(&maps.user_stacks, &user_keys, &mut last.user)
        + sweep(&maps.py_stacks, &py_keys, &mut last.python);
    (
        sweep(&maps.kernel_stacks, &kernel_keys, &mut last.kernel),
        user,
    )
}

/// The stacks of each map no total referred to at the last cleanup.
#[derive(Debug, Default)]
pub(super) struct Unreferenced {
    kernel: HashSet<u64>,
    user: HashSet<u64>,
    python: HashSet<u64>,
}
