//! The node's CPU sampler: the loaded program, attached to one perf event per online CPU
//! while captures run, shared by every CPU capture.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::{CpuCapture, CpuDrops, CpuMapFill, CpuOptions};
use crate::bpf::cpu_sampler::types::{cpu_drops, cpu_sample_key, ff_target};
use crate::bpf::cpu_sampler::{CpuSamplerSkel, CpuSamplerSkelBuilder};
use crate::bpf::{from_bytes, per_cpu};
use crate::capture::kernel::{FrameWalk, KernelFeatures};
use crate::capture::process_tracker::ProcessTracker;
use crate::capture::sampler_thread::{self, OwnerThread};
use crate::capture::target_table::{CaptureCgroups, TargetMaps, TargetTable, read_target_entries};
use crate::capture::{CaptureError, CaptureTarget, Result, SamplerConfig, perf_event, stack_maps};
use crate::process::ProcessCatalog;
use crate::python::{PyStats, PythonRegistry};
use crate::unwind::{Unwinder, WalkStats};

pub(super) struct Maps {
    pub(super) targets: MapHandle,
    pub(super) generation: MapHandle,
    pub(super) counts: MapHandle,
    pub(super) kernel_stacks: MapHandle,
    pub(super) drops: MapHandle,
    pub(super) user_stacks: MapHandle,
    pub(super) unwind_stats: MapHandle,
    pub(super) py_stacks: MapHandle,
    pub(super) py_stats: MapHandle,
}

pub(super) struct Shared {
    pub(super) maps: Maps,
    pub(super) table: TargetTable,
    /// Captures running on the sampler.
    pub(super) active: usize,
    /// One perf event per online CPU with the program attached, while `active > 0`.
    pub(super) perf: Vec<OwnedFd>,
    /// When `active` last dropped to 0 (or the sampler was loaded).
    pub(super) idle_since: Instant,
    /// When the sole capture paused the perf events ([`CpuCapture::pause`]); `None` while
    /// they sample.
    pub(super) paused_at: Option<Instant>,
}

/// `PERF_EVENT_IOC_SET_BPF` of linux/perf_event.h (`_IOW('$', 8, __u32)`); libc does not
/// export it.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
/// `PERF_EVENT_IOC_ENABLE` (`_IO('$', 0)`).
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
/// `PERF_EVENT_IOC_DISABLE` (`_IO('$', 1)`).
const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;

impl Maps {
    pub(super) fn target_maps(&self) -> TargetMaps<'_> {
        TargetMaps {
            targets: &self.targets,
            generation: &self.generation,
        }
    }
}

/// The node's CPU sampler: the loaded program, attached to one perf event per
/// online CPU while at least one capture runs. Shared (through [`crate::capture::Samplers`]) by
/// every CPU capture. Between captures the perf events are closed (nothing samples) but
/// the program stays loaded, so the registry can keep an idle sampler for a while and
/// spare the next capture the load (the verifier's fraction of a second).
pub struct CpuSampler {
    shared: Mutex<Shared>,
    pub(super) options: CpuOptions,
    cpus: Vec<u32>,
    /// The sampling program (a duplicate of the owner thread's fd).
    program: OwnedFd,
    /// Feeds the node's catalog and the unwinder with the targets' processes.
    pub(super) tracker: ProcessTracker,
    owner: OwnerThread,
}

impl std::fmt::Debug for CpuSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuSampler")
            .field("options", &self.options)
            .field("perf_events", &self.cpus.len())
            .finish()
    }
}

impl CpuSampler {
    /// Whether the thread that owns the loaded programs still runs.
    pub fn is_alive(&self) -> bool {
        self.owner.is_alive()
    }

    /// Counts the entries of the sampler's maps (walks their keys: O(entries)).
    pub fn map_fill(&self) -> CpuMapFill {
        let shared = self.lock();
        let maps = &shared.maps;
        CpuMapFill {
            targets: maps.targets.keys().count(),
            counts: maps.counts.keys().count(),
            kernel_stacks: maps.kernel_stacks.keys().count(),
            user_stacks: maps.user_stacks.keys().count(),
        }
    }

