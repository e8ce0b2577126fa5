//! Per-process source selection for cgroup targets: every process of the
//! target cgroups is looked at once; Go programs are read by the
//! [`goruntime`](super::goruntime) source, the others by eBPF allocator
//! probes (as are Go programs with a C allocator mapped, i.e. cgo), and each
//! process no source can see is named with the reason. One profile comes
//! out, each sample labelled `heap_source`.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use flamefleet_proto::pprof::Profile;

use super::allocators::AllocatorFinder;
use super::ebpf::{EbpfCapture, EbpfHeapStats};
use super::goruntime::buckets::{DEFAULT_HELD_BYTES, HeldBudget, WalkLimits};
use super::goruntime::profile::{self as goprofile, ProcessBuckets};
use super::goruntime::{self, GoProcess};
use super::merge::{self, LabelledProfile};
use super::{HeapError, HeapProfile, HeapRequest, HeapSourceUsed, ProcessNote};
use crate::capture::window::Window;
use crate::capture::{CaptureTarget, Samplers, target_labels};
use crate::pprof::Label;
use crate::process::ProcessCatalog;
use crate::symbolize::StackSymbolizer;

/// Which sources per-process selection may use.
#[derive(Debug, Clone, Copy)]
pub struct Allowed {
    /// The Go runtime source.
    pub go: bool,
    /// eBPF allocator probes.
    pub ebpf: bool,
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn target_name(t: &CaptureTarget) -> String {
    if t.labels.pod.is_empty() {
        t.cgroup.path.display().to_string()
    } else {
        format!("{}/{}", t.labels.namespace, t.labels.pod)
    }
}

/// A heap capture of cgroup targets with the source chosen per process: the plan made at
/// its start, and the eBPF capture of the processes that need it while its window runs.
#[derive(Debug)]
pub struct ByProcess {
    targets: Vec<CaptureTarget>,
    reason: String,
    notes: Vec<ProcessNote>,
    /// Go programs to read at the end of the window, by target position.
    go: Vec<(usize, GoProcess)>,
    ebpf: Option<EbpfCapture>,
    catalog: ProcessCatalog,
}

/// Looks at every process of `targets` (all with a cgroup) once, picks its source, and
/// starts the eBPF capture when a process needs it.
pub fn start(
    samplers: &Samplers,
    req: &HeapRequest,
    targets: &[CaptureTarget],
    allowed: Allowed,
    reason: String,
) -> Result<ByProcess, HeapError> {
    let mut notes: Vec<ProcessNote> = Vec::new();
    let mut go: Vec<(usize, GoProcess)> = Vec::new();
    let mut need_ebpf = false;
    let mut any_process = false;
    let mut finder = AllocatorFinder::new();
    for (i, t) in targets.iter().enumerate() {
        let mut pids = t.cgroup.procs_recursive().unwrap_or_default();
        pids.sort_unstable();
        pids.dedup();
        for pid in pids {
            any_process = true;
            let note = |source: Option<HeapSourceUsed>, detail: String| ProcessNote {
                pid,
                comm: comm(pid),
                target: target_name(t),
                source,
                detail,
            };
            let maps_allocator = allowed.ebpf && !finder.allocators_of(pid).is_empty();
            if !allowed.go {
                // eBPF only: a Go program's own heap is invisible to it; say so.
                if let Some(version) = goruntime::go_version(pid) {
                    notes.push(note(
                        maps_allocator.then_some(HeapSourceUsed::Ebpf),
                        format!(
                            "{version} program: its Go heap does not go through malloc, so \
                             eBPF allocator probes cannot see it{}; use heap source auto or \
                             goruntime",
                            if maps_allocator {
                                " (only its C allocations)"
                            } else {
                                ""
                            }
                        ),
                    ));
                } else {
                    notes.push(note(
                        Some(HeapSourceUsed::Ebpf),
                        "eBPF allocator probes".into(),
                    ));
                }
                continue;
            }
            match goruntime::probe(pid) {
                Ok(Some(p)) => {
                    go.push((i, p));
                    // cgo: its C heap is seen by the allocator probes.
                    need_ebpf |= maps_allocator;
                }
                Ok(None) if allowed.ebpf => {
                    need_ebpf = true;
                    notes.push(note(
                        Some(HeapSourceUsed::Ebpf),
                        "not a Go program: eBPF allocator probes".into(),
                    ));
                }
                Ok(None) => notes.push(note(
                    None,
                    "not a Go program, which the goruntime source cannot read; use heap source \
                     auto or ebpf"
                        .into(),
                )),
                Err(e) => {
                    need_ebpf |= maps_allocator;
                    let also = if maps_allocator {
                        "; its C allocations are sampled by eBPF"
                    } else {
                        ""
                    };
                    notes.push(note(
                        maps_allocator.then_some(HeapSourceUsed::Ebpf),
                        format!("{e}{also}"),
                    ));
                }
            }
        }
    }
    // Asked for eBPF alone, or nothing runs yet (the probes cover processes
    // that start in the window): the probes run whatever was found.
    if allowed.ebpf && (!allowed.go || !any_process) {
        need_ebpf = true;
    }

    let ebpf = if need_ebpf {
        Some(EbpfCapture::start(samplers, targets, &req.ebpf)?)
    } else {
        None
    };
    Ok(ByProcess {
        targets: targets.to_vec(),
        reason,
        notes,
        go,
        ebpf,
        catalog: samplers.catalog().clone(),
    })
}

impl ByProcess {
    /// Reads the eBPF counts and the Go heaps and merges them into one profile.
    pub fn finish(self, req: &HeapRequest) -> Result<HeapProfile, HeapError> {
        let ebpf_result = self.ebpf.map(EbpfCapture::finish).transpose()?;
        read_and_merge(
            req,
            &self.targets,
            self.reason,
            self.notes,
            &self.go,
            ebpf_result,
            &self.catalog,
        )
    }
}

/// The eBPF window when eBPF runs; none when only Go heaps are read (a snapshot, read at
/// once).
impl Window for ByProcess {
    type Error = HeapError;

