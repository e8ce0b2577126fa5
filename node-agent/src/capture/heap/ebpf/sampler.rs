//! The node's one eBPF heap sampler, shared by every concurrent eBPF heap capture.
//!
//! Uprobes on an allocator trap every process that maps it, whether or not it is a target,
//! so N captures with their own programs would put N traps on every `malloc` of the node.
//! Instead, like the CPU and runqlat samplers ([`crate::capture::registry`]), one program
//! set is loaded while any heap capture runs, and:
//!
//! - **targets** go into one refcounted target table ([`TargetTable`]): each capture's
//!   cgroups get indices, and the kernel aggregates by index;
//! - **uprobes** attach once per allocator binary (device, inode) while any capture needs
//!   it: each capture holds a reference on the binaries its targets' processes map, and the
//!   last capture holding a binary detaches its probes ([`HeapSampler::attachments`]);
//! - **results** stay per capture: `alloc_*` is the increase of the kernel's (only growing)
//!   counters over the capture's window, and `inuse_*` counts the live sampled allocations
//!   made since the capture started (every live entry carries its allocation time), so a
//!   capture joining mid-way never counts what was allocated before it.
//!
//! Settings fixed at load — `sample_bytes` (the gap table is read-only data), the probe
//! mode, CFI unwinding, the map sizes — are the first capture's: later captures join the
//! running sampler and report the effective `sample_bytes` in their stats and profile (as
//! CPU captures report the effective frequency). A different rate per capture would need a
//! per-target gap table and a per-thread countdown per rate; one rate keeps the one trap
//! per call cheap, and a capture's profile is still unbiased (it is scaled by the rate it
//! was sampled at).
//!
//! The node's registry ([`crate::capture::Samplers`]) holds it like the other samplers, with
//! the node's map sizes: the first capture starts it, and it stops — detaching everything
//! and freeing its maps — when the last capture holding it ends. Like the other samplers it
//! has a bounded life: when its target indices run out, the next capture starts a fresh one.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::{Link, MapCore as _, MapFlags, MapHandle};

use super::EbpfHeapOptions;
use crate::bpf::from_bytes;
use crate::bpf::heap::types;
use crate::bpf::heap::{HeapSkel, HeapSkelBuilder};
use crate::capture::heap::allocators::{AllocatorBinary, EntryKind};
use crate::capture::heap::sampling;
use crate::capture::kernel::KernelFeatures;
use crate::capture::process_tracker::ProcessTracker;
use crate::capture::sampler_thread::{self, OwnerThread};
use crate::capture::target_table::{CaptureCgroups, TargetMaps, TargetTable};
use crate::capture::{CaptureError, CaptureTarget, Result, SamplerConfig, stack_maps};
use crate::process::ProcessCatalog;
use crate::unwind::Unwinder;

/// Number of entries in the exponential gap table (`HEAP_GAP_TABLE_SIZE`).
const GAP_TABLE_SIZE: usize = 4096;

/// A binary's identity for uprobes: (device, inode).
pub type DevIno = (u64, u64);

/// `struct heap_agg_key` as a hashable tuple: (target, tgid, size_class, user_stack).
pub(crate) type AggKey = (u32, u32, u32, u64);

pub(crate) fn agg_key(k: &types::heap_agg_key) -> AggKey {
    (k.target, k.tgid, k.size_class, k.user_stack)
}

/// How uprobes are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ProbeMode {
    /// malloc-like entry points as session uprobes, the others as uprobe_multi links
    /// (Linux 6.13+).
    Session,
    /// Every entry and return probe as a uprobe_multi link (Linux 6.6+).
    Multi,
    /// Perf-event uprobes (any kernel; CAP_SYS_ADMIN on most: see
    /// [`crate::capture::kernel::PerfUprobeAccess`]).
    #[default]
    Classic,
}

/// The settings a heap sampler was loaded with (the first capture's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapSamplerSettings {
    /// Mean bytes between samples.
    pub sample_bytes: u64,
    /// Whether stacks are walked with CFI tables.
    pub cfi_unwind: bool,
    /// Whether malloc-like entry points use session uprobes.
    pub session_uprobes: bool,
}

