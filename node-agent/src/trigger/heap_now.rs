//! The heap capture a memory fire starts on the node, at once.
//!
//! A cgroup near its memory limit can be OOM-killed within a second: asking the operator
//! for a ProfileRequest first (agent → operator → API server → operator → agent) loses that
//! race. So a memory fire reads the Go runtime's own heap profile of the cgroup's processes
//! right away, from this node, without stopping them
//! ([`crate::capture::heap::goruntime`]); the ProfileRequest the fire becomes carries the
//! profile taken here.

use std::time::{Duration, Instant};

use crate::capture::heap::{
    self, HeapError, HeapProfile, HeapRequest, HeapSource, HeapTarget, ebpf::EbpfHeapOptions,
    endpoint::FetchLimits,
};
use crate::capture::{Samplers, TargetLabels};
use crate::cgroup::Cgroup;

/// A heap read by a memory fire, and how long it took.
#[derive(Debug)]
pub struct HeapNow {
    /// The profile.
    pub profile: HeapProfile,
    /// From the call to the profile built.
    pub took: Duration,
}

/// Reads the Go heap of every Go process of `cgroup` now.
///
/// # Errors
/// As [`heap::capture`] for the Go runtime source: no Go process, one that exited during
/// the read (the race with the OOM killer lost), an unsupported Go version.
pub fn capture_go_heap(
    samplers: &Samplers,
    cgroup: &Cgroup,
    labels: TargetLabels,
    node: &str,
) -> Result<HeapNow, HeapError> {
    let started = Instant::now();
    let request = HeapRequest {
        source: HeapSource::GoRuntime,
        targets: vec![HeapTarget {
            labels,
            cgroup: Some(cgroup.clone()),
            endpoint: None,
        }],
        ebpf: EbpfHeapOptions {
            node: node.to_owned(),
            ..Default::default()
        },
        fetch: FetchLimits::default(),
        delta_seconds: 0,
    };
    let profile = heap::capture(samplers, &request)?;
    Ok(HeapNow {
        profile,
        took: started.elapsed(),
    })
}
