//! Heap profiles from eBPF allocation sampling: uprobes on the allocators of
//! the target cgroups' processes (`bpf/heap.bpf.c`), byte-based sampling in
//! the kernel, aggregation per (target, process, stack, size class), and a
//! pprof in Go's heap layout, scaled back up like Go's.
//!
//! Probes attach by binary path with pid = -1: every process mapping that
//! allocator is covered, including processes started during the capture; the
//! BPF programs keep only target cgroups. The capture rescans the targets'
//! processes every [`EbpfHeapOptions::rescan`] for allocators not yet probed
//! (a new container image, a `dlopen`ed jemalloc).
//!
//! Stacks are walked with the node's CFI unwind tables ([`crate::unwind`],
//! shared with the CPU sampler), so allocation sites in code built without
//! frame pointers keep their callers.
//!
//! What the profile means: `alloc_*` counts allocations made during the
//! capture; `inuse_*` those of them still live at its end. Allocations made
//! before the capture started are not seen (use the endpoint source for a
//! process's whole heap).

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::{Link, MapCore as _, MapFlags};

use super::allocators::{AllocatorBinary, AllocatorFinder, EntryKind};
use super::sampling;
use crate::bpf::heap::types;
use crate::bpf::heap::{HeapSkel, HeapSkelBuilder};
use crate::bpf::{Pod, from_bytes};
use crate::capture::{CaptureError, CaptureTarget, Result, check_btf, target_labels};
use crate::pprof::{Label, ProfileBuilder};
use crate::symbolize::{ProcessCatalog, StackSymbolizer};
use crate::unwind::{UnwindConfig, Unwinder, WalkStats};
use flamefleet_proto::pprof::Profile;

// SAFETY: generated from BTF of plain C structs of integers and arrays.
unsafe impl Pod for types::heap_agg_key {}
unsafe impl Pod for types::heap_agg_val {}
unsafe impl Pod for types::ff_proc_event {}

/// Number of entries in the exponential gap table (`HEAP_GAP_TABLE_SIZE`).
const GAP_TABLE_SIZE: usize = 4096;
/// Frames kept per stack by the stack map (its value size in the BPF source).
const MAX_FRAMES: usize = 127;

/// Settings of one eBPF heap capture.
#[derive(Debug, Clone)]
pub struct EbpfHeapOptions {
    /// How long to sample.
    pub duration: Duration,
    /// Mean bytes between samples (`heap.sampleBytes`); 0 samples every allocation.
    pub sample_bytes: u64,
    /// Live sampled allocations tracked at once (beyond: counted as drops).
    pub max_live: u32,
    /// Aggregation rows (targets × processes × stacks × size classes).
    pub max_rows: u32,
    /// Distinct stacks.
    pub max_stacks: u32,
    /// How often to look for allocators not yet probed.
    pub rescan: Duration,
    /// The node name put in the `node` label.
    pub node: String,
    /// Use classic entry + return probes even where session uprobes exist
    /// (what kernels before 6.13 get; tests cover both paths with it).
    pub force_classic_uprobes: bool,
    /// Walk the cgroup ancestry on every call instead of caching the result
    /// (what kernels before 6.2 get).
    pub no_target_cache: bool,
    /// Walk stacks with CFI tables (code without frame pointers); `false`
    /// keeps the kernel's frame-pointer walk.
    pub cfi_unwind: bool,
    /// Limits of the unwind tables, when no sampler of the node has created
    /// them yet (they are shared: the running ones are used as they are).
    pub unwind: UnwindConfig,
    /// Told once the probes are attached to the allocators of the targets'
    /// processes running at the start (allocations from then on are seen).
    pub ready: Option<std::sync::mpsc::SyncSender<()>>,
    /// Refuse when the first window projects more uprobe overhead than this
    /// (percent of the targets' CPU time); 0 turns the guard off.
    pub max_overhead_percent: f64,
    /// Capture even above `max_overhead_percent`.
    pub force: bool,
    /// Length of the first window that measures the allocation rate.
    pub overhead_window: Duration,
}

