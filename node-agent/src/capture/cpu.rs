//! CPU profiles: the shared CPU sampler (one perf event per online CPU, a BPF
//! program counting stacks of target cgroups in the kernel), captures on top
//! of it, and their pprof output.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::{MapCore as _, MapFlags, MapHandle, RingBufferBuilder};

use flamefleet_proto::pprof::Profile;

pub use super::perf_event::PerfEventKind;
use super::sampler_thread::{self, OwnerThread, Woken};
use super::target_table::{TargetMaps, TargetTable, delete_target_entries};
use super::{CaptureError, CaptureTarget, Result, SamplerConfig, perf_event, stack_maps};
use crate::bpf::cpu_sampler::types::{cpu_drops, cpu_sample_key, ff_proc_event, ff_target};
use crate::bpf::cpu_sampler::{CpuSamplerSkel, CpuSamplerSkelBuilder};
use crate::bpf::from_bytes;
use crate::pprof::{Label, ProfileBuilder};
use crate::symbolize::{ProcessCatalog, StackSymbolizer};
use crate::unwind::{Unwinder, UnwinderStats, WalkStats};

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

struct Maps {
    targets: MapHandle,
    generation: MapHandle,
    counts: MapHandle,
    kernel_stacks: MapHandle,
    drops: MapHandle,
    user_stacks: MapHandle,
    unwind_stats: MapHandle,
}

struct Shared {
    maps: Maps,
    table: TargetTable,
    /// Captures running on the sampler.
    active: usize,
    /// One perf event per online CPU with the program attached, while `active > 0`.
    perf: Vec<OwnedFd>,
    /// When `active` last dropped to 0 (or the sampler was loaded).
    idle_since: Instant,
}

/// `PERF_EVENT_IOC_SET_BPF` of linux/perf_event.h (`_IOW('$', 8, __u32)`); libc does not
/// export it.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;

impl Maps {
    fn target_maps(&self) -> TargetMaps<'_> {
        TargetMaps {
            targets: &self.targets,
            generation: &self.generation,
        }
    }
}

/// The node's CPU sampler: the loaded program, attached to one perf event per
/// online CPU while at least one capture runs. Shared (through [`super::Samplers`]) by
/// every CPU capture. Between captures the perf events are closed (nothing samples) but
/// the program stays loaded, so the registry can keep an idle sampler for a while and
/// spare the next capture the load (the verifier's fraction of a second).
pub struct CpuSampler {
    shared: Mutex<Shared>,
    options: CpuOptions,
    cpus: Vec<u32>,
    /// The sampling program (a duplicate of the owner thread's fd).
    program: OwnedFd,
    catalog: ProcessCatalog,
    unwinder: Option<Arc<Unwinder>>,
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
        super::check_btf()?;
        let began = Instant::now();
        let cpus = perf_event::online_cpus()?;
        let (max_targets, max_indices) = (config.max_targets, config.max_target_indices);
        let config = config.clone();
        let thread_catalog = catalog.clone();
        let unwinder = if options.cfi_unwind {
            Some(Unwinder::shared(&config.unwind)?)
        } else {
            None
        };
        let thread_unwinder = unwinder.clone();
        let (handles, owner) = sampler_thread::spawn("cpu", move |ready, stop| {
            let mut object = MaybeUninit::uninit();
            let loaded = load(
                &mut object,
                &config,
                options,
                thread_catalog,
                thread_unwinder,
            );
            match loaded {
                Ok(loaded) => {
                    if ready.send(Ok((loaded.maps, loaded.program))).is_err() {
                        return;
                    }
                    // Sleeps until the ring has process notifications or the sampler
                    // stops; consume errors are EINTR.
                    while stop.wait(Some(loaded.ring.epoll_fd()), None) == Woken::Look {
                        let _ = loaded.ring.consume();
                    }
                    drop(loaded.links);
                    drop(loaded.skel);
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                }
            }
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
            }),
            options,
            cpus,
            program,
            catalog,
            unwinder,
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
    fn end_capture(shared: &mut Shared) {
        shared.active = shared.active.saturating_sub(1);
        if shared.active == 0 {
            shared.perf.clear();
            shared.idle_since = Instant::now();
        }
    }

    /// The unwind tables the sampler walks user stacks with (`None` with
    /// `cfi_unwind: false`).
    pub fn unwinder(&self) -> Option<&Arc<Unwinder>> {
        self.unwinder.as_ref()
    }

