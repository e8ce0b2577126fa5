//! The pprof of an eBPF heap capture, in Go's heap layout (`alloc_*`, `inuse_*`), scaled
//! back up like Go's.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use flamefleet_proto::pprof::Profile;

use super::{EbpfHeapOptions, EbpfHeapStats};
use crate::capture::{CaptureTarget, target_labels};
use crate::pprof::{Label, ProfileBuilder};
use crate::process::ProcessCatalog;
use crate::symbolize::StackSymbolizer;

/// Scaled values of one (target, process, stack): alloc objects, alloc
/// bytes, in-use objects, in-use bytes.
pub(super) type Row = [f64; 4];

/// Aggregation rows by (target position, process, user stack key).
pub(super) type Rows = HashMap<(usize, u32, u64), Row>;

/// What a capture read from the sampler, before symbolization.
pub(super) struct CaptureRead {
    pub(super) rows: Rows,
    /// The stacks the rows refer to, by key, leaf first.
    pub(super) stacks: HashMap<u64, Vec<u64>>,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn build_profile(
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
        .window(started, duration)
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
    // The samples come from the targets: a process without a snapshot is read now only if
    // it is still there (its PID may have gone to another process).
    symbolizer.confine_to(targets.iter().map(|t| t.cgroup.clone()));
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
    for c in symbolizer.comments("allocations") {
        b.comment(&c);
    }
    if let Some(w) = &stats.walk {
        b.comment(&w.comment());
    }
    b.build()
}