impl Default for EbpfHeapOptions {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(10),
            sample_bytes: sampling::DEFAULT_SAMPLE_BYTES,
            // 64 Ki live samples stand for 32 GiB of live heap at 512 KiB.
            max_live: 65536,
            max_rows: 16384,
            max_stacks: 16384,
            rescan: Duration::from_millis(500),
            node: String::new(),
            force_classic_uprobes: false,
            no_target_cache: false,
            cfi_unwind: true,
            unwind: UnwindConfig::default(),
            ready: None,
            max_overhead_percent: super::overhead::DEFAULT_MAX_OVERHEAD_PERCENT,
            force: false,
            overhead_window: Duration::from_millis(300),
        }
    }
}

/// Counters of one capture, reported with the profile; drops are never silent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EbpfHeapStats {
    /// Allocation calls made by target threads.
    pub calls: u64,
    /// Sampled allocations recorded.
    pub sampled: u64,
    /// Sampled allocations seen freed.
    pub freed: u64,
    /// Sampled allocations whose frees could not be tracked (live map full).
    pub dropped_live_full: u64,
    /// Samples lost to a full aggregation map.
    pub dropped_rows_full: u64,
    /// Samples whose stack was lost (stack map collision or full).
    pub dropped_stacks: u64,
    /// Calls not sampled for lack of per-thread state.
    pub dropped_thread_state: u64,
    /// Process notifications lost (ring buffer full).
    pub dropped_notifications: u64,
    /// Allocator binaries probed (paths inside the processes' namespaces).
    pub allocators: Vec<String>,
    /// Uprobes attached.
    pub probes: usize,
    /// Whether malloc-like entry points used session uprobes (Linux 6.13+),
    /// which skip the return trap for unsampled calls.
    pub session_uprobes: bool,
    /// How sampled stacks were walked (`None`: frame pointers only).
    pub walk: Option<WalkStats>,
    /// Uprobe overhead projected from the first window, in hundredths of a
    /// percent of the targets' CPU time (`None` when the guard was off).
    pub projected_overhead_basis_points: Option<u64>,
}

