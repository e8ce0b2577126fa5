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
//!
//! The programs and probes are the node's one [`super::sampler::HeapSampler`],
//! shared by concurrent captures: a capture adds its targets to it, holds the
//! probes of the allocators its targets use, and reads only its own counts.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::allocators::AllocatorFinder;
use super::sampler::{self, HeapSampler, JoinedCapture};
use super::sampling;
use crate::bpf::heap::types;
use crate::bpf::{Pod, from_bytes};
use crate::capture::{CaptureError, CaptureTarget, Result, stack_maps, target_labels};
use crate::pprof::{Label, ProfileBuilder};
use crate::symbolize::{ProcessCatalog, StackSymbolizer};
use crate::unwind::{UnwindConfig, Unwinder, WalkStats};
use flamefleet_proto::pprof::Profile;

// SAFETY: generated from BTF of plain C structs of integers and arrays.
unsafe impl Pod for types::heap_agg_key {}
unsafe impl Pod for types::heap_agg_val {}
unsafe impl Pod for types::heap_live_val {}
unsafe impl Pod for types::ff_proc_event {}

/// Settings of one eBPF heap capture.
#[derive(Debug, Clone)]
pub struct EbpfHeapOptions {
    /// How long to sample.
    pub duration: Duration,
    /// Mean bytes between samples (`heap.sampleBytes`); 0 samples every allocation.
    /// The node's sampler runs at its first capture's rate: a capture joining it samples
    /// at that rate and says so ([`EbpfHeapStats::sample_bytes`]).
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

/// Counters of one capture, reported with the profile; drops are never silent. The call,
/// sample and drop counters are the node's sampler's over the capture's window (all
/// captures running then: their maps are shared).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EbpfHeapStats {
    /// The sampling rate in effect (the node sampler's, set by its first capture; it can
    /// differ from the rate this capture asked for).
    pub sample_bytes: u64,
    /// Other captures sharing the sampler when this one started.
    pub shared_with: usize,
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
    /// Allocator binaries probed for this capture (paths inside the processes'
    /// namespaces), whether it attached them or joined probes already attached.
    pub allocators: Vec<String>,
    /// Uprobes on those binaries.
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

/// Runs one eBPF heap capture of `targets` on the node's heap sampler and returns the
/// profile.
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
    let started = SystemTime::now();
    let joined = sampler::join(targets, opts)?;
    let capture = Capture(joined);
    let s = Arc::clone(&capture.0.sampler);
    let settings = s.settings();
    let unwinder = s.unwinder().cloned();
    let mut stats = EbpfHeapStats {
        sample_bytes: settings.sample_bytes,
        shared_with: s.captures().saturating_sub(1),
        session_uprobes: settings.session_uprobes,
        ..EbpfHeapStats::default()
    };
    let (stats_before, walk_before) = {
        let shared = s.lock();
        (
            read_counters(&shared.maps.heap_stats)?,
            WalkStats::read(&shared.maps.unwind_stats),
        )
    };
    // Tables of the processes running now, before their first sample.
    let mut known = HashSet::new();
    register_new_processes(&unwinder, s.catalog(), targets, &mut known, true);
    let mut finder = AllocatorFinder::default();
    hold_allocators(&capture.0, &mut finder, targets, &mut stats)?;
    guard_overhead(&s, targets, opts, &mut stats)?;
    if let Some(ready) = &opts.ready {
        // The receiver may have gone: nothing to tell then.
        let _ = ready.try_send(());
    }
    let deadline = Instant::now() + opts.duration;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        std::thread::sleep(left.min(opts.rescan.max(Duration::from_millis(10))));
        if Instant::now() < deadline {
            hold_allocators(&capture.0, &mut finder, targets, &mut stats)?;
            register_new_processes(&unwinder, s.catalog(), targets, &mut known, false);
        }
    }
    // Read while every probe this capture holds is still attached: detaching is not
    // atomic (each uprobe waits for an RCU grace period), and while `malloc`'s probe is
    // gone but `free`'s is not, a process that frees and allocates in a loop would have
    // all its live samples retired — an empty inuse_space, seen once in CI.
    let read = {
        let shared = s.lock();
        let now = read_counters(&shared.maps.heap_stats)?;
        apply_counters(&mut stats, now, stats_before);
        if unwinder.is_some() {
            stats.walk = Some(WalkStats::read(&shared.maps.unwind_stats).since(walk_before));
        }
        read_capture(&shared, &capture.0, settings.sample_bytes)?
    };
    drop(capture);
    let duration = started.elapsed().unwrap_or(opts.duration);
    let profile = build_profile(
        read,
        targets,
        opts,
        settings.sample_bytes,
        s.catalog(),
        started,
        duration,
        &stats,
    );
    Ok((profile, stats))
}