/// One allocator binary's probes, as [`HeapSampler::attachments`] reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatorAttachment {
    /// The binary's path inside the namespace of the process it was found in.
    pub name: String,
    /// Its identity.
    pub dev_ino: DevIno,
    /// Uprobes attached to it (entry and return probes).
    pub probes: usize,
    /// Captures holding it.
    pub captures: usize,
}

/// Handles on the sampler's maps (duplicated fds: usable from any thread).
pub(crate) struct Maps {
    pub(crate) targets: MapHandle,
    pub(crate) generation: MapHandle,
    pub(crate) heap_agg: MapHandle,
    pub(crate) heap_live: MapHandle,
    pub(crate) user_stacks: MapHandle,
    pub(crate) heap_stats: MapHandle,
    pub(crate) unwind_stats: MapHandle,
}

impl Maps {
    pub(crate) fn target_maps(&self) -> TargetMaps<'_> {
        TargetMaps {
            targets: &self.targets,
            generation: &self.generation,
        }
    }
}

/// One attached allocator binary.
struct Attached {
    name: String,
    probes: usize,
    /// Captures (by ID) holding it.
    holders: HashSet<u64>,
    /// Dropping them detaches the probes.
    links: Vec<Link>,
}

/// State every capture of the sampler reads and changes, under one lock.
pub(crate) struct Shared {
    pub(crate) maps: Maps,
    pub(crate) table: TargetTable,
    attached: HashMap<DevIno, Attached>,
    /// Start (`CLOCK_MONOTONIC` ns, the clock of `bpf_ktime_get_ns`) of each running capture.
    running: HashMap<u64, u64>,
}

/// A request to the owner thread, which alone can reach the loaded programs.
struct AttachRequest {
    binary: AllocatorBinary,
    reply: mpsc::SyncSender<Result<(Vec<Link>, usize)>>,
}

/// The node's eBPF heap sampler (see the module documentation).
pub struct HeapSampler {
    shared: Mutex<Shared>,
    requests: Mutex<mpsc::Sender<AttachRequest>>,
    settings: HeapSamplerSettings,
    /// Feeds the node's catalog and the unwinder with the targets' processes.
    tracker: ProcessTracker,
    next_capture: AtomicU64,
    owner: OwnerThread,
}

impl std::fmt::Debug for HeapSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapSampler")
            .field("settings", &self.settings)
            .finish()
    }
}

/// What a capture got when it joined: its sampler, ID, cgroups and baseline.
pub(crate) struct JoinedCapture {
    pub(crate) sampler: Arc<HeapSampler>,
    pub(crate) id: u64,
    /// Its target cgroups and which target each belongs to.
    pub(crate) cgroups: CaptureCgroups,
    /// `heap_agg` alloc counters of the capture's indices when it started.
    pub(crate) baseline: HashMap<AggKey, (u64, u64)>,
    pub(crate) start_ns: u64,
}

/// `CLOCK_MONOTONIC` now, in ns (what `bpf_ktime_get_ns` returns).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

impl HeapSampler {
    /// Loads the programs (session uprobes, else uprobe_multi, else perf-event uprobes) on
    /// an owner thread, sized by the node's `config`, and attaches the exec tracepoint; no
    /// uprobe is attached yet. `opts` (the first capture's) sets the sampling rate, the probe
    /// mode and the stack walk.
    pub(crate) fn start(
        config: &SamplerConfig,
        opts: &EbpfHeapOptions,
        catalog: ProcessCatalog,
    ) -> Result<Self> {
        crate::capture::check_btf()?;
        if let Some(reason) = KernelFeatures::get().heap_ebpf_refusal() {
            return Err(CaptureError::KernelFeature {
                feature: "eBPF heap sampling".into(),
                detail: reason,
            });
        }
        let unwinder = if opts.cfi_unwind {
            Some(Unwinder::shared(&config.unwind)?)
        } else {
            None
        };
        let tracker = ProcessTracker::new(catalog, unwinder);
        let (thread_opts, thread_config, thread_tracker) =
            (opts.clone(), config.clone(), tracker.clone());
        let (tx, rx) = mpsc::channel::<AttachRequest>();
        let ((maps, mode), owner) = sampler_thread::spawn("heap", move |ready, stop| {
            run_owner(
                &thread_opts,
                &thread_config,
                &thread_tracker,
                &rx,
                &ready,
                &stop,
            );
        })?;
        Ok(Self {
            shared: Mutex::new(Shared {
                maps,
                table: TargetTable::new(config.max_targets, config.max_target_indices),
                attached: HashMap::new(),
                running: HashMap::new(),
            }),
            requests: Mutex::new(tx),
            settings: HeapSamplerSettings {
                sample_bytes: opts.sample_bytes,
                cfi_unwind: tracker.unwinder().is_some(),
                session_uprobes: mode == ProbeMode::Session,
            },
            tracker,
            next_capture: AtomicU64::new(1),
            owner,
        })
    }