/// Runs one eBPF heap capture of `targets` and returns the profile.
pub fn capture(
    targets: &[CaptureTarget],
    opts: &EbpfHeapOptions,
) -> Result<(Profile, EbpfHeapStats)> {
    if targets.is_empty() {
        return Err(CaptureError::InvalidOptions(
            "no target cgroup given".into(),
        ));
    }
    if opts.duration.is_zero() {
        return Err(CaptureError::InvalidOptions(
            "duration must be positive, found 0".into(),
        ));
    }
    check_btf()?;
    let started = SystemTime::now();
    // The node's unwind tables, shared with the CPU sampler.
    let unwinder = if opts.cfi_unwind {
        Some(Unwinder::shared(&opts.unwind)?)
    } else {
        None
    };
    let mut objects: [MaybeUninit<libbpf_rs::OpenObject>; 3] = [
        MaybeUninit::uninit(),
        MaybeUninit::uninit(),
        MaybeUninit::uninit(),
    ];
    let [session_object, multi_object, classic_object] = &mut objects;
    // Best first: session uprobes (Linux 6.13+: no return trap for unsampled calls), then
    // uprobe_multi links (6.6+), then perf-event uprobes. The two link-based modes need only
    // CAP_BPF and CAP_PERFMON; perf-event uprobes need CAP_SYS_ADMIN on recent kernels.
    let (skel, mode) = if opts.force_classic_uprobes {
        (
            load(
                classic_object,
                opts,
                ProbeMode::Classic,
                unwinder.as_deref(),
            )?,
            ProbeMode::Classic,
        )
    } else if let Ok(skel) = load(
        session_object,
        opts,
        ProbeMode::Session,
        unwinder.as_deref(),
    ) {
        (skel, ProbeMode::Session)
    } else if let Ok(skel) = load(multi_object, opts, ProbeMode::Multi, unwinder.as_deref()) {
        (skel, ProbeMode::Multi)
    } else {
        (
            load(
                classic_object,
                opts,
                ProbeMode::Classic,
                unwinder.as_deref(),
            )?,
            ProbeMode::Classic,
        )
    };
    let session = mode == ProbeMode::Session;
    for (i, t) in targets.iter().enumerate() {
        let value = types::ff_target {
            index: i as u32 + 1,
            flags: 0,
        };
        // The kernel covers the cgroup's descendants (a pod's containers), live.
        skel.maps
            .targets
            .update(
                &t.cgroup.id.to_ne_bytes(),
                crate::bpf::as_bytes(&value),
                MapFlags::ANY,
            )
            .map_err(|e| CaptureError::bpf("adding a cgroup to the heap target map", e))?;
    }
    skel.maps
        .target_generation
        .update(&0u32.to_ne_bytes(), &1u64.to_ne_bytes(), MapFlags::ANY)
        .map_err(|e| CaptureError::bpf("publishing the heap target map", e))?;
    let catalog = ProcessCatalog::new();
    let mut stats = EbpfHeapStats {
        session_uprobes: session,
        ..EbpfHeapStats::default()
    };
    // Tables of the processes running now, before their first sample.
    let mut known = HashSet::new();
    register_new_processes(&unwinder, &catalog, targets, &mut known, true);
    let rows = {
        let mut links: Vec<Link> = Vec::new();
        links.push(
            skel.progs
                .heap_on_exec
                .attach()
                .map_err(|e| CaptureError::bpf("attaching the exec tracepoint", e))?,
        );
        let mut attacher = Attacher {
            mode,
            ..Attacher::default()
        };
        attacher.rescan(&skel, targets, &mut links, &mut stats)?;
        let events = catalog.clone();
        let mut rb = libbpf_rs::RingBufferBuilder::new();
        let events_unwinder = unwinder.clone();
        rb.add(&skel.maps.proc_events, move |data: &[u8]| {
            if let Some(ev) = from_bytes::<types::ff_proc_event>(data) {
                events.snapshot(ev.tgid);
                if let (Some(u), Some(maps)) = (&events_unwinder, events.lookup(ev.tgid)) {
                    u.register(ev.tgid, maps);
                }
            }
            0
        })
        .map_err(|e| CaptureError::bpf("opening the process ring buffer", e))?;
        let rb = rb
            .build()
            .map_err(|e| CaptureError::bpf("opening the process ring buffer", e))?;
        guard_overhead(&skel, targets, opts, &mut stats)?;
        if let Some(ready) = &opts.ready {
            // The receiver may have gone: nothing to tell then.
            let _ = ready.try_send(());
        }
        let deadline = Instant::now() + opts.duration;
        let mut next_rescan = Instant::now() + opts.rescan;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            // Poll errors are EINTR at worst; the loop goes on to the deadline.
            let _ = rb.poll(left.min(Duration::from_millis(100)));
            if Instant::now() >= next_rescan {
                attacher.rescan(&skel, targets, &mut links, &mut stats)?;
                register_new_processes(&unwinder, &catalog, targets, &mut known, false);
                next_rescan = Instant::now() + opts.rescan;
            }
        }
        let _ = rb.consume();
        // Read while every probe is still attached: detaching is not atomic
        // (each uprobe waits for an RCU grace period, tens of milliseconds on
        // a loaded machine), and while `malloc`'s probe is gone but `free`'s
        // is not, a process that frees and allocates in a loop would have all
        // its live samples retired — an empty inuse_space, seen once in CI.
        read_stats(&skel, &mut stats)?;
        if unwinder.is_some() {
            stats.walk = Some(WalkStats::read(&skel.maps.unwind_stats));
        }
        let rows = read_rows(&skel, opts.sample_bytes)?;
        drop(links);
        rows
    };
    let duration = started.elapsed().unwrap_or(opts.duration);
    let profile = build_profile(
        &skel, rows, targets, opts, &catalog, started, duration, &stats,
    );
    Ok((profile, stats))
}

