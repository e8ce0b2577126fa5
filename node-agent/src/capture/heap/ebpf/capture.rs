//! One eBPF heap capture: joins the node's heap sampler, holds the probes of its targets'
//! allocators for its window, and reads back its own counts.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::profile::{CaptureRead, Rows, build_profile};
use super::sampler::{self, HeapSampler, JoinedCapture};
use super::{EbpfHeapOptions, EbpfHeapStats};
use crate::bpf::heap::types;
use crate::bpf::{from_bytes, per_cpu};
use crate::capture::heap::allocators::AllocatorFinder;
use crate::capture::heap::sampling;
use crate::capture::window::{self, Stop, Window};
use crate::capture::{CaptureError, CaptureTarget, Result, Samplers, stack_maps};
use crate::unwind::WalkStats;
use flamefleet_proto::pprof::Profile;

/// Runs one eBPF heap capture of `targets` on the node's heap sampler, for its whole
/// window, and returns the profile.
pub fn capture(
    samplers: &Samplers,
    targets: &[CaptureTarget],
    opts: &EbpfHeapOptions,
) -> Result<(Profile, EbpfHeapStats)> {
    let mut running = EbpfCapture::start(samplers, targets, opts)?;
    window::run(&mut running, &Stop::new())?;
    running.finish()
}

/// A running eBPF heap capture: its targets and the probes of their allocators held on
/// the node's heap sampler until it finishes or is dropped.
pub struct EbpfCapture {
    capture: Capture,
    sampler: Arc<HeapSampler>,
    targets: Vec<CaptureTarget>,
    opts: EbpfHeapOptions,
    stats: EbpfHeapStats,
    stats_before: [u64; 8],
    walk_before: WalkStats,
    /// Processes already snapshot and registered for this capture.
    known: HashSet<u32>,
    finder: AllocatorFinder,
    started: SystemTime,
    deadline: Instant,
    /// When the targets are next rescanned.
    next_scan: Instant,
}

impl std::fmt::Debug for EbpfCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfCapture")
            .field("targets", &self.targets)
            .finish_non_exhaustive()
    }
}

impl EbpfCapture {
    /// Joins the node's heap sampler (starting it with `opts` when none runs), holds the
    /// probes of the allocators the targets' processes map, runs the overhead guard, and
    /// tells `opts.ready`; the window of `opts.duration` starts then.
    pub fn start(
        samplers: &Samplers,
        targets: &[CaptureTarget],
        opts: &EbpfHeapOptions,
    ) -> Result<Self> {
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
        let capture = Capture(samplers.join_heap(targets, opts)?);
        let sampler = Arc::clone(&capture.0.sampler);
        let settings = sampler.settings();
        let mut stats = EbpfHeapStats {
            sample_bytes: settings.sample_bytes,
            shared_with: sampler.captures().saturating_sub(1),
            session_uprobes: settings.session_uprobes,
            ..EbpfHeapStats::default()
        };
        let (stats_before, walk_before) = {
            let shared = sampler.lock();
            (
                read_counters(&shared.maps.heap_stats)?,
                WalkStats::read(&shared.maps.unwind_stats),
            )
        };
        // Tables of the processes running now, before their first sample.
        let mut known = HashSet::new();
        sampler.tracker().track_running(targets, &mut known, true);
        let mut finder = AllocatorFinder::default();
        hold_allocators(&capture.0, &mut finder, targets, &mut stats)?;
        guard_overhead(&sampler, targets, opts, &mut stats)?;
        if let Some(ready) = &opts.ready {
            // The receiver may have gone: nothing to tell then.
            let _ = ready.try_send(());
        }
        Ok(Self {
            capture,
            sampler,
            targets: targets.to_vec(),
            opts: opts.clone(),
            stats,
            stats_before,
            walk_before,
            known,
            finder,
            started,
            deadline: Instant::now() + opts.duration,
            next_scan: Instant::now() + rescan_period(opts),
        })
    }