    /// Number of cgroups currently in the target map.
    pub fn target_cgroups(&self) -> usize {
        self.lock().table.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
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
        let (cgroups, owner_of) = super::expand_targets(targets);
        // Processes running already will not announce themselves by exec.
        // Their tables are loaded before their cgroups become targets, so
        // that even their first samples unwind fully.
        let mut running = Vec::new();
        for t in targets {
            for pid in t.cgroup.procs_recursive().unwrap_or_default() {
                self.catalog.snapshot(pid);
                if let Some(maps) = self.catalog.lookup(pid) {
                    running.push((pid, maps));
                }
            }
        }
        if let Some(u) = &self.unwinder {
            u.register_now(running, Duration::from_millis(300));
        }
        let mut shared = self.lock();
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
        let cgroup_ids: Vec<u64> = cgroups.iter().map(|c| c.id).collect();
        let begun = (|| {
            let Shared { maps, table, .. } = &mut *shared;
            table.acquire::<ff_target>(&maps.target_maps(), &cgroups, 0, |a, _| Ok(a))?;
            let covered = table.covered(&cgroup_ids);
            let baseline = read_counts(&maps.counts, &covered.keys().copied().collect())?;
            Ok((
                baseline,
                read_drops(&maps.drops),
                WalkStats::read(&maps.unwind_stats),
            ))
        })();
        let (baseline, drops_before, walk_before) = match begun {
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
            cgroup_ids,
            owner_of,
            baseline,
            drops_before,
            walk_before,
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
    catalog: ProcessCatalog,
    unwinder: Option<Arc<Unwinder>>,
) -> Result<Loaded<'obj>> {
    let mut open = CpuSamplerSkelBuilder::default()
        .open(object)
        .map_err(|e| CaptureError::bpf("opening the CPU sampler BPF object", e))?;
    let cache = super::target_cache_enabled(config);
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.capture_kernel_stacks = options.kernel_stacks;
        ro.ff_cgrp_cache = cache;
        ro.cfi_unwind = unwinder.is_some();
        ro.ff_stack_seed = stack_maps::seed();
    }
    open.maps
        .target_cache
        .set_autocreate(cache)
        .map_err(|e| CaptureError::bpf("configuring the target cache", e))?;
    if let Some(u) = &unwinder {
        u.share_maps(&mut open.maps.unwind_tables, &mut open.maps.unwind_procs)?;
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
    ];
    for (map, size) in sizes {
        map.set_max_entries(size.max(1))
            .map_err(|e| CaptureError::bpf("sizing CPU sampler maps", e))?;
    }
    let skel = open
        .load()
        .map_err(|e| CaptureError::bpf("loading the CPU sampler BPF programs", e))?;
    // The perf events are opened and the sampling program attached per capture
    // (CpuSampler::attach), from a duplicate of its fd.
    let program = skel
        .progs
        .on_cpu_sample
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| CaptureError::Io {
            action: "duplicating the CPU sampler program's fd".into(),
            source,
        })?;
    let links = vec![
        skel.progs
            .on_exec
            .attach()
            .map_err(|e| CaptureError::bpf("attaching to sched_process_exec", e))?,
    ];
    let handle = |m: &libbpf_rs::MapMut<'_>, what: &str| {
        MapHandle::try_from(m).map_err(|e| CaptureError::bpf(format!("duplicating map {what}"), e))
    };
    let maps = Maps {
        targets: handle(&skel.maps.targets, "targets")?,
        generation: handle(&skel.maps.target_generation, "target_generation")?,
        counts: handle(&skel.maps.counts, "counts")?,
        kernel_stacks: handle(&skel.maps.kernel_stacks, "kernel_stacks")?,
        drops: handle(&skel.maps.drops, "drops")?,
        user_stacks: handle(&skel.maps.user_stacks, "user_stacks")?,
        unwind_stats: handle(&skel.maps.unwind_stats, "unwind_stats")?,
    };
    let events = handle(&skel.maps.proc_events, "proc_events")?;
    let mut rb = RingBufferBuilder::new();
    rb.add(&events, move |data: &[u8]| {
        if let Some(ev) = from_bytes::<ff_proc_event>(data) {
            catalog.snapshot(ev.tgid);
            if let (Some(u), Some(maps)) = (&unwinder, catalog.lookup(ev.tgid)) {
                u.register(ev.tgid, maps);
            }
        }
        0
    })
    .map_err(|e| CaptureError::bpf("reading the process ring buffer", e))?;
    let ring = rb
        .build()
        .map_err(|e| CaptureError::bpf("reading the process ring buffer", e))?;
    Ok(Loaded {
        skel,
        links,
        maps,
        program,
        ring,
    })
}