/// CPU time the targets' cgroups (with their descendants) have used so far.
fn targets_cpu(targets: &[CaptureTarget]) -> Duration {
    let usec: u64 = targets
        .iter()
        .filter_map(|t| std::fs::read_to_string(t.cgroup.path.join("cpu.stat")).ok())
        .filter_map(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum();
    Duration::from_micros(usec)
}

/// The first window of the overhead guard (see [`super::overhead`]): with
/// every probe attached, counts the targets' allocator calls and their CPU
/// time, and refuses the capture when the projected trap cost is above
/// `max_overhead_percent` (unless forced). The projection goes in `stats`.
fn guard_overhead(
    skel: &HeapSkel<'_>,
    targets: &[CaptureTarget],
    opts: &EbpfHeapOptions,
    stats: &mut EbpfHeapStats,
) -> Result<()> {
    if opts.max_overhead_percent <= 0.0 || opts.overhead_window.is_zero() {
        return Ok(());
    }
    read_stats(skel, stats)?;
    let (calls0, cpu0, t0) = (stats.calls, targets_cpu(targets), Instant::now());
    std::thread::sleep(opts.overhead_window);
    read_stats(skel, stats)?;
    let projection = super::overhead::project(
        stats.calls.saturating_sub(calls0),
        t0.elapsed(),
        targets_cpu(targets).saturating_sub(cpu0),
        super::overhead::UPROBE_CALL_COST,
    );
    stats.projected_overhead_basis_points = Some(
        (projection.overhead_percent * 100.0)
            .round()
            .min(u64::MAX as f64) as u64,
    );
    if projection.refuses(opts.max_overhead_percent) && !opts.force {
        return Err(CaptureError::InvalidOptions(
            projection.refusal(opts.max_overhead_percent),
        ));
    }
    Ok(())
}

/// Hands the unwinder the targets' processes not seen yet (`known`), so their
/// stacks unwind with CFI from their first samples: on the caller's thread
/// for up to 300 ms when `now` (a capture's start), queued otherwise.
fn register_new_processes(
    unwinder: &Option<Arc<Unwinder>>,
    catalog: &ProcessCatalog,
    targets: &[CaptureTarget],
    known: &mut HashSet<u32>,
    now: bool,
) {
    let Some(u) = unwinder else { return };
    let mut new = Vec::new();
    for t in targets {
        for pid in t.cgroup.procs_recursive().unwrap_or_default() {
            if known.insert(pid) && catalog.snapshot(pid) {
                new.extend(catalog.lookup(pid).map(|maps| (pid, maps)));
            }
        }
    }
    if now {
        u.register_now(new, Duration::from_millis(300));
    } else {
        for (pid, maps) in new {
            u.register(pid, maps);
        }
    }
}

/// How uprobes are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum ProbeMode {
    /// malloc-like entry points as session uprobes, the others as uprobe_multi links
    /// (Linux 6.13+).
    Session,
    /// Every entry and return probe as a uprobe_multi link (Linux 6.6+).
    Multi,
    /// Perf-event uprobes (any kernel; CAP_SYS_ADMIN on recent ones).
    #[default]
    Classic,
}