    /// Loads and attaches the sampler. Fails with [`CaptureError::Privilege`]
    /// without CAP_BPF/CAP_PERFMON, [`CaptureError::KernelFeature`] when the
    /// event or BTF is missing.
    pub fn start(
        config: &SamplerConfig,
        options: CpuOptions,
        catalog: ProcessCatalog,
    ) -> Result<Self> {
        options.validate()?;
        crate::capture::check_btf()?;
        let began = Instant::now();
        let cpus = perf_event::online_cpus()?;
        let (max_targets, max_indices) = (config.max_targets, config.max_target_indices);
        let config = config.clone();
        let unwinder = if options.cfi_unwind {
            Some(Unwinder::shared(&config.unwind)?)
        } else {
            None
        };
        // Python frames are read where the CFI walk runs (bpf_loop kernels, Linux 5.17+).
        let mut tracker = ProcessTracker::new(catalog, unwinder);
        if options.cfi_unwind
            && config.python_frames
            && !config.force_bounded_walk
            && KernelFeatures::get().frame_walk() != FrameWalk::Bounded
        {
            let python =
                PythonRegistry::shared().map_err(|e| CaptureError::bpf(e.what, e.source))?;
            tracker = tracker.with_python(python);
        }
        let thread_tracker = tracker.clone();
        let (handles, owner) = sampler_thread::spawn("cpu", move |ready, stop| {
            let mut object = MaybeUninit::uninit();
            let loaded = load(&mut object, &config, options, &thread_tracker)
                .map(|l| ((l.maps, l.program), l.ring, (l.links, l.skel)));
            sampler_thread::serve_ring(ready, &stop, loaded);
        })?;
        let (maps, program) = handles;
        // Most of it is the verifier's; the first capture after an idle spell waits for it.
        tracing::info!(
            ms = began.elapsed().as_millis() as u64,
            cpus = cpus.len(),
            "cpu sampler loaded"
        );
        Ok(Self {
            shared: Mutex::new(Shared {
                maps,
                table: TargetTable::new(max_targets, max_indices),
                active: 0,
                perf: Vec::new(),
                idle_since: Instant::now(),
                paused_at: None,
            }),
            options,
            cpus,
            program,
            tracker,
            owner,
        })
    }

    /// The options the sampler runs with (the first capture's).
    pub fn options(&self) -> CpuOptions {
        self.options
    }

    /// Number of perf events a capture opens (one per online CPU).
    pub fn perf_events(&self) -> usize {
        self.cpus.len()
    }

    /// How long the sampler has had no capture; `None` while one runs.
    pub fn idle_for(&self) -> Option<Duration> {
        let shared = self.lock();
        (shared.active == 0).then(|| shared.idle_since.elapsed())
    }

    /// Opens one perf event per online CPU and attaches the program to each.
    fn attach(&self, perf: &mut Vec<OwnedFd>) -> Result<()> {
        for &cpu in &self.cpus {
            let fd = perf_event::open(self.options.event, cpu, self.options.frequency)?;
            // SAFETY: both descriptors are open and ours; the ioctl reads the program fd
            // passed by value.
            let rc = unsafe {
                libc::ioctl(
                    fd.as_raw_fd(),
                    PERF_EVENT_IOC_SET_BPF as _,
                    self.program.as_raw_fd(),
                )
            };
            if rc != 0 {
                perf.clear();
                return Err(CaptureError::Io {
                    action: format!("attaching the CPU sampler to the perf event of CPU {cpu}"),
                    source: std::io::Error::last_os_error(),
                });
            }
            perf.push(fd);
        }
        Ok(())
    }

    /// A capture ended: the last one closes the perf events (nothing samples then).
    pub(super) fn end_capture(shared: &mut Shared) {
        shared.active = shared.active.saturating_sub(1);
        if shared.active == 0 {
            shared.perf.clear();
            shared.paused_at = None;
            shared.idle_since = Instant::now();
        }
    }