/// A capture joined to the node's sampler; leaves it (targets, probes) when dropped,
/// also on errors.
struct Capture(JoinedCapture);

impl Drop for Capture {
    fn drop(&mut self) {
        self.0.sampler.release(self.0.id, &self.0.cgroup_ids);
    }
}

/// Holds the probes of the allocators the targets' processes map that this capture does
/// not hold yet (attaching those no capture holds).
fn hold_allocators(
    capture: &JoinedCapture,
    finder: &mut AllocatorFinder,
    targets: &[CaptureTarget],
    stats: &mut EbpfHeapStats,
) -> Result<()> {
    for t in targets {
        // A target whose processes all exited is simply empty.
        for pid in t.cgroup.procs_recursive().unwrap_or_default() {
            for bin in finder.allocators_of(pid) {
                if capture.sampler.holds(capture.id, bin.dev_ino) {
                    continue;
                }
                match capture.sampler.hold_binary(capture.id, &bin) {
                    Ok(Some(probes)) => {
                        stats.probes += probes;
                        stats.allocators.push(bin.name.clone());
                    }
                    Ok(None) => {}
                    // The binary is held open from the moment it was found: its probes
                    // attach even if the process exited meanwhile.
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(())
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
/// The call counter is the shared sampler's: with other heap captures
/// running it also counts their targets' calls, so the projection errs high
/// (a refusal names the figure; `force` overrides it).
fn guard_overhead(
    sampler: &HeapSampler,
    targets: &[CaptureTarget],
    opts: &EbpfHeapOptions,
    stats: &mut EbpfHeapStats,
) -> Result<()> {
    if opts.max_overhead_percent <= 0.0 || opts.overhead_window.is_zero() {
        return Ok(());
    }
    let calls = || -> Result<u64> { Ok(read_counters(&sampler.lock().maps.heap_stats)?[0]) };
    let (calls0, cpu0, t0) = (calls()?, targets_cpu(targets), Instant::now());
    std::thread::sleep(opts.overhead_window);
    let projection = super::overhead::project(
        calls()?.saturating_sub(calls0),
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

/// Snapshots the maps of the targets' processes not seen yet (`known`) for symbolization
/// and hands them to the unwinder, so their stacks unwind with CFI from their first
/// samples: on the caller's thread for up to 300 ms when `now` (a capture's start), queued
/// otherwise. Done per capture: the node's sampler announces a process only on its first
/// sample ever, and a capture must not symbolize with a snapshot older than itself.
fn register_new_processes(
    unwinder: &Option<Arc<Unwinder>>,
    catalog: &ProcessCatalog,
    targets: &[CaptureTarget],
    known: &mut HashSet<u32>,
    now: bool,
) {
    let mut new = Vec::new();
    for t in targets {
        for pid in t.cgroup.procs_recursive().unwrap_or_default() {
            if known.insert(pid) && catalog.snapshot(pid) {
                new.extend(catalog.lookup(pid).map(|maps| (pid, maps)));
            }
        }
    }
    let Some(u) = unwinder else { return };
    if now {
        u.register_now(new, Duration::from_millis(300));
    } else {
        for (pid, maps) in new {
            u.register(pid, maps);
        }
    }
}

/// The sampler's counters (`enum heap_stat`), summed over CPUs.
fn read_counters(map: &MapHandle) -> Result<[u64; 8]> {
    let mut totals = [0u64; 8];
    for (i, total) in totals.iter_mut().enumerate() {
        let per_cpu = map
            .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| CaptureError::bpf("reading the heap counters", e))?
            .unwrap_or_default();
        *total = per_cpu.iter().filter_map(|v| from_bytes::<u64>(v)).sum();
    }
    Ok(totals)
}

/// Puts the increase of the counters from `before` to `now` in `stats`.
fn apply_counters(stats: &mut EbpfHeapStats, now: [u64; 8], before: [u64; 8]) {
    let d = |i: usize| now[i].saturating_sub(before[i]);
    stats.calls = d(0);
    stats.sampled = d(1);
    stats.freed = d(2);
    stats.dropped_live_full = d(3);
    stats.dropped_rows_full = d(4);
    stats.dropped_stacks = d(5);
    stats.dropped_thread_state = d(6);
    stats.dropped_notifications = d(7);
}

/// Scaled values of one (target, process, stack): alloc objects, alloc
/// bytes, in-use objects, in-use bytes.
type Row = [f64; 4];

/// Aggregation rows by (target position, process, user stack key).
type Rows = HashMap<(usize, u32, u64), Row>;

/// What a capture read from the sampler, before symbolization.
struct CaptureRead {
    rows: Rows,
    /// The stacks the rows refer to, by key, leaf first.
    stacks: HashMap<u64, Vec<u64>>,
}

/// This capture's rows: per size class, `alloc_*` is the increase of the row's counters
/// since the capture started and `inuse_*` the live sampled allocations made since then;
/// each is scaled (the bias correction depends on the size), then summed over size classes.
fn read_capture(
    shared: &sampler::Shared,
    capture: &JoinedCapture,
    rate: u64,
) -> Result<CaptureRead> {
    // Indices nested below a target (another capture's) count for it too.
    let target_of_index: HashMap<u32, usize> = shared
        .table
        .covered(&capture.cgroup_ids)
        .into_iter()
        .map(|(index, pos)| (index, capture.owner_of[pos]))
        .collect();
    let own: HashSet<u32> = target_of_index.keys().copied().collect();
    // Sampled (count, bytes) per aggregation key: allocated, in use.
    let mut sampled: HashMap<sampler::AggKey, [u64; 4]> = HashMap::new();
    for (key, (count, bytes)) in sampler::read_alloc_counters(&shared.maps.heap_agg, &own)? {
        let key = sampler::agg_key(&key);
        let (c0, b0) = capture.baseline.get(&key).copied().unwrap_or((0, 0));
        let e = sampled.entry(key).or_default();
        e[0] += count.saturating_sub(c0);
        e[1] += bytes.saturating_sub(b0);
    }
    for raw in shared.maps.heap_live.keys() {
        let Some(live) = shared
            .maps
            .heap_live
            .lookup(&raw, MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|v| from_bytes::<types::heap_live_val>(&v))
        else {
            continue;
        };
        if live.alloc_ns < capture.start_ns || !own.contains(&live.agg.target) {
            continue;
        }
        let e = sampled.entry(sampler::agg_key(&live.agg)).or_default();
        e[2] += 1;
        e[3] += live.size;
    }
    let mut rows: Rows = HashMap::new();
    let mut stacks = HashMap::new();
    for ((index, tgid, _size_class, user_stack), [ac, ab, ic, ib]) in sampled {
        let Some(&target) = target_of_index.get(&index) else {
            continue;
        };
        let (ac, ab) = sampling::scale(ac, ab, rate);
        let (ic, ib) = sampling::scale(ic, ib, rate);
        let row = rows.entry((target, tgid, user_stack)).or_default();
        row[0] += ac;
        row[1] += ab;
        row[2] += ic;
        row[3] += ib;
        stacks
            .entry(user_stack)
            .or_insert_with(|| stack_maps::read(&shared.maps.user_stacks, user_stack));
    }
    Ok(CaptureRead { rows, stacks })
}

#[allow(clippy::too_many_arguments)]
fn build_profile(
    read: CaptureRead,
    targets: &[CaptureTarget],
    opts: &EbpfHeapOptions,
    rate: u64,
    catalog: &ProcessCatalog,
    started: SystemTime,
    duration: Duration,
    stats: &EbpfHeapStats,
) -> Profile {
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
    if rate != opts.sample_bytes {
        b.comment(&format!(
            "asked for one sample per {} bytes; the node's heap sampler, shared with {} other \
             capture(s), samples at {rate}",
            opts.sample_bytes, stats.shared_with
        ));
    }
    let mut symbolizer = StackSymbolizer::new(catalog.clone());
    let mut sorted: Vec<_> = read.rows.into_iter().collect();
    sorted.sort_by_key(|(k, _)| *k);
    let mut comms: HashMap<u32, String> = HashMap::new();
    for ((target, tgid, user_stack), row) in sorted {
        let Some(t) = targets.get(target) else {
            continue;
        };
        let stack = read.stacks.get(&user_stack).map_or(&[][..], Vec::as_slice);
        let frames = symbolizer.user_frames(&mut b, tgid, stack);
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