/// Opens, sizes and loads the heap programs for `mode`.
fn load<'obj>(
    open_object: &'obj mut MaybeUninit<libbpf_rs::OpenObject>,
    opts: &EbpfHeapOptions,
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
    let cache = !opts.no_target_cache && crate::capture::target_cache_supported();
    rodata.ff_cgrp_cache = cache;
    open.maps
        .target_cache
        .set_autocreate(cache)
        .map_err(|e| CaptureError::bpf("configuring the heap target cache", e))?;
    // The stack map the configured walk does not use keeps one entry.
    let (fp_stacks, cfi_stacks) = match unwinder {
        Some(u) => {
            u.share_maps(&mut open.maps.unwind_tables, &mut open.maps.unwind_procs)?;
            (1, opts.max_stacks)
        }
        None => {
            for map in [&mut open.maps.unwind_tables, &mut open.maps.unwind_procs] {
                map.set_max_entries(1)
                    .map_err(|e| CaptureError::bpf("sizing a heap map", e))?;
            }
            (opts.max_stacks, 1)
        }
    };
    for (map, n) in [
        (&mut open.maps.heap_live, opts.max_live),
        (&mut open.maps.heap_agg, opts.max_rows),
        (&mut open.maps.heap_stacks, fp_stacks),
        (&mut open.maps.user_stacks, cfi_stacks),
    ] {
        map.set_max_entries(n.max(1))
            .map_err(|e| CaptureError::bpf("sizing a heap map", e))?;
    }
    open.load().map_err(|e| {
        let err = CaptureError::bpf("loading the heap BPF programs", e);
        match err {
            CaptureError::Bpf { action, source } => CaptureError::KernelFeature {
                feature: "uprobes with BPF task storage".into(),
                detail: format!(
                    "{action} failed ({source}); need Linux 5.11+ with BTF, and CAP_BPF + CAP_PERFMON"
                ),
            },
            other => other,
        }
    })
}

/// Attaches probes to allocator binaries found in the targets' processes,
/// once per binary (inode).
#[derive(Default)]
struct Attacher {
    /// How to attach.
    mode: ProbeMode,
    finder: AllocatorFinder,
    attached: HashSet<(u64, u64)>,
}