    /// Enables or disables every perf event of the sampler (each on its CPU, synchronously:
    /// once disabled, no sample is taken any more).
    pub(super) fn set_enabled(shared: &Shared, enabled: bool) -> Result<()> {
        let request = if enabled {
            PERF_EVENT_IOC_ENABLE
        } else {
            PERF_EVENT_IOC_DISABLE
        };
        for fd in &shared.perf {
            // SAFETY: the descriptor is open and ours; the request takes no argument.
            let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, 0) };
            if rc != 0 {
                return Err(CaptureError::Io {
                    action: format!(
                        "{} the CPU sampler's perf event",
                        if enabled { "enabling" } else { "disabling" }
                    ),
                    source: std::io::Error::last_os_error(),
                });
            }
        }
        Ok(())
    }

    /// The unwind tables the sampler walks user stacks with (`None` with
    /// `cfi_unwind: false`).
    pub fn unwinder(&self) -> Option<&Arc<Unwinder>> {
        self.tracker.unwinder()
    }

    /// Number of cgroups currently in the target map.
    pub fn target_cgroups(&self) -> usize {
        self.lock().table.len()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a capture of `targets` on this sampler. A capture that joins running ones
    /// gets the sampler's options whatever it asked for; on an idle sampler loaded with
    /// other options it fails with [`CaptureError::IdleSamplerOptions`] (the registry
    /// then loads a fresh one).
    pub fn capture(
        self: &Arc<Self>,
        targets: &[CaptureTarget],
        options: &CpuOptions,
    ) -> Result<CpuCapture> {
        if targets.is_empty() {
            return Err(CaptureError::InvalidOptions(
                "no target cgroup given".into(),
            ));
        }
        // A target covers its cgroup and, live, everything below it.
        let (own_cgroups, cgroups) = CaptureCgroups::of(targets);
        // Processes running already will not announce themselves by exec. Their tables
        // are loaded before their cgroups become targets, so that even their first
        // samples unwind fully.
        self.tracker
            .track_running(targets, &mut HashSet::new(), true);
        let mut shared = self.lock();
        if shared.paused_at.is_some() {
            return Err(CaptureError::InvalidOptions(
                "the CPU sampler is paused by the capture holding it; end that capture first"
                    .into(),
            ));
        }
        // The first capture of a busy spell opens the perf events (the last one of the
        // previous spell closed them).
        let opens_spell = shared.active == 0;
        if opens_spell {
            if *options != self.options {
                return Err(CaptureError::IdleSamplerOptions);
            }
            self.attach(&mut shared.perf)?;
        }
        shared.active += 1;
        let begun = (|| {
            let Shared { maps, table, .. } = &mut *shared;
            table.acquire::<ff_target>(&maps.target_maps(), &cgroups, 0, |a, _| Ok(a))?;
            let baseline = read_counts(&maps.counts, &own_cgroups.covered(table))?;
            Ok((
                baseline,
                read_drops(&maps.drops),
                WalkStats::read(&maps.unwind_stats),
                PyStats::read(&maps.py_stats),
            ))
        })();
        let (baseline, drops_before, walk_before, py_before) = match begun {
            Ok(b) => b,
            Err(e) => {
                Self::end_capture(&mut shared);
                return Err(e);
            }
        };
        drop(shared);
        Ok(CpuCapture {
            sampler: self.clone(),
            targets: targets.to_vec(),
            cgroups: own_cgroups,
            baseline,
            drops_before,
            walk_before,
            py_before,
            started: SystemTime::now(),
            started_at: Instant::now(),
            opens_spell,
        })
    }
}

/// What the owner thread keeps alive while the sampler runs.
struct Loaded<'obj> {
    skel: CpuSamplerSkel<'obj>,
    links: Vec<libbpf_rs::Link>,
    maps: Maps,
    program: OwnedFd,
    ring: libbpf_rs::RingBuffer<'static>,
}