/// A running CPU capture; [`CpuCapture::finish`] returns its samples.
/// Dropping it without finishing releases its targets.
pub struct CpuCapture {
    sampler: Arc<CpuSampler>,
    targets: Vec<CaptureTarget>,
    /// The target cgroups, deduplicated; `owner_of[i]` is the position in
    /// `targets` of `cgroup_ids[i]`.
    cgroup_ids: Vec<u64>,
    owner_of: Vec<usize>,
    baseline: HashMap<Vec<u8>, u64>,
    drops_before: CpuDrops,
    walk_before: WalkStats,
    started: SystemTime,
    started_at: Instant,
    opens_spell: bool,
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
        let removed = table.release(&maps.target_maps(), &self.cgroup_ids);
        delete_target_entries::<cpu_sample_key>(&maps.counts, &removed, |k| k.target);
        if !removed.is_empty() {
            let freed = drop_unreferenced_stacks(maps);
            tracing::debug!(?freed, "cpu sampler: stacks no count refers to removed");
        }
        CpuSampler::end_capture(&mut shared);
    }
}

/// Stacks removed by [`drop_unreferenced_stacks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct FreedStacks {
    /// Entries removed from `kernel_stacks`.
    kernel_stacks: usize,
    /// Entries removed from `user_stacks`.
    user_stacks: usize,
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
fn drop_unreferenced_stacks(maps: &Maps) -> FreedStacks {
    let mut kernel_keys: HashSet<u64> = HashSet::new();
    let mut user_keys: HashSet<u64> = HashSet::new();
    for raw in maps.counts.keys() {
        if let Some(k) = from_bytes::<cpu_sample_key>(&raw) {
            kernel_keys.insert(k.kernel_stack);
            user_keys.insert(k.user_stack);
        }
    }
    FreedStacks {
        kernel_stacks: stack_maps::delete_keys_not_in(&maps.kernel_stacks, &kernel_keys),
        user_stacks: stack_maps::delete_keys_not_in(&maps.user_stacks, &user_keys),
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

    /// The samples so far, as [`Self::finish`] would read them now, without
    /// stopping the capture.
    pub fn peek(&self) -> Result<CpuSamples> {
        self.read()
    }

    fn read(&self) -> Result<CpuSamples> {
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
        let now = read_counts(&shared.maps.counts, &own)?;
        let mut drops = read_drops(&shared.maps.drops).since(self.drops_before);
        let walk = WalkStats::read(&shared.maps.unwind_stats).since(self.walk_before);
        drops.user_stack += walk.stack_lost;
        let mut kernel_cache: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut user_cache: HashMap<u64, Vec<u64>> = HashMap::new();
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
                comm: super::comm_string(&key.comm),
                user_stack: stack(&mut user_cache, &shared.maps.user_stacks, key.user_stack),
                kernel_stack: stack(
                    &mut kernel_cache,
                    &shared.maps.kernel_stacks,
                    key.kernel_stack,
                ),
                count,
            });
        }
        drop(shared);
        let options = self.sampler.options;
        Ok(CpuSamples {
            targets: self.targets.clone(),
            samples,
            drops,
            walk,
            unwinder: self.sampler.unwinder.as_ref().map(|u| u.stats()),
            options,
            started: self.started,
            duration,
        })
    }
}

/// One aggregated CPU sample: a thread, its stacks, and how often it was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuSample {
    /// Index into [`CpuSamples::targets`].
    pub target: usize,
    /// Process ID.
    pub tgid: u32,
    /// Thread ID.
    pub pid: u32,
    /// Thread name at sampling time.
    pub comm: String,
    /// User stack, leaf first (empty for kernel threads).
    pub user_stack: Vec<u64>,
    /// Kernel stack, leaf first (empty when not captured).
    pub kernel_stack: Vec<u64>,
    /// Number of samples.
    pub count: u64,
}

/// The result of a CPU capture, before symbolization.
#[derive(Debug, Clone)]
pub struct CpuSamples {
    /// The capture's targets.
    pub targets: Vec<CaptureTarget>,
    /// Aggregated samples.
    pub samples: Vec<CpuSample>,
    /// Losses during the capture window.
    pub drops: CpuDrops,
    /// How user stacks were walked during the window (all targets of the node).
    pub walk: WalkStats,
    /// The unwind tables' state at the end (`None` without CFI unwinding).
    pub unwinder: Option<UnwinderStats>,
    /// The sampler's effective options (frequency, event).
    pub options: CpuOptions,
    /// Wall-clock start.
    pub started: SystemTime,
    /// Capture length.
    pub duration: Duration,
}