    fn deadline(&self) -> Option<Instant> {
        self.ebpf.as_ref().and_then(Window::deadline)
    }

    fn next_work(&self) -> Option<Instant> {
        self.ebpf.as_ref().and_then(Window::next_work)
    }

    fn work(&mut self) -> Result<(), HeapError> {
        match &mut self.ebpf {
            Some(e) => Ok(e.work()?),
            None => Ok(()),
        }
    }
}

/// The Go heaps (read now, at the end of the window, like an endpoint would be) and the eBPF
/// profile merged into one, each sample labelled with its source.
fn read_and_merge(
    req: &HeapRequest,
    targets: &[CaptureTarget],
    reason: String,
    mut notes: Vec<ProcessNote>,
    go: &[(usize, GoProcess)],
    ebpf_result: Option<(Profile, EbpfHeapStats)>,
    catalog: &ProcessCatalog,
) -> Result<HeapProfile, HeapError> {
    // Each process is the one found at the start (held since), and what it yields is kept
    // only while it is still in its target. What they all keep is bounded together.
    let mut parts: Vec<ProcessBuckets> = Vec::new();
    let mut comments: Vec<String> = Vec::new();
    let mut held = HeldBudget::new(DEFAULT_HELD_BYTES);
    for (i, p) in go {
        let t = &targets[*i];
        let started = Instant::now();
        let result = p
            .read(
                goruntime::DEFAULT_READ_BUDGET,
                WalkLimits::default(),
                &mut held,
            )
            .and_then(|read| {
                // Read by PID: the comm and the maps are this process's only if it still
                // lives once they are read.
                let c = comm(p.pid);
                catalog.snapshot(p.pid);
                match p.unattributable(&t.cgroup) {
                    Some(e) => Err(e),
                    None => Ok((read, c)),
                }
            });
        let took = started.elapsed();
        match result {
            Ok(((walk, bytes), c)) => {
                let detail = format!(
                    "{}{}, MemProfileRate {}, {} buckets, {bytes} bytes read in {:.1} ms, GC \
                     cycle {}{}{}",
                    p.binary.version,
                    if p.binary.from_code {
                        " (stripped: globals found from the runtime's code)"
                    } else {
                        ""
                    },
                    p.rate,
                    walk.buckets.len(),
                    took.as_secs_f64() * 1e3,
                    walk.cycle,
                    if walk.restarts > 0 {
                        format!(
                            ", read again {} times (GC completed meanwhile)",
                            walk.restarts
                        )
                    } else {
                        String::new()
                    },
                    if walk.summed_pending {
                        ", no GC cycle completed yet: pending cycles summed"
                    } else {
                        ""
                    }
                );
                comments.push(format!(
                    "heap_source goruntime: pid {} ({c}) {detail}; the heap as of the last \
                     completed GC cycle, like /debug/pprof/heap",
                    p.pid
                ));
                let mut labels = target_labels(Some(t), &req.ebpf.node);
                labels.push(Label::Num("pid".into(), i64::from(p.pid), String::new()));
                if !c.is_empty() {
                    labels.push(Label::Str("comm".into(), c.clone()));
                }
                parts.push(ProcessBuckets {
                    pid: p.pid,
                    rate: p.rate,
                    buckets: walk.buckets,
                    labels,
                });
                notes.push(ProcessNote {
                    pid: p.pid,
                    comm: c,
                    target: target_name(t),
                    source: Some(HeapSourceUsed::GoRuntime),
                    detail,
                });
            }
            Err(e) => notes.push(ProcessNote {
                pid: p.pid,
                // Read by PID: kept only if the process found still lives afterwards.
                comm: Some(comm(p.pid))
                    .filter(|_| p.process.is_alive())
                    .unwrap_or_default(),
                target: target_name(t),
                source: None,
                detail: e.to_string(),
            }),
        }
    }
    for n in notes.iter().filter(|n| n.source.is_none()) {
        comments.push(format!("unseen: pid {} ({}): {}", n.pid, n.comm, n.detail));
    }

    let mut labelled = Vec::new();
    if !parts.is_empty() {
        let mut symbolizer = StackSymbolizer::new(catalog.clone());
        symbolizer.confine_to(targets.iter().map(|t| t.cgroup.clone()));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        let mut profile = goprofile::build(&parts, &mut symbolizer, &comments, now);
        for c in symbolizer.comments("buckets") {
            let i = profile.string_table.len() as i64;
            profile.string_table.push(c);
            profile.comment.push(i);
        }
        labelled.push(LabelledProfile {
            profile,
            labels: vec![Label::Str("heap_source".into(), "goruntime".into())],
        });
    }
    let mut warnings = Vec::new();
    let mut ebpf_stats = None;
    if let Some((profile, stats)) = ebpf_result {
        if profile.sample.is_empty() {
            warnings.push(if stats.allocators.is_empty() {
                "eBPF: no allocator (malloc, jemalloc, tcmalloc, mimalloc) found to probe in the \
                 target processes, so no allocation was seen"
                    .to_owned()
            } else {
                format!(
                    "eBPF: {} allocator calls, none sampled during the window",
                    stats.calls
                )
            });
        }
        let mut profile = profile;
        if labelled.is_empty() && !comments.is_empty() {
            // Keep the unseen processes on record in an eBPF-only profile.
            for c in &comments {
                let i = profile.string_table.len() as i64;
                profile.string_table.push(c.clone());
                profile.comment.push(i);
            }
        }
        labelled.push(LabelledProfile {
            profile,
            labels: vec![Label::Str("heap_source".into(), "ebpf".into())],
        });
        ebpf_stats = Some(stats);
    }
    let served_go = !parts.is_empty();
    let source = match (served_go, ebpf_stats.is_some()) {
        (true, true) => HeapSourceUsed::Mixed,
        (true, false) => HeapSourceUsed::GoRuntime,
        (false, true) => HeapSourceUsed::Ebpf,
        (false, false) => {
            return Err(HeapError::Unseen(
                notes
                    .iter()
                    .map(|n| format!("pid {} ({}) in {}: {}", n.pid, n.comm, n.target, n.detail))
                    .collect(),
            ));
        }
    };
    let profile: Profile = merge::merge(&labelled)?;
    if profile.sample.is_empty() {
        let unseen: Vec<String> = notes
            .iter()
            .filter(|n| n.source.is_none())
            .map(|n| format!("pid {} ({}): {}", n.pid, n.comm, n.detail))
            .collect();
        warnings.push(format!(
            "no heap samples{}",
            if unseen.is_empty() {
                String::new()
            } else {
                format!("; processes no source can see: {}", unseen.join("; "))
            }
        ));
    }
    let served: Vec<String> = notes
        .iter()
        .filter_map(|n| n.source.map(|s| format!("pid {} {s}", n.pid)))
        .collect();
    Ok(HeapProfile {
        profile,
        source,
        reason: format!(
            "{reason}; per process: {}",
            if served.is_empty() {
                "none served".into()
            } else {
                served.join(", ")
            }
        ),
        ebpf_stats,
        warnings,
        processes: notes,
    })
}