fn load<'obj>(
    object: &'obj mut MaybeUninit<libbpf_rs::OpenObject>,
    config: &SamplerConfig,
    options: CpuOptions,
    tracker: &ProcessTracker,
) -> Result<Loaded<'obj>> {
    let unwinder = tracker.unwinder();
    let mut open = CpuSamplerSkelBuilder::default()
        .open(object)
        .map_err(|e| CaptureError::bpf("opening the CPU sampler BPF object", e))?;
    let cache = crate::capture::target_cache_enabled(config);
    // One of two program sets (KernelFeatures::frame_walk): bpf_loop and BTF task
    // pointers, or bounded loops and probe reads where the kernel lacks them.
    let walk = if config.force_bounded_walk {
        FrameWalk::Bounded
    } else {
        KernelFeatures::get().frame_walk()
    };
    let bounded = walk == FrameWalk::Bounded;
    open.progs.on_cpu_sample.set_autoload(!bounded);
    open.progs.on_cpu_sample_compat.set_autoload(bounded);
    open.progs.cpu_walk_compat.set_autoload(bounded);
    for map in [&mut open.maps.cpu_walk_progs, &mut open.maps.cpu_pending] {
        map.set_autocreate(bounded)
            .map_err(|e| CaptureError::bpf("configuring the bounded walk's maps", e))?;
    }
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.capture_kernel_stacks = options.kernel_stacks;
        ro.ff_cgrp_cache = cache;
        ro.cfi_unwind = unwinder.is_some();
        ro.python_frames = tracker.python().is_some();
        ro.ff_stack_seed = stack_maps::seed();
    }
    open.maps
        .target_cache
        .set_autocreate(cache)
        .map_err(|e| CaptureError::bpf("configuring the target cache", e))?;
    // Perf-event programs are not preempted: the walk's per-CPU scratch serves, and the
    // per-task one (task storage, which Linux 5.10 lacks) is not created.
    open.maps
        .unwind_task_scratch
        .set_autocreate(false)
        .map_err(|e| CaptureError::bpf("configuring the unwind scratch", e))?;
    if let Some(u) = unwinder {
        u.share_maps(&mut open.maps.unwind_tables, &mut open.maps.unwind_procs)?;
    }
    if let Some(py) = tracker.python() {
        py.share_maps(&mut open.maps.py_procs, &mut open.maps.py_threads)
            .map_err(|e| CaptureError::bpf(e.what, e.source))?;
    }
    // Without kernel stacks their map keeps one entry.
    let kernel_stacks = if options.kernel_stacks {
        config.max_stacks
    } else {
        1
    };
    let sizes = [
        (&mut open.maps.targets, config.max_targets),
        (&mut open.maps.counts, config.max_cpu_entries),
        (&mut open.maps.kernel_stacks, kernel_stacks),
        (&mut open.maps.user_stacks, config.max_stacks),
        (
            &mut open.maps.py_stacks,
            if tracker.python().is_some() {
                config.max_stacks
            } else {
                1
            },
        ),
    ];
    for (map, size) in sizes {
        map.set_max_entries(size.max(1))
            .map_err(|e| CaptureError::bpf("sizing CPU sampler maps", e))?;
    }
    let skel = CaptureError::load("loading the CPU sampler BPF programs", || open.load())?;
    // The perf events are opened and the sampling program attached per capture
    // (CpuSampler::attach), from a duplicate of its fd.
    if bounded {
        let walker = skel.progs.cpu_walk_compat.as_fd().as_raw_fd() as u32;
        skel.maps
            .cpu_walk_progs
            .update(&0u32.to_ne_bytes(), &walker.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("installing the bounded walk's tail call", e))?;
    }
    let sample = if bounded {
        &skel.progs.on_cpu_sample_compat
    } else {
        &skel.progs.on_cpu_sample
    };
    let program = sample
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| CaptureError::Io {
            action: "duplicating the CPU sampler program's fd".into(),
            source,
        })?;
    let links = vec![
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
        kernel_stacks: handle(&skel.maps.kernel_stacks, "kernel_stacks")?,
        drops: handle(&skel.maps.drops, "drops")?,
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
        program,
        ring,
    })
}

/// Stacks removed by [`drop_unreferenced_stacks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct FreedStacks {
    /// Entries removed from `kernel_stacks`.
    kernel_stacks: usize,
    /// Entries removed from `user_stacks`.
    user_stacks: usize,
    /// Entries removed from `py_stacks`.
    py_stacks: usize,
}

/// Removes the stacks no count refers to any more, so that the stack maps hold only what
/// the captures still running can read: without it they fill up over a long-lived sampler
/// (every distinct stack ever seen stays) and then lose new stacks. Called when a capture
/// released targets (their counts are gone).
///
/// The program may count a sample whose stack is removed in the instant between the scan
/// and the removal, if that same stack was until then referred to only by released counts;
/// the next sample of that stack stores it again under the same key (the key is a hash of
/// the frames), so only a stack seen exactly once in that instant can read back empty.
pub(super) fn drop_unreferenced_stacks(maps: &Maps) -> FreedStacks {
    let mut kernel_keys: HashSet<u64> = HashSet::new();
    let mut user_keys: HashSet<u64> = HashSet::new();
    let mut py_keys: HashSet<u64> = HashSet::new();
    for raw in maps.counts.keys() {
        if let Some(k) = from_bytes::<cpu_sample_key>(&raw) {
            kernel_keys.insert(k.kernel_stack);
            user_keys.insert(k.user_stack);
            py_keys.insert(k.py_stack);
        }
    }
    FreedStacks {
        kernel_stacks: stack_maps::delete_keys_not_in(&maps.kernel_stacks, &kernel_keys),
        user_stacks: stack_maps::delete_keys_not_in(&maps.user_stacks, &user_keys),
        py_stacks: stack_maps::delete_keys_not_in(&maps.py_stacks, &py_keys),
    }
}

/// Counts of the given target indices, keyed by raw key bytes.
pub(super) fn read_counts(
    counts: &MapHandle,
    targets: &HashSet<u32>,
) -> Result<HashMap<Vec<u8>, u64>> {
    read_target_entries::<cpu_sample_key, u64>(counts, targets, |k| k.target, "CPU sample counts")
}

pub(super) fn read_drops(drops: &MapHandle) -> CpuDrops {
    let mut sum = CpuDrops::default();
    for d in per_cpu::<cpu_drops>(drops, 0).unwrap_or_default() {
        sum.counts_full += d.counts_full;
        sum.user_stack += d.user_stack;
        sum.kernel_stack += d.kernel_stack;
        sum.notify += d.notify;
    }
    sum
}