    /// Reads the capture's counts, leaves the sampler (targets, probes) and builds the
    /// profile.
    pub fn finish(mut self) -> Result<(Profile, EbpfHeapStats)> {
        let s = Arc::clone(&self.sampler);
        let rate = s.settings().sample_bytes;
        // Read while every probe this capture holds is still attached: detaching is not
        // atomic (each uprobe waits for an RCU grace period), and while `malloc`'s probe is
        // gone but `free`'s is not, a process that frees and allocates in a loop would have
        // all its live samples retired — an empty inuse_space, seen once in CI.
        let read = {
            let shared = s.lock();
            let now = read_counters(&shared.maps.heap_stats)?;
            apply_counters(&mut self.stats, now, self.stats_before);
            if s.tracker().unwinder().is_some() {
                self.stats.walk =
                    Some(WalkStats::read(&shared.maps.unwind_stats).since(self.walk_before));
            }
            read_capture(&shared, &self.capture.0, rate)?
        };
        drop(self.capture);
        let duration = self.started.elapsed().unwrap_or(self.opts.duration);
        let profile = build_profile(
            read,
            &self.targets,
            &self.opts,
            rate,
            s.tracker().catalog(),
            self.started,
            duration,
            &self.stats,
        );
        Ok((profile, self.stats))
    }
}

/// How often a capture looks for allocators not probed yet.
fn rescan_period(opts: &EbpfHeapOptions) -> Duration {
    opts.rescan.max(Duration::from_millis(10))
}

/// The window of `opts.duration` from the end of [`EbpfCapture::start`]: every
/// `opts.rescan` it holds the allocators of processes started meanwhile (a new container
/// image, a `dlopen`ed jemalloc) and registers new processes for symbolization.
impl Window for EbpfCapture {
    type Error = CaptureError;

    fn deadline(&self) -> Option<Instant> {
        Some(self.deadline)
    }

    fn next_work(&self) -> Option<Instant> {
        (self.next_scan < self.deadline).then_some(self.next_scan)
    }

    fn work(&mut self) -> Result<()> {
        hold_allocators(
            &self.capture.0,
            &mut self.finder,
            &self.targets,
            &mut self.stats,
        )?;
        self.sampler
            .tracker()
            .track_running(&self.targets, &mut self.known, false);
        self.next_scan = Instant::now() + rescan_period(&self.opts);
        Ok(())
    }
}

/// A capture joined to the node's sampler; leaves it (targets, probes) when dropped,
/// also on errors.
struct Capture(JoinedCapture);

impl Drop for Capture {
    fn drop(&mut self) {
        self.0.sampler.release(self.0.id, self.0.cgroups.ids());
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

/// The first window of the overhead guard (see [`crate::capture::heap::overhead`]): with
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
    let projection = crate::capture::heap::overhead::project(
        calls()?.saturating_sub(calls0),
        t0.elapsed(),
        targets_cpu(targets).saturating_sub(cpu0),
        crate::capture::heap::overhead::UPROBE_CALL_COST,
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

/// The sampler's counters (`enum heap_stat`), summed over CPUs.
fn read_counters(map: &MapHandle) -> Result<[u64; 8]> {
    let mut totals = [0u64; 8];
    for (i, total) in totals.iter_mut().enumerate() {
        *total = per_cpu::<u64>(map, i as u32)
            .map_err(|e| CaptureError::bpf("reading the heap counters", e))?
            .into_iter()
            .sum();
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

/// This capture's rows: per size class, `alloc_*` is the increase of the row's counters
/// since the capture started and `inuse_*` the live sampled allocations made since then;
/// each is scaled (the bias correction depends on the size), then summed over size classes.
fn read_capture(
    shared: &sampler::Shared,
    capture: &JoinedCapture,
    rate: u64,
) -> Result<CaptureRead> {
    // Indices nested below a target (another capture's) count for it too.
    let target_of_index = capture.cgroups.owners(&shared.table);
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