impl Attacher {
    fn rescan(
        &mut self,
        skel: &HeapSkel<'_>,
        targets: &[CaptureTarget],
        links: &mut Vec<Link>,
        stats: &mut EbpfHeapStats,
    ) -> Result<()> {
        for t in targets {
            // A target whose processes all exited is simply empty.
            for pid in t.cgroup.procs_recursive().unwrap_or_default() {
                for bin in self.finder.allocators_of(pid) {
                    if !self.attached.insert(bin.dev_ino) {
                        continue;
                    }
                    // This binary's links, kept only when all of them attach.
                    let mut bin_links = Vec::new();
                    let attached = Self::attach_binary(self.mode, skel, &bin, &mut bin_links);
                    match attached {
                        Ok(probes) => {
                            links.append(&mut bin_links);
                            stats.probes += probes;
                            stats.allocators.push(bin.name.clone());
                        }
                        // The process exited between being listed and its probes attaching
                        // (its `/proc/<pid>/root/...` path went with it): nothing to probe
                        // there; another process of the same binary may bring it back.
                        Err(_) if !bin.path.exists() => {
                            drop(bin_links);
                            self.attached.remove(&bin.dev_ino);
                            tracing::debug!(pid, binary = %bin.name, "process exited before its allocator probes attached; skipped");
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Ok(())
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
            let what = || format!("attaching a uprobe to {} in {}", ep.symbol, bin.name);
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
}

fn read_stats(skel: &HeapSkel<'_>, stats: &mut EbpfHeapStats) -> Result<()> {
    let mut totals = [0u64; 8];
    for (i, total) in totals.iter_mut().enumerate() {
        let per_cpu = skel
            .maps
            .heap_stats
            .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading the heap counters", e))?
            .unwrap_or_default();
        *total = per_cpu.iter().filter_map(|v| from_bytes::<u64>(v)).sum();
    }
    stats.calls = totals[0];
    stats.sampled = totals[1];
    stats.freed = totals[2];
    stats.dropped_live_full = totals[3];
    stats.dropped_rows_full = totals[4];
    stats.dropped_stacks = totals[5];
    stats.dropped_thread_state = totals[6];
    stats.dropped_notifications = totals[7];
    Ok(())
}

/// Scaled values of one (target, process, stack): alloc objects, alloc
/// bytes, in-use objects, in-use bytes.
type Row = [f64; 4];

/// Aggregation rows by (target, process, stack ID, CFI stack key).
type Rows = HashMap<(u32, u32, i32, u64), Row>;

/// The aggregation rows, scaled, summed over size classes.
fn read_rows(skel: &HeapSkel<'_>, rate: u64) -> Result<Rows> {
    let mut rows: Rows = HashMap::new();
    for key_bytes in skel.maps.heap_agg.keys() {
        let Some(key) = from_bytes::<types::heap_agg_key>(&key_bytes) else {
            continue;
        };
        let val = skel
            .maps
            .heap_agg
            .lookup(&key_bytes, MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading the heap aggregation map", e))?
            .and_then(|v| from_bytes::<types::heap_agg_val>(&v));
        let Some(val) = val else { continue };
        let (ac, ab) = sampling::scale(val.alloc_count, val.alloc_bytes, rate);
        let (ic, ib) = sampling::scale(val.inuse_count, val.inuse_bytes, rate);
        let row = rows
            .entry((key.target, key.tgid, key.stack_id, key.user_stack))
            .or_default();
        row[0] += ac;
        row[1] += ab;
        row[2] += ic;
        row[3] += ib;
    }
    Ok(rows)
}

#[allow(clippy::too_many_arguments)]
fn build_profile(
    skel: &HeapSkel<'_>,
    rows: Rows,
    targets: &[CaptureTarget],
    opts: &EbpfHeapOptions,
    catalog: &ProcessCatalog,
    started: SystemTime,
    duration: Duration,
    stats: &EbpfHeapStats,
) -> Profile {
    let rate = opts.sample_bytes;
    let mut b = ProfileBuilder::new(&[
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]);
    b.period("space", "bytes", rate as i64)
        .default_sample_type("inuse_space")
        .time(
            started
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i64),
            duration.as_nanos() as i64,
        )
        .comment(&format!(
            "flamefleet eBPF heap sampling, one sample per {rate} bytes on average; \
             alloc_* = allocations during the capture, inuse_* = those still live at its end"
        ));
    let mut symbolizer = StackSymbolizer::new(catalog.clone());
    let mut sorted: Vec<_> = rows.into_iter().collect();
    sorted.sort_by_key(|(k, _)| *k);
    let mut comms: HashMap<u32, String> = HashMap::new();
    for ((target, tgid, stack_id, user_stack), row) in sorted {
        let Some(t) = targets.get((target as usize).wrapping_sub(1)) else {
            continue;
        };
        let stack = read_stack(skel, stack_id, user_stack);
        let frames = symbolizer.user_frames(&mut b, tgid, &stack);
        let comm = comms
            .entry(tgid)
            .or_insert_with(|| {
                std::fs::read_to_string(format!("/proc/{tgid}/comm"))
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default()
            })
            .clone();
        let mut labels = target_labels(Some(t), &opts.node);
        labels.push(Label::Num("pid".into(), i64::from(tgid), String::new()));
        if !comm.is_empty() {
            labels.push(Label::Str("comm".into(), comm));
        }
        let values: Vec<i64> = row.iter().map(|v| v.round() as i64).collect();
        symbolizer.account(&frames, values[0].max(1) as u64);
        b.add_sample(&frames, &values, &labels);
    }
    b.comment(&symbolizer.stats.quality_comment("allocations"));
    if let Some(w) = &stats.walk {
        b.comment(&w.comment());
    }
    b.build()
}

/// The user stack `id` of `heap_stacks`, or `user_stack` of `user_stacks`
/// when not 0 (leaf first); empty when it was not captured.
fn read_stack(skel: &HeapSkel<'_>, id: i32, user_stack: u64) -> Vec<u64> {
    let bytes = if user_stack != 0 {
        skel.maps
            .user_stacks
            .lookup(&user_stack.to_ne_bytes(), MapFlags::ANY)
    } else {
        let Ok(id) = u32::try_from(id) else {
            return Vec::new();
        };
        skel.maps
            .heap_stacks
            .lookup(&id.to_ne_bytes(), MapFlags::ANY)
    };
    let bytes = bytes.ok().flatten().unwrap_or_default();
    bytes
        .chunks_exact(8)
        .take(MAX_FRAMES)
        .filter_map(|c| c.try_into().ok().map(u64::from_ne_bytes))
        .take_while(|&a| a != 0)
        .collect()
}