impl CpuSamples {
    /// Total number of samples.
    pub fn total(&self) -> u64 {
        self.samples.iter().map(|s| s.count).sum()
    }

    /// Symbolizes the frames of these samples that no capture has symbolized yet and
    /// keeps them in the symbolizer's caches, building no profile; a frame already
    /// cached costs a lookup. Returns the frames it symbolized. Run during a capture's
    /// window on [`CpuCapture::peek`]'s samples, so that [`Self::to_profile`] after the
    /// window finds them cached.
    pub fn warm_symbols(&self, symbolizer: &mut StackSymbolizer) -> usize {
        let mut kernel: HashSet<&[u64]> = HashSet::new();
        let mut done = 0;
        for s in &self.samples {
            done += symbolizer.warm_user(s.tgid, &s.user_stack);
            if !s.kernel_stack.is_empty() && kernel.insert(&s.kernel_stack) {
                done += symbolizer.warm_kernel(&s.kernel_stack);
            }
        }
        done
    }

    /// Symbolizes and builds the pprof profile: sample types `samples/count`
    /// and `cpu/nanoseconds`, labels namespace/pod/container/node/pid/comm/thread.
    pub fn to_profile(&self, symbolizer: &mut StackSymbolizer, node: &str) -> Profile {
        let period = crate::pprof::nanos_per_sample(self.options.frequency);
        let mut b = ProfileBuilder::new(&[("samples", "count"), ("cpu", "nanoseconds")]);
        b.cpu_period(self.options.frequency);
        b.default_sample_type("cpu");
        let start = self
            .started
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        b.time(start, self.duration.as_nanos() as i64);
        b.comment(&format!(
            "event {} at {} Hz; drops: counts_full={} user_stack={} kernel_stack={} notify={}",
            self.options.event.name(),
            self.options.frequency,
            self.drops.counts_full,
            self.drops.user_stack,
            self.drops.kernel_stack,
            self.drops.notify
        ));
        for s in &self.samples {
            // User frames first: pprof takes mapping 1 as the main binary.
            let user = symbolizer.user_frames(&mut b, s.tgid, &s.user_stack);
            let mut frames = symbolizer.kernel_frames(&mut b, &s.kernel_stack);
            frames.extend(user);
            let mut labels = super::target_labels(self.targets.get(s.target), node);
            labels.push(Label::Num("pid".into(), i64::from(s.tgid), String::new()));
            labels.push(Label::Num("thread".into(), i64::from(s.pid), String::new()));
            labels.push(Label::Str("comm".into(), s.comm.clone()));
            let n = s.count as i64;
            symbolizer.account(&frames, s.count);
            b.add_sample(&frames, &[n, n * period], &labels);
        }
        b.comment(&symbolizer.stats.quality_comment("samples"));
        b.comment(&self.walk.comment());
        if let Some(u) = &self.unwinder {
            b.comment(&format!(
                "unwind tables: {} binaries, {} KiB; build+load {:.1} ms per binary (max {:.1} ms); \
                 {} without usable CFI; {} over budget; {} evicted",
                u.tables,
                u.table_bytes / 1024,
                u.build_micros as f64 / 1e3 / u.tables_loaded.max(1) as f64,
                u.max_build_micros as f64 / 1e3,
                u.binaries_without_cfi,
                u.over_budget,
                u.tables_evicted
            ));
        }
        b.build()
    }
}

/// Counts of the given target indices, keyed by raw key bytes.
fn read_counts(counts: &MapHandle, targets: &HashSet<u32>) -> Result<HashMap<Vec<u8>, u64>> {
    let mut out = HashMap::new();
    for key in counts.keys() {
        let Some(k) = from_bytes::<cpu_sample_key>(&key) else {
            continue;
        };
        if !targets.contains(&k.target) {
            continue;
        }
        let value = counts
            .lookup(&key, MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading CPU sample counts", e))?;
        if let Some(n) = value.as_deref().and_then(from_bytes::<u64>) {
            out.insert(key, n);
        }
    }
    Ok(out)
}

fn read_drops(drops: &MapHandle) -> CpuDrops {
    let per_cpu = drops
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .ok()
        .flatten();
    let mut sum = CpuDrops::default();
    for v in per_cpu.unwrap_or_default() {
        if let Some(d) = from_bytes::<cpu_drops>(&v) {
            sum.counts_full += d.counts_full;
            sum.user_stack += d.user_stack;
            sum.kernel_stack += d.kernel_stack;
            sum.notify += d.notify;
        }
    }
    sum
}