    /// Whether the thread that owns the loaded programs still runs.
    pub fn is_alive(&self) -> bool {
        self.owner.is_alive()
    }

    /// The settings the sampler was loaded with (the first capture's).
    pub fn settings(&self) -> HeapSamplerSettings {
        self.settings
    }

    /// The allocator binaries probed now: one entry per binary however many captures
    /// hold it.
    pub fn attachments(&self) -> Vec<AllocatorAttachment> {
        let shared = self.lock();
        let mut out: Vec<AllocatorAttachment> = shared
            .attached
            .iter()
            .map(|(&dev_ino, a)| AllocatorAttachment {
                name: a.name.clone(),
                dev_ino,
                probes: a.probes,
                captures: a.holders.len(),
            })
            .collect();
        out.sort_by_key(|a| a.dev_ino);
        out
    }

    /// Captures running on the sampler.
    pub fn captures(&self) -> usize {
        self.lock().running.len()
    }

    pub(crate) fn tracker(&self) -> &ProcessTracker {
        &self.tracker
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `targets` to the target table and takes the capture's baseline.
    pub(crate) fn register(self: &Arc<Self>, targets: &[CaptureTarget]) -> Result<JoinedCapture> {
        let (own_cgroups, cgroups) = CaptureCgroups::of(targets);
        let id = self.next_capture.fetch_add(1, Ordering::Relaxed);
        let mut shared = self.lock();
        let Shared {
            maps,
            table,
            running,
            ..
        } = &mut *shared;
        table.acquire::<types::ff_target>(&maps.target_maps(), &cgroups, 0, |a, _| Ok(a))?;
        let own = own_cgroups.covered(table);
        // Baseline first, then the start time: an allocation in between counts in
        // alloc_* but not in inuse_* (never in-use without having been allocated).
        let baseline = match read_alloc_counters(&maps.heap_agg, &own) {
            Ok(rows) => rows.into_iter().map(|(k, v)| (agg_key(&k), v)).collect(),
            Err(e) => {
                // Not joined after all: give the targets back.
                table.release(&maps.target_maps(), own_cgroups.ids());
                return Err(e);
            }
        };
        let start_ns = monotonic_ns();
        running.insert(id, start_ns);
        drop(shared);
        Ok(JoinedCapture {
            sampler: Arc::clone(self),
            id,
            cgroups: own_cgroups,
            baseline,
            start_ns,
        })
    }

    /// Holds `binary`'s probes for capture `id`, attaching them if no capture holds them
    /// yet. `Ok(Some(probes))` when this capture newly holds it, `Ok(None)` when it already
    /// did.
    pub(crate) fn hold_binary(&self, id: u64, binary: &AllocatorBinary) -> Result<Option<usize>> {
        let mut shared = self.lock();
        if let Some(a) = shared.attached.get_mut(&binary.dev_ino) {
            return Ok(a.holders.insert(id).then_some(a.probes));
        }
        // Attached while the lock is held, so two captures never attach the same binary.
        let (reply, answer) = mpsc::sync_channel(1);
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(AttachRequest {
                binary: binary.clone(),
                reply,
            })
            .map_err(|_| CaptureError::SamplerGone("heap"))?;
        self.owner.waker().kick();
        let (links, probes) = answer
            .recv()
            .map_err(|_| CaptureError::SamplerGone("heap"))??;
        shared.attached.insert(
            binary.dev_ino,
            Attached {
                name: binary.name.clone(),
                probes,
                holders: HashSet::from([id]),
                links,
            },
        );
        Ok(Some(probes))
    }

    /// Whether capture `id` holds the binary `dev_ino`.
    pub(crate) fn holds(&self, id: u64, dev_ino: DevIno) -> bool {
        self.lock()
            .attached
            .get(&dev_ino)
            .is_some_and(|a| a.holders.contains(&id))
    }

    /// Ends capture `id`: releases its targets (deleting what the kernel counted for
    /// targets no capture has any more), its binaries (detaching those no capture holds),
    /// and the live entries no running capture can count any more.
    pub(crate) fn release(&self, id: u64, cgroup_ids: &[u64]) {
        let mut shared = self.lock();
        let Shared {
            maps,
            table,
            attached,
            running,
        } = &mut *shared;
        running.remove(&id);
        let removed = table.release(&maps.target_maps(), cgroup_ids);
        crate::capture::target_table::delete_target_entries::<types::heap_agg_key>(
            &maps.heap_agg,
            &removed,
            |k| k.target,
        );
        // Live allocations of removed targets, and those older than every running capture
        // (no capture counts them), go: the live map holds only what can still be counted.
        let oldest = running.values().copied().min().unwrap_or(u64::MAX);
        let doomed: Vec<Vec<u8>> = maps
            .heap_live
            .keys()
            .filter(|k| {
                maps.heap_live
                    .lookup(k, MapFlags::ANY)
                    .ok()
                    .flatten()
                    .and_then(|v| from_bytes::<types::heap_live_val>(&v))
                    .is_some_and(|v| removed.contains(&v.agg.target) || v.alloc_ns < oldest)
            })
            .collect();
        for k in doomed {
            // Freed meanwhile is fine.
            let _ = maps.heap_live.delete(&k);
        }
        if !removed.is_empty() {
            drop_unreferenced_stacks(maps);
        }
        let mut detached = Vec::new();
        attached.retain(|_, a| {
            a.holders.remove(&id);
            if a.holders.is_empty() {
                detached.push(std::mem::take(&mut a.links));
                false
            } else {
                true
            }
        });
        drop(shared);
        // Detaching waits for an RCU grace period per probe: outside the lock.
        drop(detached);
    }
}

/// The owner thread's body: loads the programs (best probe mode first), reports the map
/// handles, then answers attach requests and drains process notifications until stopped.
fn run_owner(
    opts: &EbpfHeapOptions,
    config: &SamplerConfig,
    tracker: &ProcessTracker,
    requests: &mpsc::Receiver<AttachRequest>,
    ready: &sampler_thread::Ready<(Maps, ProbeMode)>,
    stop: &sampler_thread::Waker,
) {
    let mut objects: [MaybeUninit<libbpf_rs::OpenObject>; 3] = [const { MaybeUninit::uninit() }; 3];
    let [session_object, multi_object, classic_object] = &mut objects;
    let u = tracker.unwinder().map(|u| &**u);
    // Best first: session uprobes (Linux 6.13+: no return trap for unsampled calls), then
    // uprobe_multi links (6.6+), then perf-event uprobes. The two link-based modes need only
    // CAP_BPF and CAP_PERFMON; perf-event uprobes need CAP_SYS_ADMIN on kernels carrying the
    // fix of CVE-2025-38466 (probed: `heap_ebpf_refusal` refuses before this point when they
    // are denied).
    // The kernel's BTF says which link types exist (KernelFeatures); a load that fails
    // anyway falls through to the next mode.
    let features = KernelFeatures::get();
    let loaded = if opts.force_classic_uprobes {
        load(classic_object, opts, config, ProbeMode::Classic, u).map(|s| (s, ProbeMode::Classic))
    } else if let Some(skel) = features
        .uprobe_session
        .found
        .then(|| load(session_object, opts, config, ProbeMode::Session, u).ok())
        .flatten()
    {
        Ok((skel, ProbeMode::Session))
    } else if let Some(skel) = features
        .uprobe_multi
        .found
        .then(|| load(multi_object, opts, config, ProbeMode::Multi, u).ok())
        .flatten()
    {
        Ok((skel, ProbeMode::Multi))
    } else {
        load(classic_object, opts, config, ProbeMode::Classic, u).map(|s| (s, ProbeMode::Classic))
    };
    let (skel, mode) = match loaded {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let setup = || -> Result<(Link, Maps, libbpf_rs::RingBuffer<'static>)> {
        let exec = skel
            .progs
            .ff_proc_on_exec
            .attach()
            .map_err(|e| CaptureError::bpf("attaching the exec tracepoint", e))?;
        let maps = map_handles(&skel)?;
        let events = MapHandle::try_from(&skel.maps.proc_events)
            .map_err(|e| CaptureError::bpf("duplicating heap map proc_events", e))?;
        let rb = tracker.event_ring(&events)?;
        Ok((exec, maps, rb))
    };
    let (exec, maps, rb) = match setup() {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if ready.send(Ok((maps, mode))).is_err() {
        return;
    }
    // Sleeps until an attach request is kicked in, the ring has process notifications, or
    // the sampler stops: no periodic wakeups.
    while stop.wait(Some(rb.epoll_fd()), None) == sampler_thread::Woken::Look {
        while let Ok(req) = requests.try_recv() {
            let mut links = Vec::new();
            let result = attach_binary(mode, &skel, &req.binary, &mut links).map(|n| (links, n));
            // The capture that asked may have gone: its links then detach here.
            let _ = req.reply.send(result);
        }
        let _ = rb.consume();
    }
    drop(rb);
    drop(exec);
    drop(skel);
}

/// Alloc counters (count, bytes) of `heap_agg` rows of the given target indices.
pub(crate) fn read_alloc_counters(
    agg: &MapHandle,
    own: &HashSet<u32>,
) -> Result<Vec<(types::heap_agg_key, (u64, u64))>> {
    let mut out = Vec::new();
    for raw in agg.keys() {
        let Some(key) = from_bytes::<types::heap_agg_key>(&raw) else {
            continue;
        };
        if !own.contains(&key.target) {
            continue;
        }
        let val = agg
            .lookup(&raw, MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading the heap aggregation map", e))?
            .and_then(|v| from_bytes::<types::heap_agg_val>(&v));
        if let Some(v) = val {
            out.push((key, (v.alloc_count, v.alloc_bytes)));
        }
    }
    Ok(out)
}

/// Removes stacks that neither an aggregation row nor a live allocation refers to, so the
/// stack maps hold only what running captures can read (see the CPU sampler's twin).
fn drop_unreferenced_stacks(maps: &Maps) {
    let mut user: HashSet<u64> = HashSet::new();
    for raw in maps.heap_agg.keys() {
        if let Some(k) = from_bytes::<types::heap_agg_key>(&raw) {
            user.insert(k.user_stack);
        }
    }
    stack_maps::delete_keys_not_in(&maps.user_stacks, &user);
}

fn map_handles(skel: &HeapSkel<'_>) -> Result<Maps> {
    let handle = |m: &libbpf_rs::MapMut<'_>, what: &str| {
        MapHandle::try_from(m)
            .map_err(|e| CaptureError::bpf(format!("duplicating heap map {what}"), e))
    };
    Ok(Maps {
        targets: handle(&skel.maps.targets, "targets")?,
        generation: handle(&skel.maps.target_generation, "target_generation")?,
        heap_agg: handle(&skel.maps.heap_agg, "heap_agg")?,
        heap_live: handle(&skel.maps.heap_live, "heap_live")?,
        user_stacks: handle(&skel.maps.user_stacks, "user_stacks")?,
        heap_stats: handle(&skel.maps.heap_stats, "heap_stats")?,
        unwind_stats: handle(&skel.maps.unwind_stats, "unwind_stats")?,
    })
}

/// Opens, sizes and loads the heap programs for `mode`.
fn load<'obj>(
    open_object: &'obj mut MaybeUninit<libbpf_rs::OpenObject>,
    opts: &EbpfHeapOptions,
    config: &SamplerConfig,
    mode: ProbeMode,
    unwinder: Option<&Unwinder>,
) -> Result<HeapSkel<'obj>> {
    let mut open = HeapSkelBuilder::default()
        .open(open_object)
        .map_err(|e| CaptureError::bpf("opening the heap BPF object", e))?;
    open.progs
        .malloc_session
        .set_autoload(mode == ProbeMode::Session);
    if mode != ProbeMode::Classic {
        for prog in [
            &mut open.progs.malloc_enter,
            &mut open.progs.calloc_enter,
            &mut open.progs.realloc_enter,
            &mut open.progs.memalign_enter,
            &mut open.progs.posix_memalign_enter,
            &mut open.progs.free_enter,
            &mut open.progs.alloc_exit,
        ] {
            prog.set_attach_type(libbpf_rs::ProgramAttachType::TraceUprobeMulti);
        }
    }
    let table = sampling::gap_table(opts.sample_bytes, GAP_TABLE_SIZE);
    let rodata =
        open.maps
            .rodata_data
            .as_deref_mut()
            .ok_or_else(|| CaptureError::KernelFeature {
                feature: "BPF global data".into(),
                detail:
                    "the heap program's read-only data section is not mmapable; need Linux 5.2+"
                        .into(),
            })?;
    rodata.gap_table.copy_from_slice(&table);
    rodata.cfi_unwind = unwinder.is_some();
    rodata.ff_stack_seed = stack_maps::seed();
    // Uprobe programs can be preempted: the walk's scratch is per thread, and the per-CPU
    // row cache, which such walks skip, is not created.
    rodata.ff_unwind_per_task = true;
    let cache = crate::capture::target_cache_enabled(config);
    rodata.ff_cgrp_cache = cache;
    open.maps
        .target_cache
        .set_autocreate(cache)
        .map_err(|e| CaptureError::bpf("configuring the heap target cache", e))?;
    open.maps
        .unwind_row_cache
        .set_autocreate(false)
        .map_err(|e| CaptureError::bpf("configuring the heap unwind row cache", e))?;
    match unwinder {
        Some(u) => u.share_maps(&mut open.maps.unwind_tables, &mut open.maps.unwind_procs)?,
        None => {
            for map in [&mut open.maps.unwind_tables, &mut open.maps.unwind_procs] {
                map.set_max_entries(1)
                    .map_err(|e| CaptureError::bpf("sizing a heap map", e))?;
            }
        }
    }
    for (map, n) in [
        (&mut open.maps.targets, config.max_targets),
        (&mut open.maps.heap_live, config.max_heap_live),
        (&mut open.maps.heap_agg, config.max_heap_rows),
        (&mut open.maps.user_stacks, config.max_heap_stacks),
    ] {
        map.set_max_entries(n.max(1))
            .map_err(|e| CaptureError::bpf("sizing a heap map", e))?;
    }
    CaptureError::load("loading the heap BPF programs", || open.load())
}

/// Attaches the probes of one allocator binary into `links`; the number of probes.
fn attach_binary(
    mode: ProbeMode,
    skel: &HeapSkel<'_>,
    bin: &AllocatorBinary,
    links: &mut Vec<Link>,
) -> Result<usize> {
    let mut probes = 0;
    for ep in &bin.entry_points {
        let what = || {
            let kind = if mode == ProbeMode::Classic {
                "a perf-event uprobe"
            } else {
                "a uprobe"
            };
            format!("attaching {kind} to {} in {}", ep.symbol, bin.name)
        };
        if mode == ProbeMode::Session && ep.kind == EntryKind::Malloc {
            let opts = libbpf_rs::UprobeMultiOpts {
                offsets: vec![ep.probe_offset as usize],
                session: true,
                ..Default::default()
            };
            let link = skel
                .progs
                .malloc_session
                .attach_uprobe_multi_with_opts(-1, &bin.path, "", opts)
                .map_err(|e| CaptureError::bpf(what(), e))?;
            links.push(link);
            probes += 1;
            continue;
        }
        let prog = match ep.kind {
            EntryKind::Malloc => &skel.progs.malloc_enter,
            EntryKind::Calloc => &skel.progs.calloc_enter,
            EntryKind::Realloc => &skel.progs.realloc_enter,
            EntryKind::Memalign => &skel.progs.memalign_enter,
            EntryKind::PosixMemalign => &skel.progs.posix_memalign_enter,
            EntryKind::Free => &skel.progs.free_enter,
        };
        let attach = |p: &libbpf_rs::ProgramMut<'_>, ret: bool| {
            if mode == ProbeMode::Classic {
                p.attach_uprobe(ret, -1, &bin.path, ep.probe_offset as usize)
            } else {
                let opts = libbpf_rs::UprobeMultiOpts {
                    offsets: vec![ep.probe_offset as usize],
                    retprobe: ret,
                    ..Default::default()
                };
                p.attach_uprobe_multi_with_opts(-1, &bin.path, "", opts)
            }
            .map_err(|e| CaptureError::bpf(what(), e))
        };
        links.push(attach(prog, false)?);
        if ep.kind.allocates() {
            links.push(attach(&skel.progs.alloc_exit, true)?);
        }
        probes += 1 + usize::from(ep.kind.allocates());
    }
    Ok(probes)
}
